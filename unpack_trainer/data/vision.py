"""Image (and video) samples packed: processor outputs -> one packed row with every vision tensor in pack order.

The vision stage of the data path, beside the text collator ([`unpack_trainer.data.collator`]): a vision-language
sample is tokenized with its images by the model's processor (as TRL's ``DataCollatorForVisionLanguageModeling``
does), and the processed samples of a batch become one packed row (``(1, T)``, no attention mask). The tokens of every
sample follow each other; each per-token key (``mm_token_type_ids``, ``token_type_ids``, ...) is concatenated the same
way; every vision tensor (``pixel_values``, ``image_grid_thw``, ``video_grid_thw``, ``second_per_grid_ts``,
``pixel_attention_mask``, ``image_sizes``, ...) keeps the order of the processor's batch, which is the samples' order,
which is the pack order. An image is never split across rows (a sample is never split) and never cut by truncation:
a sample whose image tokens do not fit ``max_length`` is an error naming the sample and the limit; only text after
the last image token is truncated (``keep_start``), and that is counted per dataset
(:class:`VisionTruncationCounts`). Image tokens == image features is checked per row where the processor's grids tell
the features (Qwen2-VL family).

Errors name a sample by its dataset example (``"example 12 of the train dataset"``): each example read through
:func:`with_sources` carries its dataset's name and its index under :data:`VISION_SOURCE_KEY`, which the collator
takes off before the processor sees the example; an example the processor refuses (image placeholders vs images, ...)
is named with its images, the processor's message after it.

Worked example (two samples, Qwen2-VL markup, merge 2: a 56 x 56 image is a 4 x 4 grid, 4 tokens)::

    sample 0   [t t <vs> I I I I <ve> t]   9 tokens, image_grid_thw [[1, 4, 4]]
    sample 1   [t t t]                     3 tokens
    packed     input_ids (1, 12), mm_token_type_ids (1, 12), packed_seq_lengths [9, 3],
               pixel_values (16, 1176), image_grid_thw [[1, 4, 4]],
               position_ids (1, 12) [0..8, 0..2]; with the model's positions, packed_multimodal_position_ids
               (4, 1, 12) from its get_rope_index per sample
               labels -100 at 0 and 9, and wherever the processor's labels are -100

Under sequence parallelism (``sequence_shards=N``, DeepSpeed Ulysses: its data loader adapter cuts every tensor of a
batch along the row and copies everything else whole) the row is padded to a multiple of ``N`` and the batch holds
only ``input_ids``, ``labels`` and ``position_ids`` ``(1, T)`` to cut; ``packed_seq_info`` (the whole row's samples,
``sequence_shards=N``) and :class:`WholeRowInputs` (``packed_vision_inputs``: the whole row's tokens, vision tensors,
per-token keys and multi-axis positions) go whole to every process, which embeds its shard and takes from them the
image features and positions of its own tokens (:mod:`unpack_trainer.models.fixes.vision_language`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from unpack_trainer._logging import log_once
from unpack_trainer.data.collator import IGNORE_INDEX, SEQUENCE_SHARDED_KEYS, packed_metadata
from unpack_trainer.data.preparation import TruncationCounts
from unpack_trainer.data.validation import check_positive_int
from unpack_trainer.packed_seq_info import (
    CU_SEQ_LENS_Q_KEY,
    INFO_KEY,
    MULTIMODAL_POSITIONS_KEY,
    PACKED_BATCH_KEYS,
    SEQ_LENGTHS_COLUMN,
    SEQ_LENGTHS_KEY,
    PackedSeqInfo,
)

__all__ = [
    "PER_TOKEN_KEYS",
    "VISION_ROWS_KEY",
    "VISION_SOURCE_KEY",
    "WHOLE_ROW_KEY",
    "DataCollatorForVisionPacking",
    "VisionRows",
    "VisionTruncationCounts",
    "WholeRowInputs",
    "image_token_ids",
    "pack_processed",
    "pack_vision_dataset",
    "truncate_processed",
    "with_sources",
]

logger = logging.getLogger("unpack_trainer")

# Keys a processor (or TRL's collator) returns with one value per token, shaped as ``input_ids``.
PER_TOKEN_KEYS: tuple[str, ...] = (
    "input_ids",
    "attention_mask",
    "labels",
    "mm_token_type_ids",
    "token_type_ids",
    "assistant_masks",
    "completion_mask",
)
# The key of a row packed ahead (:class:`VisionRows`): the raw examples of the row, in pack order.
VISION_ROWS_KEY = "vision_samples"
# Where an example comes from, for the collator's errors and counts (:func:`with_sources`): ``(dataset name, index)``
# on an example (index ``None`` for a stream's), a list of them on a row packed ahead; never reaches the processor.
VISION_SOURCE_KEY = "vision_source"

# Under sequence parallelism: the batch key of a packed row's WholeRowInputs (what DeepSpeed's adapter must not cut).
WHOLE_ROW_KEY = "packed_vision_inputs"

# ``(input_ids (1, T), info, inputs) -> (rows, 1, T)``: a model's positions per sample (anatomy.vision.RopeIndex).
PositionFunction = Callable[[torch.Tensor, PackedSeqInfo, dict[str, Any]], torch.Tensor]


@dataclass
class WholeRowInputs:
    """A packed vision-language row's inputs that sequence parallelism must not cut, for every process whole.

    DeepSpeed's data loader adapter cuts every tensor of a batch along its dim 1 (and refuses one whose dim 1 is not
    the row) and copies any other object whole to every process of the group. This object is not a tensor, a mapping
    nor a sequence, so the adapter copies it and transformers' ``Trainer`` leaves it on the host (its tensors reach
    the device only where the model's forward hook moves them: the image inputs of the process's shard).

    Attributes:
        inputs: the whole row's ``input_ids`` ``(1, T)`` int64 and every other key of the packed batch but ``labels``
            and ``position_ids``: the vision tensors as the processor returned them (``pixel_values``,
            ``image_grid_thw``, ...), the per-token keys ``(1, T)`` (``mm_token_type_ids``, ``token_type_ids``) and,
            for a multi-axis RoPE, ``packed_multimodal_position_ids`` ``(rows, 1, T)`` int64. All on the CPU.
    """

    inputs: dict[str, Any]

    def __repr__(self) -> str:
        shapes = {key: tuple(value.shape) for key, value in self.inputs.items() if isinstance(value, torch.Tensor)}
        return f"WholeRowInputs({shapes})"


def image_token_ids(processor: Any) -> frozenset[int]:
    """The token ids of ``processor`` that stand for an image or a video (placeholders and the markers around them):
    its and its tokenizer's ``image_token_id`` / ``video_token_id`` / ``boi_token_id`` / ``eoi_token_id`` and the
    ids of its ``image_token`` / ``video_token`` / ``fake_image_token`` / ``boi_token`` strings."""
    tokenizer = getattr(processor, "tokenizer", processor)
    ids: set[int] = set()
    for owner in (processor, tokenizer):
        for name in ("image_token_id", "video_token_id", "boi_token_id", "eoi_token_id"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                ids.add(value)
        for name in ("image_token", "video_token", "fake_image_token", "boi_token", "eoi_token"):
            token = getattr(owner, name, None)
            if isinstance(token, str):
                value = tokenizer.convert_tokens_to_ids(token)
                if isinstance(value, int) and value != getattr(tokenizer, "unk_token_id", None):
                    ids.add(value)
    return frozenset(ids)


def _row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Each row's real tokens of a right-padded ``(n, L)`` mask; ``ValueError`` where a row is not ones then zeros."""
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(1)
    steps = torch.arange(mask.shape[1]).unsqueeze(0)
    if not torch.equal(mask, steps < lengths.unsqueeze(1)):
        row = int(torch.nonzero((mask != (steps < lengths.unsqueeze(1))).any(1))[0, 0])
        raise ValueError(
            f"Sample {row} of the processed batch is not right-padded (its attention_mask is not ones then zeros); "
            "the vision packing collator reads each sample's tokens from the left."
        )
    return lengths.tolist()


