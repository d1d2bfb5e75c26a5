"""A vision-language model's vision tower kept out of the packing; the packing decided once, before it runs, and handed
to the text decoder.

A vision-language model's *multimodal model* (``Qwen2_5_VLModel``, ``Gemma3Model``, ``LlavaModel``, ...: the module
that holds the text decoder and the vision tower, :func:`unpack_trainer.models.vision.find_vision_language`) hands its
keyword arguments on to its vision tower as well as to its text decoder. The vision tower's attention runs per image
(its own ``cu_seqlens``) and must stay exactly as stock, so the packing keywords must not reach it. A forward
pre-hook on the multimodal model takes them off the call (``packed_seq_info``, ``packed_seq_lengths``,
``packed_seq_parents``, ``cu_seq_lens_*``, ``max_length_*``), decides the packing with the one detector
(:func:`unpack_trainer.packed_seq_info.detect_packed`), and hands the decision to the text decoder's state, the one
channel: :attr:`~unpack_trainer.models.state.DecoderState.carried` (``packed_seq_info``, which the decoder hook adopts
and hands every layer as the keyword) and :attr:`~unpack_trainer.models.state.DecoderState.running` (which answers
the mask functions the multimodal model calls itself before its decoder runs: Gemma 3 builds its text model's masks;
not set when ``output_attentions`` sends attention down transformers' dense path, which a model that builds its text
masks itself cannot take on packed rows: refused with the reason). A packed batch's all-ones
``attention_mask`` is dropped (one that hides tokens is refused), ``use_cache`` defaults to ``False``, and a text
model of 1-D positions gets each sample's restarting positions where none are given. A post-hook (always called)
clears what was handed over. An unpacked forward (a padded batch, generation) runs exactly as stock.

Worked example: ``model(input_ids (1, 12), pixel_values, image_grid_thw, packed_seq_lengths=[9, 3])``: the vision
tower gets ``pixel_values`` and ``image_grid_thw`` as stock; the text decoder gets ``packed_seq_info`` (2 samples of
9 and 3 tokens) through its state, and no mask is built.

The multi-axis positions (:mod:`~unpack_trainer.models.fixes.multimodal_rope`) and the image blocks
(:mod:`~unpack_trainer.models.fixes.image_blocks`) of the same model follow this hook, installed after it on the same
module, and read the decision from the decoder's state.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from unpack_trainer._compat import cache_argument, cache_length, remove_hook
from unpack_trainer.models.discovery import builds_mask_with_transformers
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import DecoderState
from unpack_trainer.models.vision import find_vision_language, is_vision_language
from unpack_trainer.packed_seq_info import (
    CU_SEQ_LENS_K_KEY,
    CU_SEQ_LENS_Q_KEY,
    INFO_KEY,
    MAX_LENGTH_K_KEY,
    MAX_LENGTH_Q_KEY,
    METADATA_KEYS,
    SEQ_LENGTHS_KEY,
    SEQ_PARENTS_KEY,
    PackedSeqInfo,
    detect_packed,
    hides_nothing,
)

__all__ = ["FIX", "carried_info", "hook_multimodal_model", "unhook_multimodal_model"]


def carried_info(state: DecoderState) -> PackedSeqInfo | None:
    """The packing this fix's hook handed to the decoder for the forward now running, or ``None`` (not packed)."""
    return None if state.carried is None else state.carried.get(INFO_KEY)


def hook_multimodal_model(
    site: FixSite,
    name: str,
    pre_hook: Callable[..., Any],
    post_hook: Callable[..., Any] | None = None,
) -> None:
    """Register ``pre_hook`` (and ``post_hook``, always called) with keyword arguments on the multimodal model of
    ``site``'s vision-language model, for the fix ``name``; keep in ``site.state.undo[name]`` the module's name and
    the hook ids."""
    vision = find_vision_language(site.model)
    names = {module: qualified for qualified, module in site.model.named_modules()}
    module = vision.module
    ids = [module.register_forward_pre_hook(pre_hook, with_kwargs=True).id]
    if post_hook is not None:
        ids.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True).id)
    site.state.undo[name] = (names[module], ids)


