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


def _blocked_reason(model: Any, args: DPOConfig, data_collator: Any, train_dataset: Any) -> str | None:
    """Why these pairs cannot be packed exactly (``None`` when they can), checked before TRL's ``__init__``."""
    from unpack_trainer.models import refusal_reason

    if data_collator is not None:
        return "a custom `data_collator` is set; remove it to pack"
    sample = next(iter(train_dataset)) if train_dataset is not None else {}
    if "image" in sample or "images" in sample:
        return "vision datasets are not packed"
    peft_config = getattr(model, "peft_config", None) if not isinstance(model, str) else None
    for config in (peft_config or {}).values() if isinstance(peft_config, dict) else []:
        if getattr(config, "is_prompt_learning", False):
            return "prompt-learning PEFT adds virtual tokens to every sequence"
    if not isinstance(model, str):
        return refusal_reason(model.config)
    return None


class DPOTrainer(trl.DPOTrainer):
    """[`trl.DPOTrainer`] whose batches are packed (see the module docstring); the arguments are TRL's.

    ``args`` may be our [`DPOConfig`] or a plain ``trl.DPOConfig`` (converted, our fields at their defaults).
    ``UNPACK_DISABLE=1`` makes the class behave exactly as ``trl.DPOTrainer``.

    Attributes:
        unpack_packed (`bool`): whether batches are packed.
        unpack_reason (`str`): why (or why not), also logged once when training starts.
    """

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, *pos: Any, **kwargs: Any) -> None:
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
            reason = _blocked_reason(model, args, data_collator, train_dataset)
        self.unpack_packed = reason is None
        self.unpack_reason = "packed pairs" + (", prefix shared" if args.prefix_sharing else "") if reason is None \
            else f"padded batches: {reason}"
        if reason is not None and requested and reason != "UNPACK_DISABLE=1":
            log_once(logger, logging.WARNING, f"DPOTrainer: packing turned off: {reason}.")
        self._unpack_ready = False
        trl_args = copy.copy(args)
        trl_args.padding_free = False  # TRL 1.16 turns it off with a warning; the packed path replaces it
        super().__init__(model, ref_model, trl_args, data_collator, train_dataset, *pos, **kwargs)
        if self.unpack_packed:
            self._enable_packed_path()
        log_once(logger, logging.INFO, f"DPOTrainer: {self.unpack_reason}.")

    def _enable_packed_path(self) -> None:
        """Swap in the packed collator, patch the policy and the reference model, and hook their decoders; once."""
        if self._unpack_ready:
            return
        from unpack_trainer.models import patch_model

        stock = self.data_collator
        self.data_collator = DataCollatorForPackedPreference(
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
        self._unpack_ready = True

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        # TRL precomputes inside its __init__; the packed path is in place from the first precomputed batch.
        if self.unpack_packed:
            self._enable_packed_path()
        return super()._precompute_ref_logps(dataset, name, batch_size)
