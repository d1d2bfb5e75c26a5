"""Packing metadata: the per-sample lengths of a packed batch and what is derived from them, computed on the CPU.

The one piece of the data path shared by the collator (which writes the metadata into a batch) and the patches
(which read it back in the model). It depends on torch only, so the collator never imports the attention backends.

Worked example, one row of two samples of lengths 3 and 2::

    seq_lengths    [3, 2]              (num_seqs,)      int32
    cu_seqlens     [0, 3, 5]           (num_seqs + 1,)  int32, zero-prefixed cumsum
    max_seqlen     3                   Python int
    position_ids   [[0, 1, 2, 0, 1]]   (B, T)           int64, restarting at 0 per sample
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

__all__ = ["PackedSeqInfo", "restart_positions", "zero_prefixed_cumsum"]

_T = TypeVar("_T")


def zero_prefixed_cumsum(seq_lengths: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` of ``seq_lengths``: ``(num_seqs,)`` integer lengths -> ``(num_seqs + 1,)`` of the same dtype,
    ``[0, l0, l0 + l1, ...]``.

    Example::

        >>> zero_prefixed_cumsum(torch.tensor([3, 2], dtype=torch.int32)).tolist()
        [0, 3, 5]
    """
    cu_seqlens = torch.zeros(seq_lengths.numel() + 1, dtype=seq_lengths.dtype)
    torch.cumsum(seq_lengths, dim=0, out=cu_seqlens[1:])
    return cu_seqlens