def unhook_multimodal_model(site: FixSite, name: str) -> None:
    """Remove the hooks :func:`hook_multimodal_model` registered for the fix ``name``."""
    module_name, ids = site.state.undo.pop(name, ("", []))
    if ids:
        module = site.model.get_submodule(module_name)
        for hook_id in ids:
            remove_hook(module, hook_id)


@functools.cache
def _forward_parameters(cls: type) -> tuple[str, ...]:
    """The names ``cls.forward`` binds positional arguments to, after ``self`` (LLaVA-NeXT's outer model hands
    ``input_ids`` to its multimodal model positionally)."""
    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _wants_attention_weights(module: torch.nn.Module, kwargs: dict) -> bool:
    requested = kwargs.get("output_attentions")
    if requested is None:
        requested = getattr(module.config, "output_attentions", False)
    return bool(requested)


def _pre_hook(
    state: DecoderState, position_rows: int, builds_masks: bool, module: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    if args:
        kwargs = {**dict(zip(_forward_parameters(type(module)), args)), **kwargs}
        args = ()
    state.carried = None
    given = kwargs.pop(INFO_KEY, None)
    metadata = {key: kwargs.pop(key) for key in METADATA_KEYS if key in kwargs}
    input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    reference = input_ids if input_ids is not None else embeds
    if reference is None:
        return args, kwargs
    position_ids = kwargs.get("position_ids")
    cached = cache_length(cache_argument(kwargs))
    lengths, cu_q, max_q = (
        metadata.get(SEQ_LENGTHS_KEY),
        metadata.get(CU_SEQ_LENS_Q_KEY),
        metadata.get(MAX_LENGTH_Q_KEY),
    )
    info = detect_packed(
        reference.shape[0],
        reference.shape[1],
        packed_seq_lengths=lengths,
        packed_seq_parents=metadata.get(SEQ_PARENTS_KEY),
        cu_seq_lens_q=cu_q,
        max_length_q=max_q,
        position_ids=position_ids,
        attention_mask=kwargs.get("attention_mask"),
        cached=cached,
        packed_seq_info=given,
    )
    if info is None:
        return args, kwargs
    if given is None and (lengths is not None or cu_q is not None):
        cu_k = metadata.get(CU_SEQ_LENS_K_KEY)
        info.check_key_side(None if cu_k is cu_q else cu_k, metadata.get(MAX_LENGTH_K_KEY))
    if cached:
        raise ValueError(
            f"A packed batch cannot be run on top of a KV cache that already holds {cached} tokens; pass no "
            "`cache` / `past_key_values` (and `use_cache=False`) for packed training batches."
        )
    if not hides_nothing(kwargs.get("attention_mask")):
        raise ValueError(
            "A packed batch cannot also hide tokens with an `attention_mask`; make trailing padding a sample of its "
            "own and drop the mask."
        )
    kwargs["attention_mask"] = None
    if position_rows == 1 and position_ids is None:
        kwargs["position_ids"] = info.position_ids(reference.device)
    if kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    if not _wants_attention_weights(module, kwargs):
        state.running = info  # the mask functions the multimodal model calls before its decoder runs
    elif builds_masks:
        raise ValueError(
            f"output_attentions=True with a packed batch is not supported for {type(module).__name__}: it builds its "
            "text model's attention masks itself, before the text model can take transformers' dense path for packed "
            "rows; run the samples unpacked (or padded) to get attention weights."
        )
    state.carried = {INFO_KEY: info}
    return args, kwargs


def _post_hook(state: DecoderState, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    state.carried = None
    state.running, state.dense = None, False


def _applies(site: FixSite) -> str | None:
    if not site.state.attention or not is_vision_language(site.model):
        return None
    return (
        f"{type(site.model).__name__} hands its keyword arguments to its vision tower too: the packing is decided "
        "before it runs and handed to the text decoder only"
    )


def _install(site: FixSite) -> None:
    vision = find_vision_language(site.model)
    builds_masks = builds_mask_with_transformers(type(vision.module))  # Gemma 3 builds its text model's masks
    hook_multimodal_model(
        site,
        "vision_language",
        functools.partial(_pre_hook, site.state, vision.position_rows, builds_masks),
        functools.partial(_post_hook, site.state),
    )


def _remove(site: FixSite) -> None:
    unhook_multimodal_model(site, "vision_language")
    site.state.carried = None


FIX = Fix("vision_language", _applies, _install, _remove)
