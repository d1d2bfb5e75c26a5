"""The one attention helper for packed rows: every sample attends only to itself, at the cost of the samples alone.

A packed batch holds several samples per row. Stock transformers (5.x) turns packed ``position_ids`` into a dense
``(T, T)`` block-causal mask for SDPA and eager, so attention costs ``O(T**2)`` time and memory whatever the samples.
This module computes the same result from the per-sample lengths:

- ``flash``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16), split at sample boundaries where a row is so
  large that the kernel's 32-bit offsets would overflow;
- ``torch_varlen``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, no extra install);
- ``xformers``: ``memory_efficient_attention`` with a ``BlockDiagonalCausalMask`` (CUDA);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` per sample, without any ``(T, T)`` mask: samples of
  similar length are gathered into one padded ``(n, H, L, D)`` batch (padding at the end of each sample, where causal
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
=================  =====  ============  ========  ====  =====

``UNPACK_ATTENTION_BACKEND=flash|torch_varlen|xformers|sdpa|eager`` forces a backend; asking for one that cannot run,
or that cannot apply what the model asks for, is an error naming the variable. So is a ``backend=`` argument that
cannot apply it (as transformers' own ``sdpa_attention_forward`` refuses ``softcap``).

The packing metadata is computed once per forward on the CPU (:class:`PackedSeqInfo`); every per-layer index tensor is
cached on that object, so no layer synchronises with the device.
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
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from unpack_trainer._logging import log_once

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "BackendChoice",
    "PackedSeqInfo",
    "backend_unavailable_reason",
    "choose_backend",
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
    "flash": frozenset({"softcap", "dropout"}),
    "torch_varlen": frozenset(),
    "xformers": frozenset({"dropout"}),
    "sdpa": frozenset({"dropout"}),
    "eager": frozenset({"softcap", "sinks", "dropout"}),
}
_FEATURE_NAMES = {
    "softcap": "attention logit softcapping",
    "sinks": "attention sinks (s_aux)",
    "dropout": "attention dropout",
}
# flash-attn 2 and torch's varlen flash kernel take head dims up to 256 (one head dim for q, k and v).
_FLASH_MAX_HEAD_DIM = 256

# Availability seams. Tests swap these to run the flash/xformers dispatch on CPU with stand-in kernels.
_KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_FLASH_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
_XFORMERS_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

# flash-attn's varlen backward indexes its fp32 dq accumulator, of (total_tokens + 128 * num_seqs) * num_heads *
# head_dim rounded up (see _flash_rounded_head_dim) elements, with 32-bit offsets in the releases that predate the fix
# (flash-attention PR 1500). Rows above this bound are split at sample boundaries.
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
# Packing metadata
# --------------------------------------------------------------------------------------------------------------------


class _Bucket(NamedTuple):
    length: int  # L: the longest sample of the bucket; every sample is padded to it
    count: int  # n: samples in the bucket


class _SdpaPlan(NamedTuple):
    """Samples grouped by length. Slots are the padded tokens of all buckets, bucket after bucket, each bucket
    ``(n, L)`` row-major; a sample's real tokens fill the first slots of its row, padding the rest."""

    buckets: list[_Bucket]
    sizes: list[int]  # n * L slots per bucket
    gather: torch.Tensor  # (num_slots,) int64: token read by each slot (padding repeats the sample's first token)
    scatter: torch.Tensor  # (total_tokens,) int64: slot of each token
    pad_slots: torch.Tensor  # (num_slots,) bool: True at padding slots


class _FlashChunk(NamedTuple):
    first_seq: int  # index of the chunk's first sample
    begin: int  # token range [begin, end) of the chunk
    end: int
    max_seqlen: int
    cu_seqlens: torch.Tensor | None  # (n + 1,) int32 on the device, zero-based; None when flash-attn cannot take it
    fallback: PackedSeqInfo | None  # the chunk's own metadata, for another backend


