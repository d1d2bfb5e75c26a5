"""Reward-model step throughput and peak memory: stock ``trl.RewardTrainer`` (padded) vs
``unpack_trainer.RewardTrainer`` packed without prefix sharing vs packed with prefix sharing, on pairs whose prompts
are 20%, 50% and 80% of their tokens.

    python benchmarks/bench_reward.py                          # tiny Llama, 8 pairs per batch, 3 repeats
    python benchmarks/bench_reward.py --repeats 5 --threads 1  # steadier on a busy machine
    python benchmarks/bench_reward.py --model smollm2          # SmolLM2-135M-Instruct with LoRA (the `real` extra)
    python benchmarks/bench_reward.py --shares 0.02            # short prompts: what packing alone gives

Each (provider, prompt share) case runs in its own process: one warm-up step, then ``--steps`` training steps (the
model's forward and backward through the trainers' own ``compute_loss``) on the same pre-tokenized pairs. The
providers are interleaved (stock, plain, shared, stock, ...) for ``--repeats`` rounds; the table gives the median and
spread (min-max) of tokens/s and of each ratio, paired within a round, once by the process's CPU time (torch on one
thread with ``--threads 1``: what the step costs, steadier than wall time on a machine other jobs share) and once by
wall time. Tokens/s counts the tokens of ``[p, c]`` and ``[p, r]`` (what stock TRL runs without its padding), the same
numerator for every provider. Peak memory: the growth
of the process's peak RSS over the training steps, warm-up included (ru_maxrss; CPU).

Data: the pairs of ``benchmarks/bench_dpo.py`` (``|p| + |c| + |r|`` lognormal, median ``--median-tokens``, the
prompt the given share, random token ids), as TRL's tokenized columns ``chosen_ids = p + c`` and ``rejected_ids =
p + r``. Models: ``--model tiny_llama`` (default): ``LlamaForSequenceClassification`` at the benchmarks' tiny size
(hidden 256, 4 layers, 8 heads, 4 kv heads, vocab 4096), fully fine-tuned. ``--model smollm2``:
SmolLM2-135M-Instruct (fp32, SDPA; the `real` extra) as ``LlamaForSequenceClassification`` (a new ``score`` head)
with LoRA (``task_type="SEQ_CLS"``, r 16 on every linear layer, the head trained in full); the token ids stay below
4096 (valid SmolLM2 ids).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dpo import PROVIDERS, _spread, make_pairs, measure, word_tokenizer  # noqa: E402
from common import format_table, pair_trainer, quiet_case, timed_loss_steps, tiny_llama_config  # noqa: E402


def _model(name: str) -> tuple[object, dict]:
    """``(model, trainer kwargs)`` of the benchmark's ``--model``."""
    import torch
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)  # the new score head
    if name == "smollm2":
        from peft import LoraConfig

        from unpack_trainer import smollm2_path

        model = LlamaForSequenceClassification.from_pretrained(
            smollm2_path(), num_labels=1, dtype=torch.float32, attn_implementation="sdpa"
        )
        lora = LoraConfig(task_type="SEQ_CLS", r=16, lora_alpha=32, target_modules="all-linear")
        return model, {"peft_config": lora}
    config = tiny_llama_config(pad_token_id=0, eos_token_id=2, bos_token_id=1, num_labels=1)
    return LlamaForSequenceClassification(config), {}


def run_case(
    provider: str, share: float, steps: int, batch_size: int, threads: int | None, model_name: str, median: int
) -> dict:
    """Train ``steps`` + 1 steps of ``provider`` in this process; tokens/s and the growth of peak RSS (MiB)."""
    quiet_case(threads)
    import trl
    from datasets import Dataset

    from unpack_trainer import RewardConfig, RewardTrainer

    model, extra = _model(model_name)
    tokenizer = word_tokenizer()
    pairs = make_pairs(batch_size * (steps + 1), share, median=median)
    dataset = Dataset.from_list(
        [
            {"chosen_ids": p["prompt_ids"] + p["chosen_ids"], "rejected_ids": p["prompt_ids"] + p["rejected_ids"]}
            for p in pairs
        ]  # fmt: skip
    )
    trainer = pair_trainer(provider, (trl.RewardTrainer, trl.RewardConfig), (RewardTrainer, RewardConfig), batch_size,
                           model=model, train_dataset=dataset, processing_class=tokenizer, **extra)  # fmt: skip
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    timed = timed_loss_steps(trainer, batch_size, examples, steps)
    seconds, cpu_seconds = timed["seconds"], timed["cpu_seconds"]
    tokens = sum(len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples[batch_size:])
    return {"tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu_seconds,
            "peak_mib": timed["peak_mib"], "seconds": seconds}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args, results = measure(__file__, __doc__, argv, run_case)
    if results is None:
        return
    what = {"tiny_llama": "tiny Llama, full", "smollm2": "SmolLM2-135M-Instruct, LoRA r 16"}[args.model]
    for key, clock in (("tokens_per_cpu_s", "the process's CPU time"), ("tokens_per_s", "wall time")):
        print(f"\nReward-model step, {what}, {args.batch_size} pairs per batch (median pair {args.median_tokens} "
              f"tokens), {args.steps} steps x {args.repeats} rounds, by {clock} (median (min-max)):")  # fmt: skip
        print(_table(results, args.shares, key))


def _table(results: dict[tuple[str, float], list[dict]], shares: list[float], key: str) -> str:
    """Tokens per second (``key``: per wall or CPU second) of each provider, their ratios paired within a round, and
    the median peak memory."""
    rows = []
    for share in shares:
        tps = {p: [r[key] for r in results[(p, share)]] for p in PROVIDERS}
        peak = {p: [r["peak_mib"] for r in results[(p, share)]] for p in PROVIDERS}
        rows.append([
            f"{share:.0%}",
            *(_spread(tps[p], ",.0f") for p in PROVIDERS),
            _spread([b / a for a, b in zip(tps["stock"], tps["plain"])], ".2f"),
            _spread([b / a for a, b in zip(tps["stock"], tps["shared"])], ".2f"),
            _spread([b / a for a, b in zip(tps["plain"], tps["shared"])], ".2f"),
            " / ".join(f"{np.median(peak[p]):.0f}" for p in PROVIDERS),
            f"{np.median(peak['shared']) / max(np.median(peak['stock']), 1e-9):.2f}",
        ])  # fmt: skip
    return format_table(
        ["prompt share", "stock tokens/s", "packed tokens/s", "shared tokens/s", "packed / stock",
         "shared / stock", "shared / packed", "peak MiB stock / packed / shared", "peak shared / stock"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
