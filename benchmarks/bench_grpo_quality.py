"""Quality of packed GRPO: the reward curve of stock ``trl.GRPOTrainer`` (padded) vs ``unpack_trainer.GRPOTrainer``
(packed forwards, each group's prompt shared), paired per seed, on a verifiable toy task.

    python benchmarks/bench_grpo_quality.py                  # the table of docs/quality.md: 8 seeds x 3 arms, 2 processes
    python benchmarks/bench_grpo_quality.py --seeds 0 --steps 20   # smoke test

The task: a prompt is a few letters of ``abcd``; the reward of a completion is the share of its first
``--completion-length`` characters that repeat the prompt's last letter (the characters before ``</s>``; a completion
that stops early scores less). It needs the prompt (prefix sharing must keep it visible to every completion) and is
checked by a program. The policy: a tiny random Llama over the character tokenizer ([`unpack_trainer.model_zoo.tiny`]) whose
``</s>`` logit is raised, so that early completions end at different lengths.

For each seed all arms start from the same initial weights, draw the same prompts in the same order and sample with
the same seed, with TRL's defaults otherwise (``loss_type="dapo"``, ``beta=0``), ``--prompts`` prompts x
``--generations`` completions per step, learning rate ``--learning-rate``, fp32 on the CPU:

- ``stock``: ``trl.GRPOTrainer``, padded forwards;
- ``ours``: ``unpack_trainer.GRPOTrainer`` with its defaults (packed forwards, prompts shared);
- ``control``: stock again from the initial weights multiplied by ``1 + 1e-6 * N(0, 1)`` (about fp32 rounding): one
  step of ours equals stock's to rounding (``tests/test_grpo_trainer.py``), but sampling turns a rounding-size change
  of the weights into other completions after some steps, so the runs part; the control measures how far a
  rounding-size perturbation alone moves the curve, the yardstick for ``ours - stock``.

The table gives, per arm, the mean reward of the completions of each window of steps (TRL's logged ``reward``) as
mean ± std over seeds, and the paired differences ``ours - stock`` and ``control - stock`` (mean ± std, standard
error). The per-seed curves go to ``benchmarks/RESULTS_grpo_quality.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import paired_table, quiet_case, run_arms_and_record  # noqa: E402

ARMS = ("stock", "ours", "control")
RESULTS_JSON = Path(__file__).resolve().parent / "RESULTS_grpo_quality.json"
LETTERS = "abcd"


def prompts(count: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 6))) for _ in range(count)]


def repeat_reward(length: int):
    """The task's reward: the share of a completion's first ``length`` characters equal to its prompt's last."""

    def repeat_last_letter(prompts, completions, **kwargs):
        return [sum(ch == p[-1] for ch in c[:length]) / length for p, c in zip(prompts, completions)]

    return repeat_last_letter


def run_case(arm: str, seed: int, options: argparse.Namespace) -> dict:
    quiet_case(1)
    import torch
    import trl
    from datasets import Dataset

    from unpack_trainer import GRPOConfig, GRPOTrainer
    from unpack_trainer.model_zoo import tiny

    tokenizer = tiny.char_tokenizer()
    model = tiny.tiny_model("llama", seed=seed, vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    tiny.raise_token_logit(model, tokenizer.eos_token_id, 2.0, seed=seed)
    with torch.no_grad():
        if arm == "control":
            generator = torch.Generator().manual_seed(10_000 + seed)
            for parameter in model.parameters():
                parameter.mul_(1 + 1e-6 * torch.randn(parameter.shape, generator=generator))
    rows = options.steps * options.prompts
    common = dict(
        output_dir=tempfile.mkdtemp(),
        max_steps=options.steps,
        per_device_train_batch_size=options.prompts * options.generations,
        num_generations=options.generations,
        max_completion_length=options.completion_length + 2,
        learning_rate=options.learning_rate,
        seed=seed,
        data_seed=seed,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    config = trl.GRPOConfig(**common) if arm != "ours" else GRPOConfig(**common)
    trainer_class = GRPOTrainer if arm == "ours" else trl.GRPOTrainer
    trainer = trainer_class(model=model, reward_funcs=repeat_reward(options.completion_length), args=config,
                            train_dataset=Dataset.from_dict({"prompt": prompts(rows, seed)}),
                            processing_class=tokenizer)  # fmt: skip
    if arm == "ours":
        assert trainer.unpack_decision.packed, trainer.unpack_decision.reason
    start = time.perf_counter()
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    lengths = [entry["completions/mean_length"] for entry in trainer.state.log_history if "reward" in entry]
    forwards = getattr(trainer, "unpack_stats", {}).get("forwards")
    return {"arm": arm, "seed": seed, "rewards": rewards, "mean_lengths": lengths, "forwards": forwards,
            "train_s": time.perf_counter() - start}  # fmt: skip


def summarize(runs: list[dict], window: int) -> str:
    """Markdown table: per window of steps, each arm's mean reward (mean ± std over seeds) and the paired
    differences to ``stock``."""
    steps = min(len(run["rewards"]) for run in runs)

    def window_mean(start: int, stop: int):
        return lambda run: statistics.fmean(run["rewards"][start:stop])

    metrics = [
        (f"steps {start + 1}-{min(start + window, steps)}", window_mean(start, min(start + window, steps)))
        for start in range(0, steps, window)
    ]
    return paired_table(runs, ARMS, metrics, "mean reward")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=30, help="steps per row of the table")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    parser.add_argument("--json", type=Path, default=RESULTS_JSON, help="where to write the per-seed runs")
    options = parser.parse_args(argv)
    if options.case:
        arm, seed = options.case.split(":")
        print(json.dumps(run_case(arm, int(seed), options)))
        return

    shared = ["--steps", str(options.steps), "--prompts", str(options.prompts)]
    shared += ["--generations", str(options.generations), "--completion-length", str(options.completion_length)]
    shared += ["--learning-rate", str(options.learning_rate)]

    def describe(run: dict) -> str:
        first, last = run["rewards"][: options.window], run["rewards"][-options.window :]
        return f"reward {statistics.fmean(first):.3f} -> {statistics.fmean(last):.3f}, {run['train_s']:.0f} s"

    runs = run_arms_and_record(__file__, options, argv, shared, describe, timeout=7200)
    print()
    print(f"GRPO quality, tiny Llama (hidden 64, 2 layers), repeat-the-last-letter task, {options.steps} steps of "
          f"{options.prompts} prompts x {options.generations} completions, fp32, CPU:")  # fmt: skip
    print(summarize(runs, options.window))
    print(f"\nruns written to {options.json}")


if __name__ == "__main__":
    main()
