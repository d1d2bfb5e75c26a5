"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` per sample, without any ``(T, T)`` mask.

Samples of similar length are gathered into one padded ``(n, num_heads, L, head_dim)`` batch (padding at the end of
each sample, where causal attention of real tokens never sees it; :mod:`unpack_trainer.patches.buckets`) and run in
one causal call, so memory is linear in ``T`` and thousands of tiny samples cost a handful of calls. Runs on every
device and dtype.

On CUDA the buckets are planned for a GPU (few large buckets of lengths from a fixed grid,
:func:`~unpack_trainer.patches.buckets.planning_for`) and run without cuDNN attention (:func:`_planless_kernels`):
the host stays ahead of the GPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention._common import (
    AttentionFeature,
    CallOptions,
    bucket_backend,
    repeat_heads,
    tokens_major,
)
from unpack_trainer.patches.attention.bucket_masks import alibi_bias, band_mask, bidirectional_mask, branch_mask
from unpack_trainer.patches.buckets import (
    Bucket,
    BucketPlan,
    attention_plan,
    bucketed,
    key_bucketed,
    unbucketed,
)

__all__ = ["BACKEND"]

# Device types whose bucket calls run without cuDNN attention.
NO_CUDNN_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def _planless_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends for the bucket calls on ``device``: on CUDA those enabled now minus cuDNN attention (through
    ``torch.nn.attention.sdpa_kernel``, which ``torch.compile`` understands); elsewhere, or where cuDNN attention is
    already off or is the only one enabled, nothing changes.

    cuDNN attention (SDPA's choice for bf16 on Hopper) builds an execution plan on the host for every new
    ``(n, num_heads, L, head_dim)``: about 2 ms of CPU per call, measured on an H200 where the buckets of a step had
    ~50 shapes per layer and the GPU was busy 0.38 s of a 3.0 s step. Flash, memory-efficient and math attention
    plan nothing. A user's own choice of backends (``sdpa_kernel`` around the step) is kept, less cuDNN.
    """
    if device.type not in NO_CUDNN_DEVICE_TYPES or not torch.backends.cuda.cudnn_sdp_enabled():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = [
        backend
        for backend, on in (
            (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
            (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
            (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
        )
        if on
    ]
    return sdpa_kernel(enabled) if enabled else contextlib.nullcontext()


def forward(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions) -> Tensor:
    """Per-sample causal attention through ``F.scaled_dot_product_attention``, one call per bucket of similar lengths.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)`` in any float dtype SDPA takes -> ``(B, T, num_heads, head_dim_v)``. Each
    bucket is a padded ``(n, num_heads, L, head_dim)`` batch, padding after each sample's tokens where no real query
    sees it (the batch's bucket plan, kept in ``info.plans``).

    GQA: ``enable_gqa`` where the bucket runs ``is_causal``, else each kv head repeated
    ``num_heads // num_kv_heads`` times. Window ``w``: a ``(L, L)`` band mask ``i - w < j <= i`` on each bucket longer
    than ``w`` (a shorter one stays ``is_causal``). Dropout: SDPA's ``dropout_p``. Softcap, sinks: refused. No query
    row is fully masked (each sees itself, padded ones included). ALiBi: a float ``(num_heads, L, L)`` mask of the
    per-sample biases (:func:`alibi_bias`) on every bucket. Bidirectional spans (``info.bidirectional_spans``): an
    ``(n, 1, L, L)`` mask (:func:`bidirectional_mask`) on each bucket that holds one (on a branch plan: each causal
    unit's, read from the tokens of its prefix and first branch; a later branch's span in its :func:`branch_mask`).
    """
    return buckets_forward(query, key, value, info, options, attention_plan(info, query.device))


def buckets_forward(
    query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions, plan: BucketPlan
) -> Tensor:
    """:func:`forward` on the buckets of ``plan``: a plain plan, or a branch plan (:func:`branch_plan`) whose
    branch buckets run with their bottom-right causal masks (windows and bidirectional spans applied; ALiBi never
    reaches one)."""
    batch_size, num_heads, seq_len, _ = query.shape
    heads_per_kv = num_heads // key.shape[1]
    qs = bucketed(tokens_major(query), plan)
    ks, vs = (key_bucketed(tokens_major(x), plan) for x in (key, value))
    outputs = []
    with _planless_kernels(query.device):
        for index, (bucket, q, k, v) in enumerate(zip(plan.buckets, qs, ks, vs)):
            outputs.append(_bucket_attention(info, index, bucket, q, k, v, options, heads_per_kv))
    return unbucketed(outputs, plan, batch_size, seq_len)


def _bucket_attention(
    info: PackedSeqInfo,
    index: int,
    bucket: Bucket,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: CallOptions,
    heads_per_kv: int,
) -> Tensor:
    """One SDPA call on bucket ``index`` of the plan: q ``(n, num_heads, L, head_dim)``, k / v
    ``(n, num_kv_heads, Lk, head_dim(_v))`` -> ``(n, num_heads, L, head_dim_v)``."""
    window = options.sliding_window
    mask = None
    if bucket.key_length:
        mask = branch_mask(info, index, bucket, window, q.device)
    elif options.alibi_slopes is not None:
        mask = alibi_bias(info, bucket.length, window, options.alibi_slopes, q.dtype, q.device)
    elif info.bidirectional_spans is not None:
        mask = bidirectional_mask(info, index, bucket, window, q.device)  # None: no span in this bucket
    if mask is None and window is not None and bucket.length > window:
        mask = band_mask(info, bucket.length, window, q.device)
    extra = {}
    if heads_per_kv > 1:
        if mask is None:
            extra["enable_gqa"] = True
        else:
            k, v = repeat_heads(k, heads_per_kv), repeat_heads(v, heads_per_kv)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=options.dropout, is_causal=mask is None, scale=options.scaling, **extra
    )


BACKEND = bucket_backend(
    "sdpa",
    frozenset(
        {
            AttentionFeature.SLIDING_WINDOW,
            AttentionFeature.DROPOUT,
            AttentionFeature.ALIBI,
            AttentionFeature.BIDIRECTIONAL,
        }
    ),
    forward,
    buckets_forward,
)
