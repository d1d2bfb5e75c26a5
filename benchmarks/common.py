"""Shared set-up for the benchmarks: tiny models from configs, length distributions, environment header, tables.

Every benchmark compares providers in the same run and reports ratios; absolute times on shared machines are noise.
The pieces live in the package, [`unpack_trainer.cli.trainer_comparison`] (``unpack-trainer bench`` uses them too);
``benchmarks/`` imports them from there, never the other way round.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from unpack_trainer.cli.trainer_comparison import (
    environment,
    environment_line,
    format_table,
    lognormal_lengths,
    lognormal_lengths_with_mean,
    mean_std,
    paired_difference,
    paired_table,
    run_in_subprocess,
    run_seeded_cases,
    spread,
    tiny_llama_config,
    write_runs,
)

__all__ = [
    "environment",
    "TINY_SIZES",
    "format_table",
    "lognormal_lengths",
    "lognormal_lengths_with_mean",
    "mean_std",
    "paired_difference",
    "paired_table",
    "print_header",
    "quiet_case",
    "run_arms_and_record",
    "run_in_subprocess",
    "run_seeded_cases",
    "spread",
    "tiny_config",
    "tiny_llama_config",
    "write_runs",
]

# The sizes of tiny_llama_config, for any architecture: hidden 256, 4 layers, 8 heads, 4 kv heads of 32, vocab 4096.
TINY_SIZES = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=688,
    vocab_size=4096,
    max_position_embeddings=32768,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(model_type: str, **overrides):
    """A config of ``model_type`` (any ``model_type`` of transformers' causal-LM mapping) at :data:`TINY_SIZES`,
    ``overrides`` (the family's own fields at this width) applied last."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY_SIZES, **overrides})


def pair_trainer(provider: str, stock: tuple, ours: tuple, batch_size: int, **trainer_arguments):
    """The trainer a pair benchmark (DPO, reward) times for ``provider``: ``"stock"`` builds TRL's ``stock``
    (``(trainer class, config class)``), ``"plain"`` / ``"shared"`` ours (``ours``) with ``prefix_sharing`` off / on,
    which must decide to pack; fp32 on the CPU, ``batch_size`` pairs per step, no truncation. ``trainer_arguments``
    go to the trainer (model, data, processing class, ...)."""
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch_size, report_to=[], bf16=False,
                  use_cpu=True, gradient_checkpointing=False, max_length=None)  # fmt: skip
    if provider == "stock":
        trainer_class, config_class = stock
        args = config_class(**common)
    else:
        trainer_class, config_class = ours
        args = config_class(**common, prefix_sharing=provider == "shared")
    trainer = trainer_class(args=args, **trainer_arguments)
    assert provider == "stock" or trainer.unpack_decision.packed, trainer.unpack_decision.reason
    return trainer


def timed_loss_steps(
    trainer, batch_size: int, examples: list, steps: int, on_warm_up: Callable[[], None] | None = None
) -> dict:
    """Time ``steps`` optimizer-free training steps of ``trainer`` (its own ``compute_loss``, then ``backward``) on
    ``examples`` collated ``batch_size`` at a time by its ``data_collator``, after one warm-up step on the first batch
    (``on_warm_up`` runs after it, e.g. to reset a counter). Returns ``{"seconds", "cpu_seconds", "peak_mib",
    "batches"}``: wall and CPU seconds of the timed steps, the growth of the process's peak RSS in MiB over all of
    them, and the prepared batches (the warm-up batch first)."""
    model = trainer.model
    model.train()
    batches = [
        trainer._prepare_inputs(trainer.data_collator(examples[i * batch_size : (i + 1) * batch_size]))
        for i in range(steps + 1)
    ]

    def step(batch):
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(batches[0])  # warm-up
    if on_warm_up is not None:
        on_warm_up()
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches[1:]:
        step(batch)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mib": (rss_after - rss_before) / 1024,
            "batches": batches}  # fmt: skip


def quiet_case(threads: int | None = None) -> None:
    """The start of a benchmark case's process: torch on ``threads`` threads (``None``: torch's default), transformers'
    logging at errors only and datasets' progress bars off, so what the case prints is its result."""
    import torch
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    if threads is not None:
        torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    disable_progress_bar()


def print_header(title: str) -> None:
    print(f"## {title}\n")
    print(environment_line() + "\n")


def run_arms_and_record(
    script: str,
    options: argparse.Namespace,
    argv: list[str] | None,
    shared: list[str],
    describe: Callable[[dict], str],
    timeout: float,
) -> list[dict]:
    """Run every (arm, seed) of ``options.arms`` x ``options.seeds`` as ``script --case arm:seed`` with the options
    ``shared``, ``options.jobs`` processes at a time (``describe`` prints each run as it ends); the runs, with the
    command and the options chosen, written to ``options.json``. For the quality benchmarks (DPO, reward, GRPO)."""
    cases = [(arm, seed) for seed in options.seeds for arm in options.arms]
    start = time.perf_counter()
    runs = run_seeded_cases(
        os.path.abspath(script), cases, shared, jobs=options.jobs, timeout=timeout, describe=describe
    )
    command = f"python benchmarks/{Path(script).name} " + " ".join(argv if argv is not None else sys.argv[1:])
    chosen = {k: v for k, v in vars(options).items() if k not in ("case", "json")}
    write_runs(options.json, command, chosen, runs, time.perf_counter() - start)
    return runs
