"""The one attention helper for packed rows: every sample attends only to itself, at the cost of the samples alone.

A packed batch holds several samples per row. Stock transformers (5.x) turns packed ``position_ids`` into a dense
``(T, T)`` block-causal mask for SDPA and eager, so attention costs ``O(T**2)`` time and memory whatever the samples.
This module computes the same result from the per-sample lengths:

- ``flash``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16), split at sample boundaries where a row is so
  large that the kernel's 32-bit offsets would overflow;
- ``torch_varlen``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, no extra install);
- ``xformers``: ``memory_efficient_attention`` with a ``BlockDiagonalCausalMask`` (CUDA);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` per sample, without any ``(T, T)`` mask: samples of
  similar length are gathered into one padded ``(n, num_heads, L, head_dim)`` batch (padding at the end of each sample, where causal
  attention of real tokens never sees it) and run in one causal call, so memory is linear in ``T`` and thousands of
  tiny samples cost a handful of calls;
- ``eager``: the same buckets with an explicit ``softmax(QK^T * scaling + mask) V``, the readable reference.

Worked example, one row of two samples of lengths 3 and 2::

    position_ids        [[0, 1, 2, 0, 1]]
    packed_seq_lengths  [3, 2]          int32
    cu_seqlens          [0, 3, 5]       int32
    max_seqlen          3

Sliding-window attention (a query at position ``i`` sees keys ``j`` with ``i - sliding_window < j <= i``, as in
transformers' masks), grouped-query attention (``num_kv_heads`` dividing ``num_heads``), any ``scaling`` and a value
head dim different from the query head dim (MLA) work on every backend. The model families' other quirks are applied
by the backends that can, and handed to one that can by the automatic choice (logged once):

=================  =====  ============  ========  ====  =====
feature            flash  torch_varlen  xformers  sdpa  eager
=================  =====  ============  ========  ====  =====
logit ``softcap``  yes    no            no        no    yes
sinks (``s_aux``)  no     no            no        no    yes
dropout            yes    no            yes       yes   yes
ALiBi              yes    no            no        yes   yes
=================  =====  ============  ========  ====  =====

``UNPACK_ATTENTION_BACKEND=flash|torch_varlen|xformers|sdpa|eager`` forces a backend; asking for one that cannot run,
or that cannot apply what the model asks for, is an error naming the variable. So is a ``backend=`` argument that
cannot apply it (as transformers' own ``sdpa_attention_forward`` refuses ``softcap``).

The packing metadata is computed once per forward on the CPU
(:class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`); each backend caches the index tensors it derives from it on
that object (``PackedSeqInfo.plan``, one namespace per backend), so no layer synchronises with the device.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import PackedSeqInfo, zero_prefixed_cumsum
from unpack_trainer.patches.masks import current_packed_info, detect_packed

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "BackendChoice",
    "backend_unavailable_reason",
    "choose_backend",
    "chunked_info",
    "make_attention_function",
    "packed_attention_forward",
]

logger = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("flash", "torch_varlen", "xformers", "sdpa", "eager")
ENV_BACKEND = "UNPACK_ATTENTION_BACKEND"

# The automatic choice: the first of these that can run here and can apply what the call asks for, else eager.
_AUTOMATIC_ORDER: tuple[str, ...] = ("flash", "torch_varlen", "xformers", "sdpa")
# What each backend applies beyond causal / sliding-window / grouped-query attention with any scaling.
_CAPABILITIES: dict[str, frozenset[str]] = {
    "flash": frozenset({"softcap", "dropout", "alibi"}),
    "torch_varlen": frozenset(),
    "xformers": frozenset({"dropout"}),
    "sdpa": frozenset({"dropout", "alibi"}),
    "eager": frozenset({"softcap", "sinks", "dropout", "alibi"}),
}
_FEATURE_NAMES = {
    "softcap": "attention logit softcapping",
    "sinks": "attention sinks (s_aux)",
    "dropout": "attention dropout",
    "alibi": "ALiBi position biases",
}
# flash-attn 2 and torch's varlen flash kernel take head dims up to 256 (one head dim for q, k and v).
_FLASH_MAX_HEAD_DIM = 256

# Availability seams. Tests swap these to run the flash/xformers dispatch on CPU with stand-in kernels.
_KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_FLASH_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
_XFORMERS_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

# flash-attn's varlen backward indexes its fp32 dq accumulator, of (total_tokens + 128 * num_seqs) * num_heads *
# head_dim rounded up (see _flash_rounded_head_dim) elements, with 32-bit offsets in the releases that predate the fix
# (flash-attention PR 1500). Rows above this bound (_flash_fits) are split at sample boundaries.
_FLASH_MAX_ELEMENTS = 2**31 - 1

# SDPA/eager bucketing minimises sum over buckets of (_CALL_COST_PAIRS + samples * longest**2): the fixed cost of one
# more attention call (forward + backward), in units of the cost of one (query, key) pair of a padded sample. Measured
# on CPU with torch's flash SDPA kernel, 8 heads of 32 dims: ~100 us per call, ~70 ns per (query, key) pair.
_CALL_COST_PAIRS = 1536
# The grouping runs over distinct lengths (quadratic); above this many they are first rounded up to coarser steps.
_MAX_DISTINCT_LENGTHS = 256
# Eager materialises (n, H, L, L) scores; buckets are run in chunks of at most this many score elements.
_EAGER_MAX_SCORE_ELEMENTS = 1 << 25

# --------------------------------------------------------------------------------------------------------------------
# The packing metadata of a call
# --------------------------------------------------------------------------------------------------------------------


class _LastDerivedInfo:
    """The metadata this helper derived last, for callers that bypass the model hook (which hands every layer a
    ``packed_seq_info``): every layer of one forward receives the same source tensor object, so the CPU work and any
    device sync happen once per forward. One entry, keyed by the source tensor's identity (a weak reference, so the
    batch is not kept alive) and version, its keyword name and the batch shape."""

    def __init__(self) -> None:
        self._source: weakref.ref[Tensor] | None = None
        self._key: tuple[str, int, int, int] | None = None
        self._info: PackedSeqInfo | None = None

    def get(self, source_name: str, source: Tensor, batch_size: int, seq_len: int) -> PackedSeqInfo | None:
        """The metadata of ``source`` (``packed_seq_lengths``, ``cu_seq_lens_q`` or ``position_ids``), derived once
        by the one detector, :func:`unpack_trainer.patches.masks.detect_packed`."""
        key = (source_name, source._version, batch_size, seq_len)
        if self._source is not None and self._source() is source and self._key == key:
            return self._info
        info = detect_packed(batch_size, seq_len, **{source_name: source})
        self._source, self._key, self._info = weakref.ref(source), key, info
        return info


_last_derived = _LastDerivedInfo()


def packed_info_from_kwargs(
    query: Tensor, key: Tensor, attention_mask: Any, kwargs: dict[str, Any]
) -> PackedSeqInfo | None:
    """The packing metadata of this call, or ``None`` for an unpacked call.

    ``packed_seq_info`` (set by the model hook, ``None`` meaning "not packed") when present; else, for a direct call
    without the hook, what :func:`unpack_trainer.patches.masks.detect_packed` decides from ``packed_seq_lengths``,
    ``cu_seq_lens_q`` or ``position_ids`` (the latter only without an attention mask and with as many keys as
    queries, i.e. no KV cache).
    """
    if "packed_seq_info" in kwargs:
        return kwargs["packed_seq_info"]
    if kwargs.get("packed_seq_parents") is not None:
        raise ValueError(
            "Branched packed samples (`packed_seq_parents`) reach attention through the patched model's hook, which "
            "passes `packed_seq_info`; patch the model with unpack_trainer.models.patch_model."
        )
    batch_size, _, seq_len, _ = query.shape
    for name in ("packed_seq_lengths", "cu_seq_lens_q"):
        source = kwargs.get(name)
        if source is not None:
            return _last_derived.get(name, source, batch_size, seq_len)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and attention_mask is None and key.shape[2] == seq_len:
        return _last_derived.get("position_ids", position_ids, batch_size, seq_len)
    return None


def chunked_info(info: PackedSeqInfo, chunk_size: int) -> PackedSeqInfo:
    """``info`` with every sample cut into chunks of ``chunk_size`` tokens counted from the sample's start (the last
    chunk of a sample may be shorter), cached on ``info``.

    Chunked attention (a query sees the keys of its own chunk only, causally) over packed samples is packed attention
    over their chunks, so every backend runs it unchanged. Lengths ``[5, 2]``, ``chunk_size`` 2 -> ``[2, 2, 1, 2]``.

    Raises:
        ValueError: ``chunk_size`` is not a positive number of tokens.
    """
    chunk_size = int(chunk_size)
    if chunk_size <= 0:
        raise ValueError(f"attention_chunk_size must be a positive number of tokens, got {chunk_size}.")
    if info.max_seqlen <= chunk_size and not info.is_branched:  # a branch's positions continue its prefix's
        return info

    def build() -> PackedSeqInfo:
        if info.is_branched:
            return _chunked_branches(info, chunk_size)
        lengths = info.seq_lengths.to(torch.int64)
        chunks = (lengths + chunk_size - 1) // chunk_size  # (num_seqs,) chunks per sample
        sizes = torch.full((int(chunks.sum()),), chunk_size, dtype=torch.int64)
        sizes[torch.cumsum(chunks, 0) - 1] = lengths - (chunks - 1) * chunk_size  # each sample's last chunk
        return PackedSeqInfo.from_seq_lengths(sizes.to(torch.int32), batch_size=info.batch_size, seq_len=info.seq_len)

    return info.plan("chunked", chunk_size, build)


def _chunked_branches(info: PackedSeqInfo, chunk_size: int) -> PackedSeqInfo:
    """:func:`chunked_info` of a branched batch: chunks are counted by position, and a branch continues its prefix's
    positions. A prefix is cut from its start; a branch's first piece, up to the next multiple of ``chunk_size`` of
    its positions, is a branch of the prefix's last chunk when that chunk is not full, so it sees the prefix tokens
    of its own chunk; the rest of the branch is cut into whole chunks that start fresh.

    Example, ``chunk_size`` 3, p, c, r of lengths 4, 3, 2 (positions 0-3, 4-6, 4-5): p -> ``[3, 1]``, c -> ``[2, 1]``
    (its first 2 tokens share the chunk of positions 3-5 with p's last token), r -> ``[2]``; parents
    ``[-1, -1, 1, -1, 1]``.
    """
    sizes: list[int] = []
    parents: list[int] = []
    last_chunk: dict[int, tuple[int, int]] = {}  # prefix sample -> (index of its last chunk, tokens in it)
    for index, (length, parent) in enumerate(zip(info.seq_lengths.tolist(), info.seq_parents.tolist())):
        if parent >= 0:
            chunk, filled = last_chunk[parent]
            if filled < chunk_size:
                first = min(length, chunk_size - filled)
                sizes.append(first)
                parents.append(chunk)
                length -= first
        whole, rest = divmod(length, chunk_size)
        pieces = [chunk_size] * whole + ([rest] if rest else [])
        sizes += pieces
        parents += [-1] * len(pieces)
        if parent < 0:
            last_chunk[index] = (len(sizes) - 1, pieces[-1])
    return PackedSeqInfo.from_seq_lengths(
        torch.tensor(sizes, dtype=torch.int32),
        batch_size=info.batch_size,
        seq_len=info.seq_len,
        seq_parents=torch.tensor(parents, dtype=torch.int64),
    )


# --------------------------------------------------------------------------------------------------------------------
# Backend availability and choice
# --------------------------------------------------------------------------------------------------------------------


def _optional(description: str, load: Callable[[], Any]) -> Any:
    """``load()``, or ``None`` when it raises (logged at DEBUG): an optional kernel that is missing or broken (e.g. an
    install without its CUDA libraries) is "not available"."""
    try:
        return load()
    except Exception as error:  # noqa: BLE001
        log_once(logger, logging.DEBUG, f"{description} is not usable: {error!r}")
        return None


@functools.cache
def _flash_varlen_kernel() -> Callable[..., Tensor] | None:
    """``flash_attn.flash_attn_varlen_func`` when flash-attn imports, else ``None`` (imported on first use)."""
    return _optional("flash-attn", lambda: importlib.import_module("flash_attn").flash_attn_varlen_func)


@functools.cache
def _torch_varlen_kernel() -> Callable[..., Tensor] | None:
    """``torch.nn.attention.varlen.varlen_attn`` when this torch has it (2.10 and later), else ``None``."""
    return _optional(
        "torch.nn.attention.varlen", lambda: importlib.import_module("torch.nn.attention.varlen").varlen_attn
    )


def _takes_enable_gqa(kernel: Callable[..., Any]) -> bool:
    """Whether ``varlen_attn`` has the ``enable_gqa`` keyword (added after the first release); read from its
    signature, not from the torch version."""
    try:
        return "enable_gqa" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


def _cuda_flash_unsupported_reason(device: torch.device) -> str | None:
    """Why torch's own flash kernel cannot run on ``device``: a torch built without it, or a GPU older than sm80."""
    if device.type != "cuda":
        return None
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch was built without its flash attention kernel"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"torch's flash kernel needs compute capability 8.0 or newer, the GPU has {major}.{minor}"
    return None


@functools.cache
def _xformers_fmha() -> Any:
    """``xformers.ops.fmha`` when xformers imports, else ``None`` (imported on first use)."""
    return _optional("xformers", lambda: importlib.import_module("xformers.ops.fmha"))


def _kernel_unavailable_reason(
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
    if device.type not in _KERNEL_DEVICE_TYPES:
        return f"{name} needs a CUDA device, the model is on {device.type}"
    if dtype not in dtypes:
        return dtype_problem.format(name=name, dtype=dtype)
    return None


def backend_unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run packed attention on ``device`` / ``dtype``; ``None`` when it can."""
    device = torch.device(device)
    if backend in ("sdpa", "eager"):
        return None
    half_only = "{name} needs float16 or bfloat16, the model computes in {dtype}"
    if backend == "flash":
        return _kernel_unavailable_reason(
            _flash_varlen_kernel(),
            device,
            dtype,
            name="flash-attn",
            not_installed="flash-attn is not installed (pip install flash-attn)",
            dtypes=_FLASH_DTYPES,
            dtype_problem=half_only,
        )
    if backend == "torch_varlen":
        reason = _kernel_unavailable_reason(
            _torch_varlen_kernel(),
            device,
            dtype,
            name="torch's varlen_attn",
            not_installed="this torch has no torch.nn.attention.varlen.varlen_attn (torch 2.10 or later)",
            dtypes=_FLASH_DTYPES,
            dtype_problem=half_only,
        )
        return reason or _cuda_flash_unsupported_reason(device)
    if backend == "xformers":
        return _kernel_unavailable_reason(
            _xformers_fmha(),
            device,
            dtype,
            name="xformers",
            not_installed="xformers is not installed (pip install xformers)",
            dtypes=_XFORMERS_DTYPES,
            dtype_problem="{name} does not support {dtype}",
        )
    raise ValueError(f"Unknown packed attention backend {backend!r}; choose one of {', '.join(BACKENDS)}.")


class BackendChoice(NamedTuple):
    """The packed attention backend and why it was chosen."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def _missing_features(backend: str, features: frozenset[str], head_dim: int | None) -> list[str]:
    """What ``backend`` cannot apply of ``features`` (keys of :data:`_FEATURE_NAMES`) and ``head_dim``, described."""
    missing = [_FEATURE_NAMES[name] for name in sorted(features - _CAPABILITIES[backend])]
    if backend in ("flash", "torch_varlen") and head_dim is not None and head_dim > _FLASH_MAX_HEAD_DIM:
        missing.append(f"head_dim {head_dim} (its kernel takes at most {_FLASH_MAX_HEAD_DIM})")
    return missing


def _features(*, softcap: bool, sinks: bool, dropout: bool, alibi: bool = False) -> frozenset[str]:
    flags = {"softcap": softcap, "sinks": sinks, "dropout": dropout, "alibi": alibi}
    return frozenset(name for name, wanted in flags.items() if wanted)


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
) -> BackendChoice:
    """Which backend packed attention uses for inputs on ``device`` in ``dtype``.

    ``UNPACK_ATTENTION_BACKEND`` wins (and is an error if that backend cannot run here, or cannot apply the requested
    features). A model loaded with ``attn_implementation="eager"`` keeps eager. Otherwise the first of flash-attn,
    torch's ``varlen_attn``, xformers and SDPA that can run here and can apply the features; eager when none can.

    Args:
        softcap, sinks, dropout: whether the call applies logit softcapping, attention sinks (``s_aux``), dropout.
        head_dim: the larger of the query and value head dims (flash kernels take at most 256); ``None``: unknown.
        alibi: whether the call adds ALiBi position biases (bloom, mpt).
    """
    wanted = _features(softcap=softcap, sinks=sinks, dropout=dropout, alibi=alibi)
    forced = os.environ.get(ENV_BACKEND, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={forced!r} is not a backend; choose one of {', '.join(BACKENDS)}.")
        reason = backend_unavailable_reason(forced, device, dtype)
        if reason is not None:
            raise ValueError(f"{ENV_BACKEND}={forced} but {reason}. Unset {ENV_BACKEND} to choose automatically.")
        missing = _missing_features(forced, wanted, head_dim)
        if missing:
            able = [name for name in BACKENDS if not _missing_features(name, wanted, head_dim)]
            raise ValueError(
                f"{ENV_BACKEND}={forced} cannot apply {' and '.join(missing)}, which this model's attention uses; "
                f"set it to {' or '.join(able)}, or unset {ENV_BACKEND} to choose automatically."
            )
        return BackendChoice(forced, f"forced by {ENV_BACKEND}")
    if original_implementation == "eager":
        return BackendChoice("eager", "the model was loaded with attn_implementation='eager'")
    skipped = []
    for backend in _AUTOMATIC_ORDER:
        reason = backend_unavailable_reason(backend, device, dtype)
        if reason is not None:
            skipped.append(reason)
            continue
        missing = _missing_features(backend, wanted, head_dim)
        if missing:
            skipped.append(f"{backend} cannot apply {' and '.join(missing)}")
            continue
        if backend == "sdpa":
            reason = "no kernel backend: " + "; ".join(skipped) if skipped else "SDPA"
            return BackendChoice("sdpa", reason)
        reason = f"{backend} available on {torch.device(device).type} for {dtype}"
        return BackendChoice(backend, reason + ("; skipped: " + "; ".join(skipped) if skipped else ""))
    return BackendChoice("eager", "; ".join(skipped))


# --------------------------------------------------------------------------------------------------------------------
# Backends: ``backend(query, key, value, info, options) -> attn_output`` (see _BackendFunction), each caching what it
# derives from the samples on ``info`` through PackedSeqInfo.plan, under its own owner name.
# --------------------------------------------------------------------------------------------------------------------


class _CallOptions(NamedTuple):
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


class _BackendFunction(Protocol):
    """One backend: the contract of :func:`packed_attention_forward` on its inputs.

    ``query`` ``(B, num_heads, T, head_dim)``, ``key`` ``(B, num_kv_heads, T, head_dim)``, ``value``
    ``(B, num_kv_heads, T, head_dim_v)``, one float dtype, ``num_kv_heads`` dividing ``num_heads`` (query head ``h``
    reads kv head ``h // (num_heads // num_kv_heads)``); ``info``: the samples, tiling the ``B * T`` tokens. Returns
    ``(B, T, num_heads, head_dim_v)`` in query's dtype, causal attention within each sample. Every query sees at
    least itself, so no row is ever fully masked. An option the backend cannot apply (``_CAPABILITIES``) is refused
    before dispatch, so it arrives as ``None`` / 0.0.
    """

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions
    ) -> Tensor: ...


def _tokens_major(x: Tensor) -> Tensor:
    """(B, num_heads, T, head_dim) -> (total_tokens, num_heads, head_dim), total_tokens = B * T; a view when B == 1."""
    batch_size, num_heads, seq_len, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch_size * seq_len, num_heads, head_dim)


