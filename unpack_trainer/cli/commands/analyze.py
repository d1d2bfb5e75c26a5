"""``unpack-trainer analyze DATA --max-length N``: what packing does for a dataset, before any training.

Sample length statistics, the padding that padded batching would process, how many rows the global
best-fit-decreasing packer needs, and the estimated speedup ([`unpack_trainer.data.estimate`], the trainer's start line
uses the same definition). Files are read with [`unpack_trainer.data.files`], the package's one reader.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from unpack_trainer.cli.commands import CLIError, add_command_parser, one_line, positive_int
from unpack_trainer.data import files as data_files
from unpack_trainer.data.estimate import PackingAnalysis, analyze_lengths

__all__ = ["add_command", "detect_layout", "format_report", "open_table", "read_lengths", "write_plot"]

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
ACCEPTED_FORMATS = (
    ".jsonl / .json (optionally .gz), .parquet, .arrow, or a directory written by `Dataset.save_to_disk`"
)
_READ_BATCH_SIZE = 1000
_PROGRESS_MIN_ROWS = 10_000


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


def _columns(rows: list[dict[str, Any]], wanted: list[str]) -> dict[str, list[Any]]:
    return {name: [row[name] for row in rows] for name in wanted}


def _json_array_table(path: Path) -> _Table:
    """A ``.json`` file holding one JSON array of objects (read whole)."""
    with data_files.open_text(path) as stream:
        try:
            records = json.load(stream)
        except json.JSONDecodeError as error:
            raise CLIError(f"{path} is not valid JSON: {error}") from None
    if not all(isinstance(record, dict) for record in records):
        raise CLIError(f"{path} holds a JSON array whose items are not all objects.")

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        for start in range(0, len(records), _READ_BATCH_SIZE):
            chunk = records[start : start + _READ_BATCH_SIZE]
            yield _columns(
                [_fields(record, wanted, f"row {start + i}", path) for i, record in enumerate(chunk)], wanted
            )

    return _Table(f"JSON array, {len(records):,} rows", list(records[0]) if records else [], len(records), batches)


def _json_lines_table(path: Path) -> _Table:
    """A JSON Lines file, read line by line ([`unpack_trainer.data.files.iter_json_lines`])."""
    first = next(data_files.iter_json_lines(path), (0, {}))[1]
    num_rows = data_files.count_json_lines(path)

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        chunk: list[dict] = []
        for line_number, record in data_files.iter_json_lines(path):
            chunk.append(_fields(record, wanted, f"line {line_number}", path))
            if len(chunk) == _READ_BATCH_SIZE:
                yield _columns(chunk, wanted)
                chunk = []
        if chunk:
            yield _columns(chunk, wanted)

    return _Table(f"JSON lines, {num_rows:,} rows", list(first), num_rows, batches)


def _fields(record: dict, wanted: list[str], where: str, path: Path) -> dict:
    for name in wanted:
        if name not in record:
            fields = ", ".join(map(repr, record))
            raise CLIError(f"{where} of {path} has no {name!r} field (its fields: {fields}).")
    return record


def _arrow_table(path: Path, kind: str) -> _Table:
    """A Parquet or Arrow file, read in record batches ([`unpack_trainer.data.files.StreamingDatasetReader`])."""
    columns, num_rows = data_files.arrow_columns_and_rows(path)

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        for rows in data_files.StreamingDatasetReader([str(path)], _READ_BATCH_SIZE, wanted):
            yield _columns(rows, wanted)

    return _Table(f"{kind}, {num_rows:,} rows", columns, num_rows, batches)


def _saved_dataset_table(path: Path, split: str | None) -> _Table:
    from datasets import DatasetDict

    if not data_files.is_saved_dataset(path):
        raise CLIError(
            f"{path} is a directory but not a dataset written by `Dataset.save_to_disk` (it has no state.json or "
            f"dataset_dict.json); pass {ACCEPTED_FORMATS}."
        )
    dataset = data_files.load_saved(path)
    description = "saved dataset"
    if isinstance(dataset, DatasetDict):
        split = data_files.choose_split(list(dataset), split, str(path), option="--split")
        dataset, description = dataset[split], f"saved dataset, split {split!r}"
    elif split is not None:
        raise CLIError(f"--split {split!r} was given but {path} holds a single dataset with no splits.")

    def batches(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        yield from dataset.select_columns(wanted).iter(batch_size=_READ_BATCH_SIZE)

    return _Table(f"{description}, {len(dataset):,} rows", list(dataset.column_names), len(dataset), batches)


def _default_table(split: str | None) -> _Table:
    from unpack_trainer.data.default_data import SPLITS, load_default_records

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
    """Open ``data`` (a path, or ``"default"`` for the embedded dataset) for reading; ``CLIError`` if unusable.

    A reader's ``ValueError`` (a bad JSON line, an unreadable file, a missing split) becomes a ``CLIError``, here or
    when the table's batches are read.
    """
    try:
        table = _open_table(data, split)
    except ValueError as error:
        raise CLIError(str(error)) from None
    return _Table(table.description, table.columns, table.num_rows, _user_errors(table.batches))


def _user_errors(batches: Callable[[list[str]], Iterator[dict[str, list[Any]]]]):
    def read(wanted: list[str]) -> Iterator[dict[str, list[Any]]]:
        try:
            yield from batches(wanted)
        except ValueError as error:
            raise CLIError(str(error)) from None

    return read


def _open_table(data: str, split: str | None) -> _Table:
    if data == DEFAULT_DATASET and not Path(data).exists():
        return _default_table(split)
    path = Path(data)
    if not path.exists():
        raise CLIError(f"no such file or directory: {data}")
    if path.is_dir():
        return _saved_dataset_table(path, split)
    if split is not None:
        raise CLIError(f"--split only applies to saved datasets with splits, not to the file {path}.")
    kind = data_files.file_format(path)
    if kind == "json":
        with data_files.open_text(path) as stream:
            first = stream.read(1)
            while first.isspace():
                first = stream.read(1)
        return _json_array_table(path) if first == "[" else _json_lines_table(path)
    if kind in ("parquet", "arrow") and path.suffix != ".gz":
        return _arrow_table(path, "Parquet" if kind == "parquet" else "Arrow")
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


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    """The tokenizer at ``path`` (a directory or a ``tokenizer.json``), or the embedded default; and a description."""
    if path is None:
        from unpack_trainer.data.default_data import load_default_tokenizer

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
        raise CLIError(f"could not load a tokenizer from {path}: {one_line(error)}") from None
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
                f"{self.row + len(conversations) - 1}: {one_line(error)}"
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
    if a.default_packing:
        out.append(
            "\n" + _wrap(f"The trainer's default packer (packing_order='windowed', seed 0): {a.default_packing}.")
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
        raise CLIError(f"could not write the plot {path}: {one_line(error)}") from None


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


_ANALYZE_HELP = "show length statistics, padding waste and the packing speedup for a dataset"
_ANALYZE_DESCRIPTION = """\
Show what sample packing does for a dataset, before training: token length statistics, the padding that padded
batching processes at a batch size, the rows the global best-fit-decreasing packer needs at --max-length, and the
estimated speedup of packing. Nothing is trained and nothing is downloaded.

DATA is a .jsonl or .json file (optionally gzipped), a .parquet or .arrow file, or a directory written by
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


def add_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``analyze`` to the ``unpack-trainer`` subcommands."""
    parser = add_command_parser(subparsers, "analyze", _ANALYZE_HELP, _ANALYZE_DESCRIPTION, _ANALYZE_EPILOG)
    parser.add_argument(
        "data",
        nargs="?",
        metavar="DATA",
        help='dataset file or directory, or "default" for the embedded dataset (the default)',
    )
    parser.add_argument("--dataset", dest="dataset_option", metavar="DATA", help="same as the DATA argument")
    parser.add_argument(
        "--max-length",
        type=positive_int,
        default=1024,
        metavar="N",
        help="row length for packing and truncation limit, as SFTConfig.max_length (default: %(default)s, TRL's)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
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
