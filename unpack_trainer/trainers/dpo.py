"""``DPOTrainer``: TRL's DPO trainer on packed preference batches, prompts shared by their two completions.

What differs from SFT is the batch: TRL's ``_compute_loss`` is kept whole (the loss of every ``loss_type`` and lists
with ``loss_weights``, ``ld_alpha``, ``use_weighting``, ``f_divergence_type``, label smoothing, the MoE auxiliary
loss and every logged metric are TRL's, from TRL's view of the batch); the batch also carries the packed row
([`unpack_trainer.preference.DataCollatorForPackedPreference`]), which the model-side pieces of
[`unpack_trainer.trainers.branched`] run in place of the view, on the policy and on the reference model (a separate
``ref_model``, or the PEFT model with its adapter disabled). ``precompute_ref_log_probs=True`` precomputes with TRL's
padded batches at ``__init__`` (the packed path is enabled right after TRL's ``__init__``) and through the packed path
for a dataset passed to ``evaluate`` later.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import trl

from unpack_trainer import _trl_compat
from unpack_trainer.dpo_config import DPOConfig
from unpack_trainer.preference import DataCollatorForPackedPreference
from unpack_trainer.trainers.branched import BranchedTrainerMixin

__all__ = ["DPOTrainer"]


class DPOTrainer(BranchedTrainerMixin, trl.DPOTrainer):
    """Drop-in for [`trl.DPOTrainer`]: ``from unpack_trainer import DPOTrainer``; the arguments are TRL's.

    The pairs of each batch run as one packed row; with ``prefix_sharing`` (default) each prompt runs once for both
    completions. The decision, switches, self-checks and fallbacks are those of [`BranchedTrainerMixin`] (and its
    core [`PackedTrainerMixin`], which documents the attributes); unshared, a pair is packed as ``[prompt, chosen]``
    and ``[prompt, rejected]``.
    """

    unpack_config_class = DPOConfig
    unpack_trl_class = trl.DPOTrainer
    unpack_name = "DPOTrainer"
    unpack_unshared = "each pair is packed as [prompt, chosen] and [prompt, rejected]"
    _unpack_trl_methods = _trl_compat.DPO_TRAINER_METHODS
    _unpack_trl_attributes = _trl_compat.DPO_TRAINER_ATTRIBUTES

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        args = self._unpack_before_init(
            model,
            args,
            data_collator=data_collator,
            processing_class=processing_class,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            has_metrics=compute_metrics is not None,
        )
        if self.unpack_decision.mode == "pack":
            self.unpack_decision = dataclasses.replace(
                self.unpack_decision, reason="packing=True: the pairs of each batch in one packed row"
            )
        super().__init__(
            model,
            ref_model,
            args,
            data_collator,
            train_dataset,
            eval_dataset,
            processing_class,
            compute_metrics,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
        )
        self._unpack_after_init(train_dataset, eval_dataset)

    # ------------------------------------------------------------------------------------------------ core hooks

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """``chosen`` + ``rejected`` (an explicit ``prompt`` column, or a prompt implicit in both)."""
        return (("chosen", "rejected"),)

    def _packed_collator(self) -> DataCollatorForPackedPreference:
        padded = self._padded_collator()
        return DataCollatorForPackedPreference(
            pad_token_id=padded.pad_token_id,
            max_length=padded.max_length,
            truncation_mode=padded.truncation_mode,
            pad_to_multiple_of=padded.pad_to_multiple_of,
            prefix_sharing=self._unpack_sharing(),
        )

    def _padded_collator(self) -> Any:
        collator = getattr(self, "_unpack_padded_collator", None)
        if collator is None:
            collator = self._unpack_padded_collator = self.data_collator  # TRL's, as its __init__ built it
            if not isinstance(collator, _trl_compat.dpo_padded_collator_class()):
                raise TypeError(f"DPOTrainer expected TRL's preference collator, found {type(collator).__name__}")
        return collator

    def _unpack_stop_sharing(self) -> None:
        self.data_collator = self._packed_collator()

    def _enable_packed_path(self) -> None:
        self._padded_collator()  # keep TRL's collator before the core replaces it
        super()._enable_packed_path()
