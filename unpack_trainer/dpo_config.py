"""``DPOConfig``: TRL's DPO config with ``padding_free`` left unset by default, so the trainer can decide, and
``prefix_sharing``."""

from __future__ import annotations

from dataclasses import dataclass, field

import trl


@dataclass
class DPOConfig(trl.DPOConfig):
    r"""
    [`trl.DPOConfig`] for [`unpack_trainer.DPOTrainer`]. Every TRL field keeps its meaning; these differ or are added:

    > Parameters that control packing of preference pairs

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether to run the pairs of each batch as one packed row without padding, instead of TRL's padded batch of
            `2 * per_device_train_batch_size` rows (chosen rows, then rejected rows). Pairs never attend to each other,
            and the loss, every logged metric and every gradient are those of TRL's padded batch. `None` lets the
            trainer decide: it turns it on when the model, collator and data allow it and logs why (set
            `UNPACK_DISABLE_AUTO_PADDING_FREE=1` to keep padded batches); it stays off for a custom `data_collator`,
            a vision dataset, prompt-learning PEFT or a model the packing patch refuses. `False` is never overridden
            and trains exactly as `trl.DPOTrainer` (TRL 1.16 turns its own `padding_free=True` off).
        packing (`bool`, *optional*, defaults to `False`):
            Asks for the packed rows explicitly (logged as a request if it cannot be honoured). Pairs are packed per
            batch, as with `padding_free`: each optimizer step keeps TRL's number of pairs, over which its loss is a
            mean.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run each prompt once: a pair is one segment `[prompt, chosen, rejected]` in which chosen
            and rejected both continue from the prompt (positions, attention, and the first completion token's
            prediction from the prompt's last token) and never see each other. `False` packs `[prompt, chosen]` and
            `[prompt, rejected]` as two ordinary samples. With `truncation_mode="keep_end"`, a truncated pair is
            packed unshared.
    """

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Run the pairs of each batch as one packed row without padding (exact: TRL's loss and metrics). "
            "None (default) lets the trainer decide and log why; False is never overridden."
        },
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Ask for packed rows explicitly (pairs are packed per batch, as with padding_free)."},
    )
    prefix_sharing: bool = field(
        default=True,
        metadata={"help": "With packed rows, run each prompt once for its chosen and rejected completions."},
    )
