"""``DPOTrainer``: TRL's DPO trainer on packed preference batches, prompts shared by their two completions.

What differs from SFT is the batch: TRL's ``_compute_loss`` is kept whole (the loss of every ``loss_type`` and lists
with ``loss_weights``, ``ld_alpha``, ``use_weighting``, ``f_divergence_type``, label smoothing, the MoE auxiliary
loss and every logged metric are TRL's, from TRL's view of the batch); the batch also carries the packed row
([`unpack_trainer.data.preference.DataCollatorForPackedPreference`]), which the model-side pieces of
[`unpack_trainer.trainers.branched`] run in place of the view, on the policy and on the reference model (a separate
``ref_model``, or the PEFT model with its adapter disabled). ``precompute_ref_log_probs=True`` precomputes with TRL's
padded batches at ``__init__`` (the packed path is enabled right after TRL's ``__init__``) and through the packed path
for a dataset passed to ``evaluate`` later.

Image preference pairs on a vision-language model (TRL's ``DataCollatorForVisionPreference`` as the padded collator)
pack the same way ([`unpack_trainer.data.preference.DataCollatorForPackedVisionPreference`]): TRL's batch is the view,
each prompt with its image tokens once on the packed row, each image encoded once per pair, every token's multi-axis
positions read from its full sequence (the model's own ``get_rope_index``).
"""

from __future__ import annotations

from typing import Any

import trl

from unpack_trainer import _trl_compat
from unpack_trainer.configs import DPOConfig
from unpack_trainer.data.preference import DataCollatorForPackedPreference, DataCollatorForPackedVisionPreference
from unpack_trainer.trainers.branched import PackedPairsMixin

__all__ = ["DPOTrainer"]


class DPOTrainer(PackedPairsMixin, trl.DPOTrainer):
    """Drop-in for [`trl.DPOTrainer`]: ``from unpack_trainer import DPOTrainer``; the arguments are TRL's.

    The pairs of each batch run as one packed row; with ``prefix_sharing`` (default) each prompt runs once for both
    completions. The decision, switches, self-checks and fallbacks are those of [`PackedPairsMixin`] (and its
    core [`PackedTrainerMixin`], which documents the attributes); unshared, a pair is packed as ``[prompt, chosen]``
    and ``[prompt, rejected]``.
    """

    unpack_unshared = "each pair is packed as [prompt, chosen] and [prompt, rejected]"
    unpack_packs_vision = True  # image preference pairs: each image once per pair (data.preference)
    unpack_sequence_parallel = True  # the packed row cut by DeepSpeed Ulysses, the hidden states gathered for the view
    unpack_trl_collator = staticmethod(_trl_compat.dpo_padded_collator_class)
    unpack_trl_vision_collator = staticmethod(_trl_compat.dpo_vision_collator_class)
    unpack_config_class = DPOConfig
    unpack_packing_means = "the pairs of each batch in one packed row"
    unpack_trl_methods = _trl_compat.DPO_TRAINER_METHODS
    unpack_trl_attributes = _trl_compat.DPO_TRAINER_ATTRIBUTES

    # ------------------------------------------------------------------------------------------------ core hooks

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """``chosen`` + ``rejected`` (an explicit ``prompt`` column, or a prompt implicit in both)."""
        return (("chosen", "rejected"),)

    def _packed_collator(self) -> DataCollatorForPackedPreference | DataCollatorForPackedVisionPreference:
        padded = self._padded_collator()
        if isinstance(padded, self.unpack_trl_vision_collator()):
            from unpack_trainer.anatomy.structure import pretrained_model
            from unpack_trainer.anatomy.vision import sequence_positions_of

            model = pretrained_model(self.accelerator.unwrap_model(self.model))
            return DataCollatorForPackedVisionPreference(
                view_collator=padded, prefix_sharing=self._unpack_sharing(), positions=sequence_positions_of(model)
            )
        return DataCollatorForPackedPreference(
            pad_token_id=padded.pad_token_id,
            max_length=padded.max_length,
            truncation_mode=padded.truncation_mode,
            pad_to_multiple_of=padded.pad_to_multiple_of,
            prefix_sharing=self._unpack_sharing(),
        )
