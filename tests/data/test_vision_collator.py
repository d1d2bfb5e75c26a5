"""The vision stage of the data path: processed image+text samples -> one packed row, every vision tensor in pack order,
labels -100 at each sample start, images never cut (text after the last image truncated and counted, anything else an
error naming the sample and the limit), image tokens == image features per row, rows of examples packed ahead."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from datasets import Dataset
from random_images import random_image

from unpack_trainer.data.vision import (
    VISION_ROWS_KEY,
    VISION_SOURCE_KEY,
    DataCollatorForVisionPacking,
    VisionRows,
    image_token_ids,
    pack_processed,
    pack_vision_dataset,
    truncate_processed,
    with_sources,
)
from unpack_trainer.model_zoo.tiny_vision import tiny_processor
from unpack_trainer.packed_seq_info import MULTIMODAL_POSITIONS_KEY

trl_sft = pytest.importorskip("trl.trainer.sft_trainer")


def _examples(n: int = 4, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for index in range(n):
        size = (int(rng.integers(56, 112)), int(rng.integers(56, 112)))
        out.append(
            {
                "images": [random_image(*size, seed + index)],
                "messages": [
                    {"role": "user", "content": "what is this" + "?" * int(rng.integers(0, 6))},
                    {"role": "assistant", "content": "a shape " * int(rng.integers(1, 4))},
                ],
            }
        )
    return out


@pytest.fixture(scope="module")
def qwen():
    processor = tiny_processor("qwen2_5_vl")
    process = trl_sft.DataCollatorForVisionLanguageModeling(processor, max_length=None)
    return processor, process


def test_packed_row_keeps_every_tensor_in_pack_order(qwen):
    """One row: the tokens of each sample in turn (padding dropped), per-token keys the same way, the processor's
    vision tensors unchanged (already in sample order), labels -100 at each sample's start and where TRL's are."""
    processor, process = qwen
    examples = _examples()
    padded = process([dict(e) for e in examples])
    lengths = padded["attention_mask"].sum(1).tolist()
    batch = pack_processed(padded, lengths, processor=processor)
    assert "attention_mask" not in batch and batch["use_cache"] is False
    assert batch["packed_seq_lengths"].tolist() == lengths
    row = batch["input_ids"][0].tolist()
    expected = [token for r, n in enumerate(lengths) for token in padded["input_ids"][r, :n].tolist()]
    assert row == expected
    types = [t for r, n in enumerate(lengths) for t in padded["mm_token_type_ids"][r, :n].tolist()]
    assert batch["mm_token_type_ids"][0].tolist() == types
    assert torch.equal(batch["pixel_values"], padded["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], padded["image_grid_thw"])
    starts = np.cumsum([0, *lengths[:-1]])
    labels = batch["labels"][0]
    assert all(labels[s] == -100 for s in starts)
    expected_labels = torch.cat([padded["labels"][r, :n] for r, n in enumerate(lengths)])
    keep = torch.ones_like(labels, dtype=torch.bool)
    keep[torch.as_tensor(starts)] = False
    assert torch.equal(labels[keep], expected_labels[keep])
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]


def test_padding_and_positions_ahead(qwen):
    """``pad_to_multiple_of``: one more pseudo-sample of pad tokens, type 0, labels -100; the model's positions
    function gets the packed row and its samples, and its result travels under its own key."""
    processor, process = qwen
    padded = process([dict(e) for e in _examples(2)])
    lengths = padded["attention_mask"].sum(1).tolist()
    seen = {}

    def positions(ids, info, inputs):
        seen.update(info=info, inputs=inputs)
        return torch.zeros(4, *ids.shape, dtype=torch.int64)

    batch = pack_processed(padded, lengths, positions=positions, pad_to_multiple_of=64, pad_token_id=0)
    total = batch["input_ids"].shape[1]
    assert total % 64 == 0 and batch["packed_seq_lengths"].tolist() == [*lengths, total - sum(lengths)]
    assert (
        batch["labels"][0, sum(lengths) :].eq(-100).all() and batch["mm_token_type_ids"][0, sum(lengths) :].eq(0).all()
    )
    assert seen["info"].seq_lengths.tolist() == batch["packed_seq_lengths"].tolist()
    assert "image_grid_thw" in seen["inputs"] and batch[MULTIMODAL_POSITIONS_KEY].shape == (4, 1, total)


def test_truncation_cuts_text_only(qwen):
    """A sample longer than max_length loses text after its last image token (counted); one whose cut would remove
    an image token is an error naming the sample, its length, the limit and its last image token."""
    processor, process = qwen
    padded = process([dict(e) for e in _examples(3)])
    ids = image_token_ids(processor)
    lengths = padded["attention_mask"].sum(1).tolist()
    marked = torch.isin(padded["input_ids"], torch.tensor(sorted(ids))) | (padded["mm_token_type_ids"] != 0)
    last_image = [int(torch.nonzero(marked[r, :n])[-1, 0]) for r, n in enumerate(lengths)]
    limit = max(last_image) + 1
    cut, counts = truncate_processed(padded, limit, ids)
    assert cut == [min(n, limit) for n in lengths]
    assert counts.samples == sum(n > limit for n in lengths) and counts.tokens == sum(
        max(n - limit, 0) for n in lengths
    )
    worst = int(np.argmax(last_image))
    with pytest.raises(
        ValueError, match=rf"Sample {worst} of the batch has {lengths[worst]} tokens, more than max_length={limit - 1}"
    ):
        truncate_processed(padded, limit - 1, ids)
    with pytest.raises(ValueError, match="Example 7 of the train dataset has"):
        truncate_processed(padded, limit - 1, ids, names=[f"example {7 + r} of the train dataset" for r in range(3)])


def test_image_tokens_must_match_the_grids(qwen):
    processor, process = qwen
    padded = process([dict(e) for e in _examples(2)])
    lengths = padded["attention_mask"].sum(1).tolist()
    broken = dict(padded)
    broken["image_grid_thw"] = padded["image_grid_thw"].clone()
    broken["image_grid_thw"][0, 1] += 2
    with pytest.raises(ValueError, match="image tokens but its images give"):
        pack_processed(broken, lengths, processor=processor)


def test_a_sample_that_is_not_right_padded_is_refused(qwen):
    processor, process = qwen
    padded = dict(process([dict(e) for e in _examples(2)]))
    padded["attention_mask"] = padded["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="not right-padded"):
        truncate_processed(padded, None, image_token_ids(processor))


def test_collator_packs_rows_ahead_and_flat_batches_alike(qwen):
    """Rows packed ahead (VisionRows) and the same examples as a plain batch give the same packed row; every
    example's length is what the collator makes of it alone; a too long example is named by its index."""
    processor, process = qwen
    examples = _examples(5)
    dataset = Dataset.from_list(examples)
    collator = DataCollatorForVisionPacking(process=process, processor=processor, max_length=200)
    rows = pack_vision_dataset(dataset, collator, 200, seed=0, order="shuffled")
    assert isinstance(rows, VisionRows) and sum(len(r) for r in rows.rows) == 5
    assert sorted(i for r in rows.rows for i in r) == list(range(5))
    item = rows[0]
    assert set(item) == {VISION_ROWS_KEY, "seq_lengths", VISION_SOURCE_KEY}
    assert item[VISION_SOURCE_KEY] == [("train", i) for i in rows.rows[0]]
    batch = collator([item])
    flat = collator([dataset[i] for i in rows.rows[0]])
    for key in ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw", "packed_seq_lengths"):
        assert torch.equal(batch[key], flat[key]), key
    assert batch["packed_seq_lengths"].tolist() == item["seq_lengths"]
    with pytest.raises(ValueError, match=r"Example \d of the train dataset has \d+ tokens, more than max_length=10"):
        pack_vision_dataset(dataset, DataCollatorForVisionPacking(process, processor, max_length=10), 10, seed=0)


