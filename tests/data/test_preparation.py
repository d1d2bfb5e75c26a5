"""``unpack_trainer.data.preparation``: the dataset-level preparation the trainer calls (truncate, pack)."""

import ast
import logging
from pathlib import Path

import pytest
from datasets import Dataset

import unpack_trainer
from unpack_trainer import pack_dataset, truncate_dataset
from unpack_trainer.data.preparation import check_packed_rows, sample_lengths, samples_per_row, split_packed_rows


def _dataset(**columns):
    return Dataset.from_dict(columns)


# ---------------------------------------------------------------------------------------------------- pack_dataset


def test_pack_dataset_hand_example():
    ds = _dataset(
        input_ids=[[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
        labels=[[-100, 2, 3], [-100, 5], [-100, 7, 8, 9], [-100]],
        completion_mask=[[0, 1, 1], [0, 1], [0, 1, 1, 1], [1]],
        source=["a", "b", "c", "d"],  # not per-token: dropped
    )
    # best-fit decreasing, capacity 5: 4 (sample 2) opens row 0, 3 (sample 0) opens row 1, 2 (sample 1) fills row 1,
    # 1 (sample 3) fills row 0
    packed = pack_dataset(ds, 5)
    assert packed.column_names == ["input_ids", "labels", "completion_mask", "seq_lengths"]
    assert packed[:] == {
        "input_ids": [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]],
        "labels": [[-100, 7, 8, 9, -100], [-100, 2, 3, -100, 5]],
        "completion_mask": [[0, 1, 1, 1, 1], [0, 1, 1, 0, 1]],
        "seq_lengths": [[4, 1], [3, 2]],
    }
    assert samples_per_row(packed).tolist() == [2, 2]
    assert sample_lengths(packed, packed_ahead=True).tolist() == [4, 1, 3, 2]
    # a seed shuffles the rows, not their content
    shuffled_rows = pack_dataset(ds, 5, seed=1)["input_ids"]
    assert sorted(shuffled_rows) == sorted(packed["input_ids"])


def test_pack_dataset_shuffled_and_bounded():
    ds = _dataset(input_ids=[[i] * n for i, n in enumerate([1, 1, 1, 1, 2, 3], start=1)])
    rows = pack_dataset(ds, 4, order="shuffled", seed=0)
    assert sorted(n for lengths in rows["seq_lengths"] for n in lengths) == [1, 1, 1, 1, 2, 3]
    assert len(rows) == 3  # 9 tokens in rows of 4: as few rows as best-fit decreasing
    assert all(sum(lengths) == len(ids) <= 4 for ids, lengths in zip(rows["input_ids"], rows["seq_lengths"]))
    assert sorted(t for ids in rows["input_ids"] for t in ids) == [1, 2, 3, 4, 5, 5, 6, 6, 6]
    bounded = pack_dataset(ds, 4, seed=0, max_samples_per_row=2)
    assert max(samples_per_row(bounded).tolist()) == 2 and len(bounded) == 3


def test_pack_dataset_windowed_logs_the_window_it_chose(caplog):
    ds = _dataset(input_ids=[[1] * n for n in [5, 3, 2, 4, 4, 2, 7, 1, 6, 3]])
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        rows = pack_dataset(ds, 10, order="windowed", seed=0)
    assert "Packing 10 samples into rows of 10: windowed best fit: window of" in caplog.text
    assert sorted(n for lengths in rows["seq_lengths"] for n in lengths) == [1, 2, 2, 3, 3, 4, 4, 5, 6, 7]
    fixed = pack_dataset(ds, 10, order="windowed", seed=0, window=1)
    assert all(sum(lengths) <= 10 for lengths in fixed["seq_lengths"]) and len(fixed) >= len(rows)


@pytest.mark.parametrize(
    ("columns", "kwargs", "message"),
    [
        ({"input_ids": [[1, 2, 3]]}, {}, "Sample 0 has 3 tokens, more than the row capacity of 2"),
        ({"input_ids": [[1], []]}, {}, "Sample 1 has length 0"),
        ({"input_ids": [[1, 2]], "seq_lengths": [[1, 1]]}, {}, "no `seq_lengths` column"),
        ({"labels": [[1]]}, {}, "needs an `input_ids` column"),
        ({"input_ids": [[1]]}, {"order": "random"}, "Unknown packing order 'random'"),
        ({"input_ids": [[1]]}, {"order": "shuffled"}, "needs a `seed`"),
        ({"input_ids": [[1]]}, {"max_length": 0}, "`max_length` must be a positive integer"),
        ({"input_ids": [[1]]}, {"window": 2, "seed": 0}, "`window` needs `order='windowed'`"),
    ],
)
def test_pack_dataset_errors(columns, kwargs, message):
    kwargs = {"max_length": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        pack_dataset(_dataset(**columns), **kwargs)


# ------------------------------------------------------------------------- pack_dataset as a drop-in for TRL's
# TRL's own cases (trl's tests/test_data_utils.py, TestPackDatasetWrapped and TestPackDatasetBfd), run against ours.

TRL_PACK_CASES = {
    "wrapped": (
        {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]], "attention_mask": [[0, 1, 1], [0, 0, 1, 1], [1]]},
        3,
        "wrapped",
        {"input_ids": [[1, 2, 3], [4, 5, 6], [7, 8]], "attention_mask": [[0, 1, 1], [0, 0, 1], [1, 1]]},
    ),
    "bfd": (
        {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]]},
        4,
        "bfd",
        {"input_ids": [[4, 5, 6, 7], [1, 2, 3, 8]], "seq_lengths": [[4], [3, 1]]},
    ),
    "bfd_split overlong": (
        {"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]},
        4,
        "bfd_split",
        {"input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7, 5, 12]], "seq_lengths": [[4], [4], [2, 1, 1]]},
    ),
    "bfd_split two columns, no input_ids": (
        {
            "col1": [[1, -2, 3, -4, 5, -6], [7, -8, 9], [-10, 11, -12], [13, -14, 15, -16]],
            "col2": [[-1, 2, -3, 4, -5, 6], [-7, 8, -9], [10, -11, 12], [-13, 14, -15, 16]],
        },
        4,
        "bfd_split",
        {
            "col1": [[1, -2, 3, -4], [13, -14, 15, -16], [7, -8, 9], [-10, 11, -12], [5, -6]],
            "col2": [[-1, 2, -3, 4], [-13, 14, -15, 16], [-7, 8, -9], [10, -11, 12], [-5, 6]],
            "seq_lengths": [[4], [4], [3], [3], [2]],
        },
    ),
    "bfd_split non power of 2": (
        {"input_ids": [[1, 2, 3, 4, 5], [6], [7, 8, 9, 10], [11, 12, 13]]},
        5,
        "bfd_split",
        {"input_ids": [[1, 2, 3, 4, 5], [7, 8, 9, 10, 6], [11, 12, 13]], "seq_lengths": [[5], [4, 1], [3]]},
    ),
    "bfd truncates overlong": (
        {"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]},
        4,
        "bfd",
        {"input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7, 12]], "seq_lengths": [[4], [4], [2, 1]]},
    ),
    "bfd_split drops empty sequences": (
        {"input_ids": [[1, 2], [], [3, 4, 5], [], [6]]},
        4,
        "bfd_split",
        {"input_ids": [[3, 4, 5, 6], [1, 2]], "seq_lengths": [[3, 1], [2]]},
    ),
}


# Where ours deliberately differs: the samples in a row are in dataset order (TRL's: longest first). Same rows.
OURS = {
    "bfd_split overlong": {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [5, 6, 7, 12]],
        "seq_lengths": [[4], [4], [1, 2, 1]],
    },
    "bfd_split non power of 2": {
        "input_ids": [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13]],
        "seq_lengths": [[5], [1, 4], [3]],
    },
}


def _samples_per_row(rows: dict) -> list[list[list[int]]]:
    """Each row's samples (cut at ``seq_lengths``), sorted: what a row holds, whatever their order in it."""
    key = next(iter(rows))
    out = []
    for ids, lengths in zip(rows[key], rows["seq_lengths"]):
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        out.append(sorted(ids[end - n : end] for end, n in zip(ends, lengths)))
    return out


@pytest.mark.parametrize("case", list(TRL_PACK_CASES))
@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_pack_dataset_takes_trls_call_and_gives_trls_rows(case, kind):
    examples, seq_length, strategy, trl_rows = TRL_PACK_CASES[case]
    dataset = _dataset(**examples)
    if kind == "map-style":
        packed = pack_dataset(dataset, seq_length, strategy=strategy).to_dict()
    else:
        stream = pack_dataset(dataset.to_iterable_dataset(), seq_length, strategy, {"batch_size": 1000})
        packed = next(iter(stream.with_format(None).batch(batch_size=100)))
    assert packed == OURS.get(case, trl_rows)
    if case in OURS:
        assert _samples_per_row(packed) == _samples_per_row(trl_rows)


def test_pack_dataset_keeps_the_format_as_trl_does():
    """TRL's format checks: a numpy (float32) dataset stays numpy, with ``seq_lengths`` added to its columns; a
    numpy stream stays numpy."""
    examples = {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]], "attention_mask": [[0, 1, 1], [0, 0, 1, 1], [1]]}
    dataset = _dataset(**examples).with_format("numpy", dtype="float32")
    wrapped = pack_dataset(dataset, 3, strategy="wrapped")
    assert wrapped.format == dataset.format
    packed = pack_dataset(dataset, 4, strategy="bfd")
    assert packed.format["type"] == "numpy" and packed.format["format_kwargs"] == {"dtype": "float32"}
    assert packed.format["columns"] == ["input_ids", "attention_mask", "seq_lengths"]
    assert packed[0]["input_ids"].dtype.name == "float32"
    torch_rows = pack_dataset(_dataset(**examples).with_format("torch"), 4, strategy="bfd")
    assert torch_rows.format["type"] == "torch" and torch_rows[0]["seq_lengths"].tolist() == [4]
    stream = _dataset(**examples).to_iterable_dataset().with_format("numpy")
    assert pack_dataset(stream, 4, strategy="bfd")._formatting.format_type == "numpy"


