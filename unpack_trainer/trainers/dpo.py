"""``DPOTrainer``: TRL's DPO trainer on packed preference batches, prompts shared by their two completions.

TRL's ``_compute_loss`` is kept whole: the loss of every ``loss_type`` (and lists with ``loss_weights``), ``ld_alpha``,
``use_weighting``, ``f_divergence_type``, label smoothing, the MoE auxiliary loss and every logged metric are computed
by TRL's code from TRL's padded view of the batch. What changes is what the model runs: the batch also carries the
packed row ([`unpack_trainer.preference.DataCollatorForPackedPreference`]), and a hook on the decoder
([`unpack_trainer.preference.install_packed_view`]) runs that row and returns the last hidden state in the view's
layout, so TRL's fused LM head and loss read the same per-token values as from the padded batch. The reference model
(a separate ``ref_model``, the PEFT model with its adapter disabled, or ``precompute_ref_log_probs=True``) runs the
same packed row.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Any

import trl
from accelerate.utils import is_peft_model

from unpack_trainer._logging import log_once
from unpack_trainer.decision import env_flag
from unpack_trainer.dpo_config import DPOConfig
from unpack_trainer.preference import DataCollatorForPackedPreference, install_packed_view

__all__ = ["DPOTrainer"]

logger = logging.getLogger("unpack_trainer")


def _as_our_config(args: Any) -> DPOConfig:
    """A plain ``trl.DPOConfig`` (or any ``TrainingArguments``) as our [`DPOConfig`]: shared fields copied (tokens
    included), ours at their documented defaults."""
    if isinstance(args, DPOConfig):
        return args
    values = args.to_dict()
    for name in values:
        if name.endswith("_token"):  # to_dict hides tokens
            values[name] = getattr(args, name)
    names = {f.name for f in dataclasses.fields(DPOConfig) if f.init}
    return DPOConfig(**{name: value for name, value in values.items() if name in names})


def _blocked_reason(
    model: Any, args: DPOConfig, data_collator: Any, processing_class: Any, train_dataset: Any, peft_config: Any
) -> str | None:
    """Why these pairs cannot be packed exactly (``None`` when they can): the SFT trainer's checks
    ([`unpack_trainer.decision.blocked_reason`]: custom collator, processor, images, vision / encoder-decoder model,
    blocklist, prompt-learning PEFT, a model the patch refuses), before TRL's ``__init__``."""
    from unpack_trainer.decision import blocked_reason
    from unpack_trainer.models import BLOCKLIST

    if isinstance(model, str):
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(model, trust_remote_code=args.trust_remote_code)
    else:
        model_config = model.config
    if peft_config is None and not isinstance(model, str):
        peft_config = getattr(model, "peft_config", None)
    return blocked_reason(
        model_config=model_config,
        data_collator=data_collator,
        processing_class=processing_class,
        dataset_sample=next(iter(train_dataset)) if train_dataset is not None else None,
        blocklist=BLOCKLIST,
        peft_config=peft_config,
    )


class DPOTrainer(trl.DPOTrainer):
    """[`trl.DPOTrainer`] whose batches are packed (see the module docstring); the arguments are TRL's.

    ``args`` may be our [`DPOConfig`] or a plain ``trl.DPOConfig`` (converted, our fields at their defaults).
    ``UNPACK_DISABLE=1`` makes the class behave exactly as ``trl.DPOTrainer``.

    Attributes:
        unpack_packed (`bool`): whether batches are packed.
        unpack_reason (`str`): why (or why not), logged once at ``__init__``.
        unpack_selfcheck (`ContaminationReport` or `None`): the self-check's result (``None`` when nothing is packed).
    """

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
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "name_or_path", None) or "model"
            args = DPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-DPO")
        args = _as_our_config(args)
        requested = bool(args.packing or args.padding_free)
        reason = None
        if env_flag(os.environ, "UNPACK_DISABLE"):
            reason = "UNPACK_DISABLE=1"
        elif not requested:
            reason = "packing=False"
        else:
            reason = _blocked_reason(model, args, data_collator, processing_class, train_dataset, peft_config)
        self.unpack_packed = reason is None
        self.unpack_reason = (
            "packed pairs" + (", prefix shared" if args.prefix_sharing else "")
            if reason is None
            else f"padded batches: {reason}"
        )
        if reason is not None and requested and reason != "UNPACK_DISABLE=1":
            log_once(logger, logging.WARNING, f"DPOTrainer: packing turned off: {reason}.")
        self._unpack_ready = False
        self.unpack_selfcheck = None
        trl_args = copy.copy(args)
        trl_args.padding_free = False  # TRL 1.16 turns it off with a warning; the packed path replaces it
        super().__init__(
            model,
            ref_model,
            trl_args,
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
        if self.unpack_packed:
            self._enable_packed_path()
        log_once(logger, logging.INFO, f"DPOTrainer: {self.unpack_reason}.")

    def _enable_packed_path(self) -> None:
        """Swap in the packed collator, patch the policy and the reference model, and hook their decoders; once."""
        if self._unpack_ready:
            return
        self._unpack_ready = True
        from unpack_trainer.models import patch_model

        stock = self._unpack_stock_collator = self.data_collator
        packed = DataCollatorForPackedPreference(
            pad_token_id=stock.pad_token_id,
            max_length=stock.max_length,
            truncation_mode=stock.truncation_mode,
            pad_to_multiple_of=stock.pad_to_multiple_of,
            prefix_sharing=self.args.prefix_sharing,
        )
        for model in (self.model, self.ref_model):
            if model is None:
                continue
            model = self.accelerator.unwrap_model(model)
            patch_model(model)
            pretrained = model.get_base_model() if is_peft_model(model) else model
            install_packed_view(pretrained.base_model)
        if self._unpack_self_check():
            self.data_collator = packed

    def _unpack_self_check(self) -> bool:
        """The contamination self-check on the patched policy, before any packed batch (the reference log-probs
        precomputed at ``__init__`` included); on failure, batches stay TRL's padded ones (``UNPACK_STRICT=1``:
        raise)."""
        from unpack_trainer.selfcheck import check_uncontaminated

        report = check_uncontaminated(self.model, measure_contamination=False)
        self.unpack_selfcheck = report
        if report.ok:
            log_once(logger, logging.INFO, f"Contamination self-check passed: {report.summary()}")
            return True
        message = f"Contamination self-check failed ({report.summary()}); training on padded batches instead"
        if env_flag(os.environ, "UNPACK_STRICT"):
            raise RuntimeError(message + " (UNPACK_STRICT=1)")
        log_once(logger, logging.ERROR, message)
        self.unpack_packed = False
        self.unpack_reason = f"padded batches: contamination self-check failed ({report.summary()})"
        return False

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        # TRL precomputes inside its __init__; the packed path is in place from the first precomputed batch.
        if self.unpack_packed:
            self._enable_packed_path()
        return super()._precompute_ref_logps(dataset, name, batch_size)