def _flash_rounded_head_dim(head_dim: int) -> int:
    """The head dimension flash-attn allocates its backward accumulator with (rounded to 32, or 64 above 128)."""
    multiple = 32 if head_dim <= 128 else 64
    return -(-head_dim // multiple) * multiple


def _group_sorted_lengths(sorted_lengths: torch.Tensor) -> list[tuple[int, int]]:
    """Split ascending lengths into contiguous ``[begin, end)`` groups minimising
    ``sum(_CALL_COST_PAIRS + (end - begin) * max_length**2)`` (dynamic programming over distinct lengths)."""
    longest = int(sorted_lengths[-1])
    step = -(-longest // _MAX_DISTINCT_LENGTHS)
    keys = (sorted_lengths + step - 1) // step * step if step > 1 else sorted_lengths
    distinct, counts = torch.unique_consecutive(keys, return_counts=True)
    prefix = torch.zeros(distinct.numel() + 1, dtype=torch.float64)
    torch.cumsum(counts.to(torch.float64), dim=0, out=prefix[1:])
    squares = distinct.to(torch.float64) ** 2
    best = torch.zeros(distinct.numel() + 1, dtype=torch.float64)
    split = [0] * (distinct.numel() + 1)
    for end in range(1, distinct.numel() + 1):
        # A group covering distinct lengths [begin, end) pays its call plus its samples padded to distinct[end - 1].
        candidates = best[:end] - prefix[:end] * squares[end - 1]
        begin = int(torch.argmin(candidates))
        best[end] = candidates[begin] + prefix[end] * squares[end - 1] + _CALL_COST_PAIRS
        split[end] = begin
    bounds, end = [], distinct.numel()
    while end > 0:
        bounds.append((split[end], end))
        end = split[end]
    offsets = prefix.to(torch.int64).tolist()
    return [(offsets[begin], offsets[end]) for begin, end in reversed(bounds)]


class PackedSeqInfo:
    """Packing metadata of one batch, computed once per forward on the CPU and shared by every layer.

    A packed batch is ``B`` rows of ``T`` tokens; the samples of all rows, in row-major order, have the lengths
    ``seq_lengths`` (every sample inside one row; trailing row padding is a sample of its own).

    Attributes:
        seq_lengths: ``(num_seqs,)`` int32 CPU, every length >= 1, summing to ``B * T``.
        cu_seqlens: ``(num_seqs + 1,)`` int32 CPU, zero-prefixed cumsum of ``seq_lengths``.
        max_seqlen: the longest sample, a Python int.
        batch_size, seq_len: ``B`` and ``T``.

    Device tensors (``cu_seqlens`` on the device, SDPA bucket indices, sliding-window band masks, flash-attn chunks,
    xformers biases) are built on first use and cached on the object.

    Example::

        >>> info = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2]), batch_size=1, seq_len=5)
        >>> info.cu_seqlens.tolist(), info.max_seqlen
        ([0, 3, 5], 3)
    """

    def __init__(self, seq_lengths: torch.Tensor, *, batch_size: int, seq_len: int) -> None:
        lengths = torch.as_tensor(seq_lengths).detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        if lengths.numel() == 0:
            raise ValueError("Packed attention got no samples: `packed_seq_lengths` is empty.")
        bad = torch.nonzero(lengths <= 0)
        if bad.numel():
            index = int(bad[0, 0])
            raise ValueError(
                f"Packed sample {index} has length {int(lengths[index])}; every sample needs at least one token."
            )
        total = int(lengths.sum())
        if total != batch_size * seq_len:
            raise ValueError(
                f"The packed sample lengths sum to {total} tokens but the batch has {batch_size} row(s) of {seq_len} "
                f"tokens ({batch_size * seq_len}); trailing row padding must be a sample of its own."
            )
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, dim=0, out=cu[1:])
        if batch_size > 1:
            boundaries = torch.arange(1, batch_size, dtype=torch.int64) * seq_len
            crossing = ~torch.isin(boundaries, cu)
            if bool(crossing.any()):
                row = int(torch.nonzero(crossing)[0, 0])
                sample = int(torch.searchsorted(cu, boundaries[row], right=True)) - 1
                raise ValueError(
                    f"Packed sample {sample} crosses the boundary between rows {row} and {row + 1} (row length "
                    f"{seq_len}); samples must not span rows."
                )
        self.seq_lengths = lengths.to(torch.int32)
        self.cu_seqlens = cu.to(torch.int32)
        self.max_seqlen = int(lengths.max())
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self._cache: dict[Any, Any] = {}

    def __repr__(self) -> str:
        return (
            f"PackedSeqInfo(num_seqs={self.num_seqs}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"max_seqlen={self.max_seqlen})"
        )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lengths.numel())

    @property
    def total_tokens(self) -> int:
        return self.batch_size * self.seq_len

    # -- constructors ------------------------------------------------------------------------------------------------

    @classmethod
    def from_seq_lengths(cls, seq_lengths: torch.Tensor, *, batch_size: int, seq_len: int) -> PackedSeqInfo:
        """From ``packed_seq_lengths``: ``(num_seqs,)`` integer lengths, row-major over the batch (any device)."""
        return cls(seq_lengths, batch_size=batch_size, seq_len=seq_len)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, *, batch_size: int, seq_len: int) -> PackedSeqInfo:
        """From ``cu_seq_lens_q``: ``(num_seqs + 1,)`` zero-prefixed cumulative lengths (any device)."""
        cu = torch.as_tensor(cu_seqlens).detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        if cu.numel() < 2 or int(cu[0]) != 0:
            raise ValueError(f"`cu_seq_lens_q` must be zero-prefixed cumulative lengths, got {cu.tolist()[:8]}...")
        return cls(cu[1:] - cu[:-1], batch_size=batch_size, seq_len=seq_len)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedSeqInfo | None:
        """From ``position_ids`` ``(B, T)``: a sample starts at each row start and wherever a position is not the
        previous one plus 1. Returns ``None`` when every row holds a single sample (nothing is packed)."""
        pos = position_ids.detach().to(device="cpu", dtype=torch.int64)
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        batch_size, seq_len = pos.shape
        if seq_len == 0:
            return None
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        if int(starts.sum()) == batch_size:
            return None
        start_index = torch.nonzero(starts.reshape(-1)).reshape(-1)
        ends = torch.cat([start_index[1:], torch.tensor([batch_size * seq_len])])
        return cls(ends - start_index, batch_size=batch_size, seq_len=seq_len)

    # -- per-device caches -------------------------------------------------------------------------------------------

    def cu_seqlens_on(self, device: torch.device) -> torch.Tensor:
        """``cu_seqlens`` as ``(num_seqs + 1,)`` int32 on ``device`` (copied once)."""
        key = ("cu_seqlens", str(device))
        if key not in self._cache:
            self._cache[key] = self.cu_seqlens.to(device, non_blocking=True)
        return self._cache[key]

    def sdpa_plan(self, device: torch.device) -> _SdpaPlan:
        """Bucket the samples by length for batched per-sample attention; index tensors live on ``device``."""
        key = ("sdpa_plan", str(device))
        if key not in self._cache:
            self._cache[key] = self._build_sdpa_plan(device)
        return self._cache[key]

    def _build_sdpa_plan(self, device: torch.device) -> _SdpaPlan:
        lengths = self.seq_lengths.to(torch.int64)
        starts = self.cu_seqlens[:-1].to(torch.int64)
        order = torch.argsort(lengths, stable=True)
        groups = _group_sorted_lengths(lengths[order])

        buckets: list[_Bucket] = []
        gathers, pads = [], []
        scatter = torch.empty(self.total_tokens, dtype=torch.int64)
        offset = 0
        for begin, end in groups:
            members = order[begin:end]
            bucket_lengths = lengths[members]
            bucket_starts = starts[members]
            length = int(bucket_lengths.max())
            count = end - begin
            steps = torch.arange(length, dtype=torch.int64)
            valid = steps.unsqueeze(0) < bucket_lengths.unsqueeze(1)  # (n, L)
            tokens = bucket_starts.unsqueeze(1) + steps.unsqueeze(0)  # (n, L)
            # Padding slots repeat the sample's first token: finite values that only padded queries ever see.
            gathers.append(torch.where(valid, tokens, bucket_starts.unsqueeze(1)).reshape(-1))
            pads.append(~valid.reshape(-1))
            slots = offset + torch.arange(count * length, dtype=torch.int64).view(count, length)
            scatter[tokens[valid]] = slots[valid]
            buckets.append(_Bucket(length, count))
            offset += count * length
        return _SdpaPlan(
            buckets,
            [bucket.count * bucket.length for bucket in buckets],
            torch.cat(gathers).to(device, non_blocking=True),
            scatter.to(device, non_blocking=True),
            torch.cat(pads).to(device, non_blocking=True),
        )

    def band_mask(self, length: int, sliding_window: int, device: torch.device) -> torch.Tensor:
        """``(L, L)`` bool, True where query ``i`` may see key ``j``: ``i - sliding_window < j <= i``."""
        key = ("band", length, sliding_window, str(device))
        if key not in self._cache:
            i = torch.arange(length, device=device).unsqueeze(1)
            j = torch.arange(length, device=device).unsqueeze(0)
            self._cache[key] = (j <= i) & (j > i - sliding_window)
        return self._cache[key]

    def additive_mask(
        self, length: int, sliding_window: int | None, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``(L, L)`` float: 0 where attention is allowed (causal, within the window), ``finfo(dtype).min`` elsewhere."""
        key = ("additive", length, sliding_window, dtype, str(device))
        if key not in self._cache:
            window = sliding_window if sliding_window is not None else length + 1
            allowed = self.band_mask(length, window, device)
            zero = torch.zeros((), dtype=dtype, device=device)
            self._cache[key] = torch.where(allowed, zero, torch.finfo(dtype).min)
        return self._cache[key]

    def flash_chunks(self, num_heads: int, head_dim: int, device: torch.device) -> list[_FlashChunk]:
        """Split the samples into chunks small enough for flash-attn's 32-bit offsets (one chunk in the usual case).

        Chunks end at sample boundaries. A sample too large on its own is a chunk of its own with ``cu_seqlens``
        ``None``, for the caller to send elsewhere.
        """
        key = ("flash_chunks", num_heads, head_dim, str(device))
        if key in self._cache:
            return self._cache[key]
        per_token = num_heads * _flash_rounded_head_dim(head_dim)
        lengths = self.seq_lengths.tolist()
        bounds: list[tuple[int, int]] = []
        first, tokens = 0, 0
        for index, length in enumerate(lengths):
            if index > first and (tokens + length + 128 * (index - first + 1)) * per_token > _FLASH_MAX_ELEMENTS:
                bounds.append((first, index))
                first, tokens = index, 0
            tokens += length
        bounds.append((first, len(lengths)))
        chunks = []
        for first, last in bounds:
            begin, end = int(self.cu_seqlens[first]), int(self.cu_seqlens[last])
            longest = max(lengths[first:last])
            if (end - begin + 128 * (last - first)) * per_token > _FLASH_MAX_ELEMENTS:
                sub = PackedSeqInfo(self.seq_lengths[first:last], batch_size=1, seq_len=end - begin)
                chunks.append(_FlashChunk(first, begin, end, longest, None, sub))
            else:
                cu = (self.cu_seqlens[first : last + 1] - self.cu_seqlens[first]).to(device, non_blocking=True)
                chunks.append(_FlashChunk(first, begin, end, longest, cu, None))
        self._cache[key] = chunks
        return chunks

    def xformers_bias(self, sliding_window: int | None, device: torch.device) -> Any:
        """The xformers ``BlockDiagonalCausalMask`` (made local for a sliding window) for these samples."""
        key = ("xformers", sliding_window, str(device))
        if key not in self._cache:
            fmha = _xformers_fmha()
            mask_cls = fmha.attn_bias.BlockDiagonalCausalMask
            seqlens = self.seq_lengths.tolist()
            if "device" in inspect.signature(mask_cls.from_seqlens).parameters:
                bias = mask_cls.from_seqlens(seqlens, device=device)
            else:
                bias = mask_cls.from_seqlens(seqlens)
            if sliding_window is not None and sliding_window < self.max_seqlen:
                bias = bias.make_local_attention(sliding_window)
            self._cache[key] = bias
        return self._cache[key]


# Single-entry cache for metadata derived inside the helper (callers that bypass the model hook): every layer of one
# forward receives the same tensor object, so the CPU work and any device sync happen once per forward.
_derived: list[Any] = [None]


def _derive_info(source_name: str, source: torch.Tensor, batch_size: int, seq_len: int) -> PackedSeqInfo | None:
    cached = _derived[0]
    if cached is not None:
        ref, version, name, shape, info = cached
        if ref() is source and version == source._version and name == source_name and shape == (batch_size, seq_len):
            return info
    if source_name == "packed_seq_lengths":
        info = PackedSeqInfo.from_seq_lengths(source, batch_size=batch_size, seq_len=seq_len)
    elif source_name == "cu_seq_lens_q":
        info = PackedSeqInfo.from_cu_seqlens(source, batch_size=batch_size, seq_len=seq_len)
    else:
        info = PackedSeqInfo.from_position_ids(source.expand(batch_size, -1) if source.shape[0] == 1 else source)
    _derived[0] = (weakref.ref(source), source._version, source_name, (batch_size, seq_len), info)
    return info


def packed_info_from_kwargs(
    query: torch.Tensor, key: torch.Tensor, attention_mask: Any, kwargs: dict[str, Any]
) -> PackedSeqInfo | None:
    """The packing metadata of this call, or ``None`` for an unpacked call.

    Precedence: ``packed_seq_info`` (set by the model hook, ``None`` meaning "not packed"), then
    ``packed_seq_lengths``, then ``cu_seq_lens_q``, then ``position_ids`` (only without an attention mask and with
    as many keys as queries, i.e. no KV cache).
    """
    if "packed_seq_info" in kwargs:
        return kwargs["packed_seq_info"]
    batch_size, _, seq_len, _ = query.shape
    for name in ("packed_seq_lengths", "cu_seq_lens_q"):
        source = kwargs.get(name)
        if source is not None:
            return _derive_info(name, source, batch_size, seq_len)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and attention_mask is None and key.shape[2] == seq_len and seq_len > 1:
        return _derive_info("position_ids", position_ids, batch_size, seq_len)
    return None


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
def _flash_varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """``flash_attn.flash_attn_varlen_func`` when flash-attn imports, else ``None`` (imported on first use)."""
    return _optional("flash-attn", lambda: importlib.import_module("flash_attn").flash_attn_varlen_func)


@functools.cache
def _torch_varlen_kernel() -> Callable[..., torch.Tensor] | None:
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


def backend_unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run packed attention on ``device`` / ``dtype``; ``None`` when it can."""
    device = torch.device(device)
    if backend in ("sdpa", "eager"):
        return None
    if backend == "flash":
        if _flash_varlen_kernel() is None:
            return "flash-attn is not installed (pip install flash-attn)"
        if device.type not in _KERNEL_DEVICE_TYPES:
            return f"flash-attn needs a CUDA device, the model is on {device.type}"
        if dtype not in _FLASH_DTYPES:
            return f"flash-attn needs float16 or bfloat16, the model computes in {dtype}"
        return None
    if backend == "torch_varlen":
        if _torch_varlen_kernel() is None:
            return "this torch has no torch.nn.attention.varlen.varlen_attn (torch 2.10 or later)"
        if device.type not in _KERNEL_DEVICE_TYPES:
            return f"torch's varlen_attn needs a CUDA device, the model is on {device.type}"
        if dtype not in _FLASH_DTYPES:
            return f"torch's varlen_attn needs float16 or bfloat16, the model computes in {dtype}"
        return _cuda_flash_unsupported_reason(device)
    if backend == "xformers":
        if _xformers_fmha() is None:
            return "xformers is not installed (pip install xformers)"
        if device.type not in _KERNEL_DEVICE_TYPES:
            return f"xformers needs a CUDA device, the model is on {device.type}"
        if dtype not in _XFORMERS_DTYPES:
            return f"xformers does not support {dtype}"
        return None
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


def _features(*, softcap: bool, sinks: bool, dropout: bool) -> frozenset[str]:
    flags = {"softcap": softcap, "sinks": sinks, "dropout": dropout}
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
) -> BackendChoice:
    """Which backend packed attention uses for inputs on ``device`` in ``dtype``.

    ``UNPACK_ATTENTION_BACKEND`` wins (and is an error if that backend cannot run here, or cannot apply the requested
    features). A model loaded with ``attn_implementation="eager"`` keeps eager. Otherwise the first of flash-attn,
    torch's ``varlen_attn``, xformers and SDPA that can run here and can apply the features; eager when none can.

    Args:
        softcap, sinks, dropout: whether the call applies logit softcapping, attention sinks (``s_aux``), dropout.
        head_dim: the larger of the query and value head dims (flash kernels take at most 256); ``None``: unknown.
    """
    wanted = _features(softcap=softcap, sinks=sinks, dropout=dropout)
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
# Backends. Each takes q (B, H, T, D), k/v (B, H_kv, T, D) and returns (B, T, H, D).
# --------------------------------------------------------------------------------------------------------------------