def test_pack_dataset_says_what_trls_strategies_cut(caplog):
    """TRL's ``bfd`` truncates and drops empty sequences without a word; ours says how much, once."""
    ds = _dataset(input_ids=[[1, 2, 3, 4, 5], [], [6]], source=["a", "b", "c"])
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        packed = pack_dataset(ds, 4, strategy="bfd")
    assert packed.to_dict() == {"input_ids": [[1, 2, 3, 4], [6]], "seq_lengths": [[4], [1]]}
    assert "1 of 2 samples are longer than seq_length=4 and were truncated (strategy='bfd'), dropping 1 token" in (
        caplog.text
    )
    assert "1 empty sample(s) dropped" in caplog.text
    assert "the column(s) ['source'] are not per-token lists" in caplog.text
    with pytest.raises(ValueError, match="Invalid packing strategy 'best'"):
        pack_dataset(ds, 4, strategy="best")
    with pytest.raises(ValueError, match="both"):
        pack_dataset(ds, 4, max_length=4)


# ---------------------------------------------------------------------------------------------------- truncate_dataset
# TRL's own cases (trl's tests/experimental/test_utils.py, TestTruncateExamples): TRL's call returns the dataset,
# every list column truncated, the other columns and the format kept.


def test_truncate_dataset_takes_trls_call():
    examples = {"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]], "attention_mask": [[0, 1, 1], [0, 0, 1, 1], [1]]}
    expected = {"input_ids": [[1, 2], [4, 5], [8]], "attention_mask": [[0, 1], [0, 0], [1]]}
    dataset = _dataset(**examples).with_format("numpy", dtype="float32")
    truncated = truncate_dataset(dataset, 2)
    assert truncated.to_dict() == expected and truncated.format == dataset.format
    stream = _dataset(**examples).to_iterable_dataset().with_format("numpy")
    truncated = truncate_dataset(stream, 2, map_kwargs={"batch_size": 2})
    assert next(iter(truncated.with_format(None).batch(batch_size=3))) == expected
    assert truncated._formatting.format_type == "numpy"
    extra = truncate_dataset(_dataset(**examples, my_column=["a", "b", "c"]), 2)
    assert extra.to_dict() == expected | {"my_column": ["a", "b", "c"]}


def _long_and_masked():
    return _dataset(
        input_ids=[[1, 2, 3, 4], [5, 6], [7, 8, 9]],
        labels=[[-100, 2, 3, 4], [-100, -100], [-100, -100, 9]],
        source=["a", "b", "c"],
    )


def test_truncate_dataset_keep_start(caplog):
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        truncated, counts = truncate_dataset(_long_and_masked(), 2, name="probe")
    # [5, 6] has every label masked; [7, 8] keeps no trained token: both dropped
    assert truncated[:] == {"input_ids": [[1, 2]], "labels": [[-100, 2]]}
    assert (counts.read, counts.over, counts.cut_tokens) == (3, 2, 3)
    assert (counts.masked_from_start, counts.masked_after_truncation) == (1, 1)
    assert "probe dataset: 2 of 3 samples are longer than max_length=2 and were truncated (keep_start)" in caplog.text


def test_truncate_dataset_keep_end_and_split():
    truncated, counts = truncate_dataset(_long_and_masked(), 2, truncation_mode="keep_end")
    assert truncated[:] == {"input_ids": [[3, 4], [8, 9]], "labels": [[3, 4], [-100, 9]]}
    assert (counts.masked_from_start, counts.masked_after_truncation) == (1, 0)
    chunks, counts = truncate_dataset(_long_and_masked(), 2, split=True)
    # [7, 8, 9] -> [7, 8] (no trained token: dropped) and [9]
    assert chunks[:] == {"input_ids": [[1, 2], [3, 4], [9]], "labels": [[-100, 2], [3, 4], [9]]}
    assert (counts.over, counts.masked_from_start, counts.masked_after_truncation) == (2, 1, 1)
    assert counts.changed


def test_truncate_dataset_counts_a_stream_as_it_is_read():
    stream, counts = truncate_dataset(_long_and_masked().to_iterable_dataset(), 2, name="train")
    assert (counts.read, counts.over) == (0, 0)  # nothing read yet
    assert [row["input_ids"] for row in stream] == [[1, 2]]
    assert (counts.read, counts.over, counts.cut_tokens, counts.masked_from_start) == (3, 2, 3, 1)
    assert "2 of 3 samples read were longer than max_length=2 and were truncated (keep_start)" in counts.summary()


@pytest.mark.parametrize(
    ("options", "kept"),
    [({}, [[1, 2]]), ({"truncation_mode": "keep_end"}, [[3, 4], [8, 9]]), ({"split": True}, [[1, 2], [3, 4], [9]])],
)
def test_a_stream_counts_what_the_map_style_path_counts(options, kept):
    """A sample masked from the start is counted once, as such, not again as 'no trained token left after
    truncation' (the stream's filter sees it too)."""
    _, expected = truncate_dataset(_long_and_masked(), 2, name="train", **options)
    stream, counts = truncate_dataset(_long_and_masked().to_iterable_dataset(), 2, name="train", **options)
    assert [row["input_ids"] for row in stream] == kept
    assert (counts.masked_from_start, counts.masked_after_truncation) == (
        expected.masked_from_start,
        expected.masked_after_truncation,
    )


def test_truncate_dataset_errors():
    with pytest.raises(ValueError, match="Unsupported truncation mode: middle"):
        truncate_dataset(_long_and_masked(), 2, truncation_mode="middle")
    with pytest.raises(ValueError, match=r"every sample was dropped \(3 samples: 1 with every label masked"):
        truncate_dataset(_long_and_masked(), 1, name="train")


# ---------------------------------------------------------------------------------------------------- rows packed ahead


def test_split_and_check_rows_packed_ahead():
    ds = _dataset(input_ids=[[1, 2, 3, 4, 5]], labels=[[-100, 2, -100, 4, 5]], seq_lengths=[[2, 3]], tag=["x"])
    split = split_packed_rows(ds, "train")
    assert split[:] == {"input_ids": [[1, 2], [3, 4, 5]], "labels": [[-100, 2], [-100, 4, 5]], "tag": ["x", "x"]}
    with pytest.raises(ValueError, match=r"Train dataset row 0 has 5 tokens but `seq_lengths` \[2, 2\]"):
        split_packed_rows(_dataset(input_ids=[[1, 2, 3, 4, 5]], seq_lengths=[[2, 2]]), "train")
    assert check_packed_rows(ds, 5, "train")["input_ids"] == [[1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="train dataset row 0 is a row packed ahead .* longer than max_length=4"):
        check_packed_rows(ds, 4, "train")


# ---------------------------------------------------------------------------------------------------- the walk


def _imports(module: str) -> set[str]:
    tree = ast.parse((Path(unpack_trainer.__file__).parent / f"{module}.py").read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_data_path_walks_one_way():
    """trainer -> preparation -> packing / streaming, never back up."""
    assert "unpack_trainer.data.preparation" in _imports("trainers/sft")
    assert "unpack_trainer.data.streaming" not in _imports("trainers/sft")
    for lower in ("data/streaming", "data/packing"):
        assert not {"unpack_trainer.trainers.sft", "unpack_trainer.data.preparation"} & _imports(lower), lower
