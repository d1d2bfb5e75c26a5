"""What flash-attn and torch's ``varlen_attn`` share: one ``(total_tokens, num_heads, head_dim)`` call with the
samples' ``cu_seqlens``, rows split at sample boundaries where the kernel's 32-bit offsets would overflow. Below the
backends: it imports none of them (a sample too large for the kernel goes to the call's ``fallback``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import PackedSeqInfo

__all__ = ["MAX_HEAD_DIM", "fits_offsets", "one_head_dim", "varlen_forward", "varlen_window"]

# The attention backends' logger (one name for the package's attention messages).
logger = logging.getLogger("unpack_trainer.patches.attention")

# flash-attn 2 and torch's varlen flash kernel take head dims up to 256 (one head dim for q, k and v).
MAX_HEAD_DIM = 256


# flash-attn's varlen backward indexes its fp32 dq accumulator, of (total_tokens + 128 * num_seqs) * num_heads *
# head_dim rounded up (see rounded_head_dim) elements, with 32-bit offsets in the releases that predate the fix
# (flash-attention PR 1500). Rows above this bound (fits_offsets) are split at sample boundaries.
MAX_ELEMENTS = 2**31 - 1


class _Chunks(NamedTuple):
    """The plan of :func:`varlen_chunks`."""

    num_heads: int
    head_dim: int
    device: str


class VarlenChunk(NamedTuple):
    first_seq: int  # index of the chunk's first sample
    begin: int  # token range [begin, end) of the chunk
    end: int
    max_seqlen: int
    cu_seqlens: Tensor | None  # (n + 1,) int32 on the device, zero-based; None when flash-attn cannot take it
    fallback: PackedSeqInfo | None  # the chunk's own metadata, for another backend


def rounded_head_dim(head_dim: int) -> int:
    """The head dimension flash-attn allocates its backward accumulator with (rounded to 32, or 64 above 128)."""
    multiple = 32 if head_dim <= 128 else 64
    return -(-head_dim // multiple) * multiple


def fits_offsets(tokens: int, num_seqs: int, num_heads: int, head_dim: int) -> bool:
    """Whether flash-attn's varlen backward accumulator for ``num_seqs`` sequences of ``tokens`` tokens in all stays
    within its 32-bit offsets: ``(tokens + 128 * num_seqs) * num_heads * rounded head_dim <= MAX_ELEMENTS``."""
    return (tokens + 128 * num_seqs) * num_heads * rounded_head_dim(head_dim) <= MAX_ELEMENTS


def varlen_chunks(info: PackedSeqInfo, num_heads: int, head_dim: int, device: torch.device) -> list[VarlenChunk]:
    """Split the samples into chunks small enough for flash-attn's 32-bit offsets (one chunk in the usual case).

    Chunks end at sample boundaries. A sample too large on its own is a chunk of its own with ``cu_seqlens``
    ``None``, for the caller to send elsewhere. Built once per batch, head count, head dim and device.
    """

    def build() -> list[VarlenChunk]:
        lengths = info.seq_lengths.tolist()
        bounds: list[tuple[int, int]] = []
        first, tokens = 0, 0
        for index, length in enumerate(lengths):
            if index > first and not fits_offsets(tokens + length, index - first + 1, num_heads, head_dim):
                bounds.append((first, index))
                first, tokens = index, 0
            tokens += length
        bounds.append((first, len(lengths)))
        chunks = []
        for first, last in bounds:
            begin, end = int(info.cu_seqlens[first]), int(info.cu_seqlens[last])
            longest = max(lengths[first:last])
            if not fits_offsets(end - begin, last - first, num_heads, head_dim):
                sub = PackedSeqInfo(info.seq_lengths[first:last], batch_size=1, seq_len=end - begin)
                chunks.append(VarlenChunk(first, begin, end, longest, None, sub))
            else:
                cu_seqlens = (info.cu_seqlens[first : last + 1] - info.cu_seqlens[first]).to(device, non_blocking=True)
                chunks.append(VarlenChunk(first, begin, end, longest, cu_seqlens, None))
        return chunks

    return info.plans.get(_Chunks(num_heads, head_dim, str(device)), build)


def varlen_window(longest: int, sliding_window: int | None) -> tuple[int, int] | None:
    """flash-attn's ``window_size`` for transformers' window ``w`` (keys ``i - w < j <= i``): ``(w - 1, 0)``, inclusive
    on both sides; ``None`` when there is no window or no sequence (of ``longest`` keys at most) is longer than it
    (plain causal attention)."""
    if sliding_window is not None and longest > sliding_window:
        return (sliding_window - 1, 0)
    return None


def one_head_dim(q: Tensor, k: Tensor, v: Tensor, multiple: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(tokens, heads, head_dim)`` q and k and ``(tokens, heads, head_dim_v)`` v zero-padded to one head dim, the
    smallest multiple of ``multiple`` not below either (zero columns leave every score unchanged; the caller crops
    the output's padded value columns)."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    padded = -(-max(head_dim, head_dim_v) // multiple) * multiple
    q, k = (F.pad(x, (0, padded - head_dim)) if padded != head_dim else x for x in (q, k))
    return q, k, F.pad(v, (0, padded - head_dim_v)) if padded != head_dim_v else v


def fallback_of(options: Any) -> tuple[str, Fallback]:
    """The name and forward of ``options.fallback`` (a backend record of torch's own ops, set by the dispatch), bound
    to the call's options."""
    record = options.fallback
    return record.name, lambda q, k, v, info: record.forward(q, k, v, info, options)


def _tokens(x: Tensor) -> Tensor:
    """(B, num_heads, T, head_dim) -> (B * T, num_heads, head_dim), contiguous as transformers hands it to flash-attn."""
    batch_size, num_heads, seq_len, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch_size * seq_len, num_heads, head_dim).contiguous()


