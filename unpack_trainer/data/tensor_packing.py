"""Token sequences -> packed tensors: [`pack_sequences`] and [`concatenate_and_pack`].

Stage 3 of the data path (pack), for callers that hold lists or tensors rather than a dataset: the rows of
[`unpack_trainer.data.packing`] written straight into padded tensors, with no collator after it.

Which samples share a row is decided by the packers of [`unpack_trainer.data.packing`] (over lengths only); this module
writes the tokens into ``(num_rows, max_length)`` int64 tensors with everything needed to train without
contamination.

Worked example (``pack_sequences`` / ``concatenate_and_pack`` with the default order-preserving strategy)::

    lengths [3, 2, 4, 3], capacity 8
    rows            [[0, 1], [2, 3]]                      # sample indices per row
    input_ids       [[1, 2, 3, 4, 5, 0, 0, 0],            # samples [1,2,3] [4,5] | pad
                     [6, 7, 8, 9, 10, 11, 12, 0]]          # samples [6,7,8,9] [10,11,12] | pad
    sample index    [[1, 1, 1, 2, 2, 0, 0, 0],             # 1-based within the row, 0 = padding
                     [1, 1, 1, 1, 2, 2, 2, 0]]
    position_ids    [[0, 1, 2, 0, 1, 0, 1, 2],             # restart per sample; padding is its own pseudo-sample
                     [0, 1, 2, 3, 0, 1, 2, 0]]
    labels          [[-100, 2, 3, -100, 5, -100, -100, -100], ...]   # -100 at every sample's first token

With ``eos_token_id=9`` each sample gets a separator appended before packing (``[1, 2, 3]`` -> ``[1, 2, 3, 9]``): it
belongs to the sample it ends (same sample index, next position) and its label is ``9`` when the sample's last token
is trained, so the model learns to end the sample from inside it; the next sample's first label is still ``-100``.

How it runs, in whole arrays (no loop per token). The common case, Python lists (or tuples) of ints whose samples
all fit a row whole (masks, if any, all ones), goes straight into the rows ([`_write_whole_lists`]):

1. the lengths (``len`` of each list) and the mask check (``count(1)`` and ``sum`` per mask) decide the rows;
2. the outputs are allocated once, and each sample's ids (then labels) are written at their place in the rows by one
   ``struct.pack_into`` per sample, which converts and checks every value in one C loop (a ``sum`` per sample and
   a look at the values equal to 0 or 1 complete the check: see [`_write_lists`]);
3. separators and the first label of every sample are set by index, the sample index by a cumulative sum.

No flat copy of the tokens is made and none is scattered: at 1M sequences that saves 2 GB per field, and fresh
memory costs about 3 ns per int64 to fault in (measured on the 2-core CI box). Everything else (tensors, arrays,
masks with padding, ``overflow="truncate"`` / ``"split"`` with long samples) takes the general path:

1. flatten: every sample's ids end to end in one ``(total_tokens,)`` int64 array (``np.fromiter`` over the chained
   lists, in chunks of 64k tokens; ``torch.cat`` for tensors; ``bytes`` for masks), every id checked on the way (see
   [`_flatten`]);
2. the packer assigns pieces (samples, or the chunks of an overflowing one) to rows, from their lengths;
3. one gather puts the tokens in row-major order (skipped for ``first_fit``, whose rows keep input order), one
   boolean-mask scatter writes them into the rows;
4. ``torch.from_numpy``, no copy.

Bad input is found by the vectorised checks; the per-sample checks ([`_check_samples_one_by_one`]) then run only to
name the first bad sample with the same words as the rest of the library ([`unpack_trainer.data.validation`]).
"""

from __future__ import annotations

import logging
import numbers
import warnings
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter, methodcaller
from struct import Struct
from struct import error as StructError

import numpy as np
import torch

from unpack_trainer.data.packing import Strategy, pack_lengths
from unpack_trainer.data.validation import (
    INT64_MAX,
    INT64_MIN,
    Overflow,
    as_sequence,
    check_overflow,
    check_positive_int,
    log_overflow,
    token_list,
    too_long_error,
)

logger = logging.getLogger(__name__)

#: Tensor dtypes whose values all fit in int64 (uint64 does not: such samples are checked value by value).
_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
_dtype_of = attrgetter("dtype")
_numel = methodcaller("numel")
_count_ones = methodcaller("count", 1)
_LIST_TYPES = frozenset({list, tuple})


# --------------------------------------------------------------------------------------------------------------------
# Arguments and validation
# --------------------------------------------------------------------------------------------------------------------


def _check_pack_args(max_length: int, pad_token_id: int | None, eos_token_id: int | None) -> None:
    check_positive_int(max_length, "max_length")
    if pad_token_id is None:
        raise ValueError("`pad_token_id` is None; pass the tokenizer's pad token id (or eos id if it has none).")
    for name, value in (("pad_token_id", pad_token_id), ("eos_token_id", eos_token_id)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"`{name}` must be an integer in int64 range, got {value!r}.")


