"""`unpack-trainer distillation`: TRL's parser and recipes unchanged, our trainer, the teacher as TRL's script loads it,
errors on one line."""

from __future__ import annotations

import json

import pytest

from unpack_trainer.cli import main
from unpack_trainer.cli.train import make_parser

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _save_tiny(path, *, seed: int, hidden_size: int) -> str:
    from unpack_trainer.model_zoo import tiny

    tokenizer = tiny.char_tokenizer()
    tiny.tiny_model("llama", seed=seed, vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=1,
                    intermediate_size=64, num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)  # fmt: skip
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student folder and a wider teacher folder over the same vocabulary."""
    return (
        _save_tiny(tmp_path_factory.mktemp("student"), seed=0, hidden_size=32),
        _save_tiny(tmp_path_factory.mktemp("teacher"), seed=1, hidden_size=48),
    )


def test_distillation_trains_with_our_trainer_from_a_recipe(tmp_path, models, caplog):
    """The launched script's body: a recipe naming the student and the teacher, a local prompt file, LoRA flags, our
    trainer (packed forwards for both models), a saved adapter."""
    import torch

    from unpack_trainer.cli import train

    student, teacher = models
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "ab" * (i % 4 + 1)}) + "\n" for i in range(8)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {student}\nteacher_model_name_or_path: {teacher}\ndataset_name: {data}\n"
        "per_device_train_batch_size: 4\nmax_completion_length: 8\nmax_steps: 1\nuse_peft: true\nlora_r: 4\n"
        "lora_target_modules: [q_proj, v_proj]\nuse_cpu: true\nreport_to: none\nsave_strategy: 'no'\nbf16: false\n"
    )
    out = tmp_path / "out"
    parsed = make_parser("distillation").parse_args_and_config(["--config", str(recipe), "--output_dir", str(out)])
    threads = torch.get_num_threads()
    with caplog.at_level("INFO", logger="unpack_trainer"):
        train.main("distillation", *parsed)
    torch.set_num_threads(threads)
    assert "DistillationTrainer: mode=padding_free" in caplog.text
    assert "Self-check of the teacher passed" in caplog.text
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
    "rows, teacher, fragments",
    [
        ([{"prompt": "ab"}], None, ["--teacher_model_name_or_path is required"]),
        ([{"prompt": "ab"}], "./no/such/teacher", ["--teacher_model_name_or_path ./no/such/teacher", "no such file"]),
        ([{"question": "ab"}], "teacher", ["no column to train on: found 'question'; DistillationTrainer reads"]),
        ([{"prompt": "ab"}, {"other": 1}], "teacher", ["line 2", "no 'prompt' field"]),
    ],
)
def test_distillation_bad_input_is_one_line_and_exit_2(rows, teacher, fragments, tmp_path, capsys, models,
                                                       script_here):  # fmt: skip
    """As `unpack-trainer grpo`'s errors: one line on stderr, exit status 2, no traceback."""
    student, teacher_dir = models
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--model_name_or_path", student, "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]
    if teacher is not None:
        argv += ["--teacher_model_name_or_path", teacher_dir if teacher == "teacher" else teacher]
    assert main(["distillation", *argv, "--max_steps", "1", "--use_cpu", "--report_to", "none"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error" in line.lower()]
    assert line.startswith("unpack-trainer distillation: error: ")
    for fragment in fragments:
        assert fragment in line, (fragment, line)
