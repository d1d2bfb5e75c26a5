"""The training script of ``unpack-trainer <command>`` (what ``trl/scripts/<command>.py`` is to ``trl <command>``),
one body for every trainer of [`unpack_trainer.trainers.TRAINERS`].

[`unpack_trainer.cli.commands.train`] parses the command line with TRL's parser for the command (our config class in
place of TRL's) and launches this module, ``python -m unpack_trainer.cli.train <command> ARGS``, through ``accelerate
launch``. [`main`] is the body of TRL's scripts (``trl/scripts/sft.py``, ``dpo.py``, ``grpo.py``, ...): the model
init kwargs from the model arguments, the dataset, the trainer built from the parsed arguments (with
``reward_funcs`` from ``--reward_funcs`` / ``--reward_model_name_or_path`` where the script arguments have them, as
TRL's GRPO and RLOO scripts build them, and the teacher from ``--teacher_model_name_or_path`` as TRL's distillation
script loads it), training, saving, pushing. What differs from TRL's:

- the trainer is ours (``unpack_trainer.<Trainer>``, and the config ours: ``--padding_free`` unset lets the trainer
  decide);
- ``--dataset_name`` also takes a local data file (``.jsonl``/``.json``/``.csv``/``.parquet``/``.arrow``/``.txt``,
  optionally ``.gz``) or a folder written by ``Dataset.save_to_disk``, besides what ``datasets.load_dataset`` takes;
- offline names: ``--model_name_or_path unpack_trainer:smollm2`` is SmolLM2-135M-Instruct from the ``real`` extra
  (converted once, see [`unpack_trainer.smollm2_path`]); ``--dataset_name`` takes the names of
  [`unpack_trainer.cli.commands.train.DATASET_NAMES`] (the data the package ships, ``train`` and ``test`` splits);
- a user error is one line on stderr, ``unpack-trainer <command>: error: ...``, and exit status 2, not a traceback:
  [`unpack_trainer.cli.commands.train.check_arguments`] (``--max_length``, a model or data path that does not exist;
  also run by the launcher, before ``accelerate launch``), a data file that cannot be read or is empty, a split that is not there, and
  [`check_split`] (a row without a column the trainer reads, or with it null: the file, line or row and field
  named);
- ``--ignore_bias_buffers`` applies to every command (TRL's DPO script reads it; it is a field of every script's
  arguments).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from unpack_trainer.cli.commands import ERROR_EXIT_CODE, PROG, CLIError, one_line
from unpack_trainer.cli.commands.train import DATASET_NAMES, SMOLLM2_NAME, check_arguments, make_parser
from unpack_trainer.data import files as data_files
from unpack_trainer.trainers import trainer_spec

__all__ = [
    "check_split",
    "load_dataset",
    "main",
    "resolve_model_name",
    "reward_funcs",
    "run",
    "teacher_model",
]


def resolve_model_name(name: str | None) -> str | None:
    """``unpack_trainer:smollm2`` -> the converted SmolLM2 folder (converted on first use); other names unchanged."""
    if name == SMOLLM2_NAME:
        from unpack_trainer.model_zoo.smollm2 import smollm2_path

        return str(smollm2_path())
    return name


def _embedded_splits(name: str, *, streaming: bool) -> Any:
    """A shipped dataset as TRL's scripts expect one: a ``DatasetDict`` of its loader's ``"train"`` as ``train`` and
    ``"eval"`` as ``test``, as streams when ``streaming``."""
    from datasets import DatasetDict

    _, loader, conversational = DATASET_NAMES[name]
    module, function = loader.split(":")
    load = getattr(importlib.import_module(module), function)
    dataset = DatasetDict(
        {
            split: load(source, conversational=conversational)
            for split, source in (("train", "train"), ("test", "eval"))
        }
    )
    return data_files.iterable_splits(dataset) if streaming else dataset


def load_dataset(name: str, *, config: str | None = None, streaming: bool = False) -> Any:
    """The dataset behind ``--dataset_name``, as a ``DatasetDict`` (or ``IterableDatasetDict`` when streaming).

    - a name of [`unpack_trainer.cli.commands.train.DATASET_NAMES`]: the data the package ships, ``train`` and ``test`` splits;
    - a local file or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``:
      [`unpack_trainer.data.files.read_splits`] (a file is read with the ``datasets`` builder of its extension,
      ``.jsonl.gz`` -> ``json``, as split ``train``; a saved ``Dataset`` becomes ``train``);
    - anything else: ``datasets.load_dataset(name, name=config, streaming=streaming)``, exactly as TRL's scripts.

    Raises:
        ValueError: a local file or folder that cannot be read: unknown suffix, empty, damaged (the message names it).
    """
    import datasets

    if name in DATASET_NAMES:
        return _embedded_splits(name, streaming=streaming)
    path = Path(name).expanduser()
    if path.is_file() or data_files.is_saved_dataset(path):
        return data_files.read_splits(path, streaming=streaming)
    return datasets.load_dataset(name, name=config, streaming=streaming)


def _load_for_cli(name: str, *, config: str | None, streaming: bool) -> Any:
    """[`load_dataset`], a reader's error turned into a ``CLIError`` naming ``name``."""
    from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError

    try:
        return load_dataset(name, config=config, streaming=streaming)
    except (ValueError, FileNotFoundError, DatasetNotFoundError) as error:
        raise CLIError(str(error).strip().splitlines()[0] if str(error).strip() else one_line(error)) from None
    except DatasetGenerationError as error:  # datasets' builder failed on a row; the cause says why
        raise CLIError(f"could not read --dataset_name {name}: {one_line(error.__cause__ or error)}") from None


