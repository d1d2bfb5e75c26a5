"""The training script of ``unpack-trainer sft`` (what ``trl/scripts/sft.py`` is to ``trl sft``).

[`unpack_trainer.cli.commands.sft`] parses the command line with [`make_parser`] (TRL's ``TrlParser`` over the
dataclasses of ``trl sft``) and launches this module, ``python -m unpack_trainer.sft_command``, through
``accelerate launch``. What differs from ``trl sft``:

- the trainer is [`unpack_trainer.SFTTrainer`] (and the config our ``SFTConfig``: ``--padding_free`` unset lets the
  trainer decide, ``--packing_buffer_size`` for streamed packing);
- ``--dataset_name`` also takes a local data file (``.jsonl``/``.json``/``.csv``/``.parquet``/``.arrow``/``.txt``,
  optionally ``.gz``) or a folder written by ``Dataset.save_to_disk``, besides what ``datasets.load_dataset`` takes;
- offline names: ``--model_name_or_path unpack_trainer:smollm2`` is SmolLM2-135M-Instruct from the ``real`` extra
  (converted once, see [`unpack_trainer.smollm2_path`]); ``--dataset_name unpack_trainer:chat`` is the embedded
  instruction data in TRL's conversational prompt-completion format (``unpack_trainer:default``: plain strings), with
  ``train`` (4,000) and ``test`` (200) splits;
- a user error is one line on stderr, ``unpack-trainer sft: error: ...``, and exit status 2, not a traceback:
  [`check_arguments`] (``--max_length``, a model or data path that does not exist; also run by the launcher, before
  ``accelerate launch``), a data file that cannot be read or is empty, a split that is not there, and
  [`check_split`] (a row without the field the layout needs, or with it null: the file, line or row and field named).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from unpack_trainer.cli.commands import CLIError, one_line
from unpack_trainer.cli.commands.sft import PROG, make_parser
from unpack_trainer.data import files as data_files

__all__ = ["check_arguments", "check_split", "load_sft_dataset", "main", "make_parser", "resolve_model_name", "run"]

SMOLLM2_NAME = "unpack_trainer:smollm2"
DATASET_NAMES = {"unpack_trainer:chat": True, "unpack_trainer:default": False}  # name -> conversational


def resolve_model_name(name: str | None) -> str | None:
    """``unpack_trainer:smollm2`` -> the converted SmolLM2 folder (converted on first use); other names unchanged."""
    if name == SMOLLM2_NAME:
        from unpack_trainer.real_model import smollm2_path

        return str(smollm2_path())
    return name


def _is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hub repository id (``name`` or ``namespace/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_arguments(script_args: Any, training_args: Any, model_args: Any, dataset_args: Any = None) -> None:
    """The checks that need no data and no model: ``CLIError`` naming the flag and the value.

    ``--max_length`` below 1; a ``--model_name_or_path`` that is neither an existing path nor shaped like a Hub id
    (transformers would say "Repo id must be in the form ..."); a ``--dataset_name`` that names a local data file
    (a path, or a data file suffix) that does not exist; neither ``--dataset_name`` nor ``datasets``.
    """
    max_length = training_args.max_length
    if max_length is not None and max_length < 1:
        raise CLIError(f"--max_length must be a positive integer (or None: no truncation), got {max_length}.")
    model = model_args.model_name_or_path
    if model is None:
        raise CLIError("--model_name_or_path is required: a model folder, a Hub model id, or unpack_trainer:smollm2.")
    if model != SMOLLM2_NAME and not Path(model).expanduser().exists() and not _is_hub_id(model):
        raise CLIError(
            f"--model_name_or_path {model}: no such file or directory (and not a Hub model id, 'name' or "
            "'namespace/name')."
        )
    if dataset_args is not None and dataset_args.datasets:
        return
    name = script_args.dataset_name
    if not name:
        raise CLIError("--dataset_name (or `datasets` in a --config recipe) is required.")
    local = data_files.file_format(name) is not None or not _is_hub_id(name)
    if name not in DATASET_NAMES and local and not Path(name).expanduser().exists():
        raise CLIError(f"--dataset_name {name}: no such file or directory.")


def load_sft_dataset(name: str, *, config: str | None = None, streaming: bool = False):
    """The dataset behind ``--dataset_name``, as a ``DatasetDict`` (or ``IterableDatasetDict`` when streaming).

    - ``unpack_trainer:chat`` / ``unpack_trainer:default``: the embedded data, ``train`` and ``test`` splits;
    - a local file or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``:
      [`unpack_trainer.data.files.read_splits`] (a file is read with the ``datasets`` builder of its extension,
      ``.jsonl.gz`` -> ``json``, as split ``train``; a saved ``Dataset`` becomes ``train``);
    - anything else: ``datasets.load_dataset(name, name=config, streaming=streaming)``, exactly as ``trl sft``.

    Raises:
        ValueError: a local file or folder that cannot be read: unknown suffix, empty, damaged (the message names it).
    """
    from datasets import load_dataset

    if name in DATASET_NAMES:
        from unpack_trainer.data.default_data import load_default_dataset

        return embedded_splits(load_default_dataset, conversational=DATASET_NAMES[name], streaming=streaming)
    path = Path(name).expanduser()
    if path.is_file() or data_files.is_saved_dataset(path):
        return data_files.read_splits(path, streaming=streaming)
    return load_dataset(name, name=config, streaming=streaming)


def _load_for_cli(name: str, *, config: str | None, streaming: bool):
    """[`load_sft_dataset`], a reader's error turned into a ``CLIError`` naming ``name``."""
    from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError

    try:
        return load_sft_dataset(name, config=config, streaming=streaming)
    except (ValueError, FileNotFoundError, DatasetNotFoundError) as error:
        raise CLIError(str(error).strip().splitlines()[0] if str(error).strip() else one_line(error)) from None
    except DatasetGenerationError as error:  # datasets' builder failed on a row; the cause says why
        raise CLIError(f"could not read --dataset_name {name}: {one_line(error.__cause__ or error)}") from None


