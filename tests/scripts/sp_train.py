"""Run by tests/test_sequence_parallel.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): one optimizer step of
``unpack_trainer.SFTTrainer`` under DeepSpeed Ulysses (``sp_size=2``, through accelerate's ``ParallelismConfig``), as a
user sets it up, with plain SGD so that the step's update is the learning rate times the gradient.

Usage: ``sp_train.py OUTPUT_DIR MODE`` (``pack``: ``packing=True``; ``padding_free``: ``padding_free=True``); the
attention backend is ``UNPACK_ATTENTION_BACKEND`` from the environment. Rank 0 writes OUTPUT_DIR/result.json: the
row the step trained on (its tokens, labels and sample lengths), the logged loss, the trainer's decision and the
parameters after the step; the test computes the same step from each sample alone in one process.
"""

from __future__ import annotations

import json
import os
import random
import sys

import deepspeed
import torch
from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
from datasets import Dataset

from unpack_trainer import SFTConfig, SFTTrainer
from unpack_trainer._compat import gathered_parameters
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model

LEARNING_RATE = 0.5

SGD_STEP = {
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "max_steps": 1,
    "optim": "sgd",
    "learning_rate": LEARNING_RATE,
    "lr_scheduler_type": "constant",
    "weight_decay": 0.0,
    "max_grad_norm": 0.0,
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
    "seed": 0,
}
"""The config fields of one logged optimizer step of plain SGD (the update is the learning rate times the gradient),
shared by the sequence-parallel scripts of this folder."""


def recorded_batches(trainer) -> list:
    """The batches ``trainer``'s collator makes from now on, in order (its collator wrapped; the list fills as the
    data loader draws them)."""
    batches = []
    collate = trainer.data_collator

    def recording(examples):
        batches.append(collate(examples))
        return batches[-1]

    trainer.data_collator = recording
    return batches


def recorded_generation(trainer) -> dict[str, list]:
    """What a trainer that generates in its step (GRPO, RLOO, distillation) does from now on, in order: the prompts it
    generates for and what ``_generate`` returns (``prompts``, ``generated``), the examples it scores and the scored
    batch (``examples``, ``scored``), and each batch ``_prepare_inputs`` returns (``inputs``); its methods wrapped."""
    record: dict[str, list] = {"generated": [], "scored": [], "inputs": [], "prompts": [], "examples": []}
    generate, score, prepare = trainer._generate, trainer._generate_and_score_completions, trainer._prepare_inputs

    def recorded_generate(prompts):
        record["prompts"].append(prompts)
        record["generated"].append(generate(prompts))
        return record["generated"][-1]

    def recorded_score(inputs):
        record["examples"].append(inputs)
        out = score(inputs)
        record["scored"].append(dict(out))
        return out

    def recorded_prepare(batch):
        record["inputs"].append(prepare(batch))
        return record["inputs"][-1]

    trainer._generate, trainer._generate_and_score_completions = recorded_generate, recorded_score
    trainer._prepare_inputs = recorded_prepare
    return record



def save_first_step(trainer, record: dict[str, list], output_dir: str) -> None:
    """``output_dir/step.pt`` (written by the first process): the first of everything [`recorded_generation`]
    recorded, and ``copies``: every process's first scored and prepared batch (the group's, gathered)."""
    from unpack_trainer._compat import sequence_parallel_group

    copies = [None] * torch.distributed.get_world_size(sequence_parallel_group())
    torch.distributed.all_gather_object(
        copies, (record["scored"][0], record["inputs"][0]), group=sequence_parallel_group()
    )
    if trainer.accelerator.process_index == 0:
        step = {key: value[0] for key, value in record.items()} | {"copies": copies}
        torch.save(step, os.path.join(output_dir, "step.pt"))