@pytest.mark.parametrize("model_type", ["gemma3", "idefics3", "llava"])
def test_other_families_pack_their_processor_outputs(model_type):
    """The processor's own batch of the family, packed: per-token keys flattened, vision tensors as the processor
    batched them (Idefics3's (samples, images, ...) included)."""
    processor = tiny_processor(model_type)
    process = trl_sft.DataCollatorForVisionLanguageModeling(processor, max_length=None)
    collator = DataCollatorForVisionPacking(process=process, processor=processor)
    examples = _examples(3)
    padded = process([dict(e) for e in examples])
    batch = collator([dict(e) for e in examples])
    lengths = padded["attention_mask"].sum(1).tolist()
    assert batch["input_ids"].shape == (1, sum(lengths)) and batch["packed_seq_lengths"].tolist() == lengths
    assert torch.equal(batch["pixel_values"], padded["pixel_values"])
    if "token_type_ids" in padded:
        assert batch["token_type_ids"].shape == batch["input_ids"].shape


def test_each_example_is_named_by_its_dataset_index(qwen):
    """Examples read through ``with_sources`` carry ``(dataset, index)``, taken off before the processor sees them: an
    image that does not fit names the dataset example, not its place in the batch; a stream's example its dataset."""
    processor, process = qwen
    seen: list[set] = []

    def recording(examples):
        seen.extend(set(example) for example in examples)
        return process(examples)

    dataset = Dataset.from_list(_examples(3))
    view = with_sources(dataset, "eval")
    assert len(view) == 3 and view[2][VISION_SOURCE_KEY] == ("eval", 2)
    collator = DataCollatorForVisionPacking(process=recording, processor=processor, max_length=10)
    with pytest.raises(ValueError, match=r"^Example 1 of the eval dataset has \d+ tokens, more than max_length=10"):
        collator([view[1], view[2]])
    assert seen and not any(VISION_SOURCE_KEY in keys for keys in seen)
    stream = list(with_sources(dataset.to_iterable_dataset(), "train"))
    assert [example[VISION_SOURCE_KEY] for example in stream] == [("train", None)] * 3
    with pytest.raises(ValueError, match=r"^Sample 0 of a batch of the streamed train dataset has \d+ tokens"):
        collator(stream[:2])


