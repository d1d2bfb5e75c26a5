"""`unpack-trainer analyze`: real files in a temporary directory, return codes, errors, the plot, the console script."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from unpack_trainer import load_default_tokenizer
from unpack_trainer.cli import main
from unpack_trainer.cli.commands.analyze import detect_layout, format_report, open_table, read_lengths
from unpack_trainer.data.default_data import load_default_records
from unpack_trainer.data.estimate import analyze_lengths, estimated_speedup, padded_batches

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def records():
    """40 prompt/completion records from the embedded data, lengths from about 10 to several hundred tokens."""
    return load_default_records("eval")[:40]


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def _write_jsonl(path, rows):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as stream:
        for row in rows:
            stream.write(json.dumps(row) + "\n")
    return path


def _messages(record):
    return [
        {"role": "user", "content": record["prompt"].rstrip("\n")},
        {"role": "assistant", "content": record["completion"]},
    ]


def _run(capsys, *argv):
    code = main(["analyze", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _reported(out: str, name: str) -> str:
    """The value printed after ``name`` at the start of a report line."""
    for line in out.splitlines():
        if line.strip().startswith(name):
            return line.strip()[len(name) :].split()[0]
    raise AssertionError(f"{name!r} not in the report:\n{out}")


# --------------------------------------------------------------------------------------------------------------------
# analyze_lengths: hand-computed cases
# --------------------------------------------------------------------------------------------------------------------


def test_analyze_lengths_by_hand():
    a = analyze_lengths([100, 10, 90, 10, 0], max_length=128, batch_size=2)
    assert a.num_empty == 1 and a.num_samples == 4 and a.num_truncated == 0
    assert a.real_tokens == 210
    assert a.padded_tokens == int(padded_batches(np.array([100, 10, 90, 10]), 2, seed=0)[1].sum())  # random batches
    assert a.sorted_padded_tokens == 2 * 10 + 2 * 100  # batches [10, 10] and [90, 100]
    assert a.num_batches == 2
    assert sorted(sorted(row) for row in a.rows) == [[0, 1, 3], [2]]  # 100 + 10 + 10 = 120 <= 128, then 90
    assert a.packed_tokens == 2 * 128
    assert a.packing_efficiency == pytest.approx(210 / 256)
    assert a.speedup == pytest.approx(a.padded_tokens / 210) == estimated_speedup(np.array([100, 10, 90, 10]), 2)
    assert a.sorted_speedup == pytest.approx(220 / 210)
    real, padded = padded_batches(np.array([100, 10, 90, 10]), 2, seed=0)
    np.testing.assert_allclose(a.batch_fill, real / padded)
    np.testing.assert_allclose(sorted(a.row_fill), [90 / 128, 120 / 128])


def test_analyze_lengths_truncates_long_samples_and_pads_the_last_batch():
    a = analyze_lengths([300, 5, 7], max_length=128, batch_size=2)
    assert (a.num_truncated, a.truncated_tokens, a.real_tokens) == (1, 172, 140)
    assert a.sorted_padded_tokens == 2 * 7 + 1 * 128  # sorted [5, 7] [128]: the last batch holds one sample
    assert len(a.rows) == 2 and a.packed_tokens == 256
    assert a.lengths.tolist() == [300, 5, 7]  # statistics are on the untruncated lengths


def test_analyze_shows_the_window_the_default_packer_chooses():
    # uniform 700-1400 in rows of 2048: 4 open rows are far from best-fit decreasing, so the window widens
    lengths = np.random.default_rng(0).integers(700, 1401, 2000)
    a = analyze_lengths(lengths, max_length=2048, batch_size=8)
    assert (
        a.default_packing.startswith("windowed best fit: ") and "window 4 alone gave +" in a.default_packing
    )
    assert "The trainer's default packer (packing_order='windowed', seed 0): windowed best fit" in format_report(a)


@pytest.mark.parametrize(
    ("lengths", "max_length", "batch_size", "message"),
    [([1, 2], 0, 1, "max_length"), ([1, 2], 4, 0, "batch_size"), ([3, -1], 4, 1, "Sample 1"), ([0, 0], 4, 1, "no")],
)
def test_analyze_lengths_rejects_bad_input(lengths, max_length, batch_size, message):
    with pytest.raises(ValueError, match=message):
        analyze_lengths(lengths, max_length=max_length, batch_size=batch_size)


# --------------------------------------------------------------------------------------------------------------------
# Every input format and column layout, counted the way TRL counts
# --------------------------------------------------------------------------------------------------------------------


def _trl_lengths(tokenizer, dataset, tmp_path):
    """Token counts of TRL's own SFTTrainer data preparation (no truncation), the reference for ``analyze``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=None, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = SFTTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=dataset, processing_class=tokenizer)
    return [len(ids) for ids in trainer.train_dataset["input_ids"]]


