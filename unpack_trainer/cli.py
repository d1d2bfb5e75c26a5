"""The ``unpack-trainer`` command line.

``unpack-trainer analyze DATA --max-length N`` shows what packing does for a dataset before any training: sample
length statistics, the padding that padded batching would process, how many rows the global best-fit-decreasing
packer needs, and the estimated speedup.

Each subcommand is one ``_add_<name>_command(subparsers)`` function that builds its parser and sets
``handler=<function(args) -> int>``; it is listed in ``_COMMANDS``. A handler reports a user error by raising
[`CLIError`]: [`main`] prints it as one line on stderr and returns exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CLIError", "PackingAnalysis", "analyze_lengths", "build_parser", "main"]

PROG = "unpack-trainer"
ERROR_EXIT_CODE = 2
DEFAULT_DATASET = "default"
LAYOUTS = {
    "input_ids": "pre-tokenized `input_ids`",
    "prompt_completion": "`prompt` + `completion`",
    "messages": "conversational `messages`",
    "text": "`text`",
}
ACCEPTED_LAYOUTS = (
    "'input_ids' (pre-tokenized), 'prompt' + 'completion' (strings or message lists), "
    "'messages' (conversations), 'text'"
)
ACCEPTED_FORMATS = ".jsonl / .json (optionally .gz), .parquet, or a directory written by `Dataset.save_to_disk`"
_READ_BATCH_SIZE = 1000
_PROGRESS_MIN_ROWS = 10_000


class CLIError(Exception):
    """A user error: printed as ``unpack-trainer <command>: error: <message>``, exit code 2."""


# --------------------------------------------------------------------------------------------------------------------
# Length analysis (pure)
# --------------------------------------------------------------------------------------------------------------------


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
        """Token-count speedup estimate, [`unpack_trainer.estimate.estimated_speedup`]: padded tokens of random
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
        >>> a = analyze_lengths([100, 10, 10, 10], max_length=128, batch_size=2)
        >>> a.sorted_padded_tokens, len(a.rows), a.packed_tokens   # sorted batches [10, 10] [10, 100]: 20 + 200
        (220, 1, 128)
    """
    from unpack_trainer.estimate import padded_batches
    from unpack_trainer.packing import best_fit_decreasing

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
    )


# --------------------------------------------------------------------------------------------------------------------
# Reading datasets
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class _Table:
    """A column-oriented view of the input: its description, columns, row count and a batch iterator."""

    description: str
    columns: list[str]
    num_rows: int
    batches: Callable[[list[str]], Iterator[dict[str, list[Any]]]]


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def _strip_gz(path: Path) -> str:
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def _json_table(path: Path) -> _Table:
    with _open_text(path) as stream:
        first = stream.read(1)
        while first.isspace():
            first = stream.read(1)
    if first == "[":  # one JSON array of objects
        with _open_text(path) as stream:
            try:
                records = json.load(stream)
            except json.JSONDecodeError as error:
                raise CLIError(f"{path} is not valid JSON: {error}") from None
        if not all(isinstance(record, dict) for record in records):
            raise CLIError(f"{path} holds a JSON array whose items are not all objects.")
        columns = list(records[0]) if records else []

        def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
            for start in range(0, len(records), _READ_BATCH_SIZE):
                chunk = records[start : start + _READ_BATCH_SIZE]
                yield {
                    name: [_field(record, name, start + i, path) for i, record in enumerate(chunk)] for name in wanted
                }

        return _Table(f"JSON array, {len(records):,} rows", columns, len(records), batches)

    num_rows, columns = 0, []
    with _open_text(path) as stream:
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            if num_rows == 0:
                columns = list(_parse_line(line, line_number, path))
            num_rows += 1

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        chunk: list[dict] = []
        with _open_text(path) as stream:
            for line_number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                record = _parse_line(line, line_number, path)
                chunk.append({name: _field(record, name, line_number, path, "line") for name in wanted})
                if len(chunk) == _READ_BATCH_SIZE:
                    yield {name: [row[name] for row in chunk] for name in wanted}
                    chunk = []
        if chunk:
            yield {name: [row[name] for row in chunk] for name in wanted}

    return _Table(f"JSON lines, {num_rows:,} rows", columns, num_rows, batches)


def _parse_line(line: str, line_number: int, path: Path) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise CLIError(f"line {line_number} of {path} is not valid JSON: {error}") from None
    if not isinstance(record, dict):
        raise CLIError(f"line {line_number} of {path} is a JSON {type(record).__name__}, not an object.")
    return record


def _field(record: dict, name: str, index: int, path: Path, what: str = "row") -> Any:
    if name not in record:
        raise CLIError(f"{what} {index} of {path} has no {name!r} field (its fields: {', '.join(map(repr, record))}).")
    return record[name]


def _parquet_table(path: Path) -> _Table:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a corrupt file
        raise CLIError(f"{path} is not a readable Parquet file: {_one_line(error)}") from None
    num_rows = parquet.metadata.num_rows

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        for batch in parquet.iter_batches(batch_size=_READ_BATCH_SIZE, columns=wanted):
            yield batch.to_pydict()

    return _Table(f"Parquet, {num_rows:,} rows", list(parquet.schema_arrow.names), num_rows, batches)


def _saved_dataset_table(path: Path, split: str | None) -> _Table:
    from datasets import DatasetDict, load_from_disk

    if not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise CLIError(
            f"{path} is a directory but not a dataset written by `Dataset.save_to_disk` (it has no state.json or "
            f"dataset_dict.json); pass {ACCEPTED_FORMATS}."
        )
    try:
        dataset = load_from_disk(str(path))
    except Exception as error:  # datasets raises FileNotFoundError, ValueError, ... for a damaged directory
        raise CLIError(f"could not load the saved dataset {path}: {_one_line(error)}") from None
    description = "saved dataset"
    if isinstance(dataset, DatasetDict):
        splits = list(dataset)
        if split is None:
            if "train" not in dataset and len(splits) != 1:
                raise CLIError(f"{path} holds the splits {splits}; choose one with --split.")
            split = "train" if "train" in dataset else splits[0]
        if split not in dataset:
            raise CLIError(f"{path} has no split {split!r}; its splits are {splits}.")
        dataset, description = dataset[split], f"saved dataset, split {split!r}"
    elif split is not None:
        raise CLIError(f"--split {split!r} was given but {path} holds a single dataset with no splits.")

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        yield from dataset.select_columns(wanted).iter(batch_size=_READ_BATCH_SIZE)

    return _Table(f"{description}, {len(dataset):,} rows", list(dataset.column_names), len(dataset), batches)


def _default_table(split: str | None) -> _Table:
    from unpack_trainer.default_data import SPLITS, load_default_records

    split = split or "train"
    if split not in SPLITS:
        raise CLIError(f"the embedded default dataset has no split {split!r}; its splits are {list(SPLITS)}.")
    records = load_default_records(split)

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        for start in range(0, len(records), _READ_BATCH_SIZE):
            chunk = records[start : start + _READ_BATCH_SIZE]
            yield {name: [record[name] for record in chunk] for name in wanted}

    description = f"embedded default dataset, split {split!r}, {len(records):,} rows"
    return _Table(description, ["prompt", "completion"], len(records), batches)


def open_table(data: str, split: str | None = None) -> _Table:
    """Open ``data`` (a path, or ``"default"`` for the embedded dataset) for reading; ``CLIError`` if unusable."""
    if data == DEFAULT_DATASET and not Path(data).exists():
        return _default_table(split)
    path = Path(data)
    if not path.exists():
        raise CLIError(f"no such file or directory: {data}")
    if path.is_dir():
        return _saved_dataset_table(path, split)
    if split is not None:
        raise CLIError(f"--split only applies to saved datasets with splits, not to the file {path}.")
    if _strip_gz(path) in (".jsonl", ".json"):
        return _json_table(path)
    if path.suffix == ".parquet":
        return _parquet_table(path)
    raise CLIError(
        f"cannot read {path}: unsupported file type {''.join(path.suffixes) or '(none)'}; pass {ACCEPTED_FORMATS}."
    )


def detect_layout(columns: Sequence[str]) -> str:
    """The column layout TRL's ``SFTTrainer`` would see, in its order of precedence; ``CLIError`` if none fits."""
    if "input_ids" in columns:
        return "input_ids"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "messages" in columns:
        return "messages"
    if "text" in columns:
        return "text"
    found = ", ".join(map(repr, columns)) or "none"
    raise CLIError(f"unknown column layout: found columns {found}; expected one of {ACCEPTED_LAYOUTS}.")


