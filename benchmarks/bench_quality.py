"""Quality of packed training: held-out loss of padded vs packed runs (and packing variants), over several seeds.

    python benchmarks/bench_quality.py                      # docs/quality.md's arms: 15 seeds, 3 arms, 2 processes
    python benchmarks/bench_quality.py --seeds 0 1 2 --arms padded packed_bfd packed_shuffled
    python benchmarks/bench_quality.py --analyze            # no training: how each arm composes its steps
    python benchmarks/bench_quality.py --quick              # smoke test: 1 seed, 64 samples, 2 arms
    python benchmarks/bench_quality.py --summarize benchmarks/RESULTS_quality.json  # stored runs: table, seed noise

Every arm trains the tiny Llama of the main job (``examples/sft_packing.py``: hidden 128, 2 layers, about 0.4M
parameters, random init) on the embedded instruction data (3,991 trained samples of 10 to 1,629 tokens), for the
same number of epochs, from the same initial weights for a given seed (the seed also sets the data order and the
packing shuffle), with the same optimizer and cosine learning-rate schedule. The padded arm's batch size is the
average number of samples in the packed arms' optimizer steps, so every arm takes about the same number of steps of
about the same number of samples. The held-out loss is the mean next-token loss over every trained token of the 200
held-out samples, computed the same way for every arm. Runs go seed by seed, the arms in turn within a seed, in one
process, with torch on one thread (the machine is shared).

The default is the main job's configuration (``examples/sft_packing.py`` with its defaults): all 3,944 prepared
training samples, rows of 512 tokens (longer samples, about 3%, are truncated in every arm), 2 rows per optimizer
step (about 10 samples per step), one epoch, fp32; 15 seeds, since one packed run's held-out loss varies by about
0.04 over seeds. The run of docs/quality.md took about 40 minutes on 2 shared cores (``--jobs 2``).
``--train-samples 2000 --seeds 0 1 2`` is the smaller set-up of the first table (docs/quality.md).

Arms (``--arms``):

- ``padded``: ``padding_free=False``, random batches padded to their longest sample (what ``trl.SFTTrainer`` does).
- ``packed_bfd``: ``packing=True, packing_order="decreasing"``: best-fit decreasing, the packer before this benchmark.
- ``packed_shuffled``: ``packing_order="shuffled"``: rows mix lengths at random, as full as best-fit decreasing.
- ``packed_bfd_sample``, ``packed_shuffled_sample``: the same with ``loss_normalization="sample"``.
- ``packed_shuffled_balanced``: shuffled rows, each step composed of rows with balanced sample counts.
- ``packed_windowed_balanced``: ``packing_order="windowed"``: rows of samples that follow each other in a seeded
  random order (best fit over the last few open rows, the window widening only as far as needed for at most 1% more
  rows than best-fit decreasing), balanced steps.
- ``packed_window4_balanced``: the same with the window fixed at 4 open rows (``packing_window=4``, the default
  until the window widened by itself; a row of the 15-seed table of docs/quality.md).
- ``packed_shuffled_cap``: shuffled rows of at most ``2 x`` the mean samples per row.
- ``padded_sample``: padded with ``loss_normalization="sample"``.
- ``padding_free``: the padded arm's random batches flattened into one row (``padding_free=True``): the padded arm's
  step composition through the packed attention path, a control for the packed kernels' numerics in training.

The arm whose settings are ``unpack_trainer.SFTConfig``'s defaults is marked "(default)" in the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, format_table, quiet_case  # noqa: E402

from unpack_trainer.cli.sft_comparison import checkpointing_off, held_out_loss  # noqa: E402

_UNBALANCED = {"balance_samples_per_step": False}
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "padded": ("padded (trl default)", {"packing": False, "padding_free": False}),
    "packed_bfd": ("packed, best-fit decreasing", {"packing": True, "packing_order": "decreasing", **_UNBALANCED}),
    "packed_shuffled": ("packed, shuffled best fit", {"packing": True, "packing_order": "shuffled", **_UNBALANCED}),
    "packed_bfd_sample": (
        "packed, best-fit decreasing, per-sample loss",
        {"packing": True, "packing_order": "decreasing", "loss_normalization": "sample", **_UNBALANCED},
    ),
    "packed_shuffled_sample": (
        "packed, shuffled, per-sample loss",
        {"packing": True, "packing_order": "shuffled", "loss_normalization": "sample", **_UNBALANCED},
    ),
    "packed_shuffled_balanced": (
        "packed, shuffled, balanced steps",
        {"packing": True, "packing_order": "shuffled", "balance_samples_per_step": True},
    ),
    "packed_windowed_balanced": (
        "packed, windowed (widens as needed), balanced steps",
        {"packing": True, "packing_order": "windowed", "balance_samples_per_step": True},
    ),
    "packed_window4_balanced": (
        "packed, windowed (4 open rows), balanced steps",
        {"packing": True, "packing_order": "windowed", "packing_window": 4, "balance_samples_per_step": True},
    ),
    "packed_shuffled_cap": (
        "packed, shuffled, <= 2x mean samples/row",
        {"packing": True, "packing_order": "shuffled", **_UNBALANCED},
    ),
    "padded_sample": (
        "padded, per-sample loss",
        {"packing": False, "padding_free": False, "loss_normalization": "sample"},
    ),
    "padding_free": (
        "padding-free (the padded batches, flattened)",
        {"packing": False, "padding_free": True},
    ),
}
DEFAULT_ARMS = ("padded", "packed_shuffled_balanced", "packed_windowed_balanced")
LEVERS = ("packing_order", "packing_window", "max_samples_per_row", "loss_normalization", "balance_samples_per_step")


def default_packed_arm() -> str:
    """The arm whose settings are ``unpack_trainer.SFTConfig``'s defaults for every lever."""
    from unpack_trainer import SFTConfig

    fields = {f.name: f.default for f in dataclasses.fields(SFTConfig)}
    for arm, (_, overrides) in ARMS.items():
        if overrides.get("packing") and arm != "packed_shuffled_cap":
            if all(overrides.get(name, fields[name]) == fields[name] for name in LEVERS):
                return arm
    raise RuntimeError("no arm has the default settings")


