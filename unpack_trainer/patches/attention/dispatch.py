"""The packed attention helper: checks a call, chooses its backend once per batch and runs it (branched batches
included)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from torch import Tensor

from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention._common import CallOptions, logger, tokens_major
from unpack_trainer.patches.attention.metadata import chunked_info, packed_info_from_kwargs
from unpack_trainer.patches.attention.registry import (
    ENV_BACKEND,
    REGISTRY,
    BackendChoice,
    check_explicit_backend,
    choose_backend,
    compute_dtype,
    features,
    missing_features,
)

__all__ = ["packed_attention_forward"]


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
    min_head_dim = min(query.shape[-1], value.shape[-1])
    flags = (softcap, sinks, dropout, head_dim, min_head_dim, alibi)
    key = (str(query.device), query.dtype, original, flags, os.environ.get(ENV_BACKEND))

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
            min_head_dim=min_head_dim,
        )
        plain = choose_backend(query.device, query.dtype, original)
        if plain.name != choice.name:
            wanted = features(softcap=softcap, sinks=sinks, dropout=dropout, alibi=alibi)
            missing = missing_features(plain.name, wanted, head_dim, min_head_dim)
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
            ``(B, num_kv_heads, T, head_dim_v)``; float dtypes, all cast to the one attention computes in (see
            Returns; flash and torch_varlen: float16 / bfloat16).
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
        ``(attn_output, None)`` with ``attn_output`` ``(B, T, num_heads, head_dim_v)`` in the dtype attention
        computes in: under ``torch.autocast`` float32 inputs are cast to the autocast dtype first (and the backend
        chosen for it, :func:`~unpack_trainer.patches.attention.registry.compute_dtype`), else ``query``'s dtype;
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
    # The dtype the kernel computes in: under autocast, fp32 q / k (RoPE by fp32 cos / sin) and a half-precision v
    # all go to the autocast dtype, and the backend is chosen for it.
    target = compute_dtype(query.device, functools.reduce(torch.promote_types, (query.dtype, key.dtype, value.dtype)))
    query, key, value = (x if x.dtype == target else x.to(target) for x in (query, key, value))
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
        wanted = features(
            softcap=softcap is not None, sinks=sinks is not None, dropout=dropout > 0, alibi=alibi_slopes is not None
        )
        dims = (head_dim, value.shape[-1])
        check_explicit_backend(
            backend, query.device, query.dtype, wanted, max(dims), from_env=False, min_head_dim=min(dims)
        )
    options = CallOptions(scaling, dropout, sliding_window, softcap, sinks, module, alibi_slopes)
    if info.is_branched:
        return _branched(backend, query, key, value, info, options), None
    return REGISTRY[backend].forward(query, key, value, info, options), None


def _branched(
    backend: str, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
) -> Tensor:
    """Backend ``backend`` on branched samples (shared prefixes); no branch sees a sibling.

    SDPA, eager and flash-attn (without ALiBi) compute every query once: the prefix with its first branch as one
    causal unit, each later branch's queries against the keys ``[prefix; branch]``, aligned to the end of its keys
    (each record's ``branched_forward``: :func:`~unpack_trainer.patches.buckets.branch_plan` with
    :func:`~unpack_trainer.patches.attention.bucket_masks.branch_mask`, and ``flash.branched_forward``). torch's varlen_attn and xformers (whose
    alignment for more keys than queries this package does not rely on), ALiBi, and a batch whose first branch does
    not follow its prefix run every branch as the plain causal unit ``[prefix; branch]``
    (:meth:`PackedSeqInfo.branch_units`), so each backend applies its own causal mask, window, softcap and sinks to
    it unchanged; the prefix's queries are then computed once per branch and dropped after the first.

    On the units path the tokens are gathered into the units (a prefix read once per branch; autograd sums the
    prefix's key/value gradients over its branches), the backend runs on one row of ``num_slots`` tokens, and each
    token's output is read back from its own slot. Shapes as :class:`BackendFunction`: ``(B, num_heads, T,
    head_dim)`` in, ``(B, T, num_heads, head_dim_v)`` out.
    """
    record = REGISTRY[backend]
    if record.branched_forward is not None:
        out = record.branched_forward(query, key, value, info, options)
        if out is not None:
            return out
    batch_size, num_heads, seq_len, _ = query.shape
    unit_info, gather, owner = info.branch_units()
    device = query.device
    gather, owner = info.plan(
        "branch_units_device", str(device), lambda: (gather.to(device, non_blocking=True), owner.to(device))
    )

    def units(x: Tensor) -> Tensor:
        return tokens_major(x).index_select(0, gather).unsqueeze(0).transpose(1, 2)

    out = record.forward(units(query), units(key), units(value), unit_info, options)  # (1, slots, H, Dv)
    return out[0].index_select(0, owner).view(batch_size, seq_len, num_heads, out.shape[-1])
