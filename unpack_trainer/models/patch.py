"""The patch itself: what :func:`patch_model` installs on a model, and how :func:`unpatch_model` takes it off.

The model is first checked (:func:`unpack_trainer.models.refusals.check_model`: what it is made of, and whether it can
be packed exactly). Then, on each decoder:

- registers ``unpack_<impl>`` in transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (``<impl>`` is the
  model's attention implementation: "sdpa", "eager", "flash_attention_2", ...) and sets the model's
  ``config._attn_implementation`` to it. Packed batches go to :mod:`unpack_trainer.patches.attention` with no
  ``(T, T)`` mask built; every other batch (a padded batch with ``attention_mask``, generation with any KV cache) runs
  ``<impl>`` exactly as before. ``model.set_attn_implementation(...)`` after patching is followed (the next forward
  re-routes through ``unpack_<new impl>``), ``config.output_attentions = True`` works where it works unpatched (packed
  batches then take transformers' own exact path, which returns the weights), and a pickled patched model registers
  its implementation again when it is loaded;
- adds a forward pre-hook on the decoder that decides once per forward whether the batch is packed
  (:func:`unpack_trainer.patches.masks.packed_info_for_forward`, the one detector) and computes the packing metadata
  (:class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`), which reaches every layer as a keyword argument (so it
  survives gradient checkpointing) and, where no keyword reaches (the mask function, token mixers, attention under a
  decoder that does not hand its keyword arguments down), through the packed forward it publishes
  (:func:`unpack_trainer.patches.masks.current_packed_info`).
  Under ``torch.compile`` / ``torch.export`` a batch without packing metadata is left as it came;
- patches each token mixer with the handler that owns it (:mod:`unpack_trainer.models.mixers`);
- hooks each embeddings module that numbers tokens itself (:mod:`unpack_trainer.models.positions`: the RoBERTa
  family, from ``padding_idx + 1``) so that on a packed forward it gets each sample's own positions instead of the
  restarting ``position_ids``;
- refuses ``output_attentions=True`` on a packed batch where transformers' dense path would not be exact (ALiBi over
  the whole row, a decoder that builds its mask without ``position_ids`` such as BERT's): a ``ValueError``;
- with ``rope=True``, where the modeling module's ``apply_rotary_pos_emb`` is Llama's, replaces it with
  :func:`unpack_trainer.patches.rope.apply_rotary_pos_emb` (same signature and result; restored when the last patched
  model of that module is unpatched or collected, unless another library replaced it since: Liger-Kernel's RoPE,
  applied by ``use_liger_kernel=True`` when training starts, stays);
- on a sequence-classification model (``*ForSequenceClassification``), hooks that score each packed sequence at its
  own last non-pad token instead of one token per row, or refuse a packed forward with the reason
  (:mod:`unpack_trainer.models.classification_head`);
- where the decoder applies ``config.sliding_window`` through its mask only, tells its attention modules the window;
  likewise the chunk size of each chunked-attention layer (llama4), whose chunks then count from each sample's start,
  and a per-sample correction where a layer scales its queries by positions along the row (llama4's temperature
  tuning of its NoPE layers, on rows of ``floor_scale`` tokens or more).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unpack_trainer._compat import (
    attention_implementation,
    locally_registered,
    mask_functions,
    remove_hook,
    set_attention_implementation,
)
from unpack_trainer.models import alibi
from unpack_trainer.models.alibi import packed_forward_for, patch_attention_class, unpatch_attention_class
from unpack_trainer.models.discovery import (
    Decoder,
    attention_chunks,
    class_references,
    mask_without_positions,
    mentions,
    pretrained_model,
)
from unpack_trainer.models.mixers import handler_for, handler_named
from unpack_trainer.models.positions import POSITIONS_ATTRIBUTE, own_position_embeddings, sample_positions
from unpack_trainer.models.refusals import check_model
from unpack_trainer.models.undo import run_undos
from unpack_trainer.packed_seq_info import INFO_KEY, METADATA_KEYS
from unpack_trainer.patches.masks import MASK_PLACEHOLDER_ATTRIBUTE

if TYPE_CHECKING:
    from unpack_trainer.patches.attention import BackendChoice

__all__ = [
    "attention_features",
    "is_patched",
    "patch_model",
    "resolve_backend",
    "supported_model_types",
    "unpatch_model",
]

logger = logging.getLogger("unpack_trainer.models")

_STATE_ATTRIBUTE = "_unpack_trainer_patch"


@dataclass
class _PatchState:
    model_type: str
    implementation: str  # the attention implementation whose registered name routes this decoder's packed batches
    attention: bool
    rope: bool
    rope_modules: tuple[str, ...] = ()
    hook_ids: list[int] = field(default_factory=list)  # ids, not handles: a deep copy of the model keeps the ids
    # (qualified name under the decoder, handler name) of each patched token mixer: names, so a copy finds its own.
    mixers: list[tuple[str, str]] = field(default_factory=list)
    routed: bool = True  # False for a copy (deep copy, unpickled): its first forward adds it to the routed decoders
    own_forwards: bool = False  # attention with a packed forward of its class (unpack_trainer.models.alibi)
    # Why transformers' dense path (what output_attentions=True takes) is not exact on packed rows, or None.
    no_dense_path: str | None = None
    # (qualified name under the decoder, hook id) of each embeddings module that numbers tokens itself (RoBERTa).
    positions: list[tuple[str, int]] = field(default_factory=list)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A deep copy or an unpickled model (torch.load, maybe in a new process): the packed routing of its
        # implementation must be in place before its first forward (the decoder hook registers the copy itself).
        self.__dict__.update(state)
        self.routed = False
        if self.attention:
            _route(self.implementation, None)


# modeling module -> original RoPE function, and the decoders currently using the replacement.
_rope_originals: dict[str, Any] = {}
_rope_users: dict[str, weakref.WeakSet] = {}


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values verified on the fast packed path with the installed transformers, sorted.

    Each one passed the generated coverage check (``tests/models/test_coverage.py``): a tiny model of that type is
    patched, its packed logits equal each sample run alone and its loss and every gradient equal a padded batch, on
    SDPA and eager, with no ``(T, T)`` mask built. Other types may still patch (the patch is generic); the trainer's
    self-check guards them.
    """
    from unpack_trainer.models.verified import verified_model_types

    return sorted(verified_model_types())


