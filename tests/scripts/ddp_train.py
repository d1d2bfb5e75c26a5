"""Run by tests/test_trainer_ddp.py under `accelerate launch --num_processes 2 --cpu`: one epoch of packed
training; each rank writes the packed rows it trained on to OUTPUT_DIR/rank{N}.json."""

from __future__ import annotations

import json
import os
import random
import sys

from datasets import Dataset

from unpack_trainer import SFTConfig, SFTTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model


def main(output_dir: str) -> None:
    rng = random.Random(0)
    rows = [
        {
            "prompt": "a" * rng.randint(1, 15),
            "completion": "".join(rng.choice("bcdefg") for _ in range(rng.randint(1, 30))),
        }
        for _ in range(45)
    ]
    tokenizer = char_tokenizer()
    args = SFTConfig(
        output_dir=os.path.join(output_dir, "out"),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_length=40,
        packing=True,
        per_device_train_batch_size=2,
        num_train_epochs=1,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        # the trainer tests' tiny Llama (tests/conftest.py's `tiny_llama` fixture)
        model=tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=None),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    seen, samples, tokens = [], [], []
    collate = trainer.data_collator

    def recording_collator(examples):
        seen.extend(example["input_ids"] for example in examples)
        samples.extend(len(example["seq_lengths"]) for example in examples)
        tokens.extend(len(example["input_ids"]) for example in examples)
        return collate(examples)

    trainer.data_collator = recording_collator
    result = trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(
            {
                "rows": seen,
                "num_rows": len(trainer.train_dataset),
                "samples": samples,
                "tokens": tokens,
                "num_samples": sum(len(lengths) for lengths in trainer.train_dataset["seq_lengths"]),
                "global_step": result.global_step,
                "world_size": trainer.accelerator.num_processes,
            },
            handle,
        )
    exit_without_teardown()


def exit_without_teardown() -> None:
    """Leave the process now, without tearing the process group down, once this rank has written what the test reads.

    torch's gloo backend can deadlock or abort at teardown after training succeeded: a gloo worker thread may still
    hold the last all-gather's tensors, and dropping them needs the GIL, while the thread that destroys the group holds
    the GIL and joins that worker. Here: 4 hangs in 30 runs in `~ProcessGroupGloo` under `~Reducer` after
    `Trainer.end()`, and one SIGABRT ("terminate called without an active exception") at interpreter exit in CI
    without it (pytorch/pytorch#179291).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