def _layout_columns(columns: list[str], layouts: tuple[tuple[str, ...], ...], trainer: str) -> tuple[str, ...]:
    """The first of ``layouts`` (the column sets ``trainer`` reads, in its order of precedence) whose first column
    the dataset has."""
    for layout in layouts:
        if layout[0] in columns:
            return layout
    found = ", ".join(map(repr, columns)) or "none"
    expected = "; ".join(" + ".join(map(repr, layout)) for layout in layouts)
    raise CLIError(f"no column to train on: found {found}; {trainer} reads {expected}.")


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


def check_split(
    dataset: Any, *, source: str, split: str, layouts: tuple[tuple[str, ...], ...], trainer: str = "the trainer"
) -> None:
    """``CLIError`` if the split ``split`` of ``--dataset_name source`` cannot be trained on: no rows, none of
    ``layouts`` (the column sets ``trainer`` reads, in its order of precedence; empty: not checked), a layout with a
    column missing, or a row whose column is null (a JSON Lines row without the field, or with ``null``). The message
    names the file and line (JSON Lines) or the row, and the field.

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
    if not layouts:
        return
    table = dataset.with_format("arrow")[:]
    layout = _layout_columns(list(dataset.column_names), layouts, trainer)
    for column in layout:
        if column not in table.column_names:
            raise CLIError(
                f"{where} has a {layout[0]!r} column but no {column!r} column; {trainer} needs "
                f"{' and '.join(map(repr, layout))}."
            )
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


def reward_funcs(script_args: Any) -> list[Any]:
    """The reward functions of ``--reward_model_name_or_path`` and ``--reward_funcs``, as TRL's GRPO and RLOO scripts
    build them: the reward model's path first, then each function of TRL's registry (``accuracy_reward``,
    ``reasoning_accuracy_reward``, ``think_format_reward``, ``get_soft_overlong_punishment`` with
    ``max_completion_len=1280, soft_punish_cache=256``) or any dotted import path (``my_lib.rewards.custom``, the
    working directory importable). ``CLIError`` for a name that is neither."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }
    funcs: list[Any] = []
    if getattr(script_args, "reward_model_name_or_path", None):
        funcs.append(script_args.reward_model_name_or_path)
    for name in getattr(script_args, "reward_funcs", None) or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name:
            module_path, function = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            try:
                funcs.append(getattr(importlib.import_module(module_path), function))
            except (ImportError, AttributeError) as error:
                raise CLIError(f"--reward_funcs {name}: {one_line(error)}") from None
        else:
            raise CLIError(
                f"--reward_funcs {name}: not a reward function; expected one of {list(registry)} or a dotted import "
                "path (my_lib.rewards.custom_reward)."
            )
    return funcs


