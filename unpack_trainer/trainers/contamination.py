"""A trainer's contamination self-check: run once on the model as it will train, right before the first data loader
is built, and its failure handled (``UNPACK_STRICT=1`` raises; otherwise logged, and the run falls back to padded
batches). The check itself is the package's ([`unpack_trainer.selfcheck.check_uncontaminated`]: packed samples give
what each gives alone); this module runs it for a trainer.

The core's ``_unpack_check_before_first_batch`` hook is [`check_before_first_batch`]; trainers that check more (the
branched probe of shared prompts, a distillation teacher) extend the hook and report their own failures through
[`self_check_failed`].
"""

from __future__ import annotations

import logging
import os
from typing import Any

from unpack_trainer._logging import log_once
from unpack_trainer.decision import env_flag
from unpack_trainer.selfcheck import check_uncontaminated
from unpack_trainer.trainers.start_line import attention_backend

__all__ = ["check_before_first_batch", "self_check_failed"]

logger = logging.getLogger("unpack_trainer")


def check_before_first_batch(trainer: Any) -> None:
    """Run the contamination self-check once, on ``trainer.model`` as it is when its first data loader is built
    (``train()`` has applied liger kernels, loaded a checkpoint, ... by then), in the precision training runs it
    (the trainer's ``_unpack_training_precision``), its report in ``trainer.unpack_selfcheck``; fall back to padded
    batches before any batch is drawn if it fails. Nothing once it has run, or when nothing is packed."""
    run = trainer.unpack_run
    if run.checked:
        return
    run.checked = True
    with trainer._unpack_training_precision():
        report = check_uncontaminated(trainer.model, measure_contamination=False)
    run.selfcheck = report
    if report.ok:
        if not report.conclusive:
            log_once(logger, logging.WARNING, f"Self-check inconclusive on this model: {report.summary()}")
        log_once(logger, logging.INFO, f"Contamination self-check passed: {report.summary()}")
        if getattr(trainer.args, "use_liger_kernel", False):
            _log_liger_note(trainer)
        return
    what = report.failure()
    self_check_failed(f"Contamination self-check failed ({what}); training padded instead")
    trainer._fall_back_to_padded(f"contamination self-check failed: {what}")


def self_check_failed(message: str) -> None:
    """A failed self-check, before its fallback: raise ``message`` under ``UNPACK_STRICT=1``, else log it once as an
    error."""
    if env_flag(os.environ, "UNPACK_STRICT"):
        raise RuntimeError(message + " (UNPACK_STRICT=1)")
    log_once(logger, logging.ERROR, message)


def _log_liger_note(trainer: Any) -> None:
    """With ``use_liger_kernel=True`` (Liger's kernels applied by now): one line on whose RoPE, per-token kernels,
    attention and loss run ([`unpack_trainer.trainers.liger.liger_note`])."""
    from accelerate.utils import is_peft_model

    from unpack_trainer.trainers.liger import liger_note

    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if is_peft_model(model) else model
    attention = attention_backend(model, trainer.unpack_decision.patch, trainer.args)
    note = liger_note(model, attention=attention, loss_kernel=getattr(trainer, "unpack_loss_kernel", None))
    log_once(logger, logging.INFO, f"{trainer.unpack_name}: {note}")
