"""One validator for every entry point (issue 10, items 19 and 20): the packing API, the collator, the streaming
packer and the trainer reject the same bad samples, naming the sample and what is allowed."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from datasets import Dataset, Features, Sequence, Value

from unpack_trainer import (
    DataCollatorForPacking,
    SFTConfig,
    SFTTrainer,
    StreamingPacker,
    best_fit_decreasing,
    concatenate_and_pack,
    pack_sequences,
)
from unpack_trainer.data.validation import (
    check_dataset_token_ids,
    check_overflow,
    check_positive_int,
    check_seq_lengths,
    check_token_ids,
    token_list,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

#: (bad token sequence, what the message must say)
BAD_IDS = [
    ([1.5, 2.0], "non-integer id 1.5 at position 0"),
    ([1, 2.0], "non-integer id 2.0 at position 1"),
    (["a", "b"], "non-integer id 'a' at position 0"),
    ("ab", "must be a list or 1-D tensor of ids"),
    ([1, None], "non-integer id None at position 1"),
    ([[1, 2], [3]], "nested sequence at position 0"),
    ([1, True], "non-integer id True at position 1"),
    ([2**70], "id 1180591620717411303424 at position 0, outside the int64 range"),
    (torch.tensor([[1, 2], [3, 4]]), r"must be 1-D, got shape \(2, 2\)"),
    (torch.tensor([1.0, 2.0]), "must hold integer ids, got dtype torch.float32"),
    (np.array([[1, 2]]), r"must be a 1-D array of integer ids, got int64 \(1, 2\)"),
    (np.array([1.5]), "must be a 1-D array of integer ids, got float64"),
    (None, "must be a list or 1-D tensor of ids"),
]


@pytest.mark.parametrize("bad, message", BAD_IDS)
def test_token_list_rejects_and_names_the_sample(bad, message):
    with pytest.raises(ValueError, match="Sample 7 (holds|must).*") as error:
        token_list(bad, 7)
    assert error.match(message)


@pytest.mark.parametrize(
    "good, expected",
    [
        ([1, 2, 3], [1, 2, 3]),
        ((1, 2), [1, 2]),
        ([np.int64(4), np.int32(5)], [4, 5]),
        (np.array([1, 2], dtype=np.int32), [1, 2]),
        (torch.tensor([7, 8], dtype=torch.int16), [7, 8]),
        ([-100, 2**63 - 1, -(2**63)], [-100, 2**63 - 1, -(2**63)]),
        ([], []),
    ],
)
def test_token_list_accepts_integers_of_every_kind(good, expected):
    out = token_list(good, 0)
    assert out == expected and all(type(v) is int for v in out)


def test_plain_int_list_is_not_copied_and_masks_may_be_bool():
    ids = [1, 2, 3]
    assert token_list(ids, 0) is ids
    assert check_token_ids([True, False, 1], 3, field="completion_mask") == [1, 0, 1]
    assert check_token_ids(torch.tensor([True, False]), 3, field="assistant_masks") == [1, 0]
    with pytest.raises(ValueError, match="`labels` of sample 3 of the train dataset holds a non-integer id True"):
        check_token_ids([1, True], 3, field="labels", where=" of the train dataset")


def test_options_and_seq_lengths():
    assert check_positive_int(3, "max_length") == 3
    for bad in (0, -1, 2.5, True, None, "4"):
        with pytest.raises(ValueError, match="`max_length` must be a positive integer, got"):
            check_positive_int(bad, "max_length")
    with pytest.raises(ValueError, match="Unknown overflow policy 'drop'"):
        check_overflow("drop")
    with pytest.raises(ValueError, match="Unknown overflow policy"):
        check_overflow(["error"])
    assert check_seq_lengths([2, 1], 3, 5) == [2, 1]
    with pytest.raises(ValueError, match=r"Sample 5 has 3 tokens but `seq_lengths` \[1, 1\] \(sum 2\)"):
        check_seq_lengths([1, 1], 3, 5)
    with pytest.raises(ValueError, match="`seq_lengths` of sample 5 holds a non-integer id 1.5"):
        check_seq_lengths([1.5, 1.5], 3, 5)


# ------------------------------------------------------------------------------------------------ every entry point


@pytest.mark.parametrize("bad, message", BAD_IDS)
def test_packing_api_rejects(bad, message):
    with pytest.raises(ValueError, match="Sample 1") as error:
        pack_sequences([[1, 2], bad], 8, 0)
    assert error.match(message)
    with pytest.raises(ValueError, match="Sample 1") as error:
        concatenate_and_pack([[1, 2], bad], None, None, 8, 0)
    assert error.match(message)
    with pytest.raises(ValueError, match="Labels of sample 1") as error:
        concatenate_and_pack([[1, 2], [3, 4]], [[1, 2], bad], None, 8, 0)


@pytest.mark.parametrize("bad, message", BAD_IDS)
def test_collator_rejects(bad, message):
    collator = DataCollatorForPacking(pad_token_id=0)
    with pytest.raises(ValueError, match="`input_ids` of example 1") as error:
        collator([{"input_ids": [1, 2]}, {"input_ids": bad}])
    assert error.match(message)
    if bad is not None:  # `labels: None` means "no labels": the ids are the labels
        with pytest.raises(ValueError, match="`labels` of example 1"):
            collator([{"input_ids": [1, 2]}, {"input_ids": [3, 4], "labels": bad}])


@pytest.mark.parametrize("bad, message", BAD_IDS)
def test_streaming_packer_rejects(bad, message):
    if bad is None:  # a missing field
        with pytest.raises(ValueError, match="Sample 1 of the stream has no `input_ids`"):
            list(StreamingPacker([{"input_ids": [1]}, {"input_ids": bad}], 8))
        return
    with pytest.raises(ValueError, match="`input_ids` of sample 1 of the stream") as error:
        list(StreamingPacker([{"input_ids": [1]}, {"input_ids": bad}], 8))
    assert error.match(message)
    with pytest.raises(ValueError, match="`labels` of sample 1 of the stream"):
        list(StreamingPacker([{"input_ids": [1]}, {"input_ids": [1, 2], "labels": bad}], 8))


def test_collator_seq_lengths_and_options():
    collator = DataCollatorForPacking(pad_token_id=0)
    with pytest.raises(ValueError, match="`seq_lengths` of example 0 holds a non-integer id 1.5"):
        collator([{"input_ids": [1, 2, 3], "seq_lengths": [1.5, 1.5]}])
    with pytest.raises(ValueError, match="`seq_lengths` of example 0 must be a list"):
        collator([{"input_ids": [1, 2, 3], "seq_lengths": None}])
    with pytest.raises(ValueError, match="`seq_lengths` of sample 0 of the stream holds a non-integer id 1.5"):
        list(StreamingPacker([{"input_ids": [1, 2, 3], "seq_lengths": [1.5, 1.5]}], 8))
    for bad in (2.5, "8", True):
        with pytest.raises(ValueError, match="`pad_to_multiple_of` must be positive"):
            DataCollatorForPacking(pad_token_id=0, pad_to_multiple_of=bad)
    with pytest.raises(ValueError, match="`pad_token_id` must be an integer"):
        DataCollatorForPacking(pad_token_id=1.0)


def test_containers_may_be_generators():
    assert best_fit_decreasing((n for n in [5, 3, 2, 4, 4, 2]), 10) == [[0, 3], [1, 2, 4], [5]]
    inputs, labels, masks = concatenate_and_pack((s for s in [[1, 2], [3]]), None, None, 4, 0)
    assert inputs.tolist() == [[1, 2, 3, 0]]
    inputs, _, _ = concatenate_and_pack(iter([[1, 2], [3]]), iter([[1, 2], [3]]), iter([[1, 1], [1]]), 4, 0)
    assert inputs.tolist() == [[1, 2, 3, 0]]
    assert pack_sequences((s for s in [[1], [2]]), 2, 0).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="`lengths` must be a sequence"):
        best_fit_decreasing("abc", 4)
    with pytest.raises(ValueError, match="`input_sequences` must be a sequence"):
        concatenate_and_pack(5, None, None, 4, 0)


def test_dataset_column_check_names_the_sample():
    check_dataset_token_ids(Dataset.from_dict({"input_ids": [[1, 2], [3]]}), "train")
    fixed = Features({"input_ids": Sequence(Value("int32"), length=2)})
    check_dataset_token_ids(Dataset.from_dict({"input_ids": [[1, 2]]}, features=fixed), "train")
    with pytest.raises(ValueError, match="`input_ids` of sample 0 of the train dataset holds a non-integer id 1.0"):
        check_dataset_token_ids(Dataset.from_dict({"input_ids": [[1.0, 2.0], [3.5]]}), "train")
    with pytest.raises(ValueError, match="`input_ids` of sample 1 of the eval dataset holds a nested sequence"):
        check_dataset_token_ids(Dataset.from_dict({"input_ids": [[], [[1], [2]]]}), "eval")
    with pytest.raises(ValueError, match="`labels` of sample 0 of the train dataset holds a non-integer id 0.5"):
        check_dataset_token_ids(Dataset.from_dict({"input_ids": [[1]], "labels": [[0.5]]}), "train")
    with pytest.raises(ValueError, match="`input_ids` of sample 0 of the train dataset must be a list"):
        check_dataset_token_ids(Dataset.from_dict({"input_ids": ["ab"]}), "train")


# ------------------------------------------------------------------------------------------------ the trainer


@pytest.mark.parametrize("packing", [True, False])
def test_trainer_rejects_float_token_ids(tmp_path, packing, caplog, tokenizer, tiny_llama):
    """Float ids used to be truncated to ints and trained (pack and automatic padding-free); stock TRL crashes."""
    ids = [[float(7 + (i + j) % 20) for j in range(3 + i % 5)] for i in range(8)]
    ids[3][1] = 9.5
    dataset = Dataset.from_dict({"input_ids": ids})
    args = SFTConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        max_length=16,
        packing=packing,
        per_device_train_batch_size=4,
        max_steps=1,
        save_strategy="no",
    )
    with pytest.raises(ValueError, match="`input_ids` of sample 0 of the train dataset holds a non-integer id 7.0"):
        with caplog.at_level(logging.INFO, logger="unpack_trainer"):
            SFTTrainer(
                model=tiny_llama(vocab_size=len(tokenizer)),
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
            )


def test_selfcheck_probe_lengths_are_checked(tiny_llama):
    from unpack_trainer import check_uncontaminated

    model = tiny_llama(vocab_size=32)
    for bad, message in (
        ((), r"at least 2 positive integer length\(s\), got \[\]"),
        ((4,), r"got \[4\]"),
        ((3, 0), r"got \[3, 0\]"),
        ((2.5, 3), "non-integer id 2.5"),
        ("ab", "must be a sequence"),
    ):
        with pytest.raises(ValueError, match=message):
            check_uncontaminated(model, lengths=bad)
    assert check_uncontaminated(model, lengths=[3, 1]).ok


def test_streaming_packer_checks_ends_and_the_collator_every_id():
    """The packer's O(1) check (container, dtype, first and last ids) keeps it fast; a bad id in the middle of a
    list reaches the collator, which checks every id, so it is still never trained."""
    rows = list(StreamingPacker([{"input_ids": [1, 2.5, 3]}, {"input_ids": [4, 5]}], 8))
    with pytest.raises(ValueError, match="`input_ids` of example 0 holds a non-integer id 2.5 at position 1"):
        DataCollatorForPacking(pad_token_id=0)(rows)