def _tokens_major(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B * T, H, D); a view when B == 1."""
    batch, heads, seq_len, dim = x.shape
    return x.transpose(1, 2).reshape(batch * seq_len, heads, dim)


_sdpa_gqa_supported: list[bool] = []


def _sdpa_supports_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (probed once on a tiny CPU input)."""
    if not _sdpa_gqa_supported:
        try:
            probe = torch.zeros(1, 2, 1, 4)
            F.scaled_dot_product_attention(probe, probe[:, :1], probe[:, :1], enable_gqa=True)
            _sdpa_gqa_supported.append(True)
        except (TypeError, RuntimeError):
            _sdpa_gqa_supported.append(False)
    return _sdpa_gqa_supported[0]


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(n, H_kv, L, D) -> (n, H_kv * groups, L, D), each kv head repeated ``groups`` times (transformers' repeat_kv)."""
    if groups == 1:
        return x
    n, heads, length, dim = x.shape
    return x[:, :, None].expand(n, heads, groups, length, dim).reshape(n, heads * groups, length, dim)


class _GatherSlots(torch.autograd.Function):
    """``tokens (N, ...) -> slots (S, ...)``, ``slots = tokens[gather]``; padding slots are constants for autograd.

    Every token has exactly one real slot (``scatter``), so the backward is a gather too (no scatter-add). Dropping
    the padding slots' gradient is exact here: padding sits after each sample's real tokens, so under causal
    attention no real query sees it, and padded queries get a zero output gradient (:class:`_ScatterTokens`).
    """

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, gather: torch.Tensor, scatter: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scatter)
        return tokens.index_select(0, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scatter,) = ctx.saved_tensors
        return grad.index_select(0, scatter), None, None