def _init_kwargs(training_args: Any, model_args: Any, revision: str | None, own: dict | None) -> dict[str, Any]:
    """A model's ``from_pretrained`` keyword arguments as TRL's scripts set them from the model arguments (``revision``,
    trust_remote_code, attention implementation, dtype), the recipe's ``own`` taking precedence."""
    found = dict(
        revision=revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    return {**found, **(own or {})}


def set_model_init_kwargs(training_args: Any, model_args: Any) -> None:
    """``training_args.model_init_kwargs`` from the model arguments, as TRL's scripts set them (revision,
    trust_remote_code, attention implementation, dtype), the recipe's own ``model_init_kwargs`` taking precedence."""
    training_args.model_init_kwargs = _init_kwargs(
        training_args, model_args, model_args.model_revision, training_args.model_init_kwargs
    )


def teacher_model(training_args: Any, model_args: Any) -> str:
    """The teacher of ``trl distillation``: ``--teacher_model_name_or_path`` (``unpack_trainer:smollm2`` resolved),
    with ``training_args.teacher_model_init_kwargs`` from the model arguments as TRL's distillation script sets them
    (revision, trust_remote_code, attention implementation, dtype; the recipe's own taking precedence; the teacher
    left unquantized). ``CLIError`` when it is missing, or neither an existing path nor a Hub id."""
    from unpack_trainer.cli.commands.train import _is_hub_id

    name = training_args.teacher_model_name_or_path
    if name is None:
        raise CLIError(
            "--teacher_model_name_or_path is required: distillation trains the student to match a teacher (a model "
            "folder, a Hub model id, or unpack_trainer:smollm2)."
        )
    if name != SMOLLM2_NAME and not Path(name).expanduser().exists() and not _is_hub_id(name):
        raise CLIError(f"--teacher_model_name_or_path {name}: no such file or directory (and not a Hub model id).")
    training_args.teacher_model_init_kwargs = _init_kwargs(
        training_args, model_args, training_args.teacher_model_revision, training_args.teacher_model_init_kwargs
    )
    return resolve_model_name(name)


def main(command: str, script_args: Any, training_args: Any, model_args: Any, dataset_args: Any) -> None:
    """The body of ``trl <command>`` (``trl/scripts/<command>.py``'s ``main``) with our trainer and dataset loading."""
    from accelerate.logging import get_logger
    from trl import get_dataset, get_peft_config, get_quantization_config

    spec = trainer_spec(command)
    trainer_class = spec.trainer_class()
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
    evaluate = training_args.eval_strategy != "no"
    splits = [script_args.dataset_train_split] + ([script_args.dataset_test_split] if evaluate else [])
    layouts = trainer_class.unpack_data_columns(training_args)
    for split in splits:
        if split not in dataset:
            raise CLIError(f"{source} has no split {split!r}; its splits are {list(dataset)}.")
        check_split(dataset[split], source=source, split=split, layouts=layouts, trainer=spec.trainer)

    extra = {}
    if hasattr(script_args, "reward_funcs"):
        extra["reward_funcs"] = reward_funcs(script_args)
    if hasattr(training_args, "teacher_model_name_or_path"):  # distillation
        extra["teacher_model"] = teacher_model(training_args, model_args)
    trainer = trainer_class(
        model=resolve_model_name(model_args.model_name_or_path),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluate else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        **extra,
    )
    if script_args.ignore_bias_buffers:
        import torch

        from unpack_trainer._compat import ignore_in_ddp

        ignore_in_ddp(
            trainer.model, [name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool]
        )
    _train_and_save(trainer, training_args, dataset_name=script_args.dataset_name)


def _train_and_save(trainer: Any, training_args: Any, *, dataset_name: str | None) -> None:
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
    """The script's entry point: ``argv`` (default ``sys.argv[1:]``) is the command, then its arguments, parsed as
    ``trl <command>`` does; runs [`main`]. A user error is one line on stderr and exit status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    command, *args = sys.argv[1:] if argv is None else argv
    parser = make_parser(command)
    try:
        main(command, *parser.parse_args_and_config(args, fail_with_unknown_args=False))
    except CLIError as error:
        print(f"{PROG} {command}: error: {error}", file=sys.stderr)
        return ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":  # launched by `unpack-trainer <command>` through accelerate
    sys.exit(run())
