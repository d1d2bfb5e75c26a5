"""Trainer throughput: stock TRL (padded, packing=True) vs unpack_trainer (packing=True, automatic padding-free).

Run by ``unpack-trainer bench`` (the embedded default data) and ``benchmarks/bench_trainer.py`` (lognormal data);
also the shared set-up of ``benchmarks/`` (tiny model, length distributions, environment, table, subprocess runs).
Same model, same ``SFTConfig`` otherwise, same data for every provider; every case runs in its own process, the
providers interleaved (A B C D A B C D ...) for several rounds. Throughput is real (non-pad) tokens per second over
the timed steps (the first step is a warm-up and not timed); the report gives the median and spread over the rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "PROVIDERS",
    "add_arguments",
    "compare",
    "compare_from_args",
    "environment",
    "environment_line",
    "format_table",
    "lognormal_lengths",
    "lognormal_lengths_with_mean",
    "main",
    "mean_std",
    "paired_difference",
    "paired_table",
    "ratio_cell",
    "run_case",
    "run_seeded_cases",
    "spread",
    "run_in_subprocess",
    "time_training",
    "tiny_llama_config",
    "write_runs",
]

PROVIDERS = {
    "trl_padded": "(a) trl.SFTTrainer, padded",
    "trl_packing": "(b) trl.SFTTrainer, packing=True",
    "unpack_packing": "(c) unpack_trainer, packing=True",
    "unpack_auto": "(d) unpack_trainer, automatic padding-free",
}


DATASETS = ("lognormal", "default")


def lognormal_lengths(
    n: int, *, median: float = 180.0, sigma: float = 0.8, low: int = 8, high: int = 2048, seed: int = 0
) -> np.ndarray:
    """``n`` sample lengths (int64) drawn lognormal around ``median``, clipped to ``[low, high]``."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(lengths), low, high).astype(np.int64)


def lognormal_lengths_with_mean(
    n: int, *, mean: float, sigma: float = 0.8, low: int = 8, high: int = 2048, seed: int = 0
) -> np.ndarray:
    """Lognormal lengths whose (unclipped) mean is ``mean``: median = mean * exp(-sigma**2 / 2)."""
    return lognormal_lengths(n, median=mean * np.exp(-(sigma**2) / 2), sigma=sigma, low=low, high=high, seed=seed)


def tiny_llama_config(**overrides: Any):
    """The benchmark model: hidden 256, 4 layers, 8 heads, 4 kv heads, vocab 4096 (about 3.6M parameters).

    DESIGN's benchmark size, built without a tokenizer; [`unpack_trainer.data.default_data.tiny_model_config`] is a
    different, smaller model (0.4M parameters) sized from the embedded tokenizer for CPU fine-tuning.
    """
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=4096,
        max_position_embeddings=32768,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _word_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(4096)}, unk_token="t3"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2")


def _setup(data: str, max_length: int, num_samples: int):
    """``(model, tokenizer, dataset)`` for one case; the same seed everywhere, so every provider gets the same."""
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if data == "default":
        from unpack_trainer.data.default_data import load_default_dataset, load_default_tokenizer, tiny_model_config

        tokenizer = load_default_tokenizer()
        model = LlamaForCausalLM(tiny_model_config(tokenizer))
        return model, tokenizer, load_default_dataset("train")
    model = LlamaForCausalLM(tiny_llama_config(pad_token_id=0, eos_token_id=2, bos_token_id=1))
    lengths = lognormal_lengths(num_samples, high=max_length)
    rng = np.random.default_rng(0)
    dataset = Dataset.from_dict({"input_ids": [rng.integers(3, 4096, size=n).tolist() for n in lengths]})
    return model, _word_tokenizer(), dataset


