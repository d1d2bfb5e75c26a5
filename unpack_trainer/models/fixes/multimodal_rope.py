"""Multi-axis RoPE (the Qwen2-VL family): every sample of a packed row gets the positions the model's own
``get_rope_index`` gives it alone.

The text model of a Qwen2-VL-style model rotates by several position axes (``mrope_section``): text tokens count
along all of them, an image's tokens by their temporal, height and width place in the image's grid. Its multimodal
model computes them from the row when no positions are given, which on a packed row counts the second sample on from
the first; restarting 1-D ``position_ids`` do not carry the image axes at all. A forward pre-hook on the multimodal
model (after :mod:`~unpack_trainer.models.fixes.vision_language`'s, which decided the packing) gives a packed batch,
in place of its ``position_ids``, each sample's own positions in the layout the text model takes
(:func:`unpack_trainer.anatomy.vision.multimodal_positions`): 4 rows ``[text; t; h; w]`` where the text model reads a
text row (``position_ids[0]``, restarting per sample), else 3 rows ``[t; h; w]``. Positions that already have that
layout are used as given, and so are the collator's (``packed_multimodal_position_ids``, computed ahead on the CPU
with :class:`~unpack_trainer.anatomy.vision.SamplePositions`, so the forward needs no host sync). 3 rows where 4 are
read, or 2-D positions other than the per-sample ``0, 1, 2, ...``, are refused with a ``ValueError``: each runs
without an error and contaminates (measured 0.29-0.43 logit error). A branched row (prompts shared by their
completions, :mod:`unpack_trainer.trainers.branched`) numbers every token as its full sequence ``[prompt; branch]``
alone: with images, from the collator's positions (:class:`~unpack_trainer.anatomy.vision.SequencePositions`, read from
each full sequence); text only, from the model's own ``get_rope_index`` over the row's branch units
(:meth:`~unpack_trainer.packed_seq_info.PackedSeqInfo.branch_units`); a branched image row without the collator's
positions is refused.

Worked example (two samples: 3 text tokens; 2 text + one image of a 2 x 2 grid merged to 1 token + 1 text)::

    text row  [0 1 2 | 0 1 2 3]
    t / h / w [0 1 2 | 0 1 2 3] for text, the image token at its grid position
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from unpack_trainer.anatomy.vision import (
    MM_TOKEN_TYPES_KEY,
    ROPE_INDEX_INPUTS,
    RopeIndex,
    find_vision_language,
    is_vision_language,
    multimodal_positions,
)
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.fixes.vision_language import carried_info, hook_multimodal_model, unhook_multimodal_model
from unpack_trainer.models.state import DecoderState
from unpack_trainer.packed_seq_info import MULTIMODAL_POSITIONS_KEY, PackedSeqInfo

__all__ = ["FIX"]


def _positions(
    module: torch.nn.Module,
    rope_index: RopeIndex,
    rows: int,
    kwargs: dict[str, Any],
    info: PackedSeqInfo,
    position_ids: torch.Tensor | None,
) -> torch.Tensor:
    """The multi-axis positions of a packed batch (see the module docstring)."""
    if position_ids is not None and position_ids.dim() == 3:
        if position_ids.shape[0] == rows:
            return position_ids
        raise ValueError(
            f"A packed batch of {type(module).__name__} has position_ids of {position_ids.shape[0]} rows; its text "
            f"model takes {rows} ({'[text; t; h; w]' if rows == 4 else '[t; h; w]'}) and would attend across "
            "samples with any other layout. Pass no position_ids (each sample's are computed from the model's own "
            "get_rope_index) or the full layout."
        )
    if position_ids is not None and not torch.equal(
        position_ids.detach().cpu().expand(info.batch_size, -1), info.position_ids()
    ):
        raise ValueError(
            f"A packed batch of {type(module).__name__} has 2-D position_ids other than each sample's own 0, 1, 2, "
            "...; its multimodal RoPE cannot be derived from them. Pass no position_ids (each sample's are computed "
            "from the model's own get_rope_index)."
        )
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError(
            f"A packed batch of {type(module).__name__} given as inputs_embeds needs its position_ids: the multimodal "
            "positions are computed from input_ids. Pass input_ids, or the 4-row position_ids."
        )
    inputs = {name: kwargs.get(name) for name in (MM_TOKEN_TYPES_KEY, *ROPE_INDEX_INPUTS)}
    has_images = any(kwargs.get(name) is not None for name in ("image_grid_thw", "video_grid_thw"))
    if info.is_branched:
        if has_images:
            raise ValueError(
                f"A packed batch of {type(module).__name__} with shared prompts and images needs each full "
                f"sequence's positions with it (`{MULTIMODAL_POSITIONS_KEY}`, from its collator: "
                "unpack_trainer.anatomy.vision.SequencePositions); a branch continues its prompt's image positions."
            )
        return _branched_positions(rope_index, input_ids, info, inputs, rows)
    if has_images and rope_index.accepts(MM_TOKEN_TYPES_KEY) and inputs[MM_TOKEN_TYPES_KEY] is None:
        raise ValueError(
            f"A packed batch of {type(module).__name__} with images needs `{MM_TOKEN_TYPES_KEY}` (the processor "
            "returns them) to compute each sample's multimodal positions; without them the model itself falls back "
            "to text positions for the image tokens."
        )
    return multimodal_positions(rope_index, input_ids, info, inputs, rows=rows)


def _branched_positions(
    rope_index: RopeIndex, input_ids: torch.Tensor, info: PackedSeqInfo, inputs: dict[str, Any], rows: int
) -> torch.Tensor:
    """``(rows, B, T)`` int64: the positions of a branched text batch (shared prompts, no image), every token's as
    the model's ``get_rope_index`` numbers its full sequence ``[prompt; branch]`` alone. The full sequences are the
    batch's attention units (:meth:`PackedSeqInfo.branch_units`: each branch with its prompt gathered in front), run
    through :func:`multimodal_positions` as plain samples; each token reads its positions from the slot that owns
    it (a prompt token from its first unit)."""
    unit_info, gather, owner = info.branch_units()
    device = input_ids.device
    gather, owner = gather.to(device), owner.to(device)
    unit_ids = input_ids.reshape(-1).index_select(0, gather).unsqueeze(0)
    unit_inputs = {
        name: value.reshape(-1).index_select(0, gather).unsqueeze(0)
        if isinstance(value, torch.Tensor) and value.shape == input_ids.shape
        else value
        for name, value in inputs.items()
    }
    positions = multimodal_positions(rope_index, unit_ids, unit_info, unit_inputs, rows=rows)
    return positions[:, 0].index_select(1, owner).reshape(rows, *input_ids.shape)


def _pre_hook(
    state: DecoderState, rope_index: RopeIndex, rows: int, module: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    ahead = kwargs.pop(MULTIMODAL_POSITIONS_KEY, None)  # the collator's, computed with the batch
    info = carried_info(state)
    if info is None:
        return args, kwargs
    position_ids = kwargs.get("position_ids")
    if ahead is not None and (position_ids is None or position_ids.dim() == 2):
        position_ids = ahead
    kwargs["position_ids"] = _positions(module, rope_index, rows, kwargs, info, position_ids)
    return args, kwargs


def _applies(site: FixSite) -> str | None:
    if "vision_language" not in site.state.fixes or not is_vision_language(site.model):
        return None
    rows = find_vision_language(site.model, site.structure).position_rows
    if rows == 1:
        return None
    return (
        f"its text model rotates by several position axes ({rows} rows of position_ids): each sample's from the "
        "model's own get_rope_index"
    )


def _install(site: FixSite) -> None:
    vision = find_vision_language(site.model, site.structure)
    pre_hook = functools.partial(_pre_hook, site.state, RopeIndex(vision.module), vision.position_rows)
    hook_multimodal_model(site, "multimodal_rope", pre_hook)


def _remove(site: FixSite) -> None:
    unhook_multimodal_model(site, "multimodal_rope")


FIX = Fix("multimodal_rope", _applies, _install, _remove)