@pytest.mark.parametrize("layout", ["prompt_completion", "conversational_prompt_completion", "messages", "text"])
def test_lengths_match_trl(tmp_path, records, tokenizer, layout):
    from datasets import Dataset

    if layout == "prompt_completion":
        rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in records]
    elif layout == "conversational_prompt_completion":
        rows = [{"prompt": _messages(r)[:1], "completion": _messages(r)[1:]} for r in records]
    elif layout == "messages":
        rows = [{"messages": _messages(r)} for r in records]
    else:
        rows = [{"text": r["prompt"] + r["completion"]} for r in records]
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    table = open_table(str(path))
    ours = read_lengths(table, detect_layout(table.columns), tokenizer, "default").tolist()
    assert ours == _trl_lengths(tokenizer, Dataset.from_list(rows), tmp_path)


def test_jsonl_with_plot(tmp_path, capsys, records, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", records)
    plot = tmp_path / "lengths.png"
    code, out, err = _run(capsys, path, "--max-length", 256, "--batch-size", 4, "--plot", plot)
    assert code == 0, err
    assert "layout: `prompt` + `completion`" in out and "JSON lines, 40 rows" in out
    assert "embedded default tokenizer" in out
    lengths = [
        len(ids) for ids in tokenizer([r["prompt"] + r["completion"] + "<|eos|>" for r in records])["input_ids"]
    ]
    expected = analyze_lengths(lengths, max_length=256, batch_size=4)
    assert _reported(out, "samples") == "40"
    assert _reported(out, "total tokens") == f"{sum(lengths):,}"
    assert _reported(out, "max") == f"{max(lengths):,}"
    assert _reported(out, "packed rows") == f"{len(expected.rows):,}"
    assert expected.num_truncated > 0 and f"{expected.num_truncated:,} sample(s)" in out
    assert f"{expected.speedup:.2f}x over random padded batches" in out
    assert "token-count estimate" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == PNG_MAGIC


def test_gzipped_jsonl_and_json_array(tmp_path, capsys, records):
    gz = _write_jsonl(tmp_path / "train.jsonl.gz", records)
    array = tmp_path / "train.json"
    array.write_text(json.dumps(records), encoding="utf-8")
    outputs = []
    for path in (gz, array):
        code, out, err = _run(capsys, path, "--max-length", 512)
        assert code == 0, err
        outputs.append(out.split("\n", 1)[1])  # everything after the "data:" line
    assert outputs[0] == outputs[1]


def test_parquet_messages(tmp_path, capsys, records):
    from datasets import Dataset

    path = tmp_path / "chat.parquet"
    Dataset.from_dict({"messages": [_messages(r) for r in records], "id": list(range(len(records)))}).to_parquet(path)
    plot = tmp_path / "chat.png"
    code, out, err = _run(capsys, path, "--max-length", 1024, "--plot", plot)
    assert code == 0, err
    assert "Parquet, 40 rows" in out and "conversational `messages`" in out
    assert "Every sample fits in max_length=1,024" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == PNG_MAGIC


def test_saved_dataset_pretokenized(tmp_path, capsys):
    from datasets import Dataset

    lengths = [5, 300, 17, 64, 2000, 9]
    Dataset.from_dict({"input_ids": [list(range(n)) for n in lengths]}).save_to_disk(str(tmp_path / "saved"))
    code, out, err = _run(capsys, tmp_path / "saved", "--max-length", 512, "--tokenizer", tmp_path / "absent")
    assert code == 0, err  # pre-tokenized data needs no tokenizer, so a bad --tokenizer is not even opened
    assert "saved dataset, 6 rows" in out and "not needed (pre-tokenized input_ids)" in out
    assert _reported(out, "total tokens") == f"{sum(lengths):,}"
    assert "1 sample(s) (16.7 %) are longer than max_length=512" in out and "dropping 1,488 tokens" in out


def test_saved_dataset_dict_splits(tmp_path, capsys):
    from datasets import Dataset, DatasetDict

    splits = {
        name: Dataset.from_dict({"input_ids": [[1] * n for n in sizes]})
        for name, sizes in (("train", [3, 4, 5]), ("validation", [7, 8]))
    }
    DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    code, out, _ = _run(capsys, tmp_path / "dd", "--max-length", 16)
    assert code == 0 and "split 'train', 3 rows" in out
    code, out, _ = _run(capsys, tmp_path / "dd", "--max-length", 16, "--split", "validation")
    assert code == 0 and "split 'validation', 2 rows" in out
    code, _, err = _run(capsys, tmp_path / "dd", "--split", "test")
    assert code == 2 and "no split 'test'" in err and "'validation'" in err


@pytest.mark.parametrize("argv", [[], ["default"], ["--dataset", "default"]])
def test_embedded_default_dataset(capsys, argv):
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert "embedded default dataset, split 'train', 4,000 rows" in out
    assert "tokenizer: embedded default tokenizer" in out
    assert "max_length=1,024" in out and "batch size 8" in out  # TRL's defaults


def test_tokenizer_from_a_directory(tmp_path, capsys, records, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": _messages(r)} for r in records])
    code, out, err = _run(capsys, path, "--tokenizer", tmp_path / "tok")
    assert code == 0, err
    assert f"tokenizer: {tmp_path / 'tok'}" in out


# --------------------------------------------------------------------------------------------------------------------
# Errors: exit code 2, one line, no traceback
# --------------------------------------------------------------------------------------------------------------------


def _assert_one_line_error(code, err, *fragments):
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unpack-trainer analyze: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_error_missing_file(tmp_path, capsys):
    code, _, err = _run(capsys, tmp_path / "nope.jsonl")
    _assert_one_line_error(code, err, "no such file or directory", "nope.jsonl")


def test_error_unknown_column_layout(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [{"question": "a", "answer": "b"}])
    code, _, err = _run(capsys, path)
    _assert_one_line_error(code, err, "unknown column layout", "'question', 'answer'", "'input_ids'", "'messages'")


def test_error_conversations_without_chat_template(tmp_path, capsys, records, tokenizer):
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    tokenizer.backend_tokenizer.save(str(bare))  # a tokenizer.json alone carries no chat template
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": _messages(r)} for r in records])
    code, _, err = _run(capsys, path, "--tokenizer", bare)
    _assert_one_line_error(code, err, "conversational", "no chat template", "--tokenizer")
    # the same file is fine for plain text
    text = _write_jsonl(tmp_path / "text.jsonl", [{"text": r["prompt"]} for r in records])
    code, out, err = _run(capsys, text, "--tokenizer", bare)
    assert code == 0, err


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (lambda d: d / "absent_tokenizer", ["tokenizer not found", "absent_tokenizer"]),
        (lambda d: (d / "empty").mkdir() or d / "empty", ["could not load a tokenizer"]),
    ],
)
def test_error_unusable_tokenizer(tmp_path, capsys, records, make, fragments):
    path = _write_jsonl(tmp_path / "text.jsonl", [{"text": r["prompt"]} for r in records])
    code, _, err = _run(capsys, path, "--tokenizer", make(tmp_path))
    _assert_one_line_error(code, err, *fragments)


