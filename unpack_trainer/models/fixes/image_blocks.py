"""Image tokens that attend to each other both ways (Gemma 3, Gemma 4), per sample on packed rows.

Gemma 3's multimodal model lets the tokens of one image attend to each other in both directions
(``token_type_ids`` 1 for image tokens; its ``get_block_sequence_ids_for_mask`` gives every image its own block id
and the mask an ``or`` of causal and same-block) on every layer, everything else causally; Gemma 4's does the same from
``mm_token_type_ids`` where its text config's ``use_bidirectional_attention`` is ``"vision"`` (its larger models), on
its sliding-window layers only (its full-attention layers stay causal). On a packed row the packed attention
builds no mask, so the blocks travel on the batch's :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo` as
``bidirectional_spans``: a forward pre-hook on the multimodal model (after
:mod:`~unpack_trainer.models.fixes.vision_language`'s, which decided the packing) reads the model's own block ids of
the token types its function takes (:func:`unpack_trainer.anatomy.vision.image_block_key`), cuts them at every sample
start (:func:`unpack_trainer.anatomy.vision.image_block_spans`) and replaces the decided metadata by one with those
spans, in the decoder's state. Which layers apply them is read from the model's own mask builder
(:func:`unpack_trainer.anatomy.vision.image_block_layer_types`); the attention modules of the other layers are marked
(:attr:`~unpack_trainer.models.state.AttentionState.image_blocks`) and get the samples without spans
(:meth:`~unpack_trainer.packed_seq_info.PackedSeqInfo.without_bidirectional_spans`). Flex, SDPA and eager apply the
spans (with a window as the sliding layers do); the varlen kernels cannot and are not chosen (the attention feature
``bidirectional``).

Under sequence parallelism (a row cut into shards, DeepSpeed Ulysses) the attention of every process sees the whole row
(for its share of the heads): the spans are the whole row's, read from its whole token types (which
:mod:`~unpack_trainer.models.fixes.vision_language` hands on whole), and the model then gets its shard's slice of them.

Worked example (one row, samples of 5 and 4 tokens, an image of 2 tokens in each)::

    token_type_ids       [0 1 1 0 0 | 0 0 1 1]
    bidirectional_spans  [[1, 3], [7, 9]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from unpack_trainer.anatomy.vision import (
    find_vision_language,
    image_block_layer_types,
    image_block_spans,
    is_vision_language,
    sequence_shard,
)
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.fixes.vision_language import carried_info, hook_multimodal_model, unhook_multimodal_model
from unpack_trainer.models.state import DecoderState, attention_state
from unpack_trainer.packed_seq_info import INFO_KEY

__all__ = ["FIX"]


def _pre_hook(
    state: DecoderState,
    block_ids: Callable[..., torch.Tensor],
    key: str,
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
) -> tuple[tuple, dict] | None:
    info = carried_info(state)
    token_types = kwargs.get(key)
    if info is None or token_types is None:
        return None
    spanned = info.with_bidirectional_spans(image_block_spans(block_ids, token_types, info))
    if spanned is not info:
        state.carried[INFO_KEY] = spanned
        if state.running is info:
            state.running = spanned
    reference = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    span = None if reference is None else sequence_shard(info, reference.shape[1])
    if span is None:
        return None
    kwargs[key] = token_types[..., span[0] : span[1]].to(reference.device)  # the shard's, for the model's own use
    return args, kwargs


def _layer_type(module: torch.nn.Module, config: object) -> str | None:
    """The layer type of the attention module ``module`` (its ``layer_type``, or ``config.layer_types`` at its
    ``layer_idx``), ``None`` where neither tells."""
    layer_type = getattr(module, "layer_type", None)
    if layer_type is not None:
        return layer_type
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    return types[index] if types is not None and isinstance(index, int) and index < len(types) else None


def _applies(site: FixSite) -> str | None:
    if "vision_language" not in site.state.fixes or not is_vision_language(site.model):
        return None
    if find_vision_language(site.model, site.structure).image_blocks is None:
        return None
    return "the tokens of each image attend to each other both ways (get_block_sequence_ids_for_mask), per sample"


def _install(site: FixSite) -> None:
    vision = find_vision_language(site.model, site.structure)
    layer_types = image_block_layer_types(vision.module)
    if layer_types is not None:
        for attention in site.decoder.attention:
            if _layer_type(attention, site.module.config) not in layer_types:
                attention_state(attention).image_blocks = False
    pre_hook = functools.partial(_pre_hook, site.state, vision.image_blocks, vision.image_block_key)
    hook_multimodal_model(site, "image_blocks", pre_hook)


def _remove(site: FixSite) -> None:
    unhook_multimodal_model(site, "image_blocks")
    for module in site.module.modules():
        state = attention_state(module)
        if state is not None:
            state.image_blocks = True


FIX = Fix("image_blocks", _applies, _install, _remove)
