"""Shared set-up for the benchmarks: tiny models from configs, length distributions, environment header, tables.

Every benchmark compares providers in the same run and reports ratios; absolute times on shared machines are noise.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from unpack_trainer.trainer_benchmark import lognormal_lengths, tiny_llama_config

__all__ = [
    "environment",
    "format_table",
    "lognormal_lengths",
    "lognormal_lengths_with_mean",
    "print_header",
    "run_in_subprocess",
    "tiny_llama_config",
]


def lognormal_lengths_with_mean(
    n: int, *, mean: float, sigma: float = 0.8, low: int = 8, high: int = 2048, seed: int = 0
) -> np.ndarray:
    """Lognormal lengths whose (unclipped) mean is ``mean``: median = mean * exp(-sigma**2 / 2)."""
    return lognormal_lengths(n, median=mean * np.exp(-(sigma**2) / 2), sigma=sigma, low=low, high=high, seed=seed)


def environment() -> dict[str, str]:
    """Versions and device, recorded next to every table."""
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": str(os.cpu_count())}
    for name in ("torch", "transformers", "trl", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "not installed"
    try:
        import torch

        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        pass
    return info


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; floats are printed with 3 significant decimals."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_header(title: str) -> None:
    env = environment()
    print(f"## {title}\n")
    print(", ".join(f"{k} {v}" for k, v in env.items()) + "\n")


def run_in_subprocess(module_args: Sequence[str], *, timeout: float = 1800) -> dict:
    """Run ``python <args>`` in a fresh process that prints one JSON object on its last stdout line; return it.

    Each measured case runs in its own process so that peak memory (ru_maxrss) belongs to that case alone.
    """
    proc = subprocess.run([sys.executable, *module_args], capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark case {module_args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