# --------------------------------------------------------------------------------------------------------------------
# Tokenization (the way TRL's SFTTrainer tokenizes)
# --------------------------------------------------------------------------------------------------------------------


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    """The tokenizer at ``path`` (a directory or a ``tokenizer.json``), or the embedded default; and a description."""
    if path is None:
        from unpack_trainer.default_data import load_default_tokenizer

        return load_default_tokenizer(), "embedded default tokenizer (pass --tokenizer PATH to count with yours)"
    location = Path(path)
    if not location.exists():
        raise CLIError(f"tokenizer not found: no such file or directory: {path}")
    try:
        if location.is_file() and not (location.parent / "tokenizer_config.json").exists():
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(location))
        else:
            from transformers import AutoTokenizer

            directory = location if location.is_dir() else location.parent
            tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, Exception from the Rust side, ...
        raise CLIError(f"could not load a tokenizer from {path}: {_one_line(error)}") from None
    return tokenizer, f"{path}"


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


class _Counter:
    """Turns batches of one layout into token counts, the way TRL's ``SFTTrainer`` tokenizes them."""

    def __init__(self, layout: str, tokenizer: Any, tokenizer_name: str) -> None:
        self.layout, self.tokenizer, self.tokenizer_name = layout, tokenizer, tokenizer_name
        self.eos = getattr(tokenizer, "eos_token", None) if tokenizer is not None else None
        self.conversational: bool | None = None
        self.row = 0

    def columns(self) -> list[str]:
        return {"input_ids": ["input_ids"], "prompt_completion": ["prompt", "completion"]}.get(
            self.layout, [self.layout]
        )

    def __call__(self, batch: dict[str, list[Any]]) -> list[int]:
        if self.layout == "input_ids":
            lengths = [self._sequence_length(ids, i) for i, ids in enumerate(batch["input_ids"], start=self.row)]
        elif self.layout == "prompt_completion":
            lengths = self._prompt_completion(batch["prompt"], batch["completion"])
        elif self.layout == "messages":
            lengths = self._conversations(batch["messages"], "messages")
        else:
            texts = batch["text"]
            lengths = self._texts(
                [self._with_eos(self._string(t, i, "text")) for i, t in enumerate(texts, start=self.row)]
            )
        self.row += len(lengths)
        return lengths

    def _sequence_length(self, ids: Any, row: int) -> int:
        if ids is None or isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            raise CLIError(f"row {row}: 'input_ids' must be a list of token ids, got {type(ids).__name__}.")
        return len(ids)

    def _string(self, value: Any, row: int, column: str) -> str:
        if not isinstance(value, str):
            raise CLIError(f"row {row}: column {column!r} must be a string, got {type(value).__name__}.")
        return value

    def _with_eos(self, text: str) -> str:
        # TRL appends EOS to non-conversational text and completions that do not already end with it.
        return text if not self.eos or text.endswith(self.eos) else text + self.eos

    def _texts(self, texts: list[str], *, add_special_tokens: bool = True) -> list[int]:
        encoded = self.tokenizer(
            texts, add_special_tokens=add_special_tokens, return_attention_mask=False, return_token_type_ids=False
        )["input_ids"]
        return [len(ids) for ids in encoded]

    def _check_conversational(self, conversational: bool, row: int) -> None:
        if self.conversational is None:
            self.conversational = conversational
            if conversational and not getattr(self.tokenizer, "chat_template", None):
                raise CLIError(
                    f"the data is conversational but the tokenizer ({self.tokenizer_name}) has no chat template; "
                    "pass --tokenizer with the directory of a tokenizer that has one."
                )
        elif conversational != self.conversational:
            raise CLIError(f"row {row} mixes conversational and plain-text rows; use one format for every row.")

    def _conversations(self, conversations: list[Any], column: str) -> list[int]:
        for i, conversation in enumerate(conversations, start=self.row):
            if not _is_conversation(conversation):
                raise CLIError(
                    f"row {i}: column {column!r} must be a list of {{'role': ..., 'content': ...}} messages, "
                    f"got {type(conversation).__name__}."
                )
            self._check_conversational(True, i)
        try:
            texts = self.tokenizer.apply_chat_template(conversations, tokenize=False)
        except Exception as error:  # jinja2 errors raised by the user's template
            raise CLIError(
                f"the chat template of {self.tokenizer_name} failed on rows {self.row}-"
                f"{self.row + len(conversations) - 1}: {_one_line(error)}"
            ) from None
        return self._texts(texts, add_special_tokens=False)

    def _prompt_completion(self, prompts: list[Any], completions: list[Any]) -> list[int]:
        conversational = _is_conversation(prompts[0])
        self._check_conversational(conversational, self.row)
        if conversational:
            for i, (p, c) in enumerate(zip(prompts, completions), start=self.row):
                if not (_is_conversation(p) and _is_conversation(c)):
                    raise CLIError(f"row {i}: 'prompt' and 'completion' must both be message lists like row 0.")
            return self._conversations([p + c for p, c in zip(prompts, completions)], "prompt")
        texts = []
        for i, (p, c) in enumerate(zip(prompts, completions), start=self.row):
            texts.append(self._string(p, i, "prompt") + self._with_eos(self._string(c, i, "completion")))
        return self._texts(texts)


