"""Dataset-level preparation the trainer calls, like TRL's ``trl/data_utils.py``: truncate and pack a tokenized
dataset.

Stage 2 of the data path (prepare: tokenized rows -> truncated or packed rows with ``seq_lengths``); it calls the
packers of stage 3 ([`unpack_trainer.data.packing`], [`unpack_trainer.data.streaming`]). The walk of a training set
through ``SFTTrainer`` with ``packing=True``::

    trainers/sft.py ──► preparation.truncate_dataset       long samples truncated (or split), counted
                    ──► preparation.pack_dataset           map-style: global bin packing        (packing.py)
                        preparation.pack_iterable_dataset  streamed: packed on the fly          (streaming.py)
                    ──► sampler.py                         which rows each step takes
                    ──► collator.py                        one packed batch per step

- [`truncate_dataset`]: enforce ``max_length`` on ``input_ids`` / ``labels`` and drop the samples with no trained
  token, with counts (a map-style dataset or a stream).
- [`pack_dataset`]: a map-style dataset into rows of ``max_length`` tokens with the global packer of ``packing.py``;
  each row holds its samples' tokens side by side and their lengths in ``seq_lengths``.
- [`pack_iterable_dataset`]: a stream into such rows, on the fly, with
  [`~unpack_trainer.data.streaming.StreamingPacker`].
- [`split_packed_rows`] / [`check_packed_rows`]: datasets whose rows were packed ahead (a ``seq_lengths`` column).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

from unpack_trainer._compat import stream_format_type
from unpack_trainer._logging import log_once
from unpack_trainer.data.packing import best_fit_decreasing, shuffled_best_fit, split_rows, windowed_packing
from unpack_trainer.data.streaming import StreamingPacker
from unpack_trainer.data.validation import Overflow, check_positive_int, check_seq_lengths
from unpack_trainer.packed_seq_info import SEQ_LENGTHS_COLUMN

__all__ = [
    "TruncationCounts",
    "check_packed_rows",
    "column_names",
    "pack_dataset",
    "pack_iterable_dataset",
    "packed_rows",
    "sample_lengths",
    "samples_per_row",
    "split_packed_rows",
    "truncate_dataset",
]

logger = logging.getLogger(__name__)

_ORDERS = ("windowed", "shuffled", "decreasing")


# --------------------------------------------------------------------------------------------------------------------
# Reading a dataset
# --------------------------------------------------------------------------------------------------------------------


def column_names(dataset: Any) -> list[str]:
    """The columns of ``dataset``; for an ``IterableDataset`` with unknown features, the keys of its first example."""
    names = getattr(dataset, "column_names", None)
    if names is None and dataset is not None:  # an IterableDataset with unknown features: peek at one example
        names = list(next(iter(dataset), {}).keys())
    return list(names or [])


def sample_lengths(dataset: Dataset, packed_ahead: bool = False) -> np.ndarray:
    """``(num_samples,)`` int64 sample lengths: of each row (``input_ids``), or with ``packed_ahead`` of each sample
    of the rows packed ahead (``seq_lengths`` flattened, row-major)."""
    table = dataset.with_format("arrow")[:]
    if packed_ahead:
        return pc.list_flatten(table[SEQ_LENGTHS_COLUMN]).to_numpy(zero_copy_only=False).astype(np.int64)
    return pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)


def samples_per_row(dataset: Dataset) -> np.ndarray:
    """``(num_rows,)`` int64 number of samples in each row of a packed dataset (the lengths of its ``seq_lengths``)."""
    table = dataset.with_format("arrow")[:]
    return pc.list_value_length(table[SEQ_LENGTHS_COLUMN]).to_numpy(zero_copy_only=False).astype(np.int64)


def _trained_tokens(dataset: Dataset) -> np.ndarray:
    """``(num_samples,)`` int64 number of labels other than -100 in each sample."""
    labels = dataset.with_format("arrow")[:]["labels"]
    lengths = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
    trained = pc.not_equal(pc.list_flatten(labels), -100).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(lengths)
    totals = np.concatenate(([0], np.cumsum(trained)))
    return totals[ends] - totals[ends - lengths]


# --------------------------------------------------------------------------------------------------------------------
# Rows packed ahead (a `seq_lengths` column)
# --------------------------------------------------------------------------------------------------------------------


def split_packed_rows(dataset: Dataset | IterableDataset, name: str) -> Dataset | IterableDataset:
    """Rows packed ahead (a ``seq_lengths`` column) -> one row per sample, cut at the boundaries ``seq_lengths`` gives.

    Every per-token column (a list as long as ``input_ids``) is cut; other columns are repeated for each sample.
    ``ValueError`` naming the row when its ``seq_lengths`` are not positive integers summing to its length
    ([`check_seq_lengths`], the collator's check).
    """
    columns = column_names(dataset)
    log_once(
        logger,
        logging.INFO,
        f"{name} dataset has a `seq_lengths` column (rows packed ahead): each row is split into its samples at those "
        "boundaries, so no sample attends to another.",
    )
    counter = {"row": 0}

    def split(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {column: [] for column in columns if column != SEQ_LENGTHS_COLUMN}
        for index, lengths in enumerate(batch[SEQ_LENGTHS_COLUMN]):
            row = counter["row"]
            counter["row"] += 1
            ids = batch["input_ids"][index]
            lengths = check_seq_lengths(lengths, len(ids), row, f"{name} dataset row {{index}}")
            starts = np.concatenate(([0], np.cumsum(lengths)))
            for column in out:
                value = batch[column][index]
                per_token = isinstance(value, (list, tuple)) and len(value) == len(ids)
                for start, end in zip(starts[:-1], starts[1:]):
                    out[column].append(value[start:end] if per_token else value)
        return out

    return dataset.map(split, batched=True, remove_columns=columns)


def check_packed_rows(dataset: Dataset | IterableDataset, max_length: int, name: str) -> Dataset | IterableDataset:
    """Rows packed ahead are kept whole in padding-free mode: one longer than ``max_length`` is an error naming it."""
    counter = {"row": 0}

    def check(example: dict[str, Any]) -> bool:
        row = counter["row"]
        counter["row"] += 1
        if len(example["input_ids"]) > max_length:
            raise ValueError(
                f"{name} dataset row {row} is a row packed ahead (`seq_lengths` column) of {len(example['input_ids'])} "
                f"tokens, longer than max_length={max_length}; rows packed ahead are never cut. Raise max_length, "
                "set packing=True to pack its samples anew, or set max_length=None."
            )
        return any(label != -100 for label in example["labels"])

    return dataset.filter(check)


# --------------------------------------------------------------------------------------------------------------------
# max_length
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class TruncationCounts:
    """What ``max_length`` did to one dataset: counted up front for a map-style dataset, as it is read for a stream."""

    name: str
    max_length: int
    truncation_mode: str
    split: bool
    read: int = 0
    over: int = 0
    cut_tokens: int = 0
    masked_from_start: int = 0
    masked_after_truncation: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.over or self.masked_from_start or self.masked_after_truncation)

    def summary(self) -> str:
        action = "split into chunks of max_length" if self.split else f"truncated ({self.truncation_mode})"
        text = (
            f"{self.name} dataset (streamed): {self.over} of {self.read} samples read were longer than "
            f"max_length={self.max_length} and were {action}"
        )
        if not self.split:
            text += f", dropping {self.cut_tokens:,} tokens"
        if self.masked_from_start:
            text += f"; {self.masked_from_start} sample(s) with every label masked were dropped"
        if self.masked_after_truncation:
            text += f"; {self.masked_after_truncation} sample(s) with no trained token left after truncation dropped"
        return text + "."


def truncate_dataset(
    dataset: Any,
    max_length: int,
    map_kwargs: dict[str, Any] | None = None,
    *,
    truncation_mode: str | None = None,
    split: bool | None = None,
    name: str | None = None,
) -> Any:
    """Truncate the samples of a tokenized dataset to ``max_length`` tokens: TRL's ``truncate_dataset`` when called
    as TRL calls it, the trainer's counted truncation when called with any of its options.

    **TRL's call**, ``truncate_dataset(dataset, max_length, map_kwargs=None)`` (``trl.experimental.utils``): every
    list column is cut to its first ``max_length`` items; the other columns, the row count and the dataset's format
    (``with_format``: numpy, torch, ...) are kept; a ``Dataset``, ``IterableDataset`` or a dict of them is returned.
    Unlike TRL's, the number of samples cut is logged once (map-style datasets; streams: once, when the first is).

    **The trainer's call**, with ``truncation_mode``, ``split`` or ``name``: truncate (or, with ``split``, cut into
    chunks) samples longer than ``max_length`` exactly as TRL's padded path truncates, then drop the samples without
    any trained token (every label ``-100``), as padded training does, and return ``(dataset, counts)``. Every count
    is logged (once, ``name`` naming the dataset): up front for a map-style dataset; for a stream, the first
    truncation when it is read, the totals accumulating in the returned counts as it is read (the trainer logs them
    at the end of training).

    Args:
        dataset: a tokenized ``datasets.Dataset`` or ``IterableDataset``. TRL's call: any list columns (and a
            ``DatasetDict`` / ``IterableDatasetDict``). The trainer's call: ``input_ids`` and ``labels`` (lists of
            integer ids, of equal length in each sample); other columns are removed.
        max_length: the most tokens a sample keeps.
        map_kwargs: keyword arguments for ``dataset.map`` (``num_proc``, ``desc``, ``batch_size``, ...).
        truncation_mode: ``"keep_start"`` (default) keeps a long sample's first ``max_length`` tokens, ``"keep_end"``
            its last ones (``SFTConfig.truncation_mode``).
        split: cut a long sample into consecutive chunks of ``max_length`` tokens (the last one shorter) instead of
            truncating it (``packing_strategy="bfd_split"``); each chunk is a sample of its own.
        name: the dataset's name in the log lines and errors (default ``"train"``).

    Returns:
        TRL's call: the truncated dataset. The trainer's call: ``(dataset, counts)``, the dataset with ``input_ids``
        and ``labels`` only and its [`TruncationCounts`] (complete for a map-style dataset; filled as a stream is
        read).

    Raises:
        ValueError: ``max_length`` is not a positive integer, an unknown ``truncation_mode``, or (the trainer's call)
            a map-style dataset with no sample left (the message gives the counts).

    Example:
        >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6], [7, 8, 9]],
        ...                         "labels": [[-100, 2, 3, 4], [-100, -100], [-100, -100, 9]]})
        >>> truncate_dataset(ds, 2)[:]   # TRL's call: every list column cut, nothing dropped
        {'input_ids': [[1, 2], [5, 6], [7, 8]], 'labels': [[-100, 2], [-100, -100], [-100, -100]]}
        >>> truncated, counts = truncate_dataset(ds, 2, name="train")   # the trainer's: [5, 6], [7, 8] untrained
        >>> truncated[:]
        {'input_ids': [[1, 2]], 'labels': [[-100, 2]]}
        >>> counts.over, counts.cut_tokens, counts.masked_from_start, counts.masked_after_truncation
        (2, 3, 1, 1)
    """
    if truncation_mode is None and split is None and name is None:
        return _truncate_list_columns(dataset, max_length, map_kwargs or {})
    return _truncate_and_count(
        dataset,
        max_length,
        map_kwargs or {},
        truncation_mode=truncation_mode or "keep_start",
        split=bool(split),
        name=name or "train",
    )


def _dataset_format(dataset: Any) -> dict[str, Any]:
    """The ``with_format`` arguments that restore ``dataset``'s format (TRL's ``_get_dataset_format``): a map-style
    dataset's ``format`` flattened; a stream's format type (``IterableDataset._formatting``)."""
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        dataset = dataset[next(iter(dataset))]
    if isinstance(dataset, Dataset):
        format = dict(dataset.format)
    else:
        format = {"type": stream_format_type(dataset)}
    format.update(format.pop("format_kwargs", None) or {})
    return format


def _is_list(data_type: pa.DataType) -> bool:
    return pa.types.is_list(data_type) or pa.types.is_large_list(data_type)


def _truncate_list_columns(dataset: Any, max_length: int, map_kwargs: dict[str, Any]) -> Any:
    """TRL's ``truncate_dataset``: every list column cut to ``max_length`` items, the format kept; the count logged."""
    max_length = check_positive_int(max_length, "max_length")
    format = _dataset_format(dataset)
    if isinstance(dataset, Dataset):
        table = dataset.with_format("arrow")[:]
        lists = [column for column in table.column_names if _is_list(table.schema.field(column).type)]
        if lists:
            lengths = pc.list_value_length(table[lists[0]]).to_numpy(zero_copy_only=False)
            over = lengths > max_length
            if over.any():
                log_once(
                    logger,
                    logging.WARNING,
                    f"truncate_dataset: {int(over.sum())} of {lengths.size} samples are longer than "
                    f"max_length={max_length} and were truncated, dropping {int((lengths[over] - max_length).sum()):,} "
                    f"tokens of {lists[0]!r}.",
                )

    def truncate(batch: pa.Table) -> pa.Table:
        columns = []
        for column in batch.columns:
            if _is_list(column.type):
                if (
                    not isinstance(dataset, Dataset)
                    and pc.any(pc.greater(pc.list_value_length(column), max_length)).as_py()
                ):
                    log_once(
                        logger,
                        logging.WARNING,
                        f"truncate_dataset: samples longer than max_length={max_length} are truncated as they are read.",
                    )
                column = pc.list_slice(column, 0, max_length)
            columns.append(column)
        return pa.Table.from_arrays(columns, names=batch.column_names)

    truncated = dataset.with_format("arrow").map(truncate, batched=True, **map_kwargs)
    return truncated.with_format(**format)


