"""Run by tests/test_sequence_parallel.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): one optimizer step of
``unpack_trainer.GRPOTrainer`` (or ``RLOOTrainer``) under DeepSpeed Ulysses (``sp_size=2``), a reference model
(``beta > 0``), plain SGD, sampled completions of different lengths.

Usage: ``sp_grpo.py OUTPUT_DIR [TRAINER [ZERO_STAGE]]`` (``grpo``, the default, or ``rloo``; ZeRO stage 1 by
default). Every process records what the step trained on; rank 0 writes OUTPUT_DIR/step.pt (the prompts of the step,
TRL's generation output, the examples it scored, the scored batch before TRL's shuffle and the batch the loss read,
every process's copy of the last two) and OUTPUT_DIR/result.json (the logged loss and metrics, the decision, the
policy's parameters after the step, and what greedy generation and evaluation under Ulysses give after it); the test
computes the same step in one process.
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

from unpack_trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, raise_token_logit, tiny_model

TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}
PROMPTS = ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvw", "xyz"]


def count_a(completions, **kwargs):
    return [float(text.count("a")) - 0.1 * len(text) for text in completions]


def model(tokenizer):
    """A tiny Llama whose end-of-sequence logit is raised (completions of different lengths)."""
    built = tiny_model("llama", seed=0, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                       intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       attn_implementation="sdpa")  # fmt: skip
    return raise_token_logit(built, tokenizer.eos_token_id, 2.5)


def saved_model(tokenizer, output_dir: str) -> str:
    """[`model`] saved as a folder (rank 0; the others wait): TRL builds the separate reference model (``beta > 0``)
    from the policy's folder."""
    path = os.path.join(output_dir, "model")
    if int(os.environ.get("RANK", "0")) == 0:
        model(tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
    torch.distributed.barrier()
    return path


def config(name: str, output_dir: str, **changes):
    beta = {"beta": 0.1} if name == "grpo" else {"beta": 0.05}
    return TRAINERS[name][1](
        **{
            "output_dir": os.path.join(output_dir, "out"),
            **SGD_STEP,
            "per_device_train_batch_size": 4,
            "num_generations": 2,  # two whole groups in each process's batch
            "max_completion_length": 10,
            "per_device_eval_batch_size": 4,
            "log_completions": True,  # TRL's table of the step's prompts, completions, rewards and advantages
            **beta,
        }
        | changes
    )


def logged_table(trainer) -> dict:
    """TRL's table of logged completions (``trainer._logs``: deques, and dicts of deques per reward function and
    extra column), as plain lists."""
    return {
        key: {name: list(values) for name, values in logged.items()} if isinstance(logged, dict) else list(logged)
        for key, logged in trainer._logs.items()
    }


def main(output_dir: str, name: str = "grpo", stage: str = "1") -> None:
    deepspeed.init_distributed(dist_backend="gloo")  # on the CPU accelerate does not start DeepSpeed's communication
    tokenizer = char_tokenizer()
    trainer = TRAINERS[name][0](
        model=saved_model(tokenizer, output_dir),
        reward_funcs=count_a,
        args=config(name, output_dir, **ulysses(stage=int(stage))),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    record = recorded_generation(trainer)
    # Each process's own random state (TRL seeds them alike): the group must still sample and shuffle alike.
    torch.manual_seed(1000 + trainer.accelerator.process_index)
    trainer.train()
    completions = logged_table(trainer)

    # Greedy generation in a training step's mode, after the step: Ulysses must leave it whole.
    trainer.model.train()
    trainer.generation_config.do_sample = False
    greedy = trainer._generate(record["prompts"][0])[1]
    forwards = dict(trainer.unpack_stats.get("forwards", {}))  # the step's and the greedy generation's
    # Evaluation (each process its own eval batch, whole), greedy: as in one process.
    evaluation = trainer.evaluate(eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}))
    save_first_step(trainer, record, output_dir)
    after = {"greedy": [list(ids) for ids in greedy], "evaluation": evaluation, "completions": completions}
    finish(trainer, output_dir, after | {"forwards": forwards})


if __name__ == "__main__":
    main(*sys.argv[1:])
