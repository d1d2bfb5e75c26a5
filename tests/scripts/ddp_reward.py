"""Run by tests/test_trainer_ddp.py under `accelerate launch` with 2 processes, as ddp_dpo.py runs DPO:
`unpack_trainer.RewardTrainer` and stock `trl.RewardTrainer` (a tiny Llama sequence classifier), each on a map-style
and on an iterable set of pairs with a `margin` column (train and eval), fp32; each rank writes, per trainer, the
pairs its collator got, the training pairs and the log history to OUTPUT_DIR/rank{N}.json."""

from __future__ import annotations

import random
import sys

import torch
import trl
from ddp_dpo import data_and_args, main, pairs, train_and_record  # this folder is the script's sys.path[0]
from transformers import AutoModelForSequenceClassification

from unpack_trainer import RewardConfig, RewardTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_config

TRAINERS = {"ours": (RewardTrainer, RewardConfig), "stock": (trl.RewardTrainer, trl.RewardConfig)}


def _token_ids(example: dict) -> list[list[int]]:
    """A tokenized pair as ``[chosen_ids, rejected_ids]``."""
    return [example["chosen_ids"], example["rejected_ids"]]


def run(output_dir: str, name: str, kind: str) -> dict:
    trainer_class, config_class = TRAINERS[name]
    tokenizer = char_tokenizer()
    rng = random.Random(1)
    rows = [pair | {"margin": rng.uniform(0.0, 1.0)} for pair in pairs(24)]
    train, evaluation, args = data_and_args(config_class, output_dir, name, kind, rows)
    config = tiny_config("llama", vocab_size=len(tokenizer), max_position_embeddings=512, num_labels=1)
    torch.manual_seed(0)
    trainer = trainer_class(
        model=AutoModelForSequenceClassification.from_config(config),
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
    )
    return train_and_record(trainer, _token_ids)


if __name__ == "__main__":
    main(sys.argv[1], run)
