"""``flex``: ``torch.nn.attention.flex_attention`` with one block mask per batch, the one GPU kernel that applies every
feature our models use in one call: causal document masking, sliding windows, logit softcapping, attention sinks,
ALiBi, chunked attention and the branched (shared-prompt) layout of DPO.

The ``B * T`` tokens run as one row of ``N`` tokens, zero-padded to a *shape class* ``N_pad`` (a multiple of the
block size, then one of four lengths per octave: :func:`padded_length`), so a compiled kernel serves every batch of
its class instead of recompiling per step. The padding is one more document that no real token sees.

The block mask is built from the samples' bounds per block of 128 queries and 128 keys (:func:`block_mask`), never
from a dense ``(N, N)`` mask: ``torch.nn.attention.flex_attention.create_block_mask`` (uncompiled) evaluates the
mask function on every (query, key) pair, with ``(N, N)`` intermediates (int64 document ids gathered per pair: 34
GB at 64k tokens, the likely source of the 44.8 GiB peak measured there on an H200), where the bounds need
``O((N / 128) ** 2)``.

``mask_mod`` (query ``q``, key ``k``, tokens of the padded row)::

    (doc[q] == doc[k] and k <= q) or parent[q] == doc[k]        # own sample causally, or the prefix it continues
    or (block[q] == block[k] and block[q] >= 0)                  # with bidirectional spans: one span, both ways
    and pos[q] - pos[k] < window                                 # with a sliding window

A span lies inside one sample (on a branched row a prompt or one of its branches), so the span term only lets a
token see the later tokens of its own span; the block tables reach every query's keys up to its span's last token.

``score_mod``: ``softcap * tanh(score / softcap)``, then ``- slopes[h] * (pos[q] - pos[k])`` (ALiBi). Sinks: the
output renormalised with flex's log-sum-exp, ``out * exp(lse - logaddexp(lse, sinks[h]))``, as transformers'
``integrations/flex_attention.py`` does for ``s_aux``.

Compiled (``torch.compile(flex_attention, dynamic=False)``, once per process) on CUDA; elsewhere flex runs unfused,
forward only: torch has no flex backward on the CPU, so a CPU call that needs gradients is an error naming the fix.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from unpack_trainer._compat import recompile_limit_at_least
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention._common import (
    AttentionBackend,
    AttentionFeature,
    CallOptions,
    OptionalKernel,
    tokens_major,
)
from unpack_trainer.patches.buckets import grid_length

__all__ = ["BACKEND", "block_mask", "padded_length"]

# Queries and keys per block of the block mask (flex's default sparse block size).
BLOCK_SIZE = 128
# Device types where flex runs compiled (elsewhere: its unfused forward).
COMPILE_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# The smallest query / key / value head dim inductor's flex_attention kernel takes ("NYI: embedding dimension of the
# query, key, and value must be at least 16").
MIN_HEAD_DIM = 16
# Recompilations allowed for the compiled kernel while a packed call runs (torch's default is 8): one per shape class
# and variant of the mask / score functions (window or not, softcap, ALiBi), over a whole run.
RECOMPILE_LIMIT = 64


def _load_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

    del AuxRequest, BlockMask  # what this module uses beside the kernel: fail here if they are missing
    return flex_attention


@functools.cache
def _compiled() -> Callable[..., Any]:
    """The compiled kernel, built once per process on first use (nothing compiles at import)."""
    return torch.compile(BACKEND.kernel.get(), dynamic=False)


def padded_length(total_tokens: int) -> int:
    """The shape class of a row of ``total_tokens``: a multiple of :data:`BLOCK_SIZE`, rounded up to four lengths
    per octave (at most 25% padding). ``padded_length(1000) == 1024``, ``padded_length(5000) == 5120``,
    ``padded_length(64 * 1024) == 65536``."""
    blocks = -(-total_tokens // BLOCK_SIZE) * BLOCK_SIZE
    return -(-grid_length(blocks) // BLOCK_SIZE) * BLOCK_SIZE


class _LayoutKey(NamedTuple):
    """The plan of :func:`_device_layout`: the padded row's length and the device."""

    padded: int
    device: str


class _BlockMaskKey(NamedTuple):
    """The plan of :func:`block_mask`: the padded row's length, the window and the device."""

    padded: int
    window: int | None
    device: str


class _Layout(NamedTuple):
    """Per token of the padded row, int32 on the device: ``doc`` its sample (padding: ``num_seqs``), ``parent`` the
    sample it continues (-1: none), ``pos`` its position (a branch's continue its prefix's; padding from 0)."""

    doc: Tensor
    parent: Tensor
    pos: Tensor