def _flatten(samples: Sequence, *, allow_bool: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """Every sample's values end to end, validated: ``(flat (total,) int64, lengths (num_samples,) int64)``.

    Fast paths for the two common inputs: Python lists (or tuples) of ``int``, and 1-D CPU or GPU tensors of an
    integer dtype (``bool`` too with ``allow_bool``, for masks). ``None`` when anything is off or unusual: a value
    that is not an ``int`` (a float, a string, ``None``, a nested list, a numpy scalar, a ``bool`` outside masks),
    an id outside int64, a tensor that is not 1-D or of another dtype, another container type. The caller then runs
    [`_check_samples_one_by_one`], which names the bad sample or converts the unusual-but-valid ones.

    For lists, the type check costs one ``sum`` per sample (a C loop; its result is an ``int`` only if every value
    is an int or a bool: a float, numpy scalar or ``Fraction`` changes the type, a string or list raises) and
    ``np.fromiter`` rejects ids outside int64. ``bool`` is an ``int`` to both, so the few values equal to 0 or 1
    are looked up one by one.
    """
    num = len(samples)
    if num == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    kinds = set(map(type, samples))
    if kinds <= {list, tuple}:
        return _flatten_lists(samples, allow_bool)
    if kinds == {torch.Tensor}:
        return _flatten_tensors(samples, allow_bool)
    return None


_CHUNK_TOKENS = 1 << 16  # below numpy's 4 MB huge-page threshold, so every chunk reuses the memory of the last


def _flatten_lists(samples: Sequence[Sequence[int]], allow_bool: bool) -> tuple[np.ndarray, np.ndarray] | None:
    lengths = np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))
    ends = np.cumsum(lengths)
    total = int(ends[-1])
    # Chunks of whole samples, about _CHUNK_TOKENS tokens each, converted into one buffer allocated by torch.
    cuts = np.searchsorted(ends, np.arange(_CHUNK_TOKENS, total, _CHUNK_TOKENS), side="right")
    cuts = np.unique(np.concatenate(([0], cuts, [len(samples)]))).tolist()
    starts = [0, *ends.tolist()]
    out, flat = _empty(total)
    for first, last in zip(cuts[:-1], cuts[1:]):
        part = samples[first:last] if isinstance(samples, (list, tuple)) else [samples[i] for i in range(first, last)]
        begin, end = starts[first], starts[last]
        try:
            if set(map(type, map(sum, part))) - {int}:
                return None
            chunk = np.fromiter(chain.from_iterable(part), dtype=np.int64, count=end - begin)
        except (TypeError, ValueError, OverflowError):
            return None
        if not allow_bool:
            maybe_bool = np.flatnonzero(chunk.view(np.uint64) <= 1)
            if maybe_bool.size:
                sample = np.searchsorted(ends[first:last], maybe_bool + begin, side="right") + first
                offset = maybe_bool + begin - (ends - lengths)[sample]
                for s, o in zip(sample.tolist(), offset.tolist()):
                    if samples[s][o].__class__ is bool:
                        return None
        flat[begin:end] = chunk
    return flat, lengths


def _flatten_tensors(samples: Sequence[torch.Tensor], allow_bool: bool) -> tuple[np.ndarray, np.ndarray] | None:
    dtypes = set(map(_dtype_of, samples))
    if not dtypes <= (_INT_DTYPES | {torch.bool} if allow_bool else _INT_DTYPES):
        return None
    try:
        flat = torch.cat(list(samples))  # 0-d or mixed-rank tensors raise
    except RuntimeError:
        return None
    if flat.dim() != 1:
        return None
    # every sample is 1-D here (an empty one may be skipped by `cat`, but it is 1-D too): numel is its length, and
    # a C method where `len` goes through Tensor.__len__ in Python (23 ms for 30,000 samples)
    lengths = np.fromiter(map(_numel, samples), dtype=np.int64, count=len(samples))
    return flat.to(device="cpu", dtype=torch.int64).numpy(), lengths


def _mask_span(mask: list[int], index: int) -> tuple[int, int]:
    """The ``[start, end)`` span of ones in a 0/1 attention mask that may be padded on either side."""
    ones = [i for i, value in enumerate(mask) if value]
    if not ones:
        raise ValueError(f"Sample {index} has an attention mask with no 1s; every sample needs at least one token.")
    start, end = ones[0], ones[-1] + 1
    if end - start != len(ones) or any(value not in (0, 1) for value in mask):
        raise ValueError(
            f"Sample {index} has an attention mask with 0s between its tokens (or values other than 0/1); only "
            "left or right padding can be removed before packing."
        )
    return start, end


def _check_samples_one_by_one(
    inputs: Sequence, labels: Sequence | None, masks: Sequence | None
) -> tuple[list[list[int]], list[list[int]] | None, list[list[int]] | None]:
    """Check sample after sample (ids, then labels, then mask) and raise the first problem, naming the sample.

    The order decides which error a caller sees when several samples are bad; it is the order the packing API has
    always checked in. Returns the samples as lists of Python ints (numpy scalars, uint64 tensors and boolean masks
    converted), for inputs that are valid but outside [`_flatten`]'s fast paths.
    """
    ids_out, labels_out, masks_out = [], None if labels is None else [], None if masks is None else []
    for i in range(len(inputs)):
        ids = token_list(inputs[i], i, "sample {index}")
        ids_out.append(ids)
        if labels is not None:
            sample_labels = token_list(labels[i], i, "labels of sample {index}")
            if len(sample_labels) != len(ids):
                raise ValueError(
                    f"Sample {i} has {len(ids)} input ids but {len(sample_labels)} labels; they must match."
                )
            labels_out.append(sample_labels)
        if masks is not None:
            mask = token_list(masks[i], i, "attention mask of sample {index}", allow_bool=True)
            if len(mask) != len(ids):
                raise ValueError(
                    f"Sample {i} has {len(ids)} input ids but an attention mask of length {len(mask)}; they must match."
                )
            if ids:
                _mask_span(mask, i)
            masks_out.append(mask)
    return ids_out, labels_out, masks_out