# --------------------------------------------------------------------------------------------------------------------
# Registration, hooks, RoPE
# --------------------------------------------------------------------------------------------------------------------


# implementation name -> the live patched decoders that use its routing, and what the routing replaced.
_route_users: dict[str, weakref.WeakSet] = {}
_routed: dict[str, tuple[Any, Any]] = {}


def _route(implementation: str, decoder: torch.nn.Module | None) -> None:
    """Route packed batches of patched models through the packed helper under transformers' own name.

    While a patched model uses ``implementation`` ("sdpa", "eager", "flash_attention_2", ...), transformers' attention
    and mask interfaces (``ALL_ATTENTION_FUNCTIONS``, ``ALL_MASK_ATTENTION_FUNCTIONS``) map that name to
    :func:`~unpack_trainer.patches.attention.make_attention_function` /
    :func:`~unpack_trainer.patches.masks.make_mask_function`: a packed forward of a patched decoder takes the packed
    helper with no ``(T, T)`` mask, every other call (any unpatched model, padded batches, generation) runs the
    function the name mapped to before, exactly. The mapping is the interfaces' per-instance one (``interface[name] =
    function``), so the class-wide registry stays as transformers and the user left it; it is restored when the last
    decoder using it is unpatched or collected. So a patched model's ``config._attn_implementation`` reads what a
    stock one reads.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from unpack_trainer.patches.attention import make_attention_function
    from unpack_trainer.patches.masks import make_mask_function

    if implementation not in _routed:
        previous_attention = locally_registered(ALL_ATTENTION_FUNCTIONS, implementation)
        previous_mask = locally_registered(ALL_MASK_ATTENTION_FUNCTIONS, implementation)
        ALL_ATTENTION_FUNCTIONS[implementation] = make_attention_function(implementation, fallback=previous_attention)
        if implementation in mask_functions():
            # (transformers builds no mask at all for a name missing there, packed or not)
            ALL_MASK_ATTENTION_FUNCTIONS[implementation] = make_mask_function(implementation, fallback=previous_mask)
        _routed[implementation] = (previous_attention, previous_mask)
    if decoder is not None:
        users = _route_users.setdefault(implementation, weakref.WeakSet())
        if decoder not in users:
            users.add(decoder)
            # A patched model that is garbage collected without unpatch_model releases the routing too.
            weakref.finalize(decoder, _release_route, implementation)


def _release_route(implementation: str, decoder: torch.nn.Module | None = None) -> None:
    """Drop ``decoder`` from the users of ``implementation``'s routing; restore the interfaces once none is left."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    users = _route_users.get(implementation)
    if users is not None:
        if decoder is not None:
            users.discard(decoder)
        if next(iter(users), None) is not None:  # iterating skips decoders being collected
            return
    if implementation not in _routed:
        return
    for interface, previous in zip(
        (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS), _routed.pop(implementation)
    ):
        if previous is not None:
            interface[implementation] = previous
        elif getattr(locally_registered(interface, implementation), "original_implementation", None) is not None:
            del interface[implementation]