def run_case(
    provider: str, max_length: int, steps: int, batch_size: int, data: str = "lognormal", threads: int | None = None
) -> dict:
    """Train ``steps`` + 1 optimizer steps in this process (on ``threads`` torch CPU threads; ``None``: torch's
    default) and return throughput figures as a dict."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    disable_progress_bar()

    num_samples = (steps + 1) * max(batch_size, max_length // 90) * 4
    model, tokenizer, dataset = _setup(data, max_length, num_samples)
    return time_training(
        provider, model, tokenizer, dataset, max_length=max_length, steps=steps, batch_size=batch_size
    )


def time_training(
    provider: str, model: Any, tokenizer: Any, dataset: Any, *, max_length: int, steps: int, batch_size: int
) -> dict[str, Any]:
    """Train ``model`` on ``dataset`` for ``steps + 1`` steps with ``provider``'s trainer and time the last ``steps``.

    ``provider`` is one of ``trl_padded``, ``trl_packing``, ``unpack_packing``, ``unpack_padding_free``: stock TRL or
    our ``SFTTrainer``, with ``packing=True`` (one row per device batch) or not (``batch_size`` samples). Returns the
    real (non-pad) ``tokens_per_s`` and ``seconds_per_step`` of the timed steps, ``first_step_s``, ``peak_rss_mb`` of
    this process, and for our trainer ``selfcheck_s`` and ``mode``.
    """
    import resource

    import trl
    from transformers import TrainerCallback

    packed = provider in ("trl_packing", "unpack_packing")
    config = dict(
        output_dir=f"/tmp/bench_trainer/{provider}",
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_length=max_length,
        max_steps=steps + 1,
        per_device_train_batch_size=1 if packed else batch_size,
        packing=packed,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    if provider.startswith("trl"):
        trainer_cls, config_cls = trl.SFTTrainer, trl.SFTConfig
    else:
        from unpack_trainer import SFTConfig, SFTTrainer

        trainer_cls, config_cls = SFTTrainer, SFTConfig
    trainer = trainer_cls(model=model, args=config_cls(**config), train_dataset=dataset, processing_class=tokenizer)

    tokens: list[int] = []
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        mask = batch.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting_collator
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    trainer.add_callback(Stamp())
    start = time.perf_counter()
    trainer.train()
    timed = stamps[-1] - stamps[0]
    result: dict[str, Any] = {
        "tokens_per_s": sum(tokens[1 : len(stamps)]) / timed,
        "seconds_per_step": timed / (len(stamps) - 1),
        "first_step_s": stamps[0] - start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    selfcheck = getattr(trainer, "unpack_selfcheck", None)
    if selfcheck is not None:
        result["selfcheck_s"] = selfcheck.seconds
    decision = getattr(trainer, "unpack_decision", None)
    if decision is not None:
        result["mode"] = decision.mode
    return result


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


def environment_line() -> str:
    """[`environment`] as one line: ``python 3.12.3, machine x86_64, cpus 2, torch ..., device cpu``."""
    return ", ".join(f"{name} {value}" for name, value in environment().items())


def run_in_subprocess(module_args: Sequence[str], *, timeout: float = 1800) -> dict:
    """Run ``python <args>`` in a fresh process that prints one JSON object on its last stdout line; return it.

    Each measured case runs in its own process so that peak memory (ru_maxrss) belongs to that case alone.
    """
    proc = subprocess.run([sys.executable, *module_args], capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark case {list(module_args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_in_subprocess(
    provider: str, max_length: int, steps: int, batch_size: int, data: str, threads: int | None = None
) -> dict:
    """One case of [`compare`] (``python -m unpack_trainer.cli.trainer_comparison --case ...``)."""
    command = ["-m", __name__, "--case", f"{provider}:{max_length}", "--steps", str(steps)]
    command += ["--batch-size", str(batch_size), "--data", data]
    if threads is not None:
        command += ["--threads", str(threads)]
    return run_in_subprocess(command, timeout=3600)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; floats are printed with 3 significant decimals, ints with separators."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def spread(values: Sequence[float], fmt: str) -> str:
    """``median (min-max)`` of ``values`` formatted with ``fmt``; just the value when there is one."""
    median = float(np.median(values))
    if len(values) == 1:
        return format(median, fmt)
    return f"{format(median, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def run_seeded_cases(
    script: str,
    cases: Sequence[tuple[str, int]],
    arguments: Sequence[str],
    *,
    jobs: int,
    timeout: float,
    describe: Any,
) -> list[dict]:
    """Run ``script --case ARM:SEED ARGUMENTS`` for every ``(arm, seed)`` of ``cases``, ``jobs`` processes at a time
    (:func:`run_in_subprocess`), printing ``describe(run)`` as each finishes; the runs in the order of ``cases``."""
    from concurrent.futures import ThreadPoolExecutor

    def one(case: tuple[str, int]) -> dict:
        run = run_in_subprocess([script, "--case", f"{case[0]}:{case[1]}", *arguments], timeout=timeout)
        print(f"  seed {case[1]} {case[0]}: {describe(run)}", flush=True)
        return run

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, cases))


def write_runs(path: Any, command: str, options: dict, runs: list[dict], wall_s: float) -> None:
    """The per-seed runs of a benchmark as JSON at ``path``: its command, the environment, its options, the wall time
    and the runs."""
    from pathlib import Path

    payload = {"command": command.strip(), "environment": environment(), "options": options, "wall_s": wall_s,
               "runs": runs}  # fmt: skip
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of ``values`` (0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_difference(baseline: Sequence[float], values: Sequence[float], fmt: str = ".4f") -> str:
    """``mean ± std (se ...)`` of the paired differences ``values[i] - baseline[i]`` (per seed), with ``fmt``."""
    mean, std = mean_std([b - a for a, b in zip(baseline, values)])
    return f"{mean:+{fmt}} ± {std:{fmt}} (se {std / math.sqrt(len(values)):{fmt}})"


ARM_NAMES = {"stock": "stock (padded)", "ours": "ours (packed, shared)", "control": "control (stock, init jitter)"}
"""The arms of the quality benchmarks, as their tables name them."""


def paired_table(runs: list[dict], arms: Sequence[str], metrics: Sequence[tuple[str, Any]], first: str) -> str:
    """The quality benchmarks' table: per metric, each arm's mean ± std over the seeds every arm ran, and the paired
    differences of the other arms to ``arms[0]`` (``stock``): mean ± std and standard error; a last row with each arm's
    mean training seconds.

    Args:
        runs: one dict per (arm, seed) run with ``"arm"``, ``"seed"`` and ``"train_s"``.
        arms: the arms in column order, the baseline first; arms without a run are left out.
        metrics: ``(row label, value(run) -> float)`` per row.
        first: the first column's header.
    """
    by = {(r["arm"], r["seed"]): r for r in runs}
    arms = [arm for arm in arms if any(r["arm"] == arm for r in runs)]
    seeds = sorted({r["seed"] for r in runs if all((arm, r["seed"]) in by for arm in arms)})
    rows = []
    for label, value in metrics:
        values = {arm: [value(by[arm, s]) for s in seeds] for arm in arms}
        row = [label, *("{:.4f} ± {:.4f}".format(*mean_std(values[arm])) for arm in arms)]
        rows.append(row + [paired_difference(values[arms[0]], values[arm]) for arm in arms[1:]])
    seconds = [f"{statistics.fmean(by[arm, s]['train_s'] for s in seeds):.0f}" for arm in arms]
    rows.append(["train seconds (mean)", *seconds, *([""] * (len(arms) - 1))])
    headers = [first, *(ARM_NAMES.get(a, a) for a in arms), *(f"{a} - {arms[0]} (paired)" for a in arms[1:])]
    return f"{len(seeds)} seeds, mean ± std over seeds:\n\n" + format_table(headers, rows)


def ratio_cell(ratios: Sequence[float]) -> str:
    """A ratio's median and spread over the repeats, ``not significant`` when the spread crosses 1.0.

    Example:
        >>> ratio_cell([1.5, 1.6, 1.7])
        '1.60x (1.50-1.70)'
        >>> ratio_cell([0.8, 1.87, 1.45])
        '1.45x (0.80-1.87), not significant'
    """
    cell = spread(ratios, ".2f").replace(" (", "x (", 1) if len(ratios) > 1 else f"{ratios[0]:.2f}x"
    if len(ratios) > 1 and min(ratios) <= 1.0 <= max(ratios):
        cell += ", not significant"
    return cell


def compare(
    *,
    max_lengths: Sequence[int] = (2048, 8192),
    steps: int = 3,
    batch_size: int = 8,
    providers: Sequence[str] = tuple(PROVIDERS),
    data: str = "lognormal",
    repeats: int = 3,
    threads: int | None = None,
    progress: bool = True,
) -> str:
    """Run every provider at every ``max_length``, each case in its own process, interleaved (A B C D A B C D ...)
    ``repeats`` times, and return a markdown report: the median and spread (min-max) of tokens/s over the repeats,
    and of each ratio, computed within each round of the interleaving (so that a slow spell of a shared machine hits
    both sides of a ratio). A ratio whose spread crosses 1.0 is marked not significant."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be at least 1, got {repeats}.")
    headers = [
        "max_length",
        "provider",
        "tokens/s median (min-max)",
        "s/step",
        "peak RSS MB",
        "vs (a) padded",
        "vs (b) trl packing",
    ]
    table, notes = [], []
    for max_length in max_lengths:
        results: dict[str, list[dict]] = {provider: [] for provider in providers}
        for round_index in range(repeats):
            for provider in providers:
                result = _run_in_subprocess(provider, max_length, steps, batch_size, data, threads)
                results[provider].append(result)
                if progress:
                    print(
                        f"[{round_index + 1}/{repeats}] {PROVIDERS[provider]} @ {max_length}: {result}",
                        file=sys.stderr,
                        flush=True,
                    )
        for provider, runs in results.items():
            tokens = [r["tokens_per_s"] for r in runs]
            ratios = [
                "1.00x"
                if base == provider
                else ratio_cell([r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, results[base])])
                if base in results
                else "-"
                for base in ("trl_padded", "trl_packing")
            ]
            table.append(
                [
                    str(max_length),
                    PROVIDERS[provider],
                    spread(tokens, ",.0f"),
                    f"{np.median([r['seconds_per_step'] for r in runs]):.2f}",
                    f"{np.median([r['peak_rss_mb'] for r in runs]):,.0f}",
                    *ratios,
                ]
            )
            checks = [r for r in runs if "selfcheck_s" in r]
            if checks:
                share = [100 * r["selfcheck_s"] / r["first_step_s"] for r in checks]
                notes.append(
                    f"- {PROVIDERS[provider]} @ {max_length}: self-check "
                    f"{np.median([r['selfcheck_s'] for r in checks]) * 1000:.0f} ms = {np.median(share):.2f}% of the "
                    f"first step ({np.median([r['first_step_s'] for r in checks]):.2f} s), medians"
                )
    title = (
        f"Trainer throughput, real (non-pad) tokens/s, data={data}, {steps} timed steps, batch {batch_size}, "
        f"{repeats} interleaved repeats" + (f", torch threads {threads}" if threads is not None else "")
    )
    return "\n".join([f"## {title}", "", environment_line(), "", format_table(headers, table), "", *notes])


