"""``eager``: ``softmax(softcap(QK^T * scaling) + mask) V`` per bucket of samples, as transformers' eager functions
compute it: the readable reference, and the one backend besides ``flash`` that applies every feature (sinks
included). Runs on every device and dtype; the automatic choice's last resort.
"""

from __future__ import annotations

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
from unpack_trainer.patches.attention.bucket_masks import (
    additive_mask,
    alibi_bias,
    bucket_additive_mask,
)
from unpack_trainer.patches.buckets import BucketPlan, attention_plan, bucketed, key_bucketed, unbucketed

__all__ = ["BACKEND"]

# Eager materialises (n, H, L, L) scores; buckets are run in chunks of at most this many score elements.
MAX_SCORE_ELEMENTS = 1 << 25


def forward(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions) -> Tensor:
    """``softmax(softcap(QK^T * scaling) + mask) V`` per bucket, as transformers' eager functions compute it: the
    readable reference, and the one backend that applies sinks.

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)`` in any float dtype -> ``(B, T, num_heads, head_dim_v)``; the softmax runs in
    float32. The SDPA buckets (:func:`attention_plan`), run in chunks of at most ``MAX_SCORE_ELEMENTS`` scores.

    GQA: each kv head repeated ``num_heads // num_kv_heads`` times. Window ``w``: keys ``i - w < j <= i``, through an
    additive ``(L, L)`` mask of ``finfo(dtype).min`` (finite: never NaN; no query row is fully masked anyway).
    Softcap ``c``: ``tanh(scores / c) * c`` before the mask. Sinks ``(num_heads,)``: every query's softmax denominator
    also holds ``exp(sinks[h])``: ``weights = exp(scores - logaddexp(logsumexp(scores), sinks[h]))``, the sink's own
    weight dropped, as gpt_oss's ``eager_attention_forward`` does by concatenating a sink column. Dropout: on the
    weights, only while ``options.module.training``. ALiBi: ``-slopes[h] * (i - j)`` added to the scores.
    Bidirectional spans (``info.bidirectional_spans``): an ``(n, 1, L, L)`` additive mask on each bucket holding one
    (on a branch plan, the branch buckets' masks hold their spans too).
    """
    return buckets_forward(query, key, value, info, options, attention_plan(info, query.device))


def buckets_forward(
    query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions, plan: BucketPlan
) -> Tensor:
    """:func:`forward` on the buckets of ``plan``: a plain plan, or a branch plan (:func:`branch_plan`) whose
    branch buckets add their bottom-right causal masks as ``(n, 1, L, Lk)`` additive masks, bidirectional spans
    included (ALiBi never reaches one)."""
    batch_size, num_heads, seq_len, _ = query.shape
    heads_per_kv = num_heads // key.shape[1]
    scaling, softcap = options.scaling, options.softcap
    qs = bucketed(tokens_major(query), plan)
    ks, vs = (key_bucketed(tokens_major(x), plan) for x in (key, value))
    dropout = options.dropout if getattr(options.module, "training", False) else 0.0
    sink_logits = None
    if options.sinks is not None:
        sink_logits = options.sinks.to(device=query.device, dtype=torch.float32).view(1, num_heads, 1, 1)
    outputs = []
    for index, (bucket, q_bucket, k_bucket, v_bucket) in enumerate(zip(plan.buckets, qs, ks, vs)):
        length, key_length = bucket.length, bucket.key_length or bucket.length
        mask = bucket_additive_mask(info, index, bucket, options.sliding_window, query.dtype, query.device)
        if mask is None:
            mask = additive_mask(info, length, options.sliding_window, query.dtype, query.device)
        per_chunk = max(1, MAX_SCORE_ELEMENTS // (num_heads * length * key_length))
        masks = mask.split(per_chunk) if mask.dim() == 4 else [mask] * (-(-bucket.count // per_chunk))
        chunks = []
        splits = (q_bucket.split(per_chunk), k_bucket.split(per_chunk), v_bucket.split(per_chunk), masks)
        for q, k, v, mask in zip(*splits):
            k, v = repeat_heads(k, heads_per_kv), repeat_heads(v, heads_per_kv)
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
                    alibi_bias(info, length, None, options.alibi_slopes, query.dtype, query.device, masked=False)
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
    return unbucketed(outputs, plan, batch_size, seq_len)


# Not a choice among the others: what remains when none of them can run or apply the call.
BACKEND = bucket_backend(
    "eager",
    frozenset(feature for feature in AttentionFeature if not feature.by_dispatch),  # every one a backend can serve
    forward,
    buckets_forward,
    automatic=False,
    keeps_implementation="eager",  # transformers' eager functions, computed as they compute them
)
