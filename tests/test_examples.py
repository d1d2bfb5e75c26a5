"""The examples: each script run for a few steps in a subprocess, plus their data loading, errors and metric."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from unpack_trainer import load_default_tokenizer
from unpack_trainer.data.default_data import load_default_records

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One thread per process: the examples' tiny model gains little from more, and the test machine is shared.
ENV = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sft_example():
    return _load("sft_packing")


@pytest.fixture(scope="module")
def streaming_example():
    return _load("streaming_packing")


def _run(script: str, *argv: object, tmp_path: Path) -> str:
    env = ENV | {"HF_DATASETS_CACHE": str(tmp_path / "hf_datasets_cache")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *map(str, argv)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _table_rows(out: str) -> dict[str, dict[str, str]]:
    """The final table of sft_packing.py as {run: {column: cell}}."""
    lines = [line for line in out.splitlines() if " | " in line]
    header = [cell.strip() for cell in lines[0].split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


# --------------------------------------------------------------------------------------------------------------------
# The main job, end to end
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_sft_packing_quick_trains_both_and_writes_table_plot_and_model(tmp_path):
    plot = tmp_path / "plots" / "loss.png"
    out = _run(
        "sft_packing.py",
        "--quick",
        "--max-length",
        256,
        "--output-dir",
        tmp_path / "out",
        "--plot",
        plot,
        tmp_path=tmp_path,
    )
    rows = _table_rows(out)
    assert set(rows) == {"packed", "padded"}, out
    for run in ("packed", "padded"):
        row = rows[run]
        assert _number(row["steps"]) == 4
        assert _number(row["real tokens"]) > 0 and _number(row["real tokens/s"]) > 0
        assert 0 < _number(row["train wall-clock (s)"])
        for loss in ("final train loss", "held-out loss/token"):
            assert 0 < _number(row[loss]) < 10  # log(796) = 6.7 at random init
    assert _number(rows["packed"]["padding"]) == 0.0
    assert _number(rows["padded"]["padding"]) > 0.0  # lengths spread from 10 to 256 tokens
    assert re.search(r"packed vs padded: [0-9.]+x less wall-clock, [0-9.]+x the real tokens/s", out), out
    assert f"loss against wall-clock time and samples seen: {plot.resolve()}" in out
    assert plot.read_bytes().startswith(PNG_MAGIC) and plot.stat().st_size > 10_000
    verdict = re.search(
        r"held-out loss per token: packed ([0-9.]+), padded ([0-9.]+) \(packed - padded ([-+][0-9.]+)\); seed noise "
        r"from `python benchmarks/bench_quality.py[^`]*`: std of the padded held-out loss over seeds ([0-9.]+).* -> "
        r"(?:the difference is WITHIN the seed noise|packed is (?:BETTER|WORSE) by more than the seed noise)",
        out,
    )
    assert verdict, out
    assert float(verdict[1]) == pytest.approx(_number(rows["packed"]["held-out loss/token"]), abs=1e-3)
    assert float(verdict[2]) == pytest.approx(_number(rows["padded"]["held-out loss/token"]), abs=1e-3)
    final = tmp_path / "out" / "packed" / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").stat().st_size > 0


@pytest.mark.timeout(300)
def test_sft_packing_quick_with_a_local_model_and_conversational_dataset(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from unpack_trainer import tiny_model_config

    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    model_dir = tmp_path / "my-model"
    LlamaForCausalLM(tiny_model_config(tokenizer, num_hidden_layers=1)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    records = load_default_records("eval")[:80]
    data = tmp_path / "chats.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as stream:
        for r in records:
            messages = [
                {"role": "user", "content": r["prompt"].rstrip("\n")},
                {"role": "assistant", "content": r["completion"]},
            ]
            stream.write(json.dumps({"messages": messages}) + "\n")
    plot = tmp_path / "loss.png"
    out = _run(
        "sft_packing.py",
        "--quick",
        "--skip-padded",
        "--dataset",
        data,
        "--model",
        model_dir,
        "--max-length",
        256,
        "--output-dir",
        tmp_path / "out",
        "--plot",
        plot,
        tmp_path=tmp_path,
    )
    assert f"model: {model_dir}, 0." in out and f"data: {data}" in out
    rows = _table_rows(out)
    assert set(rows) == {"packed"} and _number(rows["packed"]["steps"]) == 4
    assert "packed vs padded" not in out
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_sft_packing_rejects_missing_paths_and_bad_numbers(sft_example, tmp_path, capsys):
    cases = [
        (["--model", tmp_path / "nope"], f"--model {tmp_path / 'nope'}: no such directory"),
        (["--model", tmp_path], "no config.json there"),
        (["--dataset", tmp_path / "missing.jsonl"], f"--dataset {tmp_path / 'missing.jsonl'}: no such file"),
        (["--dataset", tmp_path / "data.csv"], "unknown file type"),
        (["--max-length", "0"], "--max-length must be positive, got 0"),
    ]
    (tmp_path / "data.csv").write_text("prompt,completion\n")
    for argv, message in cases:
        with pytest.raises(SystemExit) as error:
            sft_example.main([str(arg) for arg in argv])
        assert error.value.code == 2
        assert message in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# --dataset: files and directories
# --------------------------------------------------------------------------------------------------------------------


def test_load_data_reads_jsonl_parquet_and_saved_datasets(sft_example, tmp_path):
    from datasets import Dataset, DatasetDict

    records = load_default_records("eval")[:60]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in records))
    parquet = tmp_path / "train.parquet"
    Dataset.from_list(records).to_parquet(str(parquet))
    saved = tmp_path / "saved"
    Dataset.from_list(records).save_to_disk(str(saved))
    saved_dict = tmp_path / "saved_dict"
    DatasetDict(
        {"train": Dataset.from_list(records[:50]), "validation": Dataset.from_list(records[50:])}
    ).save_to_disk(str(saved_dict))

    for path in (jsonl, parquet, saved):
        train, held_out, name = sft_example.load_data(path, seed=0)
        # 5% held out (at least one sample), the rest trained on, nothing lost
        assert (len(train), len(held_out)) == (57, 3) and name == str(path)
        assert sorted([*train["prompt"], *held_out["prompt"]]) == sorted(r["prompt"] for r in records)
    train, held_out, _ = sft_example.load_data(saved_dict, seed=0)
    assert (len(train), len(held_out)) == (50, 10)

    train, held_out, name = sft_example.load_data(None, seed=0)
    assert (len(train), len(held_out)) == (4000, 200) and name == "embedded instruction dataset"


def test_load_data_rejects_unknown_columns_and_non_dataset_directories(sft_example, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "a", "answer": "b"}\n' * 4)
    with pytest.raises(SystemExit, match=r"no known column layout in columns \['answer', 'question'\]"):
        sft_example.load_data(path, seed=0)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(SystemExit, match="not a directory written by Dataset.save_to_disk"):
        sft_example.load_data(tmp_path / "empty_dir", seed=0)


# --------------------------------------------------------------------------------------------------------------------
# The reported metric
# --------------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------------
# Streaming and QLoRA
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_streaming_packing_trains_from_parquet_shards_of_conversations(tmp_path):
    from datasets import Dataset

    records = load_default_records("train")[:300]
    conversations = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"].rstrip("\n")},
                {"role": "assistant", "content": r["completion"]},
            ]
        }
        for r in records
    ]
    shards = tmp_path / "shards"
    shards.mkdir()
    for index in range(2):
        Dataset.from_list(conversations[index::2]).to_parquet(str(shards / f"train-{index}.parquet"))
    out = _run(
        "streaming_packing.py",
        "--data",
        shards,
        "--max-steps",
        3,
        "--logging-steps",
        1,
        "--max-length",
        256,
        "--buffer-size",
        64,
        "--output-dir",
        tmp_path / "out",
        tmp_path=tmp_path,
    )
    assert "streaming 2 parquet file(s)" in out
    assert re.search(r"3 steps in [0-9.]+ s; training loss [0-9.]+ -> [0-9.]+; rows built by StreamingPacker", out)
    fill = re.search(r"(\d+) rows, ([\d,]+) tokens, ([0-9.]+)% full", out)
    assert fill is not None and int(fill.group(1)) >= 3, out
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


def test_streaming_default_shards_and_data_resolution(streaming_example, tmp_path):
    paths = streaming_example.write_default_shards(tmp_path / "jsonl", file_format="jsonl", num_shards=3)
    assert [Path(p).name for p in paths] == [f"train-{i:05d}-of-00003.jsonl" for i in range(3)]
    lines = sum(len(Path(p).read_text().splitlines()) for p in paths)
    assert lines == 4000
    assert streaming_example.resolve_data_files(str(tmp_path / "jsonl")) == (sorted(paths), "json")
    assert streaming_example.resolve_data_files(str(tmp_path / "jsonl" / "*-00003.jsonl")) == (sorted(paths), "json")
    with pytest.raises(SystemExit, match="no such file or directory, and no file matches it"):
        streaming_example.resolve_data_files(str(tmp_path / "missing" / "*.parquet"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text("{}\n")
    (tmp_path / "mixed" / "b.parquet").write_bytes(b"")
    with pytest.raises(SystemExit, match="mixes JSON and Parquet files"):
        streaming_example.resolve_data_files(str(tmp_path / "mixed"))


@pytest.mark.timeout(300)
def test_qlora_packing_quick_trains_a_4bit_model_with_lora_on_packed_rows(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    out = _run("qlora_packing.py", "--quick", "--max-length", 256, "--output-dir", tmp_path / "out", tmp_path=tmp_path)
    assert "packing: pack (" in out, out
    trainable = re.search(r"trainable \(LoRA\) parameters: ([\d,]+) of ([\d,]+)", out)
    assert trainable is not None and 0 < int(trainable.group(1).replace(",", "")) < int(
        trainable.group(2).replace(",", "")
    )
    assert re.search(r"3 steps in [0-9.]+ s; training loss [0-9.]+ -> [0-9.]+", out), out
    adapter = tmp_path / "out" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0


def test_vlm_packing_quick_trains_packed_and_padded(tmp_path):
    """examples/vlm_packing.py --quick: a small Qwen2.5-VL on drawn shapes, packed then padded, and the table."""
    out = _run("vlm_packing.py", "--quick", "--output-dir", tmp_path / "out", tmp_path=tmp_path)
    rows = {line.split(" | ")[0]: line.split(" | ") for line in out.splitlines() if " | " in line}
    assert set(rows) == {"run", "packed", "padded"}
    assert rows["packed"][5] == "0.0%" and rows["padded"][5] != "0.0%"  # padding: none in packed rows
    assert "the padded run's real tokens/s; held-out loss" in out