def _truncate_and_count(
    dataset: Dataset | IterableDataset,
    max_length: int,
    map_kwargs: dict[str, Any],
    *,
    truncation_mode: str,
    split: bool,
    name: str,
) -> tuple[Dataset | IterableDataset, TruncationCounts]:
    """The trainer's call of [`truncate_dataset`]: truncate or split, drop what has no trained token, count."""
    check_positive_int(max_length, "max_length")
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"Unsupported truncation mode: {truncation_mode}, expected 'keep_start' or 'keep_end'")
    counts = TruncationCounts(name, max_length, truncation_mode, split)
    action = "split into chunks of max_length" if split else f"truncated ({truncation_mode})"
    streamed = not isinstance(dataset, Dataset)
    if not streamed:
        lengths = sample_lengths(dataset)
        over = lengths > max_length
        counts.read = int(lengths.size)
        counts.over = int(over.sum())
        counts.cut_tokens = int((lengths[over] - max_length).sum())
        counts.masked_from_start = int((_trained_tokens(dataset) == 0).sum()) if lengths.size else 0
        if over.any():
            log_once(
                logger,
                logging.WARNING,
                f"{name} dataset: {counts.over} of {lengths.size} samples are longer than max_length={max_length} and "
                f"were {action}" + ("" if split else f", dropping {counts.cut_tokens:,} tokens") + ".",
            )
    columns = ["input_ids", "labels"]

    def truncate(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {column: [] for column in columns}
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            if streamed:
                counts.read += 1
                if len(ids) > max_length:
                    counts.over += 1
                    counts.cut_tokens += len(ids) - max_length
                    log_once(
                        logger,
                        logging.WARNING,
                        f"{name} dataset (streamed): samples longer than max_length={max_length} are {action} as "
                        "they are read; the totals are logged at the end of training and kept in "
                        "trainer.unpack_stats['truncation'].",
                    )
                if not any(label != -100 for label in labels):
                    # dropped here, so that the filter below counts only the samples truncation left untrained
                    counts.masked_from_start += 1
                    continue
            if split:
                for start in range(0, len(ids), max_length):
                    out["input_ids"].append(ids[start : start + max_length])
                    out["labels"].append(labels[start : start + max_length])
            else:
                window = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
                out["input_ids"].append(ids[window])
                out["labels"].append(labels[window])
        return out

    def trained(example: dict[str, Any]) -> bool:
        keep = any(label != -100 for label in example["labels"])
        if streamed and not keep:
            counts.masked_after_truncation += 1
        return keep

    remove = [c for c in (dataset.column_names or []) if c not in columns]
    dataset = dataset.map(truncate, batched=True, remove_columns=remove or None, **map_kwargs)
    if streamed:
        return dataset.filter(trained), counts
    before = len(dataset)
    dataset = dataset.filter(trained)
    counts.masked_after_truncation = before - len(dataset) - counts.masked_from_start
    if counts.masked_from_start:
        log_once(
            logger,
            logging.WARNING,
            f"{name} dataset: dropped {counts.masked_from_start} sample(s) whose labels are all masked (-100): they "
            "have no trained token (as padded training does).",
        )
    if counts.masked_after_truncation:
        log_once(
            logger,
            logging.WARNING,
            f"{name} dataset: dropped {counts.masked_after_truncation} sample(s) with no trained token left after "
            f"truncation to max_length={max_length} (as padded training does).",
        )
    if len(dataset) == 0:
        raise ValueError(
            f"{name} dataset: every sample was dropped ({counts.read} samples: {counts.masked_from_start} with every "
            f"label masked, {counts.masked_after_truncation} with no trained token left after truncation to "
            f"max_length={max_length}; {counts.over} longer than max_length). Raise max_length, use "
            "truncation_mode='keep_end', or check the labels."
        )
    return dataset, counts


# --------------------------------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------------------------------


_STRATEGIES = ("bfd", "bfd_split", "wrapped")


def pack_dataset(
    dataset: Any,
    seq_length: int | None = None,
    strategy: str | None = None,
    map_kwargs: dict[str, Any] | None = None,
    *,
    max_length: int | None = None,
    seed: int | None = None,
    order: str = "decreasing",
    max_samples_per_row: int | None = None,
    window: int | None = None,
    rows_multiple_of: int = 1,
) -> Any:
    """Pack a tokenized dataset into rows of at most ``seq_length`` tokens; a drop-in for TRL's ``pack_dataset``.

    A map-style dataset is packed with a global packer: unlike TRL's ``pack_dataset`` (best-fit decreasing over
    windows of 1,000 rows, one ``dataset.map`` batch each), the packer sees every sample at once
    ([`~unpack_trainer.data.packing.best_fit_decreasing`], [`~unpack_trainer.data.packing.shuffled_best_fit`] or
    [`~unpack_trainer.data.packing.windowed_best_fit`]). A stream (``IterableDataset``) is packed as TRL packs it, one
    ``map`` batch at a time, with the same packer. A sample is never cut across rows: each goes whole into one row,
    and ``seq_lengths`` keeps the boundaries, so the packed collator can keep every sample apart (positions restarting
    at 0, no attention across samples, no label across a boundary).

    TRL's call, ``pack_dataset(dataset, seq_length, strategy="bfd", map_kwargs=None)``, is accepted: ``strategy``
    ``"bfd"`` truncates samples longer than ``seq_length``, ``"bfd_split"`` cuts them into chunks of ``seq_length``
    (the last shorter), both drop empty samples, and ``"wrapped"`` concatenates and cuts rows at ``seq_length``
    regardless of sample boundaries (no ``seq_lengths``; as TRL, per ``map`` batch). The dataset's format
    (``with_format``: numpy, torch, ...) is kept, with ``seq_lengths`` added to its columns. Where ours differs from
    TRL's, deliberately:

    - without ``strategy`` (ours), a sample longer than ``seq_length`` or empty is an error naming it, not cut or
      dropped; with ``"bfd"`` / ``"bfd_split"`` what is cut or dropped is logged once (TRL says nothing);
    - the samples in a row are in dataset order (TRL: longest first), e.g. ``[6, 7, 5, 12]`` in TRL is
      ``[5, 6, 7, 12]`` here; the rows themselves hold the same samples;
    - a map-style dataset is packed globally (fewer rows, samples from anywhere in the dataset share a row);
      ``map_kwargs`` then has no ``map`` to go to and is only used for streams and ``"wrapped"`` (logged once);
    - columns that are not per-token lists (e.g. a ``source`` string) are dropped with a warning (TRL raises), and
      the packed list columns are ``large_list``, ``seq_lengths`` ``large_list<int64>`` (TRL: ``list<int32>``).

    Args:
        dataset: a ``datasets.Dataset`` or ``IterableDataset`` (or a dict of them) with ``input_ids`` (lists of token
            ids; without ``strategy`` every sample 1 to ``seq_length`` tokens: truncate first, e.g. with
            [`truncate_dataset`]) and optionally other per-token columns (a list as long as ``input_ids`` in every
            row: ``labels``, ``completion_mask``, ...), concatenated the same way. With a ``strategy`` and no
            ``input_ids`` column, the first column gives the lengths, as in TRL. Rows packed ahead (a ``seq_lengths``
            column) are rejected: split them first ([`split_packed_rows`]).
        seq_length: tokens per row (TRL's name; ``max_length`` is the same, by keyword).
        strategy: ``None`` (ours: every sample must fit), or TRL's ``"bfd"``, ``"bfd_split"`` or ``"wrapped"``.
        map_kwargs: keyword arguments for ``dataset.map`` where packing runs through it (streams, ``"wrapped"``).
        max_length: ``seq_length`` by its other name.
        seed: the rows come out in an order shuffled with this seed; with ``order="shuffled"`` or ``"windowed"`` it
            also seeds which samples share a row (required then). ``None``: best-fit decreasing's creation order
            (fullest rows, holding the longest samples, first).
        order: which samples share a row. ``"decreasing"``: best-fit decreasing (fewest rows; a row holds samples of
            similar rank: a long one topped up with short ones). ``"shuffled"``: samples placed in a seeded random
            order with best fit, rows as full as best-fit decreasing (at least 99.5% full), lengths mixed at random.
            ``"windowed"``: samples taken in a seeded random order, each into the best-fitting of the last few open
            rows, so a row holds samples that follow each other in that order, as a random batch would; the window
            widens only as far as needed for at most 1% more rows than best-fit decreasing
            ([`~unpack_trainer.data.packing.windowed_packing`]; the choice is logged once); what `SFTTrainer` uses by
            default (`SFTConfig.packing_order`).
        max_samples_per_row: the most samples a row may hold (rows close once they reach it, so they may be less
            full); implies the shuffled packer. ``None``: no bound.
        rows_multiple_of: split rows of several samples ([`~unpack_trainer.data.packing.split_rows`]) until the number
            of rows is a multiple of this (the trainer passes ``per_device_train_batch_size * world_size`` with
            several processes, so that none gets a row twice to even out the last batches).
        window: with ``order="windowed"``, a fixed number of open rows (no bound on the rows then); ``None``: chosen
            from the lengths as above.

    Returns:
        The same kind of dataset, of rows: every per-token column, each row's samples concatenated, and
        ``seq_lengths``: the lengths of the row's samples, summing to ``len(input_ids)`` (not with ``"wrapped"``).

    Raises:
        ValueError: no ``seq_length`` (or both names), ``seq_length`` is not a positive integer, an unknown
            ``strategy``, without a ``strategy`` a sample that is empty or longer than ``seq_length`` (the message
            names it), an unknown ``order``, ``"shuffled"`` or ``"windowed"`` without a ``seed``,
            ``max_samples_per_row`` with ``"windowed"``, ``window`` without it, no ``input_ids`` column (without a ``strategy``), or a
            ``seq_lengths`` column.

    Example:
        >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
        ...                         "labels": [[-100, 2, 3], [-100, 5], [-100, 7, 8, 9], [-100]]})
        >>> packed = pack_dataset(ds, 5)   # lengths [3, 2, 4, 1] -> rows [[2, 3], [0, 1]]
        >>> packed[:2]["input_ids"], packed[:2]["seq_lengths"]
        ([[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]], [[4, 1], [3, 2]])
        >>> packed[:2]["labels"]
        [[-100, 7, 8, 9, -100], [-100, 2, 3, -100, 5]]
        >>> pack_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8]]}), 4, "bfd")[:]["input_ids"]
        [[1, 2, 3, 4], [6, 7, 8]]
    """
    if seq_length is not None and max_length is not None:
        raise ValueError("pack_dataset got both `seq_length` and `max_length`; they are one value: give one.")
    seq_length = check_positive_int(seq_length if max_length is None else max_length, "max_length")
    if strategy is not None and strategy not in _STRATEGIES:
        raise ValueError(f"Invalid packing strategy {strategy!r}, must be one of {_STRATEGIES} (or None).")
    if order not in _ORDERS:
        raise ValueError(f"Unknown packing order {order!r}; use one of {_ORDERS}.")
    if max_samples_per_row is not None and order == "windowed":
        raise ValueError("`max_samples_per_row` needs `order='shuffled'`; the windowed packer has no bound.")
    if window is not None and order != "windowed":
        raise ValueError(f"`window` needs `order='windowed'`; got order={order!r}.")
    if (order in ("shuffled", "windowed") or max_samples_per_row is not None) and seed is None:
        raise ValueError(
            f"`order={order!r}` (or `max_samples_per_row`) needs a `seed`: it decides which samples share a row."
        )
    map_kwargs = dict(map_kwargs or {})
    format = _dataset_format(dataset)
    pack = functools.partial(
        _pack_table,
        seq_length=seq_length,
        strategy=strategy,
        seed=seed,
        order=order,
        max_samples_per_row=max_samples_per_row,
        window=window,
        rows_multiple_of=rows_multiple_of,
    )
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        return type(dataset)(
            {
                split: pack_dataset(
                    part,
                    seq_length,
                    strategy,
                    map_kwargs,
                    seed=seed,
                    order=order,
                    max_samples_per_row=max_samples_per_row,
                    window=window,
                    rows_multiple_of=rows_multiple_of,
                )
                for split, part in dataset.items()
            }
        )
    if isinstance(dataset, Dataset) and strategy != "wrapped":
        if map_kwargs:
            log_once(
                logger,
                logging.WARNING,
                f"pack_dataset: map_kwargs {sorted(map_kwargs)} not used: a map-style dataset is packed globally, in "
                "one pass, not with dataset.map.",
            )
        packed = Dataset(pack(dataset.with_format("arrow")[:]))
    else:
        packed = dataset.with_format("arrow").map(pack, batched=True, **map_kwargs)
    if isinstance(packed, Dataset) and format.get("columns") is not None:
        names = packed.column_names
        format["columns"] = [name for name in format["columns"] if name in names] + [
            name for name in (SEQ_LENGTHS_COLUMN,) if name in names and name not in format["columns"]
        ]
    return packed.with_format(**format)


def _pack_table(
    table: pa.Table,
    *,
    seq_length: int,
    strategy: str | None,
    seed: int | None,
    order: str,
    max_samples_per_row: int | None,
    window: int | None,
    rows_multiple_of: int,
) -> pa.Table:
    """[`pack_dataset`] on one Arrow table (the whole map-style dataset, or one ``map`` batch of a stream)."""
    if SEQ_LENGTHS_COLUMN in table.column_names or not table.column_names:
        raise ValueError(
            f"pack_dataset needs an `input_ids` column and no `seq_lengths` column (rows packed ahead: split them "
            f"first with split_packed_rows); got the columns {table.column_names}."
        )
    key = "input_ids" if "input_ids" in table.column_names or strategy is None else table.column_names[0]
    if key not in table.column_names or not _is_list(table.schema.field(key).type):
        raise ValueError(
            f"pack_dataset needs an `input_ids` column of token lists; got the columns {table.column_names}."
        )
    if strategy == "wrapped":
        return _wrap_table(table, seq_length)
    lengths = pc.list_value_length(table[key]).to_numpy(zero_copy_only=False).astype(np.int64)
    names = _token_columns(table, lengths, key)
    dropped = [name for name in table.column_names if name not in names]
    if dropped:
        log_once(
            logger,
            logging.WARNING,
            f"pack_dataset: the column(s) {dropped} are not per-token lists (as long as {key!r} in every row) and "
            "are not in the packed rows.",
        )
    table = table.select(names)
    if strategy is not None:
        table, lengths = _fit_samples(table, lengths, seq_length, split=strategy == "bfd_split")
    rows = packed_rows(
        lengths,
        seq_length,
        seed=seed,
        order=order,
        max_samples_per_row=max_samples_per_row,
        window=window,
        rows_multiple_of=rows_multiple_of,
    )
    sample_order = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=lengths.size)
    row_sizes = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    sample_offsets = np.concatenate(([0], np.cumsum(row_sizes)))
    token_ends = np.concatenate(([0], np.cumsum(lengths[sample_order])))
    row_offsets = pa.array(token_ends[sample_offsets], pa.int64())

    def regroup(column: pa.ChunkedArray) -> pa.Array:
        values = pc.list_flatten(column.take(pa.array(sample_order)))
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        return pa.LargeListArray.from_arrays(row_offsets, values)

    columns = {name: regroup(table[name]) for name in names}
    columns[SEQ_LENGTHS_COLUMN] = pa.LargeListArray.from_arrays(
        pa.array(sample_offsets, pa.int64()), pa.array(lengths[sample_order], pa.int64())
    )
    return pa.table(columns)


