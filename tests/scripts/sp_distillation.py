"""Run by tests/test_sequence_parallel_distillation.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): one optimizer
step of ``unpack_trainer.DistillationTrainer`` under DeepSpeed Ulysses (``sp_size=2``, ZeRO-1 or 3), plain SGD, sampled
completions of different lengths, a teacher of the student's family (``llama``) or of another one (``qwen2``), or one
the patch refuses (``qwen2-padded``: put on the blocklist, it runs TRL's padded forward).

Usage: ``sp_distillation.py OUTPUT_DIR [TEACHER [ZERO_STAGE]]`` (``llama`` and stage 1 by default). Every process records what the step trained on; rank 0 writes
OUTPUT_DIR/step.pt (the prompts of the step, TRL's generation output, the examples it scored, the scored batch and the
micro-batch the loss read, every process's copy of the last two) and OUTPUT_DIR/result.json (the logged loss and
metrics, the decision, the student's parameters after the step, how the forwards ran, and what greedy generation and
evaluation under Ulysses give after it); the test computes the same step in one process.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
from datasets import Dataset
from sp_train import (  # this folder is the script's sys.path[0]
    SGD_STEP,
    finish,
    recorded_generation,
    save_first_step,
    ulysses,
)

from unpack_trainer import DistillationConfig, DistillationTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, raise_token_logit, tiny_model
from unpack_trainer.models import refusals

PROMPTS = ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvw", "xyz"]


def model(tokenizer, model_type: str = "llama", *, seed: int = 0, hidden_size: int = 32):
    """A tiny causal LM over the character vocabulary whose end-of-sequence logit is raised (completions of different
    lengths); the same weights on every call with the same arguments."""
    built = tiny_model(model_type, seed=seed, vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=2,
                       intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       attn_implementation="sdpa")  # fmt: skip
    return raise_token_logit(built, tokenizer.eos_token_id, 2.5)


def teacher(tokenizer, family: str = "llama"):
    """The teacher: another tiny model of ``family`` (``qwen2-padded``: qwen2), wider than the student."""
    return model(tokenizer, family.removesuffix("-padded"), seed=1, hidden_size=48)


def refuse_padded_teacher(family: str, blocklist: dict) -> None:
    """``qwen2-padded``: its model type put on the patch's ``blocklist`` (the teacher then runs TRL's padded forward
    while the student packs)."""
    if family.endswith("-padded"):
        blocklist[family.removesuffix("-padded")] = "refused for this test"


def config(output_dir: str, **changes) -> DistillationConfig:
    return DistillationConfig(
        **{
            "output_dir": os.path.join(output_dir, "out"),
            **SGD_STEP,
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 2,
            "max_completion_length": 10,
            "beta": 0.5,  # the generalized JSD (both models' distributions in the loss)
            "log_completions": True,  # TRL's table of the step's prompts and completions
        }
        | changes
    )


def main(output_dir: str, family: str = "llama", stage: str = "1") -> None:
    deepspeed.init_distributed(dist_backend="gloo")  # on the CPU accelerate does not start DeepSpeed's communication
    tokenizer = char_tokenizer()
    refuse_padded_teacher(family, refusals.BLOCKLIST)
    trainer = DistillationTrainer(
        model=model(tokenizer),
        teacher_model=teacher(tokenizer, family),
        args=config(output_dir, **ulysses(stage=int(stage))),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    record = recorded_generation(trainer)
    # Each process's own random state (TRL seeds them apart): the group must still sample and shuffle alike.
    torch.manual_seed(1000 + trainer.accelerator.process_index)
    trainer.train()
    forwards = dict(trainer.unpack_stats.get("forwards", {}))  # the step's: the student's and the teacher's
    completions = {key: list(values) for key, values in trainer._logs.items()}  # the table TRL logged

    # Greedy generation in a training step's mode, after the step: Ulysses must leave it whole.
    trainer.model.train()
    trainer.generation_config.do_sample = False
    greedy = trainer._generate(record["prompts"][0])[1]
    # Evaluation (each process its own eval batch, whole), greedy: as in one process. Not under ZeRO-3: there TRL's
    # chunked loss stops in DeepSpeed's parameter gather when the processes evaluate different batches ("Cannot
    # partition a param in flight").
    evaluation = None
    if stage != "3":
        evaluation = trainer.evaluate(eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
    save_first_step(trainer, record, output_dir)
    after = {"greedy": [list(ids) for ids in greedy], "evaluation": evaluation, "forwards": forwards,
             "completions": completions}  # fmt: skip
    finish(trainer, output_dir, after)


if __name__ == "__main__":
    main(*sys.argv[1:])
