"""Patch a transformers model so that packed batches attend per sample: ``patch_model`` / ``unpatch_model``.

What a patch does, for a registered ``config.model_type``:

- registers ``unpack_<impl>`` in transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (``<impl>`` is the
  model's attention implementation: "sdpa", "eager", "flash_attention_2", ...) and sets the model's
  ``config._attn_implementation`` to it. Packed batches go to :mod:`unpack_trainer.patches.attention` with no
  ``(T, T)`` mask built; every other batch (a padded batch with ``attention_mask``, generation with a KV cache) runs
  ``<impl>`` exactly as before;
- adds a forward pre-hook on the decoder model (``LlamaModel``, ...) that decides once per forward whether the batch
  is packed and computes the packing metadata (:class:`~unpack_trainer.patches.attention.PackedSeqInfo`), which
  reaches every layer as a keyword argument (so it survives gradient checkpointing);
- with ``rope=True``, replaces the modeling module's ``apply_rotary_pos_emb`` with
  :func:`unpack_trainer.patches.rope.apply_rotary_pos_emb` (same signature and result; restored when the last patched
  model of that type is unpatched).

The per-architecture modules (``llama.py``, ``mistral.py``, ``qwen2.py``, ``qwen3.py``) only declare where these live.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from unpack_trainer.patches.attention import BackendChoice

__all__ = [
    "BLOCKLIST",
    "ArchitectureSpec",
    "get_spec",
    "is_patched",
    "patch_model",
    "resolve_backend",
    "supported_model_types",
    "unpatch_model",
]

# model_type -> module declaring its ArchitectureSpec as SPEC. Every module in this package is listed here.
_REGISTRY: dict[str, str] = {
    "llama": "unpack_trainer.models.llama",
    "mistral": "unpack_trainer.models.mistral",
    "qwen2": "unpack_trainer.models.qwen2",
    "qwen3": "unpack_trainer.models.qwen3",
}

# model_type -> why packed attention cannot be made exact for it.
BLOCKLIST: dict[str, str] = {
    "gemma2": "its attention uses logit softcapping (attn_logit_softcapping), which SDPA cannot apply per sample",
    "gpt_oss": "its attention uses attention sinks (s_aux) and flex attention, which the packed helper does not support",
}

_UNPACK_PREFIX = "unpack_"
_STATE_ATTRIBUTE = "_unpack_trainer_patch"


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where one architecture keeps what the patch touches.

    Attributes:
        model_type: ``config.model_type``.
        modeling_module: the transformers modeling module, e.g. ``"transformers.models.llama.modeling_llama"``.
        decoder_class: the decoder model class in that module (builds the mask, runs the layers): ``"LlamaModel"``.
        attention_class: the attention module class; it must call ``ALL_ATTENTION_FUNCTIONS.get_interface``.
        rope_function: the module-level RoPE function the attention class calls.
        sliding_window: where sliding windows come from (``None``: the architecture has none). The attention module
            passes ``sliding_window`` to the attention function, which applies it per sample.
    """

    model_type: str
    modeling_module: str
    decoder_class: str
    attention_class: str
    rope_function: str = "apply_rotary_pos_emb"
    sliding_window: str | None = None


@dataclass
class _PatchState:
    model_type: str
    original_implementation: str | None
    attention: bool
    rope: bool
    hook_ids: list[int] = field(default_factory=list)  # ids, not handles: a deep copy of the model keeps the ids


# modeling module -> original RoPE function, and the decoders currently using the replacement.
_rope_originals: dict[str, Any] = {}
_rope_users: dict[str, weakref.WeakSet] = {}


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values :func:`patch_model` supports, sorted."""
    return sorted(_REGISTRY)


def _unsupported(model_type: str) -> ValueError:
    supported = ", ".join(supported_model_types())
    if model_type in BLOCKLIST:
        return ValueError(
            f"unpack_trainer cannot patch model_type '{model_type}': {BLOCKLIST[model_type]}. "
            f"Supported model types: {supported}."
        )
    return ValueError(
        f"unpack_trainer has no packed-attention patch for model_type '{model_type}'. "
        f"Supported model types: {supported}."
    )


def get_spec(model_type: str) -> ArchitectureSpec:
    """The :class:`ArchitectureSpec` registered for ``model_type``.

    Raises:
        ValueError: ``model_type`` is blocklisted (with the reason) or not registered (with the supported list).
    """
    if model_type not in _REGISTRY:
        raise _unsupported(model_type)
    return importlib.import_module(_REGISTRY[model_type]).SPEC


def _pretrained_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``PreTrainedModel`` inside ``model`` (itself, or the model a ``PeftModel`` wraps)."""
    from transformers import PreTrainedModel

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"patch_model expects a torch.nn.Module, got {type(model).__name__}.")
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(
        f"patch_model expects a transformers PreTrainedModel (or a PeftModel wrapping one), got {type(model).__name__}."
    )