def _concat_checked(samples: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[`_flatten`] for lists already checked by [`_check_samples_one_by_one`]."""
    lengths = np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))
    return np.fromiter(chain.from_iterable(samples), dtype=np.int64, count=int(lengths.sum())), lengths


def _mask_keep(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """Which tokens an attention mask keeps: ``(total,)`` bool, or ``None`` if a non-empty sample's mask is not one
    run of 1s with only 0s around it (the per-sample check then names it).

    Args:
        mask: ``(total,)`` uint8 or int64, every sample's mask end to end.
        lengths: ``(num_samples,)`` int64 sample lengths.
    """
    if mask.size and not ((mask == 0) | (mask == 1)).all():
        return None
    keep = mask.astype(bool)
    starts = np.cumsum(lengths) - lengths
    previous = np.empty_like(keep)
    previous[1:] = keep[:-1]
    previous[starts[starts < keep.size]] = False
    rises = np.flatnonzero(keep & ~previous)  # first 1 of every run of 1s
    runs = np.bincount(np.searchsorted(starts, rises, side="right") - 1, minlength=lengths.size)
    if (runs[lengths > 0] != 1).any():
        return None
    return keep


def _first_bad_length(lengths: np.ndarray, max_length: int, overflow: Overflow, extra: int) -> None:
    """Raise for the first sample that is empty, or too long under ``overflow="error"`` (``extra``: 1 with a
    separator, which counts toward ``max_length``)."""
    bad = lengths == 0
    if overflow == "error":
        bad |= lengths + extra > max_length
    if bad.any():
        i = int(np.argmax(bad))
        if lengths[i] == 0:
            raise ValueError(f"Sample {i} is empty; every sample needs at least one token.")
        where = " (with its `eos_token_id` separator)" if extra else ""
        raise too_long_error(i, int(lengths[i]) + extra, max_length, where=where)


# --------------------------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------------------------


def _append_separator(streams: list[np.ndarray], values: list[np.ndarray | int], lengths: np.ndarray) -> None:
    """Append one value to every sample of each stream, in place in ``streams``: stream ``k`` gets ``values[k]``
    (a scalar, or one value per sample)."""
    ends = np.cumsum(lengths + 1) - 1
    is_token = np.ones(int(lengths.sum()) + lengths.size, dtype=bool)
    is_token[ends] = False
    for k, (stream, value) in enumerate(zip(streams, values)):
        out = _empty(is_token.size)[1]
        out[is_token] = stream
        out[ends] = value
        streams[k] = out


def _pieces(lengths: np.ndarray, max_length: int, overflow: Overflow) -> tuple[np.ndarray, np.ndarray, bool]:
    """Where each piece starts in the flat stream and its length, after ``overflow``; and whether the pieces still
    cover the stream end to end (nothing truncated)."""
    starts = np.cumsum(lengths) - lengths
    long = lengths > max_length
    if not long.any():
        return starts, lengths, True
    affected = int(long.sum())
    if overflow == "truncate":
        log_overflow(logger, overflow, affected, max_length, tokens=int((lengths[long] - max_length).sum()))
        return starts, np.minimum(lengths, max_length), False
    chunks = -(-lengths // max_length)
    first_piece = np.cumsum(chunks) - chunks
    sample = np.repeat(np.arange(lengths.size), chunks)
    chunk = np.arange(sample.size) - first_piece[sample]
    log_overflow(logger, overflow, affected, max_length, tokens=int(lengths[long].sum()))
    return starts[sample] + chunk * max_length, np.minimum(lengths[sample] - chunk * max_length, max_length), True


def _empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, np.ndarray]:
    """A new tensor and a numpy view of it. Large arrays are allocated by torch, not numpy: numpy asks the kernel for
    transparent huge pages, and on a machine where the kernel then compacts memory at first touch a fresh 216 MB
    numpy array cost 0.55 s to fill against 0.08 s for torch's (measured on the 2-core CI box)."""
    tensor = torch.empty(shape, dtype=dtype)
    return tensor, tensor.numpy()


def _runs(values: np.ndarray, lengths: np.ndarray, out: np.ndarray, *, ramp: bool = False) -> np.ndarray:
    """Fill ``out`` (``(lengths.sum(),)`` int64) with ``values[i]`` repeated ``lengths[i]`` times, or with ``ramp``
    with ``values[i], values[i] + 1, ...``: like ``np.repeat`` (plus an arange), written in place as a cumulative sum
    of steps. Zero lengths are allowed."""
    nonzero = lengths > 0
    values, lengths = values[nonzero], lengths[nonzero]
    if not values.size:
        return out
    starts = np.cumsum(lengths) - lengths
    out.fill(1 if ramp else 0)
    last = values[:-1] + (lengths[:-1] - 1 if ramp else 0)  # the value each run ends on
    out[starts[1:]] = values[1:] - last
    out[0] = values[0]
    return np.cumsum(out, out=out)


class _Layout:
    """Where every piece goes: the rows from the packer, turned into arrays.

    Attributes:
        order: ``(num_pieces,)`` int64, the pieces in row-major order.
        lengths: ``(num_pieces,)`` int64, their lengths in that order.
        starts: ``(num_pieces,)`` int64, where each starts in the row-major token stream.
        row_counts: ``(num_rows,)`` int64 pieces per row; ``fill``: ``(num_rows,)`` int64 tokens per row.
        slots: ``(num_rows, max_length)`` bool, the filled slots of the rows.
        gather: ``(total,)`` int64 index of the row-major stream into the flat one, or ``None`` when they are the same.
        segments: ``(num_pieces + num_rows,)`` int64 lengths of the pieces with each row's padding after its last
            piece (possibly 0 long): the rows end to end, as runs.
    """

    def __init__(
        self,
        piece_starts: np.ndarray,
        piece_lengths: np.ndarray,
        contiguous: bool,
        max_length: int,
        strategy: Strategy,
        seed: int | None,
    ) -> None:
        rows = pack_lengths(piece_lengths, max_length, strategy=strategy, seed=seed)
        num_pieces, num_rows = piece_lengths.size, len(rows)
        self.row_counts = np.fromiter(map(len, rows), dtype=np.int64, count=num_rows)
        in_order = contiguous and strategy == "first_fit" and seed is None  # rows are consecutive pieces
        if in_order:
            self.order = np.arange(num_pieces)
        else:
            self.order = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=num_pieces)
        self.lengths = piece_lengths[self.order]
        ends = np.cumsum(self.lengths)
        self.starts = ends - self.lengths
        last_piece = np.cumsum(self.row_counts) - 1
        self.fill = np.diff(ends[last_piece], prepend=0) if num_rows else ends[:0]
        self.shape = (num_rows, max_length)
        _, self.slots = _empty(self.shape, torch.bool)
        np.less(np.arange(max_length), self.fill[:, None], out=self.slots)
        self.gather = None
        if not in_order:
            gather = _empty(int(self.lengths.sum()))[1]
            self.gather = _runs(piece_starts[self.order], self.lengths, gather, ramp=True)
        padding = last_piece + np.arange(1, num_rows + 1)  # where each row's padding run sits in `segments`
        self._is_piece = np.ones(num_pieces + num_rows, dtype=bool)
        self._is_piece[padding] = False
        self.segments = np.empty(num_pieces + num_rows, dtype=np.int64)
        self.segments[self._is_piece] = self.lengths
        self.segments[padding] = max_length - self.fill

    def write(self, stream: np.ndarray, fill_value: int) -> torch.Tensor:
        """``(num_rows, max_length)`` int64: ``stream`` (flat order) laid out in the rows, ``fill_value`` after."""
        out = torch.full(self.shape, fill_value, dtype=torch.int64)
        if self.gather is not None:
            stream = np.take(stream, self.gather, out=_empty(self.gather.size)[1])
        out.numpy()[self.slots] = stream
        return out

    def index_in_row(self) -> torch.Tensor:
        """``(num_rows, max_length)`` int64: the 1-based index of each token's piece within its row, 0 = padding."""
        values = np.zeros(self.segments.size, dtype=np.int64)
        first = np.repeat(np.cumsum(self.row_counts) - self.row_counts, self.row_counts)
        values[self._is_piece] = np.arange(1, self.order.size + 1) - first
        out, flat = _empty(self.shape[0] * self.shape[1])
        _runs(values, self.segments, flat)
        return out.view(self.shape)

    def position_ids(self) -> torch.Tensor:
        """``(num_rows, max_length)`` int64 positions restarting at 0 per piece and at the row's padding."""
        out, flat = _empty(self.shape[0] * self.shape[1])
        _runs(np.zeros(self.segments.size, dtype=np.int64), self.segments, flat, ramp=True)
        return out.view(self.shape)

    def _row_starts(self) -> np.ndarray:
        """``(num_rows,)`` int64: where each row starts in the row-major token stream."""
        return np.cumsum(self.fill) - self.fill

    def piece_offsets(self) -> np.ndarray:
        """``(num_pieces,)`` int64, in input order: where each piece starts in the rows flattened to
        ``(num_rows * max_length,)``."""
        rows = np.repeat(np.arange(self.shape[0]), self.row_counts)
        offsets = np.empty_like(self.order)
        offsets[self.order] = rows * self.shape[1] + self.starts - self._row_starts()[rows]
        return offsets

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The piece (input order) and the offset in it of filled slots of the flattened rows.

        Args:
            positions: ``(k,)`` int64 indices into ``(num_rows * max_length,)``, all in filled slots.

        Returns:
            ``(piece, offset)``, both ``(k,)`` int64.
        """
        stream = self._row_starts()[positions // self.shape[1]] + positions % self.shape[1]
        k = np.searchsorted(self.starts, stream, side="right") - 1
        return self.order[k], stream - self.starts[k]

    def boundaries(self) -> list[list[tuple[int, int]]]:
        """Per row, the ``(start, end)`` column span of every piece, in row order."""
        row_start = np.repeat(self._row_starts(), self.row_counts)
        columns = self.starts - row_start
        spans = list(zip(columns.tolist(), (columns + self.lengths).tolist()))
        cuts = np.cumsum(self.row_counts).tolist()
        return [spans[a:b] for a, b in zip([0, *cuts[:-1]], cuts)]


# --------------------------------------------------------------------------------------------------------------------
# Lists of whole samples: straight into the rows
# --------------------------------------------------------------------------------------------------------------------


def _whole_list_lengths(
    inputs: Sequence, others: Iterable[Sequence | None], max_length: int, extra: int
) -> np.ndarray | None:
    """``(num_samples,)`` int64 sample lengths when [`_write_lists`] can take the samples: every sample of ``inputs``
    and of each of ``others`` (``None`` skipped) is a list or tuple, their lengths match, and every sample fits a row
    whole (1 to ``max_length - extra`` tokens; ``extra``: 1 with a separator). ``None`` otherwise: the general path
    then checks, and names what is off."""
    if not len(inputs) or not set(map(type, inputs)) <= _LIST_TYPES:
        return None
    lengths = np.fromiter(map(len, inputs), dtype=np.int64, count=len(inputs))
    if lengths.min() < 1 or lengths.max() > max_length - extra:
        return None
    for other in others:
        if other is None:
            continue
        if not set(map(type, other)) <= _LIST_TYPES:
            return None
        if not np.array_equal(np.fromiter(map(len, other), dtype=np.int64, count=len(other)), lengths):
            return None
    return lengths


def _whole_samples_layout(lengths: np.ndarray, max_length: int, strategy: Strategy, seed: int | None) -> _Layout:
    """The rows of samples of ``lengths`` (separators included) that all fit a row: each sample is one piece."""
    return _Layout(np.cumsum(lengths) - lengths, lengths, True, max_length, strategy, seed)


def _all_ones(masks: Sequence[Sequence[int]], lengths: np.ndarray) -> bool:
    """Whether every attention mask (a list or tuple of ``lengths[i]`` values) is all ``1`` or ``True``: nothing to
    remove. ``count(1)`` finds the ones (a C loop that compares by identity first, and ``1`` is a cached object), and a
    ``sum`` of type ``int`` proves they are all ``int`` or ``bool`` (``1.0`` or ``numpy.int64(1)`` also equal 1 but
    make the sum a ``float`` or a numpy scalar)."""
    ones = np.fromiter(map(_count_ones, masks), dtype=np.int64, count=len(masks))
    return np.array_equal(ones, lengths) and set(map(type, map(sum, masks))) == {int}


def _write_lists(
    samples: Sequence[Sequence[int]], lengths: np.ndarray, layout: _Layout, offsets: np.ndarray, fill_value: int
) -> torch.Tensor | None:
    """``(num_rows, max_length)`` int64: sample ``i`` (a list or tuple of ``lengths[i]`` ids, from
    [`_whole_list_lengths`]) written at ``offsets[i]`` of the flattened rows, ``fill_value`` everywhere else (the
    caller writes a separator there, if any). ``None`` when a value is not an ``int`` or is outside int64 (the
    general path then names it).

    One ``struct.pack_into`` per sample converts and checks in one C loop, straight into the output: a value must
    have ``__index__`` (no float, string, ``None`` or list) and fit in int64. A ``sum`` of type ``int`` then rules out
    what else has ``__index__`` (numpy scalars, tensors: the general path converts or refuses them), and the few
    values equal to 0 or 1 are looked up, since a ``bool`` is an ``int`` to both.
    """
    out = torch.full(layout.shape, fill_value, dtype=torch.int64)
    flat = out.numpy().reshape(-1)
    buffer = memoryview(flat)
    sizes = lengths.tolist()
    packers = {size: Struct(f"{size}q").pack_into for size in set(sizes)}
    try:
        for pack, offset, sample in zip(map(packers.__getitem__, sizes), (8 * offsets).tolist(), samples):
            pack(buffer, offset, *sample)
            if sum(sample).__class__ is not int:
                return None
    except (TypeError, StructError):
        return None
    maybe_bool = np.flatnonzero(flat.view(np.uint64) <= 1)
    if maybe_bool.size:
        maybe_bool = maybe_bool[layout.slots.reshape(-1)[maybe_bool]]
        sample, position = layout.locate(maybe_bool)
        written = position < lengths[sample]  # not a separator's slot
        for i, j in zip(sample[written].tolist(), position[written].tolist()):
            if samples[i][j].__class__ is bool:
                return None
    return out


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def pack_sequences(
    sequences: Iterable[Sequence[int] | torch.Tensor],
    max_length: int,
    pad_token_id: int,
    return_boundaries: bool = False,
    strategy: Strategy = "first_fit",
    *,
    overflow: Overflow = "error",
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """Pack token sequences into rows of ``max_length`` tokens, right-padded with ``pad_token_id``.

    Args:
        sequences: samples as 1-D integer tensors, arrays or lists of ids (any iterable of them); none empty. Ids
            must be integers in int64 range: floats, booleans, strings, ``None`` and nested lists are rejected with
            an error naming the sample.
        max_length: tokens per row.
        pad_token_id: id written after the last sample of each row.
        return_boundaries: also return, per row, the ``(start, end)`` token span (end exclusive) of every sample in
            it, in row order (a separator included).
        strategy: ``"first_fit"`` (default) keeps input order, starting a new row when the next sample does not fit;
            ``"bfd"`` uses the global [`best_fit_decreasing`] packer (fewest rows; samples inside a row stay in input
            order).
        overflow: what to do with a sample longer than ``max_length`` (its separator included): ``"error"``
            (default) raises; ``"truncate"`` keeps its first ``max_length`` tokens; ``"split"`` cuts it into
            ``max_length`` chunks packed as separate samples. The number of affected samples and tokens is logged as a
            warning.
        seed: shuffle the rows with this seed (``None``: no shuffle).
        eos_token_id: if set, this id is appended to every sample before packing (fast-axolotl's option of the same
            name), so each sample ends with it; it counts toward ``max_length``. A truncated sample loses it (its
            text did not end there); a split one has it in its last chunk. ``None`` (default): no separator.

    Returns:
        ``input_ids`` ``(num_rows, max_length)`` int64, and with ``return_boundaries`` the list of spans per row.

    Example:
        >>> pack_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12]], max_length=8, pad_token_id=0)
        tensor([[ 1,  2,  3,  4,  5,  0,  0,  0],
                [ 6,  7,  8,  9, 10, 11, 12,  0]])
        >>> pack_sequences([[1, 2, 3], [4, 5]], max_length=8, pad_token_id=0, eos_token_id=9)
        tensor([[1, 2, 3, 9, 4, 5, 9, 0]])
    """
    _check_pack_args(max_length, pad_token_id, eos_token_id)
    check_overflow(overflow)
    sequences = as_sequence(sequences, "sequences")
    extra = eos_token_id is not None
    lengths = _whole_list_lengths(sequences, (), max_length, extra)
    if lengths is not None:  # lists of samples that fit: written straight into the rows
        layout = _whole_samples_layout(lengths + extra, max_length, strategy, seed)
        offsets = layout.piece_offsets()
        input_ids = _write_lists(sequences, lengths, layout, offsets, pad_token_id)
        if input_ids is not None:
            if extra:
                input_ids.numpy().reshape(-1)[offsets + lengths] = eos_token_id
            return (input_ids, layout.boundaries()) if return_boundaries else input_ids
    flat = _flatten(sequences)
    if flat is None:
        flat = _concat_checked(_check_samples_one_by_one(sequences, None, None)[0])
    ids, lengths = flat
    _first_bad_length(lengths, max_length, overflow, extra)
    if extra:
        streams = [ids]
        _append_separator(streams, [eos_token_id], lengths)
        ids, lengths = streams[0], lengths + 1
    layout = _Layout(*_pieces(lengths, max_length, overflow), max_length, strategy, seed)
    input_ids = layout.write(ids, pad_token_id)
    return (input_ids, layout.boundaries()) if return_boundaries else input_ids


class PackedRows(tuple):
    """What [`concatenate_and_pack`] returns: a tuple ``(input_ids, labels, sample_index)``, or with
    ``return_position_ids`` ``(input_ids, labels, sample_index, position_ids)``, whose parts can also be read by name.
    Every part is ``(num_rows, max_length)`` int64.

    ``packed_masks`` is the deprecated name of ``sample_index`` (a ``FutureWarning``; removed in 0.3).
    """

    __slots__ = ()

    @property
    def input_ids(self) -> torch.Tensor:
        """``(num_rows, max_length)`` int64: the samples' ids side by side, ``pad_token_id`` after the last one."""
        return self[0]

    @property
    def labels(self) -> torch.Tensor:
        """``(num_rows, max_length)`` int64: the labels, ``label_pad_id`` at each sample's first token and padding."""
        return self[1]

    @property
    def sample_index(self) -> torch.Tensor:
        """``(num_rows, max_length)`` int64: the 1-based index of each token's sample within its row (0 = padding)."""
        return self[2]

    @property
    def position_ids(self) -> torch.Tensor | None:
        """``(num_rows, max_length)`` int64 positions restarting at 0 per sample; ``None`` without
        ``return_position_ids``."""
        return self[3] if len(self) > 3 else None

    @property
    def packed_masks(self) -> torch.Tensor:
        """Deprecated name of [`sample_index`]."""
        warnings.warn(
            "`packed_masks` is deprecated and will be removed in unpack_trainer 0.3; use `sample_index` (the same "
            "tensor: each token's 1-based sample index within its row, 0 = padding).",
            FutureWarning,
            stacklevel=2,
        )
        return self[2]


