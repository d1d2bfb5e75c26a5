"""`unpack-trainer grpo` / `rloo`: TRL's parser and recipes unchanged, our trainer, reward functions as TRL's scripts
take them, errors on one line."""

from __future__ import annotations

import json

import pytest

from unpack_trainer.cli import main
from unpack_trainer.cli.train import make_parser

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def count_a(completions, **kwargs):
    """A reward function imported by its dotted path (``test_rl_command.count_a``)."""
    return [float(text.count("a")) for text in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from unpack_trainer.model_zoo import tiny

    path = tmp_path_factory.mktemp("model")
    tokenizer = tiny.char_tokenizer()
    tiny.tiny_model("llama", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)  # fmt: skip
    tokenizer.save_pretrained(path)
    return path


def test_grpo_trains_with_our_trainer_from_a_recipe(tmp_path, model_dir, caplog):
    """The launched script's body: a recipe, a local prompt file, a reward function by dotted path, LoRA flags, our
    trainer (packed forwards), a saved adapter."""
    import torch

    from unpack_trainer.cli import train

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "ab" * (i % 4 + 1)}) + "\n" for i in range(8)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {data}\nreward_funcs: [test_rl_command.count_a]\n"
        "num_generations: 4\nper_device_train_batch_size: 4\nmax_completion_length: 8\nmax_steps: 1\n"
        "use_peft: true\nlora_r: 4\nlora_target_modules: [q_proj, v_proj]\nuse_cpu: true\nreport_to: none\n"
        "save_strategy: 'no'\nbf16: false\n"
    )
    out = tmp_path / "out"
    parsed = make_parser("grpo").parse_args_and_config(["--config", str(recipe), "--output_dir", str(out)])
    threads = torch.get_num_threads()
    with caplog.at_level("INFO", logger="unpack_trainer"):
        train.main("grpo", *parsed)
    torch.set_num_threads(threads)
    assert "GRPOTrainer: mode=padding_free" in caplog.text
    assert (out / "adapter_config.json").is_file()


@pytest.fixture
def script_here(monkeypatch):
    """`accelerate launch` replaced by the training script run in this process: a non-zero exit status raises
    ``CalledProcessError``, as accelerate's launcher does."""
    import subprocess

    import accelerate.commands.launch as launch

    from unpack_trainer.cli import train

    def launch_command(args):
        code = train.run(args.training_script_args)
        if code:
            raise subprocess.CalledProcessError(code, args.training_script_args)

    monkeypatch.setattr(launch, "launch_command", launch_command)


@pytest.mark.parametrize(
    "rows, flags, fragments",
    [
        (
            [{"prompt": "ab"}],
            ["--reward_funcs", "no_such_reward"],
            ["--reward_funcs no_such_reward", "accuracy_reward"],
        ),
        (
            [{"prompt": "ab"}],
            ["--reward_funcs", "no_such_module.reward"],
            ["--reward_funcs no_such_module.reward", "ModuleNotFoundError"],
        ),
        ([{"question": "ab"}], [], ["no column to train on: found 'question'; GRPOTrainer reads 'prompt'."]),
        ([{"prompt": "ab"}, {"other": 1}], [], ["line 2", "no 'prompt' field"]),
    ],
)
def test_grpo_bad_input_is_one_line_and_exit_2(rows, flags, fragments, tmp_path, capsys, model_dir, script_here):
    """As `unpack-trainer sft`'s errors: one line on stderr, exit status 2, no traceback."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]
    flags = flags or ["--reward_funcs", "accuracy_reward"]
    assert main(["grpo", *argv, *flags, "--max_steps", "1", "--use_cpu", "--report_to", "none"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error" in line.lower()]
    assert line.startswith("unpack-trainer grpo: error: ")
    for fragment in fragments:
        assert fragment in line, (fragment, line)