def _decoders(model: torch.nn.Module) -> tuple[ArchitectureSpec, Any, list[torch.nn.Module]]:
    pretrained = _pretrained_model(model)
    spec = get_spec(getattr(pretrained.config, "model_type", None) or type(pretrained).__name__)
    modeling = importlib.import_module(spec.modeling_module)
    decoder_class = getattr(modeling, spec.decoder_class)
    decoders = [module for module in model.modules() if isinstance(module, decoder_class)]
    if not decoders:
        raise ValueError(
            f"Found no {spec.decoder_class} inside {type(model).__name__}; unpack_trainer patches the decoder model "
            f"of model_type '{spec.model_type}'."
        )
    return spec, modeling, decoders


def _register_implementation(original: str | None) -> str:
    """Register ``unpack_<original>`` in transformers' attention and mask interfaces (idempotent); return the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from unpack_trainer.patches.attention import make_attention_function
    from unpack_trainer.patches.masks import make_mask_function

    base = original or "sdpa"
    name = _UNPACK_PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, make_attention_function(base))
    if name not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, make_mask_function(base))
    return name


_forward_parameters: dict[type, list[str]] = {}


def _decoder_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    from unpack_trainer.patches.masks import packed_forward_active, packed_info_for_forward

    if args:
        names = _forward_parameters.get(type(module))
        if names is None:
            names = [
                p.name
                for p in inspect.signature(module.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            _forward_parameters[type(module)] = names
        kwargs = {**dict(zip(names, args)), **kwargs}
        args = ()
    info = packed_info_for_forward(kwargs)
    module.__dict__.setdefault("_unpack_tokens", []).append(packed_forward_active(info))
    return args, kwargs


def _decoder_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    from unpack_trainer.patches.masks import reset_packed_forward

    tokens = module.__dict__.get("_unpack_tokens")
    if tokens:
        reset_packed_forward(tokens.pop())


def _patch_rope(spec: ArchitectureSpec, modeling: Any, decoder: torch.nn.Module) -> None:
    from unpack_trainer.patches.rope import apply_rotary_pos_emb

    if spec.modeling_module not in _rope_originals:
        _rope_originals[spec.modeling_module] = getattr(modeling, spec.rope_function)
        setattr(modeling, spec.rope_function, apply_rotary_pos_emb)
    _rope_users.setdefault(spec.modeling_module, weakref.WeakSet()).add(decoder)
    # A patched model that is garbage collected without unpatch_model releases the RoPE function too.
    weakref.finalize(decoder, _release_rope, spec.modeling_module, spec.rope_function)


def _release_rope(modeling_module: str, rope_function: str) -> None:
    """Restore the modeling module's RoPE function once no live patched decoder uses the replacement."""
    users = _rope_users.get(modeling_module)
    if users is not None and next(iter(users), None) is not None:  # iterating skips decoders being collected
        return
    if modeling_module in _rope_originals:
        setattr(importlib.import_module(modeling_module), rope_function, _rope_originals.pop(modeling_module))


def _unpatch_rope(spec: ArchitectureSpec, modeling: Any, decoder: torch.nn.Module) -> None:
    users = _rope_users.get(spec.modeling_module)
    if users is not None:
        users.discard(decoder)
    _release_rope(spec.modeling_module, spec.rope_function)


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _remove_hook(module: torch.nn.Module, hook_id: int) -> None:
    """What ``RemovableHandle.remove`` does, on ``module``'s own hook dicts (a handle of the original model would
    point at the original's dicts after ``copy.deepcopy``)."""
    for name in _HOOK_DICTS:
        getattr(module, name, {}).pop(hook_id, None)


