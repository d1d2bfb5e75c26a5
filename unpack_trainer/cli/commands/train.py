"""``unpack-trainer <command>`` for every trainer of [`unpack_trainer.trainers.TRAINERS`]: ``trl <command>`` with our
trainer (``unpack-trainer sft`` is ``trl sft`` with [`unpack_trainer.SFTTrainer`], ``dpo`` ``trl dpo``, ...).

Each takes exactly what ``trl <command>`` takes: TRL's own parser (``trl.scripts.<command>.make_parser``: its
``TrlParser`` over the script arguments, the config, ``ModelConfig`` and ``DatasetMixtureConfig``) with our config
class in place of TRL's, so every ``trl <command>`` flag and YAML recipe (``--config recipe.yaml``, ``env:``, LoRA
and quantization flags, ``--accelerate_config``, ``--num_processes``, ...) works unchanged. As ``trl <command>``
launches ``trl/scripts/<command>.py``, it launches the training script [`unpack_trainer.cli.train`]
(``python -m unpack_trainer.cli.train <command> ARGS``) through ``accelerate launch`` with the arguments the parser
did not know. What the script does differently from TRL's is said there and in each command's ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unpack_trainer.cli.commands import ERROR_EXIT_CODE, PROG, CLIError
from unpack_trainer.trainers import TRAINERS, TrainerSpec, trainer_spec

__all__ = [
    "COMMANDS",
    "DATASET_NAMES",
    "SCRIPT",
    "SMOLLM2_NAME",
    "add_commands",
    "check_arguments",
    "make_parser",
    "run",
]

SCRIPT = "unpack_trainer.cli.train"  # the module `accelerate launch` runs
COMMANDS: tuple[str, ...] = tuple(spec.command for spec in TRAINERS)

_DESCRIPTION = """\
{title}: `trl {command}` with unpack_trainer's {trainer}.

Same command line as `trl {command}` (TRL's own parser and dataclasses: every flag below and every YAML recipe given
with `--config recipe.yaml` works unchanged; `accelerate launch` options such as --num_processes or
--accelerate_config are passed on, as `trl {command}` does). What differs from `trl {command}`:
  * the trainer: unpack_trainer.{trainer}. {differs};
  * --dataset_name also takes a local data file (.jsonl/.json/.csv/.parquet/.arrow/.txt, optionally .gz) or a
    folder written by Dataset.save_to_disk;
  * offline names: --model_name_or_path unpack_trainer:smollm2 (SmolLM2-135M-Instruct from the `real` extra,
    converted once into ~/.cache/unpack_trainer; `unpack-trainer smollm2` prints its folder) and --dataset_name
    {datasets};
  * a bad input (--max_length below 1, a model or data path that does not exist, an empty data file, a missing
    split, a row without its field or with it null) is one line on stderr and exit status 2, not a traceback.
"""

_EPILOG = """\
examples:
  unpack-trainer {command} --config recipe.yaml
  unpack-trainer {command} --model_name_or_path unpack_trainer:smollm2 --dataset_name {dataset} \\
      --use_peft --lora_r 16 --max_steps 10 --use_cpu --output_dir out/smollm2-{command}
"""


SMOLLM2_NAME = "unpack_trainer:smollm2"
# --dataset_name -> (the commands whose --help lists it, "module:function" of its loader, conversational)
DATASET_NAMES: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "unpack_trainer:chat": (("sft",), "unpack_trainer.data.default_data:load_default_dataset", True),
    "unpack_trainer:default": (("sft",), "unpack_trainer.data.default_data:load_default_dataset", False),
    "unpack_trainer:preference_chat": (
        ("dpo", "reward", "kto"),
        "unpack_trainer.data.default_preference_data:load_default_preference_dataset",
        True,
    ),
    "unpack_trainer:preference": (
        ("dpo", "reward", "kto"),
        "unpack_trainer.data.default_preference_data:load_default_preference_dataset",
        False,
    ),
}


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

    ``--max_length`` below 1 (for a config that has it); a ``--model_name_or_path`` that is neither an existing path
    nor shaped like a Hub id (transformers would say "Repo id must be in the form ..."); a ``--dataset_name`` that
    names a local data file (a path, or a data file suffix) that does not exist; neither ``--dataset_name`` nor
    ``datasets``.
    """
    max_length = getattr(training_args, "max_length", None)
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
    from unpack_trainer.data.files import file_format

    local = file_format(name) is not None or not _is_hub_id(name)
    if name not in DATASET_NAMES and local and not Path(name).expanduser().exists():
        raise CLIError(f"--dataset_name {name}: no such file or directory.")