def _image_positions(processed: dict[str, Any], row: int, length: int, image_ids: frozenset[int]) -> torch.Tensor:
    """``(length,)`` bool: the tokens of sample ``row`` that belong to an image or a video (an id of ``image_ids``, or
    a nonzero ``mm_token_type_ids`` / ``token_type_ids``)."""
    ids = processed["input_ids"][row, :length]
    marked = (
        torch.isin(ids, torch.tensor(sorted(image_ids), dtype=ids.dtype))
        if image_ids
        else torch.zeros_like(ids, dtype=torch.bool)
    )
    for key in ("mm_token_type_ids", "token_type_ids"):
        types = processed.get(key)
        if isinstance(types, torch.Tensor) and types.shape == processed["input_ids"].shape:
            marked |= types[row, :length] != 0
    return marked


@dataclass
class TruncatedSamples:
    """What :func:`truncate_processed` cut: ``samples`` truncated, ``tokens`` removed."""

    samples: int = 0
    tokens: int = 0


def truncate_processed(
    processed: dict[str, Any],
    max_length: int | None,
    image_ids: frozenset[int],
    *,
    names: Sequence[str] | None = None,
) -> tuple[list[int], TruncatedSamples]:
    """Each sample's length in a right-padded processed batch, truncated to ``max_length`` where only text is cut.

    Args:
        processed: a processor's (or TRL's vision collator's) padded batch: ``input_ids`` and ``attention_mask``
            ``(n, L)``, per-token keys of the same shape, the vision tensors.
        max_length: the longest a sample may be (``None``: no limit).
        image_ids: the token ids that belong to images (:func:`image_token_ids`).
        names: how to name each sample in an error (its dataset index, ...); ``"sample {row} of the batch"`` else.

    Returns:
        ``(lengths, counts)``: every sample's length after truncation, and what was cut.

    Raises:
        ValueError: a sample longer than ``max_length`` whose cut would remove a token of an image (named, with its
            length, the limit and where its last image token is).
    """
    lengths = _row_lengths(processed["attention_mask"])
    counts = TruncatedSamples()
    if max_length is None:
        return lengths, counts
    for row, length in enumerate(lengths):
        if length <= max_length:
            continue
        image = _image_positions(processed, row, length, image_ids)
        if bool(image[max_length:].any()):
            last = int(torch.nonzero(image)[-1, 0])
            name = names[row] if names is not None else f"sample {row} of the batch"
            raise ValueError(
                f"{_capitalized(name)} has {length} tokens, more than max_length={max_length}, and truncating it "
                f"would cut its image tokens (the last one is token {last}); an image is never cut. Raise max_length to at "
                f"least {last + 1}, use smaller images (the processor's max_pixels / size), or leave the sample out."
            )
        counts.samples += 1
        counts.tokens += length - max_length
        lengths[row] = max_length
    return lengths, counts