def _patch_decoder(
    spec: ArchitectureSpec, modeling: Any, decoder: torch.nn.Module, *, attention: bool, rope: bool
) -> None:
    config = decoder.config
    original = config._attn_implementation
    if original is not None and original.startswith(_UNPACK_PREFIX):  # e.g. a deep copy of a patched model
        original = original[len(_UNPACK_PREFIX) :]
    state = _PatchState(spec.model_type, original, attention, rope)
    if attention:
        config._attn_implementation = _register_implementation(original)
        state.hook_ids.append(decoder.register_forward_pre_hook(_decoder_pre_hook, with_kwargs=True).id)
        post_hook = decoder.register_forward_hook(_decoder_post_hook, with_kwargs=True, always_call=True)
        state.hook_ids.append(post_hook.id)
    if rope:
        _patch_rope(spec, modeling, decoder)
    setattr(decoder, _STATE_ATTRIBUTE, state)


def _unpatch_decoder(spec: ArchitectureSpec, modeling: Any, decoder: torch.nn.Module) -> None:
    state: _PatchState | None = getattr(decoder, _STATE_ATTRIBUTE, None)
    if state is None:
        return
    for hook_id in state.hook_ids:
        _remove_hook(decoder, hook_id)
    if state.attention:
        decoder.config._attn_implementation = state.original_implementation
    if state.rope:
        _unpatch_rope(spec, modeling, decoder)
    delattr(decoder, _STATE_ATTRIBUTE)
    with contextlib.suppress(KeyError):
        del decoder.__dict__["_unpack_tokens"]


def patch_model(model: torch.nn.Module, *, attention: bool = True, rope: bool = True) -> torch.nn.Module:
    """Make packed batches attend per sample in ``model``; return ``model`` (patched in place).

    Works on a transformers model, a ``PeftModel`` wrapping one, and bitsandbytes-quantized models. Calling it again
    with the same flags does nothing; with other flags it re-patches. A packed batch is ``model(**batch)`` with the
    collator's keys (``input_ids``, ``position_ids``, ``labels``, ``packed_seq_lengths``, ``cu_seq_lens_q/k``,
    ``max_length_q/k``, no ``attention_mask``) or just ``position_ids`` restarting at 0 per sample.

    Args:
        model: the model to patch.
        attention: route packed batches to the per-sample attention helper (no ``(T, T)`` mask).
        rope: use :func:`unpack_trainer.patches.rope.apply_rotary_pos_emb` (a drop-in with the same result).

    Raises:
        ValueError: ``config.model_type`` is not supported (the message names the supported ones) or blocklisted
            (the message gives the reason).
        TypeError: ``model`` holds no transformers ``PreTrainedModel``.
    """
    spec, modeling, decoders = _decoders(model)
    for decoder in decoders:
        state: _PatchState | None = getattr(decoder, _STATE_ATTRIBUTE, None)
        if state is not None and (state.attention, state.rope) == (attention, rope):
            continue
        if state is not None:
            _unpatch_decoder(spec, modeling, decoder)
        _patch_decoder(spec, modeling, decoder, attention=attention, rope=rope)
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model` (a no-op on a model that is not patched); return ``model``."""
    spec, modeling, decoders = _decoders(model)
    for decoder in decoders:
        _unpatch_decoder(spec, modeling, decoder)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` is in effect on ``model``."""
    try:
        _, _, decoders = _decoders(model)
    except (TypeError, ValueError):
        return False
    return any(getattr(decoder, _STATE_ATTRIBUTE, None) is not None for decoder in decoders)


def resolve_backend(model: torch.nn.Module) -> BackendChoice:
    """The attention backend packed batches of ``model`` will use, and why: a ``(name, reason)`` named tuple.

    ``name`` is one of ``"flash"``, ``"xformers"``, ``"sdpa"``, ``"eager"``. Decided from the device and floating
    dtype of the model's parameters, its attention implementation, the installed kernels and
    ``UNPACK_ATTENTION_BACKEND`` (an impossible forced choice raises ``ValueError``). The model need not be patched.
    """
    from unpack_trainer.patches.attention import choose_backend

    pretrained = _pretrained_model(model)
    implementation = pretrained.config._attn_implementation
    if implementation is not None and implementation.startswith(_UNPACK_PREFIX):
        implementation = implementation[len(_UNPACK_PREFIX) :]
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = parameter.dtype if parameter is not None else torch.float32
    compute_dtype = getattr(getattr(pretrained.config, "quantization_config", None), "bnb_4bit_compute_dtype", None)
    if isinstance(compute_dtype, torch.dtype):
        dtype = compute_dtype
    return choose_backend(device, dtype, implementation)
