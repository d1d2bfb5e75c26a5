"""The one table of packed attention backends, and the choice among them.

A packed batch holds several samples per row. Stock transformers (5.x) turns packed ``position_ids`` into a dense
``(T, T)`` block-causal mask for SDPA and eager, so attention costs ``O(T**2)`` time and memory whatever the samples.
This package computes the same result from the per-sample lengths, one module per backend (its docstring says what it
runs and how it applies each feature). Each declares one :class:`~unpack_trainer.patches.attention._common.AttentionBackend`
record: its name, what it can apply beyond causal attention (``capabilities``), the optional kernel it runs and what
else it requires of a device, its forward and branched forward. :data:`REGISTRY` lists them once, in the order the
automatic choice prefers them. Adding a backend is one new module and one entry in :data:`REGISTRY`; ``unpack-trainer
env`` and the choice read everything else from the record.

Worked example, one row of two samples of lengths 3 and 2::

    position_ids        [[0, 1, 2, 0, 1]]
    packed_seq_lengths  [3, 2]          int32
    cu_seqlens          [0, 3, 5]       int32
    max_seqlen          3

Sliding-window attention (a query at position ``i`` sees keys ``j`` with ``i - sliding_window < j <= i``, as in
transformers' masks), grouped-query attention (``num_kv_heads`` dividing ``num_heads``), any ``scaling`` and a value
head dim different from the query head dim (MLA) work on every backend. What a backend cannot apply (a feature outside
its ``capabilities``, a head dim outside its ``min_head_dim`` .. ``max_head_dim``; flex only on the devices of its ``automatic_device_types``) the automatic choice hands to one that can (logged once).

Under ``torch.autocast`` attention computes in the autocast dtype: float32 q / k / v are cast to it and the backend
is chosen for it (:func:`compute_dtype`).

``UNPACK_ATTENTION_BACKEND=<name>`` forces a backend; asking for one that cannot run, or that cannot apply what the
model asks for, is an error naming the variable. So is a ``backend=`` argument that cannot apply it (as transformers'
own ``sdpa_attention_forward`` refuses ``softcap``).

The packing metadata is computed once per forward on the CPU (:class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`);
each backend caches the index tensors it derives from it on that object (``PackedSeqInfo.plan``, one namespace per
backend), so no layer synchronises with the device.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from unpack_trainer.patches.attention import eager, flash, flex, sdpa, torch_varlen, xformers
from unpack_trainer.patches.attention._common import FEATURE_NAMES, AttentionBackend

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "REGISTRY",
    "BackendChoice",
    "backend_unavailable_reason",
    "check_explicit_backend",
    "choose_backend",
    "compute_dtype",
    "features",
    "fallback_for",
    "missing_features",
]

# Name -> record, in the order the automatic choice prefers them (among those marked ``automatic``).
REGISTRY: dict[str, AttentionBackend] = {
    backend.name: backend
    for backend in (
        flash.BACKEND,
        torch_varlen.BACKEND,
        xformers.BACKEND,
        flex.BACKEND,
        sdpa.BACKEND,
        eager.BACKEND,
    )
}
BACKENDS: tuple[str, ...] = tuple(REGISTRY)
ENV_BACKEND = "UNPACK_ATTENTION_BACKEND"


def compute_dtype(
    device: torch.device, dtype: torch.dtype, *, autocast_dtype: torch.dtype | None = None
) -> torch.dtype:
    """The dtype packed attention computes in for inputs stored in ``dtype`` on ``device``.

    Under autocast a float32 input computes in the autocast dtype, as transformers' ``get_target_dtype``
    (``integrations/flash_attention.py``) casts it for flash attention: fp32 weights with ``bf16=True`` take the same
    bfloat16 kernels as bfloat16 weights. ``autocast_dtype`` is a trainer's mixed precision, known before any forward
    runs (``None``: whatever ``torch.autocast`` has enabled for ``device``'s type now). Any other dtype (float16,
    bfloat16, float64) computes as it is.
    """
    if dtype != torch.float32:
        return dtype
    if autocast_dtype is None:
        device_type = torch.device(device).type
        if torch.is_autocast_enabled(device_type):
            autocast_dtype = torch.get_autocast_dtype(device_type)
    return autocast_dtype if autocast_dtype is not None else dtype


def _known(backend: str) -> AttentionBackend:
    if backend not in REGISTRY:
        raise ValueError(f"Unknown packed attention backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    return REGISTRY[backend]


def backend_unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run packed attention on ``device`` computing in ``dtype``; ``None`` when it can.

    ``dtype`` is the dtype attention computes in: under autocast, the autocast dtype (:func:`compute_dtype`), not the
    parameters' dtype.
    """
    return _known(backend).unavailable_reason(torch.device(device), dtype)


