"""Streaming packing: pack samples from an iterable on the fly through a buffer, with exact mid-epoch resume.

Stage 3 of the data path (pack) for a stream: the rows of [`unpack_trainer.data.packing`], decided a buffer at a time.

When a data set is streamed (``datasets`` streaming, sharded JSONL / Parquet / Arrow files), nothing can be packed
ahead of time. [`StreamingPacker`] packs it on the fly:

1. It reads up to ``buffer_size`` samples into a buffer.
2. ``select_samples_to_pack(buffer)`` groups them into rows; by default with the global
   [`~unpack_trainer.data.packing.best_fit_decreasing`] over the whole buffer.
3. Every row at least ``full_row_fill`` full (default 0.995: at most 10 free tokens out of 2048) is emitted. The
   other rows are *held back*: their samples stay in the buffer, the buffer is topped up with the next samples of the
   stream, and the whole buffer is packed again, so the new samples fill the gaps of the held rows (a held sample is
   not tied to its old row: best-fit decreasing places the long held samples first and tops them up with short new
   ones).
4. ``pack_selected_samples(row)`` builds each emitted row (by default: concatenated tokens plus ``seq_lengths``).
5. At the end of the stream every remaining sample is emitted; nothing is dropped.

Why hold rows back: best-fit decreasing over one buffer leaves a handful of partly filled rows, the rows created
last when the short samples ran out. Emitting them (what packing each buffer independently does, like TRL's
``pack_dataset`` on a streamed data set) costs about 0.5% of the tokens at a buffer of 1,000 lognormal samples;
giving them another round with fresh samples recovers two thirds of it (see ``benchmarks/bench_streaming.py``).
Two bounds keep this fair and fast: a sample is held back at most ``max_hold_rounds`` times (default 2), after which
its row is emitted as it is, and held-back samples never fill more than half the buffer, so every round reads at least
half a buffer of new samples.

Worked example (capacity 8, ``buffer_size`` 4, ``full_row_fill`` 1.0)::

    stream lengths      [5, 2, 6, 1, | 3, 2, ...]
    round 0 buffer      [5, 2, 6, 1]        BFD rows: [2, 6] (full), [5, 1] (6/8)
    emitted             [2, 6]              held back: 5, 1
    round 1 buffer      [5, 1, 3, 2]        BFD rows: [5, 3] (full), [1, 2] (3/8, held again) ...

A row is a dict the packed collators accept (``DataCollatorForPacking``, TRL's ``DataCollatorForLanguageModeling``
with ``padding_free=True``): ``input_ids`` (the samples' tokens concatenated), ``seq_lengths`` (each sample's length,
summing to ``len(input_ids)``), and ``labels`` / ``completion_mask`` / ``assistant_masks`` concatenated the same way
when the samples have them.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from unpack_trainer._logging import log_once
from unpack_trainer.data.packing import best_fit_decreasing, gc_paused
from unpack_trainer.data.validation import (
    Overflow,
    check_overflow,
    check_positive_int,
    check_seq_lengths,
    log_overflow,
    overflow_spans,
    token_list,
    value_list,
)
from unpack_trainer.packed_seq_info import SEQ_LENGTHS_COLUMN

logger = logging.getLogger(__name__)

Sample = dict[str, Any]

_STATE_FORMAT = "unpack_trainer.StreamingPacker/1"
#: What a pass's state holds (the `_PassState` slots a saved state carries, under the same names).
_PASS_FIELDS = ("epoch", "shard", "num_read", "round", "exhausted", "samples", "lengths", "born", "pending", "stats")
#: The keys of [`StreamingPacker.state_dict`] that [`StreamingPacker.load_state_dict`] requires.
_STATE_KEYS = ("format", "config", *_PASS_FIELDS, "pending_tokens", "source")
#: Per-token fields a packed row carries, with the value a sample without the field is equivalent to (``None``: a
#: copy of its ``input_ids``, as the collators default the labels).
_TOKEN_FIELD_DEFAULTS: dict[str, int | None] = {"labels": None, "completion_mask": 1, "assistant_masks": 1}
DEFAULT_TOKEN_FIELDS = ("input_ids", "labels", "completion_mask", "assistant_masks")


def _cut_seq_lengths(seq_lengths: list[int], start: int, stop: int) -> list[int]:
    """The lengths of the pieces of consecutive samples (``seq_lengths``) that fall in the token span ``[start, stop)``."""
    pieces, offset = [], 0
    for length in seq_lengths:
        low, high = max(offset, start), min(offset + length, stop)
        if high > low:
            pieces.append(high - low)
        offset += length
        if offset >= stop:
            break
    return pieces


def _worker() -> tuple[int, int]:
    """``(worker_id, num_workers)`` of the current DataLoader worker, ``(0, 1)`` outside of one."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _is_hf_iterable_dataset(dataset: object) -> bool:
    try:
        from datasets import IterableDataset as HFIterableDataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(dataset, HFIterableDataset)