def add_arguments(parser: argparse.ArgumentParser, *, default_data: str) -> None:
    """The benchmark's options, shared by ``benchmarks/bench_trainer.py`` and ``unpack-trainer bench``."""
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[2048, 8192], help="row / truncation lengths")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per case (after one warm-up)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per padded or padding-free batch")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of the interleaved providers (A B C D A B C D ...)"
    )
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads per case (default: torch's); 1 is steadier on a busy machine"
    )
    parser.add_argument(
        "--data", choices=DATASETS, default=default_data, help="lognormal token ids or the embedded data"
    )


def compare_from_args(args: argparse.Namespace) -> str:
    """[`compare`] with the options of [`add_arguments`]; ``ValueError`` naming the option if one is out of range."""
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}.")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}.")
    bad = [length for length in args.max_lengths if length < 1]
    if bad:
        raise ValueError(f"--max-lengths must be positive token counts, got {bad[0]}.")
    return compare(
        max_lengths=args.max_lengths,
        steps=args.steps,
        batch_size=args.batch_size,
        providers=args.providers,
        data=args.data,
        repeats=args.repeats,
        threads=args.threads,
    )


def main(argv: list[str] | None = None) -> None:
    """``benchmarks/bench_trainer.py`` (lognormal data by default), and one case in its own process (``--case``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, default_data="lognormal")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        provider, max_length = args.case.split(":")
        print(json.dumps(run_case(provider, int(max_length), args.steps, args.batch_size, args.data, args.threads)))
        return
    print(compare_from_args(args))


if __name__ == "__main__":
    main()