class BackendChoice(NamedTuple):
    """The packed attention backend and why it was chosen."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def missing_features(
    backend: str, wanted: frozenset[str], head_dim: int | None, min_head_dim: int | None = None
) -> list[str]:
    """What ``backend`` cannot apply of ``wanted`` (keys of :data:`FEATURE_NAMES`), of ``head_dim`` (the largest
    query / value head dim) and of ``min_head_dim`` (the smallest; ``None``: the same as ``head_dim``), described."""
    record = REGISTRY[backend]
    missing = [FEATURE_NAMES[name] for name in sorted(wanted - record.capabilities)]
    if record.max_head_dim is not None and head_dim is not None and head_dim > record.max_head_dim:
        missing.append(f"head_dim {head_dim} (its kernel takes at most {record.max_head_dim})")
    smallest = head_dim if min_head_dim is None else min_head_dim
    if record.min_head_dim is not None and smallest is not None and smallest < record.min_head_dim:
        missing.append(f"head_dim {smallest} (its kernel takes at least {record.min_head_dim})")
    return missing


def fallback_for(wanted: frozenset[str]) -> AttentionBackend:
    """The first backend of :data:`REGISTRY` that runs wherever torch does (no optional kernel, no requirement) and
    applies ``wanted``: where a kernel hands over what it cannot take (a sample past its 32-bit offsets)."""
    return next(
        record
        for record in REGISTRY.values()
        if record.kernel is None and record.requires is None and not missing_features(record.name, wanted, None)
    )


def features(
    *, softcap: bool, sinks: bool, dropout: bool, alibi: bool = False, bidirectional: bool = False
) -> frozenset[str]:
    """The keys of :data:`FEATURE_NAMES` a call asks for."""
    flags = {"softcap": softcap, "sinks": sinks, "dropout": dropout, "alibi": alibi, "bidirectional": bidirectional}
    return frozenset(name for name, wanted in flags.items() if wanted)


def check_explicit_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    wanted: frozenset[str],
    head_dim: int | None,
    *,
    from_env: bool,
    min_head_dim: int | None = None,
) -> None:
    """Refuse a backend the user named (``UNPACK_ATTENTION_BACKEND`` when ``from_env``, else a ``backend=``
    argument) that does not exist, cannot apply what the call asks for, or cannot run on ``device`` computing in
    ``dtype``: a ``ValueError`` naming the choice, the reason and the fix. The one home of these checks."""
    if from_env:
        named, fix = f"{ENV_BACKEND}={backend}", f"unset {ENV_BACKEND} to choose automatically"
    else:
        named, fix = f"Packed attention backend={backend!r}", "backend=None to choose one that can"
    if backend not in REGISTRY:
        raise ValueError(f"{named} is not a packed attention backend; choose one of {', '.join(BACKENDS)}.")
    missing = missing_features(backend, wanted, head_dim, min_head_dim)
    if missing:
        able = [repr(name) for name in BACKENDS if not missing_features(name, wanted, head_dim, min_head_dim)]
        raise ValueError(f"{named} cannot apply {' and '.join(missing)}; use {' or '.join(able)}, or {fix}.")
    reason = backend_unavailable_reason(backend, device, dtype)
    if reason is not None:
        raise ValueError(f"{named} cannot run here: {reason}; {fix}.")


def choose_backend(
    device: torch.device,
    dtype: torch.dtype,
    original_implementation: str | None,
    *,
    softcap: bool = False,
    sinks: bool = False,
    dropout: bool = False,
    head_dim: int | None = None,
    alibi: bool = False,
    min_head_dim: int | None = None,
    bidirectional: bool = False,
) -> BackendChoice:
    """Which backend packed attention uses for inputs on ``device`` computing in ``dtype``.

    ``UNPACK_ATTENTION_BACKEND`` wins (and is an error if that backend cannot run here, or cannot apply the requested
    features). A model loaded with ``attn_implementation="eager"`` keeps eager. Otherwise the first backend of
    :data:`REGISTRY` marked ``automatic`` that can run here and can apply the features; eager when none can.

    Args:
        device: where attention runs.
        dtype: the dtype it computes in: under autocast the autocast dtype (:func:`compute_dtype`), else the inputs'
            dtype.
        original_implementation: the model's attention implementation before patching.
        softcap, sinks, dropout: whether the call applies logit softcapping, attention sinks (``s_aux``), dropout.
        head_dim: the larger of the query and value head dims (flash kernels take at most 256); ``None``: unknown.
        alibi: whether the call adds ALiBi position biases (bloom, mpt).
        min_head_dim: the smaller of the query and value head dims (compiled flex takes 16 or more); ``None``: the
            same as ``head_dim``.
        bidirectional: whether some tokens attend to each other both ways (``PackedSeqInfo.bidirectional_spans``:
            Gemma 3's image tokens); the varlen kernels cannot apply it.
    """
    wanted = features(softcap=softcap, sinks=sinks, dropout=dropout, alibi=alibi, bidirectional=bidirectional)
    device = torch.device(device)
    forced = os.environ.get(ENV_BACKEND, "").strip().lower()
    if forced:
        check_explicit_backend(forced, device, dtype, wanted, head_dim, from_env=True, min_head_dim=min_head_dim)
        return BackendChoice(forced, f"forced by {ENV_BACKEND}")
    if original_implementation == "eager":
        return BackendChoice("eager", "the model was loaded with attn_implementation='eager'")
    skipped = []
    for record in REGISTRY.values():
        if not record.automatic:
            continue
        if record.automatic_device_types is not None and device.type not in record.automatic_device_types:
            continue
        reason = record.unavailable_reason(torch.device(device), dtype)
        if reason is not None:
            skipped.append(reason)
            continue
        missing = missing_features(record.name, wanted, head_dim, min_head_dim)
        if missing:
            skipped.append(f"{record.name} cannot apply {' and '.join(missing)}")
            continue
        if record.name == "sdpa":
            return BackendChoice("sdpa", "no kernel backend: " + "; ".join(skipped) if skipped else "SDPA")
        reason = f"{record.name} available on {torch.device(device).type} for {dtype}"
        return BackendChoice(record.name, reason + ("; skipped: " + "; ".join(skipped) if skipped else ""))
    return BackendChoice("eager", "; ".join(skipped))
