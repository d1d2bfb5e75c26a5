"""``xformers``: ``memory_efficient_attention`` with a ``BlockDiagonalCausalMask`` over all samples at once (CUDA,
float16 / bfloat16 / float32)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, NamedTuple

import torch
from torch import Tensor

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention._common import (
    AttentionBackend,
    AttentionFeature,
    CallOptions,
    OptionalKernel,
    tokens_major,
)

__all__ = ["BACKEND"]


class _Bias(NamedTuple):
    """The ``BlockDiagonalCausalMask`` of the batch with ``sliding_window`` on ``device`` (a plan of the batch)."""

    sliding_window: int | None
    device: str


def attn_bias(fmha: Any, info: PackedSeqInfo, sliding_window: int | None, device: torch.device) -> Any:
    """The xformers ``BlockDiagonalCausalMask`` for these samples (made local for a sliding window that binds), built
    once per batch, window and device."""

    def build() -> Any:
        mask_cls = fmha.attn_bias.BlockDiagonalCausalMask
        seqlens = info.seq_lengths.tolist()
        if "device" in inspect.signature(mask_cls.from_seqlens).parameters:
            bias = mask_cls.from_seqlens(seqlens, device=device)
        else:
            bias = mask_cls.from_seqlens(seqlens)
        if sliding_window is not None and sliding_window < info.max_seqlen:
            bias = bias.make_local_attention(sliding_window)
        return bias

    return info.plans.get(_Bias(sliding_window, str(device)), build)


def forward(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions) -> Tensor:
    """xformers' ``memory_efficient_attention`` over all samples at once with a ``BlockDiagonalCausalMask``.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)``, float16 / bfloat16 / float32 on CUDA, run as one ``(1, total_tokens, ...)``
    batch -> ``(B, T, num_heads, head_dim_v)``. The bias is a plan of the batch (``info.plans``).

    GQA: xformers' grouped layout ``(1, total_tokens, num_kv_heads, heads_per_kv, head_dim)``, kv heads broadcast
    over the query heads of their group. Window ``w`` (keys ``i - w < j <= i``): the bias's
    ``make_local_attention(w)``. Dropout: ``p``. Softcap, sinks: refused. No query row is fully masked.
    """
    batch_size, num_heads, seq_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    xformers_fmha = options.kernel
    total_tokens = batch_size * seq_len
    q, k, v = (tokens_major(x).contiguous().unsqueeze(0) for x in (query, key, value))  # (1, total_tokens, H, D)
    if heads_per_kv > 1:
        q = q.reshape(1, total_tokens, num_kv_heads, heads_per_kv, head_dim)
        k = k.unsqueeze(3).expand(1, total_tokens, num_kv_heads, heads_per_kv, head_dim)
        v = v.unsqueeze(3).expand(1, total_tokens, num_kv_heads, heads_per_kv, v.shape[-1])
    bias = attn_bias(xformers_fmha, info, options.sliding_window, query.device)
    out = xformers_fmha.memory_efficient_attention(q, k, v, attn_bias=bias, p=options.dropout, scale=options.scaling)
    return out.reshape(batch_size, seq_len, num_heads, -1)


BACKEND = AttentionBackend(
    name="xformers",
    serves=frozenset({AttentionFeature.SLIDING_WINDOW, AttentionFeature.DROPOUT}),
    forward=forward,
    kernel=OptionalKernel(
        name="xformers",
        load=lambda: importlib.import_module("xformers.ops.fmha"),
        not_installed="xformers is not installed (pip install xformers)",
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        dtype_problem="{name} does not support {dtype}",
        distributions=("xformers",),
    ),
)
