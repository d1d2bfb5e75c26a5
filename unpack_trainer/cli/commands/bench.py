"""``unpack-trainer bench``: training throughput of stock TRL (padded, ``packing=True``) vs unpack_trainer.

The comparison itself lives in [`unpack_trainer.cli.trainer_comparison`] (``benchmarks/bench_trainer.py`` runs it
too); this module is the command: its parser and its handler.
"""

from __future__ import annotations

import argparse

from unpack_trainer.cli import trainer_comparison
from unpack_trainer.cli.commands import CLIError, add_command_parser

__all__ = ["add_command"]

_BENCH_HELP = "compare training throughput: stock TRL padded / packed vs unpack_trainer"
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


def add_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` to the ``unpack-trainer`` subcommands."""
    parser = add_command_parser(subparsers, "bench", _BENCH_HELP, _BENCH_DESCRIPTION, _BENCH_EPILOG)
    trainer_comparison.add_arguments(parser, default_data="default")
    parser.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    try:
        report = trainer_comparison.compare_from_args(args)
    except (RuntimeError, ValueError) as error:
        raise CLIError(str(error)) from None
    print(report)
    return 0