class _PassState:
    """Everything needed to continue one pass over the stream exactly where it stands.

    The buffer holds the samples read but not yet put in an emitted row, in reading order, with their lengths and
    the round in which they were read; ``pending`` holds the rows of the current round that were not yielded yet.
    """

    __slots__ = (*_PASS_FIELDS, "rewind", "origin", "source_started")

    def __init__(self, epoch: int, shard: tuple[int, int] | None = None) -> None:
        self.epoch = epoch
        self.shard = shard
        self.num_read = 0  # items taken from the source iterator, including those of other shards
        self.round = 0
        self.exhausted = False
        self.samples: list[Sample] = []
        self.lengths: list[int] = []
        self.born: list[int] = []
        self.pending: deque[tuple[int, list[Sample]]] = deque()  # (tokens, samples) of each row
        # After an exception while reading a stateful source, the source may stand past `num_read`: its state at the
        # start of that read, and `num_read` then, so that a resume can go back there and skip what was kept.
        self.rewind: tuple[Any, int] | None = None
        # Where this pass's source iterator started (source state or None for "its beginning", and `num_read` then),
        # and whether it was read yet: until then a `datasets` source's `state_dict()` is still the previous one.
        self.origin: tuple[Any, int] = (None, 0)
        self.source_started = False
        self.stats = {
            "samples": 0,
            "rows": 0,
            "tokens": 0,
            "truncated": 0,
            "truncated_tokens": 0,
            "split": 0,
            "split_chunks": 0,
            "held_back": 0,
        }


