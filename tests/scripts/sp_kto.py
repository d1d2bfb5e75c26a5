"""Run by tests/test_sequence_parallel_kto.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): one optimizer step of
``unpack_trainer.KTOTrainer`` under DeepSpeed Ulysses (``sp_size=2``), plain SGD.

Usage: ``sp_kto.py OUTPUT_DIR CASE``, ``CASE`` one of [`CASES`]: ``kto`` (``loss_type="kto"``, KL rows, a separate
reference model), ``apo_zero_unpaired`` (no KL rows, a separate reference model), ``peft`` (``loss_type="kto"``, a
LoRA policy from ``peft_config`` whose reference is the model with its adapter off: a training-mode reference forward, cut like the KL
row). Rank 0 writes OUTPUT_DIR/batch.pt (the whole batch the step trained on: TRL's view, the main row, the KL row and
the reference row) and OUTPUT_DIR/result.json (the logged loss and metrics, the decision, the policy's parameters
after the step); the test computes the same step in one process.
"""

from __future__ import annotations

import os
import random
import sys

import deepspeed
from datasets import Dataset
from sp_train import SGD_STEP, train_one_batch, ulysses  # this folder is the script's sys.path[0]

from unpack_trainer import KTOConfig, KTOTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model

CASES = ("kto", "apo_zero_unpaired", "peft")


def examples(count: int = 8) -> list[dict]:
    """Unpaired examples with distinct prompts of 3 to 10 tokens, each ``prompt + completion`` 21 tokens (DeepSpeed's
    adapter gathers every rank's batch with one all_gather, which gloo runs only on equal shapes: every batch's main
    row has the same length; the KL and reference rows, copied whole, differ), desirable and undesirable mixed."""
    rng = random.Random(0)
    rows = []
    for index in range(count):
        prompt = "".join(rng.choice("ab") for _ in range(3 + index % 8))
        rows.append(
            {
                "prompt": prompt,
                "completion": "".join(rng.choice("cdefg") for _ in range(21 - len(prompt))),
                "label": index % 3 != 1,
            }
        )
    return rows


def config(output_dir: str, case: str, **changes) -> KTOConfig:
    return KTOConfig(
        **{
            "output_dir": os.path.join(output_dir, "out"),
            **SGD_STEP,
            "per_device_train_batch_size": 4,  # four examples in one packed row: DeepSpeed's micro-batch is that row
            "max_length": 64,
            "loss_type": "apo_zero_unpaired" if case == "apo_zero_unpaired" else "kto",
            "beta": 0.5,
        }
        | changes
    )


def models(tokenizer, case: str) -> dict:
    """The models of ``KTOTrainer(...)``: ``model`` and ``ref_model`` (two tiny Llamas); for ``peft`` the policy with
    ``peft_config``, a LoRA drawn at random (``init_lora_weights=False``: TRL seeds before it wraps the model, so every
    run draws the same), whose reference, the model with its adapter off, differs from the policy."""
    from peft import LoraConfig

    vocab = dict(vocab_size=len(tokenizer), max_position_embeddings=512, attn_implementation="sdpa")
    policy = tiny_model("llama", seed=0, **vocab)
    if case != "peft":
        return {"model": policy, "ref_model": tiny_model("llama", seed=1, **vocab)}
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return {"model": policy, "ref_model": None, "peft_config": lora}


def main(output_dir: str, case: str, stage: str = "1") -> None:
    deepspeed.init_distributed(dist_backend="gloo")  # on the CPU accelerate does not start DeepSpeed's communication
    tokenizer = char_tokenizer()
    trainer = KTOTrainer(
        **models(tokenizer, case),
        args=config(output_dir, case, **ulysses(stage=int(stage))),
        train_dataset=Dataset.from_list(examples()),
        processing_class=tokenizer,
    )
    train_one_batch(trainer, output_dir)


if __name__ == "__main__":
    main(*sys.argv[1:4])
