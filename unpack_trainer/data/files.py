"""Reading local data files: JSON Lines (optionally gzipped), Parquet, Arrow, and ``Dataset.save_to_disk`` folders.

Stage 1 of the data path (read: files -> rows); next comes [`unpack_trainer.data.preparation`].

The one reader of the package, used by [`unpack_trainer.data.streaming`] (through [`streaming_dataset_reader`]),
``unpack-trainer analyze``, ``unpack-trainer sft`` and the examples. One function per concern:

- [`file_format`]: a data file's format from its suffix (one suffix table for every reader);
- [`iter_json_lines`]: the objects of a JSON Lines file with their line numbers; a bad line is a ``ValueError``
  naming the file and the line;
- [`read_splits`] / [`choose_split`]: a file, a glob, a list of files or a ``save_to_disk`` folder as a
  ``DatasetDict`` (every split; streamed on request), and the split a command asked for;
- [`streaming_dataset_reader`]: JSONL / Parquet / Arrow files in batches of row dicts, a few batches in memory at a
  time, with ``state_dict`` / ``load_state_dict`` to resume mid-file.

Example::

    >>> from unpack_trainer import streaming_dataset_reader          # the public name; read_splits is the CLI's
    >>> from unpack_trainer.data.files import read_splits
    >>> splits = read_splits("data/train.jsonl.gz")                    # doctest: +SKIP
    >>> for batch in streaming_dataset_reader("data/*.parquet", 512):   # doctest: +SKIP
    ...     texts = [row["text"] for row in batch]

Nothing here imports ``datasets``, ``pyarrow`` or ``torch`` before it is needed.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "FORMATS",
    "StreamingDatasetReader",
    "StreamingRows",
    "arrow_columns_and_rows",
    "choose_split",
    "count_json_lines",
    "file_format",
    "is_saved_dataset",
    "iter_json_lines",
    "iterable_splits",
    "load_saved",
    "open_text",
    "parse_json_line",
    "read_splits",
    "resolve_files",
    "streaming_dataset_reader",
]

PathLike = str | os.PathLike
Paths = PathLike | Sequence[PathLike]

FORMATS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".csv": "csv",
    ".txt": "text",
}
"""Data file suffix (after an optional ``.gz``) -> format, named as the ``datasets`` builder that reads it."""

_SUFFIXES = tuple(suffix + gz for suffix in FORMATS for gz in ("", ".gz"))  # what `datasets` reads
_STREAMED_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".arrow", ".feather", ".ipc")
"""What [`StreamingDatasetReader`] reads (gzip: JSON Lines only)."""


def file_format(path: PathLike) -> str | None:
    """The format of a data file from its suffix (``.gz`` stripped): ``"json"``, ``"parquet"``, ``"arrow"``,
    ``"csv"``, ``"text"``, or ``None`` when the suffix is unknown.

    Example:
        >>> file_format("train.jsonl.gz"), file_format("part-0.parquet"), file_format("notes.md")
        ('json', 'parquet', None)
    """
    suffixes = [suffix.lower() for suffix in Path(path).suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return FORMATS.get(suffixes[-1]) if suffixes else None


def _is_gzip(path: PathLike) -> bool:
    return os.fspath(path).lower().endswith(".gz")


# --------------------------------------------------------------------------------------------------------------------
# JSON Lines
# --------------------------------------------------------------------------------------------------------------------


def open_text(path: PathLike) -> IO[str]:
    """``path`` opened for reading as UTF-8 text, decompressed if it ends with ``.gz``."""
    return gzip.open(path, "rt", encoding="utf-8") if _is_gzip(path) else open(path, encoding="utf-8")


def _numbered_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of every non-blank line, numbered from 1 with the blank lines counted."""
    with open_text(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                yield line_number, line


def parse_json_line(line: str, line_number: int, path: PathLike) -> dict:
    """One JSON Lines record; ``ValueError`` naming ``path`` and ``line_number`` if it is not one JSON object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{os.fspath(path)}, line {line_number}: not valid JSON ({error.msg}).") from None
    if not isinstance(record, dict):
        raise ValueError(
            f"{os.fspath(path)}, line {line_number}: expected one JSON object per line (JSON Lines), got "
            f"{type(record).__name__}. A file holding one JSON array cannot be streamed; convert it to JSON Lines."
        )
    return record


def iter_json_lines(path: PathLike, *, start: int = 0) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` of every record of a JSON Lines file (optionally ``.gz``) after the first ``start``.

    Blank lines are skipped (but counted in the line numbers); the skipped records are not parsed. A line that is not
    one JSON object raises ``ValueError("<path>, line <n>: ...")`` when it is reached.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        ...     _ = f.write('{"a": 1}\\n\\n{"a": 2}\\n')
        >>> list(iter_json_lines(f.name))
        [(1, {'a': 1}), (3, {'a': 2})]
    """
    for row, (line_number, line) in enumerate(_numbered_lines(path)):
        if row >= start:
            yield line_number, parse_json_line(line, line_number, path)


def count_json_lines(path: PathLike) -> int:
    """The number of records (non-blank lines) of a JSON Lines file, without parsing them."""
    return sum(1 for _ in _numbered_lines(path))


def _iter_jsonl(path: str, start: int, batch_size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for _, record in iter_json_lines(path, start=start):
        batch.append(record)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------------------------------------------------
# Parquet and Arrow
# --------------------------------------------------------------------------------------------------------------------


def _iter_record_batches(batches: Iterable, start: int, batch_size: int) -> Iterator[list[dict]]:
    """Re-cut pyarrow record batches into lists of ``batch_size`` rows, skipping the first ``start`` rows."""
    pending, pending_rows = [], 0
    for record_batch in batches:
        if start >= record_batch.num_rows:
            start -= record_batch.num_rows
            continue
        if start:
            record_batch, start = record_batch.slice(start), 0
        offset = 0
        while offset < record_batch.num_rows:
            take = min(batch_size - pending_rows, record_batch.num_rows - offset)
            pending.append(record_batch.slice(offset, take))
            pending_rows += take
            offset += take
            if pending_rows == batch_size:
                yield [row for part in pending for row in part.to_pylist()]
                pending, pending_rows = [], 0
    if pending_rows:
        yield [row for part in pending for row in part.to_pylist()]


def _iter_parquet(path: str, start: int, batch_size: int, columns: list[str] | None) -> Iterator[list[dict]]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as parquet:
        metadata = parquet.metadata
        first_group = 0
        while first_group < metadata.num_row_groups and start >= metadata.row_group(first_group).num_rows:
            start -= metadata.row_group(first_group).num_rows
            first_group += 1
        if first_group == metadata.num_row_groups:
            return
        groups = list(range(first_group, metadata.num_row_groups))
        batches = parquet.iter_batches(batch_size=batch_size, row_groups=groups, columns=columns)
        yield from _iter_record_batches(batches, start, batch_size)


def _arrow_batches(source) -> Iterable:
    """The record batches of an Arrow IPC file or stream (``datasets`` caches use the stream format)."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:  # not the IPC file format: the IPC stream format
        source.seek(0)
        return pa.ipc.open_stream(source)


def _iter_arrow(path: str, start: int, batch_size: int, columns: list[str] | None) -> Iterator[list[dict]]:
    import pyarrow as pa

    with pa.memory_map(path, "r") as source:
        batches = _arrow_batches(source)
        if columns is not None:
            batches = (batch.select(columns) for batch in batches)
        yield from _iter_record_batches(batches, start, batch_size)


def arrow_columns_and_rows(path: PathLike) -> tuple[list[str], int]:
    """The column names and the row count of a Parquet or Arrow file, from its metadata (Arrow: its batches' sizes).

    Raises:
        ValueError: the file is not a readable Parquet / Arrow file (the message names it).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = file_format(path)
    try:
        if kind == "parquet":
            parquet = pq.ParquetFile(path)
            return list(parquet.schema_arrow.names), parquet.metadata.num_rows
        with pa.memory_map(os.fspath(path), "r") as source:
            batches = list(_arrow_batches(source))
            names = list(batches[0].schema.names) if batches else []
            return names, sum(batch.num_rows for batch in batches)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a corrupt file
        text = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
        name = "Parquet" if kind == "parquet" else "Arrow"
        raise ValueError(f"{os.fspath(path)} is not a readable {name} file: {reason}") from None


# --------------------------------------------------------------------------------------------------------------------
# Batches of rows, resumable
# --------------------------------------------------------------------------------------------------------------------


def resolve_files(path: Paths, *, suffixes: Sequence[str] = _STREAMED_SUFFIXES) -> list[str]:
    """The data files named by a file, a directory (searched recursively, hidden files left out) or a glob pattern
    (``**`` allowed), or a list of those; sorted within each entry.

    Args:
        path: what names the files.
        suffixes: the accepted file name endings (default: what [`StreamingDatasetReader`] reads).

    Raises:
        FileNotFoundError: nothing exists at ``path`` and no file matches it as a pattern.
        ValueError: an empty path (``""``) or an empty list, a directory without any data file, or a file whose
            name ends with none of ``suffixes``.
    """
    entries = list(path) if isinstance(path, (list, tuple)) else [path]
    if not entries:
        raise ValueError("The list of data paths is empty; pass at least one file, directory or glob pattern.")
    for entry in entries:
        if not os.fspath(entry).strip():
            raise ValueError(
                f"A data path is empty ({os.fspath(entry)!r}); pass a file, a directory or a glob pattern."
            )
    if isinstance(path, (list, tuple)):
        return [file for entry in path for file in resolve_files(entry, suffixes=suffixes)]
    path = os.fspath(path)
    suffixes = tuple(suffixes)
    known = ", ".join(suffixes)
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(path)
            for name in names
            if name.lower().endswith(suffixes) and not name.startswith((".", "_"))
        )
        if not files:
            raise ValueError(f"No data file ({known}) found under {path!r}.")
        return files
    if os.path.isfile(path):
        if not path.lower().endswith(suffixes):
            raise ValueError(f"Cannot tell the format of {path!r}; use one of the suffixes {known}.")
        return [path]
    files = sorted(file for file in glob.glob(path, recursive=True) if os.path.isfile(file))
    if not files:
        raise FileNotFoundError(f"No file matches {path!r}.")
    unknown = [file for file in files if not file.lower().endswith(suffixes)]
    if unknown:
        raise ValueError(f"Cannot tell the format of {unknown[0]!r}; use one of the suffixes {known}.")
    return files


class StreamingDatasetReader:
    """JSONL / Parquet / Arrow files read in batches of rows, a few batches in memory at a time.

    Iterating yields lists of at most ``batch_size`` row dicts (a batch never spans two files); each iteration starts
    over from the first file. ``rows()`` gives the same data one row at a time. Both keep their position, so
    ``state_dict()`` / ``load_state_dict()`` resume without re-reading earlier files: Parquet skips whole row groups,
    Arrow whole record batches, JSONL skips lines without parsing them.

    Attributes:
        files: the files, in reading order (sorted paths).
        batch_size: rows per batch.
        columns: the columns read (``None``: all). Parquet and Arrow read only these; JSONL rows are filtered (a
            missing key reads as ``None``).
    """

    def __init__(self, files: Sequence[str], batch_size: int, columns: Sequence[str] | None = None) -> None:
        from unpack_trainer.data.validation import check_positive_int  # imports torch: not at import time (the CLI's)

        self.files = list(files)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.columns = None if columns is None else list(columns)
        self._position = [0, 0]  # [file index, rows of that file already yielded]
        self._resume: list[int] | None = None

    def _batches_from(self, file_index: int, row: int) -> Iterator[tuple[int, int, list[dict]]]:
        """``(file index, first row of the batch, batch)`` from ``row`` of file ``file_index`` on."""
        for index in range(file_index, len(self.files)):
            path, start = self.files[index], (row if index == file_index else 0)
            kind = file_format(path)
            if kind == "json":
                batches = _iter_jsonl(path, start, self.batch_size)
                if self.columns is not None:
                    batches = (
                        [{key: record.get(key) for key in self.columns} for record in batch] for batch in batches
                    )
            elif kind == "parquet":
                batches = _iter_parquet(path, start, self.batch_size, self.columns)
            else:
                batches = _iter_arrow(path, start, self.batch_size, self.columns)
            for batch in batches:
                yield index, start, batch
                start += len(batch)

    def _start(self) -> list[int]:
        position, self._resume = (self._resume or [0, 0]), None
        return list(position)

    def __iter__(self) -> Iterator[list[dict]]:
        position = self._position = self._start()
        for index, start, batch in self._batches_from(*position):
            position[0], position[1] = index, start + len(batch)
            yield batch

    def rows(self) -> StreamingRows:
        """A re-iterable view yielding one row dict at a time, with its own ``state_dict`` (row granularity)."""
        return StreamingRows(self)

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch yielded: ``{"files": [...], "file_index": int, "row": int}``."""
        position = self._resume if self._resume is not None else self._position
        return {"files": list(self.files), "file_index": position[0], "row": position[1]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next iteration start after the position in ``state_dict`` (from a reader over the same files)."""
        if list(state_dict["files"]) != self.files:
            raise ValueError("The state was saved by a reader over other files; resume with the same files.")
        self._resume = [int(state_dict["file_index"]), int(state_dict["row"])]


class StreamingRows:
    """One row at a time from a [`StreamingDatasetReader`], resumable at any row (see its ``rows``)."""

    def __init__(self, reader: StreamingDatasetReader) -> None:
        self.reader = StreamingDatasetReader(reader.files, reader.batch_size, reader.columns)
        self._position = [0, 0]
        self._resume: list[int] | None = None

    def __iter__(self) -> Iterator[dict]:
        position, self._resume = list(self._resume or [0, 0]), None
        self._position = position
        for index, start, batch in self.reader._batches_from(*position):
            position[0] = index
            for offset, row in enumerate(batch, start=start + 1):
                position[1] = offset
                yield row

    def state_dict(self) -> dict[str, Any]:
        """Position after the last row yielded: ``{"files": [...], "file_index": int, "row": int}``."""
        position = self._resume if self._resume is not None else self._position
        return {"files": list(self.reader.files), "file_index": position[0], "row": position[1]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next iteration start after the row in ``state_dict``."""
        if list(state_dict["files"]) != self.reader.files:
            raise ValueError("The state was saved by a reader over other files; resume with the same files.")
        self._resume = [int(state_dict["file_index"]), int(state_dict["row"])]


def streaming_dataset_reader(
    path: Paths,
    batch_size: int = 1024,
    *,
    columns: Sequence[str] | None = None,
) -> StreamingDatasetReader:
    """Read JSONL, Parquet or Arrow files in batches of rows without loading them whole.

    Args:
        path: a file, a directory (every ``.jsonl``/``.json``/``.jsonl.gz``/``.parquet``/``.arrow``/``.feather``
            file under it, recursively, except hidden ones) or a glob pattern (``"data/train-*.parquet"``,
            ``**`` allowed); or a list of those. Files are read in sorted order. JSON files must be JSON Lines (one
            object per line). Arrow files may use the IPC file or stream format (``datasets`` caches use the latter).
        batch_size: rows per batch.
        columns: read only these columns (``None``: all).

    Returns:
        A re-iterable [`StreamingDatasetReader`] yielding ``list[dict]`` batches; ``.rows()`` yields single rows,
        ready for [`~unpack_trainer.StreamingPacker`] once tokenized.

    Example:
        >>> reader = streaming_dataset_reader("data/*.parquet", batch_size=512)  # doctest: +SKIP
        >>> for batch in reader:  # doctest: +SKIP
        ...     tokenized = tokenizer([row["text"] for row in batch])["input_ids"]
    """
    return StreamingDatasetReader(resolve_files(path), batch_size, columns)


# --------------------------------------------------------------------------------------------------------------------
# Map-style datasets
# --------------------------------------------------------------------------------------------------------------------


def is_saved_dataset(path: PathLike) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "state.json"))


def load_saved(path: PathLike):
    """The ``Dataset`` or ``DatasetDict`` in a ``save_to_disk`` folder.

    Raises:
        ValueError: ``path`` is not such a folder, or ``datasets`` cannot load it (the message names it).
    """
    from datasets import load_from_disk

    if not is_saved_dataset(path):
        raise ValueError(
            f"{os.fspath(path)} is a directory but not a dataset written by `Dataset.save_to_disk` (it has no "
            "state.json or dataset_dict.json)"
        )
    try:
        return load_from_disk(os.fspath(path))
    except Exception as error:  # datasets raises FileNotFoundError, ValueError, ... for a damaged directory
        text = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
        raise ValueError(f"could not load the saved dataset {os.fspath(path)}: {reason}") from None


def read_splits(path: Paths, *, streaming: bool = False):
    """Every split of a local dataset, as a ``datasets.DatasetDict`` (``IterableDatasetDict`` if ``streaming``).

    Args:
        path: a ``save_to_disk`` folder (a single saved ``Dataset`` becomes split ``"train"``), or data files of one
            format named as [`resolve_files`] takes them (a file, a directory searched recursively, a glob pattern,
            or a list; suffixes of [`FORMATS`], optionally ``.gz``), read with the ``datasets`` builder of that
            format as split ``"train"``.
        streaming: return iterable datasets (files are then read lazily by ``datasets``).

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: a file with an unknown suffix, files of mixed formats, an empty file, a directory without any data
            file, or a damaged ``save_to_disk`` folder; the message names the path and what would work.
    """
    from datasets import DatasetDict, load_dataset

    if not isinstance(path, (list, tuple)) and is_saved_dataset(path):
        dataset = load_saved(path)
        if not isinstance(dataset, DatasetDict):
            dataset = DatasetDict({"train": dataset})
        return iterable_splits(dataset) if streaming else dataset
    files = resolve_files(path, suffixes=_SUFFIXES)
    kinds = sorted({file_format(file) for file in files})
    if len(kinds) > 1:
        raise ValueError(f"The data files mix the formats {kinds}; give files of one format.")
    for file in files:
        _check_not_empty(file)
    return load_dataset(kinds[0], data_files={"train": files}, streaming=streaming)


def _check_not_empty(path: str) -> None:
    """``ValueError`` naming ``path`` if it holds nothing (no byte, or for a text format only blank lines): the
    ``datasets`` builders fail on such a file with a bare ``StopIteration`` or a parser error."""
    if os.path.getsize(path) == 0 or (
        file_format(path) in ("json", "csv", "text") and next(_numbered_lines(path), None) is None
    ):
        raise ValueError(f"{path} is empty: it has no rows.")


def iterable_splits(splits):
    """A ``DatasetDict`` as an ``IterableDatasetDict`` (each split through ``Dataset.to_iterable_dataset``)."""
    from datasets import IterableDatasetDict

    return IterableDatasetDict({split: part.to_iterable_dataset() for split, part in splits.items()})


def choose_split(splits: Sequence[str], split: str | None, where: str, *, option: str = "split=") -> str:
    """``split`` if given, else ``"train"``, else the only split; ``ValueError`` naming ``where`` (and the
    ``option`` that chooses a split) otherwise."""
    splits = list(splits)
    if split is None:
        if "train" not in splits and len(splits) != 1:
            raise ValueError(f"{where} holds the splits {splits}; choose one with {option}.")
        return "train" if "train" in splits else splits[0]
    if split not in splits:
        raise ValueError(f"{where} has no split {split!r}; its splits are {splits}.")
    return split