def concatenate_and_pack(
    input_sequences: Iterable[Sequence[int] | torch.Tensor],
    label_sequences: Iterable[Sequence[int] | torch.Tensor] | None,
    attention_masks: Iterable[Sequence[int] | torch.Tensor] | None,
    max_length: int,
    pad_token_id: int,
    label_pad_id: int = -100,
    *,
    strategy: Strategy = "first_fit",
    overflow: Overflow = "error",
    return_position_ids: bool = False,
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> PackedRows:
    """Pack samples with their labels into rows, with everything needed to train without contamination.

    Args:
        input_sequences: samples' token ids (1-D tensors, arrays or lists of integers; any iterable of them), none
            empty.
        label_sequences: per-sample labels, same lengths as the inputs (``-100`` = not trained); ``None`` uses the
            inputs as labels.
        attention_masks: per-sample 0/1 masks, same lengths as the inputs, or ``None`` (all ones). Padding marked
            with 0 at the start or end of a sample is removed before packing (and counted in a log line); a 0
            between two 1s is an error.
        max_length: tokens per row.
        pad_token_id: id filling the end of each row.
        label_pad_id: label for padding and for the first token of every sample.
        strategy, overflow, seed: as in [`pack_sequences`].
        return_position_ids: also return position ids restarting at 0 for every sample (the same as
            [`position_ids_from_sample_index`] of ``sample_index``).
        eos_token_id: if set, appended to every sample (after its mask padding is removed, before ``overflow``) as
            in [`pack_sequences`]. The separator is part of the sample it ends: same ``sample_index``, the next
            position. Its label is ``eos_token_id`` when the sample's last label is trained (not ``label_pad_id``),
            else ``label_pad_id``: it is predicted from the sample's own last token, so the model learns to end the
            sample without any label crossing a boundary, and a sample whose end is not trained (e.g. all
            ``-100``) does not get a trained token added. The next sample's first label stays ``label_pad_id``.

    Returns:
        A [`PackedRows`] tuple ``(input_ids, labels, sample_index)`` and, with ``return_position_ids``,
        ``position_ids``; all ``(num_rows, max_length)`` int64, also readable by name (``rows.sample_index``).
        ``sample_index`` holds the 1-based index of the sample inside its row (``0`` = padding): two tokens may attend
        to each other only if they carry the same non-zero index (it was called ``packed_masks``; that attribute
        still works until 0.3, with a ``FutureWarning``). The first label of every sample is ``label_pad_id``, so no
        sample is trained to predict the next sample's first token.

    Example:
        >>> rows = concatenate_and_pack([[1, 2, 3], [4, 5]], None, None, max_length=6, pad_token_id=0)
        >>> rows.input_ids
        tensor([[1, 2, 3, 4, 5, 0]])
        >>> rows.labels
        tensor([[-100,    2,    3, -100,    5, -100]])
        >>> rows.sample_index
        tensor([[1, 1, 1, 2, 2, 0]])
        >>> concatenate_and_pack([[1, 2, 3], [4, 5]], None, None, 8, 0, eos_token_id=9).labels
        tensor([[-100,    2,    3,    9, -100,    5,    9, -100]])
    """
    _check_pack_args(max_length, pad_token_id, eos_token_id)
    if isinstance(label_pad_id, bool) or not isinstance(label_pad_id, numbers.Integral):
        raise ValueError(f"`label_pad_id` must be an integer, got {label_pad_id!r}.")
    check_overflow(overflow)
    input_sequences = as_sequence(input_sequences, "input_sequences")
    if label_sequences is not None:
        label_sequences = as_sequence(label_sequences, "label_sequences")
    if attention_masks is not None:
        attention_masks = as_sequence(attention_masks, "attention_masks")
    num = len(input_sequences)
    for name, other in (("label_sequences", label_sequences), ("attention_masks", attention_masks)):
        if other is not None and len(other) != num:
            raise ValueError(f"`{name}` has {len(other)} entries but there are {num} input sequences.")

    extra = eos_token_id is not None
    lengths = _whole_list_lengths(input_sequences, (label_sequences, attention_masks), max_length, extra)
    if lengths is not None and (attention_masks is None or _all_ones(attention_masks, lengths)):
        written = _write_whole_lists(
            input_sequences,
            label_sequences,
            lengths,
            max_length,
            pad_token_id,
            label_pad_id,
            eos_token_id,
            strategy,
            seed,
        )
        if written is not None:
            return _packed_rows(*written, return_position_ids)
    streams = _flatten_all(input_sequences, label_sequences, attention_masks)
    if streams is None:
        checked = _check_samples_one_by_one(input_sequences, label_sequences, attention_masks)
        streams = _flatten_all(*checked)
    ids, labels, lengths, keep = streams
    if keep is not None:
        kept = np.concatenate(([0], np.cumsum(keep, dtype=np.int64)))  # tokens kept before each position
        ends = np.cumsum(lengths)
        new_lengths = kept[ends] - kept[ends - lengths]
        stripped = lengths - new_lengths
        logger.info(
            "Removed %d padding token(s) (attention_mask == 0) from %d sample(s).",
            int(stripped.sum()),
            int((stripped > 0).sum()),
        )
        kept_total = int(new_lengths.sum())
        ids_kept = np.compress(keep, ids, out=_empty(kept_total)[1])
        labels = ids_kept if labels is ids else np.compress(keep, labels, out=_empty(kept_total)[1])
        ids, lengths = ids_kept, new_lengths
    _first_bad_length(lengths, max_length, overflow, extra)
    if extra:
        last_label = labels[np.cumsum(lengths) - 1]
        eos_labels = np.where(last_label != label_pad_id, eos_token_id, label_pad_id)
        pair = [ids, labels]
        _append_separator(pair, [eos_token_id, eos_labels], lengths)
        ids, labels, lengths = pair[0], pair[1], lengths + 1

    piece_starts, piece_lengths, contiguous = _pieces(lengths, max_length, overflow)
    layout = _Layout(piece_starts, piece_lengths, contiguous, max_length, strategy, seed)
    if labels is ids:  # the labels are the ids, and are about to change
        labels = _empty(ids.size)[1]
        labels[:] = ids
    labels[piece_starts] = label_pad_id  # every piece's first token: predicted from the previous sample
    return _packed_rows(
        layout, layout.write(ids, pad_token_id), layout.write(labels, label_pad_id), return_position_ids
    )


def _packed_rows(
    layout: _Layout, input_ids: torch.Tensor, labels: torch.Tensor, return_position_ids: bool
) -> PackedRows:
    outputs: tuple[torch.Tensor, ...] = (input_ids, labels, layout.index_in_row())
    if return_position_ids:
        outputs += (layout.position_ids(),)
    return PackedRows(outputs)


def _write_whole_lists(
    inputs: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]] | None,
    lengths: np.ndarray,
    max_length: int,
    pad_token_id: int,
    label_pad_id: int,
    eos_token_id: int | None,
    strategy: Strategy,
    seed: int | None,
) -> tuple[_Layout, torch.Tensor, torch.Tensor] | None:
    """[`concatenate_and_pack`]'s rows for samples that [`_whole_list_lengths`] accepted (their masks, if any, all
    ones): ``(layout, input_ids, labels)``, or ``None`` when a value is off (the general path then names it)."""
    extra = eos_token_id is not None
    layout = _whole_samples_layout(lengths + extra, max_length, strategy, seed)
    offsets = layout.piece_offsets()
    input_ids = _write_lists(inputs, lengths, layout, offsets, pad_token_id)
    if input_ids is None:
        return None
    if labels is None:
        out = torch.full(layout.shape, label_pad_id, dtype=torch.int64)
        np.copyto(out.numpy(), input_ids.numpy(), where=layout.slots)
    else:
        out = _write_lists(labels, lengths, layout, offsets, label_pad_id)
        if out is None:
            return None
    flat_ids, flat_labels = input_ids.numpy().reshape(-1), out.numpy().reshape(-1)
    if extra:  # the separator after each sample, its label as in `concatenate_and_pack`'s docstring
        ends = offsets + lengths
        flat_labels[ends] = np.where(flat_labels[ends - 1] != label_pad_id, eos_token_id, label_pad_id)
        flat_ids[ends] = eos_token_id
    flat_labels[offsets] = label_pad_id  # every sample's first token: predicted from the previous sample
    return layout, input_ids, out