RESULTS_JSON = Path(__file__).resolve().parent / "RESULTS_quality.json"  # the default run


@dataclasses.dataclass
class Run:
    """One training run. ``samples_per_step`` holds the sample count of every optimizer step."""

    arm: str
    seed: int
    eval_loss: float
    final_train_loss: float
    steps: int
    samples_per_step: list[int]
    train_s: float
    real_tokens: int
    rows_fill: float | None
    long_share: float


class _Recorder:
    """Wraps the collator: real tokens and samples of every batch (padding and the pad pseudo-sample excluded)."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.batches: list[tuple[int, int]] = []
        self.trained: list[list[int]] = []  # per batch: trained tokens of each sample

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collate(examples)
        labels = batch["labels"]
        if "attention_mask" in batch:
            real, samples = int(batch["attention_mask"].sum()), int(batch["input_ids"].shape[0])
            trained = (labels[:, 1:] != -100).sum(dim=1).tolist()
        else:
            samples = sum(len(e["seq_lengths"]) if "seq_lengths" in e else 1 for e in examples)
            real = sum(len(e["input_ids"]) for e in examples)
            pieces = labels[0].split(batch["packed_seq_lengths"].tolist())
            trained = [int((piece != -100).sum()) for piece in pieces][:samples]
        self.batches.append((real, samples))
        self.trained.append(trained)
        return batch


def long_sample_weight_share(trained_per_step: list[list[int]], normalization: str) -> float:
    """Share of the epoch's gradient weight carried by the 10% of samples with the most trained tokens.

    In a step normalized per token, sample ``i`` weighs ``t_i / (trained tokens of the step)``; per sample, ``1 /
    (samples of the step)``. Every step weighs 1 in total, so the shares show which samples a run learns most from.
    """
    weights, sizes = [], []
    for step in trained_per_step:
        total, count = sum(step), sum(1 for t in step if t > 0)
        for t in step:
            if t > 0:
                weights.append(t / total if normalization == "token" else 1 / count)
                sizes.append(t)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    top = order[: max(1, len(order) // 10)]
    return sum(weights[i] for i in top) / sum(weights)


def train_arm(
    arm: str,
    seed: int,
    *,
    tokenizer: Any,
    train_dataset: Any,
    eval_dataset: Any,
    max_length: int,
    rows_per_step: int,
    padded_batch_size: int,
    max_samples_per_row: int | None,
    epochs: float,
    learning_rate: float,
    output_dir: str,
) -> Run:
    import torch
    from transformers import LlamaForCausalLM, PrinterCallback, TrainerCallback

    from unpack_trainer import SFTConfig, SFTTrainer, tiny_model_config

    overrides = dict(ARMS[arm][1])
    packed = overrides["packing"]
    if arm == "packed_shuffled_cap":
        overrides["max_samples_per_row"] = max_samples_per_row
    args = SFTConfig(
        output_dir=output_dir,
        max_length=max_length,
        num_train_epochs=epochs,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        weight_decay=0.0,
        per_device_train_batch_size=rows_per_step if packed else padded_batch_size,
        per_device_eval_batch_size=8,
        eval_packing=False,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # fp32, as the main job on a CPU (TRL's SFTConfig defaults to bf16, which autocasts on CPUs too)
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        **overrides,
        **checkpointing_off(SFTConfig),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_model_config(tokenizer))
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer
    )
    recorder = _Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    losses: list[tuple[int, float]] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append((state.global_step, float(logs["loss"])))

    trainer.add_callback(Losses())
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    output = trainer.train()
    train_s = time.perf_counter() - start
    trainer.data_collator = recorder.collate
    eval_loss = held_out_loss(trainer)
    batches = recorder.batches[: output.global_step]  # one batch per step (no gradient accumulation)
    tail = [loss for step, loss in losses if step >= 0.9 * output.global_step] or [losses[-1][1]]
    stats = trainer.unpack_stats
    return Run(
        arm=arm,
        seed=seed,
        eval_loss=eval_loss,
        final_train_loss=sum(tail) / len(tail),
        steps=output.global_step,
        samples_per_step=[samples for _, samples in batches],
        train_s=train_s,
        real_tokens=sum(real for real, _ in batches),
        rows_fill=stats.get("efficiency") if packed else None,
        long_share=long_sample_weight_share(
            recorder.trained[: output.global_step], overrides.get("loss_normalization", "token")
        ),
    )


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[Run], arms: list[str]) -> str:
    """The markdown table: one line per arm, means (± std over seeds) and the paired difference to ``padded``."""
    by_arm = {arm: sorted((r for r in runs if r.arm == arm), key=lambda r: r.seed) for arm in arms}
    padded = {r.seed: r for r in by_arm.get("padded", [])}
    headers = [
        "arm",
        "held-out loss/token",
        "vs padded (paired)",
        "final train loss",
        "steps",
        "samples/step mean (min-max)",
        "train s",
        "real tokens/s",
        "rows full",
    ]
    rows = []
    default = default_packed_arm()
    for arm in arms:
        group = by_arm[arm]
        if not group:
            continue
        loss, loss_std = _mean_std([r.eval_loss for r in group])
        diffs = [r.eval_loss - padded[r.seed].eval_loss for r in group if r.seed in padded]
        if arm != "padded" and len(diffs) > 0:
            diff, diff_std = _mean_std(diffs)
            versus = f"{diff:+.3f} ± {diff_std:.3f} (se {diff_std / math.sqrt(len(diffs)):.3f}, {len(diffs)} seeds)"
        else:
            versus = "-"
        counts = [c for r in group for c in r.samples_per_step]
        seconds = statistics.fmean(r.train_s for r in group)
        fill = [r.rows_fill for r in group if r.rows_fill is not None]
        rows.append(
            [
                ARMS[arm][0] + (" (default)" if arm == default else ""),
                f"{loss:.3f} ± {loss_std:.3f}",
                versus,
                f"{statistics.fmean(r.final_train_loss for r in group):.3f}",
                f"{statistics.fmean(r.steps for r in group):.0f}",
                f"{statistics.fmean(counts):.1f} ({min(counts)}-{max(counts)})",
                f"{seconds:.0f}",
                f"{statistics.fmean(r.real_tokens / r.train_s for r in group):,.0f}",
                f"{statistics.fmean(fill):.2%}" if fill else "-",
            ]
        )
    return format_table(headers, rows)


def summarize_files(paths: list[Path], arms: list[str], seeds: list[int]) -> str:
    """The [`summarize`] table of the runs stored in ``paths`` (results files written by ``--json``), restricted to
    ``arms`` and ``seeds``; a later file's run of the same arm and seed replaces an earlier one's."""
    runs: dict[tuple[str, int], Run] = {}
    sources = []
    for path in paths:
        payload = json.loads(Path(path).read_text())
        sources.append(f"`{path}`: `{payload.get('command', '?')}`")
        for run in payload["runs"]:
            if run["arm"] in arms and run["seed"] in seeds:
                runs[run["arm"], run["seed"]] = Run(**run)
    header = "Runs read from " + "; ".join(sources) + "\n\n"
    ordered = sorted(runs.values(), key=lambda r: (r.seed, arms.index(r.arm)))
    noise = ", ".join(f"{k} {v:.4f}" for k, v in seed_noise(ordered).items())
    footer = f"\n\nseed noise (the default packed arm's runs paired with padded's): {noise}" if noise else ""
    return header + summarize(ordered, arms) + footer


def prepared_samples(train_dataset: Any, tokenizer: Any, max_length: int) -> tuple[list[int], list[int]]:
    """Every training sample's length and trained-token count as the trainer prepares them (chat template, EOS,
    truncation to ``max_length``, samples without a trained token dropped): read back from a packed trainer's rows."""
    from transformers import LlamaForCausalLM

    from unpack_trainer import SFTConfig, SFTTrainer, tiny_model_config

    with tempfile.TemporaryDirectory() as tmp:
        trainer = SFTTrainer(
            model=LlamaForCausalLM(tiny_model_config(tokenizer)),
            args=SFTConfig(output_dir=tmp, max_length=max_length, packing=True, use_cpu=True, report_to="none"),
            train_dataset=train_dataset,
            processing_class=tokenizer,
        )
    lengths, trained = [], []
    for row in trainer.train_dataset:
        offset = 0
        for length in row["seq_lengths"]:
            labels = row["labels"][offset : offset + length]
            lengths.append(length)
            trained.append(sum(1 for label in labels[1:] if label != -100))
            offset += length
    return lengths, trained


