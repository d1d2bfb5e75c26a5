"""What every packed attention backend shares: the options of a call, the backend record, the token layout helpers
and the availability check of an optional CUDA kernel."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import PackedSeqInfo

__all__ = [
    "FEATURE_NAMES",
    "KERNEL_DEVICE_TYPES",
    "AttentionBackend",
    "BackendFunction",
    "BranchedFunction",
    "CallOptions",
    "kernel_unavailable_reason",
    "logger",
    "optional_kernel",
    "repeat_heads",
    "tokens_major",
]

# One logger for every backend module: the messages of the package keep one name.
logger = logging.getLogger("unpack_trainer.patches.attention")

# What a backend may apply beyond causal / sliding-window / grouped-query attention with any scaling.
FEATURE_NAMES = {
    "softcap": "attention logit softcapping",
    "sinks": "attention sinks (s_aux)",
    "dropout": "attention dropout",
    "alibi": "ALiBi position biases",
}

# Availability seam. Tests extend it to run the CUDA kernels' dispatch on CPU with stand-in kernels.
KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


class CallOptions(NamedTuple):
    """What one packed attention call asks for besides q, k, v and the samples (checked by packed_attention_forward).

    ``sliding_window``: ``None`` (causal) or ``w``: query ``i`` sees keys ``j`` with ``i - w < j <= i`` (transformers'
    convention). ``softcap``: ``None`` or ``c``: scores become ``tanh(scores / c) * c``. ``sinks``: ``None`` or
    ``(num_heads,)`` one logit per query head added to every softmax denominator (gpt_oss ``s_aux``). ``dropout``: a
    probability (transformers passes 0.0 outside training). ``module``: the attention module (``training``).
    """

    scaling: float
    dropout: float
    sliding_window: int | None
    softcap: float | None
    sinks: Tensor | None
    module: torch.nn.Module
    # ALiBi (bloom, mpt): (num_heads,) float slopes; query i adds -slopes[h] * (i - j) to its score of key j, i and j
    # counted within the sample.
    alibi_slopes: Tensor | None = None


class BackendFunction(Protocol):
    """One backend: the contract of :func:`packed_attention_forward` on its inputs.

    ``query`` ``(B, num_heads, T, head_dim)``, ``key`` ``(B, num_kv_heads, T, head_dim)``, ``value``
    ``(B, num_kv_heads, T, head_dim_v)``, one float dtype, ``num_kv_heads`` dividing ``num_heads`` (query head ``h``
    reads kv head ``h // (num_heads // num_kv_heads)``); ``info``: the samples, tiling the ``B * T`` tokens. Returns
    ``(B, T, num_heads, head_dim_v)`` in query's dtype, causal attention within each sample. Every query sees at
    least itself, so no row is ever fully masked. An option the backend cannot apply (beyond its record's ``capabilities``) is refused
    before dispatch, so it arrives as ``None`` / 0.0.
    """

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
    ) -> Tensor: ...


class BranchedFunction(Protocol):
    """A backend's own path for a branched batch (shared prefixes, :meth:`PackedSeqInfo.branch_spans`): the contract of
    :class:`BackendFunction`, or ``None`` where it cannot take this batch (the caller then runs the ``[prefix; branch]``
    units, :meth:`PackedSeqInfo.branch_units`, through the backend's plain forward)."""

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
    ) -> Tensor | None: ...


class AttentionBackend(NamedTuple):
    """One packed attention backend, declared by its module and listed once in
    :data:`unpack_trainer.patches.attention.registry.REGISTRY`.

    Attributes:
        name: what ``UNPACK_ATTENTION_BACKEND`` and ``backend=`` call it.
        capabilities: what it applies beyond causal / sliding-window / grouped-query attention (keys of
            :data:`FEATURE_NAMES`); a call asking for more goes to a backend that can, or is refused.
        unavailable_reason: ``(device, compute dtype) -> str | None``, why it cannot run there (``None``: it can).
        forward: the packed forward (:class:`BackendFunction`).
        branched_forward: its own path for branched batches (:class:`BranchedFunction`), or ``None``: always the
            ``[prefix; branch]`` units.
        max_head_dim: the largest query / value head dim its kernel takes; ``None``: any.
        min_head_dim: the smallest query / value head dim its kernel takes; ``None``: any.
        automatic: whether the automatic choice considers it (in the registry's order).
        automatic_device_types: the device types where it does (``None``: every device it runs on).
    """

    name: str
    capabilities: frozenset[str]
    unavailable_reason: Callable[[torch.device, torch.dtype], str | None]
    forward: BackendFunction
    branched_forward: BranchedFunction | None = None
    max_head_dim: int | None = None
    automatic: bool = True
    min_head_dim: int | None = None
    automatic_device_types: tuple[str, ...] | None = None


def tokens_major(x: Tensor) -> Tensor:
    """(B, num_heads, T, head_dim) -> (total_tokens, num_heads, head_dim), total_tokens = B * T; a view when B == 1."""
    batch_size, num_heads, seq_len, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch_size * seq_len, num_heads, head_dim)


def repeat_heads(x: Tensor, heads_per_kv: int) -> Tensor:
    """(n, num_kv_heads, L, head_dim) -> (n, num_kv_heads * heads_per_kv, L, head_dim), each kv head repeated
    ``heads_per_kv`` times (transformers' repeat_kv)."""
    if heads_per_kv == 1:
        return x
    n, num_kv_heads, length, head_dim = x.shape
    expanded = x[:, :, None].expand(n, num_kv_heads, heads_per_kv, length, head_dim)
    return expanded.reshape(n, num_kv_heads * heads_per_kv, length, head_dim)


def optional_kernel(description: str, load: Callable[[], Any]) -> Any:
    """``load()``, or ``None`` when it raises (logged at DEBUG): an optional kernel that is missing or broken (e.g. an
    install without its CUDA libraries) is "not available"."""
    try:
        return load()
    except Exception as error:  # noqa: BLE001
        log_once(logger, logging.DEBUG, f"{description} is not usable: {error!r}")
        return None


def kernel_unavailable_reason(
    kernel: Any,
    device: torch.device,
    dtype: torch.dtype,
    *,
    name: str,
    not_installed: str,
    dtypes: tuple[torch.dtype, ...],
    dtype_problem: str,
) -> str | None:
    """Why an optional CUDA kernel (``None`` when it did not import) cannot run on ``device`` / ``dtype``.
    ``dtype_problem`` is formatted with ``name`` and ``dtype``."""
    if kernel is None:
        return not_installed
    if device.type not in KERNEL_DEVICE_TYPES:
        return f"{name} needs a CUDA device, the model is on {device.type}"
    if dtype not in dtypes:
        return dtype_problem.format(name=name, dtype=dtype)
    return None