# kernel_call(q, k, v, cu_seqlens, max_seqlen): q/k/v (tokens, num_heads or num_kv_heads, padded head_dim), cu_seqlens
# (num_seqs + 1,) int32 on the device -> (tokens, num_heads, padded head_dim).
VarlenCall = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]
# fallback(q, k, v, info): (1, heads, tokens, head_dim) q / k / v of one sample and its metadata -> (1, tokens, heads,
# head_dim_v), on a backend that runs anywhere.
Fallback = Callable[[Tensor, Tensor, Tensor, PackedSeqInfo], Tensor]


def varlen_forward(
    kernel_call: VarlenCall,
    kernel_name: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    info: PackedSeqInfo,
    *,
    head_dim_multiple: int,
    fallback: tuple[str, Fallback],
) -> Tensor:
    """Shared by flash-attn and torch's varlen_attn: ``(total_tokens, num_heads, head_dim)`` inputs with one head dim
    for q, k and v (zero-padded up to ``head_dim_multiple``), the samples' ``cu_seqlens`` and ``max_seqlen``, rows
    split into chunks (a plan of the batch, :func:`varlen_chunks`) where the kernel's 32-bit offsets would overflow; a
    sample too large alone runs on ``fallback`` (its name and forward: the dispatch's, SDPA or eager). Zero padding of
    q and k leaves every score unchanged (``scaling`` is explicit); padded value columns are cropped from the output.

    Returns ``(B, T, num_heads, head_dim_v)``.
    """
    batch_size, num_heads, seq_len, head_dim = query.shape
    head_dim_v = value.shape[-1]
    # (total_tokens, num_heads, head_dim), contiguous as transformers hands them to flash-attn.
    q_tokens, k_tokens, v_tokens = (_tokens(x) for x in (query, key, value))
    q_in, k_in, v_in = one_head_dim(q_tokens, k_tokens, v_tokens, head_dim_multiple)
    padded = q_in.shape[-1]

    def crop(out: Tensor) -> Tensor:
        return out[..., :head_dim_v] if padded != head_dim_v else out

    chunks = varlen_chunks(info, num_heads, padded, query.device)
    if len(chunks) == 1 and chunks[0].cu_seqlens is not None:
        out = crop(kernel_call(q_in, k_in, v_in, chunks[0].cu_seqlens, info.max_seqlen))
        return out.reshape(batch_size, seq_len, num_heads, head_dim_v)
    log_once(
        logger,
        logging.WARNING,
        f"A packed batch of {info.total_tokens} tokens x {num_heads} heads x head_dim {padded} exceeds "
        f"{kernel_name}'s 32-bit offsets; it is run in {len(chunks)} chunks split at sample boundaries.",
    )
    outputs = []
    for chunk in chunks:
        part = slice(chunk.begin, chunk.end)
        if chunk.cu_seqlens is not None:
            outputs.append(crop(kernel_call(q_in[part], k_in[part], v_in[part], chunk.cu_seqlens, chunk.max_seqlen)))
            continue
        log_once(
            logger,
            logging.WARNING,
            f"Packed sample {chunk.first_seq} ({chunk.end - chunk.begin} tokens) alone exceeds {kernel_name}'s 32-bit "
            f"offsets; it runs on {fallback[0]} instead.",
        )
        q, k, v = (x[part].transpose(0, 1).unsqueeze(0) for x in (q_tokens, k_tokens, v_tokens))
        out = fallback[1](q, k, v, chunk.fallback)
        outputs.append(out.reshape(chunk.end - chunk.begin, num_heads, head_dim_v))
    return torch.cat(outputs).view(batch_size, seq_len, num_heads, head_dim_v)