def packed_rows(
    lengths: np.ndarray,
    seq_length: int,
    *,
    seed: int | None,
    order: str,
    max_samples_per_row: int | None = None,
    window: int | None = None,
    rows_multiple_of: int = 1,
) -> list[list[int]]:
    """Which samples share a row, as [`pack_dataset`] decides it (its arguments of the same names): the sample indices
    of each row. ``lengths``: ``(num_samples,)`` int64, each 1 to ``seq_length``."""
    if order == "windowed" and max_samples_per_row is None:
        packing = windowed_packing(lengths, seq_length, seed=seed, window=window)
        log_once(
            logger, logging.INFO, f"Packing {lengths.size:,} samples into rows of {seq_length}: {packing.describe()}."
        )
        rows = packing.rows
    elif order == "shuffled" or max_samples_per_row is not None:
        rows = shuffled_best_fit(lengths, seq_length, seed=seed, max_samples_per_row=max_samples_per_row)
    else:
        rows = best_fit_decreasing(lengths, seq_length, seed=seed)
    if rows_multiple_of > 1:
        rows = split_rows(rows, rows_multiple_of)
        if len(rows) % rows_multiple_of:
            log_once(
                logger,
                logging.WARNING,
                f"{len(rows)} packed rows cannot be split into a multiple of {rows_multiple_of} rows (too few "
                "samples): the data loader repeats rows to even out the last batches across processes.",
            )
    return rows