def train_one_batch(trainer, output_dir: str) -> None:
    """Train (one step, [`SGD_STEP`]) and write what a prompt-sharing trainer's test compares: its first batch as
    DeepSpeed's adapter got it whole (``batch.pt``, the first process's) and [`finish`]'s record."""
    from unpack_trainer.packed_seq_info import SHARDED_BATCH_KEY

    batches = recorded_batches(trainer)
    trainer.train()
    if trainer.accelerator.process_index == 0:
        torch.save(batches[0][SHARDED_BATCH_KEY], os.path.join(output_dir, "batch.pt"))
    finish(trainer, output_dir, {})

def rows(count: int = 24) -> list[dict]:
    rng = random.Random(0)
    return [
        {
            "prompt": "a" * rng.randint(1, 12),
            "completion": "".join(rng.choice("bcdefg") for _ in range(rng.randint(4, 30))),
        }
        for _ in range(count)
    ]


def model():
    tokenizer = char_tokenizer()
    return tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512, attn_implementation="sdpa")


def ulysses(sp_size: int = 2, stage: int = 1) -> dict:
    """The two config fields of DeepSpeed Ulysses through accelerate, as a user sets them (ZeRO ``stage``)."""
    return {
        "parallelism_config": ParallelismConfig(
            sp_size=sp_size,
            sp_backend="deepspeed",
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
        ),
        "deepspeed": {
            "zero_optimization": {"stage": stage},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        },
    }


def finish(trainer, output_dir: str, record: dict) -> None:
    """Rank 0 writes OUTPUT_DIR/result.json: ``record``, the first logged step, the decision and the trained
    parameters; then every rank leaves (gloo's teardown can hang after the work is done, see
    ddp_train.exit_without_teardown)."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    with gathered_parameters(unwrapped):  # ZeRO-3: every process takes part in the gather
        parameters = {n: p.detach().tolist() for n, p in unwrapped.named_parameters()}
    if trainer.accelerator.process_index == 0:
        record |= {
            "logged": next(entry for entry in trainer.state.log_history if "loss" in entry),
            "mode": trainer.unpack_decision.mode,
            "reason": trainer.unpack_decision.reason,
            "learning_rate": LEARNING_RATE,
            "parameters": parameters,
        }
        with open(os.path.join(output_dir, "result.json"), "w") as handle:
            json.dump(record, handle)
    torch.distributed.barrier()
    os._exit(0)


def main(output_dir: str, mode: str) -> None:
    # accelerate sets up DeepSpeed's communication only on an accelerator; on the CPU it is started here, over gloo.
    deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = char_tokenizer()
    args = SFTConfig(
        output_dir=os.path.join(output_dir, "out"),
        max_length=96,
        # DeepSpeed's data loader adapter gathers every rank's batch with one all_gather, which gloo (unlike NCCL)
        # only runs on equal shapes: every row padded to the same length (its own pseudo-sample, labels -100).
        pad_to_multiple_of=96,
        packing=mode == "pack",
        padding_free=True if mode == "padding_free" else None,
        per_device_train_batch_size=1,
        **SGD_STEP,
        **ulysses(),
    )
    trainer = SFTTrainer(
        model=model(),
        args=args,
        train_dataset=Dataset.from_list(rows()),
        eval_dataset=Dataset.from_list(rows(8)),
        processing_class=tokenizer,
    )
    batches = recorded_batches(trainer)
    trainer.train()
    # Evaluation: Trainer does not cut evaluation batches and Ulysses leaves an evaluating model whole
    # (sp_disable_in_eval=True, accelerate's default): each process evaluates its own batches whole.
    evaluation = trainer.evaluate()
    # The adapter's first micro-batch is rank 0's first batch, cut in two: the step trained on it.
    first = batches[0]
    info = first["packed_seq_info"]
    finish(
        trainer,
        output_dir,
        {
            "input_ids": first["input_ids"][0].tolist(),
            "labels": first["labels"][0].tolist(),
            "seq_lengths": info.seq_lengths.tolist(),
            "sequence_shards": info.sequence_shards,
            "eval_loss": evaluation["eval_loss"],
        },
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
