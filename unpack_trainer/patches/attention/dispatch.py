"""The packed attention helper: checks a call, chooses its backend and runs it (branched batches included).

A call's packing metadata arrives resolved: the ``packed_seq_info`` keyword the decoder hook (or the registered
attention function) hands it, read once here. Only a direct call without the hook (``packed_seq_lengths``,
``cu_seq_lens_q`` or packed ``position_ids`` in its keywords) derives it, with the one detector,
:func:`unpack_trainer.packed_seq_info.detect_packed`, every call.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Any, NamedTuple

import torch
from torch import Tensor

from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import (
    BOUNDARY_KEYS,
    INFO_KEY,
    SEQ_PARENTS_KEY,
    PackedSeqInfo,
    detect_packed,
)
from unpack_trainer.patches.attention._common import (
    AttentionBackend,
    AttentionFeature,
    CallOptions,
    Needs,
    logger,
    tokens_major,
)
from unpack_trainer.patches.attention.registry import (
    REGISTRY,
    check_explicit_backend,
    choose_backend,
    compute_dtype,
    fallback_for,
    forced_backend,
)

__all__ = ["packed_attention_forward", "packed_info_from_kwargs", "prepare_packed_attention"]


# What a call may ask for, in the order packed_attention_forward reads it.
_CALL_FEATURES = (
    AttentionFeature.SLIDING_WINDOW,
    AttentionFeature.SOFTCAP,
    AttentionFeature.SINKS,
    AttentionFeature.DROPOUT,
    AttentionFeature.ALIBI,
    AttentionFeature.BIDIRECTIONAL,
    AttentionFeature.CHUNKS,
    AttentionFeature.BRANCHES,
)


# The dispatch's plans (:class:`~unpack_trainer.packed_seq_info.PlanCache` keys).
class _BackendChoice(NamedTuple):
    """The backend (and the fallback of its calls) on ``device`` in ``dtype`` for the calls asking for ``features``
    with heads of ``head_dims`` (largest, smallest), ``forced`` by the environment or not."""

    device: str
    dtype: torch.dtype
    original: str | None
    features: frozenset[AttentionFeature]
    head_dims: tuple[int, int]
    forced: str | None


class _BranchUnitsOn(NamedTuple):
    """:meth:`PackedSeqInfo.branch_units`' ``gather`` and ``owner`` on ``device``."""

    device: str


