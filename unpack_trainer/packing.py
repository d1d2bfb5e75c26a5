"""Bin packing of samples into fixed-capacity rows: which samples share a row, decided from their lengths alone.

Everything here is a pure function of lengths: no model code, no global state. Writing token sequences into packed
tensors (``pack_sequences``, ``concatenate_and_pack``) lives in [`unpack_trainer.tensor_packing`]; those names can
still be imported from this module.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import numpy as np

from unpack_trainer._validation import as_sequence, check_positive_int

logger = logging.getLogger(__name__)

Strategy = Literal["first_fit", "bfd"]

_STRATEGIES = ("first_fit", "bfd")


# --------------------------------------------------------------------------------------------------------------------
# Bin packing over lengths
# --------------------------------------------------------------------------------------------------------------------


def _check_capacity(capacity: int, name: str = "capacity") -> int:
    return check_positive_int(capacity, name)


def _as_lengths(lengths: Iterable[int] | np.ndarray, capacity: int) -> np.ndarray:
    """Validate ``lengths`` against ``capacity`` and return them as a 1-D int64 array."""
    capacity = _check_capacity(capacity)
    array = np.asarray(as_sequence(lengths, "lengths"))
    if array.ndim != 1:
        raise ValueError(f"`lengths` must be 1-D, got shape {array.shape}.")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"`lengths` must be integers, got dtype {array.dtype}.")
    array = array.astype(np.int64, copy=False)
    if array.size:
        too_short = np.flatnonzero(array <= 0)
        if too_short.size:
            i = int(too_short[0])
            raise ValueError(
                f"Sample {i} has length {int(array[i])}; every sample needs at least one token "
                f"({too_short.size} sample(s) are empty)."
            )
        too_long = np.flatnonzero(array > capacity)
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"Sample {i} has {int(array[i])} tokens, more than the row capacity of {capacity} "
                f"({too_long.size} sample(s) are too long). Truncate or split them first."
            )
    return array


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block (and restore its previous state after it).

    For code that allocates many small objects it keeps (rows as lists of sample indices, buffered samples): the
    collector would only walk the same lists again and again. Cyclic garbage made meanwhile is collected once the
    collector runs again. Used by [`best_fit_decreasing`] and the streaming packer's buffer.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _rows_from_assignment(row_of: np.ndarray, num_rows: int) -> list[list[int]]:
    """Group sample indices by row id; each row's indices ascending, rows ordered by id."""
    order = np.argsort(row_of, kind="stable")
    ends = np.cumsum(np.bincount(row_of, minlength=num_rows))
    starts = (ends - np.bincount(row_of, minlength=num_rows)).tolist()
    flat = order.tolist()
    # Hundreds of thousands of small lists would trigger the cyclic garbage collector over and over.
    with gc_paused():
        return [flat[start:end] for start, end in zip(starts, ends.tolist())]


