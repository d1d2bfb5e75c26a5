"""``DPOConfig``: TRL's DPO config plus the packing fields of [`unpack_trainer.DPOTrainer`]."""

from __future__ import annotations

from dataclasses import dataclass, field

import trl


@dataclass
class DPOConfig(trl.DPOConfig):
    r"""
    [`trl.DPOConfig`] for [`unpack_trainer.DPOTrainer`]. Every TRL field keeps its meaning; these are added:

    > Parameters that control packing of preference pairs

    Args:
        packing (`bool`, *optional*, defaults to `True`):
            Run the pairs of each batch as one packed row without padding instead of TRL's padded batch of
            `2 * per_device_train_batch_size` rows (chosen rows, then rejected rows). Pairs never attend to each other
            and the loss, every logged metric and every gradient are those of TRL's padded batch. Turned off, with
            the reason logged once, for a custom `data_collator`, a vision dataset, prompt-learning PEFT, or a model
            the packing patch refuses; `False` trains exactly as `trl.DPOTrainer`. TRL's `padding_free=True` (which
            TRL 1.16 turns off) asks for the same thing.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With `packing`, run each prompt once: a pair is one segment `[prompt, chosen, rejected]` in which chosen
            and rejected both continue from the prompt (positions, attention and the first completion token's
            prediction), and never see each other. `False` packs `[prompt, chosen]` and `[prompt, rejected]` as two
            ordinary samples. With `truncation_mode="keep_end"`, a pair that is truncated is packed unshared.
    """

    packing: bool = field(
        default=True,
        metadata={"help": "Run the pairs of each batch as one packed row without padding (exact; TRL's loss)."},
    )
    prefix_sharing: bool = field(
        default=True,
        metadata={"help": "With packing, run each prompt once for its chosen and rejected completions."},
    )
