"""The tensor packing API: our ``pack_sequences`` / ``concatenate_and_pack`` vs fast-axolotl's (Rust) on the same inputs.

    python benchmarks/bench_packing_api.py                              # 10k, 100k and 1M sequences, 5 repeats
    python benchmarks/bench_packing_api.py --sizes 10000 100000 --repeats 5 --inputs lists tensors

fast-axolotl is optional (``pip install fast-axolotl``, or the ``bench`` extra); without it only ``unpack`` runs and
a line says so. Everything runs on one thread (``torch.set_num_threads(1)``, ``RAYON_NUM_THREADS=1``), each size and
input kind in its own process.

Inputs: ``n`` sequences with lognormal lengths (median 180, sigma 0.8) clipped to ``[8, max_length - 2]`` (fast-axolotl
0.2.0's ``pack_sequences`` panics on a sample of ``max_length - 1`` tokens or more), ids uniform in ``[3, 32000)``;
labels are separate lists with the first quarter of each sample ``-100`` (a prompt), attention masks all ones
(``[1] * length``). Three kinds, the same values:

- ``lists``: lists of Python ints, every id and label its own ``int`` object (``.tolist()`` of a numpy array: what a
  tokenizer or ``datasets`` returns), about 88 bytes per token for the three fields;
- ``pooled``: lists whose ints are references into one shared list of the ``int`` objects ``-100 .. 31999`` (8 bytes
  per token and field, 24 in all: what fits in memory at 1M sequences), otherwise the same lists;
- ``tensors``: one 1-D int64 tensor per sample and field. fast-axolotl takes only lists, so its time includes
  ``[t.tolist() for t in tensors]``.

Calls: ``pack_sequences(ids, max_length, pad_token_id=0, eos_token_id=2)`` (fast-axolotl: ``pack_sequences(ids,
max_length, 0, 2, -100)``); ``concatenate_and_pack(ids, labels, masks, max_length, 0)`` (fast-axolotl has no
separator there). Ours returns int64 tensors (with the sample index and a masked first label per sample) and checks
every id, label and mask value; fast-axolotl returns Python lists of lists (input ids, labels and an attention mask
of 0/1, which lets samples of a row attend to each other), which the timing leaves as they are.

Columns: seconds (wall, median and min-max over interleaved repeats), CPU seconds (``time.process_time``, the
figure the other processes of a shared machine disturb least), tokens per second (input tokens / median wall), peak
memory above the inputs (the process's peak resident set, reset before each call; max over repeats), and the
speed-up of ``unpack`` over fast-axolotl per repeat (CPU time, paired within a repeat).

Memory guard: a size and input kind whose inputs would not fit in the available memory is skipped, and so is a
provider whose peak per token at the previous size, scaled to this one, would not (a line says which, with the
figures). On the 24 GB CI box that leaves out ``lists`` at 1M sequences (its inputs: about 24 GB) and fast-axolotl
at 1M (its Python-list outputs, about 85 bytes per token: 22 GB for ``pooled``, 39 GB for ``tensors``).
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
INPUTS = ("lists", "pooled", "tensors")
EOS, PAD = 2, 0


def _fast_axolotl():
    try:
        import fast_axolotl
    except ImportError:
        return None
    return fast_axolotl if fast_axolotl.is_available() else None


#: Bytes per input token (ids, labels and masks together) each input kind holds, and that building it needs on top.
INPUT_BYTES = {"lists": 88, "pooled": 24, "tensors": 24}
BUILD_BYTES = 16


def _lengths(n: int, max_length: int) -> np.ndarray:
    return lognormal_lengths(n, median=180, sigma=0.8, low=8, high=max_length - 2, seed=0)


def _inputs(n: int, max_length: int, kind: str) -> tuple[list, list, list, int]:
    """``(ids, labels, masks, tokens)`` of one input kind (see the module docstring)."""
    lengths = _lengths(n, max_length)
    ids = np.random.default_rng(0).integers(3, 32000, size=int(lengths.sum()))
    labels = ids.copy()
    for start, size in zip((np.cumsum(lengths) - lengths).tolist(), (lengths // 4).tolist()):
        labels[start : start + size] = -100  # the prompt
    cuts = np.cumsum(lengths)[:-1]
    if kind == "tensors":
        import torch

        as_tensor = torch.from_numpy
        masks = [torch.ones(int(size), dtype=torch.int64) for size in lengths]
        return (
            [as_tensor(p) for p in np.split(ids, cuts)],
            [as_tensor(x) for x in np.split(labels, cuts)],
            masks,
            ids.size,
        )
    if kind == "lists":
        to_list = np.ndarray.tolist
    else:  # pooled: the same values, every int a reference into one list
        pool = list(range(-100, 32000))
        ids += 100
        labels += 100

        def to_list(piece: np.ndarray) -> list[int]:
            return list(map(pool.__getitem__, piece.tolist()))

    out_ids = [to_list(p) for p in np.split(ids, cuts)]
    del ids
    out_labels = [to_list(x) for x in np.split(labels, cuts)]
    return out_ids, out_labels, [[1] * size for size in lengths.tolist()], int(lengths.sum())


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


def _memory_kb(field: str, path: str = "/proc/self/status") -> int:
    with open(path) as status:
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


def _available_mb() -> float:
    return _memory_kb("MemAvailable", "/proc/meminfo") / 1024


def run_size(n: int, max_length: int, repeats: int, kind: str, providers: dict[str, float]) -> dict:
    """One size and input kind, in this process: interleaved repeats of every (function, provider).

    ``providers``: name -> estimated peak MB (0: unknown); a provider whose estimate exceeds the memory available once
    the inputs are built is skipped, with the reason in ``skipped``.
    """
    import torch

    torch.set_num_threads(1)
    ids, labels, masks, tokens = _inputs(n, max_length, kind)
    gc.collect()
    available = _available_mb()
    skipped = {
        name: f"not run: needs about {need / 1024:,.1f} GB at its peak per token at the previous size, "
        f"{available / 1024:,.1f} GB available"
        for name, need in providers.items()
        if need > 0.9 * available
    }
    running = [name for name in providers if name not in skipped]
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats):
        for function in FUNCTIONS:
            for provider in running:
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
    return {"tokens": tokens, "results": results, "skipped": skipped}


def _cell(values: list[float], fmt: str = ".3f") -> str:
    median = float(np.median(values))
    return f"{median:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else f"{median:{fmt}}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inputs", nargs="+", choices=INPUTS, default=list(INPUTS))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: "n:kind:provider=MB,...", one process per case
    args = parser.parse_args(argv)
    if args.case:
        n, kind, providers = args.case.split(":")
        estimates = {name: float(mb) for name, mb in (item.split("=") for item in providers.split(","))}
        print(json.dumps(run_size(int(n), args.max_length, args.repeats, kind, estimates)))
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
    headers = ["sequences", "input", "function", "provider", "seconds", "CPU seconds", "tokens/s", "peak MB"]
    print(format_table([*headers, "unpack speed-up"], []), flush=True)  # rows follow as each case ends
    notes = []
    peak_per_token: dict[tuple[str, str], float] = {}  # (kind, provider) -> MB per token at the last size run
    for n in args.sizes:
        tokens = int(_lengths(n, args.max_length).sum())
        for kind in args.inputs:
            need = tokens * (INPUT_BYTES[kind] + BUILD_BYTES) / 2**20
            if need > 0.9 * _available_mb():
                notes.append(
                    f"{n:,} {kind}: not run, its inputs need about {need / 1024:,.1f} GB, "
                    f"{_available_mb() / 1024:,.1f} GB available"
                )
                continue
            estimates = ",".join(f"{p}={peak_per_token.get((kind, p), 0.0) * tokens:.0f}" for p in providers)
            command = [os.path.abspath(__file__), "--case", f"{n}:{kind}:{estimates}"]
            command += ["--max-length", str(args.max_length), "--repeats", str(args.repeats)]
            try:
                data = run_in_subprocess(command, timeout=7200)
            except RuntimeError as error:  # e.g. killed for memory by the kernel: say so, go on with the rest
                last = str(error).strip().splitlines()[-1]
                if last.startswith("benchmark case"):
                    last = "its process ended without an error message: killed, for memory?"
                notes.append(f"{n:,} {kind}: failed ({last[:200]})")
                continue
            for provider, reason in data["skipped"].items():
                notes.append(f"{n:,} {kind}: {provider} {reason}")
            for function in FUNCTIONS:
                ours = data["results"].get(f"{function}:unpack")
                for provider in providers:
                    entry = data["results"].get(f"{function}:{provider}")
                    if entry is None:
                        continue
                    peak = max(entry["peak_mb"]) / data["tokens"]
                    peak_per_token[kind, provider] = max(peak, peak_per_token.get((kind, provider), 0.0))
                    speedup = ""
                    if provider != "unpack" and ours is not None:
                        speedup = ratio_cell([o / f for o, f in zip(entry["cpu"], ours["cpu"])])
                    row = [
                        f"{n:,}",
                        kind,
                        function,
                        provider,
                        _cell(entry["wall"]),
                        _cell(entry["cpu"]),
                        f"{data['tokens'] / float(np.median(entry['wall'])) / 1e6:.1f}M",
                        f"{max(entry['peak_mb']):,.0f}",
                        speedup,
                    ]
                    print(format_table(headers, [row]).splitlines()[-1], flush=True)
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