def _best_fit_decreasing_assign(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing, exact, over the whole input. Returns ``(row_of (n,) int64, num_rows)``.

    Samples are taken longest first (ties by index); each goes to the open row with the least free space that still
    fits it, else a new row. Open rows are kept in buckets by free space (a dict, plus the sorted list of the free
    space values that have a bucket) and all samples of one length are placed together: a row with free space ``r``
    takes ``r // L`` samples of length ``L`` in a row (after each one it is still the best fit), so the work is a few
    list operations per (distinct length, bucket touched) instead of a loop per sample. Memory is ``O(num_samples)``
    and time does not depend on ``capacity``: there are never more buckets than rows.
    """
    n = lengths.size
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    row_of_sorted = np.empty(n, dtype=np.int64)
    group_starts = np.concatenate(([0], np.flatnonzero(np.diff(sorted_lengths)) + 1, [n])).tolist()

    buckets: dict[int, list[int]] = {}  # free space -> ids of open rows (full rows are not kept)
    free_values: list[int] = []  # the keys of `buckets`, ascending
    num_rows = 0

    def move(rows: list[int], free: int) -> None:
        if free == 0:
            return
        bucket = buckets.get(free)
        if bucket is None:
            buckets[free] = list(rows)
            bisect.insort(free_values, free)
        else:
            bucket.extend(rows)

    for start, end in zip(group_starts[:-1], group_starts[1:]):
        length = int(sorted_lengths[start])
        pos, remaining = start, end - start
        first = bisect.bisect_left(free_values, length)
        emptied = 0  # buckets free_values[first : first + emptied] were used up
        moves: list[tuple[list[int], int]] = []  # every move lands below `length`: apply them after the scan
        for index in range(first, len(free_values)):
            free = free_values[index]
            per_row = free // length
            rows = buckets[free]
            if len(rows) * per_row <= remaining:
                del buckets[free]
                emptied += 1
                count = len(rows) * per_row
                row_of_sorted[pos : pos + count] = np.repeat(np.asarray(rows, dtype=np.int64), per_row)
                pos, remaining = pos + count, remaining - count
                moves.append((rows, free - per_row * length))
                if remaining == 0:
                    break
                continue
            full, rest = divmod(remaining, per_row)
            used = full + (rest > 0)
            taken = rows[len(rows) - used :][::-1]
            del rows[len(rows) - used :]
            row_of_sorted[pos : pos + full * per_row] = np.repeat(np.asarray(taken[:full], dtype=np.int64), per_row)
            moves.append((taken[:full], free - per_row * length))
            if rest:
                row_of_sorted[pos + full * per_row : end] = taken[full]
                moves.append(([taken[full]], free - rest * length))
            remaining = 0
            break
        del free_values[first : first + emptied]
        for rows, free in moves:
            move(rows, free)
        if remaining:
            per_row = capacity // length
            full, rest = divmod(remaining, per_row)
            new_rows = np.arange(num_rows, num_rows + full + (rest > 0), dtype=np.int64)
            row_of_sorted[pos : pos + full * per_row] = np.repeat(new_rows[:full], per_row)
            move(new_rows[:full].tolist(), capacity - per_row * length)
            if rest:
                row_of_sorted[pos + full * per_row : end] = new_rows[-1]
                move([int(new_rows[-1])], capacity - rest * length)
            num_rows += new_rows.size

    row_of = np.empty(n, dtype=np.int64)
    row_of[order] = row_of_sorted
    return row_of, num_rows


_SMALL_INPUT = 8192


def _best_fit_decreasing_assign_small(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing, one sample at a time over a sorted list of open rows: faster than the bucketed version
    below ``_SMALL_INPUT`` samples, where numpy's per-call overhead dominates. Ties go to the lowest row id."""
    values = lengths.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    row_of = [0] * len(values)
    num_rows = _best_fit_in_order(values, order, capacity, row_of, open_rows=[])
    return np.asarray(row_of, dtype=np.int64), num_rows


def best_fit_decreasing(
    lengths: Iterable[int] | np.ndarray, capacity: int, *, seed: int | None = None
) -> list[list[int]]:
    """Pack samples into rows of ``capacity`` tokens with best-fit decreasing over the *whole* input.

    Unlike TRL's ``pack_dataset(strategy="bfd")``, which packs windows of 1,000 rows independently, this sees every
    sample at once, so short samples from anywhere fill the gaps left by long ones. Deterministic: ties are broken by
    sample index. Runs in a few list operations per distinct length (millions of samples per second); memory and
    time do not depend on ``capacity``.

    Args:
        lengths: ``(num_samples,)`` integer lengths, each in ``[1, capacity]``: a list, array, tensor or any
            iterable (a generator is read once).
        capacity: tokens per row (``max_length``).
        seed: if given, the rows are returned in an order shuffled with ``numpy.random.default_rng(seed)`` (see
            [`shuffle_rows`]), so that batches are not sorted by length. ``None`` keeps creation order (fullest rows,
            holding the longest samples, first).

    Returns:
        Rows as lists of sample indices into ``lengths``, each list ascending. Every index appears exactly once.

    Raises:
        ValueError: a length is not a positive integer or exceeds ``capacity`` (the message names the sample).

    Example:
        >>> best_fit_decreasing([5, 3, 2, 4, 4, 2], capacity=10)
        [[0, 3], [1, 2, 4], [5]]
    """
    array = _as_lengths(lengths, capacity)
    if array.size == 0:
        return []
    assign = _best_fit_decreasing_assign_small if array.size <= _SMALL_INPUT else _best_fit_decreasing_assign
    row_of, num_rows = assign(array, int(capacity))
    rows = _rows_from_assignment(row_of, num_rows)
    return rows if seed is None else shuffle_rows(rows, seed)


def _best_fit_in_order(
    lengths: list[int],
    order: Sequence[int],
    capacity: int,
    row_of: list[int],
    open_rows: list[tuple[int, int]],
    max_samples: int | None = None,
) -> int:
    """Place the samples ``order`` one by one into the open row with the least free space that fits (ties: lowest
    row id), else a new row. ``open_rows`` is a sorted list of ``(free space, row id)`` of every row created so far,
    updated in place; returns the number of rows created. With ``max_samples``, a row closes (leaves ``open_rows``)
    once it holds that many samples; ``open_rows`` must then start empty."""
    created = 0
    num_rows = len(open_rows)
    counts: list[int] = []  # samples per row, with `max_samples`
    for i in order:
        length = lengths[i]
        position = bisect.bisect_left(open_rows, (length, -1))
        if position < len(open_rows):
            free, row = open_rows.pop(position)
        else:
            free, row, num_rows, created = capacity, num_rows, num_rows + 1, created + 1
            counts.append(0)
        row_of[i] = row
        if max_samples is not None:
            counts[row] += 1
            if counts[row] >= max_samples:
                continue
        bisect.insort(open_rows, (free - length, row))
    return created


def shuffled_best_fit(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    seed: int,
    min_efficiency: float = 0.995,
    max_samples_per_row: int | None = None,
) -> list[list[int]]:
    """Pack samples into rows that mix lengths at random, as full as best-fit decreasing (or ``min_efficiency``).

    [`best_fit_decreasing`] places the longest samples first, so each row holds samples of similar rank: a long one
    with the short ones filling its gap, medium ones together, and the last rows only short ones. This packer places
    the samples in an order shuffled with ``numpy.random.default_rng(seed)`` with best fit (each into the open row
    with the least free space that fits), except the shortest ones, kept back as fillers and placed last, longest
    first, into the gaps. The fillers are the shortest samples holding a share of the tokens that starts at 5% and
    doubles until the rows are as few as ``max(best-fit decreasing rows, ceil(tokens / (min_efficiency *
    capacity)))`` (all samples are fillers at worst: that is best-fit decreasing on a shuffled tie order).

    Args:
        lengths: ``(num_samples,)`` integer lengths, each in ``[1, capacity]``.
        capacity: tokens per row (``max_length``).
        seed: seed of the shuffle; the same seed gives the same rows.
        min_efficiency: accept fewer filler tokens once the rows are at least this full (real tokens / (rows x
            capacity)); best-fit decreasing's row count is always accepted.
        max_samples_per_row: if set, no row holds more samples than this (rows may then be less full; the
            efficiency target is relaxed to what best fit reaches under the same bound).

    Returns:
        Rows as lists of sample indices, each list ascending, rows in shuffled order. Every index appears once.

    Raises:
        ValueError: a length is not a positive integer or exceeds ``capacity``, or ``max_samples_per_row < 1``.

    Example:
        >>> shuffled_best_fit([5, 3, 2, 4, 4, 2], capacity=10, seed=0)  # best_fit_decreasing: [[0, 3], [1, 2, 4], [5]]
        [[1], [0, 4], [2, 3, 5]]
    """
    array = _as_lengths(lengths, capacity)
    capacity = int(capacity)
    if max_samples_per_row is not None and max_samples_per_row < 1:
        raise ValueError(f"`max_samples_per_row` must be at least 1, got {max_samples_per_row}.")
    if array.size == 0:
        return []
    if not 0.0 < min_efficiency <= 1.0:
        raise ValueError(f"`min_efficiency` must be in (0, 1], got {min_efficiency}.")
    rng = np.random.default_rng(seed)
    values = array.tolist()
    shuffled = rng.permutation(array.size)
    # Shortest first, ties in shuffled order: the fillers are a prefix of this order.
    by_length = shuffled[np.argsort(array[shuffled], kind="stable")]
    cumulative = np.cumsum(array[by_length])
    total = int(cumulative[-1])
    if max_samples_per_row is None:
        target = max(
            len(best_fit_decreasing(array, capacity)),
            -(-total // max(1, int(min_efficiency * capacity))),
        )
    else:
        target = None
    share = 0.05
    best: tuple[int, list[int]] | None = None
    while True:
        num_fillers = int(np.searchsorted(cumulative, share * total, side="right"))
        if share >= 1.0:
            num_fillers = array.size
        is_filler = np.zeros(array.size, dtype=bool)
        is_filler[by_length[:num_fillers]] = True
        body = [int(i) for i in shuffled if not is_filler[i]]
        fillers = by_length[:num_fillers][::-1].tolist()  # longest filler first
        row_of = [0] * array.size
        if max_samples_per_row is None:
            open_rows: list[tuple[int, int]] = []
            num_rows = _best_fit_in_order(values, body, capacity, row_of, open_rows)
            num_rows += _best_fit_in_order(values, fillers, capacity, row_of, open_rows)
        else:
            num_rows = _best_fit_in_order(values, body + fillers, capacity, row_of, [], max_samples_per_row)
        if best is None or num_rows < best[0]:
            best = (num_rows, row_of)
        if (target is not None and num_rows <= target) or share >= 1.0:
            break
        share = min(1.0, share * 2)
    num_rows, row_of = best
    rows = _rows_from_assignment(np.asarray(row_of, dtype=np.int64), num_rows)
    return shuffle_rows(rows, int(rng.integers(2**63 - 1)))


def windowed_best_fit(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    seed: int,
    window: int = 4,
) -> list[list[int]]:
    """Pack samples into rows of samples that follow each other in a seeded random order, as a random batch holds.

    The samples are taken in an order shuffled with ``numpy.random.default_rng(seed)``; each goes with best fit into
    one of at most ``window`` open rows (the one with the least free space that fits). When none fits, the fullest
    open row closes if ``window`` rows are open, and a new row opens; a row that is exactly full closes at once. So a
    row holds samples that are close in the random order, whatever their lengths, and the window fills the gaps:
    ``window=1`` is next fit (rows of consecutive samples, about 82% full on the embedded data at rows of 512),
    ``window=4`` about 99% full. Unlike [`shuffled_best_fit`] and [`best_fit_decreasing`], no sample is chosen for
    its length (a long sample is not systematically paired with the shortest ones): on the quality benchmark this
    is what brings the packed held-out loss to the padded one (README, "Quality").

    Args:
        lengths: ``(num_samples,)`` integer lengths, each in ``[1, capacity]``.
        capacity: tokens per row (``max_length``).
        seed: seed of the sample order and of the row order; the same seed gives the same rows.
        window: the most rows open at once (``>= 1``).

    Returns:
        Rows as lists of sample indices, each list ascending, rows in an order shuffled with ``seed``. Every index
        appears once.

    Raises:
        ValueError: a length is not a positive integer or exceeds ``capacity``, or ``window < 1``.

    Example:
        >>> windowed_best_fit([5, 3, 2, 4, 4, 2], capacity=10, seed=0, window=1)  # next fit in the order 3 2 5 4 0 1
        [[2, 3, 5], [0, 4], [1]]
    """
    array = _as_lengths(lengths, capacity)
    capacity = int(capacity)
    window = check_positive_int(window, "window")
    rng = np.random.default_rng(seed)
    values = array.tolist()
    rows: list[list[int]] = []
    open_rows: list[list[int]] = []  # [free space, row id]
    for i in rng.permutation(array.size).tolist():
        length = values[i]
        best = None
        for entry in open_rows:
            if entry[0] >= length and (best is None or entry[0] < best[0]):
                best = entry
        if best is None:
            if len(open_rows) >= window:
                open_rows.remove(min(open_rows, key=lambda entry: entry[0]))
            best = [capacity, len(rows)]
            rows.append([])
            open_rows.append(best)
        best[0] -= length
        rows[best[1]].append(i)
        if best[0] == 0:
            open_rows.remove(best)
    return [sorted(rows[r]) for r in rng.permutation(len(rows)).tolist()]


def balanced_step_order(samples_per_row: Sequence[int] | np.ndarray, rows_per_step: int, *, seed: int) -> list[int]:
    """An order of the rows in which every ``rows_per_step`` consecutive rows (one optimizer step) hold about the same
    number of samples.

    The rows are ranked by sample count (ties in an order shuffled with ``seed``) and cut into ``rows_per_step``
    strata of consecutive ranks; step ``j`` takes the ``j``-th row of each stratum, going up the even strata and down
    the odd ones, so rows with many samples are paired with rows with few. The steps are then shuffled with
    ``seed``. With ``rows_per_step == 1`` this is a plain shuffle. When the rows do not divide evenly, the left-over
    rows (the middle ranks) form the last, smaller step.

    Args:
        samples_per_row: ``(num_rows,)`` number of samples in each row.
        rows_per_step: rows in one optimizer step (all processes and accumulation steps).
        seed: seed of the tie order and of the order of the steps.

    Returns:
        A permutation of ``range(num_rows)`` as a list.

    Example:
        >>> order = balanced_step_order([1, 9, 5, 5, 2, 8], rows_per_step=2, seed=0)
        >>> sorted(sum([1, 9, 5, 5, 2, 8][i] for i in order[k : k + 2]) for k in range(0, 6, 2))
        [10, 10, 10]
    """
    counts = np.asarray(samples_per_row, dtype=np.int64)
    if rows_per_step < 1:
        raise ValueError(f"`rows_per_step` must be at least 1, got {rows_per_step}.")
    rng = np.random.default_rng(seed)
    if rows_per_step == 1 or counts.size <= rows_per_step:
        return rng.permutation(counts.size).tolist()
    shuffled = rng.permutation(counts.size)
    ranked = shuffled[np.argsort(counts[shuffled], kind="stable")]
    num_steps = counts.size // rows_per_step
    strata = []
    for r in range(rows_per_step):
        # strata at both ends of the ranking; the left-over middle ranks are set aside
        start = r * num_steps if r < rows_per_step // 2 else counts.size - (rows_per_step - r) * num_steps
        stratum = ranked[start : start + num_steps]
        strata.append(stratum if r % 2 == 0 else stratum[::-1])
    steps = np.stack(strata, axis=1)  # (num_steps, rows_per_step)
    half = rows_per_step // 2
    leftover = ranked[half * num_steps : counts.size - (rows_per_step - half) * num_steps].tolist()
    order = steps[rng.permutation(num_steps)].reshape(-1).tolist()
    return order + leftover


def first_fit(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Order-preserving packing: fill rows in input order and start a new row when the next sample does not fit.

    Concatenating the rows gives the samples in their original order (this is "next fit" in bin-packing terms; it is
    what a user expects when sample order matters, e.g. for ``pack_sequences``' default).

    Args:
        lengths: ``(num_samples,)`` integer lengths, each in ``[1, capacity]``.
        capacity: tokens per row.

    Returns:
        Rows as lists of consecutive sample indices.

    Example:
        >>> first_fit([3, 2, 4, 3], capacity=8)
        [[0, 1], [2, 3]]
    """
    array = _as_lengths(lengths, capacity)
    ends = np.cumsum(array)
    rows, start, consumed = [], 0, 0
    while start < array.size:
        stop = int(np.searchsorted(ends, consumed + capacity, side="right"))
        rows.append(list(range(start, stop)))
        consumed, start = int(ends[stop - 1]), stop
    return rows


def shuffle_rows(rows: Sequence[Sequence[int]], seed: int) -> list[list[int]]:
    """Return ``rows`` in an order permuted by ``numpy.random.default_rng(seed)``; each row's content is unchanged."""
    permutation = np.random.default_rng(seed).permutation(len(rows))
    return [list(rows[i]) for i in permutation.tolist()]


def packing_efficiency(lengths: Sequence[int] | np.ndarray, rows: Sequence[Sequence[int]], capacity: int) -> float:
    """Real tokens / (number of rows × capacity): 1.0 means no padding at all."""
    if not rows:
        return 1.0
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return total / (len(rows) * _check_capacity(capacity))


def pack_lengths(
    lengths: Sequence[int] | np.ndarray, capacity: int, *, strategy: Strategy = "bfd", seed: int | None = None
) -> list[list[int]]:
    """Dispatch to [`best_fit_decreasing`] (``"bfd"``) or [`first_fit`] (``"first_fit"``)."""
    if strategy == "bfd":
        return best_fit_decreasing(lengths, capacity, seed=seed)
    if strategy == "first_fit":
        rows = first_fit(lengths, capacity)
        return rows if seed is None else shuffle_rows(rows, seed)
    raise ValueError(f"Unknown packing strategy {strategy!r}; use one of {_STRATEGIES}.")


_TENSOR_PACKING = ("pack_sequences", "concatenate_and_pack", "PackedRows", "position_ids_from_sample_index")


def __getattr__(name: str):
    # The tensor packing API moved to `unpack_trainer.tensor_packing` (which imports this module); its names stay
    # importable from here.
    if name in _TENSOR_PACKING:
        from unpack_trainer import tensor_packing

        return getattr(tensor_packing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
