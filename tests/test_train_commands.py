"""`unpack-trainer <command>` for every trainer of ``TRAINERS``: its help says what differs from `trl <command>`, a
recipe in TRL's own format parses exactly as TRL's script parses it, launcher options go to `accelerate launch` as
`trl <command>` sends them, and the shipped example recipe parses. What each command trains is tested beside it
(test_sft_command.py, test_dpo_command.py, test_rl_command.py, test_reward_command.py)."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest

from unpack_trainer.cli import main
from unpack_trainer.cli.train import make_parser
from unpack_trainer.trainers import TRAINERS

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [spec.command for spec in TRAINERS]

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

_COMMON = """\
env:
  UNPACK_TEST_RECIPE_ENV: "1"
model_name_or_path: Qwen/Qwen2-0.5B-Instruct
use_peft: true
lora_r: 32
use_cpu: true
"""
# Recipes in TRL's own format (each trl/scripts/<command>.py's docstring or options, as YAML), with an `env:` section.
RECIPES = {
    "sft": _COMMON
    + """\
dataset_name: trl-lib/Capybara
learning_rate: 2.0e-4
num_train_epochs: 1
packing: true
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
eos_token: <|im_end|>
eval_strategy: steps
eval_steps: 100
lora_alpha: 16
lora_target_modules: [q_proj, v_proj]
output_dir: Qwen2-0.5B-SFT
""",
    "dpo": _COMMON
    + """\
dataset_name: trl-lib/ultrafeedback_binarized
learning_rate: 5.0e-7
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
eval_strategy: steps
eval_steps: 50
loss_type: [sigmoid, sft]
loss_weights: [1.0, 0.5]
lora_alpha: 16
output_dir: Qwen2-0.5B-DPO
""",
    "grpo": _COMMON
    + """\
dataset_name: trl-lib/DeepMath-103K
reward_funcs: [accuracy_reward, think_format_reward]
learning_rate: 1.0e-6
num_generations: 8
max_completion_length: 256
per_device_train_batch_size: 8
loss_type: dr_grpo
beta: 0.04
output_dir: Qwen2-0.5B-GRPO
""",
    "rloo": _COMMON
    + """\
dataset_name: trl-lib/DeepMath-103K
reward_funcs: [accuracy_reward, think_format_reward]
learning_rate: 1.0e-6
num_generations: 8
max_completion_length: 256
per_device_train_batch_size: 8
beta: 0.04
output_dir: Qwen2-0.5B-RLOO
""",
    "reward": _COMMON
    + """\
dataset_name: trl-lib/ultrafeedback_binarized
learning_rate: 1.0e-4
per_device_train_batch_size: 8
center_rewards_coefficient: 0.01
eval_strategy: steps
eval_steps: 50
lora_task_type: SEQ_CLS
output_dir: Qwen2-0.5B-Reward
""",
    "distillation": _COMMON
    + """teacher_model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct
dataset_name: trl-lib/ultrafeedback-prompt
learning_rate: 2.0e-4
num_train_epochs: 1
beta: 0.5
lora_alpha: 16
output_dir: Qwen2.5-0.5B-Distillation
""",
    "kto": _COMMON
    + """\
dataset_name: trl-lib/kto-mix-14k
learning_rate: 5.0e-7
lr_scheduler_type: cosine
per_device_train_batch_size: 16
desirable_weight: 1.0
undesirable_weight: 1.0
output_dir: Qwen2-0.5B-KTO
""",
}
# Flags each command's help lists besides TRL's common ones.
FLAGS = {
    "sft": ("--packing", "--max_length", "--lora_r"),
    "dpo": ("--beta", "--loss_type", "--prefix_sharing", "--packing"),
    "grpo": ("--reward_funcs", "--num_generations", "--prefix_sharing"),
    "rloo": ("--reward_funcs", "--num_generations", "--prefix_sharing"),
    "reward": ("--center_rewards_coefficient", "--prefix_sharing"),
    "distillation": ("--teacher_model_name_or_path", "--beta", "--prefix_sharing"),
    "kto": ("--beta", "--desirable_weight", "--prefix_sharing", "--packing"),
}
# The example recipes shipped in examples/, by command.
EXAMPLES = {"sft": "smollm2_sft.yaml", "dpo": "smollm2_dpo.yaml", "reward": "smollm2_reward.yaml"}


def test_every_command_is_tested_here():
    assert set(RECIPES) == set(FLAGS) == set(COMMANDS)


@pytest.mark.parametrize("spec", TRAINERS, ids=COMMANDS)
def test_help_says_what_differs(spec, capsys):
    assert main([spec.command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: unpack-trainer {spec.command}") and f"unpack_trainer.{spec.trainer}" in out
    for flag in ("--dataset_name", "--model_name_or_path", "--padding_free", "--use_peft", *FLAGS[spec.command]):
        assert flag in out, flag
    assert main(["--help"]) == 0
    assert f"`trl {spec.command}` with unpack_trainer's {spec.trainer}" in capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_trl_recipe_parses_exactly_as_trl(command, tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPES[command])
    argv = ["--config", str(recipe), "--max_steps", "7"]
    monkeypatch.delenv("UNPACK_TEST_RECIPE_ENV", raising=False)
    theirs = __import__(f"trl.scripts.{command}", fromlist=["make_parser"]).make_parser().parse_args_and_config(argv)
    ours = make_parser(command).parse_args_and_config(list(argv))
    assert os.environ["UNPACK_TEST_RECIPE_ENV"] == "1"
    for their, our in zip(theirs, ours):
        assert isinstance(our, type(their))
        for field in fields(their):
            if field.name == "padding_free":  # ours: None lets the trainer decide
                assert getattr(our, field.name) is None
                continue
            assert getattr(our, field.name) == getattr(their, field.name), field.name
    assert ours[1].max_steps == 7


@pytest.mark.parametrize("command", COMMANDS)
def test_launches_like_trl(command, monkeypatch):
    """Launcher options go to `accelerate launch`, everything else to this package's script, as `trl <command>`."""
    import accelerate.commands.launch as launch

    launched = []
    monkeypatch.setattr(launch, "launch_command", launched.append)
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--num_processes", "1", "--use_cpu"]
    assert main([command, *argv]) == 0
    (args,) = launched
    assert args.module and args.training_script == "unpack_trainer.cli.train" and args.num_processes == 1
    assert args.training_script_args == [command, "--model_name_or_path", "m", "--dataset_name", "d", "--use_cpu"]


@pytest.mark.parametrize("command", list(EXAMPLES))
def test_the_smollm2_example_recipe_parses(command):
    script, training, model, _ = make_parser(command).parse_args_and_config(
        ["--config", str(ROOT / "examples" / EXAMPLES[command])]
    )
    assert model.model_name_or_path == "unpack_trainer:smollm2"
    assert script.dataset_name.startswith("unpack_trainer:")
    assert 0 < training.max_steps <= 10