def test_error_bad_files(tmp_path, capsys):
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    code, _, err = _run(capsys, csv)
    _assert_one_line_error(code, err, "unsupported file type .csv", ".parquet")

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": oops}\n')
    code, _, err = _run(capsys, broken)
    _assert_one_line_error(code, err, "line 2", "not valid JSON")

    missing_field = _write_jsonl(tmp_path / "ragged.jsonl", [{"text": "a"}, {"body": "b"}])
    code, _, err = _run(capsys, missing_field)
    _assert_one_line_error(code, err, "line 2", "no 'text' field")

    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_bytes(b"not parquet at all")
    code, _, err = _run(capsys, not_parquet)
    _assert_one_line_error(code, err, "not a readable Parquet file")

    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    code, _, err = _run(capsys, plain_dir)
    _assert_one_line_error(code, err, "not a dataset written by `Dataset.save_to_disk`")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, _, err = _run(capsys, empty)
    _assert_one_line_error(code, err, "has no rows")

    bad_type = _write_jsonl(tmp_path / "numbers.jsonl", [{"text": 3}])
    code, _, err = _run(capsys, bad_type)
    _assert_one_line_error(code, err, "row 0", "'text' must be a string")


def test_error_bad_plot_path(tmp_path, capsys, records):
    path = _write_jsonl(tmp_path / "train.jsonl", records)
    code, _, err = _run(capsys, path, "--plot", tmp_path / "no" / "such" / "dir.png")
    _assert_one_line_error(code, err, "cannot write the plot", "does not exist")
    code, _, err = _run(capsys, path, "--plot", tmp_path / "plot.xyz")
    _assert_one_line_error(code, err, "unknown image format .xyz", ".png")