def _capitalized(name: str) -> str:
    """``name`` with its first letter upper case, the rest kept (a dataset's name as it was given)."""
    return name[:1].upper() + name[1:]


def _sample_name(source: Any, position: int) -> str:
    """How an error names the sample at ``position`` of a batch: by its dataset example where its ``source`` (see
    :data:`VISION_SOURCE_KEY`) says it, by its place in a batch of its stream, else by its place in the batch."""
    if source is None:
        return f"sample {position} of the batch"
    name, index = source
    if index is None:
        return f"sample {position} of a batch of the streamed {name} dataset"
    return f"example {index} of the {name} dataset"


def _images_of(example: dict[str, Any]) -> str:
    """``"1 image"``, ``"3 images"``, ``"no image"``: what ``example`` gives its processor (``images`` / ``image``)."""
    images = example.get("images")
    count = len(images) if isinstance(images, (list, tuple)) else int(example.get("image") is not None)
    return "no image" if count == 0 else f"{count} image" + ("s" if count > 1 else "")


def _refusal(error: Exception) -> str:
    """What a processor's refusal says: its message; a ``StopIteration`` (which must not leave a collator: a data
    loader would end its epoch there, silently) said in words."""
    if isinstance(error, StopIteration):
        return (
            "the processor raised StopIteration, as some transformers releases do where the text holds more image "
            "placeholders than there are images"
        )
    return str(error)


