"""The one definition of the estimated packing speedup, shared by the trainer's start line and ``unpack-trainer analyze``,
and the length analysis behind ``analyze`` ([`analyze_lengths`] -> [`PackingAnalysis`]).

Beside the data path rather than a stage of it: it reads the lengths of stage 2 and runs the packers of stage 3
([`unpack_trainer.data.packing`]) only to count rows; nothing it computes reaches a batch.

    speedup = padded tokens of random batches of B samples / real tokens

Padded training shuffles the samples and pads each batch of ``B`` samples to its longest; packed and padding-free
training process only the real tokens. ``B`` is the number of samples a padded step would hold: the
``--batch-size`` of ``analyze``; for the trainer, ``per_device_train_batch_size`` samples (padding-free) or
``per_device_train_batch_size`` rows times the mean samples per row (packing). A token count, not a measurement: it
leaves out attention's quadratic cost and per-step overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PackingAnalysis", "analyze_lengths", "estimated_speedup", "padded_batches"]


def padded_batches(lengths: np.ndarray, batch_size: int, *, seed: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """Batches of ``batch_size`` samples (the last may be smaller), shuffled with ``seed`` (``None``: in the given
    order), each padded to its longest sample.

    Args:
        lengths: ``(num_samples,)`` integer token counts, all positive.
        batch_size: samples per batch, ``>= 1``.
        seed: seed of the shuffle, or ``None`` to keep the order of ``lengths``.

    Returns:
        ``(real, padded)``: ``(num_batches,)`` int64 real tokens and padded tokens of each batch.

    Example:
        >>> padded_batches(np.array([100, 10, 90, 10]), 2, seed=None)   # batches [100, 10] and [90, 10]
        (array([110, 100]), array([200, 180]))
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}.")
    array = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if seed is not None:
        array = array[np.random.default_rng(seed).permutation(array.size)]
    num_batches = -(-array.size // batch_size)
    grid = np.zeros(num_batches * batch_size, dtype=np.int64)
    grid[: array.size] = array
    grid = grid.reshape(num_batches, batch_size)
    sizes = (grid > 0).sum(axis=1)
    return grid.sum(axis=1), grid.max(axis=1) * sizes


def estimated_speedup(lengths: np.ndarray, batch_size: float, *, seed: int = 0) -> float:
    """Padded tokens of random batches of ``batch_size`` samples (rounded, at least 1) / real tokens.

    Example:
        >>> estimated_speedup(np.array([10, 1]), 2)   # one batch padded to 10: 20 tokens for 11 real ones
        1.8181818181818181
    """
    array = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if array.size == 0 or int(array.sum()) == 0:
        raise ValueError("No tokens to estimate a speedup from.")
    _, padded = padded_batches(array, max(1, round(batch_size)), seed=seed)
    return float(padded.sum()) / float(array.sum())


@dataclass(frozen=True)
class PackingAnalysis:
    """What padded batching and packing cost for one set of sample lengths. All token counts are per epoch.

    Attributes:
        lengths: ``(num_samples,)`` int64 tokenized lengths, before truncation, empty samples excluded.
        max_length: row capacity and truncation limit.
        batch_size: samples per padded batch, and packed rows per packed batch.
        num_empty: samples of length 0 (left out of everything else).
        num_truncated: samples longer than ``max_length`` (TRL truncates them to ``max_length``).
        truncated_tokens: tokens cut off by that truncation.
        real_tokens: tokens left after truncation.
        padded_tokens: tokens processed by padded batching of random batches (the trainer shuffles; seed 0), each
            batch padded to its longest sample.
        sorted_padded_tokens: the same with the samples sorted by length first (the best ``group_by_length`` can do).
        num_batches: padded batches per epoch.
        rows: packed rows (sample indices into ``lengths``) from the global best-fit-decreasing packer.
        packed_tokens: ``len(rows) * max_length``: every packed row counted as full (an upper bound; padding-free
            batching processes only ``real_tokens``).
        batch_fill: ``(num_batches,)`` float64 real / padded tokens of each random padded batch.
        row_fill: ``(len(rows),)`` float64 real tokens / ``max_length`` of each packed row.
        default_packing: what the trainer's default packer (``packing_order="windowed"``, seed 0) chooses for these
            lengths: its window, fillers and rows against best-fit decreasing
            ([`unpack_trainer.data.packing.WindowedPacking.describe`]).
    """

    lengths: np.ndarray
    max_length: int
    batch_size: int
    num_empty: int
    num_truncated: int
    truncated_tokens: int
    real_tokens: int
    padded_tokens: int
    sorted_padded_tokens: int
    num_batches: int
    rows: list[list[int]] = field(repr=False)
    packed_tokens: int
    batch_fill: np.ndarray = field(repr=False)
    row_fill: np.ndarray = field(repr=False)
    default_packing: str = ""

    @property
    def num_samples(self) -> int:
        return int(self.lengths.size)

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / (packed rows × max_length)."""
        return self.real_tokens / self.packed_tokens

    @property
    def padding_waste(self) -> float:
        """Fraction of the tokens processed by padded batching (dataset order) that are padding."""
        return 1.0 - self.real_tokens / self.padded_tokens

    @property
    def sorted_padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.sorted_padded_tokens

    @property
    def speedup(self) -> float:
        """Token-count speedup estimate, [`estimated_speedup`]: padded tokens of random
        batches / real tokens (what the trainer's start line reports)."""
        return self.padded_tokens / self.real_tokens

    @property
    def sorted_speedup(self) -> float:
        """The same against length-sorted padded batches: sorted padded tokens / real tokens."""
        return self.sorted_padded_tokens / self.real_tokens


def analyze_lengths(lengths: Sequence[int] | np.ndarray, max_length: int, batch_size: int) -> PackingAnalysis:
    """Compare padded batching with packing for samples of the given token ``lengths``.

    Samples longer than ``max_length`` are counted and truncated to ``max_length`` (what TRL's ``SFTTrainer`` does
    with ``truncation_mode="keep_start"``) for both the padded and the packed estimate; empty samples are counted and
    left out.

    Args:
        lengths: ``(num_samples,)`` non-negative integer token counts, in dataset order.
        max_length: packed row capacity and truncation limit, ``>= 1``.
        batch_size: samples per padded batch (and packed rows per packed batch), ``>= 1``.

    Returns:
        A [`PackingAnalysis`].

    Raises:
        ValueError: ``max_length`` or ``batch_size`` < 1, a negative length, or no non-empty sample.

    Example:
        >>> a = analyze_lengths([100, 10, 10, 10], max_length=130, batch_size=2)
        >>> a.sorted_padded_tokens, len(a.rows), a.packed_tokens   # sorted batches [10, 10] [10, 100]: 20 + 200
        (220, 1, 130)
    """
    from unpack_trainer.data.packing import best_fit_decreasing, windowed_packing

    if max_length < 1:
        raise ValueError(f"`max_length` must be at least 1, got {max_length}.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}.")
    array = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if array.size and array.min() < 0:
        raise ValueError(f"Sample {int(np.argmin(array))} has a negative length {int(array.min())}.")
    num_empty = int((array == 0).sum())
    array = array[array > 0]
    if array.size == 0:
        raise ValueError("There is no non-empty sample to analyze.")
    clipped = np.minimum(array, max_length)
    real, padded = padded_batches(clipped, batch_size, seed=0)
    _, sorted_padded = padded_batches(np.sort(clipped), batch_size, seed=None)
    rows = best_fit_decreasing(clipped, max_length)
    row_tokens = np.asarray([int(clipped[row].sum()) for row in rows], dtype=np.int64)
    return PackingAnalysis(
        lengths=array,
        max_length=max_length,
        batch_size=batch_size,
        num_empty=num_empty,
        num_truncated=int((array > max_length).sum()),
        truncated_tokens=int((array - clipped).sum()),
        real_tokens=int(clipped.sum()),
        padded_tokens=int(padded.sum()),
        sorted_padded_tokens=int(sorted_padded.sum()),
        num_batches=int(padded.size),
        rows=rows,
        packed_tokens=len(rows) * max_length,
        batch_fill=real / padded,
        row_fill=row_tokens / max_length,
        default_packing=windowed_packing(clipped, max_length, seed=0).describe(),
    )