def _layout_columns(columns: list[str], text_field: str) -> list[str]:
    """The columns TRL's ``SFTTrainer`` reads, in its order of precedence (``input_ids``; ``prompt`` + ``completion``;
    ``messages``; ``dataset_text_field``)."""
    for layout in (["input_ids"], ["prompt", "completion"], ["messages"], ["conversations"], [text_field]):
        if layout[0] in columns:
            return layout
    found = ", ".join(map(repr, columns)) or "none"
    raise CLIError(
        f"no column to train on: found {found}; SFT reads 'input_ids' (pre-tokenized), 'prompt' + 'completion', "
        f"'messages', or the text column {text_field!r} (--dataset_text_field)."
    )


def _json_lines_record(path: Path, row: int) -> tuple[int, dict] | None:
    """``(line number, record)`` of row ``row`` of a JSON Lines file, or ``None`` if ``path`` is not one."""
    if not path.is_file() or data_files.file_format(path) != "json":
        return None
    try:
        with data_files.open_text(path) as stream:
            if stream.read(4096).lstrip().startswith("["):
                return None
        for index, (line_number, record) in enumerate(data_files.iter_json_lines(path)):
            if index == row:
                return line_number, record
    except (OSError, ValueError):
        return None
    return None


def check_split(dataset: Any, *, source: str, split: str, text_field: str = "text") -> None:
    """``CLIError`` if the split ``split`` of ``--dataset_name source`` cannot be trained on: no rows, no column
    TRL's ``SFTTrainer`` reads, or a row whose column is null (a JSON Lines row without the field, or with
    ``null``). The message names the file and line (JSON Lines) or the row, and the field.

    A streamed split (``IterableDataset``, ``--dataset_streaming``) is not read here: that would read the stream
    before training (an empty local file is still caught when it is opened).
    """
    import pyarrow.compute as pc
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        return
    where = source if split == "train" and Path(source).is_file() else f"{source}, split {split!r}"
    if len(dataset) == 0:
        raise CLIError(f"{where} has no rows.")
    table = dataset.with_format("arrow")[:]
    for column in _layout_columns(list(dataset.column_names), text_field):
        if column == "completion" and column not in table.column_names:
            raise CLIError(f"{where} has a 'prompt' column but no 'completion' column; SFT needs both.")
        values = table[column]
        if not values.null_count:
            continue
        row = int(pc.index(pc.is_null(values), True).as_py())
        located = _json_lines_record(Path(source).expanduser(), row)
        if located is not None:
            line_number, record = located
            place = f"{source}, line {line_number}"
            if column not in record:
                fields = ", ".join(map(repr, record)) or "none"
                raise CLIError(f"{place}: no {column!r} field (its fields: {fields}); every row needs one.")
        else:
            place = f"{where}, row {row}"
        raise CLIError(f"{place}: {column!r} is null; every row needs a value.")


