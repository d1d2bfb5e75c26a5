"""Run by tests/test_trainer_ddp.py under `accelerate launch` with 2 processes, as ddp_dpo.py runs DPO:
`unpack_trainer.KTOTrainer` and stock `trl.KTOTrainer`, each on a map-style and on an iterable set of unpaired examples
(train and eval; prompts repeating, so that prompts are shared), fp32; each rank writes, per trainer, the examples
its collator got, the training examples and the log history (the KL estimate gathered over both ranks included) to
OUTPUT_DIR/rank{N}.json."""

from __future__ import annotations

import random
import sys

import trl
from ddp_dpo import data_and_args, main, train_and_record  # this folder is the script's sys.path[0]

from unpack_trainer import KTOConfig, KTOTrainer
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model

TRAINERS = {"ours": (KTOTrainer, KTOConfig), "stock": (trl.KTOTrainer, trl.KTOConfig)}


def examples(count: int) -> list[dict]:
    rng = random.Random(0)
    prompts = ["a" * rng.randint(1, 12) for _ in range(count // 2)]
    return [
        {
            "prompt": prompts[index // 2],  # two examples in a row per prompt
            "completion": "".join(rng.choice("bcdefg") for _ in range(rng.randint(1, 10))),
            "label": rng.random() < 0.5,
        }
        for index in range(count)
    ]


def _token_ids(example: dict) -> list[list[int]]:
    """A tokenized example as ``[prompt_ids, completion_ids, KL_completion_ids]``."""
    return [example["prompt_ids"], example["completion_ids"], example.get("KL_completion_ids", [])]


def run(output_dir: str, name: str, kind: str) -> dict:
    trainer_class, config_class = TRAINERS[name]
    tokenizer = char_tokenizer()
    train, evaluation, args = data_and_args(config_class, output_dir, name, kind, examples(24))
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


if __name__ == "__main__":
    main(sys.argv[1], run)
