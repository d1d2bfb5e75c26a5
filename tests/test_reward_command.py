"""`unpack-trainer reward`: `trl reward`'s parser and recipes unchanged, our RewardTrainer, offline names."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import pytest

from unpack_trainer.cli import main
from unpack_trainer.cli.train import make_parser as _make_parser

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# A recipe in TRL's own format (trl/scripts/reward.py's options as YAML), with an `env:` section.
TRL_RECIPE = """\
env:
  UNPACK_TEST_REWARD_RECIPE_ENV: "1"
model_name_or_path: Qwen/Qwen2-0.5B-Instruct
dataset_name: trl-lib/ultrafeedback_binarized
learning_rate: 1.0e-4
per_device_train_batch_size: 8
center_rewards_coefficient: 0.01
eval_strategy: steps
eval_steps: 50
use_peft: true
lora_task_type: SEQ_CLS
lora_r: 32
output_dir: Qwen2-0.5B-Reward
use_cpu: true
"""


def test_help_says_what_differs(capsys):
    assert main(["reward", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: unpack-trainer reward") and "unpack_trainer.RewardTrainer" in out
    for flag in ("--dataset_name", "--center_rewards_coefficient", "--prefix_sharing", "--padding_free", "--use_peft"):
        assert flag in out
    assert "unpack_trainer:preference_chat" in out
    assert main(["--help"]) == 0
    assert "`trl reward` with unpack_trainer's RewardTrainer" in capsys.readouterr().out


def test_a_trl_recipe_parses_exactly_as_trl_reward(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TRL_RECIPE)
    argv = ["--config", str(recipe), "--max_steps", "7"]
    monkeypatch.delenv("UNPACK_TEST_REWARD_RECIPE_ENV", raising=False)
    theirs = __import__("trl.scripts.reward", fromlist=["make_parser"]).make_parser().parse_args_and_config(list(argv))
    ours = _make_parser("reward").parse_args_and_config(list(argv))
    assert os.environ["UNPACK_TEST_REWARD_RECIPE_ENV"] == "1"
    for their, our in zip(theirs, ours):
        assert isinstance(our, type(their))
        for field in fields(their):
            assert getattr(our, field.name) == getattr(their, field.name), field.name
    assert ours[1].max_steps == 7 and ours[1].prefix_sharing and ours[1].padding_free is None


def test_the_smollm2_example_recipe_parses():
    script, training, model, _ = _make_parser("reward").parse_args_and_config(
        ["--config", str(ROOT / "examples" / "smollm2_reward.yaml")]
    )
    assert (model.model_name_or_path, script.dataset_name) == (
        "unpack_trainer:smollm2",
        "unpack_trainer:preference_chat",
    )
    assert model.lora_task_type == "SEQ_CLS" and training.prefix_sharing and 0 < training.max_steps <= 10


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