_forward_parameters: dict[type, list[str]] = {}


def _wants_attention_weights(module: torch.nn.Module, kwargs: dict) -> bool:
    requested = kwargs.get("output_attentions")
    if requested is None:
        requested = getattr(module.config, "output_attentions", False)
    return bool(requested)


def _follow_implementation(module: torch.nn.Module, state: _PatchState) -> None:
    """Route the decoder's packed batches through its implementation now: after
    ``model.set_attn_implementation(impl)`` changed it, and on the first forward of a copy."""
    current = attention_implementation(module.config) or "eager"
    changed = current != state.implementation
    _route(current, module)
    if changed:
        _release_route(state.implementation, module)
        logger.warning(
            "unpack_trainer: the attention implementation of this patched model was changed to %r; packed batches "
            "now use the packed helper on %r.",
            current,
            current,
        )
        state.implementation = current
    if not state.routed:
        for layer in module.modules():  # a copy's attention modules with a packed forward join its routing
            if alibi.CONFIG_ATTRIBUTE in layer.__dict__:
                patch_attention_class(layer, module.config)
    state.routed = True


def _decoder_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    from unpack_trainer.patches.masks import packed_forward_active, packed_info_for_forward

    state: _PatchState | None = module.__dict__.get(_STATE_ATTRIBUTE)
    if (
        state is not None
        and state.attention
        and (not state.routed or attention_implementation(module.config) != state.implementation)
    ):
        _follow_implementation(module, state)
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
    # get + del, not dict.pop: torch 2.11's dynamo cannot trace ``pop`` on a module's ``__dict__`` (compile with
    # fullgraph=True failed there), and under compile nothing is carried, so the ``del`` is never traced.
    carried = module.__dict__.get(_CARRIED_ATTRIBUTE)
    if carried is not None:
        del module.__dict__[_CARRIED_ATTRIBUTE]
    if carried:
        kwargs = {**carried, **{key: value for key, value in kwargs.items() if value is not None}}
    info = packed_info_for_forward(kwargs)
    if info is None:
        return args, kwargs
    dense = _wants_attention_weights(module, kwargs)
    if dense and state is not None and state.no_dense_path is not None:
        raise ValueError(
            f"output_attentions=True with a packed batch is not supported for {state.model_type}: its packed "
            f"attention returns no weights and the model has no exact dense path for packed rows "
            f"({state.no_dense_path}); run the samples unpacked (or padded) to get attention weights."
        )
    if state is not None and state.positions:
        for name, _ in state.positions:
            embeddings = module.get_submodule(name)
            embeddings.__dict__[POSITIONS_ATTRIBUTE] = sample_positions(
                embeddings, info, input_ids=kwargs.get("input_ids"), inputs_embeds=kwargs.get("inputs_embeds")
            )
    if dense:
        # The packed helper returns no weights: transformers' own packed path (a dense block mask from the restarting
        # position_ids, which the metadata filled in) computes the same outputs and returns them.
        from unpack_trainer._logging import log_once
        from unpack_trainer.patches.attention import logger as attention_logger

        log_once(
            attention_logger,
            logging.INFO,
            "unpack_trainer: output_attentions=True: packed batches take transformers' dense-mask path, which "
            "returns the attention weights.",
        )
        kwargs[INFO_KEY] = None
    # One publication for the mask function, the attention modules no keyword reaches and the token mixers; attention
    # follows it unless it takes the dense path.
    packed_forward_active(module, info, attention=not dense)
    return args, kwargs


