"""The patch: what :func:`patch_model` installs on a model, and how :func:`unpatch_model` takes it off.

The model is first checked (:func:`unpack_trainer.models.refusals.check_model`: what it is made of, and whether it can
be packed exactly). Then, on each decoder:

- its state (:class:`~unpack_trainer.models.state.DecoderState`), and on each of its attention modules an
  :class:`~unpack_trainer.models.state.AttentionState`: everything the patch keeps, under one attribute;
- the routing (:mod:`unpack_trainer.models.routing`): under the model's attention implementation ("sdpa", "eager",
  "flash_attention_2", ...) transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` take packed batches to
  :mod:`unpack_trainer.patches.attention` with no ``(T, T)`` mask built; every other batch (a padded batch with
  ``attention_mask``, generation with any KV cache) runs the implementation exactly as before.
  ``model.set_attn_implementation(...)`` after patching is followed, ``config.output_attentions = True`` works where
  it works unpatched (packed batches then take transformers' own exact path, which returns the weights), and a
  copied or pickled patched model routes its implementation again on its first forward;
- each token mixer patched by the handler that owns it (:mod:`unpack_trainer.models.mixers`);
- the model-family fixes that apply (:mod:`unpack_trainer.models.fixes`: a window applied through the mask only,
  llama4's chunks and temperature, bloom's and mpt's ALiBi, RoBERTa-style positions, the fused RoPE, a sequence
  classifier's score per packed sequence, ...);
- the decoder hooks (:mod:`unpack_trainer.models.packed_forward`): once per forward they decide whether the batch is
  packed and hand its :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo` to every layer. ``output_attentions=True``
  on a packed batch is refused where transformers' dense path would not be exact (ALiBi over the whole row, a decoder
  that builds its mask without ``position_ids`` such as BERT's): a ``ValueError``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from unpack_trainer._compat import attention_implementation, remove_hook, set_attention_implementation
from unpack_trainer.anatomy.attention import attention_features
from unpack_trainer.anatomy.structure import Decoder, ModelStructure, mask_without_positions, pretrained_model
from unpack_trainer.models import fixes
from unpack_trainer.models.fixes import FixSite
from unpack_trainer.models.mixers import handler_for, handler_named
from unpack_trainer.models.packed_forward import decoder_post_hook, decoder_pre_hook
from unpack_trainer.models.refusals import check_model
from unpack_trainer.models.routing import release_route, route
from unpack_trainer.models.state import PATCH_ATTRIBUTE, AttentionState, DecoderState, decoder_state

if TYPE_CHECKING:
    from unpack_trainer.patches.attention import BackendChoice, Needs

__all__ = [
    "install_fix",
    "is_patched",
    "patch_model",
    "resolve_backend",
    "supported_model_types",
    "unpatch_model",
]

logger = logging.getLogger("unpack_trainer.models")


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values verified on the fast packed path with the installed transformers, sorted.

    Each one passed the generated coverage check (``tests/models/test_coverage.py``): a tiny model of that type is
    patched, its packed logits equal each sample run alone and its loss and every gradient equal a padded batch, on
    SDPA and eager, with no ``(T, T)`` mask built; for a vision-language family, with images in its samples
    (``check_vision_type`` of ``tools/model_coverage.py``). Other types may still patch (the patch is generic);
    the trainer's self-check guards them.
    """
    from unpack_trainer.models.verified import verified_model_types, verified_vision_model_types

    return sorted(verified_model_types() | verified_vision_model_types())


