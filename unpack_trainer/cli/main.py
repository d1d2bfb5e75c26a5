"""The ``unpack-trainer`` entry point: one parser with a subcommand per module of [`unpack_trainer.cli.commands`].

``unpack-trainer analyze`` (length statistics and the estimated packing speedup of a dataset), ``bench`` (training
throughput against stock TRL), one command per trainer of [`unpack_trainer.trainers.TRAINERS`] (``sft``: ``trl sft``
with our trainer, ``dpo``: ``trl dpo`` with ours, ...; [`unpack_trainer.cli.commands.train`]) and ``smollm2`` (the
converted SmolLM2 folder).
A subcommand reports a user error by raising [`CLIError`]: [`main`] prints it as one line on stderr and returns exit
code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from unpack_trainer.cli.commands import ERROR_EXIT_CODE, PROG, CLIError, analyze, bench, env, smollm2, train

__all__ = ["CLIError", "build_parser", "main"]

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    analyze.add_command,
    bench.add_command,
    train.add_commands,
    smollm2.add_command,
    env.add_command,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``unpack-trainer`` parser with every subcommand of ``COMMANDS``."""
    from unpack_trainer import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tools for sample packing with Hugging Face TRL. Run `unpack-trainer COMMAND --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``unpack-trainer`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code.

    0 on success; 2 on a usage error (argparse's message) or a data error (one line on stderr, no traceback).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in train.COMMANDS:  # `trl <command>`'s own parser takes every argument after it
        return train.run(argv[0], argv[1:])
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