class _ScatterTokens(torch.autograd.Function):
    """``slots (S, ...) -> tokens (N, ...)``, ``tokens = slots[scatter]``; padding slots get a zero gradient."""

    @staticmethod
    def forward(
        ctx, slots: torch.Tensor, scatter: torch.Tensor, gather: torch.Tensor, pad_slots: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(gather, pad_slots)
        return slots.index_select(0, scatter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gather, pad_slots = ctx.saved_tensors
        grad_slots = grad.index_select(0, gather)
        grad_slots.masked_fill_(pad_slots.view(-1, *([1] * (grad_slots.dim() - 1))), 0)
        return grad_slots, None, None, None


def _bucketed(x_tokens: torch.Tensor, plan: _SdpaPlan) -> list[torch.Tensor]:
    """(B*T, H, D) tokens -> one (n, H, L, D) padded batch per bucket."""
    heads, dim = x_tokens.shape[1:]
    slots = _GatherSlots.apply(x_tokens, plan.gather, plan.scatter)
    return [
        part.view(bucket.count, bucket.length, heads, dim).transpose(1, 2)
        for part, bucket in zip(slots.split(plan.sizes), plan.buckets)
    ]


def _unbucketed(outputs: list[torch.Tensor], plan: _SdpaPlan, batch: int, seq_len: int) -> torch.Tensor:
    """One (n, H, L, D) output per bucket -> (B, T, H, D) in token order."""
    heads, dim = outputs[0].shape[1], outputs[0].shape[3]
    flat = [out.transpose(1, 2).reshape(-1, heads, dim) for out in outputs]
    slots = flat[0] if len(flat) == 1 else torch.cat(flat)
    return _ScatterTokens.apply(slots, plan.scatter, plan.gather, plan.pad_slots).view(batch, seq_len, heads, dim)


def _sdpa_packed(query, key, value, info, *, scaling, dropout, sliding_window, softcap, sinks, module):
    del softcap, sinks, module  # refused before dispatch (see _CAPABILITIES)
    batch, heads, seq_len, dim = query.shape
    groups = heads // key.shape[1]
    plan = info.sdpa_plan(query.device)
    qs, ks, vs = (_bucketed(_tokens_major(x), plan) for x in (query, key, value))
    outputs = []
    for bucket, q, k, v in zip(plan.buckets, qs, ks, vs):
        mask = None
        if sliding_window is not None and bucket.length > sliding_window:
            mask = info.band_mask(bucket.length, sliding_window, query.device)
        extra = {}
        if groups > 1:
            if mask is None and _sdpa_supports_gqa():
                extra["enable_gqa"] = True
            else:
                k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
        outputs.append(
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, **extra
            )
        )
    return _unbucketed(outputs, plan, batch, seq_len)


def _eager_packed(query, key, value, info, *, scaling, dropout, sliding_window, softcap, sinks, module):
    """``softmax(softcap(QK^T * scaling) + mask) V`` per bucket, as transformers' eager functions compute it.

    With ``sinks`` ``(H,)`` (gpt_oss ``s_aux``), every query's softmax denominator also holds ``exp(sinks[h])``:
    ``weights = exp(scores - logaddexp(logsumexp(scores), sinks[h]))``, the sink's own weight dropped, as gpt_oss's
    ``eager_attention_forward`` does by concatenating a sink column.
    """
    batch, heads, seq_len, dim = query.shape
    groups = heads // key.shape[1]
    plan = info.sdpa_plan(query.device)
    qs, ks, vs = (_bucketed(_tokens_major(x), plan) for x in (query, key, value))
    training = bool(getattr(module, "training", False))
    sink_logits = None if sinks is None else sinks.to(device=query.device, dtype=torch.float32).view(1, heads, 1, 1)
    outputs = []
    for bucket, q_bucket, k_bucket, v_bucket in zip(plan.buckets, qs, ks, vs):
        length = bucket.length
        mask = info.additive_mask(length, sliding_window, query.dtype, query.device)
        per_chunk = max(1, _EAGER_MAX_SCORE_ELEMENTS // (heads * length * length))
        chunks = []
        for q, k, v in zip(q_bucket.split(per_chunk), k_bucket.split(per_chunk), v_bucket.split(per_chunk)):
            k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
            # The scale goes on q (n, H, L, D), or into the softcap's tanh, instead of one more (n, H, L, L) pass.
            if softcap is None:
                scores = torch.matmul(q * scaling, k.transpose(2, 3))
            else:
                scores = torch.tanh(torch.matmul(q * (scaling / softcap), k.transpose(2, 3))) * softcap
            scores.add_(mask)  # in place: neither the matmul nor the softcap's multiply needs its output back
            if sink_logits is None:
                weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            else:
                logits = scores.float()
                normaliser = torch.logaddexp(torch.logsumexp(logits, dim=-1, keepdim=True), sink_logits)
                weights = torch.exp(logits - normaliser).to(query.dtype)
            if dropout > 0 and training:
                weights = F.dropout(weights, p=dropout, training=True)
            chunks.append(torch.matmul(weights, v))
        outputs.append(chunks[0] if len(chunks) == 1 else torch.cat(chunks))
    return _unbucketed(outputs, plan, batch, seq_len)


def _varlen_packed(kernel_call, name, query, key, value, info, *, scaling, dropout, sliding_window, softcap, module):
    """Shared by flash-attn and torch's varlen_attn: (total_tokens, heads, head_dim) inputs with one head dim for q, k
    and v (rounded up to ``multiple``), the samples' ``cu_seqlens`` and ``max_seqlen``, rows split into chunks where
    the kernel's 32-bit offsets would overflow.

    ``kernel_call(q, k, v, cu_seqlens, max_seqlen) -> (tokens, heads, padded head_dim)``; ``kernel_call.multiple``:
    the head-dim multiple the kernel needs (zero padding of q and k leaves every score unchanged: ``scaling`` is
    explicit; padded value columns are cropped from the output).
    """
    batch, heads, seq_len, dim = query.shape
    v_dim = value.shape[-1]
    # (total_tokens, num_heads, head_dim), contiguous as transformers hands them to flash-attn.
    q_tokens, k_tokens, v_tokens = (_tokens_major(x).contiguous() for x in (query, key, value))
    padded = -(-max(dim, v_dim) // kernel_call.multiple) * kernel_call.multiple
    q_in, k_in = (F.pad(x, (0, padded - dim)) if padded != dim else x for x in (q_tokens, k_tokens))
    v_in = F.pad(v_tokens, (0, padded - v_dim)) if padded != v_dim else v_tokens

    def crop(out: torch.Tensor) -> torch.Tensor:
        return out[..., :v_dim] if padded != v_dim else out

    chunks = info.flash_chunks(heads, padded, query.device)
    if len(chunks) == 1 and chunks[0].cu_seqlens is not None:
        out = crop(kernel_call(q_in, k_in, v_in, chunks[0].cu_seqlens, info.max_seqlen))
        return out.reshape(batch, seq_len, heads, v_dim)
    log_once(
        logger,
        logging.WARNING,
        f"A packed batch of {info.total_tokens} tokens x {heads} heads x head_dim {padded} exceeds {name}'s 32-bit "
        f"offsets; it is run in {len(chunks)} chunks split at sample boundaries.",
    )
    outputs = []
    for chunk in chunks:
        part = slice(chunk.begin, chunk.end)
        if chunk.cu_seqlens is not None:
            outputs.append(crop(kernel_call(q_in[part], k_in[part], v_in[part], chunk.cu_seqlens, chunk.max_seqlen)))
            continue
        fallback = "eager" if softcap is not None else "sdpa"
        log_once(
            logger,
            logging.WARNING,
            f"Packed sample {chunk.first_seq} ({chunk.end - chunk.begin} tokens) alone exceeds {name}'s 32-bit "
            f"offsets; it runs on {fallback} instead.",
        )
        out = _BACKEND_FUNCTIONS[fallback](
            *(x[part].transpose(0, 1).unsqueeze(0) for x in (q_tokens, k_tokens, v_tokens)),
            chunk.fallback,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=None,
            module=module,
        )
        outputs.append(out.reshape(chunk.end - chunk.begin, heads, v_dim))
    return torch.cat(outputs).view(batch, seq_len, heads, v_dim)


def _flash_packed(query, key, value, info, *, scaling, dropout, sliding_window, softcap, sinks, module):
    del sinks  # refused before dispatch
    kernel = _flash_varlen_kernel()
    options: dict[str, Any] = {"dropout_p": dropout, "softmax_scale": scaling, "causal": True}
    if sliding_window is not None and info.max_seqlen > sliding_window:
        # flash-attn's window is inclusive on both sides: (left, right) = (sliding_window - 1, 0) keeps
        # i - sliding_window < j <= i, transformers' convention.
        options["window_size"] = (sliding_window - 1, 0)
    if softcap is not None:
        options["softcap"] = softcap

    def call(q, k, v, cu_seqlens, max_seqlen):
        # flash-attn takes grouped kv heads as they are, and pads head dims to a multiple of 8 itself.
        return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)

    call.multiple = 1
    return _varlen_packed(
        call,
        "flash-attn",
        query,
        key,
        value,
        info,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        softcap=softcap,
        module=module,
    )


def _torch_varlen_packed(query, key, value, info, *, scaling, dropout, sliding_window, softcap, sinks, module):
    del softcap, sinks, dropout  # refused before dispatch: varlen_attn has none of them
    kernel = _torch_varlen_kernel()
    heads, kv_heads = query.shape[1], key.shape[1]
    groups = heads // kv_heads
    grouped = groups > 1 and _takes_enable_gqa(kernel)
    window = (-1, 0)  # causal
    if sliding_window is not None and info.max_seqlen > sliding_window:
        window = (sliding_window - 1, 0)  # inclusive on both sides, as flash-attn's

    def call(q, k, v, cu_seqlens, max_seqlen):
        options: dict[str, Any] = {"scale": scaling, "window_size": window}
        if grouped:
            options["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)

    call.multiple = 8  # torch's flash kernel asserts head_dim % 8 == 0 (flash-attn's Python wrapper pads for us)
    return _varlen_packed(
        call,
        "torch varlen_attn",
        query,
        key,
        value,
        info,
        scaling=scaling,
        dropout=0.0,
        sliding_window=sliding_window,
        softcap=None,
        module=module,
    )


def _xformers_packed(query, key, value, info, *, scaling, dropout, sliding_window, softcap, sinks, module):
    del softcap, sinks, module  # refused before dispatch
    batch, heads, seq_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    fmha = _xformers_fmha()
    total = batch * seq_len
    q, k, v = (_tokens_major(x).contiguous().unsqueeze(0) for x in (query, key, value))  # (1, total, H, D)
    if groups > 1:
        # xformers' grouped layout (B, M, G, H, K): kv heads broadcast over the query heads of their group.
        q = q.reshape(1, total, kv_heads, groups, dim)
        k = k.unsqueeze(3).expand(1, total, kv_heads, groups, dim)
        v = v.unsqueeze(3).expand(1, total, kv_heads, groups, v.shape[-1])
    bias = info.xformers_bias(sliding_window, query.device)
    out = fmha.memory_efficient_attention(q, k, v, attn_bias=bias, p=dropout, scale=scaling)
    return out.reshape(batch, seq_len, heads, -1)


# Dispatch table: tests wrap entries to check which backend ran.
_BACKEND_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "flash": _flash_packed,
    "torch_varlen": _torch_varlen_packed,
    "xformers": _xformers_packed,
    "sdpa": _sdpa_packed,
    "eager": _eager_packed,
}


def _choice_for(
    info: PackedSeqInfo,
    query: torch.Tensor,
    value: torch.Tensor,
    original: str | None,
    *,
    softcap: bool,
    sinks: bool,
    dropout: bool,
) -> BackendChoice:
    """The automatic (or forced) backend of one call, decided once per batch and set of features; a hand-over from
    the backend chosen for plain attention to one that can apply the call's features is logged once."""
    head_dim = max(query.shape[-1], value.shape[-1])
    features = (softcap, sinks, dropout, head_dim)
    key = ("choice", str(query.device), query.dtype, original, features, os.environ.get(ENV_BACKEND))
    cached = info._cache.get(key)
    if cached is not None:
        return cached
    choice = choose_backend(
        query.device, query.dtype, original, softcap=softcap, sinks=sinks, dropout=dropout, head_dim=head_dim
    )
    plain = choose_backend(query.device, query.dtype, original)
    if plain.name != choice.name:
        missing = _missing_features(plain.name, _features(softcap=softcap, sinks=sinks, dropout=dropout), head_dim)
        log_once(
            logger,
            logging.WARNING,
            f"Packed attention: {plain.name} cannot apply {' and '.join(missing)}; using {choice.name} for these "
            "layers.",
        )
    log_once(logger, logging.INFO, f"Packed attention backend: {choice}.")
    info._cache[key] = choice
    return choice


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    original_implementation: str | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed batch in which no sample sees another; transformers' attention-function signature.

    Args:
        module: the attention module (read for ``training``, ``is_causal``).
        query: ``(B, H, T, D)``; key: ``(B, H_kv, T, D)``; value: ``(B, H_kv, T, D_v)``, with ``H_kv`` dividing
            ``H``. Keys must be exactly the query tokens (no KV cache of earlier tokens).
        attention_mask: ignored on the packed path (the samples define the mask); ``None`` in a patched model.
        scaling: softmax scale, ``1 / sqrt(D)`` when ``None``.
        dropout: attention dropout probability (transformers passes 0.0 outside training).
        sliding_window: each query sees at most this many keys, itself included; ``None`` for full causal attention.
        softcap: ``tanh(scores / softcap) * softcap`` logit softcapping (gemma2); flash and eager apply it.
        backend: one of :data:`BACKENDS`; ``None`` chooses with :func:`choose_backend`, handing what a backend
            cannot apply (softcap, sinks, dropout on torch_varlen) to one that can. A ``backend`` that cannot apply
            them raises ``ValueError``.
        original_implementation: the model's attention implementation before patching (for the choice).
        **kwargs: packing metadata, read by :func:`packed_info_from_kwargs`: ``packed_seq_info``,
            ``packed_seq_lengths`` ``(num_seqs,)`` int, ``cu_seq_lens_q`` ``(num_seqs + 1,)`` int32, or
            ``position_ids`` ``(B, T)``. ``s_aux``: attention sinks (gpt_oss), ``(H,)`` one logit per query head
            added to every softmax denominator (eager applies them). ``is_causal`` (default: the module's).

    Returns:
        ``(attn_output, None)`` with ``attn_output`` ``(B, T, H, D_v)`` in ``query``'s dtype; ``D_v`` is the value
        head dim (MLA models such as deepseek_v3 have ``D_v != D``).
    """
    del attention_mask
    info = packed_info_from_kwargs(query, key, None, kwargs)
    if info is None:
        raise ValueError(
            "packed_attention_forward needs packing metadata: `packed_seq_lengths`, `cu_seq_lens_q` or packed "
            "`position_ids` (positions restarting at 0 per sample)."
        )
    batch, heads, seq_len, dim = query.shape
    if info.batch_size != batch or info.seq_len != seq_len:
        raise ValueError(
            f"The packing metadata describes {info.batch_size} row(s) of {info.seq_len} tokens but the queries are "
            f"{batch} row(s) of {seq_len} tokens."
        )
    if key.shape[2] != seq_len or value.shape[2] != seq_len:
        raise ValueError(
            f"Packed attention needs keys for exactly the {seq_len} query tokens, got {key.shape[2]} keys: a packed "
            "batch cannot be combined with a KV cache of earlier tokens."
        )
    if heads % key.shape[1] != 0:
        raise ValueError(f"{heads} query heads cannot be grouped over {key.shape[1]} key/value heads.")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("Packed attention is causal only; this module asks for bidirectional attention.")
    sinks = kwargs.get("s_aux")
    if sinks is not None and sinks.numel() != heads:
        raise ValueError(f"Attention sinks (`s_aux`) need one logit per query head ({heads}), got {sinks.numel()}.")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}.")
    if scaling is None:
        scaling = dim**-0.5
    if backend is None:
        backend = _choice_for(
            info,
            query,
            value,
            original_implementation,
            softcap=softcap is not None,
            sinks=sinks is not None,
            dropout=dropout > 0,
        ).name
    else:
        if backend not in _BACKEND_FUNCTIONS:
            raise ValueError(f"Unknown packed attention backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
        wanted = _features(softcap=softcap is not None, sinks=sinks is not None, dropout=dropout > 0)
        missing = _missing_features(backend, wanted, max(dim, value.shape[-1]))
        if missing:
            able = [name for name in BACKENDS if not _missing_features(name, wanted, max(dim, value.shape[-1]))]
            raise ValueError(
                f"Packed attention backend={backend!r} cannot apply {' and '.join(missing)}; use "
                f"{' or '.join(repr(name) for name in able)}, or backend=None to choose one that can."
            )
        reason = backend_unavailable_reason(backend, query.device, query.dtype)
        if reason is not None:
            raise ValueError(f"Packed attention backend={backend!r} cannot run here: {reason}.")
    out = _BACKEND_FUNCTIONS[backend](
        query,
        key,
        value,
        info,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        module=module,
    )
    return out, None


# --------------------------------------------------------------------------------------------------------------------
# Registered attention functions: packed path, or the model's own implementation unchanged
# --------------------------------------------------------------------------------------------------------------------

_METADATA_KWARGS = ("packed_seq_info", "packed_seq_lengths")


def _eager_function_of(module: torch.nn.Module) -> Callable[..., Any]:
    """The ``eager_attention_forward`` of the module's own modeling file (what transformers falls back to)."""
    modeling = sys.modules.get(type(module).__module__)
    function = getattr(modeling, "eager_attention_forward", None)
    if function is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as function
    return function


def make_attention_function(original_implementation: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """An ``AttentionInterface`` function: packed batches go to :func:`packed_attention_forward`, anything else to
    ``original_implementation`` ("sdpa", "eager", "flash_attention_2", ...) exactly as without the patch."""

    def unpack_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        info = packed_info_from_kwargs(query, key, attention_mask, kwargs)
        if info is not None:
            kwargs["packed_seq_info"] = info
            if kwargs.get("sliding_window") is None and getattr(module, "_unpack_sliding_window", None):
                # The model applies this window through its mask only (set by unpack_trainer.models.patch_model).
                kwargs["sliding_window"] = module._unpack_sliding_window
            return packed_attention_forward(
                module, query, key, value, None, original_implementation=original_implementation, **kwargs
            )
        for name in _METADATA_KWARGS:
            kwargs.pop(name, None)
        if original_implementation == "eager":
            function = _eager_function_of(module)
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            function = ALL_ATTENTION_FUNCTIONS[original_implementation]
        return function(module, query, key, value, attention_mask, **kwargs)

    unpack_attention_forward.original_implementation = original_implementation  # type: ignore[attr-defined]
    return unpack_attention_forward