def _repeat_heads(x: Tensor, heads_per_kv: int) -> Tensor:
    """(n, num_kv_heads, L, head_dim) -> (n, num_kv_heads * heads_per_kv, L, head_dim), each kv head repeated
    ``heads_per_kv`` times (transformers' repeat_kv)."""
    if heads_per_kv == 1:
        return x
    n, num_kv_heads, length, head_dim = x.shape
    expanded = x[:, :, None].expand(n, num_kv_heads, heads_per_kv, length, head_dim)
    return expanded.reshape(n, num_kv_heads * heads_per_kv, length, head_dim)


# -- SDPA and eager: samples bucketed by length --------------------------------------------------------------------


class _Bucket(NamedTuple):
    length: int  # L: the longest sample of the bucket; every sample is padded to it
    count: int  # n: samples in the bucket
    # Branch buckets (shared prefixes, :meth:`PackedSeqInfo.branch_spans`) only: Lk, the longest key span; each
    # unit's queries are aligned to the end of its keys. 0 for a causal bucket (the keys are the queries).
    key_length: int = 0
    query_lengths: Tensor | None = None  # (n,) int64 CPU q_u, branch buckets only
    key_lengths: Tensor | None = None  # (n,) int64 CPU k_u >= q_u, branch buckets only


class _SdpaPlan(NamedTuple):
    """Samples grouped by length. Slots are the padded tokens of all buckets, bucket after bucket, each bucket
    ``(n, L)`` row-major; a sample's real tokens fill the first slots of its row, padding the rest.

    A branch plan (:func:`_branch_plan`) also has key slots, ``(n, Lk)`` per bucket, read through ``key_gather``."""

    buckets: list[_Bucket]
    sizes: list[int]  # n * L slots per bucket
    gather: Tensor  # (num_slots,) int64: token read by each slot (padding repeats the sample's first token)
    scatter: Tensor  # (total_tokens,) int64: slot of each token
    pad_slots: Tensor  # (num_slots,) bool: True at padding slots
    key_gather: Tensor | None = None  # (num_key_slots,) int64: token read by each key slot (branch plans only)
    key_sizes: list[int] | None = None  # n * Lk key slots per bucket (branch plans only)


