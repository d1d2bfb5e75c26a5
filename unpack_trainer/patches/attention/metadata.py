"""The packing metadata of one attention call: the model hook's ``packed_seq_info``, or what a direct call carries
(``packed_seq_lengths``, ``cu_seq_lens_q``, packed ``position_ids``), derived once per forward; chunked attention as
packed attention over chunks."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from unpack_trainer._compat import tensor_version
from unpack_trainer.packed_seq_info import BOUNDARY_KEYS, INFO_KEY, SEQ_PARENTS_KEY, PackedSeqInfo
from unpack_trainer.patches.masks import detect_packed

__all__ = ["chunked_info", "packed_info_from_kwargs"]


class _LastDerivedInfo:
    """The metadata this helper derived last, for callers that bypass the model hook (which hands every layer a
    ``packed_seq_info``): every layer of one forward receives the same source tensor object, so the CPU work and any
    device sync happen once per forward. One entry, keyed by the source tensor's identity (a weak reference, so the
    batch is not kept alive) and version, its keyword name and the batch shape."""

    def __init__(self) -> None:
        self._source: weakref.ref[Tensor] | None = None
        self._key: tuple[str, int, int, int] | None = None
        self._info: PackedSeqInfo | None = None

    def get(self, source_name: str, source: Tensor, batch_size: int, seq_len: int) -> PackedSeqInfo | None:
        """The metadata of ``source`` (``packed_seq_lengths``, ``cu_seq_lens_q`` or ``position_ids``), derived once
        by the one detector, :func:`unpack_trainer.patches.masks.detect_packed`."""
        key = (source_name, tensor_version(source), batch_size, seq_len)
        if self._source is not None and self._source() is source and self._key == key:
            return self._info
        info = detect_packed(batch_size, seq_len, **{source_name: source})
        self._source, self._key, self._info = weakref.ref(source), key, info
        return info


_last_derived = _LastDerivedInfo()


def packed_info_from_kwargs(
    query: Tensor, key: Tensor, attention_mask: Any, kwargs: dict[str, Any]
) -> PackedSeqInfo | None:
    """The packing metadata of this call, or ``None`` for an unpacked call.

    ``packed_seq_info`` (set by the model hook, ``None`` meaning "not packed") when present; else, for a direct call
    without the hook, what :func:`unpack_trainer.patches.masks.detect_packed` decides from ``packed_seq_lengths``,
    ``cu_seq_lens_q`` or ``position_ids`` (the latter only without an attention mask and with as many keys as
    queries, i.e. no KV cache).
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
        source = kwargs.get(name)
        if source is not None:
            return _last_derived.get(name, source, batch_size, seq_len)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and attention_mask is None and key.shape[2] == seq_len:
        return _last_derived.get("position_ids", position_ids, batch_size, seq_len)
    return None


def chunked_info(info: PackedSeqInfo, chunk_size: int) -> PackedSeqInfo:
    """``info`` with every sample cut into chunks of ``chunk_size`` tokens counted from the sample's start (the last
    chunk of a sample may be shorter), cached on ``info``.

    Chunked attention (a query sees the keys of its own chunk only, causally) over packed samples is packed attention
    over their chunks, so every backend runs it unchanged. Lengths ``[5, 2]``, ``chunk_size`` 2 -> ``[2, 2, 1, 2]``.

    Raises:
        ValueError: ``chunk_size`` is not a positive number of tokens.
    """
    chunk_size = int(chunk_size)
    if chunk_size <= 0:
        raise ValueError(f"attention_chunk_size must be a positive number of tokens, got {chunk_size}.")
    if info.max_seqlen <= chunk_size and not info.is_branched:  # a branch's positions continue its prefix's
        return info

    def build() -> PackedSeqInfo:
        if info.is_branched:
            return _chunked_branches(info, chunk_size)
        lengths = info.seq_lengths.to(torch.int64)
        chunks = (lengths + chunk_size - 1) // chunk_size  # (num_seqs,) chunks per sample
        sizes = torch.full((int(chunks.sum()),), chunk_size, dtype=torch.int64)
        sizes[torch.cumsum(chunks, 0) - 1] = lengths - (chunks - 1) * chunk_size  # each sample's last chunk
        return PackedSeqInfo.from_seq_lengths(sizes.to(torch.int32), batch_size=info.batch_size, seq_len=info.seq_len)

    return info.plan("chunked", chunk_size, build)


def _chunked_branches(info: PackedSeqInfo, chunk_size: int) -> PackedSeqInfo:
    """:func:`chunked_info` of a branched batch: chunks are counted by position, and a branch continues its prefix's
    positions. A prefix is cut from its start; a branch's first piece, up to the next multiple of ``chunk_size`` of
    its positions, is a branch of the prefix's last chunk when that chunk is not full, so it sees the prefix tokens
    of its own chunk; the rest of the branch is cut into whole chunks that start fresh.

    Example, ``chunk_size`` 3, p, c, r of lengths 4, 3, 2 (positions 0-3, 4-6, 4-5): p -> ``[3, 1]``, c -> ``[2, 1]``
    (its first 2 tokens share the chunk of positions 3-5 with p's last token), r -> ``[2]``; parents
    ``[-1, -1, 1, -1, 1]``.
    """
    sizes: list[int] = []
    parents: list[int] = []
    last_chunk: dict[int, tuple[int, int]] = {}  # prefix sample -> (index of its last chunk, tokens in it)
    for index, (length, parent) in enumerate(zip(info.seq_lengths.tolist(), info.seq_parents.tolist())):
        if parent >= 0:
            chunk, filled = last_chunk[parent]
            if filled < chunk_size:
                first = min(length, chunk_size - filled)
                sizes.append(first)
                parents.append(chunk)
                length -= first
        whole, rest = divmod(length, chunk_size)
        pieces = [chunk_size] * whole + ([rest] if rest else [])
        sizes += pieces
        parents += [-1] * len(pieces)
        if parent < 0:
            last_chunk[index] = (len(sizes) - 1, pieces[-1])
    return PackedSeqInfo.from_seq_lengths(
        torch.tensor(sizes, dtype=torch.int32),
        batch_size=info.batch_size,
        seq_len=info.seq_len,
        seq_parents=torch.tensor(parents, dtype=torch.int64),
    )