# Keys of the packed batch an outer model may not hand down to its decoder (bloom's and mpt's CausalLM forwards pass
# only their named arguments): the outer hook carries them to the decoder hook.
_CARRIED_KEYS = (INFO_KEY, *METADATA_KEYS, "position_ids")
_CARRIED_ATTRIBUTE = "_unpack_carried_kwargs"
_OUTER_ATTRIBUTE = "_unpack_trainer_outer"  # on the outer model: {"decoders": [qualified names], "hook_ids": [...]}


def _outer_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    carried = {key: kwargs[key] for key in _CARRIED_KEYS if kwargs.get(key) is not None}
    if carried:
        for name in module.__dict__[_OUTER_ATTRIBUTE]["decoders"]:
            module.get_submodule(name).__dict__[_CARRIED_ATTRIBUTE] = carried


def _outer_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    for name in module.__dict__[_OUTER_ATTRIBUTE]["decoders"]:
        module.get_submodule(name).__dict__.pop(_CARRIED_ATTRIBUTE, None)


def _patch_outer(pretrained: torch.nn.Module, decoders: list[torch.nn.Module]) -> None:
    """Carry the packing keys from ``pretrained``'s forward to ``decoders`` (ones whose outer model drops them)."""
    if pretrained.__dict__.get(_OUTER_ATTRIBUTE) is not None or all(d is pretrained for d in decoders):
        return
    names = {module: name for name, module in pretrained.named_modules()}
    pre = pretrained.register_forward_pre_hook(_outer_pre_hook, with_kwargs=True)
    post = pretrained.register_forward_hook(_outer_post_hook, with_kwargs=True, always_call=True)
    pretrained.__dict__[_OUTER_ATTRIBUTE] = {"decoders": [names[d] for d in decoders], "hook_ids": [pre.id, post.id]}


def _unpatch_outer(model: torch.nn.Module) -> None:
    for module in model.modules():
        outer = module.__dict__.pop(_OUTER_ATTRIBUTE, None)
        if outer is not None:
            for hook_id in outer["hook_ids"]:
                remove_hook(module, hook_id)


def _decoder_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    from unpack_trainer.patches.masks import reset_packed_forward

    reset_packed_forward(module)
    state: _PatchState | None = module.__dict__.get(_STATE_ATTRIBUTE)
    for name, _ in state.positions if state is not None else ():
        module.get_submodule(name).__dict__.pop(POSITIONS_ATTRIBUTE, None)


_position_parameter: dict[type, int] = {}


def _positions_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """On an embeddings module that numbers tokens itself: inside a packed forward, the positions each sample gets
    alone (:mod:`unpack_trainer.models.positions`) replace the restarting ``position_ids``; otherwise nothing."""
    positions = module.__dict__.pop(POSITIONS_ATTRIBUTE, None)
    if positions is None:
        return None
    index = _position_parameter.get(type(module))
    if index is None:
        names = list(inspect.signature(module.forward).parameters)
        index = _position_parameter[type(module)] = names.index("position_ids")
    if len(args) > index:
        return (*args[:index], positions, *args[index + 1 :]), kwargs
    return args, {**kwargs, "position_ids": positions}


def _same_code(a: Any, b: Any) -> bool:
    a, b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if a is None or b is None:
        return False

    def key(code: types.CodeType) -> tuple:
        consts = tuple(c for c in code.co_consts if not isinstance(c, (str, types.CodeType)))
        return code.co_code, code.co_names, code.co_varnames, consts

    return key(a) == key(b)


