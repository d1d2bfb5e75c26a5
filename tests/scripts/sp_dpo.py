"""Run by tests/test_sequence_parallel.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): one optimizer step of
``unpack_trainer.DPOTrainer`` under DeepSpeed Ulysses (``sp_size=2``), a reference model beside the policy, plain SGD.

Usage: ``sp_dpo.py OUTPUT_DIR [ZERO_STAGE]`` (default 1). Rank 0 writes OUTPUT_DIR/batch.pt (the whole batch the step trained on: the view
and the packed row, each prompt once with its chosen and rejected completions) and OUTPUT_DIR/result.json (the logged
loss and metrics, the decision, the policy's parameters after the step); the test computes the same step in one
process.
"""

from __future__ import annotations

import os
import random
import sys

import deepspeed
import torch
from datasets import Dataset
from sp_train import SGD_STEP, train_one_batch, ulysses  # this folder is the script's sys.path[0]

from unpack_trainer import DPOConfig, DPOTrainer
from unpack_trainer._compat import gathered_parameters
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model


def pairs(count: int = 8) -> list[dict]:
    """Pairs of equal lengths (prompt 9, chosen and rejected 12): DeepSpeed's adapter gathers every rank's batch with
    one all_gather, which gloo runs only on equal shapes."""
    rng = random.Random(0)
    return [
        {
            "prompt": "".join(rng.choice("ab") for _ in range(9)),
            "chosen": "".join(rng.choice("bcd") for _ in range(12)),
            "rejected": "".join(rng.choice("efg") for _ in range(12)),
        }
        for _ in range(count)
    ]


def config(output_dir: str, **changes) -> DPOConfig:
    return DPOConfig(
        **{
            "output_dir": os.path.join(output_dir, "out"),
            **SGD_STEP,
            "per_device_train_batch_size": 2,  # two pairs in one packed row: DeepSpeed's micro-batch is that row
            "max_length": 64,
        }
        | changes
    )


def models(tokenizer) -> tuple:
    vocab = dict(vocab_size=len(tokenizer), max_position_embeddings=512, attn_implementation="sdpa")
    return tiny_model("llama", seed=0, **vocab), tiny_model("llama", seed=1, **vocab)


def main(output_dir: str, stage: int = 1) -> None:
    deepspeed.init_distributed(dist_backend="gloo")  # on the CPU accelerate does not start DeepSpeed's communication
    tokenizer = char_tokenizer()
    args = config(output_dir, **ulysses(stage=stage))
    policy, reference = models(tokenizer)
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(pairs()),
        processing_class=tokenizer,
    )
    # Under ZeRO-3 the models are built partitioned (their random weights drawn per partition): the test starts the
    # one-process step from these.
    initial = {}
    for name, model in (("policy", policy), ("reference", reference)):
        with gathered_parameters(model):
            initial[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if trainer.accelerator.process_index == 0:
        torch.save(initial, os.path.join(output_dir, "initial.pt"))
    train_one_batch(trainer, output_dir)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
