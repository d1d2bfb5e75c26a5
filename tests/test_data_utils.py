"""``unpack_trainer.data_utils``: the dataset-level preparation the trainer calls (truncate, pack)."""

import ast
import logging
from pathlib import Path

import pytest
from datasets import Dataset

import unpack_trainer
from unpack_trainer import pack_dataset, truncate_dataset
from unpack_trainer.data_utils import check_packed_rows, sample_lengths, samples_per_row, split_packed_rows


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
    ],
)
def test_pack_dataset_errors(columns, kwargs, message):
    kwargs = {"max_length": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        pack_dataset(_dataset(**columns), **kwargs)


# ---------------------------------------------------------------------------------------------------- truncate_dataset


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
    stream, counts = truncate_dataset(_long_and_masked().to_iterable_dataset(), 2)
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
    _, expected = truncate_dataset(_long_and_masked(), 2, **options)
    stream, counts = truncate_dataset(_long_and_masked().to_iterable_dataset(), 2, **options)
    assert [row["input_ids"] for row in stream] == kept
    assert (counts.masked_from_start, counts.masked_after_truncation) == (
        expected.masked_from_start,
        expected.masked_after_truncation,
    )


def test_truncate_dataset_errors():
    with pytest.raises(ValueError, match="Unsupported truncation mode: middle"):
        truncate_dataset(_long_and_masked(), 2, truncation_mode="middle")
    with pytest.raises(ValueError, match=r"every sample was dropped \(3 samples: 1 with every label masked"):
        truncate_dataset(_long_and_masked(), 1)


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
    """trainer -> data_utils -> packing / streaming, never back up."""
    assert "unpack_trainer.data_utils" in _imports("trainers/sft")
    assert "unpack_trainer.streaming" not in _imports("trainers/sft")
    for lower in ("streaming", "packing"):
        assert not {"unpack_trainer.trainer", "unpack_trainer.data_utils"} & _imports(lower), lower
