"""Image prompts shared by a group of completions: TRL's vision inputs of a GRPO / RLOO batch laid out for its packed
row (:func:`unpack_trainer.trainers.branched.pack_completions`), each group's images once.

TRL 1.16's ``GRPOTrainer`` / ``RLOOTrainer`` repeat an image prompt once per completion: the ``(R, P + C)`` batch of
their log-prob forwards comes with every row's vision tensors, one row's after another along dimension 0, in the
layout of the model's family, and with per-token keys ``(R, P + C)`` (``mm_token_type_ids``, ``token_type_ids``).
TRL's ``_get_per_token_logps_and_entropies`` tells the layouts apart to cut its chunks of rows; [`row_slices`] reads
them the same way, in the same order:

- ``image_grid_thw`` (the Qwen2-VL family): an image of grid ``(t, h, w)`` takes ``t·h·w`` rows of
  ``pixel_values``, ``num_images[r]`` images per row;
- ``image_position_ids``: ``pixel_values`` and ``image_position_ids`` one entry per image;
- ``spatial_shapes`` (LFM2-VL): ``pixel_values``, ``pixel_attention_mask`` and ``spatial_shapes`` one entry per tile,
  ``num_tiles[r]`` per row; ``num_tiles`` alone (InternVL): ``pixel_values`` per tile;
- ``pixel_values`` one entry per image (LLaVA, Gemma 3: ``pixel_values.size(0) == sum(num_images)``), else one per
  row (Idefics3, SmolVLM: ``(R, max_images, C, H, W)``); ``pixel_attention_mask`` (without ``spatial_shapes``) one
  per row; ``image_sizes`` one per image.

On the packed row each prompt appears once, so each group's vision tensors are handed to the model once: the rows of a
group are those with equal prompt token ids **and** equal vision entries ([`image_keys`]: two prompts of the same
text and image size differ only in their pixels), and the packed row's vision tensors hold one row's entries per
prompt segment, in the order of the segments, which is the order of the image tokens on the row
([`pack_image_inputs`]); the per-token keys are read into the packed row. A text model of multi-axis positions (the
Qwen2-VL family) numbers each token as the model's own ``get_rope_index`` numbers its full sequence ``[prompt;
completion]`` alone, computed on TRL's padded batch (each row from its first real token) and read into the packed row
through ``packed_token_index`` (:class:`unpack_trainer.anatomy.vision.SequencePositions`); any other takes the packed
row's 1-D positions, which restart at 0 per prompt and continue it in each branch. Either way a branch continues its
prompt exactly as its full sequence alone. A vision input of no layout above is named by [`row_slices`], and the
forward runs TRL's padded batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unpack_trainer.packed_seq_info import MULTIMODAL_POSITIONS_KEY, PACKED_INPUT_IDS_KEY, TOKEN_INDEX_KEY

__all__ = ["PER_TOKEN_INPUTS", "RowSlices", "image_keys", "pack_image_inputs", "row_slices"]

# TRL's per-token vision inputs, ``(R, L)`` like ``input_ids``: read into the packed row.
PER_TOKEN_INPUTS = ("mm_token_type_ids", "token_type_ids")
# The counts TRL passes beside the tensors, per row: how many images (tiles) each row has.
_COUNTS = ("num_images", "num_tiles")


@dataclass(frozen=True)
class RowSlices:
    """Where each row's entries lie in TRL's vision tensors.

    Attributes:
        slices: per vision tensor name, per row, its ``[start, end)`` along dimension 0.
    """

    slices: dict[str, list[tuple[int, int]]]

    def rows(self, start: int, end: int) -> RowSlices:
        """The slices of rows ``start:end``."""
        return RowSlices({name: spans[start:end] for name, spans in self.slices.items()})

    def span(self, name: str) -> tuple[int, int]:
        """``[start, end)`` of every row of these slices together (they are consecutive) in tensor ``name``."""
        spans = self.slices[name]
        return (spans[0][0], spans[-1][1]) if spans else (0, 0)


def _offsets(counts: Sequence[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for count in counts:
        spans.append((start, start + int(count)))
        start += int(count)
    return spans


def row_slices(vision: dict[str, Any], rows: int) -> RowSlices | str:
    """Each row's ``[start, end)`` in every vision tensor of ``vision`` (TRL's keyword arguments of a log-prob
    forward over ``rows`` rows that are not ``None``; ``image_grid_thw`` ``(num_images, 3)`` int is read on the host),
    in TRL's layouts (see the module docstring); or why they cannot be laid out per row (a string).

    Example (LLaVA: 3 rows, the second without an image)::

        row_slices({"pixel_values": pixels (2, 3, 8, 8), "num_images": [1, 0, 1]}, 3).slices
        {"pixel_values": [(0, 1), (1, 1), (1, 2)]}
    """
    num_images, num_tiles = vision.get("num_images"), vision.get("num_tiles")
    pixel_values = vision.get("pixel_values")
    counts: dict[str, Sequence[int]] = {}
    per_row = [1] * rows

    def per_image(*names: str) -> None:
        counts.update({name: num_images for name in names if vision.get(name) is not None})

    if pixel_values is not None:
        grid = vision.get("image_grid_thw")
        if grid is not None:
            if num_images is None:
                return "its pixel_values come with image_grid_thw but without num_images, which say whose they are"
            sizes = grid.detach().cpu().prod(dim=-1).tolist()
            ends = [end for _, end in _offsets(num_images)]
            counts["pixel_values"] = [sum(sizes[a:b]) for a, b in zip([0, *ends[:-1]], ends)]
            per_image("image_grid_thw")
        elif vision.get("image_position_ids") is not None:
            per_image("pixel_values", "image_position_ids")
        elif vision.get("spatial_shapes") is not None:
            if num_tiles is None:
                return "its tiles (spatial_shapes) come without num_tiles, which say whose they are"
            counts.update({n: num_tiles for n in ("pixel_values", "pixel_attention_mask", "spatial_shapes")})
        elif num_tiles is not None:
            counts["pixel_values"] = num_tiles
        elif num_images is not None and pixel_values.shape[0] == sum(num_images):
            per_image("pixel_values")
        else:
            counts["pixel_values"] = per_row
    if vision.get("pixel_attention_mask") is not None and vision.get("spatial_shapes") is None:
        counts["pixel_attention_mask"] = per_row
    if vision.get("image_sizes") is not None:
        per_image("image_sizes")
    known = set(counts) | set(_COUNTS) | set(PER_TOKEN_INPUTS)
    other = sorted(name for name, value in vision.items() if value is not None and name not in known)
    if other:
        return f"its vision inputs {', '.join(other)} are not laid out the way TRL's log-prob forward cuts its rows"
    slices = {}
    for name, per in counts.items():
        if per is None:
            return f"its {name} comes without num_images, which say whose images they are"
        if len(per) != rows or sum(per) != vision[name].shape[0]:
            return (
                f"its {name} ({vision[name].shape[0]} entries) does not hold {list(per)} entries for its {rows} rows"
            )
        slices[name] = _offsets(per)
    return RowSlices(slices)


def image_keys(vision: dict[str, Any], slices: RowSlices, prompts: Sequence[Hashable]) -> list[int]:
    """One key per row, equal for two rows exactly when their prompts (``prompts``: one hashable per row, e.g. its
    token ids) and their entries of every vision tensor of ``slices`` (shapes and values) are equal: the rows that may
    share a prompt segment.

    Rows are compared only with rows of the same prompt and entry shapes, each with its bucket's first row, on the
    device of the tensors: one host sync per round, one round when every bucket holds one group's rows.
    """

    def shapes(row: int) -> tuple:
        return tuple(tuple(vision[name][slice(*spans[row])].shape) for name, spans in slices.slices.items())

    keys = [-1] * len(prompts)
    buckets: dict[Any, list[int]] = {}
    for row, prompt in enumerate(prompts):
        buckets.setdefault((prompt, shapes(row)), []).append(row)
    pending = list(buckets.values())
    next_key = 0
    while pending:
        pairs: list[tuple[int, int]] = []
        for members in pending:
            keys[members[0]] = next_key
            next_key += 1
            pairs.extend((row, members[0]) for row in members[1:])
        same = _same_entries(vision, slices, pairs)
        rest: dict[int, list[int]] = {}
        for (row, first), equal in zip(pairs, same):
            if equal:
                keys[row] = keys[first]
            else:
                rest.setdefault(first, []).append(row)
        pending = list(rest.values())
    return keys


def _same_entries(vision: dict[str, Any], slices: RowSlices, pairs: list[tuple[int, int]]) -> list[bool]:
    """Whether each pair of rows (of equal entry shapes) has equal entries in every vision tensor, one host sync."""
    results: list[torch.Tensor | bool] = []
    for row, other in pairs:
        same: torch.Tensor | bool = True
        for name, spans in slices.slices.items():
            (start, end), (other_start, other_end) = spans[row], spans[other]
            if end > start:
                equal = torch.equal if vision[name].device.type == "cpu" else _all_equal
                same = same & equal(vision[name][start:end], vision[name][other_start:other_end])
        results.append(same)
    tensors = [result for result in results if isinstance(result, torch.Tensor)]
    values = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    return [bool(next(values)) if isinstance(result, torch.Tensor) else result for result in results]


def _all_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a == b).all()`` as a device tensor (no host sync)."""
    return (a == b).all()


