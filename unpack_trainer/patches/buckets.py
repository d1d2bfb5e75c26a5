"""Samples bucketed by length: the planner shared by the SDPA / eager attention backends and the token mixers.

Per-sample work on a packed row (attention, a convolution, a recurrent scan) costs what the samples alone cost when
samples of similar length are gathered into one padded ``(n, L, ...)`` batch each: padding sits after each sample's
real tokens, so causal attention and a causal mixer never let a real token see it. The plan
(:class:`BucketPlan`) is built once per batch on the CPU from :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`
and kept beside it (``info.plans``); :class:`GatherSlots` / :class:`ScatterTokens` move tokens into the slots and
back with gathers only (every token has exactly one real slot).

Worked example, lengths ``[1, 2, 3]`` (tokens ``t0 | t1 t2 | t3 t4 t5``), one bucket of ``L = 3``: slots
``[t0 pad pad | t1 t2 pad | t3 t4 t5]``, ``gather`` ``[0 0 0 1 2 1 3 4 5]`` (padding repeats the sample's first
token), ``scatter`` ``[0 3 4 6 7 8]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from unpack_trainer.packed_seq_info import PackedSeqInfo, zero_prefixed_cumsum

__all__ = [
    "CALL_COST_PAIRS",
    "GPU_CALL_COST_PAIRS",
    "GPU_DEVICE_TYPES",
    "Bucket",
    "BucketPlan",
    "Planning",
    "GatherSlots",
    "ScatterTokens",
    "attention_plan",
    "branch_plan",
    "bucketed",
    "build_plan",
    "grid_length",
    "group_sorted_lengths",
    "key_bucketed",
    "planning_for",
    "unbucketed",
]

# SDPA/eager bucketing minimises sum over buckets of (CALL_COST_PAIRS + samples * longest**2): the fixed cost of one
# more attention call (forward + backward), in units of the cost of one (query, key) pair of a padded sample. Measured
# on CPU with torch's flash SDPA kernel, 8 heads of 32 dims: ~100 us per call, ~70 ns per (query, key) pair.
CALL_COST_PAIRS = 1536


# The grouping runs over distinct lengths (quadratic); above this many they are first rounded up to coarser steps.
MAX_DISTINCT_LENGTHS = 256

# On a GPU one more SDPA call (forward + backward: our Python, torch's dispatch and the launches, ~100 us of host
# time) costs as much as about a million (query, key) pairs of a 1B-parameter model's 32 heads of GPU work (~0.1 ns a
# pair at ~400 TFLOP/s), so buckets there are few and large: an estimate from a profiled H200 step, which
# benchmarks/bench_gpu.py measures.
GPU_CALL_COST_PAIRS = 1 << 20
# Device types planned with the GPU cost and the shape grid.
GPU_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# The shape grid: bucket lengths are multiples of 16 up to 128, then 4 values per octave (160, 192, 224, 256, 320,
# ...), so the (n, L) shapes of every step come from a small fixed set of L.
_GRID_FINE = 128
_GRID_STEPS_PER_OCTAVE = 4


def grid_length(length: int) -> int:
    """``length`` rounded up to the shape grid: a multiple of 16 up to 128, above that a multiple of
    ``2**floor(log2(length)) / 4`` (at most 25% padding). ``grid_length(5) == 16``, ``grid_length(300) == 320``."""
    if length <= _GRID_FINE:
        return -(-length // 16) * 16
    step = (1 << (length.bit_length() - 1)) // _GRID_STEPS_PER_OCTAVE
    return -(-length // step) * step


class Planning(NamedTuple):
    """How buckets are planned for a device: ``call_cost`` of one more call in (query, key) pairs, and whether
    bucket lengths are rounded up to the shape grid (:func:`grid_length`)."""

    call_cost: float = CALL_COST_PAIRS
    grid: bool = False


def planning_for(device: torch.device, *, compiled: bool = False) -> Planning:
    """The attention buckets' planning on ``device``: on a GPU (:data:`GPU_DEVICE_TYPES`), and for layers compiled by
    ``torch.compile`` on any device, few large buckets of grid lengths, so a step launches a handful of attention
    calls of shapes seen before (a compiled layer recompiles only for a new number of buckets, its sizes turning
    symbolic after the first change); elsewhere the CPU cost model."""
    if compiled or torch.device(device).type in GPU_DEVICE_TYPES:
        return Planning(GPU_CALL_COST_PAIRS, grid=True)
    return Planning()


class _AttentionBuckets(NamedTuple):
    """The plan of :func:`attention_plan` on ``device``."""

    device: str


class _BranchBuckets(NamedTuple):
    """The plan of :func:`branch_plan` on ``device``."""

    device: str


class Bucket(NamedTuple):
    length: int  # L: the longest sample of the bucket; every sample is padded to it
    count: int  # n: samples in the bucket
    # Branch buckets (shared prefixes, :meth:`PackedSeqInfo.branch_spans`) only: Lk, the longest key span; each
    # unit's queries are aligned to the end of its keys. 0 for a causal bucket (the keys are the queries).
    key_length: int = 0
    query_lengths: Tensor | None = None  # (n,) int64 CPU q_u, branch buckets only
    key_lengths: Tensor | None = None  # (n,) int64 CPU k_u >= q_u, branch buckets only
    samples: Tensor | None = None  # (n,) int64 CPU: the sample in each of the bucket's rows (attention plans only)
    # (n,) int64 CPU: the unit of :meth:`PackedSeqInfo.branch_spans` in each of the bucket's rows (branch plans only)
    units: Tensor | None = None


class BucketPlan(NamedTuple):
    """Samples grouped by length. Slots are the padded tokens of all buckets, bucket after bucket, each bucket
    ``(n, L)`` row-major; a sample's real tokens fill the first slots of its row, padding the rest.

    A branch plan (:func:`branch_plan`) also has key slots, ``(n, Lk)`` per bucket, read through ``key_gather``."""

    buckets: list[Bucket]
    sizes: list[int]  # n * L slots per bucket
    gather: Tensor  # (num_slots,) int64: token read by each slot (padding repeats the sample's first token)
    scatter: Tensor  # (total_tokens,) int64: slot of each token
    pad_slots: Tensor  # (num_slots,) bool: True at padding slots
    key_gather: Tensor | None = None  # (num_key_slots,) int64: token read by each key slot (branch plans only)
    key_sizes: list[int] | None = None  # n * Lk key slots per bucket (branch plans only)


def group_sorted_lengths(
    sorted_lengths: Tensor, *, call_cost: float = CALL_COST_PAIRS, power: int = 2, grid: bool = False
) -> list[tuple[int, int]]:
    """Split ascending lengths into contiguous ``[begin, end)`` groups minimising
    ``sum(call_cost + (end - begin) * max_length**power)`` (dynamic programming over distinct lengths): ``power=2``
    for attention (cost per sample quadratic in its padded length), ``power=1`` for the token mixers of
    :mod:`unpack_trainer.patches.mixers` (linear). With ``grid``, lengths count as rounded up to the shape grid
    (:func:`grid_length`), where the group's padded length will be."""
    if grid:
        keys = torch.tensor([grid_length(n) for n in sorted_lengths.tolist()], dtype=torch.int64)
    else:
        longest = int(sorted_lengths[-1])
        step = -(-longest // MAX_DISTINCT_LENGTHS)
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


def attention_plan(info: PackedSeqInfo, device: torch.device, *, compiled: bool = False) -> BucketPlan:
    """The samples of ``info`` bucketed by length for batched per-sample attention (SDPA and eager), index tensors on
    ``device``; built once per batch and device (``compiled``: planned for compiled layers, :func:`planning_for`; the
    first build of a batch decides)."""
    planning = planning_for(device, compiled=compiled)
    return info.plans.get(
        _AttentionBuckets(str(device)),
        lambda: build_plan(info, device, call_cost=planning.call_cost, grid=planning.grid),
    )


def build_plan(
    info: PackedSeqInfo,
    device: torch.device,
    *,
    call_cost: float = CALL_COST_PAIRS,
    power: int = 2,
    grid: bool = False,
) -> BucketPlan:
    """The samples of ``info`` grouped by :func:`group_sorted_lengths` into padded buckets, index tensors on
    ``device``; with ``grid`` every bucket's length is on the shape grid (:func:`grid_length`)."""
    lengths = info.seq_lengths.to(torch.int64)
    starts = info.cu_seqlens[:-1].to(torch.int64)
    order = torch.argsort(lengths, stable=True)
    groups = group_sorted_lengths(lengths[order], call_cost=call_cost, power=power, grid=grid)
    pad_to = grid_length if grid else int

    buckets: list[Bucket] = []
    gathers, pads = [], []
    scatter = torch.empty(info.total_tokens, dtype=torch.int64)
    offset = 0
    for begin, end in groups:
        members = order[begin:end]
        bucket = Bucket(pad_to(int(lengths[members].max())), end - begin, samples=members)
        gather, pad = fill_slots(starts[members], lengths[members], bucket.length, offset, scatter)
        gathers.append(gather)
        pads.append(pad)
        buckets.append(bucket)
        offset += bucket.count * bucket.length
    return finish_plan(buckets, gathers, scatter, pads, device)


def padded_spans(starts: Tensor, lengths: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """``(n, length)`` int64 indices of ``n`` spans (``starts``, ``lengths``: ``(n,)`` int64), padding repeating each
    span's first index, and the ``(n, length)`` bool mask of the real entries."""
    steps = torch.arange(length, dtype=torch.int64)
    valid = steps.unsqueeze(0) < lengths.unsqueeze(1)
    index = starts.unsqueeze(1) + steps.unsqueeze(0)
    return torch.where(valid, index, starts.unsqueeze(1)), valid


def fill_slots(starts: Tensor, lengths: Tensor, length: int, offset: int, scatter: Tensor) -> tuple[Tensor, Tensor]:
    """The ``(n, L)`` query slots of one bucket from slot ``offset`` on: ``(gather, pad)`` flattened, the token each
    slot reads (padding repeats the sample's first token: finite values that only padded queries ever see) and True
    at padding slots; ``scatter[token] = slot`` is set for the bucket's real tokens."""
    tokens, valid = padded_spans(starts, lengths, length)
    slots = offset + torch.arange(tokens.numel(), dtype=torch.int64).view_as(tokens)
    scatter[tokens[valid]] = slots[valid]
    return tokens.reshape(-1), ~valid.reshape(-1)


def finish_plan(
    buckets: list[Bucket],
    gathers: list[Tensor],
    scatter: Tensor,
    pads: list[Tensor],
    device: torch.device,
    key_gathers: list[Tensor] | None = None,
    key_sizes: list[int] | None = None,
) -> BucketPlan:
    """The :class:`BucketPlan` of the buckets, index tensors moved to ``device``."""
    return BucketPlan(
        buckets,
        [bucket.count * bucket.length for bucket in buckets],
        torch.cat(gathers).to(device, non_blocking=True),
        scatter.to(device, non_blocking=True),
        torch.cat(pads).to(device, non_blocking=True),
        None if key_gathers is None else torch.cat(key_gathers).to(device, non_blocking=True),
        key_sizes,
    )


def branch_plan(info: PackedSeqInfo, device: torch.device, *, compiled: bool = False) -> BucketPlan | None:
    """The units of a branched batch (:meth:`PackedSeqInfo.branch_spans`) bucketed for SDPA and eager, every query
    computed once; ``None`` when the spans are not contiguous. Built once per batch and device.

    Units whose keys are their queries (a prefix with its first branch, a sample without branches) are bucketed as in
    :func:`build_plan` and run causally; the later branches of a prefix (queries = the branch, keys =
    ``[prefix; branch]``) are bucketed by key length and run with a bottom-right causal mask
    (:func:`~unpack_trainer.patches.attention.bucket_masks.branch_mask`). Every bucket names its units
    (``Bucket.units``), from which the masks of bidirectional spans are read. Planned for ``device`` as
    :func:`attention_plan` (:func:`planning_for`).
    """
    planning = planning_for(device, compiled=compiled)
    pad_to = grid_length if planning.grid else int

    def build() -> BucketPlan | None:
        spans = info.branch_spans()
        if spans is None:
            return None
        key_starts = zero_prefixed_cumsum(spans.key_lengths)[:-1]
        same = spans.key_lengths == spans.query_lengths
        buckets: list[Bucket] = []
        gathers, pads, key_gathers, key_sizes = [], [], [], []
        scatter = torch.empty(info.total_tokens, dtype=torch.int64)
        offset = 0
        for branch, units in ((False, torch.nonzero(same).reshape(-1)), (True, torch.nonzero(~same).reshape(-1))):
            if units.numel() == 0:
                continue
            # causal units grouped by their length, branch units by their key length
            sorted_lengths, permutation = spans.key_lengths[units].sort(stable=True)
            order = units[permutation]
            for begin, end in group_sorted_lengths(sorted_lengths, call_cost=planning.call_cost, grid=planning.grid):
                members = order[begin:end]
                q_lengths, k_lengths = spans.query_lengths[members], spans.key_lengths[members]
                length, key_length, count = pad_to(int(q_lengths.max())), pad_to(int(k_lengths.max())), end - begin
                gather, pad = fill_slots(spans.query_starts[members], q_lengths, length, offset, scatter)
                gathers.append(gather)
                pads.append(pad)
                offset += count * length
                # Key slots: the unit's keys, padding repeating its first key (masked out, or after every real query).
                key_index, _ = padded_spans(key_starts[members], k_lengths, key_length)
                key_gathers.append(spans.key_gather[key_index].reshape(-1))
                key_sizes.append(count * key_length)
                if branch:
                    buckets.append(Bucket(length, count, key_length, q_lengths, k_lengths, units=members))
                else:
                    buckets.append(Bucket(length, count, units=members))
        return finish_plan(buckets, gathers, scatter, pads, device, key_gathers, key_sizes)

    return info.plans.get(_BranchBuckets(str(device)), build)


class GatherSlots(torch.autograd.Function):
    """``tokens (N, ...) -> slots (S, ...)``, ``slots = tokens[gather]``; padding slots are constants for autograd.

    Every token has exactly one real slot (``scatter``), so the backward is a gather too (no scatter-add). Dropping
    the padding slots' gradient is exact here: padding sits after each sample's real tokens, so under causal
    attention no real query sees it, and padded queries get a zero output gradient (:class:`ScatterTokens`).
    """

    @staticmethod
    def forward(ctx, tokens: Tensor, gather: Tensor, scatter: Tensor) -> Tensor:
        ctx.save_for_backward(scatter)
        return tokens.index_select(0, gather)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (scatter,) = ctx.saved_tensors
        return grad.index_select(0, scatter), None, None


class ScatterTokens(torch.autograd.Function):
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


def bucketed(x_tokens: Tensor, plan: BucketPlan) -> list[Tensor]:
    """(total_tokens, num_heads, head_dim) tokens -> one (n, num_heads, L, head_dim) padded batch per bucket."""
    num_heads, head_dim = x_tokens.shape[1:]
    slots = GatherSlots.apply(x_tokens, plan.gather, plan.scatter)
    return [
        part.view(bucket.count, bucket.length, num_heads, head_dim).transpose(1, 2)
        for part, bucket in zip(slots.split(plan.sizes), plan.buckets)
    ]


def key_bucketed(x_tokens: Tensor, plan: BucketPlan) -> list[Tensor]:
    """(total_tokens, num_kv_heads, head_dim) keys or values -> one (n, num_kv_heads, Lk, head_dim) batch per bucket:
    :func:`bucketed` for a plain plan; the key slots of a branch plan (a prefix's keys read by each of its units,
    autograd summing their gradients)."""
    if plan.key_gather is None:
        return bucketed(x_tokens, plan)
    num_heads, head_dim = x_tokens.shape[1:]
    slots = x_tokens.index_select(0, plan.key_gather)
    return [
        part.view(bucket.count, bucket.key_length or bucket.length, num_heads, head_dim).transpose(1, 2)
        for part, bucket in zip(slots.split(plan.key_sizes), plan.buckets)
    ]


def unbucketed(outputs: list[Tensor], plan: BucketPlan, batch_size: int, seq_len: int) -> Tensor:
    """One (n, num_heads, L, head_dim) output per bucket -> (B, T, num_heads, head_dim) in token order."""
    num_heads, head_dim = outputs[0].shape[1], outputs[0].shape[3]
    flat = [out.transpose(1, 2).reshape(-1, num_heads, head_dim) for out in outputs]
    slots = flat[0] if len(flat) == 1 else torch.cat(flat)
    out = ScatterTokens.apply(slots, plan.scatter, plan.gather, plan.pad_slots)
    return out.view(batch_size, seq_len, num_heads, head_dim)
