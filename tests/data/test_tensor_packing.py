"""The tensor packing API (``unpack_trainer/data/tensor_packing.py``): the vectorised ``pack_sequences`` and
``concatenate_and_pack`` equal a simple sample-by-sample reference on random inputs (every container kind, strategy,
overflow policy, mask padding, separator), and the ``eos_token_id`` separator keeps every boundary."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unpack_trainer import concatenate_and_pack, pack_sequences, position_ids_from_sample_index
from unpack_trainer.data.packing import pack_lengths
from unpack_trainer.data.validation import overflow_spans

t = torch.tensor
MAX_LENGTHS = st.integers(1, 12)


# ---------------------------------------------------------------------------------------------------- the reference


def reference(samples, labels, masks, max_length, *, pad=0, label_pad=-100, strategy, overflow, seed, eos):
    """Sample by sample, token by token: (input_ids, labels, sample_index, position_ids, boundaries) as lists."""
    pieces = []
    for i, ids in enumerate(samples):
        ids = [int(v) for v in ids]
        lab = list(ids) if labels is None else [int(v) for v in labels[i]]
        if masks is not None:
            ones = [j for j, v in enumerate(masks[i]) if v]
            ids, lab = ids[ones[0] : ones[-1] + 1], lab[ones[0] : ones[-1] + 1]
        if not ids:
            raise ValueError(f"Sample {i} is empty")
        if eos is not None:
            lab.append(eos if lab[-1] != label_pad else label_pad)
            ids.append(eos)
        for a, b in overflow_spans(i, len(ids), max_length, overflow):
            pieces.append((ids[a:b], lab[a:b]))
    rows = pack_lengths([len(p[0]) for p in pieces], max_length, strategy=strategy, seed=seed)
    out = {name: [] for name in ("input_ids", "labels", "sample_index", "position_ids", "boundaries")}
    for row in rows:
        ids_row, lab_row, index_row, pos_row, spans = [], [], [], [], []
        for k, p in enumerate(row, start=1):
            ids, lab = pieces[p]
            spans.append((len(ids_row), len(ids_row) + len(ids)))
            ids_row += ids
            lab_row += [label_pad] + lab[1:]  # the first token is predicted from the previous sample
            index_row += [k] * len(ids)
            pos_row += list(range(len(ids)))
        free = max_length - len(ids_row)
        out["input_ids"].append(ids_row + [pad] * free)
        out["labels"].append(lab_row + [label_pad] * free)
        out["sample_index"].append(index_row + [0] * free)
        out["position_ids"].append(pos_row + list(range(free)))
        out["boundaries"].append(spans)
    return out


def _container(values: list[int], kind: str, index: int):
    if kind == "mixed":
        kind = ("list", "tuple", "tensor", "array")[index % 4]
    if kind == "list":
        return list(values)
    if kind == "tuple":
        return tuple(values)
    if kind == "tensor":
        return torch.tensor(values, dtype=torch.int64)
    return np.asarray(values, dtype=np.int64)


@st.composite
def packing_inputs(draw):
    max_length = draw(MAX_LENGTHS)
    overflow = draw(st.sampled_from(["error", "truncate", "split"]))
    eos = draw(st.one_of(st.none(), st.integers(0, 300)))
    longest = max_length - (eos is not None) if overflow == "error" else 3 * max_length
    num = draw(st.integers(0, 16))
    # ids around 0 and 1 on purpose: those are the values whose type (bool or int) is checked one by one
    ids = [draw(st.lists(st.integers(-3, 300), min_size=1, max_size=max(longest, 1))) for _ in range(num)]
    if overflow == "error" and longest < 1:
        ids = []
    kind = draw(st.sampled_from(["list", "tuple", "tensor", "array", "mixed"]))
    return {
        "max_length": max_length,
        "overflow": overflow,
        "eos": eos,
        "ids": ids,
        "kind": kind,
        "strategy": draw(st.sampled_from(["first_fit", "bfd"])),
        "seed": draw(st.one_of(st.none(), st.integers(0, 3))),
    }


@settings(max_examples=100, deadline=None)
@given(packing_inputs())
def test_pack_sequences_equals_the_reference(case):
    samples = [_container(ids, case["kind"], i) for i, ids in enumerate(case["ids"])]
    options = {"strategy": case["strategy"], "overflow": case["overflow"], "seed": case["seed"]}
    expected = reference(case["ids"], None, None, case["max_length"], eos=case["eos"], **options)
    packed, boundaries = pack_sequences(
        samples, case["max_length"], 0, return_boundaries=True, eos_token_id=case["eos"], **options
    )
    assert packed.dtype == torch.int64 and packed.shape == (len(expected["input_ids"]), case["max_length"])
    assert packed.tolist() == expected["input_ids"]
    assert boundaries == expected["boundaries"]


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(packing_inputs(), st.data())
def test_concatenate_and_pack_equals_the_reference(case, data):
    ids = case["ids"]
    labels = None
    if data.draw(st.booleans()):
        labels = [[data.draw(st.sampled_from([-100, v, v + 1])) for v in sample] for sample in ids]
    masks, padded_ids, padded_labels = None, ids, labels
    if data.draw(st.booleans()):  # left / right padding marked 0 in the mask, removed before packing
        pads = [(data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))) for _ in ids]
        masks = [[0] * a + [1] * len(sample) + [0] * b for (a, b), sample in zip(pads, ids)]
        padded_ids = [[7] * a + sample + [8] * b for (a, b), sample in zip(pads, ids)]
        if labels is not None:
            padded_labels = [[5] * a + sample + [6] * b for (a, b), sample in zip(pads, labels)]
        if data.draw(st.booleans()):
            masks = [[bool(v) for v in mask] for mask in masks]
    kind = case["kind"]
    options = {"strategy": case["strategy"], "overflow": case["overflow"], "seed": case["seed"]}
    expected = reference(padded_ids, padded_labels, masks, case["max_length"], eos=case["eos"], **options)
    rows = concatenate_and_pack(
        [_container(s, kind, i) for i, s in enumerate(padded_ids)],
        None if labels is None else [_container(s, kind, i + 1) for i, s in enumerate(padded_labels)],
        masks,
        case["max_length"],
        0,
        return_position_ids=True,
        eos_token_id=case["eos"],
        **options,
    )
    assert all(part.dtype == torch.int64 for part in rows)
    assert rows.input_ids.tolist() == expected["input_ids"]
    assert rows.labels.tolist() == expected["labels"]
    assert rows.sample_index.tolist() == expected["sample_index"]
    assert rows.position_ids.tolist() == expected["position_ids"]
    assert torch.equal(rows.position_ids, position_ids_from_sample_index(rows.sample_index))


# ---------------------------------------------------------------------------------------------------- the separator


def test_eos_separator_hand_example():
    rows = concatenate_and_pack(
        [[1, 2, 3], [4, 5], [6]],
        [[-100, 2, 3], [-100, -100], [6]],
        None,
        max_length=8,
        pad_token_id=0,
        eos_token_id=9,
        return_position_ids=True,
    )
    # sample 0 ends trained: its separator is trained to predict 9 from 3, inside the sample. Sample 1's labels are
    # all -100 (not trained): its separator is not trained either. Every sample's first label stays -100.
    assert rows.input_ids.tolist() == [[1, 2, 3, 9, 4, 5, 9, 0], [6, 9, 0, 0, 0, 0, 0, 0]]
    assert rows.labels.tolist() == [
        [-100, 2, 3, 9, -100, -100, -100, -100],
        [-100, 9, -100, -100, -100, -100, -100, -100],
    ]
    assert rows.sample_index.tolist() == [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 0, 1, 2, 3, 4, 5]]
    packed, boundaries = pack_sequences([[1, 2, 3], [4, 5], [6]], 8, 0, return_boundaries=True, eos_token_id=9)
    assert packed.tolist() == rows.input_ids.tolist()
    assert boundaries == [[(0, 4), (4, 7)], [(0, 2)]]


def test_eos_separator_counts_toward_max_length(caplog):
    with pytest.raises(
        ValueError, match=r"Sample 1 \(with its `eos_token_id` separator\) has 5 tokens, more than max"
    ):
        pack_sequences([[1], [1, 2, 3, 4]], 4, 0, eos_token_id=9)
    assert pack_sequences([[1], [1, 2, 3]], 4, 0, eos_token_id=9).tolist() == [[1, 9, 0, 0], [1, 2, 3, 9]]
    with caplog.at_level(logging.WARNING, logger="unpack_trainer.data.tensor_packing"):
        truncated = concatenate_and_pack([[1, 2, 3, 4]], None, None, 4, 0, overflow="truncate", eos_token_id=9)
    assert truncated.input_ids.tolist() == [[1, 2, 3, 4]]  # a cut sample did not end: no separator
    assert "dropping 1 token(s)" in caplog.text
    split = concatenate_and_pack([[1, 2, 3, 4, 5]], None, None, 4, 0, overflow="split", eos_token_id=9)
    assert split.input_ids.tolist() == [[1, 2, 3, 4], [5, 9, 0, 0]]
    assert split.labels.tolist() == [[-100, 2, 3, 4], [-100, 9, -100, -100]]


@pytest.mark.parametrize("bad", [True, 1.0, "9", 2**63])
def test_eos_token_id_must_be_an_int64(bad):
    with pytest.raises(ValueError, match="`eos_token_id` must be an integer in int64 range"):
        pack_sequences([[1, 2]], 8, 0, eos_token_id=bad)
    with pytest.raises(ValueError, match="`eos_token_id` must be an integer in int64 range"):
        concatenate_and_pack([[1, 2]], None, None, 8, 0, eos_token_id=bad)


# ---------------------------------------------------------------------------------------------------- every id checked


@pytest.mark.parametrize(
    "sample, message",
    [
        ([5, True, 7], "Sample 1 holds a non-integer id True at position 1"),
        ([False], "Sample 1 holds a non-integer id False at position 0"),
        ((0, 1.0), "Sample 1 holds a non-integer id 1.0 at position 1"),
        ([1, 2**63], "Sample 1 holds the id 9223372036854775808 at position 1, outside the int64 range"),
        ([3, "4"], "Sample 1 holds a non-integer id '4' at position 1"),
        (t([True, False]), "Sample 1 must hold integer ids, got dtype torch.bool"),
        (t([1.0]), "Sample 1 must hold integer ids, got dtype torch.float32"),
        (t(5), r"Sample 1 must be 1-D, got shape \(\)"),
    ],
)
def test_fast_paths_check_every_id(sample, message):
    """Lists and tensors take the vectorised path; a bad value anywhere still gets the per-sample error."""
    for good in ([1, 0, 1], t([1, 0, 1])):
        with pytest.raises(ValueError, match=message):
            pack_sequences([good, sample, good], 8, 0)
        with pytest.raises(ValueError, match=message):
            concatenate_and_pack([good, sample], None, None, 8, 0)
        with pytest.raises(ValueError, match=message.replace("Sample 1", "Labels of sample 1")):
            size = sample.numel() if isinstance(sample, torch.Tensor) else len(sample)
            concatenate_and_pack([good, [1] * size], [good, sample], None, 8, 0)


def test_valid_values_outside_the_fast_paths_are_packed():
    samples = [[np.int64(4), 5], t([6], dtype=torch.uint64), np.array([7, 8], dtype=np.int32), range(9, 11)]
    assert pack_sequences(samples, 4, 0).tolist() == [[4, 5, 6, 0], [7, 8, 9, 10]]
    rows = concatenate_and_pack(samples, None, [[1, True], t([True]), [1, 1], (0, 1)], 4, 0)
    assert rows.input_ids.tolist() == [[4, 5, 6, 0], [7, 8, 10, 0]]  # the mask (0, 1) removed 9
    assert rows.sample_index.tolist() == [[1, 1, 2, 0], [1, 1, 2, 0]]


def test_the_first_bad_sample_is_named_in_sample_order():
    # sample 0's labels are checked before sample 1's ids, and every id check before the empty / too-long checks
    with pytest.raises(ValueError, match="Labels of sample 0 holds a non-integer id 1.5"):
        concatenate_and_pack([[1, 2], [1.5]], [[1, 1.5], [1]], None, 8, 0)
    with pytest.raises(ValueError, match="Sample 2 holds a non-integer id"):
        pack_sequences([[], [1] * 20, [0.5]], 8, 0)
    with pytest.raises(ValueError, match="Sample 0 is empty"):
        pack_sequences([[], [1] * 20], 8, 0)
    with pytest.raises(ValueError, match="Sample 0 has an attention mask with 0s between its tokens"):
        concatenate_and_pack([[1, 2, 3], [4]], None, [[1, 0, 1], [2]], 8, 0)
    with pytest.raises(ValueError, match="Sample 1 has an attention mask with 0s between its tokens"):
        concatenate_and_pack([[1, 2, 3], [4]], None, [[0, 1, 1], [2]], 8, 0)


def test_empty_input():
    assert pack_sequences([], 4, 0).shape == (0, 4)
    rows = concatenate_and_pack([], None, None, 4, 0, return_position_ids=True)
    assert [part.shape for part in rows] == [(0, 4)] * 4


@pytest.mark.parametrize("kind", [list, tuple])
def test_whole_list_samples_check_every_value(kind):
    """Samples that all fit a row are written straight into it (``struct.pack_into``, which takes anything with
    ``__index__``): a value that is not an ``int`` still goes to the per-sample checks, which convert or name it."""
    good = kind([1, 0, 1])
    assert pack_sequences([good, kind([np.int64(4), 5])], 8, 0, eos_token_id=9).tolist() == [[1, 0, 1, 9, 4, 5, 9, 0]]
    rows = concatenate_and_pack([good, kind([6])], [good, kind([np.int32(7)])], None, 8, 0)
    assert rows.labels.tolist() == [[-100, 0, 1, -100, -100, -100, -100, -100]]
    for bad, message in (
        (t(5), "nested sequence at position 1"),
        (np.array(5), "nested sequence at position 1"),
        (np.float64(5.0), "non-integer id np.float64"),
        (True, "non-integer id True"),
    ):
        with pytest.raises(ValueError, match=f"^Sample 1 holds a {message}"):
            pack_sequences([good, kind([3, bad])], 8, 0)
        with pytest.raises(ValueError, match=f"^Sample 1 holds a {message}"):  # rows reordered, separators of 1
            pack_sequences([good, kind([3, bad]), good], 5, 0, strategy="bfd", seed=0, eos_token_id=1)
        with pytest.raises(ValueError, match=f"^Labels of sample 1 holds a {message}"):
            concatenate_and_pack([good, kind([3, 4])], [good, kind([3, bad])], None, 8, 0)


@pytest.mark.parametrize("padded", [False, True])
def test_mask_values_are_checked_like_ids(padded):
    """All-ones masks are recognised with ``count(1)`` (``1.0`` and ``tensor(1)`` equal 1 too); masks with padding go
    through ``bytes`` (which takes ``tensor(1)``): both refuse what the per-sample check refuses."""
    ids, lead = ([[1, 2, 3]], [0]) if padded else ([[1, 2]], [])
    for bad in (1.0, np.float64(1.0), t(1), np.array(1)):
        with pytest.raises(ValueError, match="^Attention mask of sample 0 holds a"):
            concatenate_and_pack(ids, None, [[*lead, 1, bad]], 8, 0)
    rows = concatenate_and_pack([[1, 2], [3]], [[5, 6], [7]], [[True, 1], [np.int64(1)]], 8, 0)
    assert rows.input_ids.tolist() == [[1, 2, 3, 0, 0, 0, 0, 0]]
    assert rows.labels.tolist() == [[-100, 6, -100, -100, -100, -100, -100, -100]]
