"""`unpack-trainer dpo`: TRL's parser and recipes unchanged, our trainer, the embedded preference set offline."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import pytest

from unpack_trainer.cli import main
from unpack_trainer.cli.train import load_dataset as load_dpo_dataset
from unpack_trainer.cli.train import make_parser as _make_parser


def make_parser():
    return _make_parser("dpo")


ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# A recipe in TRL's own format (trl/scripts/dpo.py's docstring, as YAML), with an `env:` section.
TRL_RECIPE = """\
env:
  UNPACK_TEST_DPO_RECIPE_ENV: "1"
model_name_or_path: Qwen/Qwen2-0.5B-Instruct
dataset_name: trl-lib/ultrafeedback_binarized
learning_rate: 5.0e-7
num_train_epochs: 1
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
eval_strategy: steps
eval_steps: 50
loss_type: [sigmoid, sft]
loss_weights: [1.0, 0.5]
use_peft: true
lora_r: 32
lora_alpha: 16
output_dir: Qwen2-0.5B-DPO
use_cpu: true
"""


def test_help_says_what_differs(capsys):
    assert main(["dpo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: unpack-trainer dpo")
    assert "unpack_trainer.DPOTrainer" in out
    for flag in ("--dataset_name", "--beta", "--loss_type", "--prefix_sharing", "--packing", "--use_peft"):
        assert flag in out
    assert main(["--help"]) == 0
    assert "`trl dpo` with unpack_trainer's DPOTrainer" in capsys.readouterr().out


def test_a_trl_recipe_parses_exactly_as_trl_dpo(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TRL_RECIPE)
    argv = ["--config", str(recipe), "--max_steps", "7", "--beta", "0.2"]
    monkeypatch.delenv("UNPACK_TEST_DPO_RECIPE_ENV", raising=False)
    theirs = __import__("trl.scripts.dpo", fromlist=["make_parser"]).make_parser().parse_args_and_config(list(argv))
    ours = make_parser().parse_args_and_config(list(argv))
    assert os.environ["UNPACK_TEST_DPO_RECIPE_ENV"] == "1"
    for their, our in zip(theirs, ours):
        assert isinstance(our, type(their))
        for field in fields(their):
            if field.name == "padding_free":  # ours: None lets the trainer decide; TRL: False
                assert getattr(our, field.name) is None
                continue
            assert getattr(our, field.name) == getattr(their, field.name), field.name
    assert ours[1].max_steps == 7 and ours[1].beta == 0.2 and ours[1].prefix_sharing


def test_the_smollm2_example_recipe_parses():
    script, training, model, _ = make_parser().parse_args_and_config(
        ["--config", str(ROOT / "examples" / "smollm2_dpo.yaml")]
    )
    assert (model.model_name_or_path, script.dataset_name) == (
        "unpack_trainer:smollm2",
        "unpack_trainer:preference_chat",
    )
    assert training.prefix_sharing and training.use_cpu and 0 < training.max_steps <= 10


def test_embedded_preference_names():
    chat = load_dpo_dataset("unpack_trainer:preference_chat")
    assert {split: len(part) for split, part in chat.items()} == {"train": 4000, "test": 200}
    assert chat["train"][0]["chosen"][0]["role"] == "assistant"
    plain = load_dpo_dataset("unpack_trainer:preference")
    assert isinstance(plain["test"][0]["rejected"], str)


def test_dpo_launches_like_trl_dpo(monkeypatch):
    import accelerate.commands.launch as launch

    launched = []
    monkeypatch.setattr(launch, "launch_command", launched.append)
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--num_processes", "1", "--use_cpu"]
    assert main(["dpo", *argv]) == 0
    (args,) = launched
    assert args.module and args.training_script == "unpack_trainer.cli.train" and args.num_processes == 1
    assert args.training_script_args == ["dpo", "--model_name_or_path", "m", "--dataset_name", "d", "--use_cpu"]


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
