"""Quality of packed reward-model training: held-out loss and accuracy of stock ``trl.RewardTrainer`` (padded) vs
``unpack_trainer.RewardTrainer`` (packed rows, prompts shared), paired per seed.

    python benchmarks/bench_reward_quality.py              # the table of docs/quality.md: 8 seeds x 3 arms, 2 processes
    python benchmarks/bench_reward_quality.py --seeds 0 --train-pairs 64 --eval-pairs 32   # smoke test

For each seed all arms start from the same initial weights (``torch.manual_seed(seed)``'s tiny Llama sequence
classifier, ``num_labels=1``), see the same training pairs in the same order (the trainers' own seeded sampler,
``seed`` = ``data_seed`` = the seed) with the same optimizer and learning-rate schedule, and train one epoch in fp32 on
the CPU:

- ``stock``: ``trl.RewardTrainer``, padded batches (chosen rows, then rejected rows);
- ``ours``: ``unpack_trainer.RewardTrainer`` with its defaults: each batch's pairs packed into one row, the tokens
  chosen and rejected start with run once (``prefix_sharing=True``);
- ``control``: stock again, with every initial weight multiplied by ``1 + 1e-6 * N(0, 1)`` (about fp32 rounding): how
  far a rounding-size perturbation alone moves the results over an epoch, the yardstick for ``ours - stock``
  (packed and padded steps agree to fp32 rounding, ``tests/test_reward_trainer.py``).

Every trained model is then evaluated by the same code, a stock ``trl.RewardTrainer.evaluate`` on the same held-out
pairs: ``eval_loss`` (``-log sigmoid(r_chosen - r_rejected)``, mean over batches), ``eval_accuracy`` (share of pairs
whose chosen answer scores higher) and ``eval_margin``. The table gives per arm the mean ± std over seeds, and the
paired differences ``ours - stock`` and ``control - stock`` (mean ± std, standard error over seeds); the per-seed runs
go to ``benchmarks/RESULTS_reward_quality.json`` (``--json``).

Data: the embedded preference set (standard format; chosen = the right answer, rejected = a near miss of it), the
first ``--train-pairs`` training pairs and ``--eval-pairs`` held-out pairs that fit in ``--max-length`` tokens (as
``benchmarks/bench_dpo_quality.py`` selects them: no pair is filtered out by TRL). Defaults: 2,000 training pairs
(500 steps of 4 pairs), 180 held-out pairs, ``max_length=256``, learning rate 3e-4 (of 3e-5, 1e-4, 3e-4, 1e-3 and 3e-3,
the lowest held-out loss of stock on seed 0: 0.671, against 0.684 to 0.692; at 1e-3 and above stock stays at chance),
cosine schedule with 5% warm-up.
Model: the default data's tiny Llama made smaller (hidden 64, MLP 128, 2 layers, 4 heads, 2 key/value heads) with the
embedded tokenizer, as ``LlamaForSequenceClassification``. Each (seed, arm) run is its own process with torch on one
thread, ``--jobs`` at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dpo_quality import jitter, run_arms, setup, summarize, training_arguments  # noqa: E402

ARMS = ("stock", "ours", "control")
RESULTS_JSON = Path(__file__).resolve().parent / "RESULTS_reward_quality.json"
METRICS = (
    ("eval_loss", "held-out loss"),
    ("eval_accuracy", "held-out accuracy"),
    ("eval_margin", "held-out margin"),
    ("train_loss", "train loss (epoch mean)"),
)


def run_case(arm: str, seed: int, options: argparse.Namespace) -> dict:
    """Train ``arm`` for one epoch from ``seed``'s initial weights, then evaluate it with a stock evaluator."""
    import torch
    import trl
    from transformers import LlamaForSequenceClassification

    from unpack_trainer import RewardConfig, RewardTrainer, unpatch_model

    tokenizer, train_dataset, eval_dataset, config = setup(options, num_labels=1)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    if arm == "control":
        jitter(model, seed)
    common = training_arguments(trl.RewardConfig, options, seed)
    if arm in ("stock", "control"):
        trainer_class, args = trl.RewardTrainer, trl.RewardConfig(**common)
    else:
        trainer_class, args = RewardTrainer, RewardConfig(**common)
    trainer = trainer_class(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer)
    if arm == "ours":
        assert trainer.unpack_decision.packed and trainer.data_collator.prefix_sharing, trainer.unpack_decision
    start = time.perf_counter()
    output = trainer.train()
    train_s = time.perf_counter() - start
    unpatch_model(trainer.model)  # a no-op for the stock arms; the evaluator runs padded batches either way
    evaluator = trl.RewardTrainer(
        model=trainer.model,
        args=trl.RewardConfig(**common),
        train_dataset=eval_dataset,  # required by trl.RewardTrainer; never trained on
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    metrics = evaluator.evaluate()
    return {
        "arm": arm,
        "seed": seed,
        "eval_loss": metrics["eval_loss"],
        "eval_accuracy": metrics["eval_accuracy"],
        "eval_margin": metrics["eval_margin"],
        "train_loss": output.training_loss,
        "steps": output.global_step,
        "train_s": train_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--train-pairs", type=int, default=2000)
    parser.add_argument("--eval-pairs", type=int, default=180)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per batch (train and eval)")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    parser.add_argument("--json", type=Path, default=RESULTS_JSON, help="where to write the per-seed runs")
    options = parser.parse_args(argv)
    if options.case:
        arm, seed = options.case.split(":")
        print(json.dumps(run_case(arm, int(seed), options)))
        return

    runs = run_arms(__file__, options, argv, [], "eval_accuracy")
    print()
    print(f"Reward-model quality, tiny Llama (hidden 64, 2 layers), {options.train_pairs} training pairs, one epoch, "
          f"{options.batch_size} pairs per batch, {options.eval_pairs} held-out pairs, fp32, CPU:")  # fmt: skip
    print(summarize(runs, METRICS))
    print(f"\nruns written to {options.json}")


if __name__ == "__main__":
    main()
