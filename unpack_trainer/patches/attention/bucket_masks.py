"""What the SDPA and eager backends share on their buckets (:mod:`unpack_trainer.patches.buckets`): the masks and
biases, each built once per batch, bucket shape and device and kept beside the batch's
:class:`~unpack_trainer.packed_seq_info.PackedSeqInfo` in its ``plans`` (inside a ``torch.compile`` trace built in the
graph instead, from the bucket's symbolic shape: a few elementwise ops, and no cache keyed by a shape). Below the
backends: it imports none of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from unpack_trainer.packed_seq_info import PackedSeqInfo, zero_prefixed_cumsum
from unpack_trainer.patches.buckets import Bucket, padded_spans

__all__ = [
    "additive_mask",
    "alibi_bias",
    "band_mask",
    "bidirectional_mask",
    "branch_mask",
    "bucket_additive_mask",
]


# The masks' plans (:class:`~unpack_trainer.packed_seq_info.PlanCache` keys), one type per kind of mask.
class _BranchMask(NamedTuple):
    bucket_index: int
    sliding_window: int | None
    device: str


class _BandMask(NamedTuple):
    length: int
    sliding_window: int
    device: str


class _AdditiveMask(NamedTuple):
    length: int
    sliding_window: int | None
    dtype: torch.dtype
    device: str


class _BidirectionalMask(NamedTuple):
    kind: str  # the bucket's rows: "samples" (an attention plan) or "units" (a branch plan)
    bucket_index: int
    sliding_window: int | None
    device: str


class _BucketAdditiveMask(NamedTuple):
    kind: str  # "branch" (a branch plan's later-branch bucket), else the bidirectional mask's kind
    bucket_index: int
    sliding_window: int | None
    dtype: torch.dtype
    device: str


def _cached(info: PackedSeqInfo, key: tuple, build: Callable[[], Tensor]) -> Tensor:
    """``info.plans.get(key, build)``; in a ``torch.compile`` trace ``build()`` (see the module docstring)."""
    return build() if torch.compiler.is_compiling() else info.plans.get(key, build)


def _slot_spans(info: PackedSeqInfo, tokens: Tensor, real: Tensor) -> Tensor:
    """``(n, L)`` int64: the bidirectional span of the token each slot holds (``tokens``, ``(n, L)`` int64 row-major
    over ``B * T``), ``-1`` outside every span and at padding slots (``real`` False)."""
    return torch.where(real, info.bidirectional_ids()[tokens], -1)


def _same_span(query_spans: Tensor, key_spans: Tensor) -> Tensor:
    """``(n, 1, L, Lk)`` bool: query slot ``i`` and key slot ``j`` hold tokens of one span (``(n, L)`` and
    ``(n, Lk)`` int64 span ids, ``-1`` outside every span)."""
    same = (query_spans.unsqueeze(2) == key_spans.unsqueeze(1)) & (query_spans.unsqueeze(2) >= 0)
    return same.unsqueeze(1)


def _branch_unit_spans(info: PackedSeqInfo, bucket: Bucket) -> Tensor:
    """``(n, 1, L, Lk)`` bool of a branch bucket with bidirectional spans: query ``i`` of unit ``u`` (its branch's
    ``i``-th token) and key ``j`` (the ``j``-th token of ``[prefix; branch]``) lie in one span."""
    spans = info.branch_spans()
    units = bucket.units
    queries, real_queries = padded_spans(spans.query_starts[units], bucket.query_lengths, bucket.length)
    key_starts = zero_prefixed_cumsum(spans.key_lengths)[:-1][units]
    key_slots, real_keys = padded_spans(key_starts, bucket.key_lengths, bucket.key_length)
    keys = spans.key_gather[key_slots]
    return _same_span(_slot_spans(info, queries, real_queries), _slot_spans(info, keys, real_keys))


def branch_mask(
    info: PackedSeqInfo, bucket_index: int, bucket: Bucket, sliding_window: int | None, device: torch.device
) -> Tensor:
    """``(n, 1, L, Lk)`` bool on ``device`` of a branch bucket, True where query ``i`` of unit ``u`` may see key ``j``:
    the query sits at position ``p = k_u - q_u + i`` of its keys (bottom-right alignment), so ``j <= p``, ``j < k_u``,
    or (with bidirectional spans, ``info.bidirectional_spans``) query and key lie in one span of the branch; and with
    a window ``w``, ``j > p - w``. A padding query (``i >= q_u``) sees key 0 only (finite, dropped).

    Example (a prefix of 2 tokens, a branch of 3 whose last 2 are a span; rows are the branch's queries)::

        1 1 1 0 0
        1 1 1 1 1
        1 1 1 1 1
    """

    def build() -> Tensor:
        q_lengths = bucket.query_lengths.view(-1, 1, 1, 1)
        k_lengths = bucket.key_lengths.view(-1, 1, 1, 1)
        i = torch.arange(bucket.length).view(1, 1, -1, 1)
        j = torch.arange(bucket.key_length).view(1, 1, 1, -1)
        position = k_lengths - q_lengths + i
        allowed = (j <= position) & (j < k_lengths)
        if info.bidirectional_spans is not None and bucket.units is not None:
            allowed = allowed | _branch_unit_spans(info, bucket)
        if sliding_window is not None:
            allowed &= j > position - sliding_window
        padding = (i >= q_lengths) & (j == 0)
        return (torch.where(i < q_lengths, allowed, padding)).to(device, non_blocking=True)

    return _cached(info, _BranchMask(bucket_index, sliding_window, str(device)), build)


def band_mask(info: PackedSeqInfo, length: int, sliding_window: int, device: torch.device) -> Tensor:
    """``(L, L)`` bool on ``device``, True where query ``i`` may see key ``j``: ``i - sliding_window < j <= i``."""

    def build() -> Tensor:
        i = torch.arange(length, device=device).unsqueeze(1)
        j = torch.arange(length, device=device).unsqueeze(0)
        return (j <= i) & (j > i - sliding_window)

    return _cached(info, _BandMask(length, sliding_window, str(device)), build)


def additive_mask(
    info: PackedSeqInfo, length: int, sliding_window: int | None, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``(L, L)`` ``dtype`` on ``device``: 0 where attention is allowed (causal, within the window),
    ``finfo(dtype).min`` elsewhere (finite, so even a fully masked row would give uniform weights, never NaN)."""

    def build() -> Tensor:
        window = sliding_window if sliding_window is not None else length + 1
        allowed = band_mask(info, length, window, device)
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)

    return _cached(info, _AdditiveMask(length, sliding_window, dtype, str(device)), build)


