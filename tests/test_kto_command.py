"""`unpack-trainer kto`: TRL's parser and recipes unchanged, our trainer, unpaired or paired local data and the
embedded preference set offline, and a data file without KTO's columns refused with the file and the columns named."""

from __future__ import annotations

import json

import pytest

from unpack_trainer.cli.train import make_parser as _make_parser

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def make_parser():
    return _make_parser("kto")


def _recipe(tmp_path, model_dir, data: str) -> list[str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {data}\nmax_length: 64\nper_device_train_batch_size: 4\n"
        "max_steps: 2\nuse_peft: true\nlora_r: 4\nlora_target_modules: [q_proj, v_proj]\nuse_cpu: true\n"
        "report_to: none\nsave_strategy: 'no'\nbf16: false\n"
    )
    return ["--config", str(recipe), "--output_dir", str(tmp_path / "out")]


@pytest.fixture
def model_dir(tmp_path, tokenizer, tiny_llama):
    path = tmp_path / "model"
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("layout", ["unpaired", "paired"])
def test_kto_trains_with_our_trainer_from_a_recipe(layout, tmp_path, caplog, model_dir):
    """The launched script's body: a recipe, unpaired rows (or pairs, which TRL unpairs), LoRA flags, our trainer
    packing, a saved adapter."""
    import torch

    from unpack_trainer.cli import train

    data = tmp_path / "train.jsonl"
    if layout == "unpaired":
        rows = [{"prompt": "ab" * (i % 5 + 1), "completion": "cd" * (i % 7 + 1), "label": i % 3 != 0}
                for i in range(16)]  # fmt: skip
    else:
        rows = [{"prompt": "ab" * (i % 5 + 1), "chosen": "cd" * (i % 7 + 1), "rejected": "ef" * (i % 3 + 1)}
                for i in range(8)]  # fmt: skip
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    parsed = make_parser().parse_args_and_config(_recipe(tmp_path, model_dir, str(data)))
    threads = torch.get_num_threads()
    with caplog.at_level("INFO", logger="unpack_trainer"):
        train.main("kto", *parsed)
    torch.set_num_threads(threads)
    assert "KTOTrainer: mode=padding_free" in caplog.text
    assert (tmp_path / "out" / "adapter_config.json").is_file()


def test_the_shipped_preference_sets_are_offered(capsys):
    """KTO takes pairs (TRL unpairs them), so the shipped preference sets are among its offline datasets."""
    from unpack_trainer.cli import main

    assert main(["kto", "--help"]) == 0
    out = capsys.readouterr().out
    assert "unpack_trainer:preference" in out and "unpack_trainer:preference_chat" in out


def test_a_file_without_kto_columns_is_refused_with_its_columns(tmp_path, model_dir):
    from unpack_trainer.cli import train
    from unpack_trainer.cli.commands import CLIError

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": "ab", "answer": "cd"}) + "\n" for _ in range(4)))
    parsed = make_parser().parse_args_and_config(_recipe(tmp_path, model_dir, str(data)))
    with pytest.raises(CLIError, match="'completion' \\+ 'label'; 'chosen' \\+ 'rejected'"):
        train.main("kto", *parsed)
    data.write_text("".join(json.dumps({"prompt": "ab", "completion": "cd"}) + "\n" for _ in range(4)))
    parsed = make_parser().parse_args_and_config(_recipe(tmp_path, model_dir, str(data)))
    with pytest.raises(CLIError, match="no 'label' column"):
        train.main("kto", *parsed)