def restart_positions(seq_lengths: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids restarting at 0 for every sample.

    Args:
        seq_lengths: ``(num_seqs,)`` integer lengths (CPU), in order.
        cu_seqlens: ``(num_seqs + 1,)`` zero-prefixed cumsum of ``seq_lengths`` when the caller has it already.

    Returns:
        ``(total_tokens,)`` int64 on the CPU, ``total_tokens = seq_lengths.sum()``.

    Example::

        >>> restart_positions(torch.tensor([3, 2])).tolist()
        [0, 1, 2, 0, 1]
    """
    lengths = seq_lengths.to(torch.int64)
    if cu_seqlens is None:
        cu_seqlens = zero_prefixed_cumsum(lengths)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lengths)
    return torch.arange(starts.numel(), dtype=torch.int64) - starts


class PackedSeqInfo:
    """Packing metadata of one batch, computed once per forward on the CPU and shared by every layer.

    A packed batch is ``B`` rows of ``T`` tokens; the samples of all rows, in row-major order, have the lengths
    ``seq_lengths`` (every sample inside one row; trailing row padding is a sample of its own).

    Attributes:
        seq_lengths: ``(num_seqs,)`` int32 CPU, every length >= 1, summing to ``B * T``.
        cu_seqlens: ``(num_seqs + 1,)`` int32 CPU, zero-prefixed cumsum of ``seq_lengths``.
        max_seqlen: the longest sample, a Python int.
        batch_size, seq_len: ``B`` and ``T``.

    What a consumer derives from the metadata (device copies, the SDPA buckets, masks, flash-attn chunks, xformers
    biases, the backend choice) is built on first use and cached on the object through :meth:`plan`, one namespace
    per owner, so no layer repeats the work or synchronises with the device.

    Example::

        >>> info = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2]), batch_size=1, seq_len=5)
        >>> info.cu_seqlens.tolist(), info.max_seqlen
        ([0, 3, 5], 3)
    """

    def __init__(self, seq_lengths: torch.Tensor, *, batch_size: int, seq_len: int) -> None:
        lengths = torch.as_tensor(seq_lengths).detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        if lengths.numel() == 0:
            raise ValueError("Packed attention got no samples: `packed_seq_lengths` is empty.")
        bad = torch.nonzero(lengths <= 0)
        if bad.numel():
            index = int(bad[0, 0])
            raise ValueError(
                f"Packed sample {index} has length {int(lengths[index])}; every sample needs at least one token."
            )
        total_tokens = int(lengths.sum())
        if total_tokens != batch_size * seq_len:
            raise ValueError(
                f"The packed sample lengths sum to {total_tokens} tokens but the batch has {batch_size} row(s) of "
                f"{seq_len} tokens ({batch_size * seq_len}); trailing row padding must be a sample of its own."
            )
        cu_seqlens = zero_prefixed_cumsum(lengths)
        if batch_size > 1:
            boundaries = torch.arange(1, batch_size, dtype=torch.int64) * seq_len
            crossing = ~torch.isin(boundaries, cu_seqlens)
            if bool(crossing.any()):
                row = int(torch.nonzero(crossing)[0, 0])
                sample = int(torch.searchsorted(cu_seqlens, boundaries[row], right=True)) - 1
                raise ValueError(
                    f"Packed sample {sample} crosses the boundary between rows {row} and {row + 1} (row length "
                    f"{seq_len}); samples must not span rows."
                )
        self.seq_lengths = lengths.to(torch.int32)
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.max_seqlen = int(lengths.max())
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self._plans: dict[str, dict[Hashable, Any]] = {}

    def __repr__(self) -> str:
        return (
            f"PackedSeqInfo(num_seqs={self.num_seqs}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"max_seqlen={self.max_seqlen})"
        )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lengths.numel())

    @property
    def total_tokens(self) -> int:
        return self.batch_size * self.seq_len

    # -- constructors ------------------------------------------------------------------------------------------------

    @classmethod
    def from_seq_lengths(cls, seq_lengths: torch.Tensor, *, batch_size: int, seq_len: int) -> PackedSeqInfo:
        """From ``packed_seq_lengths``: ``(num_seqs,)`` integer lengths, row-major over the batch (any device)."""
        return cls(seq_lengths, batch_size=batch_size, seq_len=seq_len)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, *, batch_size: int, seq_len: int) -> PackedSeqInfo:
        """From ``cu_seq_lens_q``: ``(num_seqs + 1,)`` zero-prefixed cumulative lengths (any device)."""
        cu = torch.as_tensor(cu_seqlens).detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        if cu.numel() < 2 or int(cu[0]) != 0:
            raise ValueError(f"`cu_seq_lens_q` must be zero-prefixed cumulative lengths, got {cu.tolist()[:8]}...")
        return cls(cu[1:] - cu[:-1], batch_size=batch_size, seq_len=seq_len)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedSeqInfo | None:
        """From ``position_ids`` ``(B, T)``: a sample starts at each row start and wherever a position is not the
        previous one plus 1. Returns ``None`` when every row holds a single sample (nothing is packed)."""
        pos = position_ids.detach().to(device="cpu", dtype=torch.int64)
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        batch_size, seq_len = pos.shape
        if seq_len == 0:
            return None
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        if int(starts.sum()) == batch_size:
            return None
        start_index = torch.nonzero(starts.reshape(-1)).reshape(-1)
        ends = torch.cat([start_index[1:], torch.tensor([batch_size * seq_len])])
        return cls(ends - start_index, batch_size=batch_size, seq_len=seq_len)

    # -- derived values ----------------------------------------------------------------------------------------------

    def position_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(B, T)`` int64 positions restarting at 0 for every sample, on ``device`` (the CPU when ``None``)."""
        positions = restart_positions(self.seq_lengths, self.cu_seqlens).view(self.batch_size, self.seq_len)
        return positions if device is None else positions.to(device)

    def plan(self, owner: str, key: Hashable, build: Callable[[], _T]) -> _T:
        """The value ``owner`` cached under ``key`` for these samples, made by ``build()`` on first use.

        Each consumer of the metadata (an attention backend, the backend choice) uses its own ``owner`` name and
        only its own keys, so no consumer reads or overwrites another's plan. Keys hold whatever the plan depends on
        besides the samples (device, dtype, head counts, window).
        """
        plans = self._plans.setdefault(owner, {})
        if key not in plans:
            plans[key] = build()
        return plans[key]
