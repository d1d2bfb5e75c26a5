"""What a trainer run checks of the parallelism it runs under, once the accelerator exists: packed rows another
engine would split are refused or given up for padded batches, and under sequence parallelism (DeepSpeed Ulysses) what
the run and its model must hold for a row cut into shards to stay exact.

The core calls [`check_parallelism`] after TRL's ``__init__`` and [`refuse_unpatched`] / [`refuse_model`] when it
enables the packed path; a trainer adds its own reasons through its ``_sequence_parallel_reason`` hook, whose default
is [`run_reason`].
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from unpack_trainer._logging import log_once
from unpack_trainer.decision import (
    explicit_padding_free,
    parallelism_reason,
    parallelism_refusal,
    sequence_parallel_size,
)

__all__ = [
    "check_parallelism",
    "evaluation_mode_reason",
    "refuse_model",
    "refuse_or_pad",
    "refuse_unpatched",
    "run_reason",
]

logger = logging.getLogger("unpack_trainer")


def _ulysses(shards: int) -> str:
    return f"sequence parallelism (sp_size={shards}, DeepSpeed Ulysses)"


def check_parallelism(trainer: Any) -> None:
    """The parallelism ``trainer``'s accelerator was built with, checked again (an accelerate config file reaches it
    without ``args.parallelism_config``): packed rows it would split are refused (``ValueError``) when asked for,
    and the automatic choice falls back to padded batches, logged with the reason ([`refuse_or_pad`]). Under sequence
    parallelism in a trainer that packs there, what the run must hold for its rows to stay exact (the trainer's
    ``_sequence_parallel_reason``), and the shards the collator cuts rows for (``unpack_run.sequence_shards``)."""
    config = getattr(trainer.accelerator, "parallelism_config", None)
    reason = parallelism_reason(config, {}, sequence_parallel=trainer.unpack_sequence_parallel)
    shards = sequence_parallel_size(config, {}) if reason is None else 1
    if reason is None and shards > 1:
        reason = trainer._sequence_parallel_reason(config, shards)
    if reason is not None:
        refuse_or_pad(trainer, reason)
        return
    trainer.unpack_run.sequence_shards = shards
    if shards > 1:
        trainer.unpack_decision = dataclasses.replace(
            trainer.unpack_decision,
            reason=f"{trainer.unpack_decision.reason}; {_ulysses(shards)}: each row cut into that many shards, every "
            "shard's attention given the whole row's sample boundaries",
        )


def refuse_or_pad(trainer: Any, reason: str) -> None:
    """``reason`` rules packed rows out: an explicit ``packing=True`` / ``padding_free=True`` is refused
    (``ValueError``), the automatic padding-free falls back to padded batches (the trainer's
    ``_fall_back_to_padded``), logged with the reason; no row is cut for sequence parallelism either way."""
    run = trainer.unpack_run
    run.sequence_shards = 1
    if getattr(run.args, "packing", False):
        raise parallelism_refusal("packing=True", reason)
    if explicit_padding_free(run.args):
        raise parallelism_refusal("padding_free=True", reason)
    log_once(logger, logging.INFO, f"{trainer.unpack_name}: automatic padding-free off ({reason})")
    trainer._fall_back_to_padded(f"automatic padding-free off ({reason})")


def run_reason(trainer: Any, config: Any, shards: int) -> str | None:
    """Why ``trainer``'s run cannot pack exactly under DeepSpeed Ulysses with ``shards`` processes per row, or
    ``None`` (the model itself is checked once patched, [`refuse_model`]); ``config``: accelerate's
    ``ParallelismConfig``."""
    what = _ulysses(shards)
    if trainer.unpack_run.sample_loss:
        return (
            f"{what} with loss_normalization='sample': the engine computes the loss, the token mean over the "
            "sequence-parallel group; use loss_normalization='token'"
        )
    batch_size = trainer.args.per_device_train_batch_size
    if batch_size != 1:
        return (
            f"{what} with per_device_train_batch_size={batch_size}: each batch is one packed row, cut into shards, "
            "and Ulysses expects as many rows as that batch size; set per_device_train_batch_size=1 (and a longer "
            "max_length to fill the row)"
        )
    if trainer.eval_dataset is None:
        return None
    return evaluation_mode_reason(
        config,
        shards,
        "transformers' Trainer does not cut evaluation batches, so every process would take its whole batch for a "
        "shard of one row",
    )


def evaluation_mode_reason(config: Any, shards: int, why: str) -> str | None:
    """Why a run that needs Ulysses to leave a module in evaluation mode whole cannot run with ``config``
    (accelerate's ``ParallelismConfig``): ``sp_disable_in_eval=False`` (``why`` says what must run whole), or
    ``None`` (``True``, accelerate's default)."""
    handler = getattr(config, "sp_handler", None)
    if getattr(handler, "sp_disable_in_eval", True) is not False:
        return None
    return (
        f"{_ulysses(shards)} with sp_disable_in_eval=False: {why}; set "
        "DeepSpeedSequenceParallelConfig(sp_disable_in_eval=True) (the default)"
    )


def refuse_unpatched(trainer: Any) -> bool:
    """Under sequence parallelism, a model the packed path leaves unpatched (its type is not verified): refused, or
    padded for the automatic padding-free (returns ``True``); ``False`` where the model is patched or no row is cut.
    Only the patched attention keeps the samples of a cut row apart."""
    shards = trainer.unpack_run.sequence_shards
    if shards == 1 or trainer.unpack_decision.patch:
        return False
    refuse_or_pad(
        trainer,
        f"{_ulysses(shards)} with a model type that is not verified: only the patched attention keeps the samples of "
        "a cut row apart (stock Ulysses runs the row as one causal document)",
    )
    return True


def refuse_model(trainer: Any) -> bool:
    """The patched model under Ulysses ([`unpack_trainer.models.sequence_parallel.sequence_parallel_reason`]):
    refused (``ValueError``, every model of the trainer's ``_unpack_models`` unpatched), or padded for the automatic
    padding-free (returns ``True``), with the reason; ``False`` where it is exact or no row is cut."""
    from unpack_trainer.data.vision import DataCollatorForVisionPacking
    from unpack_trainer.models import unpatch_model
    from unpack_trainer.models.sequence_parallel import sequence_parallel_reason
    from unpack_trainer.trainers.evaluation import batch_collator

    shards = trainer.unpack_run.sequence_shards
    # Image rows are cut with the whole row's vision inputs by SFT's vision packing collator only.
    vision_rows = isinstance(batch_collator(trainer), DataCollatorForVisionPacking)
    why = None if shards == 1 else sequence_parallel_reason(trainer.model, shards, vision_rows=vision_rows)
    if why is None:
        return False
    try:
        refuse_or_pad(trainer, f"{_ulysses(shards)}: {why}")
    except ValueError:
        for model in trainer._unpack_models():
            unpatch_model(model)
        raise
    return True
