"""`unpack-trainer dpo`: TRL's parser and recipes unchanged, our trainer, the embedded preference set offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unpack_trainer.cli.train import load_dataset as load_dpo_dataset
from unpack_trainer.cli.train import make_parser as _make_parser


def make_parser():
    return _make_parser("dpo")


ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_embedded_preference_names():
    chat = load_dpo_dataset("unpack_trainer:preference_chat")
    assert {split: len(part) for split, part in chat.items()} == {"train": 4000, "test": 200}
    assert chat["train"][0]["chosen"][0]["role"] == "assistant"
    plain = load_dpo_dataset("unpack_trainer:preference")
    assert isinstance(plain["test"][0]["rejected"], str)


def test_dpo_trains_with_our_trainer_from_a_recipe(tmp_path, caplog, tokenizer, tiny_llama):
    """The launched script's body: a recipe, a local preference file, LoRA flags, our trainer, a saved adapter."""
    import torch

    from unpack_trainer.cli import train

    model_dir = tmp_path / "model"
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "ab" * (i % 5 + 1), "chosen": "cd" * (i % 7 + 1), "rejected": "ef" * (i % 3 + 1)} for i in range(16)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {data}\nmax_length: 64\nper_device_train_batch_size: 4\n"
        "max_steps: 2\nuse_peft: true\nlora_r: 4\nlora_target_modules: [q_proj, v_proj]\nuse_cpu: true\n"
        "report_to: none\nsave_strategy: 'no'\n"
    )
    out = tmp_path / "out"
    parsed = make_parser().parse_args_and_config(["--config", str(recipe), "--output_dir", str(out)])
    threads = torch.get_num_threads()
    with caplog.at_level("INFO", logger="unpack_trainer"):
        train.main("dpo", *parsed)
    torch.set_num_threads(threads)
    assert "DPOTrainer: mode=padding_free" in caplog.text
    assert (out / "adapter_config.json").is_file()
