"""Run by tests/test_trainer_ddp.py under `accelerate launch` with 2 processes: `unpack_trainer.DPOTrainer` and stock
`trl.DPOTrainer`, each on a map-style and on an iterable preference set (train and eval), fp32; each rank writes, per
trainer, the pairs its collator got (training and evaluation batches in order), the training pairs and the log history
to OUTPUT_DIR/rank{N}.json."""

from __future__ import annotations

import json
import os
import random
import sys

import trl
from datasets import Dataset
from ddp_train import exit_without_teardown  # this folder is the script's sys.path[0]

from unpack_trainer import DPOConfig, DPOTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model

TRAINERS = {"ours": (DPOTrainer, DPOConfig), "stock": (trl.DPOTrainer, trl.DPOConfig)}


def pairs(count: int) -> list[dict]:
    rng = random.Random(0)
    return [
        {
            "prompt": "a" * rng.randint(1, 12),
            "chosen": "".join(rng.choice("bcd") for _ in range(rng.randint(1, 10))),
            "rejected": "".join(rng.choice("efg") for _ in range(rng.randint(1, 10))),
        }
        for _ in range(count)
    ]


def _token_ids(example: dict) -> list[list[int]]:
    """A tokenized pair as ``[prompt_ids, chosen_ids, rejected_ids]``."""
    return [example["prompt_ids"], example["chosen_ids"], example["rejected_ids"]]


def data_and_args(config_class, output_dir: str, name: str, kind: str, rows: list[dict]) -> tuple:
    """``(train, evaluation, args)``: the first 16 of ``rows`` to train on, the rest to evaluate, map-style or
    iterable (``kind``), and ``config_class``'s arguments: 4 steps of 2 pairs per rank, evaluation every 2 steps."""
    train, evaluation = Dataset.from_list(rows[:16]), Dataset.from_list(rows[16:])
    if kind == "iterable":  # TRL turns `dispatch_batches` off for an iterable train set only: eval is dispatched
        train, evaluation = train.to_iterable_dataset(), evaluation.to_iterable_dataset()
    args = config_class(
        output_dir=os.path.join(output_dir, f"{name}-{kind}"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=4,  # 2 ranks x 2 pairs x 4 steps: the 16 training pairs once
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_length=40,
    )
    return train, evaluation, args


def run(output_dir: str, name: str, kind: str) -> dict:
    trainer_class, config_class = TRAINERS[name]
    tokenizer = char_tokenizer()
    train, evaluation, args = data_and_args(config_class, output_dir, name, kind, pairs(24))
    vocab = dict(vocab_size=len(tokenizer), max_position_embeddings=512)
    trainer = trainer_class(
        model=tiny_model("llama", seed=0, **vocab),
        ref_model=tiny_model("llama", seed=1, **vocab),
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
    )
    return train_and_record(trainer, _token_ids)


def train_and_record(trainer, token_ids) -> dict:
    """Train ``trainer``; what its collator got (``token_ids(example)`` of each example of each batch, training and
    evaluation in order), its training pairs, log history, path and self-check (ours only), rank and world size."""
    seen = []
    collate = trainer.data_collator

    def recording_collator(examples):
        seen.append([token_ids(example) for example in examples])
        return collate(examples)

    trainer.data_collator = recording_collator
    trainer.train()
    decision = getattr(trainer, "unpack_decision", None)  # ours only
    check = getattr(trainer, "unpack_selfcheck", None)
    return {
        "seen": seen,
        "train_pairs": [token_ids(example) for example in trainer.train_dataset],
        "log": trainer.state.log_history,
        "mode": None if decision is None else decision.mode,
        "self_check": None if check is None else check.ok,
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
    }


def main(output_dir: str, run=run) -> None:
    """Every trainer of ``TRAINERS`` on map-style and iterable data (``run(output_dir, name, kind)``); this rank's
    results to ``rank{N}.json``."""
    results = {f"{name}-{kind}": run(output_dir, name, kind) for kind in ("map", "iterable") for name in TRAINERS}
    rank = results["ours-map"]["rank"]
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    exit_without_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