def read_lengths(table: _Table, layout: str, tokenizer: Any, tokenizer_name: str) -> np.ndarray:
    """Token count of every row of ``table`` in ``layout``; a progress bar on stderr for large interactive inputs."""
    from tqdm.auto import tqdm

    counter = _Counter(layout, tokenizer, tokenizer_name)
    lengths: list[int] = []
    with tqdm(
        total=table.num_rows,
        unit=" rows",
        desc="counting tokens",
        disable=True if table.num_rows < _PROGRESS_MIN_ROWS else None,  # None: shown only on a terminal
        file=sys.stderr,
    ) as progress:
        for batch in table.batches(counter.columns()):
            counted = counter(batch)
            lengths.extend(counted)
            progress.update(len(counted))
    return np.asarray(lengths, dtype=np.int64)


# --------------------------------------------------------------------------------------------------------------------
# Report and plot
# --------------------------------------------------------------------------------------------------------------------


def _percent(value: float) -> str:
    return f"{100 * value:.1f} %"


def _table(rows: Sequence[Sequence[str]], *, numeric: bool = True, indent: str = "  ") -> str:
    """Rows of cells as aligned text: the first column left-aligned, the others right-aligned if ``numeric``."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) if numeric else cell.ljust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append(indent + "   ".join(cells).rstrip())
    return "\n".join(lines)


def _wrap(text: str, indent: str = "  ") -> str:
    return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


def format_report(analysis: PackingAnalysis) -> str:
    """The text that ``unpack-trainer analyze`` prints for ``analysis``."""
    a = analysis
    lengths = a.lengths
    stats = [
        ("samples", f"{a.num_samples:,}"),
        ("total tokens", f"{int(lengths.sum()):,}"),
        ("min", f"{int(lengths.min()):,}"),
        ("median", f"{float(np.median(lengths)):,.0f}"),
        ("mean", f"{float(lengths.mean()):,.1f}"),
        ("p90", f"{float(np.percentile(lengths, 90)):,.0f}"),
        ("p99", f"{float(np.percentile(lengths, 99)):,.0f}"),
        ("max", f"{int(lengths.max()):,}"),
    ]
    out = ["Sample lengths in tokens (as TRL's SFTTrainer tokenizes them, special tokens and EOS included)"]
    out.append(_table(stats))
    if a.num_empty:
        out.append(_wrap(f"{a.num_empty:,} empty sample(s) are left out of everything below."))
    if a.num_truncated:
        out.append(
            _wrap(
                f"{a.num_truncated:,} sample(s) ({_percent(a.num_truncated / a.num_samples)}) are longer than "
                f"max_length={a.max_length:,}: TRL truncates them, dropping {a.truncated_tokens:,} tokens. They are "
                "counted truncated below."
            )
        )
    else:
        out.append(f"  Every sample fits in max_length={a.max_length:,}.")

    out.append(f"\nPadded batching, batch size {a.batch_size} (each batch padded to its longest sample)")
    out.append(
        _table(
            [
                ("", "batches", "tokens processed", "padding"),
                (
                    "random batches (as training shuffles)",
                    f"{a.num_batches:,}",
                    f"{a.padded_tokens:,}",
                    _percent(a.padding_waste),
                ),
                (
                    "sorted by length (group_by_length, best case)",
                    f"{a.num_batches:,}",
                    f"{a.sorted_padded_tokens:,}",
                    _percent(a.sorted_padding_waste),
                ),
            ]
        )
    )
    num_rows = len(a.rows)
    out.append(f"\nPacking: global best-fit decreasing into rows of max_length={a.max_length:,} tokens")
    out.append(
        _table(
            [
                ("packed rows", f"{num_rows:,} (from {a.num_samples:,} samples)"),
                ("fill efficiency", f"{_percent(a.packing_efficiency)} (real tokens / (rows x max_length))"),
                (f"batches of {a.batch_size} rows", f"{-(-num_rows // a.batch_size):,}"),
                ("tokens processed", f"{a.packed_tokens:,} (rows x max_length; padding-free: {a.real_tokens:,})"),
            ],
            numeric=False,
        )
    )
    out.append(
        f"\nEstimated speedup of packing: {a.speedup:.2f}x over random padded batches, "
        f"{a.sorted_speedup:.2f}x over length-sorted batches."
    )
    out.append(
        _wrap(
            "This is a token-count estimate (padded tokens / real tokens per epoch, the same definition as the "
            "trainer's start line), not a measurement: it leaves "
            "out the attention cost, which grows with the square of each sample's length, and the per-step "
            "overhead. Time a real training run to confirm it."
        )
    )
    return "\n".join(out)


def _check_plot_path(path: Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install matplotlib") from None
    if not path.parent.is_dir():
        raise CLIError(f"cannot write the plot {path}: the directory {path.parent} does not exist.")
    formats = Figure().canvas.get_supported_filetypes()
    extension = path.suffix.lstrip(".").lower()
    if extension not in formats:
        raise CLIError(
            f"cannot write the plot {path}: unknown image format {path.suffix or '(none)'}; use one of "
            f"{', '.join('.' + name for name in sorted(formats))}."
        )


def write_plot(analysis: PackingAnalysis, path: Path, *, title: str = "") -> None:
    """Save a length histogram and a row-fill plot of ``analysis`` to ``path`` (format from its extension)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install matplotlib") from None

    a = analysis
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    hist, fill = figure.subplots(1, 2)
    bins = np.linspace(0, max(int(a.lengths.max()), a.max_length), 60)
    hist.hist(a.lengths, bins=bins, color="tab:blue", log=True)
    hist.axvline(a.max_length, color="tab:red", linestyle="--", label=f"max_length = {a.max_length:,}")
    hist.set_xlabel("sample length (tokens)")
    hist.set_ylabel("samples (log scale)")
    hist.set_title(f"{a.num_samples:,} samples, median {float(np.median(a.lengths)):,.0f} tokens")
    hist.legend()

    for values, label, color in (
        (a.row_fill, f"packed rows ({len(a.rows):,}), {_percent(a.packing_efficiency)} full", "tab:green"),
        (a.batch_fill, f"padded batches ({a.num_batches:,}), {_percent(1 - a.padding_waste)} real", "tab:orange"),
    ):
        ordered = np.sort(values)[::-1]
        fill.step(np.linspace(0, 100, ordered.size), 100 * ordered, where="mid", label=label, color=color)
    fill.set_ylim(0, 105)
    fill.set_xlabel("rows / batches, fullest first (%)")
    fill.set_ylabel("real tokens (% of the row or batch)")
    fill.set_title(f"Row fill: packing processes {a.speedup:.2f}x fewer tokens (estimate)")
    fill.legend(loc="lower left")
    if title:
        figure.suptitle(title)
    try:
        figure.savefig(path, dpi=100)
    except (OSError, ValueError) as error:  # a missing directory, an unknown extension
        raise CLIError(f"could not write the plot {path}: {_one_line(error)}") from None


