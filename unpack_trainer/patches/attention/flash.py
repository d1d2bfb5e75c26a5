"""``flash``: flash-attn's ``flash_attn_varlen_func`` over all samples at once (CUDA, float16 / bfloat16), split at
sample boundaries where a row is so large that the kernel's 32-bit offsets would overflow."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from unpack_trainer.packed_seq_info import PackedSeqInfo, zero_prefixed_cumsum
from unpack_trainer.patches.attention._common import (
    AttentionBackend,
    AttentionFeature,
    CallOptions,
    OptionalKernel,
    tokens_major,
)
from unpack_trainer.patches.attention._varlen import (
    MAX_HEAD_DIM,
    fallback_of,
    fits_offsets,
    one_head_dim,
    varlen_forward,
    varlen_window,
)

__all__ = ["BACKEND"]


class _BranchKernelArguments(NamedTuple):
    """The branched call's ``cu_seqlens_q``, ``cu_seqlens_k`` and key gather on ``device`` (a plan of the batch)."""

    device: str


def _kernel_options(options: CallOptions, longest: int, device: torch.device) -> dict[str, Any]:
    """``flash_attn_varlen_func``'s keyword arguments for ``options``, sequences of at most ``longest`` keys: causal
    (bottom-right where a sequence has more keys than queries), the window ``(w - 1, 0)`` where one binds, softcap,
    dropout and ALiBi slopes (float32 ``(num_heads,)``)."""
    kernel_options: dict[str, Any] = {"dropout_p": options.dropout, "softmax_scale": options.scaling, "causal": True}
    window = varlen_window(longest, options.sliding_window)
    if window is not None:
        kernel_options["window_size"] = window
    if options.softcap is not None:
        kernel_options["softcap"] = options.softcap
    if options.alibi_slopes is not None:
        # flash-attn adds -slope * |i - j| (i, j within the sequence of cu_seqlens): the per-sample bias.
        kernel_options["alibi_slopes"] = options.alibi_slopes.to(device=device, dtype=torch.float32)
    return kernel_options


def forward(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions) -> Tensor:
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
    flash_attn_varlen_func = options.kernel
    kernel_options = _kernel_options(options, info.max_seqlen, query.device)

    def call(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        # flash-attn takes grouped kv heads as they are, and pads head dims to a multiple of 8 itself.
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kernel_options)

    return varlen_forward(
        call, "flash-attn", query, key, value, info, head_dim_multiple=1, fallback=fallback_of(options)
    )


def branched_forward(
    query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
) -> Tensor | None:
    """flash-attn on a branched batch with every query computed once, or ``None`` where the ``[prefix; branch]``
    units serve instead (spans not contiguous, ALiBi, or a batch past the kernel's 32-bit offsets).

    One ``flash_attn_varlen_func`` call over the units of :meth:`PackedSeqInfo.branch_spans`: the queries are the
    row's tokens as they are (``cu_seqlens_q`` from the units' query lengths), the keys and values are gathered as
    ``[prefix; branch]`` per unit (``cu_seqlens_k``), and ``causal=True`` aligns each unit's queries to the end of its
    keys (bottom-right, flash-attn's alignment since 2.1; the window ``(w - 1, 0)`` too). Shapes as
    :func:`forward`.
    """
    spans = info.branch_spans()
    if spans is None or options.alibi_slopes is not None:
        return None
    batch_size, num_heads, seq_len, head_dim = query.shape
    head_dim_v = value.shape[-1]
    num_keys, num_units = int(spans.key_gather.numel()), int(spans.key_lengths.numel())
    if not fits_offsets(num_keys, num_units, num_heads, max(head_dim, head_dim_v)):  # keys >= queries per unit
        return None
    device = query.device

    def build() -> tuple[Tensor, Tensor, Tensor]:
        cu_q, cu_k = (
            zero_prefixed_cumsum(x).to(device, torch.int32) for x in (spans.query_lengths, spans.key_lengths)
        )
        return cu_q, cu_k, spans.key_gather.to(device, non_blocking=True)

    cu_q, cu_k, key_gather = info.plans.get(_BranchKernelArguments(str(device)), build)
    q_in, k_in, v_in = one_head_dim(
        tokens_major(query).contiguous(), *(tokens_major(x).index_select(0, key_gather) for x in (key, value)), 1
    )
    max_q, max_k = int(spans.query_lengths.max()), int(spans.key_lengths.max())
    kernel_options = _kernel_options(options, max_k, device)
    out = options.kernel(q_in, k_in, v_in, cu_q, cu_k, max_q, max_k, **kernel_options)
    return out[..., :head_dim_v].reshape(batch_size, seq_len, num_heads, head_dim_v)


BACKEND = AttentionBackend(
    name="flash",
    serves=frozenset(
        {AttentionFeature.SLIDING_WINDOW, AttentionFeature.SOFTCAP, AttentionFeature.DROPOUT, AttentionFeature.ALIBI}
    ),
    forward=forward,
    branched_forward=branched_forward,
    kernel=OptionalKernel(
        name="flash-attn",
        load=lambda: importlib.import_module("flash_attn").flash_attn_varlen_func,
        not_installed="flash-attn is not installed (pip install flash-attn)",
        dtypes=(torch.float16, torch.bfloat16),
        distributions=("flash-attn", "flash_attn"),
    ),
    max_head_dim=MAX_HEAD_DIM,
)
