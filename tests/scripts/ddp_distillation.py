"""Run by tests/test_distillation_trainer.py under `accelerate launch` with 2 processes: `unpack_trainer.DistillationTrainer`
and stock `trl.DistillationTrainer`, fp32, 2 steps with gradient accumulation 2; each rank writes, per trainer, the
completions it generated, its log history (loss, grad_norm, every metric) and how its forwards ran to OUTPUT_DIR/rank{N}.json."""

from __future__ import annotations

import json
import os
import sys

import trl
from datasets import Dataset
from ddp_train import exit_without_teardown  # this folder is the script's sys.path[0]

from unpack_trainer import DistillationConfig, DistillationTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, raise_token_logit, tiny_model

TRAINERS = {
    "ours": (DistillationTrainer, DistillationConfig),
    "stock": (trl.DistillationTrainer, trl.DistillationConfig),
}


def model(tokenizer, *, seed: int, hidden_size: int):
    """A tiny Llama whose end-of-sequence logit is raised (completions of different lengths)."""
    built = tiny_model("llama", seed=seed, vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=2,
                       intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return raise_token_logit(built, tokenizer.eos_token_id, 2.5)


def run(output_dir: str, name: str) -> dict:
    trainer_class, config_class = TRAINERS[name]
    tokenizer = char_tokenizer()
    prompts = Dataset.from_dict({"prompt": ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvw", "xyz"] * 2})
    args = config_class(
        output_dir=os.path.join(output_dir, name),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,  # each rank: 2 micro-batches per step, num_items_in_batch over both ranks
        max_completion_length=10,
        max_steps=2,
        beta=0.5,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = trainer_class(
        model=model(tokenizer, seed=0, hidden_size=32),
        teacher_model=model(tokenizer, seed=1, hidden_size=48),
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
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
    rank = results["ours"]["rank"]
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    exit_without_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