def _token_layout(info: PackedSeqInfo, padded: int) -> dict[str, Tensor]:
    """CPU int64 ``(padded,)`` tensors per token of the padded row: ``doc`` (its sample; the padding is one more),
    ``parent`` (the sample it continues, -1), ``pos`` (its position; a branch's continue its prefix's), ``start``
    (its sample's first token), ``parent_start`` / ``parent_end`` (its prefix's token range, -1 without one),
    ``block`` (its bidirectional span, -1 without one) and ``last_key`` (the last key it sees: its span's last token,
    else itself)."""
    lengths = torch.cat([info.seq_lengths.to(torch.int64), torch.tensor([padded - info.total_tokens])])
    lengths = lengths[lengths > 0]
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    parents = torch.full((lengths.numel(),), -1, dtype=torch.int64)
    if info.is_branched:
        parents[: info.num_seqs] = info.seq_parents
    parent = parents[doc]
    has_parent = parent >= 0
    parent_index = parent.clamp(min=0)
    pos = torch.arange(padded, dtype=torch.int64) - starts[doc]
    pos = pos + torch.where(has_parent, lengths[parent_index], 0)
    parent_start = torch.where(has_parent, starts[parent_index], -1)
    parent_end = torch.where(has_parent, starts[parent_index] + lengths[parent_index], -1)
    # Bidirectional spans: each token's span (-1: none) and the last key it sees (the end of its span, else itself).
    block = torch.full((padded,), -1, dtype=torch.int64)
    last_key = torch.arange(padded, dtype=torch.int64)
    if info.bidirectional_spans is not None:
        block[: info.total_tokens] = info.bidirectional_ids()
        spans = info.bidirectional_spans
        inside = block >= 0
        last_key[inside] = spans[block[inside], 1] - 1
    return {
        "doc": doc,
        "parent": parent,
        "pos": pos,
        "start": starts[doc],
        "parent_start": parent_start,
        "parent_end": parent_end,
        "block": block,
        "last_key": last_key,
    }


def _device_layout(info: PackedSeqInfo, padded: int, device: torch.device) -> _Layout:
    """:func:`_token_layout`'s ``doc``, ``parent`` and ``pos`` as int32 on ``device``, once per batch."""

    def build() -> _Layout:
        layout = _token_layout(info, padded)
        return _Layout(
            *(layout[name].to(device=device, dtype=torch.int32, non_blocking=True) for name in _Layout._fields)
        )

    return info.plans.get(_LayoutKey(padded, str(device)), build)


