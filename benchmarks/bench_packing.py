"""Bin packing: our global best-fit decreasing vs TRL's ``pack_dataset(..., strategy="bfd")`` on the same lengths.

    python benchmarks/bench_packing.py                 # 100k and 1M samples (TRL at 1M takes minutes)
    python benchmarks/bench_packing.py --sizes 100000  # quicker

Distributions: lognormal with median 180 (sigma 0.8) clipped to [8, capacity], at capacities 2048 and 8192; and
lognormal with mean 256 / 512 / 1024 at capacity 2048. ``unpack`` times ``best_fit_decreasing`` on the lengths;
``trl`` times ``pack_dataset`` on a ``datasets.Dataset`` holding ``input_ids`` of exactly those lengths (TRL needs
the token lists; the Arrow handling is part of its cost). Lower bound = ceil(total tokens / capacity) rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import format_table, lognormal_lengths, lognormal_lengths_with_mean, print_header  # noqa: E402


def _cases(sizes: list[int]) -> list[tuple[str, int, int, np.ndarray]]:
    cases = []
    for n in sizes:
        for capacity in (2048, 8192):
            cases.append(("median 180", n, capacity, lognormal_lengths(n, high=capacity)))
        for mean in (256, 512, 1024):
            cases.append((f"mean {mean}", n, 2048, lognormal_lengths_with_mean(n, mean=mean, high=2048)))
    return cases


def time_unpack(lengths: np.ndarray, capacity: int) -> tuple[float, int]:
    from unpack_trainer import best_fit_decreasing

    start = time.perf_counter()
    rows = best_fit_decreasing(lengths, capacity)
    return time.perf_counter() - start, len(rows)


def _dataset_with_lengths(lengths: np.ndarray):
    import pyarrow as pa
    from datasets import Dataset

    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int32))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    return Dataset(pa.table({"input_ids": column}))


def time_trl(lengths: np.ndarray, capacity: int) -> tuple[float, int]:
    from trl import pack_dataset

    dataset = _dataset_with_lengths(lengths)
    start = time.perf_counter()
    packed = pack_dataset(dataset, capacity, strategy="bfd")
    return time.perf_counter() - start, len(packed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="numbers of samples")
    parser.add_argument("--skip-trl", action="store_true", help="time only our packer")
    args = parser.parse_args(argv)

    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    print_header("Bin packing: unpack_trainer best_fit_decreasing vs TRL pack_dataset(strategy='bfd')")
    headers = [
        "lengths",
        "samples",
        "capacity",
        "lower bound rows",
        "provider",
        "seconds",
        "samples/s",
        "rows",
        "efficiency %",
        "speedup vs trl",
    ]
    table = []
    for name, n, capacity, lengths in _cases(args.sizes):
        bound = -(-int(lengths.sum()) // capacity)
        results = {"unpack": time_unpack(lengths, capacity)}
        if not args.skip_trl:
            results["trl"] = time_trl(lengths, capacity)
        for provider, (seconds, rows) in results.items():
            speedup = results["trl"][0] / seconds if "trl" in results else float("nan")
            efficiency = 100.0 * lengths.sum() / (rows * capacity)
            table.append(
                [
                    name,
                    n,
                    capacity,
                    bound,
                    provider,
                    seconds,
                    f"{n / seconds:,.0f}",
                    rows,
                    f"{efficiency:.3f}",
                    f"{speedup:.1f}x",
                ]
            )
        print(format_table(headers, table[-len(results) :]).splitlines()[-1], flush=True)
    print()
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