def test_usage_errors_and_help(capsys):
    assert main(["analyze", "--max-length", "0"]) == 2
    assert "expected a positive integer" in capsys.readouterr().err
    assert main(["analyze", "a.jsonl", "--dataset", "b.jsonl"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main([]) == 2  # a command is required
    capsys.readouterr()

    assert main(["analyze", "--help"]) == 0
    text = capsys.readouterr().out
    for fragment in ("DATA", "--max-length", "--batch-size", "--tokenizer", "--plot", "input_ids", "messages"):
        assert fragment in text
    assert main(["--help"]) == 0
    assert "analyze" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------------------------
# Large inputs and the installed console script
# --------------------------------------------------------------------------------------------------------------------


def test_large_pretokenized_parquet(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(150), 0.9, size=30_000).astype(np.int64), 1, 4000)
    ids = pa.array([np.zeros(n, dtype=np.int32) for n in lengths], type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "big.parquet")
    code, out, err = _run(capsys, tmp_path / "big.parquet", "--max-length", 2048, "--batch-size", 16)
    assert code == 0, err
    expected = analyze_lengths(lengths, max_length=2048, batch_size=16)
    assert _reported(out, "samples") == "30,000"
    assert _reported(out, "packed rows") == f"{len(expected.rows):,}"
    assert expected.packing_efficiency > 0.99 and expected.speedup > 2


def console_script(name: str) -> str | None:
    """The console script ``name`` of the environment running the tests: where this interpreter installs scripts
    (``sysconfig.get_path("scripts")``: found when the environment's python is run directly, without an activated
    environment putting its scripts on ``PATH``), else the one ``PATH`` finds."""
    for candidate in (name, f"{name}.exe"):
        path = Path(sysconfig.get_path("scripts")) / candidate
        if path.is_file():
            return str(path)
    return shutil.which(name)


def test_console_script_is_found_without_an_activated_environment(monkeypatch):
    """``venv/bin/python -m pytest`` runs with the environment's scripts off ``PATH``: the script is still found."""
    monkeypatch.setenv("PATH", "")
    executable = console_script("unpack-trainer")
    assert executable is not None
    assert Path(executable).parent == Path(sysconfig.get_path("scripts"))


def test_console_script(tmp_path, records):
    executable = console_script("unpack-trainer")
    assert executable, "the `unpack-trainer` console script is not installed; run `pip install -e .`"
    path = _write_jsonl(tmp_path / "train.jsonl", records)
    plot = tmp_path / "script.png"
    result = subprocess.run(
        [executable, "analyze", str(path), "--max-length", "512", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Estimated speedup of packing" in result.stdout
    assert plot.read_bytes()[:8] == PNG_MAGIC

    result = subprocess.run([executable, "analyze", str(tmp_path / "missing.jsonl")], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"unpack-trainer analyze: error: no such file or directory: {tmp_path / 'missing.jsonl'}"
    ]


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "unpack_trainer.cli", "analyze", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "--max-length" in result.stdout


def test_import_is_light():
    code = (
        "import json, sys, unpack_trainer.cli;"
        "print(json.dumps([m for m in ('torch', 'transformers', 'datasets', 'matplotlib') if m in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == []


def test_bench_runs_the_trainer_comparison(capsys):
    argv = ["bench", "--max-lengths", "256", "--steps", "1", "--repeats", "1"]
    code = main([*argv, "--providers", "trl_packing", "unpack_packing"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| 256 | (c) unpack_trainer, packing=True |" in out
    assert "vs (b) trl packing" in out and "self-check" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-lengths", "-5"], "--max-lengths must be positive token counts, got -5"),
        (["--max-lengths", "256", "0"], "--max-lengths must be positive token counts, got 0"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
    ],
)
def test_bench_rejects_bad_sizes_without_a_traceback(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_estimated_speedup_by_hand():
    """One definition: padded tokens of random batches of B samples / real tokens."""
    assert estimated_speedup(np.array([10, 1]), 2) == pytest.approx(20 / 11)  # one batch, any order
    assert estimated_speedup(np.array([7, 3, 5]), 1) == 1.0  # batches of one sample are never padded
    assert estimated_speedup(np.array([4, 4, 4, 4]), 2) == 1.0
    real, padded = padded_batches(np.array([100, 10, 90, 10]), 2, seed=None)
    assert real.tolist() == [110, 100] and padded.tolist() == [200, 180]
    real, padded = padded_batches(np.array([5, 9, 2]), 2, seed=None)
    assert real.tolist() == [14, 2] and padded.tolist() == [18, 2]  # the last batch holds one sample
    with pytest.raises(ValueError, match="batch_size"):
        padded_batches(np.array([1]), 0)


def test_bench_rejects_zero_steps(capsys):
    assert main(["bench", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