def _fit_samples(table: pa.Table, lengths: np.ndarray, seq_length: int, *, split: bool) -> tuple[pa.Table, np.ndarray]:
    """TRL's ``"bfd"`` / ``"bfd_split"`` preparation, logged: empty samples dropped, longer ones truncated (keep the
    start) or cut into chunks of ``seq_length`` (the last shorter). Returns the table and its new lengths."""
    empty = lengths == 0
    if empty.any():
        log_once(
            logger,
            logging.WARNING,
            f"pack_dataset: {int(empty.sum())} empty sample(s) dropped (strategy={'bfd_split' if split else 'bfd'!r}).",
        )
        table, lengths = table.filter(pa.array(~empty)), lengths[~empty]
    over = lengths > seq_length
    if not over.any():
        return table, lengths
    strategy = "bfd_split" if split else "bfd"
    action = "split into chunks of seq_length" if split else "truncated"
    cut = "" if split else f", dropping {int((lengths[over] - seq_length).sum()):,} token(s)"
    log_once(
        logger,
        logging.WARNING,
        f"pack_dataset: {int(over.sum())} of {lengths.size} samples are longer than seq_length={seq_length} and "
        f"were {action} (strategy={strategy!r}){cut}.",
    )
    if not split:
        columns = [pc.list_slice(table[name], 0, seq_length) for name in table.column_names]
        return pa.table(dict(zip(table.column_names, columns))), np.minimum(lengths, seq_length)
    pieces = -(-lengths // seq_length)  # chunks per sample
    sample = np.repeat(np.arange(lengths.size), pieces)
    first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    start = (np.arange(sample.size) - first[sample]) * seq_length
    chunk_lengths = np.minimum(lengths[sample] - start, seq_length)
    offsets = np.concatenate(([0], np.cumsum(chunk_lengths)))
    columns = {}
    for name in table.column_names:
        values = pc.list_flatten(table[name])
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        columns[name] = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)
    return pa.table(columns), chunk_lengths.astype(np.int64)