def _patch_decoder(
    structure: ModelStructure,
    decoder: Decoder,
    *,
    attention: bool,
    rope: bool,
    compiled: bool,
    features: Needs,
) -> FixSite:
    """Patch one decoder of the model ``structure`` describes, its attention modules and token mixers (the fixes
    follow, for all decoders at once); ``features``: the model's [`~unpack_trainer.anatomy.attention.attention_features`], read once for all its
    decoders."""
    module = decoder.module
    if attention_implementation(module.config) is None:
        # what transformers runs for None, under a name the routing can use
        set_attention_implementation(module.config, "eager")
    state = DecoderState(
        structure.model_type,
        attention_implementation(module.config),
        attention,
        rope,
        config=module.config,
        compiled=compiled,
        features=features,
    )
    module.__dict__[PATCH_ATTRIBUTE] = state
    for layer in decoder.attention:
        layer.__dict__[PATCH_ATTRIBUTE] = AttentionState(state)
    if attention:
        route(state.implementation, module, state)
    for mixer in decoder.mixers:
        handler = handler_for(mixer)  # every mixer has one: check_model refused the model otherwise
        handler.patch(mixer.module, state)
        state.mixers.append((mixer.name, handler.name))
    return FixSite(structure.pretrained, module, state, decoder, structure)


def _hook(site: FixSite) -> None:
    """The decoder hooks, where something reads the packed forward: attention, token mixers, embeddings that number
    tokens themselves (even with ``attention=False``)."""
    state, module = site.state, site.module
    if state.attention and state.no_dense_path is None:
        builder = mask_without_positions(type(module))
        if builder is not None:
            state.no_dense_path = (
                f"{builder} builds the mask without position_ids, so it cannot tell the samples apart"
            )
    if state.attention or state.mixers or "positions" in state.fixes:
        state.hook_ids.append(module.register_forward_pre_hook(decoder_pre_hook, with_kwargs=True).id)
        post_hook = module.register_forward_hook(decoder_post_hook, with_kwargs=True, always_call=True)
        state.hook_ids.append(post_hook.id)


def _unpatch_decoder(model: torch.nn.Module, module: torch.nn.Module) -> None:
    state = decoder_state(module)
    fixes.remove_fixes(FixSite(model, module, state))
    for hook_id in state.hook_ids:
        remove_hook(module, hook_id)
    if state.attention:
        release_route(state.implementation, state)
    for name, handler_name in state.mixers:
        handler_named(handler_name).unpatch(module.get_submodule(name))
    for layer in module.modules():
        if isinstance(layer.__dict__.get(PATCH_ATTRIBUTE), AttentionState):
            del layer.__dict__[PATCH_ATTRIBUTE]
    del module.__dict__[PATCH_ATTRIBUTE]


def _patched_decoders(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if decoder_state(module) is not None]