def pack_image_inputs(
    batch: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    vision: dict[str, Any],
    slices: RowSlices,
    per_token: dict[str, torch.Tensor],
    positions: Any,
) -> dict[str, torch.Tensor]:
    """The vision inputs of the packed row ``batch`` (what :func:`~unpack_trainer.trainers.branched.pack_completions`
    made of ``input_ids`` / ``attention_mask`` ``(R, L)``, on the CPU).

    Args:
        batch: the packed batch (``packed_input_ids`` ``(1, T)``, ``packed_token_index`` ``(R, L)``, on the CPU).
        input_ids, attention_mask: TRL's ``(R, L)`` batch, on the CPU.
        logits_to_keep: ``C``, the completion columns.
        vision: TRL's vision tensors of the whole forward (any device), by name.
        slices: these ``R`` rows' entries in them ([`row_slices`], [`RowSlices.rows`]).
        per_token: these rows' per-token keys ``(R, L)`` int on the CPU (``mm_token_type_ids``, ``token_type_ids``).
        positions: the model's :class:`~unpack_trainer.anatomy.vision.SequencePositions`, or ``None`` for a text model
            of 1-D positions (the packed row's own).

    Returns:
        Each per-token key ``(1, T)`` on the CPU; with ``positions``, ``packed_multimodal_position_ids``
        ``(rows, 1, T)`` int64 on the CPU; every vision tensor of ``slices`` (on its device) holding the entries of one
        row of each prompt segment, in the order of the segments.
    """
    token_index = batch[TOKEN_INDEX_KEY]
    total = batch[PACKED_INPUT_IDS_KEY].shape[1]
    real = attention_mask.bool()
    flat = token_index[real]
    out: dict[str, torch.Tensor] = {}
    for name, value in per_token.items():
        packed = torch.zeros(1, total, dtype=value.dtype)
        packed[0, flat] = value[real]
        out[name] = packed
    if positions is not None:
        inputs = {name: vision[name][slice(*slices.span(name))] for name in slices.slices}
        sequence = positions(input_ids, attention_mask.to(torch.int64), {**inputs, **per_token})  # (rows, R, L)
        packed = torch.zeros(sequence.shape[0], 1, total, dtype=torch.int64)
        packed[:, 0, flat] = sequence[:, real].to(torch.int64)
        out[MULTIMODAL_POSITIONS_KEY] = packed
    if not slices.slices:
        return out
    num_prompt = input_ids.shape[1] - int(logits_to_keep)
    prompt_lengths = real[:, :num_prompt].sum(1)
    firsts = token_index[torch.arange(input_ids.shape[0]), num_prompt - prompt_lengths].tolist()
    segments: dict[int, int] = {}
    for row in sorted(range(len(firsts)), key=firsts.__getitem__):
        segments.setdefault(firsts[row], row)  # one row per prompt segment, in the order of the segments
    heads = list(segments.values())
    for name, spans in slices.slices.items():
        out[name] = torch.cat([vision[name][slice(*spans[row])] for row in heads])
    return out