def _llama_rope_module(modeling: types.ModuleType) -> bool:
    """Whether ``modeling`` applies RoPE exactly as Llama does (``apply_rotary_pos_emb`` and ``rotate_half``), with
    transformers' own function: one another library put there (Liger-Kernel's) is left to run."""
    from transformers.models.llama import modeling_llama as llama

    function = _rope_originals.get(modeling.__name__, getattr(modeling, "apply_rotary_pos_emb", None))
    reference = _rope_originals.get(llama.__name__, llama.apply_rotary_pos_emb)  # Llama's own may be replaced now
    return (
        getattr(function, "__module__", "").startswith("transformers.")
        and _same_code(function, reference)
        and _same_code(getattr(modeling, "rotate_half", None), llama.rotate_half)
    )


def _patch_rope(decoder: Decoder) -> tuple[str, ...]:
    from unpack_trainer.patches.rope import apply_rotary_pos_emb

    patched = []
    for name in dict.fromkeys(type(m).__module__ for m in decoder.attention):
        modeling = sys.modules.get(name)
        if modeling is None or not _llama_rope_module(modeling):
            continue
        if name not in _rope_originals:
            _rope_originals[name] = modeling.apply_rotary_pos_emb
            modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
        _rope_users.setdefault(name, weakref.WeakSet()).add(decoder.module)
        # A patched model that is garbage collected without unpatch_model releases the RoPE function too.
        weakref.finalize(decoder.module, _release_rope, name)
        patched.append(name)
    return tuple(patched)


def _release_rope(modeling_module: str) -> None:
    """Restore the modeling module's RoPE function once no live patched decoder uses the replacement."""
    users = _rope_users.get(modeling_module)
    if users is not None and next(iter(users), None) is not None:  # iterating skips decoders being collected
        return
    if modeling_module in _rope_originals:
        from unpack_trainer.patches.rope import apply_rotary_pos_emb

        original = _rope_originals.pop(modeling_module)
        modeling = importlib.import_module(modeling_module)
        if modeling.apply_rotary_pos_emb is apply_rotary_pos_emb:  # another library's since (Liger-Kernel's) stays
            modeling.apply_rotary_pos_emb = original


def _unpatch_rope(modules: tuple[str, ...], decoder: torch.nn.Module) -> None:
    for name in modules:
        users = _rope_users.get(name)
        if users is not None:
            users.discard(decoder)
        _release_rope(name)


_WINDOW_ATTRIBUTE = "_unpack_sliding_window"
_CHUNK_ATTRIBUTE = "_unpack_attention_chunk"  # chunked attention (llama4): read by the packed attention function
_QUERY_CORRECTION_ATTRIBUTE = "_unpack_query_correction"  # read by the packed attention function


