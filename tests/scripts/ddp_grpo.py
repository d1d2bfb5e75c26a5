"""Run by tests/test_trainer_ddp.py under `accelerate launch` with 2 processes: `unpack_trainer.GRPOTrainer` and stock
`trl.GRPOTrainer` (and the same for RLOO), fp32, 2 steps; each rank writes, per trainer, the completions it generated,
its log history and how its log-prob forwards ran to OUTPUT_DIR/rank{N}.json."""

from __future__ import annotations

import json
import os
import sys

import trl
from datasets import Dataset
from ddp_train import exit_without_teardown  # this folder is the script's sys.path[0]

from unpack_trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, raise_token_logit, tiny_model

TRAINERS = {
    "grpo-ours": (GRPOTrainer, GRPOConfig),
    "grpo-stock": (trl.GRPOTrainer, trl.GRPOConfig),
    "rloo-ours": (RLOOTrainer, RLOOConfig),
    "rloo-stock": (trl.RLOOTrainer, trl.RLOOConfig),
}


def count_a(completions, **kwargs):
    return [float(text.count("a")) - 0.1 * len(text) for text in completions]


def model(tokenizer):
    """A tiny Llama whose end-of-sequence logit is raised (completions of different lengths)."""
    built = tiny_model("llama", seed=0, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                       intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return raise_token_logit(built, tokenizer.eos_token_id, 2.5)


def run(output_dir: str, name: str) -> dict:
    trainer_class, config_class = TRAINERS[name]
    tokenizer = char_tokenizer()
    prompts = Dataset.from_dict({"prompt": ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvw", "xyz"]})
    args = config_class(
        output_dir=os.path.join(output_dir, name),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=3,
        num_generations=3,  # 2 ranks x 3 completions: two groups per step, split across the ranks
        max_completion_length=10,
        max_steps=2,
        num_iterations=2,
        beta=0.0,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = trainer_class(
        model=model(tokenizer), reward_funcs=count_a, args=args, train_dataset=prompts, processing_class=tokenizer
    )
    completions = []
    generate = trainer._generate

    def recorded(prompts):
        out = generate(prompts)
        completions.append([list(ids) for ids in out[1]])
        return out

    trainer._generate = recorded
    trainer.train()
    decision = getattr(trainer, "unpack_decision", None)  # ours only
    return {
        "completions": completions,
        "log": trainer.state.log_history,
        "mode": None if decision is None else decision.mode,
        "forwards": getattr(trainer, "unpack_stats", {}).get("forwards"),
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
    }


def main(output_dir: str) -> None:
    results = {name: run(output_dir, name) for name in TRAINERS}
    rank = results["grpo-ours"]["rank"]
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    exit_without_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
