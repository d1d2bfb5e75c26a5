"""Two data-parallel processes (gloo, this machine's CPU): how long the faster one waits for the slower at every
optimizer step, with today's row order and with ``balanced_rank_order``.

    python benchmarks/bench_rank_wait.py            # about 3 minutes on 2 cores

Each process trains the same tiny Llama (hidden 64, 2 layers, SDPA, patched so a packed row costs what its samples
cost) on packed rows of 4,096 tokens (lognormal documents, median 600, sigma 1.0, clipped to [16, 4096]; one row per
process per step). ``b / a`` of the cost model is measured first on this model
([`unpack_trainer.data.sampler.measure_attention_cost_ratio`]). Every step each process times its forward and backward,
then the two exchange their times (``all_reduce``): the wait is the slower one's time minus the faster one's. The
orders run interleaved (before, after, before, after), torch on one thread per process; the table gives the median
and mean wait per step and its share of the slower process's time.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import format_table, print_header  # noqa: E402

MAX_LENGTH, NUM_ROWS, ROUNDS = 4096, 48, 2


def _rows() -> list[list[int]]:
    from unpack_trainer.data.packing import windowed_packing

    lengths = np.clip(np.rint(np.random.default_rng(0).lognormal(np.log(600), 1.0, 400)), 16, MAX_LENGTH)
    lengths = lengths.astype(np.int64)
    rows = windowed_packing(lengths, MAX_LENGTH, seed=0).rows[:NUM_ROWS]
    return [[int(lengths[i]) for i in row] for row in rows]


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from unpack_trainer import patch_model
    from unpack_trainer.data.sampler import (
        balanced_rank_order,
        balanced_step_order,
        measure_attention_cost_ratio,
        row_costs,
    )
    from unpack_trainer.model_zoo.tiny import packed_batch, tiny_model

    model = tiny_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=MAX_LENGTH,
        attn_implementation="sdpa",
    )
    patch_model(model)
    ratio = torch.tensor([measure_attention_cost_ratio(model, MAX_LENGTH) if rank == 0 else 0.0])
    dist.broadcast(ratio, 0)
    seq_lengths = _rows()
    counts = np.asarray([len(row) for row in seq_lengths])
    costs = row_costs(seq_lengths, float(ratio))
    orders = {
        "before": balanced_step_order(counts, 2, seed=0),  # accelerate: batch k to rank k % 2
        "after": balanced_rank_order(counts, costs, num_ranks=2, batch_size=1, seed=0),
    }
    generator = torch.Generator().manual_seed(rank)
    waits: dict[str, list[tuple[float, float]]] = {name: [] for name in orders}
    for _ in range(ROUNDS):
        for name, order in orders.items():
            for start in range(0, len(order) - 1, 2):
                lengths = seq_lengths[order[start + rank]]
                batch = packed_batch([torch.randint(256, (n,), generator=generator) for n in lengths])
                begin = time.perf_counter()
                model(**batch).loss.backward()
                own = time.perf_counter() - begin
                model.zero_grad(set_to_none=True)
                both = [torch.zeros(1), torch.zeros(1)]
                dist.all_gather(both, torch.tensor([own]))
                slow, fast = max(float(t) for t in both), min(float(t) for t in both)
                waits[name].append((slow - fast, slow))
    if rank == 0:
        queue.put((float(ratio), waits, costs, orders))
    dist.destroy_process_group()


def main() -> None:
    print_header("Two gloo processes: per-step wait of the faster process for the slower")
    print("`python benchmarks/bench_rank_wait.py`\n")
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    processes = [context.Process(target=_worker, args=(rank, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    ratio, waits, costs, orders = queue.get()
    for process in processes:
        process.join()
    headers = ["order", "steps", "wait per step: median (mean) ms", "wait / slower step", "model cost max/mean"]
    table = []
    for name, values in waits.items():
        gaps = [gap for gap, _ in values]
        share = sum(gaps) / sum(slow for _, slow in values)
        order = orders[name]
        pairs = np.asarray(order[: len(order) // 2 * 2]).reshape(-1, 2)
        model_ratio = (costs[pairs].max(axis=1) / costs[pairs].mean(axis=1)).mean()
        table.append(
            [
                name,
                len(values),
                f"{1000 * statistics.median(gaps):.0f} ({1000 * statistics.fmean(gaps):.0f})",
                f"{share:.1%}",
                f"{model_ratio:.3f}",
            ]
        )
    print(
        f"measured b/a = {ratio:.3g} (attention {ratio * MAX_LENGTH / (1 + ratio * MAX_LENGTH):.0%} of a "
        f"one-sample row of {MAX_LENGTH}); {NUM_ROWS} rows, {ROUNDS} interleaved rounds per order\n"
    )
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
