"""Quality of packed DPO: held-out DPO loss and reward accuracy of stock ``trl.DPOTrainer`` (padded) vs
``unpack_trainer.DPOTrainer`` (packed rows, prefix sharing), paired per seed.

    python benchmarks/bench_dpo_quality.py                 # the table of docs/quality.md: 8 seeds x 3 arms, 2 processes
    python benchmarks/bench_dpo_quality.py --seeds 0 --train-pairs 64 --eval-pairs 32   # smoke test

For each seed all arms start from the same initial weights (the policy is ``torch.manual_seed(seed)``'s tiny Llama,
the reference model a copy of it), see the same training pairs in the same order (the trainers' own seeded sampler,
``seed`` = ``data_seed`` = the seed) with the same optimizer, learning-rate schedule and ``beta``, and train one
epoch in fp32 on the CPU:

- ``stock``: ``trl.DPOTrainer``, padded batches (chosen rows, then rejected rows);
- ``ours``: ``unpack_trainer.DPOTrainer`` with its defaults: each batch's pairs packed into one row, each prompt run
  once (``prefix_sharing=True``).
- ``control``: stock again, with every initial policy weight multiplied by ``1 + 1e-6 * N(0, 1)`` (about fp32
  rounding, a few ulp; the reference model is not perturbed). Packed and padded steps agree to fp32 rounding
  (``tests/test_dpo_trainer.py``), but one epoch of 500 steps at this learning rate amplifies rounding-level
  differences (they grow from ~1e-6 to ~1e-3 in the per-step loss between steps 110 and 150 of seed 0): the control
  measures how far a rounding-size perturbation alone moves the results, the yardstick for ``ours - stock``.

Every trained policy is then evaluated by the same code, a stock ``trl.DPOTrainer.evaluate`` on the same held-out
pairs against the same reference model: ``eval_loss`` (TRL's mean DPO loss over the evaluation batches) and
``eval_rewards/accuracies`` (share of pairs whose implicit reward of the chosen answer exceeds the rejected one's).
The table gives per arm the mean ± std over seeds, and the paired differences ``ours - stock`` and
``control - stock``: mean ± std and standard error over seeds. The per-seed runs go to ``benchmarks/RESULTS_dpo_quality.json`` (``--json``).

Data: the embedded preference set ([`unpack_trainer.data.default_preference_data.load_default_preference_dataset`], standard
format): the first ``--train-pairs`` training pairs and the first ``--eval-pairs`` held-out pairs whose
``[prompt, chosen]`` and ``[prompt, rejected]`` fit in ``--max-length`` tokens (no truncation in any arm). Defaults: 2,000 training pairs (500 steps of 4
pairs), 180 held-out pairs, ``max_length=256``, learning rate 1e-3 with a cosine schedule and 5% warm-up, ``beta=0.1``.
Model: the default data's tiny Llama ([`unpack_trainer.data.default_data.tiny_model_config`]) made smaller (hidden 64,
MLP 128, 2 layers, 4 heads, 2 key/value heads) with the embedded tokenizer. Each (seed, arm) run is its own process
with torch on one thread, ``--jobs`` at a time.

Recorded run (docs/quality.md): python 3.11.7, torch 2.13.0+cpu, transformers 5.23.0, trl 1.16.0, 2 shared CPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import paired_table, quiet_case, run_arms_and_record  # noqa: E402

ARMS = ("stock", "ours", "control")
RESULTS_JSON = Path(__file__).resolve().parent / "RESULTS_dpo_quality.json"


def pair_subset(split: str, count: int, tokenizer, max_length: int):
    """The first ``count`` pairs of ``split`` whose prompt + chosen and prompt + rejected fit in ``max_length``
    tokens (counted with BOS and EOS, as TRL tokenizes them)."""
    from unpack_trainer.data.default_preference_data import load_default_preference_dataset

    pairs = load_default_preference_dataset(split, conversational=False)
    keep = []
    for i, pair in enumerate(pairs):
        prompt = len(tokenizer(pair["prompt"])["input_ids"])
        answers = max(len(tokenizer(pair[k], add_special_tokens=False)["input_ids"]) for k in ("chosen", "rejected"))
        if prompt + answers + 1 <= max_length:
            keep.append(i)
        if len(keep) == count:
            break
    if len(keep) < count:
        raise ValueError(f"only {len(keep)} {split} pairs fit in max_length={max_length}, asked for {count}")
    return pairs.select(keep)


def jitter(model, seed: int) -> None:
    """The control arm's start: every weight of ``model`` multiplied by ``1 + 1e-6 * N(0, 1)`` (seeded by
    ``10_000 + seed``), about fp32 rounding."""
    import torch

    generator = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.mul_(1 + 1e-6 * noise)


def training_arguments(config_class: type, options: argparse.Namespace, seed: int, **extra) -> dict:
    """The arguments every arm trains and is evaluated with: one epoch of ``options.batch_size`` pairs per batch,
    cosine schedule with 5% warm-up, ``seed`` = ``data_seed``, fp32 on the CPU, no checkpointing; ``extra`` added."""
    from unpack_trainer.cli.sft_comparison import checkpointing_off

    return dict(
        output_dir=tempfile.mkdtemp(),
        num_train_epochs=1,
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        weight_decay=0.0,
        max_length=options.max_length,
        seed=seed,
        data_seed=seed,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **checkpointing_off(config_class),
        **extra,
    )


def setup(options: argparse.Namespace, **config) -> tuple:
    """``(tokenizer, train pairs, held-out pairs, model config)`` of a run, in a process set up for it (torch on one
    thread, transformers' and datasets' logs quiet): the embedded tokenizer, the pairs of [`pair_subset`], the tiny
    model config (``config`` added)."""
    quiet_case(1)
    from unpack_trainer import load_default_tokenizer, tiny_model_config

    tokenizer = load_default_tokenizer()
    train_dataset = pair_subset("train", options.train_pairs, tokenizer, options.max_length)
    eval_dataset = pair_subset("eval", options.eval_pairs, tokenizer, options.max_length)
    model_config = tiny_model_config(
        tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **config,
    )  # fmt: skip
    return tokenizer, train_dataset, eval_dataset, model_config


def run_case(arm: str, seed: int, options: argparse.Namespace) -> dict:
    """Train ``arm`` for one epoch from ``seed``'s initial weights, then evaluate it with a stock evaluator."""
    import copy

    import torch
    import trl
    from transformers import LlamaForCausalLM

    from unpack_trainer import DPOConfig, DPOTrainer

    tokenizer, train_dataset, eval_dataset, config = setup(options)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    ref_model = copy.deepcopy(model)
    if arm == "control":
        jitter(model, seed)
    common = training_arguments(trl.DPOConfig, options, seed, beta=options.beta)
    if arm in ("stock", "control"):
        trainer_class, args = trl.DPOTrainer, trl.DPOConfig(**common)
    else:
        trainer_class, args = DPOTrainer, DPOConfig(**common)
    trainer = trainer_class(
        model=model, ref_model=ref_model, args=args, train_dataset=train_dataset, processing_class=tokenizer
    )
    if arm == "ours":
        assert trainer.unpack_decision.packed, trainer.unpack_decision.reason
    start = time.perf_counter()
    output = trainer.train()
    train_s = time.perf_counter() - start
    evaluator = trl.DPOTrainer(
        model=trainer.model,
        ref_model=ref_model,
        args=trl.DPOConfig(**common),
        train_dataset=eval_dataset,  # required by trl.DPOTrainer; never trained on
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    metrics = evaluator.evaluate()
    return {
        "arm": arm,
        "seed": seed,
        "eval_loss": metrics["eval_loss"],
        "eval_reward_accuracy": metrics["eval_rewards/accuracies"],
        "eval_reward_margin": metrics["eval_rewards/margins"],
        "train_loss": output.training_loss,
        "steps": output.global_step,
        "train_s": train_s,
    }


METRICS = (
    ("eval_loss", "held-out DPO loss"),
    ("eval_reward_accuracy", "held-out reward accuracy"),
    ("eval_reward_margin", "held-out reward margin"),
    ("train_loss", "train loss (epoch mean)"),
)


def summarize(runs: list[dict], metrics: tuple[tuple[str, str], ...] = METRICS) -> str:
    """Markdown table: per metric (``(key, name)`` of ``metrics``), each arm's mean ± std over seeds and the paired
    differences to ``stock`` (mean ± std, standard error) of ``ours`` and of the rounding-perturbation ``control``."""
    rows = [(name, lambda run, key=key: run[key]) for key, name in metrics]
    return paired_table(runs, ARMS, rows, "metric")


def run_arms(
    script: str, options: argparse.Namespace, argv: list[str] | None, extra: list[str], accuracy: str
) -> list[dict]:
    """Run every (arm, seed) of ``options`` as ``script --case arm:seed`` (with the shared options and ``extra``),
    ``options.jobs`` processes at a time, each run's held-out loss and ``accuracy`` printed as it ends; the runs,
    with the command and environment, written to ``options.json``."""
    shared = ["--train-pairs", str(options.train_pairs), "--eval-pairs", str(options.eval_pairs)]
    shared += ["--max-length", str(options.max_length), "--batch-size", str(options.batch_size)]
    shared += ["--learning-rate", str(options.learning_rate), *extra]

    def describe(run: dict) -> str:
        return f"eval loss {run['eval_loss']:.6f}, {accuracy} {run[accuracy]:.4f}, {run['train_s']:.0f} s"

    return run_arms_and_record(script, options, argv, shared, describe, timeout=3600)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--train-pairs", type=int, default=2000)
    parser.add_argument("--eval-pairs", type=int, default=180)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per batch (train and eval)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    parser.add_argument("--json", type=Path, default=RESULTS_JSON, help="where to write the per-seed runs")
    options = parser.parse_args(argv)
    if options.case:
        arm, seed = options.case.split(":")
        print(json.dumps(run_case(arm, int(seed), options)))
        return

    runs = run_arms(__file__, options, argv, ["--beta", str(options.beta)], "eval_reward_accuracy")
    print()
    print(f"DPO quality, tiny Llama (hidden 64, 2 layers), {options.train_pairs} training pairs, one epoch, "
          f"{options.batch_size} pairs per batch, {options.eval_pairs} held-out pairs, fp32, CPU:")  # fmt: skip
    print(summarize(runs))
    print(f"\nruns written to {options.json}")


if __name__ == "__main__":
    main()
