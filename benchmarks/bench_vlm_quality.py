"""The vision-language example over seeds: held-out loss and speed of packed vs padded training, paired per seed.

    python benchmarks/bench_vlm_quality.py                    # the example's defaults, seeds 0-3, one at a time
    python benchmarks/bench_vlm_quality.py --seeds 0 1 2 --train 64 --json /tmp/vlm.json   # smaller

Each seed runs ``examples/vlm_packing.py`` as it is (its ``compare``: the packed run, then the padded run, in one
process, the arms interleaved seed by seed), with the example's defaults unless an option here overrides one: a small
Qwen2.5-VL built from its config (text model hidden 256, 4 layers; 2-layer vision tower), random init from the seed,
the drawn shapes with captions of :mod:`unpack_trainer.data.default_vision_data` (examples and held-out examples
drawn from the seed), AdamW at a constant learning rate, fp32 on the CPU. Both arms start from the same weights, see
the same examples for the same epochs, and take about the same optimizer steps of about the same examples (the padded
batch is the packed run's mean examples per step); both losses are the mean over the step's trained tokens. The
held-out loss is the token-mean next-token loss of the held-out examples, computed the same way for both.

Printed: per arm the mean ± std over seeds of the held-out loss, the final training loss (mean of the losses logged
over the last 10% of the steps), steps, examples per step, training wall-clock and real tokens/s; the paired
difference packed - padded per seed (mean ± std, standard error) with a verdict (within the seed noise when the mean
difference is within two standard errors of 0), and the speed-up (packed real tokens/s over padded, per seed). Every
seed's figures go to ``benchmarks/RESULTS_vlm_quality.json`` (``--json``), which the example reads to place its own
seed's difference. ``--jobs 2`` runs two seeds at once (faster; the two then share the cores, so their timings do
too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "examples"))

from common import environment, format_table, mean_std, run_seeded_cases  # noqa: E402

RESULTS_JSON = Path(__file__).resolve().parent / "RESULTS_vlm_quality.json"
# the example's options this benchmark can override (None: the example's default)
OVERRIDES = ("model_type", "train", "held_out", "epochs", "max_length", "rows_per_step", "learning_rate", "threads")


def example_options(options: argparse.Namespace, seed: int) -> argparse.Namespace:
    """The example's options for ``seed``: its defaults, with the ones given here."""
    import vlm_packing

    args = ["--seed", str(seed), "--output-dir", f"/tmp/bench_vlm_quality/{seed}"]
    for name in OVERRIDES:
        value = getattr(options, name)
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    return vlm_packing.build_parser().parse_args(args)


def run_case(seed: int, options: argparse.Namespace) -> dict:
    """One seed: the example's two runs; the figures of each and the paired ones."""
    import vlm_packing
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    disable_progress_bar()
    start = time.perf_counter()
    packed, padded = vlm_packing.compare(example_options(options, seed))
    return {
        "seconds": time.perf_counter() - start,  # both runs, their set-up and held-out losses: the example's work
        "arm": "packed+padded",
        "seed": seed,
        "packed": packed,
        "padded": padded,
        "held_out_difference": packed["held-out loss"] - padded["held-out loss"],
        "speedup": packed["real tokens/s"] / padded["real tokens/s"],
        "cpu_speedup": padded["CPU time (s)"] / packed["CPU time (s)"],
    }


