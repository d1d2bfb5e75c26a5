"""The one table of packed attention backends, and the choice among them.

A packed batch holds several samples per row. Stock transformers (5.x) turns packed ``position_ids`` into a dense
``(T, T)`` block-causal mask for SDPA and eager, so attention costs ``O(T**2)`` time and memory whatever the samples.
This package computes the same result from the per-sample lengths, one module per backend (its docstring says what it
runs and how it applies each feature). Each declares one :class:`~unpack_trainer.patches.attention._common.AttentionBackend`
record: its name, what it serves beyond causal attention (``serves``: members of
:class:`~unpack_trainer.patches.attention._common.AttentionFeature`), the optional kernel it runs and what else it
requires of a device, its forward and branched forward. :data:`REGISTRY` lists them once, in the order the automatic
choice prefers them; :func:`register_backend` (public: ``unpack_trainer.register_backend``) adds one from outside the
package, as transformers' ``AttentionInterface.register(name, fn)`` does. No code outside a backend's module names it:
the choice, ``UNPACK_ATTENTION_BACKEND``, ``backend=`` and ``unpack-trainer env`` read everything from the records.

Worked example, one row of two samples of lengths 3 and 2::

    position_ids        [[0, 1, 2, 0, 1]]
    packed_seq_lengths  [3, 2]          int32
    cu_seqlens          [0, 3, 5]       int32
    max_seqlen          3

Sliding-window attention (a query at position ``i`` sees keys ``j`` with ``i - sliding_window < j <= i``, as in
transformers' masks), grouped-query attention (``num_kv_heads`` dividing ``num_heads``), any ``scaling`` and a value
head dim different from the query head dim (MLA) work on every backend. What a backend cannot apply (a feature outside
its ``serves``, a head dim outside its ``min_head_dim`` .. ``max_head_dim``; a backend only on the devices of its
``automatic_device_types``) the automatic choice hands to one that can (logged once).

Under ``torch.autocast`` attention computes in the autocast dtype: float32 q / k / v are cast to it and the backend
is chosen for it (:func:`compute_dtype`).

``UNPACK_ATTENTION_BACKEND=<name>`` forces a backend (any name of :data:`REGISTRY`, registered ones included);
asking for one that cannot run, or that cannot apply what the model asks for, is an error naming the variable. So is
a ``backend=`` argument that cannot apply it (as transformers' own ``sdpa_attention_forward`` refuses ``softcap``).

The packing metadata is computed once per forward on the CPU (:class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`);
each backend keeps the index tensors it derives from it beside it (``PackedSeqInfo.plans``, a
:class:`~unpack_trainer.packed_seq_info.PlanCache` keyed by a type of key per plan), so no layer synchronises with the
device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention import eager, flash, flex, sdpa, torch_varlen, xformers
from unpack_trainer.patches.attention._common import (
    AttentionBackend,
    AttentionFeature,
    BackendFunction,
    BranchedFunction,
    Needs,
)

__all__ = [
    "ENV_BACKEND",
    "REGISTRY",
    "BackendChoice",
    "backend_unavailable_reason",
    "check_explicit_backend",
    "choose_backend",
    "compute_dtype",
    "fallback_for",
    "forced_backend",
    "register_backend",
]

# Name -> record, in the order the automatic choice prefers them (among those marked ``automatic``): the built-in
# backends, and those :func:`register_backend` adds.
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
ENV_BACKEND = "UNPACK_ATTENTION_BACKEND"


def register_backend(
    name: str,
    forward: BackendFunction,
    *,
    serves: Iterable[AttentionFeature | str] = (),
    requires: Callable[[torch.device, torch.dtype], str | None] | None = None,
    automatic: bool = True,
    before: str | None = None,
    branched_forward: BranchedFunction | None = None,
    prepare: Callable[[PackedSeqInfo, torch.device], None] | None = None,
    max_head_dim: int | None = None,
    min_head_dim: int | None = None,
) -> AttentionBackend:
    """Add a packed attention backend from outside the package (or replace the one of that ``name``), as transformers'
    ``AttentionInterface.register(name, fn)`` adds an attention function.

    From then on ``UNPACK_ATTENTION_BACKEND=<name>`` and ``backend=<name>`` take it, ``unpack-trainer env`` lists it
    with what it serves and whether it can run, and (``automatic``) the automatic choice prefers it to the backends
    after it, for every call whose features it serves and on every device and dtype where ``requires`` finds no
    reason against it; a call asking for more goes to the next backend that serves it (logged once).

    Example: each sample alone through ``F.scaled_dot_product_attention`` (no window: a windowed layer goes to the
    next backend)::

        import torch
        import torch.nn.functional as F

        import unpack_trainer


        def per_sample(query, key, value, info, options):
            batch_size, num_heads, seq_len, _ = query.shape
            q, k, v = (x.transpose(1, 2).flatten(0, 1).transpose(0, 1)[None] for x in (query, key, value))
            bounds = info.cu_seqlens.tolist()  # (num_seqs + 1,) over the B * T tokens
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=options.scaling, enable_gqa=True
                    )
                    for a, b in zip(bounds[:-1], bounds[1:])
                ],
                dim=2,
            )  # (1, num_heads, B * T, head_dim_v)
            return out[0].transpose(0, 1).reshape(batch_size, seq_len, num_heads, -1)


        unpack_trainer.register_backend("per_sample", per_sample)

    Args:
        name: what the variable, ``backend=`` and ``env`` call it: lower case, no spaces.
        forward: ``(query, key, value, info, options) -> output``: query ``(B, num_heads, T, head_dim)``, key
            ``(B, num_kv_heads, T, head_dim)``, value ``(B, num_kv_heads, T, head_dim_v)`` in the compute dtype,
            ``info`` the row's samples (a :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`: ``cu_seqlens``
            ``(num_seqs + 1,)`` int32, ``max_seqlen``, ``seq_lengths``), ``options`` the call's
            :class:`~unpack_trainer.patches.attention._common.CallOptions` (``scaling``, ``sliding_window``, ...);
            returns ``(B, T, num_heads, head_dim_v)`` in query's dtype, causal attention within each sample.
        serves: the :class:`~unpack_trainer.patches.attention._common.AttentionFeature` it applies itself (members or
            their names; default: none, so a windowed or softcapped call goes to a backend that serves it, never
            silently to one that ignores it). Chunked attention and branched rows reach it as plain samples.
        requires: ``(device, compute dtype) -> reason or None``: why it cannot run there (``None``: it can); the
            choice skips it with that reason, and naming it there is an error giving the reason.
        automatic: whether the automatic choice considers it.
        before: the name of the registered backend it is preferred to; ``None``: to every backend.
        branched_forward, prepare, max_head_dim, min_head_dim: as the fields of
            :class:`~unpack_trainer.patches.attention._common.AttentionBackend`.

    Returns:
        The record registered.

    Raises:
        ValueError: ``name`` is not lower case without spaces, ``serves`` holds something that is no
            :class:`~unpack_trainer.patches.attention._common.AttentionFeature`, ``before`` names no other registered
            backend.
        TypeError: ``forward`` is not callable.
    """
    if not name or name != name.strip().lower() or " " in name:
        raise ValueError(f"A packed attention backend's name is lower case without spaces, got {name!r}.")
    if not callable(forward):
        raise TypeError(
            f"register_backend({name!r}, forward): forward must be callable, got {type(forward).__name__}."
        )
    try:
        features = frozenset(AttentionFeature(feature) for feature in serves)
    except ValueError:
        known = ", ".join(feature.value for feature in AttentionFeature)
        raise ValueError(f"register_backend({name!r}, serves={serves!r}): serve some of {known}.") from None
    record = AttentionBackend(
        name,
        frozenset(feature for feature in features if not feature.by_dispatch),
        forward,
        branched_forward=branched_forward,
        requires=requires,
        max_head_dim=max_head_dim,
        automatic=automatic,
        prepare=prepare,
        min_head_dim=min_head_dim,
    )
    if before is not None and (before not in REGISTRY or before == name):
        raise ValueError(f"register_backend({name!r}, before={before!r}): choose one of {', '.join(REGISTRY)}.")
    others = [(key, value) for key, value in REGISTRY.items() if key != name]
    at = 0 if before is None else [key for key, _ in others].index(before)
    others.insert(at, (name, record))
    REGISTRY.clear()
    REGISTRY.update(others)
    return record


def forced_backend() -> str | None:
    """The backend ``UNPACK_ATTENTION_BACKEND`` names (lower-cased), or ``None`` when it is unset or empty."""
    return os.environ.get(ENV_BACKEND, "").strip().lower() or None


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
        raise ValueError(f"Unknown packed attention backend {backend!r}; choose one of {', '.join(REGISTRY)}.")
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


def fallback_for(needs: Needs) -> AttentionBackend:
    """The first backend of :data:`REGISTRY` that runs wherever torch does (no optional kernel, no requirement) and
    serves the features of ``needs``: where a kernel hands over what it cannot take (a sample past its 32-bit
    offsets), and the automatic choice's last resort.

    Raises:
        ValueError: no such backend serves them.
    """
    wanted = Needs(needs.features)
    for record in REGISTRY.values():
        if record.runs_anywhere and not record.cannot_apply(wanted):
            return record
    described = " and ".join(feature.description for feature in sorted(needs.features))
    raise ValueError(f"No packed attention backend of torch's own ops serves {described}.")


def check_explicit_backend(
    backend: str, device: torch.device, dtype: torch.dtype, needs: Needs, *, from_env: bool
) -> None:
    """Refuse a backend the user named (``UNPACK_ATTENTION_BACKEND`` when ``from_env``, else a ``backend=``
    argument) that does not exist, cannot apply what the call asks for (``needs``), or cannot run on ``device``
    computing in ``dtype``: a ``ValueError`` naming the choice, the reason and the fix. The one home of these
    checks."""
    if from_env:
        named, fix = f"{ENV_BACKEND}={backend}", f"unset {ENV_BACKEND} to choose automatically"
    else:
        named, fix = f"Packed attention backend={backend!r}", "backend=None to choose one that can"
    if backend not in REGISTRY:
        raise ValueError(f"{named} is not a packed attention backend; choose one of {', '.join(REGISTRY)}.")
    missing = REGISTRY[backend].cannot_apply(needs)
    if missing:
        able = [repr(name) for name, record in REGISTRY.items() if not record.cannot_apply(needs)]
        raise ValueError(f"{named} cannot apply {' and '.join(missing)}; use {' or '.join(able)}, or {fix}.")
    reason = backend_unavailable_reason(backend, device, dtype)
    if reason is not None:
        raise ValueError(f"{named} cannot run here: {reason}; {fix}.")


def choose_backend(
    device: torch.device, dtype: torch.dtype, original_implementation: str | None, needs: Needs | None = None
) -> BackendChoice:
    """Which backend packed attention uses for inputs on ``device`` computing in ``dtype``.

    ``UNPACK_ATTENTION_BACKEND`` wins (and is an error if that backend cannot run here, or cannot apply ``needs``).
    A model loaded with the transformers implementation a backend reproduces (its ``keeps_implementation``: eager
    attention) keeps that backend. Otherwise the first backend of :data:`REGISTRY` marked
    ``automatic`` (on its ``automatic_device_types``) that can run here and apply ``needs``; when none can, the last
    resort :func:`fallback_for`.

    Args:
        device: where attention runs.
        dtype: the dtype it computes in: under autocast the autocast dtype (:func:`compute_dtype`), else the inputs'
            dtype.
        original_implementation: the model's attention implementation before patching.
        needs: what the call (or the model's attention) applies and its head dims
            (:class:`~unpack_trainer.patches.attention._common.Needs`); ``None``: plain causal attention.
    """
    device = torch.device(device)
    needs = Needs() if needs is None else needs
    forced = forced_backend()
    if forced:
        check_explicit_backend(forced, device, dtype, needs, from_env=True)
        return BackendChoice(forced, f"forced by {ENV_BACKEND}")
    for record in REGISTRY.values():
        if original_implementation is not None and record.keeps_implementation == original_implementation:
            return BackendChoice(
                record.name, f"the model was loaded with attn_implementation={original_implementation!r}"
            )
    skipped = []
    for record in REGISTRY.values():
        if not record.automatic:
            continue
        if record.automatic_device_types is not None and device.type not in record.automatic_device_types:
            continue
        reason = record.unavailable_reason(device, dtype)
        if reason is not None:
            skipped.append(reason)
            continue
        missing = record.cannot_apply(needs)
        if missing:
            skipped.append(f"{record.name} cannot apply {' and '.join(missing)}")
            continue
        if record.runs_anywhere:
            return BackendChoice(record.name, "no kernel backend: " + "; ".join(skipped) if skipped else record.name)
        reason = f"{record.name} available on {device.type} for {dtype}"
        return BackendChoice(record.name, reason + ("; skipped: " + "; ".join(skipped) if skipped else ""))
    return BackendChoice(fallback_for(needs).name, "; ".join(skipped))
