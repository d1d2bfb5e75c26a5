"""The tensor packing API: our ``pack_sequences`` / ``concatenate_and_pack`` vs fast-axolotl's (Rust) on the same inputs.

    python benchmarks/bench_packing_api.py                              # 10k, 100k and 1M sequences
    python benchmarks/bench_packing_api.py --sizes 10000 100000 --repeats 5

fast-axolotl is optional (``pip install fast-axolotl``, or the ``bench`` extra); without it only ``unpack`` runs and
a line says so. Everything runs on one thread (``torch.set_num_threads(1)``, ``RAYON_NUM_THREADS=1``), each size in
its own process.

Inputs: ``n`` sequences with lognormal lengths (median 180, sigma 0.8) clipped to ``[8, max_length - 2]`` (fast-axolotl
0.2.0's ``pack_sequences`` panics on a sample of ``max_length - 1`` tokens or more), ids uniform in ``[3, 32000)``;
labels are separate lists with the first quarter of each sample ``-100`` (a prompt), attention masks all ones.
``lists``: lists of Python ints, given to both. ``tensors``: one 1-D int64 tensor per sample; fast-axolotl takes only
lists, so its time includes ``[t.tolist() for t in tensors]``.

Calls: ``pack_sequences(ids, max_length, pad_token_id=0, eos_token_id=2)`` (fast-axolotl: ``pack_sequences(ids,
max_length, 0, 2, -100)``); ``concatenate_and_pack(ids, labels, masks, max_length, 0)`` (fast-axolotl has no
separator there). Ours returns int64 tensors (with the sample index and a masked first label per sample);
fast-axolotl returns Python lists of lists, which the timing leaves as they are (converting them to tensors would
add to its time).

Columns: seconds (wall, median and min-max over interleaved repeats), CPU seconds (``time.process_time``, the
figure the other processes of a shared machine disturb least), tokens per second (input tokens / median wall), peak
memory above the inputs (the process's peak resident set, reset before each call; max over repeats), and the
speed-up of ``unpack`` over fast-axolotl per repeat (CPU time, paired within a repeat).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import format_table, lognormal_lengths, print_header, run_in_subprocess  # noqa: E402

from unpack_trainer.cli.trainer_comparison import ratio_cell  # noqa: E402

FUNCTIONS = ("pack_sequences", "concatenate_and_pack")
INPUTS = ("lists", "tensors")
EOS, PAD = 2, 0


def _fast_axolotl():
    try:
        import fast_axolotl
    except ImportError:
        return None
    return fast_axolotl if fast_axolotl.is_available() else None


def _inputs(n: int, max_length: int, kind: str) -> tuple[list, list, list, int]:
    lengths = lognormal_lengths(n, median=180, sigma=0.8, low=8, high=max_length - 2, seed=0)
    ids = np.random.default_rng(0).integers(3, 32000, size=int(lengths.sum()))
    cuts = np.cumsum(lengths)[:-1]
    pieces = np.split(ids, cuts)
    labels = [piece.copy() for piece in pieces]
    for label in labels:
        label[: label.size // 4] = -100
    if kind == "lists":
        return [p.tolist() for p in pieces], [x.tolist() for x in labels], [[1] * p.size for p in pieces], ids.size
    import torch

    as_tensor = torch.from_numpy
    masks = [torch.ones(p.size, dtype=torch.int64) for p in pieces]
    return [as_tensor(p) for p in pieces], [as_tensor(x) for x in labels], masks, ids.size


def _call(provider: str, function: str, ids: list, labels: list, masks: list, max_length: int, kind: str):
    if provider == "unpack":
        from unpack_trainer import concatenate_and_pack, pack_sequences

        if function == "pack_sequences":
            return pack_sequences(ids, max_length, PAD, eos_token_id=EOS)
        return concatenate_and_pack(ids, labels, masks, max_length, PAD)
    fa = _fast_axolotl()
    if kind == "tensors":  # fast-axolotl takes lists only
        ids = [t.tolist() for t in ids]
        if function == "concatenate_and_pack":
            labels, masks = [t.tolist() for t in labels], [t.tolist() for t in masks]
    if function == "pack_sequences":
        return fa.pack_sequences(ids, max_length, PAD, EOS, -100)
    return fa.concatenate_and_pack(ids, labels, masks, max_length, PAD, -100)


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def run_size(n: int, max_length: int, repeats: int, kind: str, providers: list[str]) -> dict:
    """One size and input kind, in this process: interleaved repeats of every (function, provider)."""
    import torch

    torch.set_num_threads(1)
    ids, labels, masks, tokens = _inputs(n, max_length, kind)
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats):
        for function in FUNCTIONS:
            for provider in providers:
                gc.collect()
                can_reset = _reset_peak()
                before = _memory_kb("VmRSS")
                wall, cpu = time.perf_counter(), time.process_time()
                out = _call(provider, function, ids, labels, masks, max_length, kind)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                peak = (_memory_kb("VmHWM") - before) / 1024 if can_reset else float("nan")
                del out
                entry = results.setdefault(f"{function}:{provider}", {"wall": [], "cpu": [], "peak_mb": []})
                entry["wall"].append(wall)
                entry["cpu"].append(cpu)
                entry["peak_mb"].append(peak)
    return {"tokens": tokens, "results": results}


def _cell(values: list[float], fmt: str = ".3f") -> str:
    median = float(np.median(values))
    return f"{median:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else f"{median:{fmt}}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inputs", nargs="+", choices=INPUTS, default=list(INPUTS))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: "n:kind:providers", one process per size
    args = parser.parse_args(argv)
    if args.case:
        n, kind, providers = args.case.split(":")
        print(json.dumps(run_size(int(n), args.max_length, args.repeats, kind, providers.split(","))))
        return

    print_header("Tensor packing API: unpack vs fast-axolotl")
    fa = _fast_axolotl()
    providers = ["unpack"]
    if fa is None:
        print("fast-axolotl is not installed (pip install fast-axolotl): only `unpack` runs.\n")
    else:
        providers.append("fast_axolotl")
        print(f"fast-axolotl {fa.get_version()}\n")
    print(f"rows of {args.max_length}, {args.repeats} interleaved repeats, one thread\n")
    rows = []
    for n in args.sizes:
        for kind in args.inputs:
            command = [os.path.abspath(__file__), "--case", f"{n}:{kind}:{','.join(providers)}"]
            command += ["--max-length", str(args.max_length), "--repeats", str(args.repeats)]
            data = run_in_subprocess(command, timeout=7200)
            for function in FUNCTIONS:
                ours = data["results"][f"{function}:unpack"]
                for provider in providers:
                    entry = data["results"][f"{function}:{provider}"]
                    speedup = "1.00x"
                    if provider != "unpack":
                        speedup = ratio_cell([o / f for o, f in zip(entry["cpu"], ours["cpu"])])
                    rows.append(
                        [
                            f"{n:,}",
                            kind,
                            function,
                            provider,
                            _cell(entry["wall"]),
                            _cell(entry["cpu"]),
                            f"{data['tokens'] / float(np.median(entry['wall'])) / 1e6:.1f}M",
                            f"{max(entry['peak_mb']):,.0f}",
                            speedup if provider != "unpack" else "",
                        ]
                    )
    headers = ["sequences", "input", "function", "provider", "seconds", "CPU seconds", "tokens/s", "peak MB"]
    print(format_table([*headers, "unpack speed-up"], rows))


if __name__ == "__main__":
    main()
