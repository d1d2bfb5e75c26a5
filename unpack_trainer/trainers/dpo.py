"""``DPOTrainer``: TRL's DPO trainer on packed preference batches, prompts shared by their two completions.

The packed-trainer core ([`unpack_trainer.trainers._packed.PackedTrainerMixin`]) decides (the same automatic
padding-free decision, blocklist, environment switches, self-check and padded fallback as SFT); this file adds what
differs for preference pairs. TRL's ``_compute_loss`` is kept whole: the loss of every ``loss_type`` (and lists with
``loss_weights``), ``ld_alpha``, ``use_weighting``, ``f_divergence_type``, label smoothing, the MoE auxiliary loss
and every logged metric are computed by TRL's code from TRL's view of the batch. What changes is what the model runs:
the batch also carries the packed row ([`unpack_trainer.preference.DataCollatorForPackedPreference`]), and a hook on
the decoder ([`unpack_trainer.preference.install_packed_view`]) runs that row and returns its last hidden state in
the view's layout, so TRL's fused LM head and loss read the per-token values of the padded batch. The reference model
(a separate ``ref_model``, the PEFT model with its adapter disabled) runs the same packed row;
``precompute_ref_log_probs=True`` precomputes with TRL's padded batches at ``__init__`` (the packed path is enabled
right after TRL's ``__init__``) and through the packed path for a dataset passed to ``evaluate`` later.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import trl
from accelerate.utils import is_peft_model

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.dpo_config import DPOConfig
from unpack_trainer.preference import DataCollatorForPackedPreference, install_compact_lm_head, install_packed_view
from unpack_trainer.selfcheck import ContaminationReport, check_uncontaminated
from unpack_trainer.trainers._packed import PackedTrainerMixin

__all__ = ["DPOTrainer"]

logger = logging.getLogger("unpack_trainer")


class DPOTrainer(PackedTrainerMixin, trl.DPOTrainer):
    """Drop-in for [`trl.DPOTrainer`]: ``from unpack_trainer import DPOTrainer``; the arguments are TRL's.

    With ``padding_free`` unset (our [`DPOConfig`]'s default; a plain ``trl.DPOConfig`` is converted to it) the pairs
    of each batch run as one packed row whenever the model, collator and data allow it, and the decision is logged
    once with its reason; ``padding_free=False`` trains exactly as TRL. ``UNPACK_DISABLE=1`` makes the class behave
    exactly as ``trl.DPOTrainer``. With ``prefix_sharing`` (default) each prompt runs once for both completions.

    The self-check runs the plain probe of [`check_uncontaminated`] and, when prompts are shared, the branched one
    (``branched=True``: a prompt and its two completions against each ``[prompt; completion]`` alone). If the plain
    probe fails, training falls back to TRL's padded batches; if only the branched one fails, to the narrowest
    fallback: pairs still packed, unshared (``[prompt, chosen]`` and ``[prompt, rejected]``); each logged once with
    the measured difference (``UNPACK_STRICT=1`` raises instead).

    Attributes:
        unpack_decision (`PackingDecision`): what was decided and why (after a failed self-check: ``"padded"``).
        unpack_selfcheck (`ContaminationReport` or `None`): the self-check's result, once training or evaluation has
            started (``None`` before, and when nothing is packed).
        unpack_selfcheck_branched (`ContaminationReport` or `None`): the branched probe's result, once training or
            evaluation has started with prompts shared (``None`` before, and when no prompt is shared).
    """

    unpack_config_class = DPOConfig
    unpack_trl_class = trl.DPOTrainer
    unpack_name = "DPOTrainer"
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
        self.unpack_selfcheck_branched: ContaminationReport | None = None
        self._unpack_sharing_failed = False
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

    def _packed_collator(self) -> DataCollatorForPackedPreference:
        padded = self._padded_collator()
        sharing = self.args.prefix_sharing and not self._unpack_sharing_failed and self._stateful_mixer() is None
        return DataCollatorForPackedPreference(
            pad_token_id=padded.pad_token_id,
            max_length=padded.max_length,
            truncation_mode=padded.truncation_mode,
            pad_to_multiple_of=padded.pad_to_multiple_of,
            prefix_sharing=sharing,
        )

    def _unpack_check_before_first_batch(self) -> None:
        """The core's self-check, then (with prompts shared) the branched probe; if that fails, the pairs are packed
        unshared from the first batch on."""
        first = not self._unpack_checked
        super()._unpack_check_before_first_batch()
        if not (first and self.unpack_decision.packed and getattr(self.data_collator, "prefix_sharing", False)):
            return
        report = check_uncontaminated(self.model, branched=True, measure_contamination=False)
        self.unpack_selfcheck_branched = report
        if report.ok:
            log_once(logger, logging.INFO, f"Self-check of shared prompts passed: {report.summary()}")
            return
        message = (
            f"Self-check of shared prompts failed ({report.failure()}): on this model a completion packed after its "
            "shared prompt does not give what [prompt; completion] gives alone, so prefix sharing is off; each pair "
            "is packed as [prompt, chosen] and [prompt, rejected] (the plain packed self-check passed). Set "
            "prefix_sharing=False to silence this"
        )
        self._unpack_self_check_failed(message)
        self._unpack_sharing_failed = True
        self.data_collator = self._packed_collator()

    def _stateful_mixer(self) -> str | None:
        """The class name of a token mixer of the model that carries state along the sequence (a convolution or a
        recurrent scan), logged once when it turns prefix sharing off; ``None`` when there is none. Such mixers run
        per sample on packed rows, so a branch could not continue its prompt's state: the pairs are packed unshared."""
        if not self.args.prefix_sharing:
            return None
        from unpack_trainer.patches.mixers import mixer_kind

        for module in self.model.modules():
            if mixer_kind(module) is not None:
                name = type(module).__name__
                log_once(
                    logger,
                    logging.WARNING,
                    f"DPOTrainer: prefix_sharing is off for this model: its token mixer {name} carries state along "
                    "the sequence and runs per sample on packed rows, so a completion cannot continue its prompt's "
                    "state; each pair is packed as [prompt, chosen] and [prompt, rejected] (exact, without sharing). "
                    "Set prefix_sharing=False to silence this.",
                )
                return name
        return None

    def _padded_collator(self) -> Any:
        collator = getattr(self, "_unpack_padded_collator", None)
        if collator is None:
            collator = self._unpack_padded_collator = self.data_collator  # TRL's, as its __init__ built it
            if not isinstance(collator, _trl_compat.dpo_padded_collator_class()):
                raise TypeError(f"DPOTrainer expected TRL's preference collator, found {type(collator).__name__}")
        return collator

    def _prepare_padded_datasets(self, raw_train: Any, raw_eval: Any) -> None:
        """Nothing to do: padded and packed batches are made from the same tokenized pairs."""

    def _count_samples(self, batch: dict[str, Any]) -> int:
        return int(batch["completion_mask"].shape[0]) // 2  # pairs: chosen rows, then rejected rows

    def _check_sample_loss(self) -> None:
        raise ValueError(
            "loss_normalization='sample' is not supported by DPOTrainer: TRL's DPO loss is already a mean over pairs."
        )

    def _enable_packed_path(self) -> None:
        """The core's (packed collator, patched policy), and the reference model patched too, and both decoders
        hooked to run packed preference batches, their fused LM heads scoring only the labelled positions
        ([`install_compact_lm_head`]). Branched segments need the patch, so an unverified model type is
        patched as well (the self-check guards it)."""
        from unpack_trainer.models import patch_model

        self._padded_collator()  # keep TRL's collator before the core replaces it
        if not self.unpack_decision.patch:
            self.unpack_decision = dataclasses.replace(self.unpack_decision, patch=True)
        super()._enable_packed_path()
        for model in (self.model, self.ref_model):
            if model is None:
                continue
            model = self.accelerator.unwrap_model(model)
            patch_model(model)
            pretrained = model.get_base_model() if is_peft_model(model) else model
            install_packed_view(pretrained.base_model)
            install_compact_lm_head(pretrained)