def _process_one(
    process: Callable[[list[dict[str, Any]]], dict[str, Any]], example: dict[str, Any], name: str
) -> dict[str, Any]:
    """``process([example])`` (on a copy); a ``ValueError`` or ``StopIteration`` it raises (the processor's or TRL's
    refusal: image placeholders vs images, ...) raised again as a ``ValueError`` naming the example (``name``) and its
    images, the processor's message after it."""
    try:
        return dict(process([dict(example)]))
    except (ValueError, StopIteration) as error:
        raise ValueError(
            f"{_capitalized(name)} ({_images_of(example)}) could not be processed: {_refusal(error)}"
        ) from error


@dataclass
class VisionTruncationCounts(TruncationCounts):
    """What ``max_length`` did to one dataset's image samples (``name``: ``"train"``, an evaluation set's name, or
    ``None`` for batches of no named dataset): ``read`` samples, ``over`` of them longer than ``max_length``, their
    text after the last image token cut (``cut_tokens`` removed); an image is never cut. The fields of the text path's
    [`unpack_trainer.data.preparation.TruncationCounts`], filled up front for examples packed ahead, as they are read
    otherwise."""

    name: str | None
    max_length: int | None
    truncation_mode: str = "keep_start"
    split: bool = False

    def _where(self) -> str:
        return f"{self.name} dataset" if self.name is not None else "batches of no named dataset"

    def summary(self) -> str:
        return (
            f"{self._where()}: {self.over} of {self.read} image samples read were longer than "
            f"max_length={self.max_length} and were truncated after their last image token (text only; an image is "
            f"never cut), dropping {self.cut_tokens:,} tokens."
        )