def summarize(seeds: list[dict]) -> str:
    """The table (per arm: mean ± std over seeds; the paired difference packed - padded) and the verdict lines."""
    metrics = [
        ("held-out loss/token", "held-out loss", ".4f"),
        ("final train loss", "final train loss", ".4f"),
        ("steps", "steps", ".1f"),
        ("examples/step", "samples/step", ".2f"),
        ("train wall-clock (s)", "wall-clock (s)", ".0f"),
        ("real tokens/s", "real tokens/s", ",.0f"),
        ("train CPU time (s)", "CPU time (s)", ".0f"),
    ]
    rows = []
    for label, key, fmt in metrics:
        values = {arm: [float(s[arm][key]) for s in seeds] for arm in ("padded", "packed")}
        cells = ["{:{f}} ± {:{f}}".format(*mean_std(values[arm]), f=fmt) for arm in ("padded", "packed")]
        paired = "-"
        if key.endswith("loss"):
            mean, std = mean_std([b - a for a, b in zip(values["padded"], values["packed"])])
            paired = f"{mean:+.4f} ± {std:.4f} (se {std / math.sqrt(len(seeds)):.4f})"
        rows.append([label, *cells, paired])
    table = format_table(["metric", "padded", "packed", "packed - padded (paired)"], rows)
    per_seed = format_table(
        ["seed", "held-out padded", "held-out packed", "packed - padded", "speed-up (real tokens/s)", "in CPU time"],
        [[s["seed"], f"{s['padded']['held-out loss']:.4f}", f"{s['packed']['held-out loss']:.4f}",
          f"{s['held_out_difference']:+.4f}", f"{s['speedup']:.2f}x", f"{s['cpu_speedup']:.2f}x"] for s in seeds],
    )  # fmt: skip
    differences = [s["held_out_difference"] for s in seeds]
    mean, std = mean_std(differences)
    se = std / math.sqrt(len(differences))
    padded_std = mean_std([s["padded"]["held-out loss"] for s in seeds])[1]
    within = abs(mean) <= 2 * se
    speedups = [s["speedup"] for s in seeds]
    lines = [
        table,
        "",
        per_seed,
        "",
        f"held-out loss, packed - padded over {len(seeds)} seeds: {mean:+.4f} ± {std:.4f} (se {se:.4f}; the padded "
        f"arm's own std over seeds {padded_std:.4f}) -> {'WITHIN' if within else 'OUTSIDE'} the seed noise "
        f"({abs(mean) / se if se else float('inf'):.1f} standard errors from 0)",
        f"speed-up, packed over padded real tokens/s: {statistics.fmean(speedups):.2f}x mean "
        f"({min(speedups):.2f}-{max(speedups):.2f}x over seeds); in CPU time "
        f"{statistics.fmean(s['cpu_speedup'] for s in seeds):.2f}x; the example's work per seed (both runs, set-up "
        f"and held-out losses) {statistics.fmean(s['seconds'] for s in seeds) / 60:.1f} minutes",
    ]
    return "\n".join(lines)


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once, one process each")
    parser.add_argument("--threads", type=int, help="the example's --threads (torch CPU threads per process)")
    parser.add_argument("--json", type=Path, default=RESULTS_JSON, help="where to write every seed's figures")
    parser.add_argument("--model-type", help="the example's --model-type (default: the example's)")
    parser.add_argument("--train", type=int, help="the example's --train")
    parser.add_argument("--held-out", type=int, help="the example's --held-out")
    parser.add_argument("--epochs", type=float, help="the example's --epochs")
    parser.add_argument("--max-length", type=int, help="the example's --max-length")
    parser.add_argument("--rows-per-step", type=int, help="the example's --rows-per-step")
    parser.add_argument("--learning-rate", type=float, help="the example's --learning-rate")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.case:
        print(json.dumps(run_case(int(options.case.split(":")[1]), options)))
        return

    shared = [item for name in OVERRIDES if getattr(options, name) is not None
              for item in ("--" + name.replace("_", "-"), str(getattr(options, name)))]  # fmt: skip
    load_before, start = load_average(), time.perf_counter()
    seeds = run_seeded_cases(
        __file__,
        [("packed+padded", seed) for seed in options.seeds],
        shared,
        jobs=options.jobs,
        timeout=3600,
        describe=lambda s: (
            f"held-out packed {s['packed']['held-out loss']:.4f} padded {s['padded']['held-out loss']:.4f}"
            f", speed-up {s['speedup']:.2f}x, {s['packed']['wall-clock (s)'] + s['padded']['wall-clock (s)']:.0f} s"
        ),
    )
    wall_s = time.perf_counter() - start
    settings = vars(example_options(options, options.seeds[0]))
    command = "python benchmarks/bench_vlm_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = environment()
    payload = {
        "command": command.strip(),
        "environment": env,
        "options": {name: settings[name] for name in OVERRIDES},
        "jobs": options.jobs,
        "load_average": {"before": load_before, "after": load_average()},
        "wall_s": wall_s,
        "seeds": seeds,
    }
    options.json.write_text(json.dumps(payload, indent=1) + "\n")
    print()
    print(
        f"## examples/vlm_packing.py over seeds {' '.join(map(str, options.seeds))}: "
        + ", ".join(f"{name} {settings[name]}" for name in OVERRIDES)
    )
    print(f"\n`{command.strip()}`\n")
    print(", ".join(f"{k} {v}" for k, v in env.items()) + f"; load average {load_before} before, "
          f"{payload['load_average']['after']} after; {options.jobs} job(s); total {wall_s:.0f} s\n")  # fmt: skip
    print(summarize(seeds))
    print(f"\nruns written to {options.json}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
