"""Run by tests/test_sequence_parallel_rl.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): one optimizer step of
``unpack_trainer.RewardTrainer`` under DeepSpeed Ulysses (``sp_size=2``), a tiny Llama sequence classifier, pairs
with a ``margin``, plain SGD.

Usage: ``sp_reward.py OUTPUT_DIR``. Rank 0 writes OUTPUT_DIR/batch.pt (the whole batch the step trained on: TRL's
padded pairs and the packed row, each pair's shared start once with chosen and rejected as branches),
OUTPUT_DIR/initial.pt (the model's weights before the step) and OUTPUT_DIR/result.json (the logged loss and metrics,
the decision, the parameters after the step); the test computes the same step in one process.
"""

from __future__ import annotations

import os
import random
import sys

import deepspeed
import torch
from datasets import Dataset
from sp_dpo import pairs  # this folder is the script's sys.path[0]
from sp_train import SGD_STEP, train_one_batch, ulysses
from transformers import AutoModelForSequenceClassification

from unpack_trainer import RewardConfig, RewardTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_config


def rows() -> list[dict]:
    rng = random.Random(1)
    return [pair | {"margin": rng.uniform(0.0, 1.0)} for pair in pairs()]


def config(output_dir: str, **changes) -> RewardConfig:
    return RewardConfig(
        **{
            "output_dir": os.path.join(output_dir, "out"),
            **SGD_STEP,
            "per_device_train_batch_size": 2,
            "max_length": 64,
        }
        | changes
    )


def model(tokenizer):
    torch.manual_seed(0)
    classifier = tiny_config("llama", vocab_size=len(tokenizer), max_position_embeddings=512, num_labels=1,
                             attn_implementation="sdpa")  # fmt: skip
    return AutoModelForSequenceClassification.from_config(classifier)


def main(output_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")  # on the CPU accelerate does not start DeepSpeed's communication
    tokenizer = char_tokenizer()
    classifier = model(tokenizer)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(
            {n: p.detach().clone() for n, p in classifier.named_parameters()}, os.path.join(output_dir, "initial.pt")
        )
    trainer = RewardTrainer(
        model=classifier, args=config(output_dir, **ulysses()), train_dataset=Dataset.from_list(rows()),
        processing_class=tokenizer,
    )  # fmt: skip
    train_one_batch(trainer, output_dir)


if __name__ == "__main__":
    main(sys.argv[1])