def _flatten_all(
    inputs: Sequence, labels: Sequence | None, masks: Sequence | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """``(ids, labels, lengths, keep)`` for [`concatenate_and_pack`]: ids and labels ``(total,)`` int64 (the same
    array when ``labels`` is ``None``), ``keep`` the ``(total,)`` bool tokens an attention mask keeps (``None``: all).
    ``None`` when any check fails."""
    flat = _flatten(inputs)
    if flat is None:
        return None
    ids, lengths = flat
    flat_labels = ids
    if labels is not None:
        flat = _flatten(labels)
        if flat is None or not np.array_equal(flat[1], lengths):
            return None
        flat_labels = flat[0]
    keep = None
    if masks is not None:
        flat = _flatten_masks(masks)
        if flat is None or not np.array_equal(flat[1], lengths):
            return None
        if flat[0].size and not flat[0].min() == flat[0].max() == 1:
            keep = _mask_keep(flat[0], lengths)
            if keep is None:
                return None
    return ids, flat_labels, lengths, keep


def _flatten_masks(masks: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
    """[`_flatten`] for attention masks: ``(values (total,) uint8 or int64, lengths (num_samples,) int64)``.

    Lists (or tuples) go through ``bytes``, a C loop that takes anything with ``__index__`` in ``[0, 255]`` and
    refuses floats, strings and ``None``: the conversion in one pass, five times faster than ``np.fromiter``. A
    ``sum`` of type ``int`` per mask then rules out the rest of what has ``__index__`` (numpy scalars, tensors:
    the per-sample check converts or names them). Values other than 0 and 1 are refused later by [`_mask_keep`].
    """
    if len(masks) and set(map(type, masks)) <= _LIST_TYPES:
        try:
            values = np.frombuffer(b"".join(map(bytes, masks)), dtype=np.uint8)
        except (TypeError, ValueError):
            return None
        if set(map(type, map(sum, masks))) != {int}:
            return None
        return values, np.fromiter(map(len, masks), dtype=np.int64, count=len(masks))
    return _flatten(masks, allow_bool=True)


def position_ids_from_sample_index(sample_index: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 wherever the sample index changes along the last dimension.

    Args:
        sample_index: ``(..., T)`` integer tensor, e.g. ``sample_index`` from [`concatenate_and_pack`]. Trailing
            padding (index 0) counts as one more pseudo-sample, so its positions also start at 0.

    Returns:
        ``(..., T)`` int64 position ids.

    Example:
        >>> position_ids_from_sample_index(torch.tensor([[1, 1, 1, 2, 2, 0, 0]]))
        tensor([[0, 1, 2, 0, 1, 0, 1]])
    """
    t = sample_index.shape[-1]
    arange = torch.arange(t, dtype=torch.long, device=sample_index.device).expand_as(sample_index)
    starts = torch.ones_like(sample_index, dtype=torch.bool)
    starts[..., 1:] = sample_index[..., 1:] != sample_index[..., :-1]
    start_positions = torch.where(starts, arange, torch.zeros_like(arange)).cummax(dim=-1).values
    return arange - start_positions