# --------------------------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


_ANALYZE_DESCRIPTION = """\
Show what sample packing does for a dataset, before training: token length statistics, the padding that padded
batching processes at a batch size, the rows the global best-fit-decreasing packer needs at --max-length, and the
estimated speedup of packing. Nothing is trained and nothing is downloaded.

DATA is a .jsonl or .json file (optionally gzipped), a .parquet file, or a directory written by
`Dataset.save_to_disk` (use --split for a DatasetDict). Rows are read the way TRL's SFTTrainer reads them, in this
order of precedence:
  input_ids             pre-tokenized ids (no tokenizer needed)
  prompt + completion   strings, or message lists rendered with the chat template
  messages              conversations rendered with the chat template
  text                  plain text
Text is tokenized with --tokenizer, or with the embedded default tokenizer when it is not given (the counts are then
only indicative of your model's). Without DATA, or with DATA "default", the embedded default dataset is analyzed.
"""

_ANALYZE_EPILOG = """\
examples:
  unpack-trainer analyze                                   # the embedded default dataset
  unpack-trainer analyze train.jsonl --max-length 2048 --tokenizer ./my-model
  unpack-trainer analyze data.parquet --batch-size 16 --plot lengths.png
  unpack-trainer analyze ./saved_dataset --split validation

exit status: 0 on success, 2 on a usage or data error (the message says what to fix).
"""


