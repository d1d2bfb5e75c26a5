"""Shared set-up for the benchmarks: tiny models from configs, length distributions, environment header, tables.

Every benchmark compares providers in the same run and reports ratios; absolute times on shared machines are noise.
The pieces live in the package, [`unpack_trainer.cli.trainer_comparison`] (``unpack-trainer bench`` uses them too);
``benchmarks/`` imports them from there, never the other way round.
"""

from __future__ import annotations

from unpack_trainer.cli.trainer_comparison import (
    environment,
    environment_line,
    format_table,
    lognormal_lengths,
    lognormal_lengths_with_mean,
    run_in_subprocess,
    tiny_llama_config,
)

__all__ = [
    "environment",
    "format_table",
    "lognormal_lengths",
    "lognormal_lengths_with_mean",
    "print_header",
    "run_in_subprocess",
    "tiny_llama_config",
]


def print_header(title: str) -> None:
    print(f"## {title}\n")
    print(environment_line() + "\n")