def _ranges_to_blocks(lo: Tensor, hi: Tensor, num_blocks: int) -> Tensor:
    """``(Qb, Kb)`` bool: key block ``kb`` in ``[lo[qb], hi[qb]]`` (inclusive, empty where ``lo > hi``)."""
    kb = torch.arange(num_blocks, dtype=torch.int64)
    return (kb >= lo.unsqueeze(1)) & (kb <= hi.unsqueeze(1))


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``(Qb, Kb)`` bool -> flex's ``(1, 1, Qb)`` block counts and ``(1, 1, Qb, Kb)`` indices (the marked blocks
    first, ascending), int32."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def block_tables(info: PackedSeqInfo, padded: int, window: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The block mask of ``info`` on a padded row of ``padded`` tokens, as flex's ``from_kv_blocks`` takes it:
    ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)``, int32 on the CPU. Built from every
    query's visible key ranges, ``O(padded + (padded / BLOCK_SIZE) ** 2)`` memory, never a ``(padded, padded)``
    tensor.

    A query ``q`` sees the keys ``[max(start[q], q - window + 1), q]`` of its own sample and, in a branch, the keys of
    its prefix whose positions are within the window. A query block's *partial* key blocks cover the union of its
    queries' ranges (the mask function decides inside them); its *full* key blocks lie in every query's range (no
    mask function runs there).
    """
    layout = _token_layout(info, padded)
    pos, parent, start = layout["pos"], layout["parent"], layout["start"]
    parent_start, parent_end = layout["parent_start"], layout["parent_end"]
    blocks = padded // BLOCK_SIZE
    token = torch.arange(padded, dtype=torch.int64)
    reach = padded if window is None else window
    own_lo = torch.maximum(start, token - reach + 1)
    # A branch token sees its prefix's keys [parent_start, parent_end) whose positions are within the window (a
    # prefix key's position is its offset from parent_start). No prefix: an empty range (lo = padded, hi = -1).
    parent_lo = torch.maximum(parent_start, parent_start + pos - reach + 1)
    visible = (parent >= 0) & (parent_lo < parent_end)
    parent_lo = torch.where(visible, parent_lo, padded)
    parent_hi = torch.where(visible, parent_end - 1, -1)

    def per_block(x: Tensor) -> Tensor:
        return x.view(blocks, BLOCK_SIZE)

    # Partial: the union of the queries' ranges, as one range of key blocks per kind (a query in a bidirectional
    # span reaches to the span's end).
    partial = _ranges_to_blocks(
        per_block(own_lo).amin(1) // BLOCK_SIZE, per_block(layout["last_key"]).amax(1) // BLOCK_SIZE, blocks
    ) | _ranges_to_blocks(
        per_block(parent_lo).amin(1) // BLOCK_SIZE, per_block(parent_hi).amax(1) // BLOCK_SIZE, blocks
    )
    # Full: key blocks inside every query's range, [max lo, min hi] rounded inwards.
    first_query = per_block(token).amin(1)
    full = _ranges_to_blocks(
        -(-per_block(own_lo).amax(1) // BLOCK_SIZE), (first_query + 1) // BLOCK_SIZE - 1, blocks
    ) | _ranges_to_blocks(
        -(-per_block(parent_lo).amax(1) // BLOCK_SIZE), (per_block(parent_hi).amin(1) + 1) // BLOCK_SIZE - 1, blocks
    )
    return (*_ordered(partial & ~full), *_ordered(full))


def _mask_mod(layout: _Layout, window: int | None, block: Tensor | None = None) -> Callable[..., Tensor]:
    """The mask function: a query sees the keys of its sample up to itself (and its prefix's, in a branch), and with
    ``block`` (int32 per token, -1 outside a bidirectional span) the keys of its own span both ways; with a window,
    only keys ``pos[q] - pos[k] < window``."""
    doc, parent, pos = layout

    def causal_documents(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return ((doc[q] == doc[k]) & (k <= q)) | (parent[q] == doc[k])

    def spans_documents(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return causal_documents(b, h, q, k) | ((block[q] == block[k]) & (block[q] >= 0))

    attends = causal_documents if block is None else spans_documents

    def windowed_documents(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return attends(b, h, q, k) & (pos[q] - pos[k] < window)

    return attends if window is None else windowed_documents


def block_mask(info: PackedSeqInfo, padded: int, window: int | None, device: torch.device) -> Any:
    """The ``BlockMask`` of ``info`` on a padded row of ``padded`` tokens with the sliding ``window`` (``None``: full
    causal), on ``device``: :func:`block_tables` with the mask function of the module docstring. Built once per
    batch, length, window and device."""

    def build() -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        tables = (x.to(device, non_blocking=True) for x in block_tables(info, padded, window))
        block = None
        if info.bidirectional_spans is not None:
            block = _token_layout(info, padded)["block"].to(device=device, dtype=torch.int32, non_blocking=True)
        mask_mod = _mask_mod(_device_layout(info, padded, device), window, block)
        return BlockMask.from_kv_blocks(
            *tables, BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=(padded, padded)
        )

    return info.plans.get(_BlockMaskKey(padded, window, str(device)), build)


@functools.cache
def _cached_scalar(value: float, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _scalar(value: float, device: torch.device) -> Tensor:
    """``value`` as a 0-dim float32 tensor on ``device`` (one per value and device outside a trace; built in the graph
    inside one). A score function captures its constants as tensors: dynamo turns a captured Python float into a
    symbolic float once its value changes between calls (two models with different softcaps in one process, in
    flex's unfused forward -- which compiles flex's operator -- and in a user's ``torch.compile``), and flex's operator
    refuses symbolic floats ("can only be of (Tensor, int, SymInt)")."""
    if torch.compiler.is_compiling():
        return torch.tensor(value, dtype=torch.float32, device=device)
    return _cached_scalar(float(value), device)


def _score_mod(options: CallOptions, pos: Tensor, device: torch.device) -> Callable[..., Tensor] | None:
    """The score function for ``options``: softcap, then ALiBi (``None`` without either)."""
    softcap = None if options.softcap is None else _scalar(options.softcap, device)
    slopes = None
    if options.alibi_slopes is not None:
        slopes = options.alibi_slopes.to(device=device, dtype=torch.float32)
    if softcap is None and slopes is None:
        return None

    def capped(score: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return softcap * torch.tanh(score / softcap)

    def alibi(score: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return score - slopes[h] * (pos[q] - pos[k])

    def capped_alibi(score: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return alibi(capped(score, b, h, q, k), b, h, q, k)

    if slopes is None:
        return capped
    return alibi if softcap is None else capped_alibi


def _call(device: torch.device, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel to call on ``device``: compiled on :data:`COMPILE_DEVICE_TYPES` (unless already inside a compiled
    region, which compiles it with the rest), else flex's unfused forward."""
    if device.type in COMPILE_DEVICE_TYPES and not torch.compiler.is_compiling():
        return _compiled()
    return kernel


def _recompile_limit(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type not in COMPILE_DEVICE_TYPES or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return recompile_limit_at_least(RECOMPILE_LIMIT)


def forward(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions) -> Tensor:
    """Packed attention in one flex_attention call over the padded row.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)`` -> ``(B, T, num_heads, head_dim_v)`` in q's dtype. The ``B * T`` tokens run
    as one row of :func:`padded_length` tokens (zeros after the last sample, their outputs dropped).

    GQA: flex's ``enable_gqa``. Window ``w`` (keys ``i - w < j <= i``, by position): in the mask. Softcap, ALiBi
    (float32 ``(num_heads,)`` slopes): ``score_mod``. Sinks ``(num_heads,)``: the output renormalised by flex's
    log-sum-exp. Bidirectional spans (``info.bidirectional_spans``): in the mask. Dropout: refused. Branched batches
    (``info.seq_parents``): a branch sees its prefix and itself, never a sibling, every query computed once (with
    spans: a span of the prefix or of a branch both ways). No query row is fully masked.

    Raises:
        NotImplementedError: on the CPU with inputs that need gradients (torch has no flex backward there).
    """
    batch_size, num_heads, seq_len, _ = query.shape
    head_dim_v = value.shape[-1]
    device = query.device
    if device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
        raise NotImplementedError(
            "The flex packed attention backend has no backward on the CPU (torch's flex_attention runs forward only "
            "there); set UNPACK_ATTENTION_BACKEND to sdpa or eager, or leave it unset, to train on the CPU."
        )
    total = batch_size * seq_len
    padded = padded_length(total)
    mask = block_mask(info, padded, options.sliding_window, device)
    q, k, v = (
        torch.nn.functional.pad(tokens_major(x), (0, 0, 0, 0, 0, padded - total)).transpose(0, 1).unsqueeze(0)
        for x in (query, key, value)
    )  # (1, heads, padded, dim)
    extra = {}
    if options.sinks is not None:
        from torch.nn.attention.flex_attention import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    with _recompile_limit(device):
        result = _call(device, options.kernel)(
            q,
            k,
            v,
            score_mod=_score_mod(options, _device_layout(info, padded, device).pos, device),
            block_mask=mask,
            scale=options.scaling,
            enable_gqa=num_heads != key.shape[1],
            **extra,
        )
    if options.sinks is None:
        out = result[0, :, :total]  # (num_heads, total, head_dim_v)
    else:
        out, aux = result
        lse = aux.lse[0, :, :total].float()  # (num_heads, total), natural log
        sinks = options.sinks.to(device=device, dtype=torch.float32).view(num_heads, 1)
        renorm = torch.exp(lse - torch.logaddexp(lse, sinks)).unsqueeze(-1)
        out = (out[0, :, :total].float() * renorm).to(query.dtype)
    return out.transpose(0, 1).reshape(batch_size, seq_len, num_heads, head_dim_v)


def prepare(info: PackedSeqInfo, device: torch.device) -> None:
    """The batch's block mask (without a window) and token layout on ``device``, built on the host for compiled
    layers."""
    block_mask(info, padded_length(info.total_tokens), None, device)


BACKEND = AttentionBackend(
    name="flex",
    serves=frozenset(
        {
            AttentionFeature.SLIDING_WINDOW,
            AttentionFeature.SOFTCAP,
            AttentionFeature.SINKS,
            AttentionFeature.ALIBI,
            AttentionFeature.BIDIRECTIONAL,
        }
    ),
    forward=forward,
    branched_forward=forward,  # the layout's parents: a branch sees its prefix and itself, every query once
    kernel=OptionalKernel(
        name="flex_attention",
        load=_load_flex,
        not_installed="this torch has no torch.nn.attention.flex_attention with AuxRequest (torch 2.9 or later)",
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        dtype_problem="{name} does not support {dtype}",
        device_types=("cuda", "cpu"),
    ),
    prepare=prepare,
    min_head_dim=MIN_HEAD_DIM,
    # Automatic on CUDA, after the varlen kernels and before SDPA's buckets (benchmarks/RESULTS_gpu.md, H200): in a
    # training step on rows of 4,096 it ran 0.90x torch's varlen_attn, so it takes the calls varlen kernels cannot
    # (softcap, sinks, ALiBi, float32 compute), where the alternative is SDPA's or eager's buckets. Not on the CPU:
    # torch has no flex backward there.
    automatic_device_types=COMPILE_DEVICE_TYPES,
)
