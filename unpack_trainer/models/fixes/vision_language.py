"""A vision-language model's vision tower kept out of the packing; the packing decided once, before it runs, and handed
to the text decoder.

A vision-language model's *multimodal model* (``Qwen2_5_VLModel``, ``Gemma3Model``, ``LlavaModel``, ...: the module
that holds the text decoder and the vision tower, :func:`unpack_trainer.anatomy.vision.find_vision_language`) hands its
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

Under sequence parallelism (DeepSpeed Ulysses, a row cut into ``N`` shards, ``packed_seq_info.sequence_shards == N``)
a process's forward holds ``input_ids`` / ``position_ids`` of its shard only, and the whole row's other inputs come
whole (``packed_vision_inputs``, :class:`~unpack_trainer.data.vision.WholeRowInputs`). This hook gives the model
the shard's part of them (:func:`_shard_inputs`): the image features of the shard's image tokens as
``mm_encoder_outputs`` (the model's own ``get_image_features`` on the images with a token in the shard, cut to those
tokens: :func:`~unpack_trainer.anatomy.vision.shard_image_features`; the model scatters them itself), the shard's
per-token keys and multi-axis positions; the key the image blocks are read from stays whole, for the image-blocks hook
to read the whole row's spans. A forward of the whole row (evaluation) gets the whole row's inputs back as the
collator built them. DeepSpeed replaces the attention function of the model's implementation name process-wide with
its wrapper, which would cut a vision tower's patches like a row: the vision tower's attention modules run, while a
sequence-parallel group exists, the function transformers registers under that name (:func:`_vision_attention_hooks`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from unpack_trainer._compat import (
    attention_functions,
    cache_argument,
    cache_length,
    remove_hook,
    sequence_parallel_group,
)
from unpack_trainer.anatomy.structure import builds_mask_with_transformers, uses_attention_interface
from unpack_trainer.anatomy.vision import (
    VisionLanguage,
    find_vision_language,
    is_vision_language,
    sequence_shard,
    shard_image_features,
)
from unpack_trainer.data.vision import PER_TOKEN_KEYS, WHOLE_ROW_KEY, WholeRowInputs
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import DecoderState
from unpack_trainer.packed_seq_info import (
    CU_SEQ_LENS_K_KEY,
    CU_SEQ_LENS_Q_KEY,
    INFO_KEY,
    MAX_LENGTH_K_KEY,
    MAX_LENGTH_Q_KEY,
    METADATA_KEYS,
    MULTIMODAL_POSITIONS_KEY,
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
    vision = find_vision_language(site.model, site.structure)
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


def _shard_inputs(
    module: torch.nn.Module, vision: VisionLanguage, whole: Any, info: PackedSeqInfo, kwargs: dict
) -> None:
    """Put into ``kwargs`` what the forward of ``module`` (the multimodal model) takes of the whole row's inputs
    ``whole`` (:class:`~unpack_trainer.data.vision.WholeRowInputs`): all of them for a forward of the whole row; for
    one shard of it, the image features of its image tokens (``mm_encoder_outputs``), its slice of each per-token key
    (the image-block key whole) and of the multi-axis positions."""
    if not isinstance(whole, WholeRowInputs):
        raise ValueError(f"`{WHOLE_ROW_KEY}` must be a WholeRowInputs, got {type(whole).__name__}.")
    inputs = whole.inputs
    reference = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    device, length = reference.device, reference.shape[1]
    span = sequence_shard(info, length)
    if span is not None and vision.position_rows > 1 and MULTIMODAL_POSITIONS_KEY not in inputs:
        raise ValueError(
            f"A packed row of {type(module).__name__} cut for sequence parallelism needs each sample's multi-axis "
            f"positions with it (`{MULTIMODAL_POSITIONS_KEY}`, from its collator: "
            "unpack_trainer.anatomy.vision.SamplePositions); a shard cannot compute them from its own tokens."
        )
    for key, value in inputs.items():
        if key == "input_ids":
            continue
        per_token = key in PER_TOKEN_KEYS or key == MULTIMODAL_POSITIONS_KEY  # along the row, its last dim
        if span is not None and not per_token:
            continue  # a vision input: the shard's image features replace it (below)
        if span is not None and key == vision.image_block_key:
            kwargs[key] = value  # whole and on the host: the image-blocks hook reads its spans, then cuts it
            continue
        if span is not None:
            value = value[..., span[0] : span[1]]
        kwargs[key] = value.to(device) if isinstance(value, torch.Tensor) else value
    if span is not None:
        features = shard_image_features(module, inputs, span[0], span[1], device)
        if features is not None:
            kwargs["mm_encoder_outputs"] = features


def _refuse_shard_without_row(module: torch.nn.Module, vision: VisionLanguage, kwargs: dict) -> None:
    """A forward of one shard of a packed row without the whole row's inputs (``packed_vision_inputs``): exact only
    for text rows of a model with plain positions; ``ValueError`` otherwise (its image features or multi-axis
    positions would be laid out over the whole row)."""
    images = [key for key in ("pixel_values", "pixel_values_videos") if kwargs.get(key) is not None]
    if images or vision.position_rows > 1:
        what = f"its {' and '.join(images)}" if images else "its multi-axis positions"
        raise ValueError(
            f"A shard of a packed row of {type(module).__name__} (sequence parallelism) came without the whole "
            f"row's inputs (`{WHOLE_ROW_KEY}`, from DataCollatorForVisionPacking(sequence_shards=N)): {what} would be "
            "laid out over the whole row. Only SFT's packing cuts vision-language rows for sequence parallelism."
        )


def _pre_hook(
    state: DecoderState,
    vision: VisionLanguage,
    builds_masks: bool,
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
) -> tuple[tuple, dict]:
    if args:
        kwargs = {**dict(zip(_forward_parameters(type(module)), args)), **kwargs}
        args = ()
    state.carried = None
    whole = kwargs.pop(WHOLE_ROW_KEY, None)
    given = kwargs.pop(INFO_KEY, None)
    metadata = {key: kwargs.pop(key) for key in METADATA_KEYS if key in kwargs}
    input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    reference = input_ids if input_ids is not None else embeds
    if reference is None:
        if whole is not None:
            raise ValueError(f"`{WHOLE_ROW_KEY}` came without the row's input_ids or inputs_embeds.")
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
        if whole is not None:
            raise ValueError(
                f"`{WHOLE_ROW_KEY}` (a packed row's inputs cut for sequence parallelism) came without its packing "
                f"metadata (`{INFO_KEY}`)."
            )
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
    if whole is not None:
        _shard_inputs(module, vision, whole, info, kwargs)
    elif info.sequence_shards > 1 and reference.shape[1] != info.seq_len:
        _refuse_shard_without_row(module, vision, kwargs)
    if vision.position_rows == 1 and position_ids is None:
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


class _VisionAttention:
    """Forward hooks on a vision tower's attention module: while a DeepSpeed sequence-parallel group exists, the
    module's call of its implementation name (``config._attn_implementation``) reaches the function transformers
    registers under it, not DeepSpeed's wrapper, which replaced it process-wide (``register_with_transformers``) and
    would all-to-all the image patches as if they were a shard of the row. The same computation as stock: the
    vision tower's attention is no part of the packing. The function in place is put back after the call (a
    recomputed layer under gradient checkpointing calls the module, and these hooks, again)."""

    def __init__(self) -> None:
        self.replaced: list[tuple[str, Any]] = []

    def before(self, module: torch.nn.Module, args: tuple) -> None:
        self.replaced.append(("", None))
        if "deepspeed" not in sys.modules or sequence_parallel_group() is None:
            return
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name = getattr(module.config, "_attn_implementation", None)
        original = attention_functions().get(name)
        if original is None:
            return
        current = ALL_ATTENTION_FUNCTIONS[name]
        if current is not original:
            ALL_ATTENTION_FUNCTIONS[name] = original
            self.replaced[-1] = (name, current)

    def after(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self.replaced:
            return
        name, current = self.replaced.pop()
        if name:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            ALL_ATTENTION_FUNCTIONS[name] = current


def _vision_attention_hooks(vision: VisionLanguage) -> list[tuple[torch.nn.Module, list[int]]]:
    """:class:`_VisionAttention`'s hooks on every attention module of the multimodal model outside its text decoder
    (its vision tower's, a projector's), found as the modules whose class calls transformers' attention interface."""
    inside = {id(module) for module in vision.decoder.modules()}
    hooked = []
    for module in vision.module.modules():
        if id(module) in inside or getattr(module, "config", None) is None:
            continue
        if not uses_attention_interface(type(module)):
            continue
        hooks = _VisionAttention()
        ids = [
            module.register_forward_pre_hook(hooks.before).id,
            module.register_forward_hook(hooks.after, always_call=True).id,
        ]
        hooked.append((module, ids))
    return hooked


def _applies(site: FixSite) -> str | None:
    if not site.state.attention or not is_vision_language(site.model):
        return None
    return (
        f"{type(site.model).__name__} hands its keyword arguments to its vision tower too: the packing is decided "
        "before it runs and handed to the text decoder only"
    )


def _install(site: FixSite) -> None:
    vision = find_vision_language(site.model, site.structure)
    builds_masks = builds_mask_with_transformers(type(vision.module))  # Gemma 3 builds its text model's masks
    hook_multimodal_model(
        site,
        "vision_language",
        functools.partial(_pre_hook, site.state, vision, builds_masks),
        functools.partial(_post_hook, site.state),
    )
    names = {module: qualified for qualified, module in site.model.named_modules()}
    site.state.undo["vision_attention"] = [(names[module], ids) for module, ids in _vision_attention_hooks(vision)]


def _remove(site: FixSite) -> None:
    unhook_multimodal_model(site, "vision_language")
    for module_name, ids in site.state.undo.pop("vision_attention", []):
        module = site.model.get_submodule(module_name)
        for hook_id in ids:
            remove_hook(module, hook_id)
    site.state.carried = None


FIX = Fix("vision_language", _applies, _install, _remove)
