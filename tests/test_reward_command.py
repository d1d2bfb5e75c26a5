"""`unpack-trainer reward`: `trl reward`'s parser and recipes unchanged, our RewardTrainer, offline names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unpack_trainer.cli.train import make_parser as _make_parser

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_reward_trains_with_our_trainer_from_a_recipe(tmp_path, caplog, tokenizer, tiny_llama):
    """The launched script's body: a causal LM folder loaded as a sequence classifier (as `trl reward` loads it), a
    local preference file, LoRA flags with task type SEQ_CLS, our trainer, a saved adapter."""
    import torch

    from unpack_trainer.cli import train

    model_dir = tmp_path / "model"
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "ab" * (i % 5 + 1), "chosen": "cd" * (i % 7 + 1), "rejected": "ef" * (i % 3 + 1)} for i in range(8)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {data}\nmax_length: 64\nper_device_train_batch_size: 4\n"
        "max_steps: 2\nuse_peft: true\nlora_task_type: SEQ_CLS\nlora_r: 4\nlora_target_modules: [q_proj, v_proj]\n"
        "use_cpu: true\nreport_to: none\nsave_strategy: 'no'\ngradient_checkpointing: false\n"
    )
    out = tmp_path / "out"
    parsed = _make_parser("reward").parse_args_and_config(["--config", str(recipe), "--output_dir", str(out)])
    threads = torch.get_num_threads()
    with caplog.at_level("INFO", logger="unpack_trainer"):
        train.main("reward", *parsed)
    torch.set_num_threads(threads)
    assert "RewardTrainer: mode=padding_free" in caplog.text and "Self-check of shared prompts passed" in caplog.text
    assert (out / "adapter_config.json").is_file()
