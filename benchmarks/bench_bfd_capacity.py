"""Best-fit decreasing when the capacity grows: time and peak memory must not depend on it (issue 10, item 14).

    python benchmarks/bench_bfd_capacity.py                       # 10,000 samples, capacities 2,048 .. 10**8
    python benchmarks/bench_bfd_capacity.py --samples 100000 --repeats 5

The same lengths (lognormal, median 180, clipped to [8, 2048]) are packed at each capacity. ``unpack`` is
``best_fit_decreasing``; ``trl`` is ``trl.pack_dataset(strategy="bfd")`` on a ``datasets.Dataset`` of those lengths
(its segment tree has one leaf per token of capacity, so it runs only up to ``--trl-max-capacity``). Repeats are
interleaved (unpack, trl, unpack, trl, ...); the table gives the median and the spread (min-max) of the seconds.
Peak memory is Python's ``tracemalloc`` peak (numpy allocations included) in one extra, untimed run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_packing import _dataset_with_lengths  # noqa: E402
from common import format_table, lognormal_lengths, print_header  # noqa: E402


def _unpack(lengths: np.ndarray, capacity: int) -> int:
    from unpack_trainer import best_fit_decreasing

    return len(best_fit_decreasing(lengths, capacity))


def _trl(lengths: np.ndarray, capacity: int) -> int:
    from trl import pack_dataset

    return len(pack_dataset(_dataset_with_lengths(lengths), capacity, strategy="bfd"))


def _timed(function, lengths: np.ndarray, capacity: int) -> tuple[float, int]:
    start = time.perf_counter()
    rows = function(lengths, capacity)
    return time.perf_counter() - start, rows


def _peak_mb(function, lengths: np.ndarray, capacity: int) -> float:
    tracemalloc.start()
    try:
        function(lengths, capacity)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000, help="number of samples")
    parser.add_argument(
        "--capacities", type=int, nargs="+", default=[2048, 10**5, 10**7, 10**8], help="row capacities (max_length)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per provider and capacity")
    parser.add_argument("--trl-max-capacity", type=int, default=10**7, help="largest capacity given to TRL")
    args = parser.parse_args(argv)

    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    print_header("best_fit_decreasing vs capacity: unpack_trainer vs TRL pack_dataset(strategy='bfd')")
    lengths = lognormal_lengths(args.samples, high=2048)
    headers = ["capacity", "provider", "rows", "median s", "spread s", "peak MB (tracemalloc)"]
    table = []
    for capacity in args.capacities:
        providers = {"unpack": _unpack}
        if capacity <= args.trl_max_capacity:
            providers["trl"] = _trl
        seconds: dict[str, list[float]] = {name: [] for name in providers}
        rows: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, function in providers.items():
                elapsed, rows[name] = _timed(function, lengths, capacity)
                seconds[name].append(elapsed)
        for name, function in providers.items():
            values = seconds[name]
            table.append(
                [
                    f"{capacity:,}",
                    name,
                    rows[name],
                    f"{statistics.median(values):.3f}",
                    f"{min(values):.3f}-{max(values):.3f}",
                    f"{_peak_mb(function, lengths, capacity):.1f}",
                ]
            )
            print(format_table(headers, table[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"{args.samples:,} samples, {int(lengths.sum()):,} tokens")
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
