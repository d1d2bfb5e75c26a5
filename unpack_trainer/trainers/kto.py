"""``KTOTrainer``: TRL's KTO trainer on packed unpaired preference batches, each prompt once per forward.

TRL's KTO step runs four padded forwards per batch of ``B`` examples: the policy on the ``B`` rows ``[p_i, c_i]``
with gradient and on the ``B`` KL rows ``[p_i, c_{i-1}]`` without (``loss_type="kto"``), and the reference model on
both again (unless ``precompute_ref_log_probs``), every row padded to its set's longest. Here the batch carries packed
rows instead ([`unpack_trainer.data.kto.DataCollatorForPackedUnpairedPreference`]), in which each distinct prompt
appears once and its completions follow as branches:

- the policy's forward with gradient runs the main row (TRL's ``_compute_loss`` calls the model on TRL's view of the
  batch; the decoder's packed view runs the row, [`unpack_trainer.trainers.branched`]);
- the policy's KL forward (no gradient, as TRL's) runs the KL row, through ``_compute_kl_logps``; it is a row of its
  own rather than branches of the main row, where their backward would cost three times their forward
  (the data module's docstring has the arithmetic);
- the reference model (a separate ``ref_model``, or the PEFT model with its ``"ref"`` adapter / its adapters
  disabled) runs one row of the main and the KL sequences together, each distinct sequence once, and TRL's
  ``_compute_loss`` reads its log-probs as it reads precomputed ones.

TRL's ``_compute_loss`` is kept whole: the loss of both loss types, the desirable / undesirable weights, the KL
estimate (``(KL_logps - ref_KL_logps).mean()``, gathered over processes and clamped at 0), the MoE auxiliary loss and
every logged metric are TRL's, from TRL's view of the batch. ``precompute_ref_log_probs=True`` precomputes with TRL's
padded batches at ``__init__`` (the packed path is enabled right after TRL's ``__init__``) and through the packed rows
for a dataset passed to ``evaluate`` later.

Under sequence parallelism (DeepSpeed Ulysses, ``sp_size = N``) each row is cut where its forward is: the main row
(the policy with gradient) goes through DeepSpeed's data loader adapter as DPO's row does
([`PackedPairsMixin`]); the KL row (the policy in training mode, without gradient) and the reference row come from
the collator padded to a multiple of ``N`` and marked for the cut, so that a training-mode forward of them (the KL
forward; a PEFT reference) runs this process's shard and gathers the hidden states, while a separate reference model,
in evaluation mode, runs the reference row whole. TRL's loss runs on the whole batch on every process, ``1 / N`` of it
back-propagated on each; its gathered token count (``num_tokens``) is counted once. ``precompute_ref_log_probs=True``
is refused there ([`_ulysses_reason`]).

Vision-language data: TRL 1.16's KTO trains on images (its ``DataCollatorForVisionUnpairedPreference``, as the
padded collator); they pack the same way
([`unpack_trainer.data.kto.DataCollatorForPackedVisionUnpairedPreference`]): TRL's batch is the view, the main and KL
rows hold TRL's sequences (each example's images once per row, as TRL's forwards), the reference row each example's
prompt (its image tokens included) once with its completion and KL completion as branches (its images once, where
TRL's reference encodes them twice), every token's multi-axis positions read from its full sequence (the model's own
``get_rope_index``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import trl

from unpack_trainer import _trl_compat
from unpack_trainer.configs import KTOConfig
from unpack_trainer.data.kto import (
    KL_ROW_KEY,
    REF_ROW_KEY,
    DataCollatorForPackedUnpairedPreference,
    DataCollatorForPackedVisionUnpairedPreference,
)
from unpack_trainer.decision import sequence_parallel_size
from unpack_trainer.packed_seq_info import (
    INFO_KEY,
    PACKED_INPUT_IDS_KEY,
    PACKED_POSITION_IDS_KEY,
    SEQ_LENGTHS_KEY,
    SEQ_PARENTS_KEY,
    TOKEN_INDEX_KEY,
    VIEW_INDEX_KEY,
)
from unpack_trainer.trainers.branched import BranchedRun, PackedPairsMixin

__all__ = ["KTOTrainer"]

# The main row's model inputs besides the view's ``input_ids`` (what a reference forward of the main row reads).
_MAIN_ROW_KEYS = (
    PACKED_INPUT_IDS_KEY,
    PACKED_POSITION_IDS_KEY,
    SEQ_LENGTHS_KEY,
    SEQ_PARENTS_KEY,
    INFO_KEY,
    TOKEN_INDEX_KEY,
    VIEW_INDEX_KEY,
)


@dataclasses.dataclass
class KTORun(BranchedRun):
    """The run state of [`KTOTrainer`]: ``kl_row``, the packed KL row's model inputs while [`KTOTrainer._compute_loss`]
    runs a packed batch (``None`` otherwise)."""

    kl_row: dict[str, Any] | None = None


def _ulysses_reason(args: Any, shards: int) -> str | None:
    """Why a KTO run with ``args`` (a ``KTOConfig``) cannot pack exactly under DeepSpeed Ulysses with ``shards``
    processes per row, or ``None`` (what every prompt-sharing trainer needs is checked by the branched core,
    [`unpack_trainer.trainers.branched.whole_in_evaluation_reason`], and the model by
    [`unpack_trainer.trainers.sequence_parallel.refuse_model`]).

    ``precompute_ref_log_probs=True``: TRL precomputes the reference log-probs in its ``__init__``, over its own padded
    batches, which neither go through DeepSpeed's data loader adapter nor can be cut into shards: the reference model
    would run them inside Ulysses' attention wrapper, which drops a padded batch's attention mask even where it leaves
    the batch whole, and every process of a group would gather the same examples once per process.
    """
    if shards > 1 and getattr(args, "precompute_ref_log_probs", False):
        return (
            f"sequence parallelism (sp_size={shards}, DeepSpeed Ulysses) with precompute_ref_log_probs=True: TRL "
            "precomputes the reference log-probs at __init__ on its padded batches, which Ulysses' attention wrapper "
            "runs without their attention mask and which are not cut into shards; set precompute_ref_log_probs=False "
            "(the reference then scores each batch's packed reference row whole, on every process, exactly)"
        )
    return None


def _sequence_logps(model: Any, row: dict[str, Any]) -> torch.Tensor:
    """``(rows,)``: each view row's summed completion log-probs of one packed row's forward (``row``: the model inputs
    of [`unpack_trainer.data.kto.DataCollatorForPackedUnpairedPreference`], view ``labels`` included), through TRL's
    fused LM head as TRL calls it."""
    return model(**row, use_cache=False, fused_lm_head=True).log_probs.sum(-1)


class KTOTrainer(PackedPairsMixin, trl.KTOTrainer):
    """Drop-in for [`trl.KTOTrainer`]: ``from unpack_trainer import KTOTrainer``; the arguments are TRL's.

    Each batch runs as packed rows; with ``prefix_sharing`` (default) each prompt runs once per forward. The decision,
    switches, self-checks and fallbacks are those of [`PackedPairsMixin`] (and its core [`PackedTrainerMixin`], which
    documents the attributes); unshared, every sequence is packed after its own copy of its prompt.
    """

    unpack_unshared = "every sequence is packed after its own copy of its prompt"
    unpack_packs_vision = True  # image data: each image once per prompt per row (data.kto)
    unpack_sequence_parallel = True  # main row cut by the adapter, KL row (a PEFT reference too) by the packed view
    unpack_trl_collator = staticmethod(_trl_compat.kto_padded_collator_class)
    unpack_trl_vision_collator = staticmethod(_trl_compat.kto_vision_collator_class)
    unpack_config_class = KTOConfig
    unpack_packing_means = "the examples of each batch in packed rows"
    unpack_trl_methods = _trl_compat.KTO_TRAINER_METHODS
    unpack_trl_attributes = _trl_compat.KTO_TRAINER_ATTRIBUTES
    unpack_run_class = KTORun
    unpack_run: KTORun

    # ------------------------------------------------------------------------------------------------ core hooks

    def _unpack_before_init(self, model: Any, args: Any, **arguments: Any) -> Any:
        """The branched core's; under sequence parallelism set in ``args`` a run that cannot pack exactly
        ([`_ulysses_reason`]) is refused before TRL's ``__init__``, which would precompute the reference
        log-probs first (TRL's padded batches cannot run under Ulysses either)."""
        trl_args = super()._unpack_before_init(model, args, **arguments)
        if self.unpack_run.disabled or not self.unpack_decision.packed:
            return trl_args
        shards = sequence_parallel_size(getattr(trl_args, "parallelism_config", None), {})
        reason = _ulysses_reason(trl_args, shards)
        if reason is not None:
            raise ValueError(f"{self.unpack_name} cannot train under {reason}.")
        return trl_args

    def _sequence_parallel_reason(self, config: Any, shards: int) -> str | None:
        """The branched core's reason, then [`_ulysses_reason`]'s (a parallelism that reached the
        accelerator from accelerate's config file, not from ``args``)."""
        return super()._sequence_parallel_reason(config, shards) or _ulysses_reason(self.args, shards)

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """``completion`` + ``label`` (unpaired), or ``chosen`` + ``rejected`` (pairs, which TRL unpairs)."""
        return (("completion", "label"), ("chosen", "rejected"))

    def _packed_collator(
        self,
    ) -> DataCollatorForPackedUnpairedPreference | DataCollatorForPackedVisionUnpairedPreference:
        padded = self._padded_collator()
        if isinstance(padded, self.unpack_trl_vision_collator()):
            from unpack_trainer.anatomy.structure import pretrained_model
            from unpack_trainer.anatomy.vision import sequence_positions_of

            model = pretrained_model(self.accelerator.unwrap_model(self.model))
            return DataCollatorForPackedVisionUnpairedPreference(
                view_collator=padded,
                prefix_sharing=self._unpack_sharing(),
                positions=sequence_positions_of(model),
                reference=not self.precompute_ref_logps,
            )
        return DataCollatorForPackedUnpairedPreference(
            pad_token_id=padded.pad_token_id,
            max_length=padded.max_length,
            pad_to_multiple_of=padded.pad_to_multiple_of,
            prefix_sharing=self._unpack_sharing(),
            reference=not self.precompute_ref_logps,
            sequence_shards=self.unpack_run.sequence_shards,
        )

    # ------------------------------------------------------------------------------------------------ forwards

    def _compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
        """TRL's, on a packed batch: the reference log-probs from one packed reference forward, handed to TRL as
        precomputed ones (unless they are precomputed), the policy's KL log-probs from the KL row
        ([`_compute_kl_logps`]), the policy's own forward on the main row through TRL's model call. A padded batch
        (evaluation, the fallback) goes to TRL's as it is."""
        if PACKED_INPUT_IDS_KEY not in inputs:
            return super()._compute_loss(model, inputs, return_outputs)
        inputs = dict(inputs)
        kl_row = inputs.pop(KL_ROW_KEY, None)
        ref_row = inputs.pop(REF_ROW_KEY, None)
        precompute = self.precompute_ref_logps
        if not precompute:
            reference = self.ref_model if self.ref_model is not None else self.model
            ref_logps, ref_kl_logps = self._packed_reference_logps(reference, inputs, kl_row, ref_row)
            inputs["ref_logps"] = ref_logps
            if ref_kl_logps is not None:
                inputs["ref_KL_logps"] = ref_kl_logps
        self.unpack_run.kl_row = kl_row
        self.precompute_ref_logps = True  # TRL's loss reads the reference log-probs from the batch
        try:
            return super()._compute_loss(model, inputs, return_outputs)
        finally:
            self.precompute_ref_logps = precompute
            self.unpack_run.kl_row = None

    def _compute_kl_logps(self, model: Any, batch: dict[str, Any]) -> torch.Tensor | None:
        """TRL's KL log-probs ``(B,)`` (each example's prompt with its KL completion), without gradient as TRL's: from
        the packed KL row while [`_compute_loss`] runs a packed batch, TRL's padded forward otherwise."""
        row = self.unpack_run.kl_row
        if row is None or not self.calculate_KL:
            return super()._compute_kl_logps(model, batch)
        with torch.no_grad():
            return _sequence_logps(model, row)

    def compute_ref_log_probs(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """TRL's ``(completion_logps (B,), KL_logps (B,) or None)`` of one batch under the reference; a packed batch
        through its packed rows ([`_packed_reference_logps`], e.g. precomputing an evaluation set passed to
        ``evaluate``), a padded one through TRL's."""
        if PACKED_INPUT_IDS_KEY not in inputs:
            return super().compute_ref_log_probs(model, inputs)
        with self.accelerator.autocast():
            return self._packed_reference_logps(model, inputs, inputs.get(KL_ROW_KEY), inputs.get(REF_ROW_KEY))

    def _packed_reference_logps(
        self, model: Any, inputs: dict[str, Any], kl_row: dict[str, Any] | None, ref_row: dict[str, Any] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's summed completion log-probs of the main sequences ``(B,)`` and, with a KL term, of the KL
        sequences ``(B,)`` (else ``None``), in TRL's reference context ([`_trl_compat.reference_forward_context`]):
        one forward of the reference row when the batch has it (main rows, then KL rows), else the main row and the KL
        row each."""
        rows = inputs["label"].shape[0]
        with _trl_compat.reference_forward_context(self):
            if ref_row is not None:
                logps = _sequence_logps(model, ref_row)
                return logps[:rows], (logps[rows:] if self.calculate_KL else None)
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            main_row = {key: inputs[key] for key in _MAIN_ROW_KEYS if key in inputs}
            main = _sequence_logps(model, {"input_ids": inputs["input_ids"], "labels": labels, **main_row})
            if not self.calculate_KL or kl_row is None:
                return main, None
            return main, _sequence_logps(model, kl_row)
