"""The line a trainer logs once when it is built: the decision, its reason, the attention the model runs and the
training set's statistics ([`log_start_line`]); and the two facts it reads, shared with the packed path: the dtype
mixed precision computes in ([`autocast_dtype`]) and the attention backend a model runs ([`attention_backend`]).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from unpack_trainer._compat import attention_implementation
from unpack_trainer._logging import announce_level, log_once

__all__ = ["attention_backend", "autocast_dtype", "log_start_line"]

logger = logging.getLogger("unpack_trainer")


def autocast_dtype(args: Any) -> torch.dtype | None:
    """The dtype the Trainer's mixed precision (``bf16`` / ``fp16``, run through autocast) computes float32
    parameters in; ``None`` without mixed precision. Packed attention computes in it, and chooses its backend for it."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def attention_backend(model: Any, patched: bool, args: Any) -> str:
    """The attention ``model`` runs packed rows with: the backend the patch resolves (``patched``), else
    transformers' own implementation, named as such."""
    if patched:
        from unpack_trainer.models import resolve_backend

        return str(resolve_backend(model, compute_dtype=autocast_dtype(args)))
    implementation = attention_implementation(getattr(model, "config", None))
    return f"{implementation} (transformers' own packed-position path, unpatched)"


def log_start_line(trainer: Any) -> None:
    """One line, once, on the main process: ``trainer``'s decision, its reason and the training set's statistics, at
    the level a user sees by default (:func:`~unpack_trainer._logging.announce_level`: silenced by ``log_level`` /
    transformers' verbosity above WARNING); WARNING whenever a request (packing / padding-free) was overridden."""
    decision = trainer.unpack_decision
    stats = trainer.unpack_stats
    parts = [f"mode={decision.mode}", f"reason: {decision.reason}"]
    if decision.packed:
        parts.append(f"attention={attention_backend(trainer.model, decision.patch, trainer.args)}")
    if stats.get("samples"):
        parts.append(f"samples={stats['samples']:,}")
        if "rows" in stats:
            parts.append(f"rows={stats['rows']:,}")
            parts.append(f"packing efficiency={stats['efficiency']:.2%}")
        if "estimated_speedup" in stats:
            parts.append(
                f"estimated speedup vs padded batches of {stats['padded_batch_size']:.3g} samples="
                f"{stats['estimated_speedup']:.2f}x (token count)"
            )
    if decision.packed:
        parts.append("the contamination self-check runs when training starts")
    level = logging.WARNING if decision.overridden_request else announce_level()
    log_once(logger, level, f"{trainer.unpack_name}: " + ", ".join(parts))