def test_an_example_the_processor_refuses_is_named_with_its_images():
    """A processor's (or TRL's) refusal of one example of a batch (image placeholders vs images) names that example,
    its dataset and its images, the processor's counts of that example alone after it; at trainer start
    (``sample_lengths``) the same."""
    processor = tiny_processor("idefics3")
    process = trl_sft.DataCollatorForVisionLanguageModeling(processor, max_length=None)
    good = {"images": [random_image(64, 64, 0)], "text": "<image> describe"}
    bad = {"images": [random_image(64, 64, 1)], "text": "<image><image> describe"}
    collator = DataCollatorForVisionPacking(process=process, processor=processor)
    refusal = (
        r"could not be processed: The total number of <image> tokens in the prompts should be the same as the number "
        r"of images passed\. Found (total )?\[?2\]? <image> tokens and \[?1\]? images"
    )
    with pytest.raises(ValueError, match=r"^Example 7 of the eval dataset \(1 image\) " + refusal):
        collator([{**good, VISION_SOURCE_KEY: ("eval", 6)}, {**bad, VISION_SOURCE_KEY: ("eval", 7)}])
    with pytest.raises(ValueError, match=r"^Sample 1 of the batch \(1 image\) " + refusal):
        collator([good, bad])
    with pytest.raises(ValueError, match=r"^Example 1 of the train dataset \(1 image\) " + refusal):
        collator.sample_lengths(Dataset.from_list([good, bad]))


def test_a_processor_stop_iteration_is_an_error_naming_the_example(qwen):
    """Some transformers releases raise ``StopIteration`` for more image placeholders than images; leaving the
    collator it would end a data loader's epoch without a word, so it is a ``ValueError`` naming the example."""
    processor, process = qwen

    def refusing(examples):
        if any(example.get("refuse") for example in examples):
            raise StopIteration
        return process(examples)

    examples = [{**example, "refuse": index == 1} for index, example in enumerate(_examples(2))]
    collator = DataCollatorForVisionPacking(process=refusing, processor=processor)
    with pytest.raises(ValueError, match=r"^Example 4 of the train dataset \(1 image\) could not be processed: .*"):
        collator([{**example, VISION_SOURCE_KEY: ("train", 3 + i)} for i, example in enumerate(examples)])


def test_truncated_text_is_counted_per_dataset(qwen, caplog):
    """Text cut after the last image token is counted per dataset as examples are read, the first cut logged once
    with its counts; rows packed ahead were counted (and logged, with the totals) when they were packed, not again
    when they are collated."""
    processor, process = qwen
    examples = _examples(4)
    padded = process([dict(e) for e in examples])
    lengths = padded["attention_mask"].sum(1).tolist()
    marked = torch.isin(padded["input_ids"], torch.tensor(sorted(image_token_ids(processor))))
    last_image = max(int(torch.nonzero(marked[r, :n])[-1, 0]) for r, n in enumerate(lengths))
    limit = max(last_image + 1, min(lengths))  # the shortest sample whole
    over, cut = sum(n > limit for n in lengths), sum(max(n - limit, 0) for n in lengths)
    assert 0 < over < 4
    collator = DataCollatorForVisionPacking(process=process, processor=processor, max_length=limit)
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        collator([{**e, VISION_SOURCE_KEY: ("train", i)} for i, e in enumerate(examples)])
        longest = int(np.argmax(lengths))
        collator([{**examples[longest], VISION_SOURCE_KEY: ("val", 0)}])
    train, val = collator.truncation_counts("train"), collator.truncation_counts("val")
    assert (train.read, train.over, train.cut_tokens) == (4, over, cut)
    assert (val.read, val.over, val.cut_tokens) == (1, 1, lengths[longest] - limit)
    assert f"val dataset: 1 of the 1 image samples of a batch were longer than max_length={limit}" in caplog.text
    assert (
        f"train dataset: {over} of the 4 image samples of a batch were longer than max_length={limit} and were "
        f"truncated after their last image token (text only; an image is never cut), dropping {cut} tokens"
    ) in caplog.text
    assert f"train dataset: {over} of 4 image samples read were longer" in train.summary()
    caplog.clear()
    packer = DataCollatorForVisionPacking(process=process, processor=processor, max_length=limit)
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        rows = pack_vision_dataset(Dataset.from_list(examples), packer, sum(lengths), seed=0)
    counts = packer.truncation_counts("train")
    assert (counts.read, counts.over, counts.cut_tokens) == (4, over, cut)
    assert (
        f"train dataset: {over} of 4 image samples are longer than max_length={limit} and were truncated after "
        f"their last image token (text only; an image is never cut), dropping {cut} tokens"
    ) in caplog.text
    packer([rows[i] for i in range(len(rows))])
    assert (counts.read, counts.over) == (4, over) and packer.truncation_counts("train") is counts
