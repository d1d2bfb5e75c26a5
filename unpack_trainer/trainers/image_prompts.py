"""Image prompts shared by a group of completions: TRL's vision inputs of a GRPO / RLOO batch laid out for its packed
row (:func:`unpack_trainer.trainers.branched.pack_completions`), each group's images once.

TRL 1.16's ``GRPOTrainer`` / ``RLOOTrainer`` repeat an image prompt once per completion: the ``(R, P + C)`` batch of
their log-prob forwards comes with every row's images (``pixel_values`` ``(Σ t·h·w, D)`` and ``image_grid_thw``
``(num_images, 3)`` row after row, ``num_images`` per row) and ``mm_token_type_ids`` ``(R, P + C)``: the Qwen2-VL
family's layout. On the packed row each prompt appears once, so each group's images are handed to the vision tower
once: the rows of a group are those with equal prompt token ids **and** equal images ([`image_keys`]: two prompts of
the same text and image size differ only in their pixels), and the packed ``pixel_values`` / ``image_grid_thw`` hold
one row's images per prompt segment, in the order of the segments, which is the order of the image tokens on the row
([`pack_image_inputs`]). Each token's multi-axis positions are those the model's own ``get_rope_index`` gives its
full sequence ``[prompt; completion]`` alone, computed on TRL's padded batch (each row numbered from its first real
token, as the stock forward numbers it) and read into the packed row through ``packed_token_index``: a branch
continues its prompt's positions exactly as its full sequence alone would have them
(:class:`unpack_trainer.models.vision.SequencePositions`).

Any other vision input (``pixel_attention_mask``, ``image_sizes``, ``token_type_ids``, ``spatial_shapes``, ...) is
another family's layout: [`image_inputs_problem`] says why, and the forward runs TRL's padded batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unpack_trainer.packed_seq_info import MULTIMODAL_POSITIONS_KEY, PACKED_INPUT_IDS_KEY, TOKEN_INDEX_KEY

__all__ = ["IMAGE_INPUTS", "RowImages", "image_inputs_problem", "image_keys", "pack_image_inputs", "row_images"]

# The vision inputs of TRL's log-prob forwards this module lays out (the Qwen2-VL family's).
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")


def image_inputs_problem(inputs: dict[str, Any]) -> str | None:
    """Why the vision inputs ``inputs`` (TRL's keyword arguments that are not ``None``) cannot be laid out per prompt
    segment here, or ``None``."""
    other = sorted(name for name, value in inputs.items() if value is not None and name not in IMAGE_INPUTS)
    if other:
        return (
            f"its vision inputs ({', '.join(other)}) are not laid out by image_grid_thw (the Qwen2-VL family's "
            "layout, the one whose image prompts are shared)"
        )
    if inputs.get("pixel_values") is not None and (
        inputs.get("image_grid_thw") is None or inputs.get("num_images") is None
    ):
        return "its pixel_values come without image_grid_thw and num_images, which say whose images they are"
    return None


@dataclass(frozen=True)
class RowImages:
    """Where each row's images lie in TRL's vision inputs.

    Attributes:
        images: per row, its ``[start, end)`` rows of ``image_grid_thw``.
        pixels: per row, its ``[start, end)`` rows of ``pixel_values``.
        grids: per row, its images' ``(t, h, w)`` grids.
    """

    images: list[tuple[int, int]]
    pixels: list[tuple[int, int]]
    grids: list[tuple[tuple[int, ...], ...]]


def row_images(image_grid_thw: torch.Tensor, num_images: Sequence[int]) -> RowImages:
    """[`RowImages`] of a batch: ``image_grid_thw`` ``(num_images, 3)`` int (on the CPU), ``num_images`` one count
    per row; an image of grid ``(t, h, w)`` takes ``t·h·w`` rows of ``pixel_values``."""
    grids = [tuple(int(x) for x in grid) for grid in image_grid_thw.tolist()]
    images, pixels, row_grids = [], [], []
    image, pixel = 0, 0
    for count in num_images:
        own = grids[image : image + count]
        size = sum(t * h * w for t, h, w in own)
        images.append((image, image + count))
        pixels.append((pixel, pixel + size))
        row_grids.append(tuple(own))
        image, pixel = image + count, pixel + size
    if image != len(grids):
        raise ValueError(f"num_images counts {image} images but image_grid_thw has {len(grids)}")
    return RowImages(images, pixels, row_grids)


def image_keys(pixel_values: torch.Tensor, rows: RowImages, prompts: Sequence[Hashable]) -> list[int]:
    """One key per row, equal for two rows exactly when their prompts (``prompts``: one hashable per row, e.g. its
    token ids) and their images (grids and every pixel value) are equal: the rows that may share a prompt segment.

    Rows are compared only with rows of the same prompt and grids, each with its bucket's first row, on the device of
    ``pixel_values`` ``(Σ t·h·w, D)``: one host sync per round, one round when every bucket holds one group's rows.
    """
    keys = [-1] * len(prompts)
    buckets: dict[Any, list[int]] = {}
    for row, prompt in enumerate(prompts):
        buckets.setdefault((prompt, rows.grids[row]), []).append(row)
    pending = list(buckets.values())
    next_key = 0
    while pending:
        pairs: list[tuple[int, int]] = []
        for members in pending:
            keys[members[0]] = next_key
            next_key += 1
            pairs.extend((row, members[0]) for row in members[1:])
        same = _same_pixels(pixel_values, rows, pairs)
        rest: dict[int, list[int]] = {}
        for (row, first), equal in zip(pairs, same):
            if equal:
                keys[row] = keys[first]
            else:
                rest.setdefault(first, []).append(row)
        pending = list(rest.values())
    return keys


def _same_pixels(pixel_values: torch.Tensor, rows: RowImages, pairs: list[tuple[int, int]]) -> list[bool]:
    """Whether each pair of rows (of equal grids) has equal pixel values, with one host sync."""
    results: list[bool | torch.Tensor] = []
    for row, other in pairs:
        (start, end), (other_start, other_end) = rows.pixels[row], rows.pixels[other]
        same = end == start or (pixel_values[start:end] == pixel_values[other_start:other_end]).all()
        results.append(same)
    tensors = [result for result in results if isinstance(result, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [bool(next(values)) if isinstance(result, torch.Tensor) else result for result in results]


def pack_image_inputs(
    batch: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    rows: RowImages,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    mm_token_type_ids: torch.Tensor | None,
    positions: Any,
) -> dict[str, torch.Tensor]:
    """The vision inputs of the packed row ``batch`` (what :func:`~unpack_trainer.trainers.branched.pack_completions`
    made of ``input_ids`` / ``attention_mask`` ``(R, L)``, on the CPU).

    Args:
        batch: the packed batch (``packed_input_ids`` ``(1, T)``, ``packed_token_index`` ``(R, L)``, on the CPU).
        input_ids, attention_mask: TRL's ``(R, L)`` batch, on the CPU.
        logits_to_keep: ``C``, the completion columns.
        rows: the rows' images ([`row_images`] of these ``R`` rows, offsets into ``pixel_values`` /
            ``image_grid_thw``).
        pixel_values: ``(Σ t·h·w, D)`` every image of the whole batch (any device), or ``None``.
        image_grid_thw: ``(num_images, 3)`` int on the CPU, the whole batch's, or ``None``.
        mm_token_type_ids: ``(R, L)`` int on the CPU (0 text, 1 image, 2 video), or ``None``.
        positions: the model's :class:`~unpack_trainer.models.vision.SequencePositions`.

    Returns:
        ``packed_multimodal_position_ids`` ``(rows, 1, T)`` int64 and ``mm_token_type_ids`` ``(1, T)`` on the CPU;
        ``pixel_values`` (on its device) and ``image_grid_thw`` (CPU) of one row of each prompt segment, in the order
        of the segments, where the rows have images.
    """
    token_index = batch[TOKEN_INDEX_KEY]
    total = batch[PACKED_INPUT_IDS_KEY].shape[1]
    real = attention_mask.bool()
    flat = token_index[real]
    inputs: dict[str, Any] = {}
    out: dict[str, torch.Tensor] = {}
    if mm_token_type_ids is not None:
        packed_types = torch.zeros(1, total, dtype=mm_token_type_ids.dtype)
        packed_types[0, flat] = mm_token_type_ids[real]
        out["mm_token_type_ids"] = packed_types
        inputs["mm_token_type_ids"] = mm_token_type_ids
    first_image, last_image = rows.images[0][0], rows.images[-1][1]
    if image_grid_thw is not None and last_image > first_image:
        inputs["image_grid_thw"] = image_grid_thw[first_image:last_image]
    sequence = positions(input_ids, attention_mask.to(torch.int64), inputs)  # (rows, R, L)
    packed = torch.zeros(sequence.shape[0], 1, total, dtype=torch.int64)
    packed[:, 0, flat] = sequence[:, real].to(torch.int64)
    out[MULTIMODAL_POSITIONS_KEY] = packed
    if pixel_values is None or image_grid_thw is None or last_image == first_image:
        return out
    num_prompt = input_ids.shape[1] - int(logits_to_keep)
    prompt_lengths = real[:, :num_prompt].sum(1)
    firsts = token_index[torch.arange(len(rows.images)), num_prompt - prompt_lengths].tolist()
    segments: dict[int, int] = {}
    for row in sorted(range(len(firsts)), key=firsts.__getitem__):
        segments.setdefault(firsts[row], row)  # one row per prompt segment, in the order of the segments
    heads = [row for row in segments.values() if rows.images[row][1] > rows.images[row][0]]
    out["pixel_values"] = torch.cat([pixel_values[slice(*rows.pixels[row])] for row in heads])
    out["image_grid_thw"] = torch.cat([image_grid_thw[slice(*rows.images[row])] for row in heads])
    return out