def main(script_args: Any, training_args: Any, model_args: Any, dataset_args: Any) -> None:
    """The body of ``trl sft`` (``trl/scripts/sft.py``'s ``main``) with our trainer and dataset loading."""
    from accelerate.logging import get_logger
    from trl import get_dataset, get_peft_config, get_quantization_config

    from unpack_trainer.trainers.sft import SFTTrainer

    logger = get_logger(__name__)
    check_arguments(script_args, training_args, model_args, dataset_args)
    set_model_init_kwargs(training_args, model_args)

    if dataset_args.datasets:
        if script_args.dataset_name:
            logger.warning(
                "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
                "dataset and `dataset_name` will be ignored."
            )
        dataset = get_dataset(dataset_args)
        source = "the `datasets` of the recipe"
    else:
        source = script_args.dataset_name
        dataset = _load_for_cli(source, config=script_args.dataset_config, streaming=script_args.dataset_streaming)
    splits = [script_args.dataset_train_split]
    if training_args.eval_strategy != "no":
        splits.append(script_args.dataset_test_split)
    for split in splits:
        if split not in dataset:
            raise CLIError(f"{source} has no split {split!r}; its splits are {list(dataset)}.")
        check_split(dataset[split], source=source, split=split, text_field=training_args.dataset_text_field)

    trainer = SFTTrainer(
        model=resolve_model_name(model_args.model_name_or_path),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    train_and_save(trainer, training_args, dataset_name=script_args.dataset_name)


def embedded_splits(load: Any, *, conversational: bool, streaming: bool) -> Any:
    """A shipped dataset as ``trl sft`` / ``trl dpo`` expect one: a ``DatasetDict`` of ``load("train")`` as
    ``train`` and ``load("eval")`` as ``test`` (``load`` takes the split and ``conversational=``), as streams when
    ``streaming``."""
    from datasets import DatasetDict

    dataset = DatasetDict(
        {
            split: load(source, conversational=conversational)
            for split, source in (("train", "train"), ("test", "eval"))
        }
    )
    return data_files.iterable_splits(dataset) if streaming else dataset


def set_model_init_kwargs(training_args: Any, model_args: Any) -> None:
    """``training_args.model_init_kwargs`` from the model arguments, as ``trl sft`` / ``trl dpo`` set them (revision,
    trust_remote_code, attention implementation, dtype), the recipe's own ``model_init_kwargs`` taking precedence."""
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs


def train_and_save(trainer: Any, training_args: Any, *, dataset_name: str | None) -> None:
    """The end of TRL's training scripts: train (resuming when asked), save, push to the Hub when asked, and finish
    the trackers and the process group."""
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    if hasattr(trainer, "end"):  # finish the trackers and destroy the process group (newer transformers)
        trainer.end()


def run(argv: list[str] | None = None) -> int:
    """The script's entry point: parse ``argv`` (default ``sys.argv[1:]``) as ``trl sft`` does and run [`main`];
    a user error is one line on stderr and exit status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = make_parser()
    try:
        main(*parser.parse_args_and_config(argv, fail_with_unknown_args=False))
    except CLIError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # launched by `unpack-trainer sft` through accelerate: python -m unpack_trainer.sft_command
    sys.exit(run())