def alibi_bias(
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
    return bias.masked_fill(~band_mask(info, length, window, device), torch.finfo(dtype).min)


def bidirectional_mask(
    info: PackedSeqInfo, bucket_index: int, bucket: Bucket, sliding_window: int | None, device: torch.device
) -> Tensor | None:
    """``(n, 1, L, L)`` bool on ``device`` of a causal bucket with bidirectional spans (``info.bidirectional_spans``),
    True where query ``i`` may see key ``j`` of its row: ``j <= i``, or both in the same span; and with a window
    ``w``, ``j > i - w``. A row holds a sample (a plain plan's bucket, ``bucket.samples``) or a unit of a branch plan
    whose keys are its queries (``bucket.units``: a prefix with its first branch, contiguous on the row, or a sample
    without branches). ``None`` when no row of the bucket holds a span (the bucket stays causal), and for a branch
    plan's later-branch bucket (:func:`branch_mask` applies its spans). Built on the CPU from the tokens of the
    bucket's rows, once per batch, plan, bucket, window and device.

    Example (one sample of 4 tokens whose tokens 1 and 2 are a span; rows are queries)::

        1 0 0 0
        1 1 1 0
        1 1 1 0
        1 1 1 1
    """
    if info.bidirectional_spans is None or bucket.key_length or (bucket.samples is None and bucket.units is None):
        return None
    kind = "samples" if bucket.samples is not None else "units"

    def build() -> Tensor | None:
        if bucket.samples is not None:
            starts = info.cu_seqlens[:-1].to(torch.int64)[bucket.samples]
            lengths = info.seq_lengths.to(torch.int64)[bucket.samples]
        else:
            spans = info.branch_spans()
            starts, lengths = spans.query_starts[bucket.units], spans.query_lengths[bucket.units]
        tokens, real = padded_spans(starts, lengths, bucket.length)
        block = _slot_spans(info, tokens, real)  # (n, L), -1: causal
        if not bool((block >= 0).any()):
            return None
        steps = torch.arange(bucket.length, dtype=torch.int64)
        i = steps.view(1, 1, -1, 1)
        j = steps.view(1, 1, 1, -1)
        allowed = (j <= i) | _same_span(block, block)
        if sliding_window is not None:
            allowed &= j > i - sliding_window
        return allowed.to(device, non_blocking=True)

    return info.plans.get(_BidirectionalMask(kind, bucket_index, sliding_window, str(device)), build)


def bucket_additive_mask(
    info: PackedSeqInfo,
    bucket_index: int,
    bucket: Bucket,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor | None:
    """The bucket's own mask as an ``(n, 1, L, Lk)`` ``dtype`` additive mask, 0 where allowed and ``finfo(dtype).min``
    elsewhere (finite, as :func:`additive_mask`): a branch bucket's (:func:`branch_mask`), else a causal bucket's
    bidirectional spans (:func:`bidirectional_mask`); ``None`` where neither applies (the bucket is causal: the
    shared :func:`additive_mask` serves it)."""
    branch = bool(bucket.key_length)
    if not branch and info.bidirectional_spans is None:
        return None

    def build() -> Tensor | None:
        boolean = branch_mask if branch else bidirectional_mask
        allowed = boolean(info, bucket_index, bucket, sliding_window, device)
        if allowed is None:
            return None
        return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)

    kind = "branch" if branch else ("samples" if bucket.samples is not None else "units")
    key = _BucketAdditiveMask(kind, bucket_index, sliding_window, dtype, str(device))
    # a branch mask is a few elementwise ops on the bucket's shape (built in a compiled graph); spans are read on the host
    return _cached(info, key, build) if branch else info.plans.get(key, build)