def _add_analyze_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="show length statistics, padding waste and the packing speedup for a dataset",
        description=_ANALYZE_DESCRIPTION,
        epilog=_ANALYZE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "data",
        nargs="?",
        metavar="DATA",
        help='dataset file or directory, or "default" for the embedded dataset (the default)',
    )
    parser.add_argument("--dataset", dest="dataset_option", metavar="DATA", help="same as the DATA argument")
    parser.add_argument(
        "--max-length",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="row length for packing and truncation limit, as SFTConfig.max_length (default: %(default)s, TRL's)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=8,
        metavar="B",
        help="samples per padded batch, as per_device_train_batch_size (default: %(default)s, TRL's)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer directory (e.g. a model directory) or tokenizer.json; default: the embedded tokenizer",
    )
    parser.add_argument(
        "--split", help="split of a saved DatasetDict, or train/eval of the embedded dataset (default: train)"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="also save a length histogram and a row-fill plot to FILE.png"
    )
    parser.set_defaults(handler=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    if args.data is not None and args.dataset_option is not None and args.data != args.dataset_option:
        raise CLIError(f"DATA was given twice ({args.data!r} and --dataset {args.dataset_option!r}); give it once.")
    data = args.data or args.dataset_option or DEFAULT_DATASET
    if args.plot is not None:
        _check_plot_path(args.plot)  # before the (possibly long) tokenization
    table = open_table(data, args.split)
    if table.num_rows == 0:
        raise CLIError(f"{data} has no rows.")
    layout = detect_layout(table.columns)
    if layout == "input_ids":
        tokenizer, tokenizer_name = None, "not needed (pre-tokenized input_ids)"
    else:
        tokenizer, tokenizer_name = load_tokenizer(args.tokenizer)
    lengths = read_lengths(table, layout, tokenizer, tokenizer_name)
    try:
        analysis = analyze_lengths(lengths, args.max_length, args.batch_size)
    except ValueError as error:
        raise CLIError(f"{data}: {error}") from None

    print(f"data:      {data} ({table.description}, layout: {LAYOUTS[layout]})")
    print(f"tokenizer: {tokenizer_name}\n")
    print(format_report(analysis))
    if args.plot is not None:
        write_plot(analysis, args.plot, title=f"{Path(data).name}, max_length {args.max_length:,}")
        print(f"\nplot written to {args.plot}")
    return 0


_BENCH_DESCRIPTION = """\
Time training on the embedded default dataset (or lognormal random data with --data lognormal) four ways, each in its
own process, and print real (non-pad) tokens per second with ratios:
  (a) trl.SFTTrainer, padded                  (c) unpack_trainer.SFTTrainer, packing=True
  (b) trl.SFTTrainer, packing=True            (d) unpack_trainer.SFTTrainer, automatic padding-free
Same tiny model, same data, same SFTConfig otherwise. The first step of each case is a warm-up and is not timed.
Absolute times on shared machines are noisy: compare the ratios. This is what benchmarks/bench_trainer.py runs.
"""

_BENCH_EPILOG = """\
examples:
  unpack-trainer bench                                  # max_length 2048 and 8192 on the embedded data
  unpack-trainer bench --max-lengths 1024 --steps 2     # quicker
  unpack-trainer bench --providers trl_packing unpack_packing
"""


def _add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    from unpack_trainer.trainer_benchmark import add_arguments

    parser = subparsers.add_parser(
        "bench",
        help="compare training throughput: stock TRL padded / packed vs unpack_trainer",
        description=_BENCH_DESCRIPTION,
        epilog=_BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, default_data="default")
    parser.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from unpack_trainer.trainer_benchmark import compare

    if args.steps < 1:
        raise CLIError(f"--steps must be at least 1, got {args.steps}.")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be at least 1, got {args.batch_size}.")
    bad = [length for length in args.max_lengths if length < 1]
    if bad:
        raise CLIError(f"--max-lengths must be positive token counts, got {bad[0]}.")
    try:
        report = compare(
            max_lengths=args.max_lengths,
            steps=args.steps,
            batch_size=args.batch_size,
            providers=args.providers,
            data=args.data,
            repeats=args.repeats,
            threads=args.threads,
        )
    except (RuntimeError, ValueError) as error:
        raise CLIError(str(error)) from None
    print(report)
    return 0


def _add_sft_command(subparsers: argparse._SubParsersAction) -> None:
    from unpack_trainer.sft_command import add_sft_command

    add_sft_command(subparsers)


def _add_smollm2_command(subparsers: argparse._SubParsersAction) -> None:
    from unpack_trainer.sft_command import add_smollm2_command

    add_smollm2_command(subparsers)


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_analyze_command,
    _add_bench_command,
    _add_sft_command,
    _add_smollm2_command,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``unpack-trainer`` parser with every subcommand of ``_COMMANDS``."""
    from unpack_trainer import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tools for sample packing with Hugging Face TRL. Run `unpack-trainer COMMAND --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in _COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``unpack-trainer`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code.

    0 on success; 2 on a usage error (argparse's message) or a data error (one line on stderr, no traceback).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sft"]:  # `trl sft`'s own parser takes every argument after `sft`
        from unpack_trainer.sft_command import run_sft

        return run_sft(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a usage error already printed by argparse
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else ERROR_EXIT_CODE)
    try:
        return args.handler(args)
    except CLIError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
