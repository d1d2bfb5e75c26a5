"""Bin packing of samples into fixed-capacity rows: which samples share a row, decided from their lengths alone.

Stage 3 of the data path (pack: lengths -> rows), called by [`unpack_trainer.data.preparation`]; the same decision on
a stream is [`unpack_trainer.data.streaming`]'s.

Everything here is a pure function of lengths: no model code, no global state. Writing token sequences into packed
tensors (``pack_sequences``, ``concatenate_and_pack``) lives in [`unpack_trainer.data.tensor_packing`].
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import numpy as np

from unpack_trainer.data.validation import as_sequence, check_positive_int

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


@dataclasses.dataclass(frozen=True)
class WindowedPacking:
    """What [`windowed_packing`] chose and made.

    Attributes:
        rows: rows as lists of sample indices, each list ascending, rows in an order shuffled with the seed.
        window: the most rows that were open at once; ``None``: unbounded (every row with room stays open).
        filler_share: share of the tokens held back as fillers (the shortest samples, placed last, longest first,
            into the gaps of every row); ``0.0``: none.
        bfd_rows: rows best-fit decreasing needs for the same lengths (the reference of ``max_extra_rows``).
        tried: every ``(window, filler_share, rows)`` tried, in order; the last one is the choice.
    """

    rows: list[list[int]]
    window: int | None
    filler_share: float
    bfd_rows: int
    tried: tuple[tuple[int | None, float, int], ...]

    @property
    def extra_rows(self) -> float:
        """Rows beyond best-fit decreasing's, as a fraction of them (``0.01`` = 1% more rows, so 1% more compute)."""
        return len(self.rows) / max(self.bfd_rows, 1) - 1.0

    def describe(self) -> str:
        """One line for the logs and ``unpack-trainer analyze``: the window, the fillers and the rows."""
        window = "unbounded window" if self.window is None else f"window of {self.window} open rows"
        fillers = f", the shortest samples ({self.filler_share:.0%} of the tokens) kept back as fillers"
        narrower = ""
        if len(self.tried) > 1:
            first = self.tried[0]
            narrower = f"; window {first[0]} alone gave {first[2] / max(self.bfd_rows, 1) - 1:+.2%}"
        return (
            f"windowed best fit: {window}{fillers if self.filler_share else ''}, {len(self.rows):,} rows "
            f"({self.extra_rows:+.2%} vs best-fit decreasing's {self.bfd_rows:,}{narrower})"
        )