def _check_grids(processed: dict[str, Any], processor: Any, num_image_tokens: int, num_video_tokens: int) -> None:
    """Image tokens == image features of the row, where the processor's grids tell the features (Qwen2-VL family:
    ``prod(grid_thw) / merge_size**2`` per image or video)."""
    for grid_key, count, what, sub in (
        ("image_grid_thw", num_image_tokens, "image", "image_processor"),
        ("video_grid_thw", num_video_tokens, "video", "video_processor"),
    ):
        grid = processed.get(grid_key)
        merge = getattr(getattr(processor, sub, None), "merge_size", None)
        if not isinstance(grid, torch.Tensor) or not isinstance(merge, int):
            continue
        features = int((grid.prod(-1) // merge**2).sum())
        if features != count:
            raise ValueError(
                f"The packed row has {count} {what} tokens but its {what}s give {features} features "
                f"({grid_key} {grid.tolist()}, merge size {merge}); every {what} token must be in the row with its "
                f"{what}."
            )


def pack_processed(
    processed: dict[str, Any],
    lengths: Sequence[int],
    *,
    positions: PositionFunction | None = None,
    processor: Any = None,
    use_cache: bool | None = False,
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
    seq_info: bool = False,
    sequence_shards: int = 1,
) -> dict[str, Any]:
    """A processed, right-padded batch of samples as one packed row.

    Args:
        processed: ``input_ids`` ``(n, L)`` and the other per-token keys of :data:`PER_TOKEN_KEYS` (``labels``
            optional: ``input_ids`` with ``-100`` on padding when absent), and the vision tensors, in sample order.
        lengths: each sample's length (at most its real tokens: a truncated sample is shorter).
        positions: the model's multi-axis positions per sample (``anatomy.vision.SamplePositions``:
            ``(input_ids (1, T), info, inputs) -> (rows, 1, T)``), put under ``packed_multimodal_position_ids``;
            ``None``: none (a model with multi-axis RoPE then computes them in its forward hook).
        processor: the processor, for the per-row check of image tokens against its grids; ``None`` skips it.
        use_cache: the ``use_cache`` value of the batch (``None`` leaves it out), as the text collator.
        pad_to_multiple_of: pad the row to a multiple of this many tokens with one more pseudo-sample
            (``pad_token_id``, token types 0, labels ``-100``), as the text collator pads.
        pad_token_id: the padding pseudo-sample's token id.
        seq_info: also return ``packed_seq_info``, the row's
            [`~unpack_trainer.packed_seq_info.PackedSeqInfo`] built here on the CPU (a patched model adopts it and
            reads no metadata back from the device), as the text collator's ``seq_info``.
        sequence_shards: under sequence parallelism, the ``N`` processes each row is cut over: the row padded to a
            multiple of ``N`` (with ``pad_to_multiple_of``: of both), and the batch as DeepSpeed's adapter takes it
            (see Returns).

    Returns:
        ``input_ids`` / ``labels`` ``(1, T)`` int64 (labels ``-100`` at every sample's first token), every other
        per-token key ``(1, T)``, ``position_ids`` ``(1, T)`` int64 restarting per sample (and, with ``positions``,
        ``packed_multimodal_position_ids`` ``(rows, 1, T)`` int64), ``packed_seq_lengths``,
        ``cu_seq_lens_q/k``, ``max_length_q/k``, the vision tensors as the processor returned them, ``use_cache``
        (and ``packed_seq_info`` with ``seq_info``). No ``attention_mask``.

        With ``sequence_shards`` ``N > 1``: ``input_ids``, ``labels`` and ``position_ids`` ``(1, T)`` (``T`` a multiple
        of ``N``, cut by the engine), ``packed_seq_info`` (``sequence_shards=N``), ``packed_vision_inputs`` (a
        :class:`WholeRowInputs` of everything else, the whole row's ``input_ids`` with it) and ``use_cache``.
    """
    lengths = [int(length) for length in lengths]
    if len(lengths) != processed["input_ids"].shape[0]:
        raise ValueError(f"{len(lengths)} lengths for {processed['input_ids'].shape[0]} processed samples.")
    for index, length in enumerate(lengths):
        if length <= 0:
            raise ValueError(f"Sample {index} of the batch is empty; every sample needs at least one token.")
    shape = processed["input_ids"].shape
    if "labels" not in processed:
        processed = {**processed, "labels": processed["input_ids"].masked_fill(processed["attention_mask"] == 0, -100)}
    check_positive_int(sequence_shards, "sequence_shards", requirement="positive: an integer >= 1")
    padding = (-sum(lengths)) % math.lcm(pad_to_multiple_of or 1, sequence_shards)
    batch = packed_metadata(lengths + ([padding] if padding else []))
    out: dict[str, Any] = {}
    for key, value in processed.items():
        if key == "attention_mask":
            continue
        if key in PER_TOKEN_KEYS and isinstance(value, torch.Tensor) and value.shape == shape:
            parts = [value[row, :length] for row, length in enumerate(lengths)]
            if padding:
                fill = pad_token_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
                parts.append(torch.full((padding,), fill, dtype=value.dtype))
            out[key] = torch.cat(parts).unsqueeze(0)
        else:
            out[key] = value  # a vision tensor: already in sample order
    labels = out["labels"].to(torch.int64).clone()
    labels[0, batch[CU_SEQ_LENS_Q_KEY][:-1].long()] = IGNORE_INDEX
    out["labels"] = labels
    out["input_ids"] = out["input_ids"].to(torch.int64)
    if processor is not None:
        ids = out["input_ids"]
        image = getattr(processor, "image_token_id", None)
        video = getattr(processor, "video_token_id", None)
        _check_grids(
            out,
            processor,
            int((ids == image).sum()) if isinstance(image, int) else 0,
            int((ids == video).sum()) if isinstance(video, int) else 0,
        )
    info = None
    if positions is not None or seq_info or sequence_shards > 1:
        info = PackedSeqInfo.from_seq_lengths(
            batch[SEQ_LENGTHS_KEY],
            batch_size=1,
            seq_len=sum(lengths) + padding,
            cu_seqlens=batch[CU_SEQ_LENS_Q_KEY],
        )
    if positions is not None:
        inputs = {key: value for key, value in out.items() if key not in ("input_ids", "labels")}
        out[MULTIMODAL_POSITIONS_KEY] = positions(out["input_ids"], info, inputs)
    result = {key: (out[key] if key in out else batch[key]) for key in PACKED_BATCH_KEYS}
    result.update({key: value for key, value in out.items() if key not in result})
    if sequence_shards > 1:
        whole = {key: value for key, value in out.items() if key not in SEQUENCE_SHARDED_KEYS or key == "input_ids"}
        result = {key: result[key] for key in SEQUENCE_SHARDED_KEYS}
        result[WHOLE_ROW_KEY] = WholeRowInputs(whole)
        info = info.for_sequence_shards(sequence_shards)
    if use_cache is not None:
        result["use_cache"] = use_cache
    if seq_info or sequence_shards > 1:
        result[INFO_KEY] = info
    return result


class VisionRows(torch.utils.data.Dataset):
    """Vision-language samples packed ahead into rows: item ``i`` is ``{"vision_samples": [the raw examples of row i,
    in pack order], "seq_lengths": [their lengths], "vision_source": [(name, index) of each]}``, the examples read from
    ``dataset`` when the item is read (the images are decoded and processed by the collator, per batch, as TRL does).

    Args:
        dataset: the raw dataset (``datasets.Dataset`` or any sequence of example dicts).
        rows: each row's example indices, in order.
        lengths: each example's processed length (what the rows were packed from).
        name: the dataset's name in the collator's errors (``"example 12 of the train dataset"``).
    """

    def __init__(
        self, dataset: Any, rows: Sequence[Sequence[int]], lengths: Sequence[int], name: str = "train"
    ) -> None:
        self.dataset = dataset
        self.rows = [list(map(int, row)) for row in rows]
        self.lengths = [int(length) for length in lengths]
        self.name = name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        return {
            VISION_ROWS_KEY: [self.dataset[i] for i in row],
            SEQ_LENGTHS_COLUMN: [self.lengths[i] for i in row],
            VISION_SOURCE_KEY: [(self.name, i) for i in row],
        }


class _SourcedExamples(torch.utils.data.Dataset):
    """A map-style dataset read as is, each example with ``(name, index)`` under :data:`VISION_SOURCE_KEY`."""

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset = dataset
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], VISION_SOURCE_KEY: (self.name, int(index))}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        # a batch read as the dataset reads one (``datasets.Dataset``: one query for the batch)
        read = getattr(self.dataset, "__getitems__", None)
        examples = read(indices) if read is not None else [self.dataset[index] for index in indices]
        return [{**example, VISION_SOURCE_KEY: (self.name, int(index))} for index, example in zip(indices, examples)]


