"""The ``unpack-trainer`` subcommands, one module each (``analyze``, ``bench``, ``smollm2``; ``train``: one command
per trainer), and what they share.

Each command module has ``add_command(subparsers)`` (``train`` has ``add_commands``, one per trainer, whose arguments
go to TRL's own parser unparsed), which builds its parser and sets ``handler=<function(args) -> int>``. A handler reports a
user error by raising [`CLIError`]: [`unpack_trainer.cli.main`] prints it as one line on stderr and returns exit
code 2 (no traceback).
"""

from __future__ import annotations

import argparse

__all__ = ["ERROR_EXIT_CODE", "PROG", "CLIError", "add_command_parser", "one_line", "positive_int"]

PROG = "unpack-trainer"
ERROR_EXIT_CODE = 2  # a user error, as argparse exits on a usage error


class CLIError(Exception):
    """A user error: printed as ``unpack-trainer <command>: error: <message>``, exit code 2."""


def add_command_parser(
    subparsers: argparse._SubParsersAction, name: str, help: str, description: str, epilog: str
) -> argparse.ArgumentParser:
    """The parser of the subcommand ``name``: ``help`` its line in ``unpack-trainer --help``, ``description`` and
    ``epilog`` (examples) its own ``--help`` text, line breaks kept."""
    return subparsers.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer ``>= 1``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def one_line(error: BaseException) -> str:
    """``"<ExceptionType>: <first line of the message>"``, for one-line error messages."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