def _group_sorted_lengths(
    sorted_lengths: Tensor, *, call_cost: float = _CALL_COST_PAIRS, power: int = 2
) -> list[tuple[int, int]]:
    """Split ascending lengths into contiguous ``[begin, end)`` groups minimising
    ``sum(call_cost + (end - begin) * max_length**power)`` (dynamic programming over distinct lengths): ``power=2``
    for attention (cost per sample quadratic in its padded length), ``power=1`` for the token mixers of
    :mod:`unpack_trainer.patches.mixers` (linear)."""
    longest = int(sorted_lengths[-1])
    step = -(-longest // _MAX_DISTINCT_LENGTHS)
    keys = (sorted_lengths + step - 1) // step * step if step > 1 else sorted_lengths
    distinct, counts = torch.unique_consecutive(keys, return_counts=True)
    prefix = torch.zeros(distinct.numel() + 1, dtype=torch.float64)
    torch.cumsum(counts.to(torch.float64), dim=0, out=prefix[1:])
    squares = distinct.to(torch.float64) ** power
    best = torch.zeros(distinct.numel() + 1, dtype=torch.float64)
    split = [0] * (distinct.numel() + 1)
    for end in range(1, distinct.numel() + 1):
        # A group covering distinct lengths [begin, end) pays its call plus its samples padded to distinct[end - 1].
        candidates = best[:end] - prefix[:end] * squares[end - 1]
        begin = int(torch.argmin(candidates))
        best[end] = candidates[begin] + prefix[end] * squares[end - 1] + call_cost
        split[end] = begin
    bounds, end = [], distinct.numel()
    while end > 0:
        bounds.append((split[end], end))
        end = split[end]
    offsets = prefix.to(torch.int64).tolist()
    return [(offsets[begin], offsets[end]) for begin, end in reversed(bounds)]


def _sdpa_plan(info: PackedSeqInfo, device: torch.device) -> _SdpaPlan:
    """The samples of ``info`` bucketed by length for batched per-sample attention (SDPA and eager), index tensors on
    ``device``; built once per batch and device."""
    return info.plan("buckets", str(device), lambda: _build_sdpa_plan(info, device))


def _build_sdpa_plan(
    info: PackedSeqInfo, device: torch.device, *, call_cost: float = _CALL_COST_PAIRS, power: int = 2
) -> _SdpaPlan:
    lengths = info.seq_lengths.to(torch.int64)
    starts = info.cu_seqlens[:-1].to(torch.int64)
    order = torch.argsort(lengths, stable=True)
    groups = _group_sorted_lengths(lengths[order], call_cost=call_cost, power=power)

    buckets: list[_Bucket] = []
    gathers, pads = [], []
    scatter = torch.empty(info.total_tokens, dtype=torch.int64)
    offset = 0
    for begin, end in groups:
        members = order[begin:end]
        bucket = _Bucket(int(lengths[members].max()), end - begin)
        gather, pad = _fill_slots(starts[members], lengths[members], bucket.length, offset, scatter)
        gathers.append(gather)
        pads.append(pad)
        buckets.append(bucket)
        offset += bucket.count * bucket.length
    return _finish_plan(buckets, gathers, scatter, pads, device)


def _padded_spans(starts: Tensor, lengths: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """``(n, length)`` int64 indices of ``n`` spans (``starts``, ``lengths``: ``(n,)`` int64), padding repeating each
    span's first index, and the ``(n, length)`` bool mask of the real entries."""
    steps = torch.arange(length, dtype=torch.int64)
    valid = steps.unsqueeze(0) < lengths.unsqueeze(1)
    index = starts.unsqueeze(1) + steps.unsqueeze(0)
    return torch.where(valid, index, starts.unsqueeze(1)), valid


def _fill_slots(
    starts: Tensor, lengths: Tensor, length: int, offset: int, scatter: Tensor
) -> tuple[Tensor, Tensor]:
    """The ``(n, L)`` query slots of one bucket from slot ``offset`` on: ``(gather, pad)`` flattened, the token each
    slot reads (padding repeats the sample's first token: finite values that only padded queries ever see) and True
    at padding slots; ``scatter[token] = slot`` is set for the bucket's real tokens."""
    tokens, valid = _padded_spans(starts, lengths, length)
    slots = offset + torch.arange(tokens.numel(), dtype=torch.int64).view_as(tokens)
    scatter[tokens[valid]] = slots[valid]
    return tokens.reshape(-1), ~valid.reshape(-1)


def _finish_plan(
    buckets: list[_Bucket],
    gathers: list[Tensor],
    scatter: Tensor,
    pads: list[Tensor],
    device: torch.device,
    key_gathers: list[Tensor] | None = None,
    key_sizes: list[int] | None = None,
) -> _SdpaPlan:
    """The :class:`_SdpaPlan` of the buckets, index tensors moved to ``device``."""
    return _SdpaPlan(
        buckets,
        [bucket.count * bucket.length for bucket in buckets],
        torch.cat(gathers).to(device, non_blocking=True),
        scatter.to(device, non_blocking=True),
        torch.cat(pads).to(device, non_blocking=True),
        None if key_gathers is None else torch.cat(key_gathers).to(device, non_blocking=True),
        key_sizes,
    )


def _branch_plan(info: PackedSeqInfo, device: torch.device) -> _SdpaPlan | None:
    """The units of a branched batch (:meth:`PackedSeqInfo.branch_spans`) bucketed for SDPA and eager, every query
    computed once; ``None`` when the spans are not contiguous. Built once per batch and device.

    Units whose keys are their queries (a prefix with its first branch, a sample without branches) are bucketed as in
    :func:`_build_sdpa_plan` and run causally; the later branches of a prefix (queries = the branch, keys =
    ``[prefix; branch]``) are bucketed by key length and run with a bottom-right causal mask (:func:`_branch_mask`).
    """

    def build() -> _SdpaPlan | None:
        spans = info.branch_spans()
        if spans is None:
            return None
        key_starts = zero_prefixed_cumsum(spans.key_lengths)[:-1]
        same = spans.key_lengths == spans.query_lengths
        buckets: list[_Bucket] = []
        gathers, pads, key_gathers, key_sizes = [], [], [], []
        scatter = torch.empty(info.total_tokens, dtype=torch.int64)
        offset = 0
        for branch, units in ((False, torch.nonzero(same).reshape(-1)), (True, torch.nonzero(~same).reshape(-1))):
            if units.numel() == 0:
                continue
            # causal units grouped by their length, branch units by their key length
            sorted_lengths, permutation = spans.key_lengths[units].sort(stable=True)
            order = units[permutation]
            for begin, end in _group_sorted_lengths(sorted_lengths):
                members = order[begin:end]
                q_lengths, k_lengths = spans.query_lengths[members], spans.key_lengths[members]
                length, key_length, count = int(q_lengths.max()), int(k_lengths.max()), end - begin
                gather, pad = _fill_slots(spans.query_starts[members], q_lengths, length, offset, scatter)
                gathers.append(gather)
                pads.append(pad)
                offset += count * length
                # Key slots: the unit's keys, padding repeating its first key (masked out, or after every real query).
                key_index, _ = _padded_spans(key_starts[members], k_lengths, key_length)
                key_gathers.append(spans.key_gather[key_index].reshape(-1))
                key_sizes.append(count * key_length)
                if branch:
                    buckets.append(_Bucket(length, count, key_length, q_lengths, k_lengths))
                else:
                    buckets.append(_Bucket(length, count))
        return _finish_plan(buckets, gathers, scatter, pads, device, key_gathers, key_sizes)

    return info.plan("branch_buckets", str(device), build)


def _branch_mask(
    info: PackedSeqInfo, bucket_index: int, bucket: _Bucket, sliding_window: int | None, device: torch.device
) -> Tensor:
    """``(n, 1, L, Lk)`` bool on ``device`` of a branch bucket, True where query ``i`` of unit ``u`` may see key ``j``:
    the query sits at position ``p = k_u - q_u + i`` of its keys (bottom-right alignment), so ``j <= p``, ``j < k_u``
    and, with a window ``w``, ``j > p - w``. A padding query (``i >= q_u``) sees key 0 only (finite, dropped)."""

    def build() -> Tensor:
        q_lengths = bucket.query_lengths.view(-1, 1, 1, 1)
        k_lengths = bucket.key_lengths.view(-1, 1, 1, 1)
        i = torch.arange(bucket.length).view(1, 1, -1, 1)
        j = torch.arange(bucket.key_length).view(1, 1, 1, -1)
        position = k_lengths - q_lengths + i
        allowed = (j <= position) & (j < k_lengths)
        if sliding_window is not None:
            allowed &= j > position - sliding_window
        padding = (i >= q_lengths) & (j == 0)
        return (torch.where(i < q_lengths, allowed, padding)).to(device, non_blocking=True)

    return info.plan("branch_masks", (bucket_index, sliding_window, str(device)), build)


def _branch_additive_mask(
    info: PackedSeqInfo,
    bucket_index: int,
    bucket: _Bucket,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """:func:`_branch_mask` as an ``(n, 1, L, Lk)`` ``dtype`` additive mask: 0 where allowed, ``finfo(dtype).min``
    elsewhere (finite, as :func:`_additive_mask`)."""

    def build() -> Tensor:
        allowed = _branch_mask(info, bucket_index, bucket, sliding_window, device)
        return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)

    return info.plan("branch_additive_masks", (bucket_index, sliding_window, dtype, str(device)), build)


def _band_mask(info: PackedSeqInfo, length: int, sliding_window: int, device: torch.device) -> Tensor:
    """``(L, L)`` bool on ``device``, True where query ``i`` may see key ``j``: ``i - sliding_window < j <= i``."""

    def build() -> Tensor:
        i = torch.arange(length, device=device).unsqueeze(1)
        j = torch.arange(length, device=device).unsqueeze(0)
        return (j <= i) & (j > i - sliding_window)

    return info.plan("band_masks", (length, sliding_window, str(device)), build)


def _additive_mask(
    info: PackedSeqInfo, length: int, sliding_window: int | None, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``(L, L)`` ``dtype`` on ``device``: 0 where attention is allowed (causal, within the window),
    ``finfo(dtype).min`` elsewhere (finite, so even a fully masked row would give uniform weights, never NaN)."""

    def build() -> Tensor:
        window = sliding_window if sliding_window is not None else length + 1
        allowed = _band_mask(info, length, window, device)
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)

    return info.plan("additive_masks", (length, sliding_window, dtype, str(device)), build)


def _alibi_bias(
    info: PackedSeqInfo,
    length: int,
    sliding_window: int | None,
    slopes: Tensor,
    dtype: torch.dtype,
    device: torch.device,
    *,
    masked: bool = True,
) -> Tensor:
    """``(num_heads, L, L)`` ``dtype`` ALiBi biases of one bucket: ``-slopes[h] * (i - j)`` where query ``i`` may see
    key ``j`` (causal, within the window) and, with ``masked``, ``finfo(dtype).min`` elsewhere (else 0 there).
    Bucketed samples start at slot 0, so ``i`` and ``j`` count from the sample's start, as the model computes them for
    a sample alone (its ``slope * j`` differs by ``slope * i`` per query, which the softmax does not see)."""
    positions = torch.arange(length, device=device, dtype=torch.float32)
    distance = (positions.unsqueeze(1) - positions.unsqueeze(0)).clamp_min(0)  # (L, L) i - j, 0 above the diagonal
    bias = (-slopes.to(device=device, dtype=torch.float32).view(-1, 1, 1) * distance).to(dtype)
    if not masked:
        return bias
    window = sliding_window if sliding_window is not None else length + 1
    return bias.masked_fill(~_band_mask(info, length, window, device), torch.finfo(dtype).min)


@functools.cache
def _sdpa_supports_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (probed once on a tiny CPU input)."""
    try:
        probe = torch.zeros(1, 2, 1, 4)
        F.scaled_dot_product_attention(probe, probe[:, :1], probe[:, :1], enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


class _GatherSlots(torch.autograd.Function):
    """``tokens (N, ...) -> slots (S, ...)``, ``slots = tokens[gather]``; padding slots are constants for autograd.

    Every token has exactly one real slot (``scatter``), so the backward is a gather too (no scatter-add). Dropping
    the padding slots' gradient is exact here: padding sits after each sample's real tokens, so under causal
    attention no real query sees it, and padded queries get a zero output gradient (:class:`_ScatterTokens`).
    """

    @staticmethod
    def forward(ctx, tokens: Tensor, gather: Tensor, scatter: Tensor) -> Tensor:
        ctx.save_for_backward(scatter)
        return tokens.index_select(0, gather)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (scatter,) = ctx.saved_tensors
        return grad.index_select(0, scatter), None, None


class _ScatterTokens(torch.autograd.Function):
    """``slots (S, ...) -> tokens (N, ...)``, ``tokens = slots[scatter]``; padding slots get a zero gradient."""

    @staticmethod
    def forward(ctx, slots: Tensor, scatter: Tensor, gather: Tensor, pad_slots: Tensor) -> Tensor:
        ctx.save_for_backward(gather, pad_slots)
        return slots.index_select(0, scatter)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gather, pad_slots = ctx.saved_tensors
        grad_slots = grad.index_select(0, gather)
        grad_slots.masked_fill_(pad_slots.view(-1, *([1] * (grad_slots.dim() - 1))), 0)
        return grad_slots, None, None, None


def _bucketed(x_tokens: Tensor, plan: _SdpaPlan) -> list[Tensor]:
    """(total_tokens, num_heads, head_dim) tokens -> one (n, num_heads, L, head_dim) padded batch per bucket."""
    num_heads, head_dim = x_tokens.shape[1:]
    slots = _GatherSlots.apply(x_tokens, plan.gather, plan.scatter)
    return [
        part.view(bucket.count, bucket.length, num_heads, head_dim).transpose(1, 2)
        for part, bucket in zip(slots.split(plan.sizes), plan.buckets)
    ]


def _key_bucketed(x_tokens: Tensor, plan: _SdpaPlan) -> list[Tensor]:
    """(total_tokens, num_kv_heads, head_dim) keys or values -> one (n, num_kv_heads, Lk, head_dim) batch per bucket:
    :func:`_bucketed` for a plain plan; the key slots of a branch plan (a prefix's keys read by each of its units,
    autograd summing their gradients)."""
    if plan.key_gather is None:
        return _bucketed(x_tokens, plan)
    num_heads, head_dim = x_tokens.shape[1:]
    slots = x_tokens.index_select(0, plan.key_gather)
    return [
        part.view(bucket.count, bucket.key_length or bucket.length, num_heads, head_dim).transpose(1, 2)
        for part, bucket in zip(slots.split(plan.key_sizes), plan.buckets)
    ]


def _unbucketed(outputs: list[Tensor], plan: _SdpaPlan, batch_size: int, seq_len: int) -> Tensor:
    """One (n, num_heads, L, head_dim) output per bucket -> (B, T, num_heads, head_dim) in token order."""
    num_heads, head_dim = outputs[0].shape[1], outputs[0].shape[3]
    flat = [out.transpose(1, 2).reshape(-1, num_heads, head_dim) for out in outputs]
    slots = flat[0] if len(flat) == 1 else torch.cat(flat)
    out = _ScatterTokens.apply(slots, plan.scatter, plan.gather, plan.pad_slots)
    return out.view(batch_size, seq_len, num_heads, head_dim)


def _sdpa_packed(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions) -> Tensor:
    """Per-sample causal attention through ``F.scaled_dot_product_attention``, one call per bucket of similar lengths.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)`` in any float dtype SDPA takes -> ``(B, T, num_heads, head_dim_v)``. Each
    bucket is a padded ``(n, num_heads, L, head_dim)`` batch, padding after each sample's tokens where no real query
    sees it (cached under ``"buckets"``).

    GQA: ``enable_gqa`` where this torch has it and the bucket runs ``is_causal``, else each kv head repeated
    ``num_heads // num_kv_heads`` times. Window ``w``: a ``(L, L)`` band mask ``i - w < j <= i`` on each bucket longer
    than ``w`` (a shorter one stays ``is_causal``). Dropout: SDPA's ``dropout_p``. Softcap, sinks: refused. No query
    row is fully masked (each sees itself, padded ones included). ALiBi: a float ``(num_heads, L, L)`` mask of the
    per-sample biases (:func:`_alibi_bias`) on every bucket.
    """
    return _sdpa_buckets(query, key, value, info, options, _sdpa_plan(info, query.device))


def _sdpa_buckets(
    query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions, plan: _SdpaPlan
) -> Tensor:
    """:func:`_sdpa_packed` on the buckets of ``plan``: a plain plan, or a branch plan (:func:`_branch_plan`) whose
    branch buckets run with their bottom-right causal masks (windows applied; ALiBi never reaches one)."""
    batch_size, num_heads, seq_len, _ = query.shape
    heads_per_kv = num_heads // key.shape[1]
    window = options.sliding_window
    qs = _bucketed(_tokens_major(query), plan)
    ks, vs = (_key_bucketed(_tokens_major(x), plan) for x in (key, value))
    outputs = []
    for index, (bucket, q, k, v) in enumerate(zip(plan.buckets, qs, ks, vs)):
        mask = None
        if bucket.key_length:
            mask = _branch_mask(info, index, bucket, window, query.device)
        elif options.alibi_slopes is not None:
            mask = _alibi_bias(info, bucket.length, window, options.alibi_slopes, query.dtype, query.device)
        elif window is not None and bucket.length > window:
            mask = _band_mask(info, bucket.length, window, query.device)
        extra = {}
        if heads_per_kv > 1:
            if mask is None and _sdpa_supports_gqa():
                extra["enable_gqa"] = True
            else:
                k, v = _repeat_heads(k, heads_per_kv), _repeat_heads(v, heads_per_kv)
        outputs.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=options.dropout,
                is_causal=mask is None,
                scale=options.scaling,
                **extra,
            )
        )
    return _unbucketed(outputs, plan, batch_size, seq_len)


def _eager_packed(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions) -> Tensor:
    """``softmax(softcap(QK^T * scaling) + mask) V`` per bucket, as transformers' eager functions compute it: the
    readable reference, and the one backend that applies sinks.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)`` in any float dtype -> ``(B, T, num_heads, head_dim_v)``; the softmax runs in
    float32. The SDPA buckets (``"buckets"``), run in chunks of at most ``_EAGER_MAX_SCORE_ELEMENTS`` scores.

    GQA: each kv head repeated ``num_heads // num_kv_heads`` times. Window ``w``: keys ``i - w < j <= i``, through an
    additive ``(L, L)`` mask of ``finfo(dtype).min`` (finite: never NaN; no query row is fully masked anyway).
    Softcap ``c``: ``tanh(scores / c) * c`` before the mask. Sinks ``(num_heads,)``: every query's softmax denominator
    also holds ``exp(sinks[h])``: ``weights = exp(scores - logaddexp(logsumexp(scores), sinks[h]))``, the sink's own
    weight dropped, as gpt_oss's ``eager_attention_forward`` does by concatenating a sink column. Dropout: on the
    weights, only while ``options.module.training``. ALiBi: ``-slopes[h] * (i - j)`` added to the scores.
    """
    return _eager_buckets(query, key, value, info, options, _sdpa_plan(info, query.device))


def _eager_buckets(
    query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions, plan: _SdpaPlan
) -> Tensor:
    """:func:`_eager_packed` on the buckets of ``plan``: a plain plan, or a branch plan (:func:`_branch_plan`) whose
    branch buckets add their bottom-right causal masks as ``(n, 1, L, Lk)`` additive masks (ALiBi never reaches
    one)."""
    batch_size, num_heads, seq_len, _ = query.shape
    heads_per_kv = num_heads // key.shape[1]
    scaling, softcap = options.scaling, options.softcap
    qs = _bucketed(_tokens_major(query), plan)
    ks, vs = (_key_bucketed(_tokens_major(x), plan) for x in (key, value))
    dropout = options.dropout if getattr(options.module, "training", False) else 0.0
    sink_logits = None
    if options.sinks is not None:
        sink_logits = options.sinks.to(device=query.device, dtype=torch.float32).view(1, num_heads, 1, 1)
    outputs = []
    for index, (bucket, q_bucket, k_bucket, v_bucket) in enumerate(zip(plan.buckets, qs, ks, vs)):
        length, key_length = bucket.length, bucket.key_length or bucket.length
        if bucket.key_length:
            mask = _branch_additive_mask(info, index, bucket, options.sliding_window, query.dtype, query.device)
        else:
            mask = _additive_mask(info, length, options.sliding_window, query.dtype, query.device)
        per_chunk = max(1, _EAGER_MAX_SCORE_ELEMENTS // (num_heads * length * key_length))
        masks = mask.split(per_chunk) if mask.dim() == 4 else [mask] * (-(-bucket.count // per_chunk))
        chunks = []
        splits = (q_bucket.split(per_chunk), k_bucket.split(per_chunk), v_bucket.split(per_chunk), masks)
        for q, k, v, mask in zip(*splits):
            k, v = _repeat_heads(k, heads_per_kv), _repeat_heads(v, heads_per_kv)
            # (QK^T) * scaling, in place, rounded as transformers' eager functions round it (scaling q first differs
            # by an ulp, which a model can amplify: CTRL's tied embedding gradient by ~1e-4); the softcap's tanh takes
            # the scale with the cap.
            if softcap is None:
                scores = torch.matmul(q, k.transpose(2, 3)).mul_(scaling)
            else:
                scores = torch.tanh(torch.matmul(q * (scaling / softcap), k.transpose(2, 3))) * softcap
            scores.add_(mask)  # in place: neither the matmul nor the softcap's multiply needs its output back
            if options.alibi_slopes is not None:
                scores.add_(
                    _alibi_bias(info, length, None, options.alibi_slopes, query.dtype, query.device, masked=False)
                )
            if sink_logits is None:
                weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            else:
                logits = scores.float()
                normaliser = torch.logaddexp(torch.logsumexp(logits, dim=-1, keepdim=True), sink_logits)
                weights = torch.exp(logits - normaliser).to(query.dtype)
            if dropout > 0:
                weights = F.dropout(weights, p=dropout, training=True)
            chunks.append(torch.matmul(weights, v))
        outputs.append(chunks[0] if len(chunks) == 1 else torch.cat(chunks))
    return _unbucketed(outputs, plan, batch_size, seq_len)


# -- flash-attn and torch's varlen_attn: one (total_tokens, num_heads, head_dim) call with cu_seqlens ---------------


class _FlashChunk(NamedTuple):
    first_seq: int  # index of the chunk's first sample
    begin: int  # token range [begin, end) of the chunk
    end: int
    max_seqlen: int
    cu_seqlens: Tensor | None  # (n + 1,) int32 on the device, zero-based; None when flash-attn cannot take it
    fallback: PackedSeqInfo | None  # the chunk's own metadata, for another backend


def _flash_rounded_head_dim(head_dim: int) -> int:
    """The head dimension flash-attn allocates its backward accumulator with (rounded to 32, or 64 above 128)."""
    multiple = 32 if head_dim <= 128 else 64
    return -(-head_dim // multiple) * multiple


def _flash_fits(tokens: int, num_seqs: int, num_heads: int, head_dim: int) -> bool:
    """Whether flash-attn's varlen backward accumulator for ``num_seqs`` sequences of ``tokens`` tokens in all stays
    within its 32-bit offsets: ``(tokens + 128 * num_seqs) * num_heads * rounded head_dim <= _FLASH_MAX_ELEMENTS``."""
    return (tokens + 128 * num_seqs) * num_heads * _flash_rounded_head_dim(head_dim) <= _FLASH_MAX_ELEMENTS


def _flash_chunks(info: PackedSeqInfo, num_heads: int, head_dim: int, device: torch.device) -> list[_FlashChunk]:
    """Split the samples into chunks small enough for flash-attn's 32-bit offsets (one chunk in the usual case).

    Chunks end at sample boundaries. A sample too large on its own is a chunk of its own with ``cu_seqlens``
    ``None``, for the caller to send elsewhere. Built once per batch, head count, head dim and device.
    """

    def build() -> list[_FlashChunk]:
        lengths = info.seq_lengths.tolist()
        bounds: list[tuple[int, int]] = []
        first, tokens = 0, 0
        for index, length in enumerate(lengths):
            if index > first and not _flash_fits(tokens + length, index - first + 1, num_heads, head_dim):
                bounds.append((first, index))
                first, tokens = index, 0
            tokens += length
        bounds.append((first, len(lengths)))
        chunks = []
        for first, last in bounds:
            begin, end = int(info.cu_seqlens[first]), int(info.cu_seqlens[last])
            longest = max(lengths[first:last])
            if not _flash_fits(end - begin, last - first, num_heads, head_dim):
                sub = PackedSeqInfo(info.seq_lengths[first:last], batch_size=1, seq_len=end - begin)
                chunks.append(_FlashChunk(first, begin, end, longest, None, sub))
            else:
                cu_seqlens = (info.cu_seqlens[first : last + 1] - info.cu_seqlens[first]).to(device, non_blocking=True)
                chunks.append(_FlashChunk(first, begin, end, longest, cu_seqlens, None))
        return chunks

    return info.plan("varlen_chunks", (num_heads, head_dim, str(device)), build)


def _varlen_window(longest: int, sliding_window: int | None) -> tuple[int, int] | None:
    """flash-attn's ``window_size`` for transformers' window ``w`` (keys ``i - w < j <= i``): ``(w - 1, 0)``, inclusive
    on both sides; ``None`` when there is no window or no sequence (of ``longest`` keys at most) is longer than it
    (plain causal attention)."""
    if sliding_window is not None and longest > sliding_window:
        return (sliding_window - 1, 0)
    return None


def _one_head_dim(q: Tensor, k: Tensor, v: Tensor, multiple: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(tokens, heads, head_dim)`` q and k and ``(tokens, heads, head_dim_v)`` v zero-padded to one head dim, the
    smallest multiple of ``multiple`` not below either (zero columns leave every score unchanged; the caller crops
    the output's padded value columns)."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    padded = -(-max(head_dim, head_dim_v) // multiple) * multiple
    q, k = (F.pad(x, (0, padded - head_dim)) if padded != head_dim else x for x in (q, k))
    return q, k, F.pad(v, (0, padded - head_dim_v)) if padded != head_dim_v else v


def _flash_kernel_options(options: _CallOptions, longest: int, device: torch.device) -> dict[str, Any]:
    """``flash_attn_varlen_func``'s keyword arguments for ``options``, sequences of at most ``longest`` keys: causal
    (bottom-right where a sequence has more keys than queries), the window ``(w - 1, 0)`` where one binds, softcap,
    dropout and ALiBi slopes (float32 ``(num_heads,)``)."""
    kernel_options: dict[str, Any] = {"dropout_p": options.dropout, "softmax_scale": options.scaling, "causal": True}
    window = _varlen_window(longest, options.sliding_window)
    if window is not None:
        kernel_options["window_size"] = window
    if options.softcap is not None:
        kernel_options["softcap"] = options.softcap
    if options.alibi_slopes is not None:
        # flash-attn adds -slope * |i - j| (i, j within the sequence of cu_seqlens): the per-sample bias.
        kernel_options["alibi_slopes"] = options.alibi_slopes.to(device=device, dtype=torch.float32)
    return kernel_options


# kernel_call(q, k, v, cu_seqlens, max_seqlen): q/k/v (tokens, num_heads or num_kv_heads, padded head_dim), cu_seqlens
# (num_seqs + 1,) int32 on the device -> (tokens, num_heads, padded head_dim).
_VarlenCall = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]


def _varlen_packed(
    kernel_call: _VarlenCall,
    kernel_name: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    info: PackedSeqInfo,
    options: _CallOptions,
    *,
    head_dim_multiple: int,
) -> Tensor:
    """Shared by flash-attn and torch's varlen_attn: ``(total_tokens, num_heads, head_dim)`` inputs with one head dim
    for q, k and v (zero-padded up to ``head_dim_multiple``), the samples' ``cu_seqlens`` and ``max_seqlen``, rows
    split into chunks (cached under ``"varlen_chunks"``) where the kernel's 32-bit offsets would overflow; a sample
    too large alone runs on SDPA (eager with ``softcap``). Zero padding of q and k leaves every score unchanged
    (``scaling`` is explicit); padded value columns are cropped from the output.

    Returns ``(B, T, num_heads, head_dim_v)``.
    """
    batch_size, num_heads, seq_len, head_dim = query.shape
    head_dim_v = value.shape[-1]
    # (total_tokens, num_heads, head_dim), contiguous as transformers hands them to flash-attn.
    q_tokens, k_tokens, v_tokens = (_tokens_major(x).contiguous() for x in (query, key, value))
    q_in, k_in, v_in = _one_head_dim(q_tokens, k_tokens, v_tokens, head_dim_multiple)
    padded = q_in.shape[-1]

    def crop(out: Tensor) -> Tensor:
        return out[..., :head_dim_v] if padded != head_dim_v else out

    chunks = _flash_chunks(info, num_heads, padded, query.device)
    if len(chunks) == 1 and chunks[0].cu_seqlens is not None:
        out = crop(kernel_call(q_in, k_in, v_in, chunks[0].cu_seqlens, info.max_seqlen))
        return out.reshape(batch_size, seq_len, num_heads, head_dim_v)
    log_once(
        logger,
        logging.WARNING,
        f"A packed batch of {info.total_tokens} tokens x {num_heads} heads x head_dim {padded} exceeds "
        f"{kernel_name}'s 32-bit offsets; it is run in {len(chunks)} chunks split at sample boundaries.",
    )
    outputs = []
    for chunk in chunks:
        part = slice(chunk.begin, chunk.end)
        if chunk.cu_seqlens is not None:
            outputs.append(crop(kernel_call(q_in[part], k_in[part], v_in[part], chunk.cu_seqlens, chunk.max_seqlen)))
            continue
        fallback = "eager" if options.softcap is not None else "sdpa"
        log_once(
            logger,
            logging.WARNING,
            f"Packed sample {chunk.first_seq} ({chunk.end - chunk.begin} tokens) alone exceeds {kernel_name}'s 32-bit "
            f"offsets; it runs on {fallback} instead.",
        )
        q, k, v = (x[part].transpose(0, 1).unsqueeze(0) for x in (q_tokens, k_tokens, v_tokens))
        out = _BACKEND_FUNCTIONS[fallback](q, k, v, chunk.fallback, options)
        outputs.append(out.reshape(chunk.end - chunk.begin, num_heads, head_dim_v))
    return torch.cat(outputs).view(batch_size, seq_len, num_heads, head_dim_v)


def _flash_packed(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions) -> Tensor:
    """flash-attn's ``flash_attn_varlen_func`` over all samples at once.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)``, float16 or bfloat16 on CUDA -> ``(B, T, num_heads, head_dim_v)``. flash-attn
    2 takes one head dim, at most 256: q, k and v are zero-padded to ``max(head_dim, head_dim_v)``, the output
    cropped. The kernel gets ``cu_seqlens`` ``(num_seqs + 1,)`` int32 and ``max_seqlen`` as they are.

    GQA: the kernel takes ``num_kv_heads`` dividing ``num_heads`` as they are. Window ``w`` (keys
    ``i - w < j <= i``): ``window_size=(w - 1, 0)``, inclusive on both sides, set only where a sample is longer than
    ``w``. Softcap: the kernel's ``softcap``. Dropout: ``dropout_p``. ALiBi: the kernel's ``alibi_slopes`` (float32
    ``(num_heads,)``). Sinks: refused. No query row is fully masked.
    """
    kernel = _flash_varlen_kernel()
    kernel_options = _flash_kernel_options(options, info.max_seqlen, query.device)

    def call(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        # flash-attn takes grouped kv heads as they are, and pads head dims to a multiple of 8 itself.
        return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kernel_options)

    return _varlen_packed(call, "flash-attn", query, key, value, info, options, head_dim_multiple=1)


def _flash_branched(
    query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions
) -> Tensor | None:
    """flash-attn on a branched batch with every query computed once, or ``None`` where the ``[prefix; branch]``
    units serve instead (spans not contiguous, ALiBi, or a batch past the kernel's 32-bit offsets).

    One ``flash_attn_varlen_func`` call over the units of :meth:`PackedSeqInfo.branch_spans`: the queries are the
    row's tokens as they are (``cu_seqlens_q`` from the units' query lengths), the keys and values are gathered as
    ``[prefix; branch]`` per unit (``cu_seqlens_k``), and ``causal=True`` aligns each unit's queries to the end of its
    keys (bottom-right, flash-attn's alignment since 2.1; the window ``(w - 1, 0)`` too). Shapes as
    :func:`_flash_packed`.
    """
    spans = info.branch_spans()
    if spans is None or options.alibi_slopes is not None:
        return None
    batch_size, num_heads, seq_len, head_dim = query.shape
    head_dim_v = value.shape[-1]
    num_keys, num_units = int(spans.key_gather.numel()), int(spans.key_lengths.numel())
    if not _flash_fits(num_keys, num_units, num_heads, max(head_dim, head_dim_v)):  # keys >= queries per unit
        return None
    device = query.device

    def build() -> tuple[Tensor, Tensor, Tensor]:
        cu_q, cu_k = (zero_prefixed_cumsum(x).to(device, torch.int32) for x in (spans.query_lengths, spans.key_lengths))
        return cu_q, cu_k, spans.key_gather.to(device, non_blocking=True)

    cu_q, cu_k, key_gather = info.plan("flash_branch", str(device), build)
    q_in, k_in, v_in = _one_head_dim(
        _tokens_major(query).contiguous(), *(_tokens_major(x).index_select(0, key_gather) for x in (key, value)), 1
    )
    max_q, max_k = int(spans.query_lengths.max()), int(spans.key_lengths.max())
    kernel_options = _flash_kernel_options(options, max_k, device)
    out = _flash_varlen_kernel()(q_in, k_in, v_in, cu_q, cu_k, max_q, max_k, **kernel_options)
    return out[..., :head_dim_v].reshape(batch_size, seq_len, num_heads, head_dim_v)


def _torch_varlen_packed(
    query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions
) -> Tensor:
    """PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10 or later, CUDA sm80 or newer).

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)``, float16 or bfloat16 on CUDA -> ``(B, T, num_heads, head_dim_v)``. q, k and
    v are zero-padded to one head dim, a multiple of 8 (torch's flash kernel asserts it), at most 256; the output is
    cropped. The kernel gets ``cu_seqlens`` ``(num_seqs + 1,)`` int32 and ``max_seqlen`` as they are.

    GQA: ``enable_gqa=True`` where ``varlen_attn`` has that keyword, else each kv head repeated
    ``num_heads // num_kv_heads`` times. Window ``w`` (keys ``i - w < j <= i``): ``window_size=(w - 1, 0)``; causal
    is ``(-1, 0)``. Softcap, sinks, dropout: refused (the kernel has none of them). No query row is fully masked.
    """
    kernel = _torch_varlen_kernel()
    heads_per_kv = query.shape[1] // key.shape[1]
    grouped = heads_per_kv > 1 and _takes_enable_gqa(kernel)
    kernel_options: dict[str, Any] = {
        "scale": options.scaling,
        "window_size": _varlen_window(info.max_seqlen, options.sliding_window) or (-1, 0),  # (-1, 0): causal
    }
    if grouped:
        kernel_options["enable_gqa"] = True

    def call(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        if heads_per_kv > 1 and not grouped:
            k, v = k.repeat_interleave(heads_per_kv, dim=1), v.repeat_interleave(heads_per_kv, dim=1)
        return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kernel_options)

    # torch's flash kernel asserts head_dim % 8 == 0 (flash-attn's Python wrapper pads for us).
    return _varlen_packed(call, "torch varlen_attn", query, key, value, info, options, head_dim_multiple=8)


# -- xformers: memory_efficient_attention with a block-diagonal causal bias ----------------------------------------


def _xformers_bias(info: PackedSeqInfo, sliding_window: int | None, device: torch.device) -> Any:
    """The xformers ``BlockDiagonalCausalMask`` for these samples (made local for a sliding window that binds), built
    once per batch, window and device."""

    def build() -> Any:
        mask_cls = _xformers_fmha().attn_bias.BlockDiagonalCausalMask
        seqlens = info.seq_lengths.tolist()
        if "device" in inspect.signature(mask_cls.from_seqlens).parameters:
            bias = mask_cls.from_seqlens(seqlens, device=device)
        else:
            bias = mask_cls.from_seqlens(seqlens)
        if sliding_window is not None and sliding_window < info.max_seqlen:
            bias = bias.make_local_attention(sliding_window)
        return bias

    return info.plan("xformers_bias", (sliding_window, str(device)), build)


def _xformers_packed(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions) -> Tensor:
    """xformers' ``memory_efficient_attention`` over all samples at once with a ``BlockDiagonalCausalMask``.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)``, float16 / bfloat16 / float32 on CUDA, run as one ``(1, total_tokens, ...)``
    batch -> ``(B, T, num_heads, head_dim_v)``. The bias is cached under ``"xformers_bias"``.

    GQA: xformers' grouped layout ``(1, total_tokens, num_kv_heads, heads_per_kv, head_dim)``, kv heads broadcast
    over the query heads of their group. Window ``w`` (keys ``i - w < j <= i``): the bias's
    ``make_local_attention(w)``. Dropout: ``p``. Softcap, sinks: refused. No query row is fully masked.
    """
    batch_size, num_heads, seq_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    fmha = _xformers_fmha()
    total_tokens = batch_size * seq_len
    q, k, v = (_tokens_major(x).contiguous().unsqueeze(0) for x in (query, key, value))  # (1, total_tokens, H, D)
    if heads_per_kv > 1:
        q = q.reshape(1, total_tokens, num_kv_heads, heads_per_kv, head_dim)
        k = k.unsqueeze(3).expand(1, total_tokens, num_kv_heads, heads_per_kv, head_dim)
        v = v.unsqueeze(3).expand(1, total_tokens, num_kv_heads, heads_per_kv, v.shape[-1])
    bias = _xformers_bias(info, options.sliding_window, query.device)
    out = fmha.memory_efficient_attention(q, k, v, attn_bias=bias, p=options.dropout, scale=options.scaling)
    return out.reshape(batch_size, seq_len, num_heads, -1)


# Dispatch table: tests wrap entries to check which backend ran.
_BACKEND_FUNCTIONS: dict[str, _BackendFunction] = {
    "flash": _flash_packed,
    "torch_varlen": _torch_varlen_packed,
    "xformers": _xformers_packed,
    "sdpa": _sdpa_packed,
    "eager": _eager_packed,
}


def _choice_for(
    info: PackedSeqInfo,
    query: Tensor,
    value: Tensor,
    original: str | None,
    *,
    softcap: bool,
    sinks: bool,
    dropout: bool,
    alibi: bool = False,
) -> BackendChoice:
    """The automatic (or forced) backend of one call, decided once per batch and set of features; a hand-over from
    the backend chosen for plain attention to one that can apply the call's features is logged once."""
    head_dim = max(query.shape[-1], value.shape[-1])
    features = (softcap, sinks, dropout, head_dim, alibi)
    key = (str(query.device), query.dtype, original, features, os.environ.get(ENV_BACKEND))

    def build() -> BackendChoice:
        choice = choose_backend(
            query.device,
            query.dtype,
            original,
            softcap=softcap,
            sinks=sinks,
            dropout=dropout,
            head_dim=head_dim,
            alibi=alibi,
        )
        plain = choose_backend(query.device, query.dtype, original)
        if plain.name != choice.name:
            wanted = _features(softcap=softcap, sinks=sinks, dropout=dropout, alibi=alibi)
            missing = _missing_features(plain.name, wanted, head_dim)
            log_once(
                logger,
                logging.WARNING,
                f"Packed attention: {plain.name} cannot apply {' and '.join(missing)}; using {choice.name} for these "
                "layers.",
            )
        log_once(logger, logging.INFO, f"Packed attention backend: {choice}.")
        return choice

    return info.plan("backend_choice", key, build)


def packed_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    original_implementation: str | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention over a packed batch in which no sample sees another; transformers' attention-function signature.

    Args:
        module: the attention module (read for ``training``, ``is_causal``).
        query: ``(B, num_heads, T, head_dim)``; key: ``(B, num_kv_heads, T, head_dim)``; value:
            ``(B, num_kv_heads, T, head_dim_v)``; one float dtype (flash and torch_varlen: float16 / bfloat16).
            ``num_kv_heads`` divides ``num_heads`` (grouped-query attention: query head ``h`` reads kv head
            ``h // (num_heads // num_kv_heads)``). Keys must be exactly the query tokens (no KV cache of earlier
            tokens).
        attention_mask: ignored on the packed path (the samples define the mask); ``None`` in a patched model.
        scaling: softmax scale, ``1 / sqrt(head_dim)`` when ``None``.
        dropout: attention dropout probability (transformers passes 0.0 outside training).
        sliding_window: each query sees at most this many keys, itself included (query ``i`` sees keys ``j`` with
            ``i - sliding_window < j <= i``, transformers' convention); ``None`` for full causal attention.
        softcap: ``tanh(scores / softcap) * softcap`` logit softcapping (gemma2); flash and eager apply it.
        backend: one of :data:`BACKENDS`; ``None`` chooses with :func:`choose_backend`, handing what a backend
            cannot apply (softcap, sinks, dropout on torch_varlen) to one that can. A ``backend`` that cannot apply
            them raises ``ValueError``.
        original_implementation: the model's attention implementation before patching (for the choice).
        **kwargs: packing metadata, read by :func:`packed_info_from_kwargs`: ``packed_seq_info``,
            ``packed_seq_lengths`` ``(num_seqs,)`` int, ``cu_seq_lens_q`` ``(num_seqs + 1,)`` int32, or
            ``position_ids`` ``(B, T)``. ``s_aux``: attention sinks (gpt_oss), ``(num_heads,)`` one logit per query
            head added to every softmax denominator (eager applies them). ``is_causal`` (default: the module's).
            ``alibi_slopes``: ALiBi (bloom, mpt), ``(num_heads,)`` float, query ``i`` adds ``-slopes[h] * (i - j)`` to
            its score of key ``j``, both counted within the sample (flash's ``alibi_slopes``, SDPA and eager).
            ``attention_chunk_size``: chunked attention (llama4), each query sees the keys of its own chunk of that
            many tokens, chunks counted from its sample's start (:func:`chunked_info`; every backend).

    Returns:
        ``(attn_output, None)`` with ``attn_output`` ``(B, T, num_heads, head_dim_v)`` in ``query``'s dtype;
        ``head_dim_v`` is the value head dim (MLA models such as deepseek_v3 have ``head_dim_v != head_dim``). Every
        query sees at least itself, so no row is fully masked and no output is NaN.
    """
    del attention_mask
    info = packed_info_from_kwargs(query, key, None, kwargs)
    if info is None:
        raise ValueError(
            "packed_attention_forward needs packing metadata: `packed_seq_lengths`, `cu_seq_lens_q` or packed "
            "`position_ids` (positions restarting at 0 per sample)."
        )
    batch_size, num_heads, seq_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if info.batch_size != batch_size or info.seq_len != seq_len:
        raise ValueError(
            f"The packing metadata describes {info.batch_size} row(s) of {info.seq_len} tokens but the queries are "
            f"{batch_size} row(s) of {seq_len} tokens."
        )
    if key.shape[2] != seq_len or value.shape[2] != seq_len:
        raise ValueError(
            f"Packed attention needs keys for exactly the {seq_len} query tokens, got {key.shape[2]} keys: a packed "
            "batch cannot be combined with a KV cache of earlier tokens."
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} key/value heads.")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("Packed attention is causal only; this module asks for bidirectional attention.")
    sinks = kwargs.get("s_aux")
    if sinks is not None and sinks.numel() != num_heads:
        raise ValueError(
            f"Attention sinks (`s_aux`) need one logit per query head ({num_heads}), got {sinks.numel()}."
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}.")
    if kwargs.get("attention_chunk_size") is not None:
        info = chunked_info(info, kwargs["attention_chunk_size"])
    alibi_slopes = kwargs.get("alibi_slopes")
    if alibi_slopes is not None and alibi_slopes.numel() != num_heads:
        raise ValueError(
            f"ALiBi (`alibi_slopes`) needs one slope per query head ({num_heads}), got {alibi_slopes.numel()}."
        )
    if scaling is None:
        scaling = head_dim**-0.5
    if backend is None:
        backend = _choice_for(
            info,
            query,
            value,
            original_implementation,
            softcap=softcap is not None,
            sinks=sinks is not None,
            dropout=dropout > 0,
            alibi=alibi_slopes is not None,
        ).name
    else:
        if backend not in _BACKEND_FUNCTIONS:
            raise ValueError(f"Unknown packed attention backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
        wanted = _features(
            softcap=softcap is not None, sinks=sinks is not None, dropout=dropout > 0, alibi=alibi_slopes is not None
        )
        largest_head_dim = max(head_dim, value.shape[-1])
        missing = _missing_features(backend, wanted, largest_head_dim)
        if missing:
            able = [name for name in BACKENDS if not _missing_features(name, wanted, largest_head_dim)]
            raise ValueError(
                f"Packed attention backend={backend!r} cannot apply {' and '.join(missing)}; use "
                f"{' or '.join(repr(name) for name in able)}, or backend=None to choose one that can."
            )
        reason = backend_unavailable_reason(backend, query.device, query.dtype)
        if reason is not None:
            raise ValueError(f"Packed attention backend={backend!r} cannot run here: {reason}.")
    options = _CallOptions(scaling, dropout, sliding_window, softcap, sinks, module, alibi_slopes)
    if info.is_branched:
        return _branched(backend, query, key, value, info, options), None
    return _BACKEND_FUNCTIONS[backend](query, key, value, info, options), None


# SDPA and eager run a branched batch with each query computed once (:func:`_branch_plan`).
_BRANCH_BUCKET_FUNCTIONS: dict[str, Callable[..., Tensor]] = {"sdpa": _sdpa_buckets, "eager": _eager_buckets}


def _branched(
    backend: str, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: _CallOptions
) -> Tensor:
    """Backend ``backend`` on branched samples (shared prefixes); no branch sees a sibling.

    SDPA, eager and flash-attn (without ALiBi) compute every query once: the prefix with its first branch as one
    causal unit, each later branch's queries against the keys ``[prefix; branch]``, aligned to the end of its keys
    (:func:`_branch_plan` and :func:`_branch_mask`; :func:`_flash_branched`). torch's varlen_attn and xformers (whose
    alignment for more keys than queries this package does not rely on), ALiBi, and a batch whose first branch does
    not follow its prefix run every branch as the plain causal unit ``[prefix; branch]``
    (:meth:`PackedSeqInfo.branch_units`), so each backend applies its own causal mask, window, softcap and sinks to
    it unchanged; the prefix's queries are then computed once per branch and dropped after the first.

    On the units path the tokens are gathered into the units (a prefix read once per branch; autograd sums the
    prefix's key/value gradients over its branches), the backend runs on one row of ``num_slots`` tokens, and each
    token's output is read back from its own slot. Shapes as :class:`_BackendFunction`: ``(B, num_heads, T,
    head_dim)`` in, ``(B, T, num_heads, head_dim_v)`` out.
    """
    if backend in _BRANCH_BUCKET_FUNCTIONS and options.alibi_slopes is None:
        plan = _branch_plan(info, query.device)
        if plan is not None:
            return _BRANCH_BUCKET_FUNCTIONS[backend](query, key, value, info, options, plan)
    if backend == "flash":
        out = _flash_branched(query, key, value, info, options)
        if out is not None:
            return out
    batch_size, num_heads, seq_len, _ = query.shape
    unit_info, gather, owner = info.branch_units()
    device = query.device
    gather, owner = info.plan(
        "branch_units_device", str(device), lambda: (gather.to(device, non_blocking=True), owner.to(device))
    )

    def units(x: Tensor) -> Tensor:
        return _tokens_major(x).index_select(0, gather).unsqueeze(0).transpose(1, 2)

    out = _BACKEND_FUNCTIONS[backend](units(query), units(key), units(value), unit_info, options)  # (1, slots, H, Dv)
    return out[0].index_select(0, owner).view(batch_size, seq_len, num_heads, out.shape[-1])


# --------------------------------------------------------------------------------------------------------------------
# Registered attention functions: packed path, or the model's own implementation unchanged
# --------------------------------------------------------------------------------------------------------------------

_METADATA_KWARGS = ("packed_seq_info", "packed_seq_lengths")


@functools.cache
def _eager_function_of_class(cls: type) -> Callable[..., Any]:
    """The eager attention function a module class falls back to: the ``*eager_attention_forward`` its ``forward``
    passes to ``ALL_ATTENTION_FUNCTIONS.get_interface`` (looked up where that ``forward`` is defined), else its
    modeling file's ``eager_attention_forward``, else Llama's."""
    forward = inspect.unwrap(getattr(cls, "forward", None))
    code, namespace = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
    if code is not None:
        named = [n for n in dict.fromkeys(code.co_names) if n.endswith("eager_attention_forward") and n in namespace]
        if len(named) == 1:
            return namespace[named[0]]
    function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if function is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as function
    return function


def _eager_function_of(module: torch.nn.Module) -> Callable[..., Any]:
    """The eager attention function of ``module``'s class (what transformers falls back to for "eager")."""
    return _eager_function_of_class(type(module))


def _routed_info(module: torch.nn.Module, query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> PackedSeqInfo | None:
    """The packing metadata a registered function routes on, or ``None`` (then it runs the stock function exactly).

    Only what marks a batch as packed by this package: ``packed_seq_info`` (the model hook's decision, ``None``
    meaning "not packed"), ``packed_seq_lengths``, or, for an attention module whose decoder does not hand its
    keyword arguments down, the packed forward the hook published for the module's config. Keys transformers itself
    passes (``cu_seq_lens_q``, ``position_ids``) never reroute a call, so an unpatched model sharing the registered
    name runs exactly as stock.
    """
    if "packed_seq_info" in kwargs:
        return kwargs["packed_seq_info"]
    if kwargs.get("packed_seq_lengths") is not None:
        return packed_info_from_kwargs(query, key, None, kwargs)
    config = getattr(module, "config", None)
    return current_packed_info(config) if config is not None else None


def make_attention_function(
    original_implementation: str, *, fallback: Callable[..., Any] | None = None
) -> Callable[..., tuple[Tensor, Any]]:
    """An ``AttentionInterface`` function: packed batches (see :func:`_routed_info`) go to
    :func:`packed_attention_forward`, anything else to ``original_implementation`` ("sdpa", "eager",
    "flash_attention_2", ...) exactly as without the patch: ``fallback`` when given, else transformers' own function
    of that name (the class-wide registry, so the returned function can be registered under the same name)."""

    def unpack_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        info = _routed_info(module, query, key, kwargs)
        if info is not None:
            kwargs["packed_seq_info"] = info
            if kwargs.get("sliding_window") is None and getattr(module, "_unpack_sliding_window", None):
                # The model applies this window through its mask only (set by unpack_trainer.models.patch_model).
                kwargs["sliding_window"] = module._unpack_sliding_window
            if getattr(module, "_unpack_attention_chunk", None):
                # The layer attends in chunks, through its mask only (set by unpack_trainer.models.patch_model).
                kwargs["attention_chunk_size"] = module._unpack_attention_chunk
            correction = getattr(module, "_unpack_query_correction", None)
            if correction is not None:
                # The layer scaled its queries by positions along the row (set by unpack_trainer.models.patch_model).
                query = correction(module, query, info)
            return packed_attention_forward(
                module, query, key, value, None, original_implementation=original_implementation, **kwargs
            )
        for name in _METADATA_KWARGS:
            kwargs.pop(name, None)
        if fallback is not None:
            function = fallback
        elif original_implementation == "eager":
            function = _eager_function_of(module)
        else:
            from transformers import AttentionInterface

            function = AttentionInterface._global_mapping[original_implementation]
        return function(module, query, key, value, attention_mask, **kwargs)

    unpack_attention_forward.original_implementation = original_implementation  # type: ignore[attr-defined]
    return unpack_attention_forward
