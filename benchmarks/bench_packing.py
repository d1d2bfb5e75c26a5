"""Bin packing: our global best-fit decreasing vs TRL's ``pack_dataset(..., strategy="bfd")`` on the same lengths, and
how many rows each of our packers needs on five length distributions.

    python benchmarks/bench_packing.py                 # both parts: 100k and 1M samples (TRL at 1M takes minutes)
    python benchmarks/bench_packing.py --sizes 100000  # quicker
    python benchmarks/bench_packing.py --part rows     # rows only: 50,000 samples, rows of 2048, five distributions

Rows part: the default windowed packer (``windowed_packing``: the window widens only as far as needed for at most 1%
more rows than best-fit decreasing), the window fixed at 4 open rows (the default before), ``shuffled_best_fit`` and
best-fit decreasing against the lower bound ceil(tokens / capacity), for lognormal lengths of median 180 and 600
(sigma 0.8, clipped to [8, 2048]), uniform lengths 1-2048 and 700-1400, and a bimodal mix (half normal(100, 20),
half normal(1500, 150), clipped to [1, 2048]); every packer with seed 0, times the median (min-max) of 3
interleaved repeats.

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


def five_distributions(n: int = 50_000, capacity: int = 2048, seed: int = 0) -> dict[str, np.ndarray]:
    """The rows part's length distributions (issue 21): ``n`` int64 lengths each, in ``[1, capacity]``."""
    rng = np.random.default_rng(seed)
    bimodal = np.where(rng.random(n) < 0.5, rng.normal(100, 20, n), rng.normal(1500, 150, n))
    return {
        "lognormal median 180": lognormal_lengths(n, median=180, high=capacity, seed=seed),
        "lognormal median 600": lognormal_lengths(n, median=600, high=capacity, seed=seed),
        "uniform 1-2048": rng.integers(1, capacity + 1, n),
        "uniform 700-1400": rng.integers(700, 1401, n),
        "bimodal 100/1500": np.clip(np.rint(bimodal), 1, capacity).astype(np.int64),
    }


def rows_table(n: int, capacity: int, repeats: int) -> str:
    """Rows of each packer vs best-fit decreasing and the lower bound, on [`five_distributions`]."""
    from unpack_trainer.data.packing import best_fit_decreasing, shuffled_best_fit, windowed_best_fit, windowed_packing

    packers = {
        "windowed (default)": lambda lengths: windowed_packing(lengths, capacity, seed=0),
        "windowed, 4 open rows": lambda lengths: windowed_best_fit(lengths, capacity, seed=0, window=4),
        "shuffled": lambda lengths: shuffled_best_fit(lengths, capacity, seed=0),
        "best-fit decreasing": lambda lengths: best_fit_decreasing(lengths, capacity),
    }
    headers = ["lengths", "lower bound rows", "packer", "rows", "vs best-fit decreasing", "full", "seconds", "chosen"]
    table = []
    for name, lengths in five_distributions(n, capacity).items():
        bound = -(-int(lengths.sum()) // capacity)
        times: dict[str, list[float]] = {packer: [] for packer in packers}
        results: dict[str, object] = {}
        for _ in range(repeats):  # interleaved: every packer once per round
            for packer, pack in packers.items():
                start = time.perf_counter()
                results[packer] = pack(lengths)
                times[packer].append(time.perf_counter() - start)
        bfd = len(results["best-fit decreasing"])
        for packer in packers:
            result = results[packer]
            chosen = ""
            if hasattr(result, "rows"):
                chosen = "unbounded window" if result.window is None else f"window {result.window}"
                chosen += f", fillers {result.filler_share:.0%}" if result.filler_share else ""
                result = result.rows
            seconds = sorted(times[packer])
            table.append(
                [
                    name,
                    bound,
                    packer,
                    len(result),
                    f"{len(result) / bfd - 1:+.2%}",
                    f"{lengths.sum() / (len(result) * capacity):.2%}",
                    f"{seconds[len(seconds) // 2]:.2f} ({seconds[0]:.2f}-{seconds[-1]:.2f})",
                    chosen,
                ]
            )
        print(format_table(headers, table[-len(packers) :]).splitlines()[-1], flush=True)
    return format_table(headers, table)


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
    parser.add_argument("--part", choices=["speed", "rows", "all"], default="all", help="which table(s)")
    parser.add_argument("--rows-samples", type=int, default=50_000, help="samples per distribution, rows part")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats, rows part")
    args = parser.parse_args(argv)
    if args.part in ("rows", "all"):
        print_header(f"Rows per packer: {args.rows_samples:,} samples, rows of 2048")
        print(f"`python benchmarks/bench_packing.py --part rows --rows-samples {args.rows_samples}`\n")
        print("\n" + rows_table(args.rows_samples, 2048, args.repeats) + "\n")
        if args.part == "rows":
            return

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
