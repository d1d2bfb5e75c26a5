import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from unpack_trainer import PACKED_BATCH_KEYS, DataCollatorForPacking
from unpack_trainer.data.collator import packed_metadata

t = torch.tensor


def test_hand_example_padding_free():
    out = DataCollatorForPacking(pad_token_id=0)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert list(out) == [
        "input_ids",
        "labels",
        "position_ids",
        "packed_seq_lengths",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "use_cache",
    ]
    assert list(out) == [*PACKED_BATCH_KEYS, "use_cache"]
    assert list(DataCollatorForPacking(pad_token_id=0, use_cache=None)([{"input_ids": [1]}])) == list(
        PACKED_BATCH_KEYS
    )
    assert out["use_cache"] is False  # safe for unpatched models (issue 10, item 22)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 5]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert out["packed_seq_lengths"].dtype == torch.int32
    assert out["packed_seq_lengths"].tolist() == [3, 2]
    assert out["cu_seq_lens_q"].dtype == out["cu_seq_lens_k"].dtype == torch.int32
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert out["max_length_q"] == out["max_length_k"] == 3
    assert isinstance(out["max_length_q"], int)
    assert "attention_mask" not in out


def test_rows_packed_ahead_and_masks():
    examples = [
        {
            "input_ids": [1, 2, 3, 4, 5],
            "seq_lengths": [3, 2],
            "completion_mask": [0, 1, 1, 0, 1],
        },
        {"input_ids": [6, 7, 8], "seq_lengths": [3], "completion_mask": [0, 0, 1], "assistant_masks": [1, 1, 0]},
    ]
    out = DataCollatorForPacking(pad_token_id=0)(examples)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert out["packed_seq_lengths"].tolist() == [3, 2, 3]
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100]]
    assert out["max_length_q"] == 3
    # completion_only_loss=False ignores completion_mask; assistant_masks always applies
    out = DataCollatorForPacking(pad_token_id=0, completion_only_loss=False)(examples)
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, 7, -100]]


def test_pad_to_multiple_of_is_a_pseudo_sample():
    out = DataCollatorForPacking(pad_token_id=9, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    )
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]]
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert out["packed_seq_lengths"].tolist() == [3, 2, 3]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    out = DataCollatorForPacking(pad_token_id=9, pad_to_multiple_of=5)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    )
    assert out["packed_seq_lengths"].tolist() == [3, 2]


def test_prebuilt_labels_are_kept():
    out = DataCollatorForPacking(pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}])
    assert out["labels"].tolist() == [[-100, -100, 3]]


@pytest.mark.parametrize(
    "examples, message",
    [
        ([{"input_ids": [1, 2]}, {"input_ids": []}], "Example 1 is empty"),
        ([{"input_ids": [1, 2]}, {"labels": [1]}], "Example 1 has no `input_ids`"),
        ([{"input_ids": [1, 2], "labels": [1]}], "Example 0 has 2 input_ids but 1 `labels`"),
        ([{"input_ids": [1, 2], "completion_mask": [1]}], "Example 0 has 2 input_ids but 1 `completion_mask`"),
        ([{"input_ids": [1, 2], "assistant_masks": [1, 1, 1]}], "Example 0 has 2 input_ids but 3 `assistant_masks`"),
        ([{"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}], r"Example 0 has 3 tokens but `seq_lengths` \[2, 2\]"),
        ([{"input_ids": [1, 2, 3], "seq_lengths": [3, 0]}], "must be positive"),
        ([{"input_ids": [1], "seq_lengths": [1]}, {"input_ids": [2]}], "Example 1 lacks `seq_lengths`"),
        ([], "empty batch"),
    ],
)
def test_bad_examples(examples, message):
    with pytest.raises(ValueError, match=message):
        DataCollatorForPacking(pad_token_id=0)(examples)


def test_bad_construction():
    with pytest.raises(ValueError, match="`pad_token_id` is None"):
        DataCollatorForPacking(pad_token_id=None)
    with pytest.raises(ValueError, match="`pad_to_multiple_of` must be positive"):
        DataCollatorForPacking(pad_token_id=0, pad_to_multiple_of=0)


def test_packed_metadata_worked_example():
    meta = packed_metadata([3, 2])
    assert meta["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert meta["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert meta["max_length_q"] == 3
    with pytest.raises(ValueError, match="at least one token"):
        packed_metadata([3, 0])


_example = st.lists(st.integers(1, 500), min_size=1, max_size=20)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            _example.map(lambda ids: {"input_ids": ids}),
            _example.map(lambda ids: {"input_ids": ids, "labels": [i if i % 3 else -100 for i in ids]}),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_matches_trl_padding_free_collator(examples):
    ours = DataCollatorForPacking(pad_token_id=0)(examples)
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    for key in ("input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["max_length_q"] == theirs["max_length_q"]
    # metadata consistency
    cu = ours["cu_seq_lens_q"]
    assert torch.equal(cu[1:], torch.cumsum(ours["packed_seq_lengths"], 0, dtype=torch.int32))
    assert int(ours["packed_seq_lengths"].sum()) == ours["input_ids"].shape[1]
    assert (ours["position_ids"][0, cu[:-1].long()] == 0).all()
    assert (ours["labels"][0, cu[:-1].long()] == -100).all()
    # every token exactly once, in order
    assert ours["input_ids"][0].tolist() == [i for e in examples for i in e["input_ids"]]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=4), min_size=1, max_size=4
    )
)
def test_matches_trl_on_rows_packed_ahead(rows_of_samples):
    examples = [
        {"input_ids": [i for s in row for i in s], "seq_lengths": [len(s) for s in row]} for row in rows_of_samples
    ]
    ours = DataCollatorForPacking(pad_token_id=0)(examples)
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    for key in ("input_ids", "position_ids", "labels", "cu_seq_lens_q"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["packed_seq_lengths"].tolist() == [len(s) for row in rows_of_samples for s in row]


def test_batches_are_exact_on_an_unpatched_model_by_default(tiny_llama):
    """Issue 10 item 22: with its default `use_cache=True`, an unpatched transformers model builds a KV cache and then
    ignores the packed `position_ids`, attending across samples (logit diff 0.09-0.31). The collator's batches carry
    `use_cache=False`, so they are exact on any model."""
    model = tiny_llama(vocab_size=64).eval()
    assert model.config.use_cache
    samples = [[3, 9, 4, 17, 5], [8, 2, 11], [21, 6, 30, 7, 12, 13, 1]]
    batch = DataCollatorForPacking(pad_token_id=0, pad_to_multiple_of=8)([{"input_ids": s} for s in samples])
    with torch.no_grad():
        packed = model(**batch).logits[0]
        alone = torch.cat([model(input_ids=t([s])).logits[0] for s in samples])
    torch.testing.assert_close(packed[: alone.shape[0]], alone, rtol=1e-5, atol=1e-5)
    # `use_cache=None` leaves the key out, for a forward that does not take it
    assert "use_cache" not in DataCollatorForPacking(pad_token_id=0, use_cache=None)([{"input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="`use_cache` must be True, False or None"):
        DataCollatorForPacking(pad_token_id=0, use_cache="no")