def patch_model(
    model: torch.nn.Module, *, attention: bool = True, rope: bool = True, compiled: bool = False
) -> torch.nn.Module:
    """Make packed batches attend per sample in ``model``; return ``model`` (patched in place).

    Works on any decoder-only transformers model whose attention goes through transformers' attention interface and
    whose decoder builds its mask with transformers' mask functions (found from the model, see
    :mod:`unpack_trainer.anatomy.structure`), on a ``PeftModel`` wrapping one, and on bitsandbytes-quantized models.
    Calling it again with the same flags does nothing; with other flags it re-patches. A packed batch is
    ``model(**batch)`` with the collator's keys (``input_ids``, ``position_ids``, ``labels``, ``packed_seq_lengths``,
    ``cu_seq_lens_q/k``, ``max_length_q/k``, no ``attention_mask``) or just ``position_ids`` restarting at 0 per sample.

    Args:
        model: the model to patch.
        attention: route packed batches to the per-sample attention helper (no ``(T, T)`` mask).
        rope: use :func:`unpack_trainer.patches.rope.apply_rotary_pos_emb` where the model applies Llama's RoPE.
        compiled: the model will run under ``torch.compile``: each packed forward plans on the host, before the
            layers, what their attention reads (buckets of lengths from a fixed shape grid), so a compiled layer has no
            graph break and recompiles only when a batch's shapes leave the classes it has seen.

    Raises:
        PatchRefused: (a ``ValueError``) the model cannot be packed exactly; the message gives the reason.
        TypeError: ``model`` holds no transformers ``PreTrainedModel``.
    """
    structure = check_model(model)
    model_type, decoders = structure.model_type, structure.decoders
    if model_type not in supported_model_types():
        logger.info(
            "unpack_trainer: model_type %r is patched by the generic patch but is not among the verified types; "
            "the trainer's self-check guards it.",
            model_type,
        )
    flags = (attention, rope, compiled)
    states = [decoder_state(decoder.module) for decoder in decoders]
    if all(state is not None and (state.attention, state.rope, state.compiled) == flags for state in states):
        return model
    for decoder, state in zip(decoders, states):
        if state is not None:
            _unpatch_decoder(structure.pretrained, decoder.module)
    features = attention_features(model, structure)
    sites = [
        _patch_decoder(structure, decoder, attention=attention, rope=rope, compiled=compiled, features=features)
        for decoder in decoders
    ]
    fixes.install_fixes(sites)
    for site in sites:
        _hook(site)
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model` (a no-op on a model that is not patched); return ``model``.

    An implementation chosen with ``set_attn_implementation`` after patching is kept.
    """
    pretrained = pretrained_model(model)
    for module in _patched_decoders(model):
        _unpatch_decoder(pretrained, module)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` is in effect on ``model`` (after ``set_attn_implementation`` too: the next forward
    re-routes through the new implementation)."""
    if not isinstance(model, torch.nn.Module):
        return False
    return bool(_patched_decoders(model))


def install_fix(model: torch.nn.Module, name: str) -> None:
    """Install on ``model``, patched already, the fix ``name`` of :data:`unpack_trainer.models.fixes.FIXES` that a
    trainer asks for (``"packed_view"``, ``"compact_lm_head"``: prompts shared by several completions); a no-op where
    it is installed already; removed by :func:`unpatch_model`.

    Raises:
        ValueError: ``model`` is not patched.
    """
    pretrained = pretrained_model(model)
    decoders = _patched_decoders(model)
    if not decoders:
        raise ValueError(f"install_fix({name!r}) needs a patched model (unpack_trainer.models.patch_model).")
    fixes.install_fix(name, [FixSite(pretrained, module, decoder_state(module)) for module in decoders])


def resolve_backend(model: torch.nn.Module, *, compute_dtype: torch.dtype | None = None) -> BackendChoice:
    """The attention backend packed batches of ``model`` will use, and why: a ``(name, reason)`` named tuple.

    ``name`` is one of :data:`unpack_trainer.patches.attention.REGISTRY`. Decided from the device and floating
    dtype of the model's parameters, its attention implementation, what its attention applies
    (:func:`~unpack_trainer.anatomy.attention.attention_features`), the installed kernels and ``UNPACK_ATTENTION_BACKEND`` (an impossible forced
    choice raises ``ValueError``). Dropout is left out: it only applies in training and every backend but
    ``torch_varlen`` applies it (which then hands over per call, logged once). The model need not be patched.
    ``compute_dtype``: the autocast dtype a trainer's mixed precision will run float32 parameters in (``bf16=True``:
    ``torch.bfloat16``); attention computes in it, as the forward will
    (:func:`unpack_trainer.patches.attention.compute_dtype`).
    """
    from unpack_trainer.patches.attention import choose_backend
    from unpack_trainer.patches.attention import compute_dtype as attention_dtype

    pretrained = pretrained_model(model)
    implementation = attention_implementation(pretrained.config)
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = parameter.dtype if parameter is not None else torch.float32
    quantized_dtype = getattr(getattr(pretrained.config, "quantization_config", None), "bnb_4bit_compute_dtype", None)
    if isinstance(quantized_dtype, torch.dtype):
        dtype = quantized_dtype
    dtype = attention_dtype(device, dtype, autocast_dtype=compute_dtype)
    return choose_backend(device, dtype, implementation, attention_features(model))