def packed_info_from_kwargs(query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> PackedSeqInfo | None:
    """The packing metadata of this call, or ``None`` for an unpacked call.

    ``packed_seq_info`` (set by the decoder hook, ``None`` meaning "not packed") when present; else, for a direct call
    without the hook, what :func:`unpack_trainer.packed_seq_info.detect_packed` decides from ``packed_seq_lengths``,
    ``cu_seq_lens_q`` or ``position_ids`` (the latter only with as many keys as queries, i.e. no KV cache), derived
    anew on every call.
    """
    if INFO_KEY in kwargs:
        return kwargs[INFO_KEY]
    if kwargs.get(SEQ_PARENTS_KEY) is not None:
        raise ValueError(
            f"Branched packed samples (`{SEQ_PARENTS_KEY}`) reach attention through the patched model's hook, which "
            f"passes `{INFO_KEY}`; patch the model with unpack_trainer.models.patch_model."
        )
    batch_size, _, seq_len, _ = query.shape
    for name in BOUNDARY_KEYS:
        if kwargs.get(name) is not None:
            return detect_packed(batch_size, seq_len, **{name: kwargs[name]})
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and key.shape[2] == seq_len:
        return detect_packed(batch_size, seq_len, position_ids=position_ids)
    return None


def prepare_packed_attention(
    info: PackedSeqInfo,
    device: torch.device,
    dtype: torch.dtype,
    implementation: str | None,
    needs: Needs,
) -> str:
    """Plan on the host, before the layers of a compiled model run, what their packed attention reads of this batch:
    the backend :func:`choose_backend` takes for ``device``, the compute ``dtype``, the model's ``implementation`` and
    what its attention applies (``needs``), and that backend's plans (its record's ``prepare``: buckets, block masks),
    kept in ``info.plans``. Returns the backend's name. Bidirectional image blocks (a model whose image tokens may
    attend both ways, Gemma 3) are asked for only when this batch has such spans (``info.bidirectional_spans``), as
    its layers will."""
    features = needs.features
    if info.bidirectional_spans is None:
        features = features - {AttentionFeature.BIDIRECTIONAL}
    choice = choose_backend(device, dtype, implementation, dataclasses.replace(needs, features=features))
    record = REGISTRY[choice.name]
    if record.prepare is not None:
        record.prepare(info, torch.device(device))
    return choice.name


def _decide(
    device: torch.device,
    dtype: torch.dtype,
    original: str | None,
    wanted: frozenset[AttentionFeature] | frozenset[str],
    head_dims: tuple[int, int],
) -> str:
    """The automatic (or forced) backend of a call asking for ``wanted`` (:class:`AttentionFeature` members or their
    values) with heads of ``head_dims`` (the largest and the smallest of the query and value head dims); a hand-over
    from the backend chosen for plain attention to one that can apply them is logged once."""
    needs = Needs(frozenset(wanted), *head_dims)
    choice = choose_backend(device, dtype, original, needs)
    plain = choose_backend(device, dtype, original)
    if plain.name != choice.name:
        missing = REGISTRY[plain.name].cannot_apply(needs)
        log_once(
            logger,
            logging.WARNING,
            f"Packed attention: {plain.name} cannot apply {' and '.join(missing)}; using {choice.name} for these "
            "layers.",
        )
    log_once(logger, logging.INFO, f"Packed attention backend: {choice}.")
    return choice.name


@torch.compiler.assume_constant_result
def _traced_choice(
    device: str,
    dtype: torch.dtype,
    original: str | None,
    wanted: frozenset[str],
    head_dims: tuple[int, int],
    forced: str | None,
) -> str:
    """:func:`_decide` inside a ``torch.compile`` trace: run once while tracing, its result a constant of the graph
    (the inputs' device and dtype are guarded by the graph already; ``forced`` is ``UNPACK_ATTENTION_BACKEND``)."""
    del forced  # part of the call so that a trace reads it: choose_backend reads it from the environment
    return _decide(torch.device(device), dtype, original, wanted, head_dims)


def _backend_for(
    info: PackedSeqInfo, query: Tensor, value: Tensor, original: str | None, wanted: frozenset[AttentionFeature]
) -> tuple[str, AttentionBackend]:
    """The backend of one call and the fallback of its kernel (:func:`fallback_for`), decided once per batch and set
    of features (in a ``torch.compile`` trace: the backend once per graph, as a constant of it)."""
    dims = (query.shape[-1], value.shape[-1])
    head_dims = (max(dims), min(dims))
    forced = forced_backend()
    if torch.compiler.is_compiling():
        names = frozenset(feature.value for feature in wanted)  # plain strings: constants of the trace
        name = _traced_choice(str(query.device), query.dtype, original, names, head_dims, forced)
        return name, fallback_for(Needs(wanted))

    def decide() -> tuple[str, AttentionBackend]:
        return _decide(query.device, query.dtype, original, wanted, head_dims), fallback_for(Needs(wanted))

    return info.plans.get(_BackendChoice(str(query.device), query.dtype, original, wanted, head_dims, forced), decide)


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
        backend: a name of :data:`~unpack_trainer.patches.attention.registry.REGISTRY`; ``None`` chooses with
            :func:`choose_backend`, handing what a backend cannot apply (softcap, sinks, dropout on torch_varlen) to
            one that can. A ``backend`` that cannot apply them raises ``ValueError``.
        original_implementation: the model's attention implementation before patching (for the choice).
        **kwargs: packing metadata (:func:`packed_info_from_kwargs`): ``packed_seq_info``,
            ``packed_seq_lengths`` ``(num_seqs,)`` int, ``cu_seq_lens_q`` ``(num_seqs + 1,)`` int32, or
            ``position_ids`` ``(B, T)``. ``s_aux``: attention sinks (gpt_oss), ``(num_heads,)`` one logit per query
            head added to every softmax denominator (eager applies them). ``is_causal`` (default: the module's).
            ``alibi_slopes``: ALiBi (bloom, mpt), ``(num_heads,)`` float, query ``i`` adds ``-slopes[h] * (i - j)`` to
            its score of key ``j``, both counted within the sample (flash's ``alibi_slopes``, SDPA and eager).
            ``attention_chunk_size``: chunked attention (llama4), each query sees the keys of its own chunk of that
            many tokens, chunks counted from its sample's start (:meth:`PackedSeqInfo.chunked`; every backend).
            Bidirectional spans on the metadata (``PackedSeqInfo.bidirectional_spans``, Gemma 3's image tokens): the
            tokens of a span also see each other's later tokens, on plain and branched rows (flex, SDPA and eager; a
            varlen kernel hands over).

    Returns:
        ``(attn_output, None)`` with ``attn_output`` ``(B, T, num_heads, head_dim_v)`` in the dtype attention
        computes in: under ``torch.autocast`` float32 inputs are cast to the autocast dtype first (and the backend
        chosen for it, :func:`~unpack_trainer.patches.attention.registry.compute_dtype`), else ``query``'s dtype;
        ``head_dim_v`` is the value head dim (MLA models such as deepseek_v3 have ``head_dim_v != head_dim``). Every
        query sees at least itself, so no row is fully masked and no output is NaN.
    """
    del attention_mask
    info = packed_info_from_kwargs(query, key, kwargs)
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
    sinks = kwargs.get(AttentionFeature.SINKS.keyword)
    if sinks is not None and sinks.numel() != num_heads:
        raise ValueError(
            f"Attention sinks (`s_aux`) need one logit per query head ({num_heads}), got {sinks.numel()}."
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}.")
    chunk_size = kwargs.get(AttentionFeature.CHUNKS.keyword)
    if chunk_size is not None:
        if info.bidirectional_spans is not None:
            raise ValueError("Bidirectional image blocks are not supported together with chunked attention.")
        info = info.chunked(chunk_size)
    alibi_slopes = kwargs.get(AttentionFeature.ALIBI.keyword)
    if info.bidirectional_spans is not None and alibi_slopes is not None:
        raise ValueError("Bidirectional image blocks are not supported together with ALiBi.")
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
    asked = (  # in the order of _CALL_FEATURES
        sliding_window is not None,
        softcap is not None,
        sinks is not None,
        dropout > 0,
        alibi_slopes is not None,
        info.bidirectional_spans is not None,
        chunk_size is not None,
        info.is_branched,
    )
    wanted = frozenset(itertools.compress(_CALL_FEATURES, asked))
    if backend is None:
        backend, fallback = _backend_for(info, query, value, original_implementation, wanted)
    else:
        dims = (head_dim, value.shape[-1])
        check_explicit_backend(backend, query.device, query.dtype, Needs(wanted, max(dims), min(dims)), from_env=False)
        fallback = fallback_for(Needs(wanted))
    record = REGISTRY[backend]
    options = CallOptions(
        scaling,
        dropout,
        sliding_window,
        softcap,
        sinks,
        module,
        alibi_slopes,
        fallback=fallback,
        kernel=None if record.kernel is None else record.kernel.get(),
    )
    if info.is_branched:
        return _branched(record, query, key, value, info, options), None
    return record.forward(query, key, value, info, options), None


def _branched(
    record: AttentionBackend, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
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
    token's output is read back from its own slot. Bidirectional spans (``info.bidirectional_spans``) travel on the
    units' metadata, over their slots (a prefix's span in every unit holding the prefix), so the backend's plain
    forward applies them; on the branch plans the masks apply them (flex: its mask function). Shapes as
    :class:`BackendFunction`: ``(B, num_heads, T, head_dim)`` in, ``(B, T, num_heads, head_dim_v)`` out.
    """
    if record.branched_forward is not None:
        out = record.branched_forward(query, key, value, info, options)
        if out is not None:
            return out
    batch_size, num_heads, seq_len, _ = query.shape
    unit_info, gather, owner = info.branch_units()
    device = query.device
    gather, owner = info.plans.get(
        _BranchUnitsOn(str(device)), lambda: (gather.to(device, non_blocking=True), owner.to(device))
    )

    def units(x: Tensor) -> Tensor:
        return tokens_major(x).index_select(0, gather).unsqueeze(0).transpose(1, 2)

    out = record.forward(units(query), units(key), units(value), unit_info, options)  # (1, slots, H, Dv)
    return out[0].index_select(0, owner).view(batch_size, seq_len, num_heads, out.shape[-1])