class StreamingPacker(IterableDataset):
    """Pack an iterable of tokenized samples into rows of at most ``max_length`` tokens, on the fly, through a buffer.

    See the module docstring for the algorithm. Iterating yields rows (dicts); each row is built by
    [`pack_selected_samples`] from samples chosen by [`select_samples_to_pack`]. Override either hook in a subclass
    or pass a callable with the same signature.

    Determinism and resume: for a given source order, configuration and ``seed`` the rows are always the same.
    [`state_dict`] describes the pass at the last row yielded (the samples in the buffer, the rows of the current
    round not yet yielded, the position in the source); [`load_state_dict`] makes the next iteration continue from
    there, emitting exactly the rows an uninterrupted pass would have emitted. A source with ``state_dict`` /
    ``load_state_dict`` (e.g. a streaming ``datasets.IterableDataset``, [`streaming_dataset_reader`]'s ``rows()``)
    is repositioned with them; any other source is re-iterated from its start and the items already read are
    skipped, so it must yield the same items in the same order every time it is iterated. The state holds up to
    ``buffer_size`` samples (it references them; it does not copy them). A state taken after an exception (a sample
    rejected by ``overflow="error"`` or by validation, an error in the source or in a hook) resumes with nothing lost
    or repeated: the item that raised and the row being built are not counted as read or emitted. A one-shot
    iterator source (a generator) can be read by one pass only; a second pass raises ``ValueError``.

    Sharding: in a ``torch.utils.data.DataLoader`` worker, or with ``rank`` / ``world_size``, each worker of each
    rank packs a distinct shard of the stream: no sample twice, none missing. A ``datasets.IterableDataset`` source
    is sharded by ``datasets`` (by file when it has enough shards, see ``split_dataset_by_node``); any other source is
    read whole by every shard, which keeps items ``i`` with ``i % num_shards == shard_id`` (``shard_id = rank *
    num_workers + worker_id``). Use per-worker states with workers (torchdata's ``StatefulDataLoader`` calls
    ``state_dict`` / ``load_state_dict`` inside each worker).

    Args:
        dataset: the samples: dicts with ``input_ids`` (a list, 1-D array or tensor of integer token ids; a float
            or boolean array, text, ``None`` or a nested list is rejected with an error naming the sample; the
            packer checks a list's first and last ids, the collator every id) and optionally the other
            ``token_fields`` (same length) and ``seq_lengths`` (a sample that is already several samples).
            Any iterable; a ``datasets.IterableDataset`` or a source with ``state_dict`` resumes without re-reading.
        max_length: tokens per row (the row capacity).
        buffer_size: samples packed together; larger packs tighter, costs memory and start-up latency.
        seed: if given, the rows of each round are emitted in an order shuffled with
            ``numpy.random.default_rng([seed, epoch, round])``; ``None`` keeps the order ``select_samples_to_pack``
            returns (for best-fit decreasing: fullest rows, holding the longest samples, first).
        overflow: a sample longer than ``max_length``: ``"error"`` (default) raises a ``ValueError`` naming it;
            ``"truncate"`` keeps its first ``max_length`` tokens; ``"split"`` cuts it into ``max_length`` chunks
            packed as separate samples. Counts are in [`stats`] and logged as a warning at the end of the pass.
        full_row_fill: fraction of ``max_length`` from which a row counts as full and is emitted at once; less full
            rows are held back to be topped up. ``0`` emits every row of every round (no holding back).
        max_hold_rounds: how many rounds a sample may be held back before its row is emitted as it is. ``0``
            disables holding back.
        token_fields: per-token fields concatenated into the rows (``input_ids`` first). Other keys of the samples
            are not carried over by the default ``pack_selected_samples``. Defaults to ``input_ids``, ``labels``,
            ``completion_mask``, ``assistant_masks``.
        rank, world_size: this process's rank among ``world_size`` data-parallel processes, for loops that do not
            split the data themselves. Leave ``None`` under ``accelerate`` / ``Trainer``: they already give each
            process different batches of the same stream.
        select_samples_to_pack: callable ``(samples: list[dict]) -> list[list[dict]]`` replacing the method.
        pack_selected_samples: callable ``(samples: list[dict]) -> dict`` replacing the method.

    Example:
        >>> samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9, 10, 11]}]
        >>> list(StreamingPacker(samples, max_length=8, buffer_size=3))
        [{'input_ids': [4, 5, 6, 7, 8, 9, 10, 11], 'seq_lengths': [2, 6]}, {'input_ids': [1, 2, 3], 'seq_lengths': [3]}]
    """

    def __init__(
        self,
        dataset: Iterable[Mapping[str, Any]],
        max_length: int,
        *,
        buffer_size: int = 10_000,
        seed: int | None = None,
        overflow: Overflow = "error",
        full_row_fill: float = 0.995,
        max_hold_rounds: int = 2,
        token_fields: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        select_samples_to_pack: Callable[[list[Sample]], list[list[Sample]]] | None = None,
        pack_selected_samples: Callable[[list[Sample]], Sample] | None = None,
    ) -> None:
        super().__init__()
        self.max_length = check_positive_int(max_length, "max_length")
        self.buffer_size = check_positive_int(buffer_size, "buffer_size")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
            raise ValueError(f"`seed` must be a non-negative integer or None, got {seed!r}.")
        self.seed = None if seed is None else int(seed)
        self.overflow = check_overflow(overflow)
        if (
            isinstance(full_row_fill, bool)
            or not isinstance(full_row_fill, numbers.Real)
            or not 0 <= full_row_fill <= 1
        ):
            raise ValueError(f"`full_row_fill` must be a number in [0, 1], got {full_row_fill!r}.")
        self.full_row_fill = float(full_row_fill)
        if (
            isinstance(max_hold_rounds, bool)
            or not isinstance(max_hold_rounds, numbers.Integral)
            or max_hold_rounds < 0
        ):
            raise ValueError(f"`max_hold_rounds` must be a non-negative integer, got {max_hold_rounds!r}.")
        self.max_hold_rounds = int(max_hold_rounds)
        fields = tuple(DEFAULT_TOKEN_FIELDS if token_fields is None else token_fields)
        if not fields or fields[0] != "input_ids" or len(set(fields)) != len(fields) or SEQ_LENGTHS_COLUMN in fields:
            raise ValueError(
                f"`token_fields` must start with 'input_ids', list each field once and not 'seq_lengths', got {fields}."
            )
        self.token_fields = fields
        self._inspected_keys = frozenset(fields[1:]) | {"attention_mask", SEQ_LENGTHS_COLUMN}
        if (rank is None) != (world_size is None):
            raise ValueError("Pass both `rank` and `world_size`, or neither.")
        if world_size is not None:
            world_size = check_positive_int(world_size, "world_size")
            if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
                raise ValueError(f"`rank` must be an integer in [0, {world_size}), got {rank!r}.")
        self.rank, self.world_size = (0, 1) if world_size is None else (int(rank), int(world_size))
        for name, hook in (
            ("select_samples_to_pack", select_samples_to_pack),
            ("pack_selected_samples", pack_selected_samples),
        ):
            if hook is not None and not callable(hook):
                raise ValueError(f"`{name}` must be callable, got {type(hook).__name__}.")
        self._select_hook = select_samples_to_pack
        self._pack_hook = pack_selected_samples

        self._source_shards_itself = _is_hf_iterable_dataset(dataset)
        if self._source_shards_itself and self.world_size > 1:
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank=self.rank, world_size=self.world_size)
        self.dataset = dataset
        self._stateful_source = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )
        # In shared memory so that persistent DataLoader workers see `set_epoch` calls made after they started.
        self._shared_epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        # A generator (or any iterator) can be read once: a second pass would silently find it empty.
        self._one_shot = isinstance(dataset, Iterator)
        self._passes_started = 0
        self._live: _PassState | None = None
        self._resume: dict[str, Any] | None = None
        self._keys_inspected = False  # the first sample's keys say which ones the rows do not carry

    # ---------------------------------------------------------------------------------------------------- hooks

    def select_samples_to_pack(self, samples: list[Sample]) -> list[list[Sample]]:
        """Decide which samples share a row.

        Args:
            samples: the buffer, in reading order (held-back samples first). Each has ``input_ids`` as a list.

        Returns:
            Rows as lists of the given sample objects, each sample exactly once, each row at most ``max_length``
            tokens, in the order the rows should be emitted. The default is best-fit decreasing over the whole buffer
            (each row's samples in reading order, fullest rows first).
        """
        rows = best_fit_decreasing([len(sample["input_ids"]) for sample in samples], self.max_length)
        return [[samples[i] for i in row] for row in rows]

    def pack_selected_samples(self, samples: list[Sample]) -> Sample:
        """Build one row from the samples ``select_samples_to_pack`` put together.

        The default concatenates the ``token_fields`` in order and records each sample's length in ``seq_lengths``
        (a sample that has ``seq_lengths`` contributes its own). A field some samples of the row lack is filled as
        the collators would read its absence (``labels``: the sample's ``input_ids``; ``completion_mask`` /
        ``assistant_masks``: ones); a custom field must be in all or none of them.

        Returns:
            ``{"input_ids": list[int], "seq_lengths": list[int], <other token fields>: list[int]}``.
        """
        input_ids: list[int] = []
        seq_lengths: list[int] = []
        for sample in samples:
            ids = sample["input_ids"]
            input_ids.extend(ids)
            own = sample.get(SEQ_LENGTHS_COLUMN)
            if own is None:
                seq_lengths.append(len(ids))
            else:
                seq_lengths.extend(own)
        row: Sample = {"input_ids": input_ids, SEQ_LENGTHS_COLUMN: seq_lengths}
        keys = set().union(*samples)
        for field in self.token_fields[1:]:
            if field not in keys:
                continue
            parts = [sample.get(field) for sample in samples]
            absent = parts.count(None)
            if absent == len(parts):
                continue
            default = _TOKEN_FIELD_DEFAULTS.get(field, "missing")
            if absent and default == "missing":
                raise ValueError(
                    f"Sample {parts.index(None)} of this row has no `{field}` while others have it; give every sample "
                    f"a `{field}` or none."
                )
            values: list = []
            for sample, part in zip(samples, parts):
                if part is not None:
                    values.extend(part)
                elif default is None:
                    values.extend(sample["input_ids"])
                else:
                    values.extend([default] * len(sample["input_ids"]))
            row[field] = values
        return row

    # ---------------------------------------------------------------------------------------------------- state

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch the next pass belongs to (it seeds the row shuffle); forwarded to the source if it has
        ``set_epoch``. A state loaded with [`load_state_dict`] carries its own epoch and takes precedence."""
        self._shared_epoch.fill_(int(epoch))
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(int(epoch))

    @property
    def _epoch(self) -> int:
        return int(self._shared_epoch)

    @property
    def stats(self) -> dict[str, int]:
        """Counts of the latest pass: ``samples`` read into this shard's buffer (after splitting), ``rows`` and
        ``tokens`` emitted, ``truncated`` samples (``truncated_tokens`` dropped), ``split`` samples (into
        ``split_chunks`` chunks), ``held_back`` (times a sample was held back for another round)."""
        state = self._live
        if state is None:
            return dict(_PassState(self._epoch).stats)
        return dict(state.stats)

    def _config(self) -> dict[str, Any]:
        return {
            "max_length": self.max_length,
            "buffer_size": self.buffer_size,
            "seed": self.seed,
            "overflow": self.overflow,
            "full_row_fill": self.full_row_fill,
            "max_hold_rounds": self.max_hold_rounds,
            "token_fields": list(self.token_fields),
        }

    def state_dict(self) -> dict[str, Any]:
        """The state of the latest pass after the last row it yielded (or the state loaded and not yet used).

        Returns:
            A dict of plain Python values (lists, ints, the samples themselves and the source's own
            ``state_dict()`` when it has one), to be passed to [`load_state_dict`] of a packer with the same
            configuration reading the same source.
        """
        if self._resume is not None:
            return dict(self._resume)
        state = self._live if self._live is not None else _PassState(self._epoch)
        source_state, source_skip = None, 0
        if self._stateful_source and self._live is not None:
            if state.rewind is not None:  # an exception while reading: the source may stand past `num_read`
                source_state, read_then = state.rewind
            elif not state.source_started:  # not read yet in this pass: its own state is still the previous one
                source_state, read_then = state.origin
            else:
                source_state, read_then = self.dataset.state_dict(), state.num_read
            source_skip = state.num_read - read_then
        return {
            "format": _STATE_FORMAT,
            "config": self._config(),
            "shard": None if state.shard is None else list(state.shard),
            "epoch": state.epoch,
            "num_read": state.num_read,
            "round": state.round,
            "exhausted": state.exhausted,
            "samples": list(state.samples),
            "lengths": list(state.lengths),
            "born": list(state.born),
            "pending": [list(samples) for _, samples in state.pending],
            "pending_tokens": [tokens for tokens, _ in state.pending],
            "stats": dict(state.stats),
            "source": source_state,
            "source_skip": source_skip,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next iteration continue the pass described by ``state_dict`` (from [`state_dict`]).

        Raises:
            ValueError: the state is not a ``StreamingPacker`` state, or was saved with a different configuration
                (resuming would not reproduce the uninterrupted pass). A state saved by another shard is rejected
                when iteration starts.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(f"Not a StreamingPacker state (expected format {_STATE_FORMAT!r}).")
        missing = sorted(set(_STATE_KEYS) - set(state_dict))
        if missing:
            raise ValueError(
                f"The StreamingPacker state lacks the keys {missing}; pass the dict returned by `state_dict()` "
                "unchanged (after `torch.save` / `pickle`, not after selecting keys)."
            )
        saved, current = state_dict["config"], self._config()
        differences = [
            f"{key}: saved {saved.get(key)!r}, now {value!r}"
            for key, value in current.items()
            if saved.get(key) != value
        ]
        if differences:
            raise ValueError(
                "The state was saved by a StreamingPacker configured differently, so resuming would not reproduce "
                "the same rows (" + "; ".join(differences) + "). Use the same configuration to resume."
            )
        self._resume = dict(state_dict)
        self._shared_epoch.fill_(int(state_dict["epoch"]))

    # ---------------------------------------------------------------------------------------------------- iteration

    def _shard(self) -> tuple[int, int]:
        """``(shard_id, num_shards)`` of this packer: ``rank * num_workers + worker_id`` of ``world_size * num_workers``."""
        worker_id, num_workers = _worker()
        return self.rank * num_workers + worker_id, self.world_size * num_workers

    def _start_pass(self) -> tuple[_PassState, Iterator]:
        shard = self._shard()
        if self._one_shot and self._passes_started:
            raise ValueError(
                "The StreamingPacker's source is a one-shot iterator (e.g. a generator) that an earlier pass already "
                "read, so this pass (a new epoch, or a resume) would silently yield no rows or skip samples. Pass a "
                "re-iterable source: a list, a `datasets.IterableDataset`, or an object whose `__iter__` starts "
                "over each time (e.g. `class Source: def __iter__(self): yield from read_samples()`)."
            )
        self._passes_started += 1
        resume, self._resume = self._resume, None
        if resume is None:
            state = _PassState(self._epoch, shard)
            return state, iter(self.dataset)
        if resume["shard"] is not None and tuple(resume["shard"]) != shard:
            raise ValueError(
                f"The state was saved by shard {resume['shard'][0]} of {resume['shard'][1]} but is loaded by shard "
                f"{shard[0]} of {shard[1]} (shard = rank * num_workers + DataLoader worker id). Load each worker's "
                "own state, with the same number of workers and processes (torchdata's StatefulDataLoader does this)."
            )
        state = _PassState(int(resume["epoch"]), shard)
        state.num_read = int(resume["num_read"])
        state.round = int(resume["round"])
        state.exhausted = bool(resume["exhausted"])
        state.samples = list(resume["samples"])
        state.lengths = [int(n) for n in resume["lengths"]]
        state.born = [int(r) for r in resume["born"]]
        state.pending = deque(
            (int(tokens), list(samples)) for tokens, samples in zip(resume["pending_tokens"], resume["pending"])
        )
        state.stats.update(resume["stats"])
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(state.epoch)
        if state.exhausted:
            return state, iter(())
        if self._stateful_source and resume["source"] is not None:
            self.dataset.load_state_dict(resume["source"])
            iterator, to_skip = iter(self.dataset), int(resume.get("source_skip", 0))
            state.origin = (resume["source"], state.num_read - to_skip)
        else:
            # No source state: re-read the source from its start and skip what was already read.
            iterator, to_skip = iter(self.dataset), state.num_read
        state.source_started = to_skip > 0
        skipped = sum(1 for _ in itertools.islice(iterator, to_skip))
        if skipped != to_skip:
            raise ValueError(
                f"The state says {state.num_read} items were read from the source, but it now has only {skipped}; "
                "resume with the same source."
            )
        return state, iterator

    def __iter__(self) -> Iterator[Sample]:
        state, source = self._start_pass()
        self._live = state
        # A `datasets.IterableDataset` gives each worker (and, split by node, each rank) its own part already.
        shard_id, num_shards = (0, 1) if self._source_shards_itself else state.shard
        pack = self._pack_hook if self._pack_hook is not None else self.pack_selected_samples
        stats = state.stats
        while True:
            while state.pending:
                tokens, samples = state.pending[0]
                row = pack(samples)  # if this raises, the row stays pending: a state taken now still holds it
                state.pending.popleft()
                stats["rows"] += 1
                stats["tokens"] += tokens
                yield row
            # No yield happens while the buffer is filled and packed, and almost everything allocated there is kept
            # (buffered samples, queued rows): with a buffer of 10,000 samples, GC was a third of the packer's time.
            with gc_paused():
                if not state.exhausted:
                    self._fill(state, source, shard_id, num_shards)
                if not state.samples:
                    break
                self._plan_round(state)
        self._log_overflow(state)

    def _fill(self, state: _PassState, source: Iterator, shard_id: int, num_shards: int) -> None:
        """Read from ``source`` until the buffer holds ``buffer_size`` samples or the source ends."""
        samples, lengths, born = state.samples, state.lengths, state.born
        round_index, capacity, check = state.round, self.max_length, self._check_sample
        missing, num_read = self.buffer_size - len(samples), state.num_read
        added = 0
        # `num_read` counts an item only once it is in the buffer (or belongs to another shard): an item that raises
        # is read again on resume. A stateful source stands past it, so remember where it stood before this read.
        mark = None
        if self._stateful_source and missing > 0:
            mark = (self.dataset.state_dict(), num_read) if state.source_started else state.origin
            state.source_started = True
        try:
            while added < missing:
                try:
                    item = next(source)
                except StopIteration:
                    state.exhausted = True
                    break
                index = num_read
                if num_shards > 1 and index % num_shards != shard_id:
                    num_read += 1
                    continue
                sample, length = check(item, index)
                if length <= capacity:
                    samples.append(sample)
                    lengths.append(length)
                    added += 1
                else:
                    chunks = self._overflow(sample, length, index, state.stats)
                    samples.extend([chunk for chunk, _ in chunks])
                    lengths.extend([chunk_length for _, chunk_length in chunks])
                    added += len(chunks)
                num_read += 1
            state.rewind = None
        except BaseException:
            state.rewind = mark
            raise
        finally:
            born.extend([round_index] * (len(samples) - len(born)))
            state.num_read = num_read
            state.stats["samples"] += added

    def _check_sample(self, item: Any, index: int) -> tuple[Sample, int]:
        """Validate one source item; return it with its token fields as lists, and its length.

        Token fields get the O(1) check of [`unpack_trainer.data.validation.token_list`] with ``scan=False``
        (container, dtype, first and last values), so that packing stays at hundreds of thousands of samples per
        second; the collator checks every value of the rows.
        """
        if type(item) is not dict and not isinstance(item, Mapping):
            raise ValueError(f"Sample {index} of the stream is a {type(item).__name__}, not a dict with `input_ids`.")
        ids = item.get("input_ids")
        if ids is None:
            raise ValueError(f"Sample {index} of the stream has no `input_ids` (keys: {sorted(item)}).")
        sample = item
        checked = token_list(ids, index, "`input_ids` of sample {index} of the stream", scan=False)
        if checked is not ids:
            sample = dict(item)
            ids = sample["input_ids"] = checked
        length = len(ids)
        if length == 0:
            raise ValueError(f"Sample {index} of the stream is empty; every sample needs at least one token.")
        if len(item) > 1:
            special = self._inspected_keys.intersection(item)
            if special:
                sample = self._check_fields(item, sample, special, length, index)
        if not self._keys_inspected:
            self._log_dropped_keys(item)
        return sample, length

    def _check_fields(self, item: Mapping, sample: Sample, keys: frozenset, length: int, index: int) -> Sample:
        """Validate the per-token fields, ``attention_mask`` and ``seq_lengths`` of a sample (``keys``: those it has)."""
        for field in self.token_fields[1:]:
            value = item.get(field) if field in keys else None
            if value is None:
                continue
            what = f"`{field}` of sample {{index}} of the stream"
            if field in _TOKEN_FIELD_DEFAULTS:
                checked = token_list(value, index, what, allow_bool=field != "labels", scan=False)
            else:
                checked = value_list(value, index, what)
            if checked is not value:
                if sample is item:
                    sample = dict(item)
                value = sample[field] = checked
            if len(value) != length:
                raise ValueError(
                    f"Sample {index} of the stream has {length} input_ids but {len(value)} `{field}`; they must have "
                    "equal length."
                )
        mask = item.get("attention_mask")
        if mask is not None and 0 in token_list(
            mask, index, "`attention_mask` of sample {index} of the stream", allow_bool=True
        ):
            raise ValueError(
                f"Sample {index} of the stream has padding (attention_mask == 0); packing needs unpadded samples. "
                "Tokenize without padding."
            )
        own = item.get(SEQ_LENGTHS_COLUMN)
        if own is not None:
            own = check_seq_lengths(own, length, index, "sample {index} of the stream")
            if sample is item:
                sample = dict(item)
            sample[SEQ_LENGTHS_COLUMN] = own
        return sample

    def _log_dropped_keys(self, item: Mapping) -> None:
        self._keys_inspected = True
        default_pack = (
            self._pack_hook is None and type(self).pack_selected_samples is StreamingPacker.pack_selected_samples
        )
        dropped = sorted(set(item) - set(self.token_fields) - {SEQ_LENGTHS_COLUMN})
        if dropped and default_pack:
            carried = ", ".join(f"`{f}`" for f in self.token_fields)
            log_once(
                logger,
                logging.INFO,
                f"Packed rows carry {carried} and `seq_lengths`; the other keys of the samples "
                f"({', '.join(f'`{k}`' for k in dropped)}) are not carried over.",
            )

    def _overflow(self, sample: Sample, length: int, index: int, stats: dict[str, int]) -> list[tuple[Sample, int]]:
        """Apply ``overflow`` to a sample longer than ``max_length``."""
        spans = overflow_spans(index, length, self.max_length, self.overflow, where=" of the stream")
        if self.overflow == "truncate":
            stats["truncated"] += 1
            stats["truncated_tokens"] += length - self.max_length
        else:
            stats["split"] += 1
            stats["split_chunks"] += len(spans)
        chunks = []
        for start, stop in spans:
            chunk = dict(sample)
            for field in self.token_fields:
                if sample.get(field) is not None:
                    chunk[field] = sample[field][start:stop]
            if sample.get(SEQ_LENGTHS_COLUMN) is not None:
                chunk[SEQ_LENGTHS_COLUMN] = _cut_seq_lengths(sample[SEQ_LENGTHS_COLUMN], start, stop)
            chunks.append((chunk, stop - start))
        return chunks

    def _uses_default_select(self) -> bool:
        return (
            self._select_hook is None and type(self).select_samples_to_pack is StreamingPacker.select_samples_to_pack
        )

    def _select_rows(self, state: _PassState) -> list[list[int]]:
        """Rows as lists of buffer positions, from the default packer or the ``select_samples_to_pack`` hook."""
        if self._uses_default_select():
            return best_fit_decreasing(state.lengths, self.max_length)
        hook = self._select_hook if self._select_hook is not None else self.select_samples_to_pack
        samples = state.samples
        groups = hook(list(samples))
        positions: dict[int, list[int]] = {}
        for position in range(len(samples) - 1, -1, -1):
            positions.setdefault(id(samples[position]), []).append(position)
        rows = []
        for number, group in enumerate(groups):
            row = []
            for sample in group:
                slots = positions.get(id(sample))
                if not slots:
                    raise ValueError(
                        f"select_samples_to_pack returned, in row {number}, a sample that is not in the buffer or "
                        "that it already returned; return each given sample object exactly once."
                    )
                row.append(slots.pop())
            if not row:
                raise ValueError(f"select_samples_to_pack returned an empty row (row {number}).")
            tokens = sum(state.lengths[i] for i in row)
            if tokens > self.max_length:
                raise ValueError(
                    f"select_samples_to_pack put {tokens} tokens in row {number}, more than max_length={self.max_length}."
                )
            rows.append(row)
        left = sum(len(slots) for slots in positions.values())
        if left:
            raise ValueError(
                f"select_samples_to_pack left {left} of the {len(samples)} samples out of every row; every sample "
                "must be in exactly one row (nothing may be dropped)."
            )
        return rows

    def _plan_round(self, state: _PassState) -> None:
        """Pack the buffer, queue the rows to emit, keep the held-back samples in the buffer."""
        rows = self._select_rows(state)
        lengths, born, round_index = state.lengths, state.born, state.round
        fills = [sum([lengths[i] for i in row]) for row in rows]
        emit = [True] * len(rows)
        holding = not state.exhausted and self.full_row_fill > 0 and self.max_hold_rounds > 0
        if holding:
            full = math.ceil(self.full_row_fill * self.max_length - 1e-9)
            oldest_allowed = round_index - self.max_hold_rounds
            held, held_samples = [], 0
            for number, row in enumerate(rows):
                if fills[number] >= full:
                    continue
                oldest = min([born[i] for i in row])
                if oldest > oldest_allowed:
                    emit[number] = False
                    held.append((-fills[number], oldest, number))
                    held_samples += len(row)
            # Never let held-back samples fill more than half the buffer: release the fullest (then oldest) rows.
            if held_samples > self.buffer_size // 2:
                for _, _, number in sorted(held):
                    emit[number] = True
                    held_samples -= len(rows[number])
                    if held_samples <= self.buffer_size // 2:
                        break
        emitted = [number for number, flag in enumerate(emit) if flag]
        if self.seed is not None and len(emitted) > 1:
            order = np.random.default_rng([self.seed, state.epoch, round_index]).permutation(len(emitted))
            emitted = [emitted[i] for i in order.tolist()]
        samples = state.samples
        state.pending.extend((fills[number], [samples[i] for i in rows[number]]) for number in emitted)
        if len(emitted) < len(rows):
            keep = sorted(i for row, flag in zip(rows, emit) if not flag for i in row)
            state.stats["held_back"] += len(keep)
            state.samples = [samples[i] for i in keep]
            state.lengths = [lengths[i] for i in keep]
            state.born = [born[i] for i in keep]
        else:
            state.samples, state.lengths, state.born = [], [], []
        state.round = round_index + 1

    def _log_overflow(self, state: _PassState) -> None:
        stats = state.stats
        log_overflow(logger, "truncate", stats["truncated"], self.max_length, tokens=stats["truncated_tokens"])
        log_overflow(logger, "split", stats["split"], self.max_length, chunks=stats["split_chunks"])