def _temperature_scales(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """llama4's attention temperature tuning of its NoPE layers: ``log1p(floor((p + 1) / floor_scale)) * attn_scale
    + 1`` per position ``p``, float32, as ``Llama4TextAttention.forward`` computes it."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def _temperature_per_sample(module: torch.nn.Module, query: torch.Tensor, info: Any) -> torch.Tensor:
    """``query`` ``(B, H, T, D)`` scaled as for each sample alone: llama4 scales its NoPE layers' queries by the
    token's position along the row (``arange(T)``), which in a packed row is not its position in its sample. The
    scales are 1 below ``floor_scale - 1``, so rows shorter than ``floor_scale`` are returned as they are."""
    seq_len = query.shape[2]
    if seq_len < module.floor_scale:
        return query
    row = _temperature_scales(module, torch.arange(seq_len, device=query.device))  # (T,)
    sample = _temperature_scales(module, info.position_ids(query.device))  # (B, T)
    return (query * (sample / row).unsqueeze(1).unsqueeze(-1)).to(query.dtype)


def _scales_queries_by_row_position(module: torch.nn.Module) -> bool:
    """Whether the attention module scales its queries by positions along the row (llama4's temperature tuning on
    its NoPE layers: ``attn_temperature_tuning`` and no RoPE)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and getattr(module, "use_rope", True) in (0, False)


def _window_not_passed(decoder: Decoder) -> int | None:
    """``config.sliding_window`` when the decoder builds a sliding-window mask but its attention modules never pass
    ``sliding_window`` to the attention function (e.g. Phimoe: stock SDPA/eager get the window from the mask only)."""
    from transformers import masking_utils

    window = getattr(decoder.module.config, "sliding_window", None)
    if not window or getattr(decoder.module.config, "layer_types", None) is not None:
        return None
    builders = class_references(type(decoder.module)).values()
    if not any(value is masking_utils.create_sliding_window_causal_mask for value in builders):
        return None
    if any(
        "sliding_window" in class_references(type(m)) or mentions(type(m), "sliding_window") for m in decoder.attention
    ):
        return None
    return int(window)


def _patch_decoder(model_type: str, decoder: Decoder, *, attention: bool, rope: bool) -> None:
    module = decoder.module
    config = module.config
    window = _window_not_passed(decoder)
    for layer, chunk in zip(decoder.attention, attention_chunks(decoder) or []):
        if window is not None:
            setattr(layer, _WINDOW_ATTRIBUTE, window)
        if chunk is not None:
            setattr(layer, _CHUNK_ATTRIBUTE, chunk)
        if _scales_queries_by_row_position(layer):
            setattr(layer, _QUERY_CORRECTION_ATTRIBUTE, _temperature_per_sample)
    if attention_implementation(config) is None:
        # what transformers runs for None, under a name the routing can use
        set_attention_implementation(config, "eager")
    state = _PatchState(model_type, attention_implementation(config), attention, rope)
    if attention:
        _route(state.implementation, module)
        for layer in decoder.attention:
            if packed_forward_for(type(layer)) is not None:
                patch_attention_class(layer, config)
                state.own_forwards = True
        if state.own_forwards:
            # Their decoders use the mask as a tensor (mpt: .to(torch.bool)); their packed attention ignores it.
            module.__dict__[MASK_PLACEHOLDER_ATTRIBUTE] = torch.zeros((1, 1, 1, 1), dtype=torch.bool)
            state.no_dense_path = "its attention applies ALiBi over the whole row"
        else:
            builder = mask_without_positions(type(module))
            if builder is not None:
                state.no_dense_path = (
                    f"{builder} builds the mask without position_ids, so it cannot tell the samples apart"
                )
    for name, embeddings in own_position_embeddings(module):
        hook = embeddings.register_forward_pre_hook(_positions_pre_hook, with_kwargs=True)
        state.positions.append((name, hook.id))
    for mixer in decoder.mixers:
        handler = handler_for(mixer)  # every mixer has one: check_model refused the model otherwise
        handler.patch(mixer.module)
        state.mixers.append((mixer.name, handler.name))
    if attention or state.mixers or state.positions:
        # The mixers and the embeddings read what the hook publishes, so they need it even with attention=False.
        state.hook_ids.append(module.register_forward_pre_hook(_decoder_pre_hook, with_kwargs=True).id)
        post_hook = module.register_forward_hook(_decoder_post_hook, with_kwargs=True, always_call=True)
        state.hook_ids.append(post_hook.id)
    if rope:
        state.rope_modules = _patch_rope(decoder)
    setattr(module, _STATE_ATTRIBUTE, state)


def _unpatch_decoder(module: torch.nn.Module) -> None:
    state: _PatchState | None = getattr(module, _STATE_ATTRIBUTE, None)
    if state is None:
        return
    for hook_id in state.hook_ids:
        remove_hook(module, hook_id)
    for name, hook_id in state.positions:
        embeddings = module.get_submodule(name)
        remove_hook(embeddings, hook_id)
        embeddings.__dict__.pop(POSITIONS_ATTRIBUTE, None)
    if state.attention:
        _release_route(state.implementation, module)
        for layer in module.modules():
            if alibi.CONFIG_ATTRIBUTE in layer.__dict__:
                unpatch_attention_class(layer)
        module.__dict__.pop(MASK_PLACEHOLDER_ATTRIBUTE, None)
    for name, handler_name in state.mixers:
        handler_named(handler_name).unpatch(module.get_submodule(name))
    if state.rope:
        _unpatch_rope(state.rope_modules, module)
    for layer in module.modules():
        layer.__dict__.pop(_WINDOW_ATTRIBUTE, None)
        layer.__dict__.pop(_CHUNK_ATTRIBUTE, None)
        layer.__dict__.pop(_QUERY_CORRECTION_ATTRIBUTE, None)
    delattr(module, _STATE_ATTRIBUTE)


def _patched_decoders(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if getattr(module, _STATE_ATTRIBUTE, None) is not None]


def patch_model(model: torch.nn.Module, *, attention: bool = True, rope: bool = True) -> torch.nn.Module:
    """Make packed batches attend per sample in ``model``; return ``model`` (patched in place).

    Works on any decoder-only transformers model whose attention goes through transformers' attention interface and
    whose decoder builds its mask with transformers' mask functions (found from the model, see :mod:`unpack_trainer.models.discovery`),
    on a ``PeftModel`` wrapping one, and on bitsandbytes-quantized models. Calling it again with the same flags does
    nothing; with other flags it re-patches. A packed batch is ``model(**batch)`` with the collator's keys
    (``input_ids``, ``position_ids``, ``labels``, ``packed_seq_lengths``, ``cu_seq_lens_q/k``, ``max_length_q/k``,
    no ``attention_mask``) or just ``position_ids`` restarting at 0 per sample.

    Args:
        model: the model to patch.
        attention: route packed batches to the per-sample attention helper (no ``(T, T)`` mask).
        rope: use :func:`unpack_trainer.patches.rope.apply_rotary_pos_emb` where the model applies Llama's RoPE.

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
    for decoder in decoders:
        state: _PatchState | None = getattr(decoder.module, _STATE_ATTRIBUTE, None)
        if state is not None and (state.attention, state.rope) == (attention, rope):
            continue
        if state is not None:
            _unpatch_decoder(decoder.module)
        _patch_decoder(model_type, decoder, attention=attention, rope=rope)
    own = [d.module for d in decoders if getattr(d.module, _STATE_ATTRIBUTE).own_forwards]
    if own:
        _patch_outer(structure.pretrained, own)
    from unpack_trainer.models.classification_head import install_score_hooks

    install_score_hooks(structure.pretrained)  # a sequence-classification model: one score per packed sequence
    return model


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch_model` (a no-op on a model that is not patched); return ``model``.

    An implementation chosen with ``set_attn_implementation`` after patching is kept.
    """
    pretrained_model(model)
    run_undos(model)  # what is installed on top of the patch (score hooks, the prompt-sharing view)
    for module in _patched_decoders(model):
        _unpatch_decoder(module)
    _unpatch_outer(model)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` is in effect on ``model`` (after ``set_attn_implementation`` too: the next forward
    re-routes through the new implementation)."""
    if not isinstance(model, torch.nn.Module):
        return False
    return bool(_patched_decoders(model))


def attention_features(model: torch.nn.Module) -> dict[str, Any]:
    """What the attention of ``model`` applies that a packed backend must be able to: ``softcap`` (logit softcapping,
    ``config.attn_logit_softcapping``), ``sinks`` (a ``sinks`` parameter of an attention module), ``head_dim`` and
    ``min_head_dim`` (the largest and smallest query / value head dims, ``None`` when unknown): the keyword arguments of
    :func:`unpack_trainer.patches.attention.choose_backend` besides the device, dtype and implementation. Works on a
    model built on the ``meta`` device."""
    config = pretrained_model(model).config.get_text_config()
    head_dims = [
        getattr(module, "head_dim", None)
        for module in model.modules()
        if isinstance(getattr(module, "head_dim", None), int)
    ]
    for name in ("v_head_dim", "qk_head_dim"):
        if isinstance(getattr(config, name, None), int):
            head_dims.append(getattr(config, name))
    return {
        "softcap": bool(getattr(config, "attn_logit_softcapping", None)),
        "sinks": any(isinstance(getattr(module, "sinks", None), torch.Tensor) for module in model.modules()),
        "head_dim": max(head_dims) if head_dims else None,
        "min_head_dim": min(head_dims) if head_dims else None,
    }


def resolve_backend(model: torch.nn.Module, *, compute_dtype: torch.dtype | None = None) -> BackendChoice:
    """The attention backend packed batches of ``model`` will use, and why: a ``(name, reason)`` named tuple.

    ``name`` is one of :data:`unpack_trainer.patches.attention.BACKENDS`. Decided from the device and floating
    dtype of the model's parameters, its attention implementation, what its attention applies
    (:func:`attention_features`), the installed kernels and ``UNPACK_ATTENTION_BACKEND`` (an impossible forced
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
    return choose_backend(device, dtype, implementation, **attention_features(model))