def analyze(
    train_dataset: Any,
    tokenizer: Any,
    *,
    max_length: int,
    rows_per_step: int,
    padded_batch_size: int,
    seeds: list[int],
) -> str:
    """Without training: how each arm composes its optimizer steps, from the samples the trainer prepares.

    Per arm (means over ``seeds``): rows and how full they are, samples per step, rows holding at most 2 samples, and
    the share of the epoch's gradient weight carried by the 10% of samples with the most trained tokens, under
    per-token and per-sample loss normalization ([`long_sample_weight_share`]).
    """
    import numpy as np

    from unpack_trainer.data.packing import best_fit_decreasing, shuffled_best_fit, windowed_best_fit
    from unpack_trainer.data.sampler import balanced_step_order

    lengths, trained = prepared_samples(train_dataset, tokenizer, max_length)
    lengths_array, trained_array = np.asarray(lengths), np.asarray(trained)
    max_per_row = max(1, math.ceil(2 * len(lengths) / len(best_fit_decreasing(lengths_array, max_length))))
    headers = [
        "arm",
        "rows",
        "rows full",
        "samples/step mean (min-max), std",
        "rows with <= 2 samples",
        "longest 10%: weight, per-token loss",
        "per-sample loss",
    ]
    table = []
    arms = ("padded", "packed_bfd", "packed_shuffled", "packed_shuffled_balanced", "packed_shuffled_cap")
    for arm in (*arms, "packed_window4_balanced", "packed_windowed_balanced"):
        stats: dict[str, list[float]] = {}
        for seed in seeds:
            rng = np.random.default_rng(seed)
            if arm == "padded":
                order = rng.permutation(len(lengths))
                steps = [order[k : k + padded_batch_size].tolist() for k in range(0, len(order), padded_batch_size)]
                rows = None
            else:
                if arm == "packed_bfd":
                    rows = best_fit_decreasing(lengths_array, max_length, seed=seed)
                elif arm in ("packed_windowed_balanced", "packed_window4_balanced"):
                    window = ARMS[arm][1].get("packing_window")
                    rows = windowed_best_fit(lengths_array, max_length, seed=seed, window=window)
                else:
                    bound = max_per_row if arm == "packed_shuffled_cap" else None
                    rows = shuffled_best_fit(lengths_array, max_length, seed=seed, max_samples_per_row=bound)
                if ARMS[arm][1].get("balance_samples_per_step"):
                    order = balanced_step_order([len(r) for r in rows], rows_per_step, seed=seed)
                else:
                    order = rng.permutation(len(rows)).tolist()
                ordered = [rows[i] for i in order]
                steps = [
                    [i for row in ordered[k : k + rows_per_step] for i in row]
                    for k in range(0, len(ordered), rows_per_step)
                ]
            per_step = [[int(trained_array[i]) for i in step] for step in steps]
            counts = [len(step) for step in steps]
            values = {
                "rows": len(rows) if rows else float("nan"),
                "fill": lengths_array.sum() / (len(rows) * max_length) if rows else float("nan"),
                "mean": statistics.fmean(counts),
                "min": min(counts),
                "max": max(counts),
                "std": statistics.pstdev(counts),
                "small": sum(len(r) <= 2 for r in rows) if rows else float("nan"),
                "token": long_sample_weight_share(per_step, "token"),
                "sample": long_sample_weight_share(per_step, "sample"),
            }
            for key, value in values.items():
                stats.setdefault(key, []).append(value)
        m = {key: statistics.fmean(values) for key, values in stats.items()}
        packed = arm != "padded"
        table.append(
            [
                ARMS[arm][0] + (f" ({max_per_row})" if arm == "packed_shuffled_cap" else ""),
                f"{m['rows']:.0f}" if packed else "-",
                f"{m['fill']:.2%}" if packed else "-",
                f"{m['mean']:.1f} ({min(stats['min'])}-{max(stats['max'])}), {m['std']:.1f}",
                f"{m['small']:.0f}" if packed else "-",
                f"{m['token']:.1%}",
                f"{m['sample']:.1%}",
            ]
        )
    top = np.sort(trained_array)[::-1][: max(1, len(trained) // 10)]
    note = (
        f"{len(lengths):,} samples; the 10% with the most trained tokens hold {top.sum() / trained_array.sum():.1%} "
        f"of the trained tokens (and 10% of the samples); means over seeds {seeds}"
    )
    return format_table(headers, table) + "\n\n" + note


def seed_noise(runs: list[Run]) -> dict[str, float]:
    """Std over seeds of the padded held-out loss, and of the paired difference (default packed - padded)."""
    padded = {r.seed: r.eval_loss for r in runs if r.arm == "padded"}
    packed = {r.seed: r.eval_loss for r in runs if r.arm == default_packed_arm()}
    out: dict[str, float] = {}
    if len(padded) > 1:
        out["padded_std"] = statistics.stdev(padded.values())
        out["padded_mean"] = statistics.fmean(padded.values())
    diffs = [packed[s] - padded[s] for s in packed if s in padded]
    if len(diffs) > 1:
        out["diff_mean"] = statistics.fmean(diffs)
        out["diff_std"] = statistics.stdev(diffs)
    return out


SETTINGS = ("max_length", "rows_per_step", "padded_batch_size", "epochs", "learning_rate", "train_samples", "threads")


def run_config(runs: list[Run], options: dict[str, Any]) -> dict[str, Any]:
    """The ``config`` of a results file: the arms and seeds of the ``runs`` it records (read from the runs, in the
    order they ran, so that they cannot disagree with them) and the settings they trained with (``options``: the
    command's arguments; ``padded_batch_size`` as given, ``None`` for the packed arms' mean). The command's modes and
    output (``--json``, ``--jobs``, ``--quick``...) are not configuration: the file's ``command`` has them."""
    return {
        "arms": list(dict.fromkeys(r.arm for r in runs)),
        "seeds": list(dict.fromkeys(r.seed for r in runs)),
        **{name: options.get(name) for name in SETTINGS},
    }


def _run_seeds_in_parallel(args: argparse.Namespace, argv: list[str]) -> list[Run]:
    """One process per group of seeds (``--jobs`` processes), each running every arm in turn; returns all runs."""
    import subprocess

    groups = [args.seeds[i :: args.jobs] for i in range(min(args.jobs, len(args.seeds)))]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for index, seeds in enumerate(groups):
            out = Path(tmp) / f"seeds{index}.json"
            command = [sys.executable, __file__, *_strip_options(argv, ("--seeds", "--json", "--jobs"))]
            command += ["--seeds", *map(str, seeds), "--json", str(out), "--worker"]
            procs.append((subprocess.Popen(command), out))
        runs = []
        for proc, out in procs:
            if proc.wait() != 0:
                raise RuntimeError(f"benchmark worker {proc.args} failed with code {proc.returncode}")
            runs += [Run(**run) for run in json.loads(out.read_text())]
    return sorted(runs, key=lambda r: (r.seed, args.arms.index(r.arm)))


def _strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` and their values."""
    out, skipping = [], False
    for item in argv:
        if item.startswith("--"):
            skipping = item.split("=")[0] in names
        if not skipping:
            out.append(item)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(15)))
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--max-length", type=int, default=512, help="tokens per packed row (and truncation length)")
    parser.add_argument("--rows-per-step", type=int, default=2, help="packed rows per optimizer step")
    parser.add_argument(
        "--padded-batch-size",
        type=int,
        help="samples per step of the padded and padding-free arms; default: the packed arms' mean samples per step",
    )
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--train-samples", type=int, default=0, help="use the first N training samples (0: all 4,000)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path, default=RESULTS_JSON, help="where to write every run's figures")
    parser.add_argument("--quick", action="store_true", help="smoke test: seed 0, 64 samples, padded and packed")
    parser.add_argument(
        "--jobs", type=int, default=2, help="seeds trained in parallel processes (each runs every arm in turn)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        help="no training: the table of the runs stored in these results files (--json of earlier runs; a later "
        "file's run of the same arm and seed replaces an earlier one), for --arms and --seeds",
    )
    parser.add_argument(
        "--analyze",
        action="store_true",
        help="no training: how every arm composes its optimizer steps (samples per step, weight of long samples)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.arms, args.train_samples = [0], ["padded", default_packed_arm()], 64
    if args.summarize:
        print(summarize_files(args.summarize, args.arms, args.seeds))
        return

    quiet_case(args.threads)
    import logging

    from unpack_trainer import load_default_dataset, load_default_tokenizer
    from unpack_trainer.data.packing import best_fit_decreasing

    logging.getLogger("unpack_trainer").setLevel(logging.ERROR)
    tokenizer = load_default_tokenizer()
    train_dataset = load_default_dataset("train")
    if args.train_samples:
        train_dataset = train_dataset.select(range(min(args.train_samples, len(train_dataset))))
    eval_dataset = load_default_dataset("eval")
    if args.quick:
        eval_dataset = eval_dataset.select(range(16))

    # Samples per packed row, from the samples exactly as the trainer prepares them, so that the padded batch holds
    # as many samples as the packed arms' steps on average.
    lengths, _ = prepared_samples(train_dataset, tokenizer, args.max_length)
    per_row = len(lengths) / len(best_fit_decreasing(lengths, args.max_length))
    padded_batch_size = args.padded_batch_size or max(1, round(per_row * args.rows_per_step))
    max_samples_per_row = max(1, math.ceil(2 * per_row))
    print(
        f"{len(lengths):,} samples, {per_row:.2f} per packed row of {args.max_length}: padded batch "
        f"{padded_batch_size}, packed {args.rows_per_step} row(s) per step",
        file=sys.stderr,
        flush=True,
    )
    if args.analyze:
        print(f"## Step composition per arm (no training), max_length {args.max_length}\n")
        print(f"`python benchmarks/bench_quality.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
        print(
            analyze(
                train_dataset,
                tokenizer,
                max_length=args.max_length,
                rows_per_step=args.rows_per_step,
                padded_batch_size=padded_batch_size,
                seeds=args.seeds,
            )
        )
        return
    runs: list[Run] = []
    start = time.perf_counter()
    if args.jobs > 1 and len(args.seeds) > 1 and not args.worker:
        runs = _run_seeds_in_parallel(args, argv if argv is not None else sys.argv[1:])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in args.seeds:
                for arm in args.arms:
                    run = train_arm(
                        arm,
                        seed,
                        tokenizer=tokenizer,
                        train_dataset=train_dataset,
                        eval_dataset=eval_dataset,
                        max_length=args.max_length,
                        rows_per_step=args.rows_per_step,
                        padded_batch_size=padded_batch_size,
                        max_samples_per_row=max_samples_per_row,
                        epochs=args.epochs,
                        learning_rate=args.learning_rate,
                        output_dir=os.path.join(tmp, arm),
                    )
                    runs.append(run)
                    print(
                        f"seed {seed} {arm:<26} held-out {run.eval_loss:.4f}  train {run.final_train_loss:.3f}  "
                        f"steps {run.steps}  {run.train_s:.0f} s  ({time.perf_counter() - start:.0f} s so far)",
                        file=sys.stderr,
                        flush=True,
                    )
    if args.worker:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in runs]))
        return
    command = "python benchmarks/bench_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = environment()
    print(f"## Quality: held-out loss, padded vs packed, seeds {args.seeds}\n")
    print(f"`{command.strip()}`\n")
    print(", ".join(f"{k} {v}" for k, v in env.items()) + f", torch threads {args.threads}\n")
    print(
        f"tiny Llama (0.4M parameters), embedded data ({len(lengths):,} training samples, "
        f"{len(eval_dataset)} held-out), "
        f"max_length {args.max_length}, {args.epochs:g} epoch(s), lr {args.learning_rate:g} cosine, packed "
        f"{args.rows_per_step} row(s)/step, padded batch {padded_batch_size}; mean ± std over seeds; "
        f"total {time.perf_counter() - start:.0f} s\n"
    )
    print(summarize(runs, args.arms))
    noise = seed_noise(runs)
    if noise:
        print("\n" + ", ".join(f"{k} {v:.4f}" for k, v in noise.items()))
    payload = {
        "command": command.strip(),
        "config": run_config(runs, vars(args)),
        "padded_batch_size": padded_batch_size,
        "seed_noise": noise,
        "runs": [dataclasses.asdict(r) for r in runs],
    }
    if not args.quick:
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