def _wrap_table(table: pa.Table, seq_length: int) -> pa.Table:
    """TRL's ``"wrapped"`` strategy: every column's tokens concatenated and cut into rows of ``seq_length``."""
    columns = {}
    for name in table.column_names:
        if not _is_list(table.schema.field(name).type):
            raise TypeError(f"pack_dataset(strategy='wrapped') needs every column to be lists; {name!r} is not.")
        values = pc.list_flatten(table[name])
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        offsets = np.append(np.arange(0, len(values), seq_length), len(values))
        columns[name] = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)
    return pa.table(columns)


def _token_columns(table: pa.Table, lengths: np.ndarray, key: str = "input_ids") -> list[str]:
    """``key`` and the other list columns of ``table`` as long as it in every row (``lengths``)."""
    names = [key]
    for name in table.column_names:
        if name == key or not _is_list(table.schema.field(name).type):
            continue
        column_lengths = pc.list_value_length(table[name]).to_numpy(zero_copy_only=False)
        if np.array_equal(column_lengths, lengths):
            names.append(name)
    return names


def pack_iterable_dataset(
    dataset: Iterable[Mapping[str, Any]],
    max_length: int,
    *,
    buffer_size: int = 10_000,
    seed: int | None = None,
    overflow: Overflow = "error",
    **kwargs: Any,
) -> StreamingPacker:
    """Pack a streamed data set of tokenized samples for training: what ``SFTTrainer`` does with an
    ``IterableDataset`` and ``packing=True``.

    Args:
        dataset: a ``datasets.IterableDataset`` (or any iterable) of dicts with ``input_ids`` and optionally
            ``labels`` / ``completion_mask`` / ``assistant_masks``.
        max_length: tokens per row.
        buffer_size: ``SFTConfig.packing_buffer_size``.
        seed: shuffles the rows of each round (``None``: no shuffle).
        overflow: ``"error"``, ``"truncate"`` or ``"split"``, as in [`StreamingPacker`].
        **kwargs: the other [`StreamingPacker`] options.

    Returns:
        A ``torch.utils.data.IterableDataset`` of rows with ``input_ids``, ``seq_lengths`` and the samples' other
        token fields, with ``state_dict`` / ``load_state_dict`` / ``set_epoch``.
    """
    return StreamingPacker(dataset, max_length, buffer_size=buffer_size, seed=seed, overflow=overflow, **kwargs)