def _offline_datasets(command: str) -> list[str]:
    names = [name for name, (commands, *_) in DATASET_NAMES.items() if command in commands]
    return names or list(DATASET_NAMES)


def _our_dataclasses(spec: TrainerSpec, theirs: Sequence[type]) -> tuple[type, ...]:
    """TRL's dataclasses of ``trl <command>`` with our config class in place of the TRL config it subclasses."""
    config = spec.config_class()
    swapped = tuple(config if issubclass(config, their) and their is not object else their for their in theirs)
    if config not in swapped:
        raise RuntimeError(f"trl {spec.command}'s parser has no config that {spec.config} extends: {theirs}")
    return swapped


def make_parser(command: str, prog: str | None = None) -> Any:
    """TRL's ``TrlParser`` for ``trl <command>`` (``trl.scripts.<command>.make_parser``), with our config class in
    place of TRL's, and this command's description."""
    from trl import TrlParser

    spec = trainer_spec(command)
    theirs = importlib.import_module(f"trl.scripts.{command}").make_parser()
    datasets = _offline_datasets(command)
    return TrlParser(
        _our_dataclasses(spec, theirs.dataclass_types),
        prog=prog or f"{PROG} {command}",
        description=_DESCRIPTION.format(
            title=spec.title,
            command=command,
            trainer=spec.trainer,
            differs=spec.differs,
            datasets=" / ".join(datasets) + " (the data the package ships, train and test splits)",
        ),
        epilog=_EPILOG.format(command=command, dataset=datasets[0]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """``items`` without the ordered ``subsequence`` (as ``trl`` separates launcher from script arguments)."""
    remaining = iter(subsequence)
    current = next(remaining, None)
    kept = []
    for item in items:
        if current is not None and item == current:
            current = next(remaining, None)
        else:
            kept.append(item)
    return kept


def run(command: str, argv: Sequence[str]) -> int:
    """``unpack-trainer <command> ARGS``: parse as ``trl <command>`` does (``--help`` exits here), check what needs no
    data or model ([`check_arguments`]), then ``accelerate launch`` the training script with
    the command and the script's arguments; the arguments the parser does not know go to ``accelerate launch``.

    Returns the exit status: 0; 2 on a user error (one line on stderr, here or from the training script, which
    reports its own the same way); the training script's status if it failed otherwise (its traceback is its own).
    """
    import subprocess

    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    all_args = list(argv)
    try:
        *parsed, config_remaining, cli_remaining = make_parser(command).parse_args_and_config(
            all_args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except SystemExit as exit_:  # --help, or a usage error argparse already printed
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        check_arguments(*parsed)
    except CLIError as error:
        print(f"{PROG} {command}: error: {error}", file=sys.stderr)
        return ERROR_EXIT_CODE
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _subtract_subsequence(all_args, cli_remaining)
    launch = launch_command_parser().parse_args([*launch_args, "--module", SCRIPT, command, *script_args])
    try:
        launch_command(launch)
    except subprocess.CalledProcessError as failed:  # the script said why on stderr (one line for a user error)
        return failed.returncode
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """List every trainer's command in ``unpack-trainer --help``; ``cli.main`` hands their arguments to [`run`]
    unparsed."""
    for spec in TRAINERS:
        subparsers.add_parser(
            spec.command,
            help=f"`trl {spec.command}` with unpack_trainer's {spec.trainer} (same flags and YAML recipes)",
        )