def _windowed_pass(
    values: list[int], order: list[int], fillers: list[int], capacity: int, window: int | None
) -> tuple[list[list[int]], bool]:
    """Place ``order`` with best fit into at most ``window`` open rows (``None``: no bound), then ``fillers`` with
    best fit into every row with room. Returns the rows (unsorted) and whether a row was closed with room left
    (when not, a wider window cannot change anything)."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # sorted (free space, row id): best fit = first that fits, ties lowest id
    closed: list[tuple[int, int]] = []  # rows closed by the window with room left (open again for the fillers)
    for i in order:
        length = values[i]
        position = bisect.bisect_left(open_rows, (length, -1))
        if position < len(open_rows):
            free, row = open_rows.pop(position)
        else:
            if window is not None and len(open_rows) >= window:
                closed.append(open_rows.pop(0))  # the fullest open row
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if free > length:
            bisect.insort(open_rows, (free - length, row))
    if fillers:
        open_rows = sorted(open_rows + closed)
        for i in fillers:
            length = values[i]
            position = bisect.bisect_left(open_rows, (length, -1))
            if position < len(open_rows):
                free, row = open_rows.pop(position)
            else:
                free, row = capacity, len(rows)
                rows.append([])
            rows[row].append(i)
            if free > length:
                bisect.insort(open_rows, (free - length, row))
    return rows, bool(closed)


_FIRST_WINDOW = 4


def windowed_packing(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    seed: int,
    window: int | None = None,
    max_extra_rows: float = 0.01,
) -> WindowedPacking:
    """Pack samples into rows of samples that follow each other in a seeded random order, widening the window only
    as far as the fill needs. [`windowed_best_fit`] returns just the rows; this also says what was chosen.

    The samples are taken in an order shuffled with ``numpy.random.default_rng(seed)``; each goes with best fit into
    one of at most ``window`` open rows (the one with the least free space that fits). When none fits, the fullest
    open row closes if ``window`` rows are open, and a new row opens; a row that is exactly full closes at once. So a
    row holds samples that are close in the random order, whatever their lengths, and the window fills the gaps. No
    sample is chosen for its length (a long sample is not systematically paired with the shortest ones): on the
    quality benchmark this is what brings the packed held-out loss to the padded one (docs/quality.md).

    How full the rows get with a small window depends on the lengths: with ``window=4`` and rows of 2,048 tokens,
    lognormal lengths of median 180 take 0.8% more rows than best-fit decreasing, median 600 4.4%, uniform 700-1,400
    14.8% (docs/quality.md, "Packing efficiency"). With ``window=None`` (the default) the window starts at 4 and doubles until
    the rows are at most ``1 + max_extra_rows`` times best-fit decreasing's (or no row closes with room left, so a
    wider window changes nothing; once a doubling gains no row, the next try is the unbounded window); if even that is not enough, the shortest samples are kept back as fillers (a share
    of the tokens starting at 5% and doubling; all samples at worst, which is best-fit decreasing with shuffled
    ties) and placed last, longest first, into the gaps of every row. The first setting that meets the bound wins, so
    the rows are never more than ``max_extra_rows`` above best-fit decreasing and the window no wider than needed.

    Args:
        lengths: ``(num_samples,)`` integer lengths, each in ``[1, capacity]``.
        capacity: tokens per row (``max_length``).
        seed: seed of the sample order and of the row order; the same seed gives the same rows.
        window: a fixed window (``>= 1``, no fillers, no bound on the rows), or ``None`` to choose it as above.
        max_extra_rows: with ``window=None``, the most rows beyond best-fit decreasing's, as a fraction of them
            (``>= 0``).

    Returns:
        A [`WindowedPacking`]: the rows (each list ascending, rows in an order shuffled with ``seed``; every index
        once), the window and filler share used, best-fit decreasing's row count and every setting tried.

    Raises:
        ValueError: a length is not a positive integer or exceeds ``capacity``, ``window < 1`` or
            ``max_extra_rows < 0``.

    Example:
        >>> packing = windowed_packing([5, 3, 2, 4, 4, 2], capacity=10, seed=0)
        >>> packing.rows, packing.window, packing.bfd_rows
        ([[2, 3, 5], [0, 4], [1]], 4, 3)
    """
    array = _as_lengths(lengths, capacity)
    capacity = int(capacity)
    if window is not None:
        window = check_positive_int(window, "window")
    if not max_extra_rows >= 0:
        raise ValueError(f"`max_extra_rows` must be at least 0, got {max_extra_rows}.")
    rng = np.random.default_rng(seed)
    order = rng.permutation(array.size)
    values, order_list = array.tolist(), order.tolist()
    bfd_rows = len(best_fit_decreasing(array, capacity)) if array.size else 0
    tried: list[tuple[int | None, float, int]] = []
    if window is not None:
        rows, _ = _windowed_pass(values, order_list, [], capacity, window)
        tried.append((window, 0.0, len(rows)))
    else:
        target = int(bfd_rows * (1.0 + max_extra_rows) + 1e-9)
        current: int | None = _FIRST_WINDOW
        while True:
            rows, closed_early = _windowed_pass(values, order_list, [], capacity, current)
            tried.append((current, 0.0, len(rows)))
            if len(rows) <= target:
                break
            if not closed_early:  # no row closed with room left: a wider window would give the same rows
                current = None
                break
            plateau = len(tried) > 1 and tried[-2][2] == len(rows)  # doubling gained nothing: go to unbounded
            current = None if plateau or current * 2 >= array.size else current * 2
            if current is None:
                rows, _ = _windowed_pass(values, order_list, [], capacity, None)
                tried.append((None, 0.0, len(rows)))
                break
        if len(rows) > target:
            # Shortest first, ties in the shuffled order: the fillers are a prefix of this order.
            by_length = order[np.argsort(array[order], kind="stable")]
            cumulative = np.cumsum(array[by_length])
            share = 0.05
            while len(rows) > target:
                count = (
                    array.size if share >= 1.0 else int(np.searchsorted(cumulative, share * cumulative[-1], "right"))
                )
                is_filler = np.zeros(array.size, dtype=bool)
                is_filler[by_length[:count]] = True
                body = [i for i in order_list if not is_filler[i]]
                rows, _ = _windowed_pass(values, body, by_length[:count][::-1].tolist(), capacity, current)
                tried.append((current, min(share, 1.0), len(rows)))
                if share >= 1.0:
                    break
                share *= 2
    chosen = tried[-1]
    return WindowedPacking(
        rows=[sorted(rows[r]) for r in rng.permutation(len(rows)).tolist()],
        window=chosen[0],
        filler_share=chosen[1],
        bfd_rows=bfd_rows,
        tried=tuple(tried),
    )


def windowed_best_fit(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    seed: int,
    window: int | None = None,
    max_extra_rows: float = 0.01,
) -> list[list[int]]:
    """The rows of [`windowed_packing`] (same arguments): samples that follow each other in a seeded random order
    share a row, the window widening only as far as the fill needs (``window=None``) or fixed.

    ``window=1`` is next fit (rows of consecutive samples); ``window=4`` was the fixed default before the window
    widened by itself (it gives the same rows as ``window=None`` whenever 4 open rows already fill to within
    ``max_extra_rows`` of best-fit decreasing).

    Example:
        >>> windowed_best_fit([5, 3, 2, 4, 4, 2], capacity=10, seed=0, window=1)  # next fit in the order 3 2 5 4 0 1
        [[2, 3, 5], [0, 4], [1]]
    """
    return windowed_packing(lengths, capacity, seed=seed, window=window, max_extra_rows=max_extra_rows).rows


def split_rows(rows: Sequence[Sequence[int]], multiple: int) -> list[list[int]]:
    """Split rows of several samples in two until the number of rows is a multiple of ``multiple``, so that every
    data-parallel process gets as many full batches as the others and no row has to be repeated to even them out.

    The row with the most samples is split (its samples in their order, first half and second half; ties: the
    first such row), as often as needed; at most ``multiple - 1`` splits. When the samples are too few for that,
    the rows are returned unchanged.

    Example:
        >>> split_rows([[0, 1, 2], [3], [4, 5]], multiple=2)
        [[0], [3], [4, 5], [1, 2]]
    """
    multiple = check_positive_int(multiple, "multiple")
    out = [list(row) for row in rows]
    needed = -len(out) % multiple
    if needed > sum(len(row) - 1 for row in out):
        return out
    for _ in range(needed):
        index = max(range(len(out)), key=lambda i: len(out[i]))
        row = out[index]
        half = len(row) // 2
        out[index] = row[:half]
        out.append(row[half:])
    return out


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
