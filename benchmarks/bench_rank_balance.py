"""Data-parallel ranks that finish together: the cost of each rank's rows in every optimizer step, simulated.

    python benchmarks/bench_rank_balance.py              # both data sets, 8 / 64 / 512 ranks
    python benchmarks/bench_rank_balance.py --ranks 8 64  # quicker

No cluster and no training: the rows the trainer would pack (``windowed_packing``, seed 0) are dealt to ranks the way
a run would deal them, and each rank's step cost is computed with the model ``tokens + r * sum(L_i ** 2)`` over its
rows. ``before``: today's order ([`balanced_step_order`] over every row of a step, then accelerate's sharding:
consecutive batches of ``--batch-size`` rows to ranks 0, 1, ... in turn); ``after``: [`balanced_rank_order`]. Per
step, max/mean of the ranks' costs (1.00 = every rank finishes together; the slowest rank sets the step time, so
``max/mean - 1`` is the share of the cluster's time spent waiting) and the same for the ranks' sample counts; the
table gives the mean over steps and the worst step, and the spread of samples per step (std / mean) that the quality
result needs even.

The attention share assumed (``r``, from [`attention_cost_ratio`]): matrix-multiply FLOPs of Llama-3-8B's shapes
(hidden 4096, 8 key-value heads of 128, intermediate 14336): ``r = 1 / 53,248``, so attention is 3.7% of a row
holding one 2,048-token sample and 38% of one holding a single 32,768-token document. Attention kernels reach a
lower share of peak than the matrix multiplies, so a GPU spends more than that on attention: the ``x4`` rows
multiply ``r`` by 4 (15% and 71%).

Data: the main job's (the embedded instruction data as the trainer prepares it, about 3,900 samples of 10 to 1,629
tokens, resampled with replacement to ``--main-samples`` so that 512 ranks get enough steps), in rows of 2,048; and
long-context documents (lognormal, median 4,000 tokens, sigma 1.0, clipped to [64, 32768]) in rows of 32,768. One
row per rank per forward (``--batch-size 1``) and 4 accumulation steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import format_table, print_header  # noqa: E402

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}


def main_job_lengths(n: int, max_length: int, seed: int = 0) -> np.ndarray:
    """The main job's prepared sample lengths (``bench_quality.prepared_samples``), resampled to ``n``."""
    from bench_quality import prepared_samples

    from unpack_trainer import load_default_dataset, load_default_tokenizer

    lengths, _ = prepared_samples(load_default_dataset("train"), load_default_tokenizer(), max_length)
    return np.random.default_rng(seed).choice(np.asarray(lengths, dtype=np.int64), size=n, replace=True)


def long_context_lengths(n: int, max_length: int, seed: int = 0) -> np.ndarray:
    lengths = np.random.default_rng(seed).lognormal(np.log(4000), 1.0, n)
    return np.clip(np.rint(lengths), 64, max_length).astype(np.int64)


def step_ratios(order: list[int], values: np.ndarray, ranks: int, batch_size: int, accumulation: int) -> np.ndarray:
    """Per complete optimizer step: max / mean over ranks of the summed ``values`` of each rank's rows, with
    consecutive batches of ``batch_size`` rows going to ranks in turn."""
    per_step = ranks * batch_size * accumulation
    ratios = []
    for start in range(0, len(order) - per_step + 1, per_step):
        step = np.asarray(order[start : start + per_step]).reshape(accumulation, ranks, batch_size)
        totals = values[step].sum(axis=(0, 2))
        ratios.append(totals.max() / totals.mean())
    return np.asarray(ratios)


def samples_per_step_spread(order: list[int], counts: np.ndarray, per_step: int) -> float:
    sums = [int(counts[order[k : k + per_step]].sum()) for k in range(0, len(order) - per_step + 1, per_step)]
    return statistics.pstdev(sums) / statistics.fmean(sums)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--main-samples", type=int, default=400_000)
    parser.add_argument("--long-samples", type=int, default=150_000)
    args = parser.parse_args(argv)

    import logging

    import datasets

    datasets.disable_progress_bars()
    logging.getLogger("unpack_trainer").setLevel(logging.ERROR)
    from types import SimpleNamespace

    from unpack_trainer.data.packing import windowed_packing
    from unpack_trainer.data.sampler import attention_cost_ratio, balanced_rank_order, balanced_step_order, row_costs

    ratio = attention_cost_ratio(SimpleNamespace(**LLAMA3_8B))
    print_header("Rank balance per optimizer step (simulated): today's order vs balanced_rank_order")
    command = "python benchmarks/bench_rank_balance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"`{command.strip()}`\n")
    print(
        f"r = {ratio:.3g} (Llama-3-8B FLOPs); batch size {args.batch_size}, {args.accumulation} accumulation steps\n"
    )
    data = {
        "main job, rows of 2048": (main_job_lengths(args.main_samples, 2048), 2048),
        "long context, rows of 32768": (long_context_lengths(args.long_samples, 32768), 32768),
    }
    headers = [
        "data",
        "attention",
        "ranks",
        "steps",
        "order",
        "cost max/mean: mean (worst step)",
        "samples max/mean: mean (worst)",
        "samples/step std/mean",
        "seconds",
    ]
    table = []
    for name, (lengths, max_length) in data.items():
        rows = windowed_packing(lengths, max_length, seed=0).rows
        seq_lengths = [[int(lengths[i]) for i in row] for row in rows]
        counts = np.asarray([len(row) for row in rows], dtype=np.int64)
        for scale in (1, 4):
            r = ratio * scale
            costs = row_costs(seq_lengths, r)
            share = r * max_length / (1 + r * max_length)
            for ranks in args.ranks:
                per_step = ranks * args.batch_size * args.accumulation
                usable = len(rows) - len(rows) % (ranks * args.batch_size)
                orders = {}
                start = time.perf_counter()
                orders["before"] = balanced_step_order(counts, per_step, seed=0)
                before_s = time.perf_counter() - start
                start = time.perf_counter()
                orders["after"] = balanced_rank_order(
                    counts[:usable],
                    costs[:usable],
                    num_ranks=ranks,
                    batch_size=args.batch_size,
                    accumulation_steps=args.accumulation,
                    seed=0,
                )
                seconds = {"before": before_s, "after": time.perf_counter() - start}
                for label, order in orders.items():
                    cost = step_ratios(order, costs, ranks, args.batch_size, args.accumulation)
                    samples = step_ratios(order, counts.astype(np.float64), ranks, args.batch_size, args.accumulation)
                    table.append(
                        [
                            name,
                            f"x{scale}: {share:.0%} of a one-sample row",
                            ranks,
                            cost.size,
                            label,
                            f"{cost.mean():.3f} ({cost.max():.3f})",
                            f"{samples.mean():.3f} ({samples.max():.3f})",
                            f"{samples_per_step_spread(order, counts, per_step):.3f}",
                            f"{seconds[label]:.2f}",
                        ]
                    )
                    print(format_table(headers, table[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
