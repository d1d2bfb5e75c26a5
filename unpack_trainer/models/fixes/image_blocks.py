"""Image tokens that attend to each other both ways (Gemma 3), per sample on packed rows.

Gemma 3's multimodal model lets the tokens of one image attend to each other in both directions
(``token_type_ids`` 1 for image tokens; its ``get_block_sequence_ids_for_mask`` gives every image its own block id
and the mask an ``or`` of causal and same-block), everything else causally. On a packed row the packed attention
builds no mask, so the blocks travel on the batch's :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo` as
``bidirectional_spans``: a forward pre-hook on the multimodal model (after
:mod:`~unpack_trainer.models.fixes.vision_language`'s, which decided the packing) reads the model's own block ids of
``token_type_ids``, cuts them at every sample start (:func:`unpack_trainer.models.vision.image_block_spans`) and
replaces the decided metadata by one with those spans, in the decoder's state. Flex, SDPA and eager apply them
(with a window as Gemma 3's sliding layers do); the varlen kernels cannot and are not chosen (the attention feature
``bidirectional``).

Worked example (one row, samples of 5 and 4 tokens, an image of 2 tokens in each)::

    token_type_ids       [0 1 1 0 0 | 0 0 1 1]
    bidirectional_spans  [[1, 3], [7, 9]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.fixes.vision_language import carried_info, hook_multimodal_model, unhook_multimodal_model
from unpack_trainer.models.state import DecoderState
from unpack_trainer.models.vision import TOKEN_TYPES_KEY, find_vision_language, image_block_spans, is_vision_language
from unpack_trainer.packed_seq_info import INFO_KEY

__all__ = ["FIX"]


def _pre_hook(
    state: DecoderState, block_ids: Callable[..., torch.Tensor], module: torch.nn.Module, args: tuple, kwargs: dict
) -> None:
    info = carried_info(state)
    token_types = kwargs.get(TOKEN_TYPES_KEY)
    if info is None or token_types is None:
        return
    spanned = info.with_bidirectional_spans(image_block_spans(block_ids, token_types, info))
    if spanned is not info:
        state.carried[INFO_KEY] = spanned
        if state.running is info:
            state.running = spanned


def _applies(site: FixSite) -> str | None:
    if "vision_language" not in site.state.fixes or not is_vision_language(site.model):
        return None
    if find_vision_language(site.model).image_blocks is None:
        return None
    return "the tokens of each image attend to each other both ways (get_block_sequence_ids_for_mask), per sample"


def _install(site: FixSite) -> None:
    block_ids = find_vision_language(site.model).image_blocks
    hook_multimodal_model(site, "image_blocks", functools.partial(_pre_hook, site.state, block_ids))


def _remove(site: FixSite) -> None:
    unhook_multimodal_model(site, "image_blocks")


FIX = Fix("image_blocks", _applies, _install, _remove)