def _stream_source(name: str, example: dict[str, Any]) -> dict[str, Any]:
    return {VISION_SOURCE_KEY: (name, None)}


def with_sources(dataset: Any, name: str) -> Any:
    """``dataset``'s examples, each with where it comes from under :data:`VISION_SOURCE_KEY`, for the names in the
    errors and the counts of :class:`DataCollatorForVisionPacking` (which takes the key off before processing)::

        map-style (__len__, __getitem__)   a view, nothing copied: item i is {**dataset[i], key: (name, i)}
        datasets.IterableDataset           mapped as it is read: (name, None) (a stream has no index)
        VisionRows, any other dataset      itself (a row's items carry their own sources)

    Args:
        dataset: the dataset a data loader reads for the collator.
        name: its name in the errors (``"train"``, ``"eval"``, an evaluation dict's key).
    """
    if isinstance(dataset, VisionRows):
        return dataset
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return _SourcedExamples(dataset, name)
    from datasets import IterableDataset

    if isinstance(dataset, IterableDataset):
        return dataset.map(functools.partial(_stream_source, name))
    return dataset


@dataclass
class DataCollatorForVisionPacking:
    """Vision-language examples -> one packed row (padding-free), or rows packed ahead (:class:`VisionRows`) -> one
    packed row of all their samples.

    Each example is what TRL's vision collator takes (``images`` / ``image`` with ``messages``, ``prompt`` +
    ``completion`` or a text field). The batch's samples are processed together by ``process`` (TRL's
    ``DataCollatorForVisionLanguageModeling`` without truncation: one right-padded processor batch, labels as TRL
    makes them), truncated image-safely (:func:`truncate_processed`) and packed (:func:`pack_processed`). An example
    read through :func:`with_sources` is named by its dataset and index in every error; the text cut from examples is
    counted per dataset (:meth:`truncation_counts`: up front by :meth:`sample_lengths` for rows packed ahead, as they
    are read for other examples, the first cut of each dataset logged once with its batch's counts).

    Args:
        process: ``examples -> processed padded batch`` (``input_ids``, ``attention_mask``, ``labels``, the
            processor's keys).
        processor: the model's processor (its image token ids, the grid check).
        max_length: the longest a sample may be (``None``: no limit).
        positions: the model's positions per sample (see :func:`pack_processed`); ``None``: restarting 1-D
            positions (a model with multi-axis RoPE then computes them in its forward hook).
        use_cache: the batch's ``use_cache`` value (``None`` leaves it out).
        pad_to_multiple_of: pad the row to a multiple of this with a padding pseudo-sample (the processor's pad
            token).
        seq_info: also return ``packed_seq_info`` (see :func:`pack_processed`).
        sequence_shards: under sequence parallelism (DeepSpeed Ulysses), the processes each row is cut over: rows
            padded to a multiple, the batch as the engine's data loader adapter takes it (see :func:`pack_processed`).
            Only for a patched model.
    """

    process: Callable[[list[dict[str, Any]]], dict[str, Any]]
    processor: Any
    max_length: int | None = None
    positions: PositionFunction | None = None
    use_cache: bool | None = False
    pad_to_multiple_of: int | None = None
    seq_info: bool = False
    sequence_shards: int = 1
    image_ids: frozenset[int] = field(init=False)
    truncation: dict[str | None, VisionTruncationCounts] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.max_length is not None:
            check_positive_int(self.max_length, "max_length")
        check_positive_int(self.sequence_shards, "sequence_shards", requirement="positive: an integer >= 1")
        self.image_ids = image_token_ids(self.processor)

    def truncation_counts(self, name: str | None) -> VisionTruncationCounts:
        """The counts of the dataset ``name`` (``None``: examples without a source), created empty when first asked
        for; the same object as it fills (``trainer.unpack_stats["truncation"]`` holds the training set's)."""
        if name not in self.truncation:
            self.truncation[name] = VisionTruncationCounts(name, self.max_length)
        return self.truncation[name]

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if not examples:
            raise ValueError("Cannot collate an empty batch.")
        samples: list[dict[str, Any]] = []
        sources: list[Any] = []  # (dataset name, index) of each sample, or None
        counted: list[bool] = []  # False: in a row packed ahead, counted when it was packed
        for index, example in enumerate(examples):
            if VISION_ROWS_KEY in example:
                row = example[VISION_ROWS_KEY]
                samples.extend(row)
                sources.extend(example.get(VISION_SOURCE_KEY) or [None] * len(row))
                counted.extend([False] * len(row))
            elif samples and VISION_ROWS_KEY in examples[0]:
                raise ValueError(f"Example {index} is not a packed row while example 0 is; mix them in other batches.")
            else:
                sample = dict(example)
                sources.append(sample.pop(VISION_SOURCE_KEY, None))
                samples.append(sample)
                counted.append(True)
        names = [_sample_name(source, position) for position, source in enumerate(sources)]
        processed = self._process(samples, names)
        full = _row_lengths(processed["attention_mask"])
        lengths, _ = truncate_processed(processed, self.max_length, self.image_ids, names=names)
        if self.max_length is not None:
            self._count_truncation(full, lengths, sources, counted, names)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        return pack_processed(
            processed,
            lengths,
            positions=self.positions,
            processor=self.processor,
            use_cache=self.use_cache,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            seq_info=self.seq_info,
            sequence_shards=self.sequence_shards,
        )

    def _process(self, samples: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
        """The batch processed together; where the processor refuses it, the first sample it refuses alone is named
        (:func:`_process_one`), and a batch that fails only together raises its own error (a ``StopIteration`` as a
        ``ValueError``: it would end a data loader's epoch)."""
        if len(samples) == 1:
            return _process_one(self.process, samples[0], names[0])
        try:
            return dict(self.process([dict(sample) for sample in samples]))
        except (ValueError, StopIteration) as error:
            for sample, name in zip(samples, names):
                _process_one(self.process, sample, name)
            if isinstance(error, StopIteration):
                raise ValueError(
                    f"A batch of {len(samples)} samples could not be processed: {_refusal(error)}"
                ) from error
            raise

    def _count_truncation(
        self, full: list[int], lengths: list[int], sources: list[Any], counted: list[bool], names: list[str]
    ) -> None:
        """Add a batch's cuts to each dataset's counts (``full`` / ``lengths``: each sample's tokens before / after
        truncation); the first cut of a dataset is logged once, with its batch's counts and the first sample cut."""
        batch: dict[str | None, list[int]] = {}  # dataset -> [samples, over, tokens cut, position of the first cut]
        for position, (before, after) in enumerate(zip(full, lengths)):
            if not counted[position]:
                continue
            source = sources[position]
            entry = batch.setdefault(source[0] if source is not None else None, [0, 0, 0, -1])
            entry[0] += 1
            if before > after:
                entry[1] += 1
                entry[2] += before - after
                if entry[3] < 0:
                    entry[3] = position
        for dataset, (samples, over, tokens, first) in batch.items():
            counts = self.truncation_counts(dataset)
            first_cut = counts.over == 0 and over > 0
            counts.read += samples
            counts.over += over
            counts.cut_tokens += tokens
            if first_cut:
                log_once(
                    logger,
                    logging.WARNING,
                    f"{counts._where()}: {over} of the {samples} image samples of a batch were longer than "
                    f"max_length={self.max_length} and were truncated after their last image token (text only; an "
                    f"image is never cut), dropping {tokens:,} tokens (the first: {names[first]}, {full[first]} "
                    "tokens). Later ones are counted as they are read and their totals logged at the end of training "
                    "(the training set's are kept in trainer.unpack_stats['truncation']). Raise max_length to keep "
                    "their whole text.",
                )

    def sample_lengths(self, dataset: Any, *, name: str = "train") -> list[int]:
        """Every example's processed length (truncated as the collator truncates it), one processor call each:
        what :class:`VisionRows` packs from. An example whose images do not fit ``max_length``, or that the
        processor refuses (image placeholders vs images, ...), is an error naming it (``"example 12 of the train
        dataset"``); the text cut is counted here, up front (:meth:`truncation_counts` of ``name``, replaced), and
        logged once with the totals."""
        lengths = []
        counts = VisionTruncationCounts(name, self.max_length)
        for index in range(len(dataset)):
            example_name = f"example {index} of the {name} dataset"
            processed = _process_one(self.process, dict(dataset[index]), example_name)
            (length,), cut = truncate_processed(processed, self.max_length, self.image_ids, names=[example_name])
            counts.read += 1
            counts.over += cut.samples
            counts.cut_tokens += cut.tokens
            lengths.append(length)
        if self.max_length is not None:
            self.truncation[name] = counts
            if counts.over:
                log_once(
                    logger,
                    logging.WARNING,
                    f"{name} dataset: {counts.over} of {counts.read} image samples are longer than "
                    f"max_length={self.max_length} and were truncated after their last image token (text only; an "
                    f"image is never cut), dropping {counts.cut_tokens:,} tokens. Raise max_length to keep their "
                    "whole text.",
                )
        return lengths


def pack_vision_dataset(
    dataset: Any,
    collator: DataCollatorForVisionPacking,
    max_length: int,
    *,
    seed: int | None,
    order: str = "windowed",
    max_samples_per_row: int | None = None,
    window: int | None = None,
    rows_multiple_of: int = 1,
    name: str = "train",
) -> VisionRows:
    """Vision-language examples packed ahead into rows of at most ``max_length`` tokens (:class:`VisionRows`).

    Every example is processed once to know its length (:meth:`DataCollatorForVisionPacking.sample_lengths`: an
    example whose images do not fit is an error naming it); the rows are chosen as the text path chooses them
    ([`unpack_trainer.data.preparation.packed_rows`]: ``order``, ``seed``, ``max_samples_per_row``, ``window``,
    ``rows_multiple_of``); the images stay in the dataset until the collator reads a row.
    """
    import numpy as np

    from unpack_trainer.data.preparation import packed_rows

    max_length = check_positive_int(max_length, "max_length")
    if len(dataset) == 0:
        raise ValueError(f"The {name} dataset is empty; there is nothing to pack.")
    lengths = collator.sample_lengths(dataset, name=name)
    rows = packed_rows(
        np.asarray(lengths, dtype=np.int64),
        max_length,
        seed=seed,
        order=order,
        max_samples_per_row=max_samples_per_row,
        window=window,
        rows_multiple_of=rows_multiple_of,
    )
    return VisionRows(dataset, rows, lengths, name=name)
