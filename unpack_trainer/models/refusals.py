"""Whether a model can be packed exactly, decided from its structure before any forward: :func:`check_model`,
:func:`refusal_reason`, :class:`PatchRefused`.

The checks run in the order of :data:`REFUSAL_CHECKS`; the first that finds a reason refuses the model with its
:class:`RefusalKind`:

=================  ==================================================================  ===================
kind               found when                                                          the trainer then
=================  ==================================================================  ===================
``BLOCKLIST``      ``config.model_type`` is in :data:`BLOCKLIST`                       trains padded
``BIDIRECTIONAL``  self-attention of the decoder that is not causal                    trains padded
                   (``is_causal=False``: an encoder such as BERT or RoBERTa loaded as
                   a causal LM without ``config.is_decoder=True``); a vision-language
                   model whose tokens attend both ways by a rule other than Gemma 3's
                   image blocks (:mod:`.vision`)
``ALIBI``          ALiBi position biases (``config.alibi``, ``attn_config.alibi``,     trains padded
                   or the modeling code uses an ``*alibi*`` helper) in attention
                   without a packed forward (:mod:`.fixes.alibi` has bloom's and mpt's)
``POSITIONS``      an attention term computed from positions the attention counts     trains padded
                   itself along the row (an ``arange``: Inkling's relative position
                   bias), or a ``position_bias`` of its own, read from the source of
                   its ``forward`` through its decorators; a vision-language model
                   with multimodal RoPE and no ``get_rope_index``
``STATE``          a token mixer no mixer handler owns (:mod:`.mixers`), or a decoder  trains padded
                   layer with neither attention nor an owned mixer (nor declared an
                   MLP / MoE layer in ``config.layer_types``)
``UNSUPPORTED``    a feature the packed helper does not implement (a sparse-attention  self-check decides
                   indexer; chunked attention whose layers do not show; a keyword
                   term of the attention call outside :data:`APPLIED_TERMS`; a
                   vision-language model with several text decoders)
``UNREACHABLE``    no decoder builds its mask through transformers' mask functions,    self-check decides
                   or its attention does not go through ``ALL_ATTENTION_FUNCTIONS``
=================  ==================================================================  ===================

``BLOCKLIST``, ``BIDIRECTIONAL``, ``ALIBI``, ``POSITIONS`` and ``STATE`` are *blocking*: packing would contaminate
samples. For the other two transformers' own packed path (its dense mask) may still be exact, and the trainer's
self-check decides.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from unpack_trainer.anatomy.structure import (
    MASK_BUILDERS,
    PER_TOKEN_LAYER_TYPES,
    AttentionCall,
    ModelStructure,
    attention_call,
    attention_chunks,
    cross_attention_modules,
    discover,
    mentions,
    mentions_alibi,
    meta_model,
)
from unpack_trainer.anatomy.vision import decoders_problem, image_block_problem, multi_axis_problem
from unpack_trainer.models.fixes.alibi import packed_forward_for
from unpack_trainer.models.mixers import handler_for
from unpack_trainer.packed_seq_info import METADATA_KEYS
from unpack_trainer.patches.attention import AttentionFeature

__all__ = [
    "APPLIED_TERMS",
    "BLOCKLIST",
    "NOT_TERMS",
    "REFUSAL_CHECKS",
    "PatchRefused",
    "RefusalKind",
    "check_model",
    "refusal_reason",
]

# model_type -> why it cannot be packed exactly, for what the model's structure does not show. Structural refusals
# (state-carrying mixers, ALiBi, attention outside the interface) are found by the checks below, not listed here.
BLOCKLIST: dict[str, str] = {}


class RefusalKind(enum.StrEnum):
    """Why a model is refused, by kind (a ``str``: ``RefusalKind.STATE == "state"``)."""

    BLOCKLIST = "blocklist"
    BIDIRECTIONAL = "bidirectional"
    ALIBI = "alibi"
    POSITIONS = "positions"
    STATE = "state"
    UNSUPPORTED = "unsupported"
    UNREACHABLE = "unreachable"

    @property
    def blocking(self) -> bool:
        """Whether packing would contaminate samples (the trainer trains padded); otherwise the self-check decides."""
        return self in (
            RefusalKind.BLOCKLIST,
            RefusalKind.BIDIRECTIONAL,
            RefusalKind.ALIBI,
            RefusalKind.POSITIONS,
            RefusalKind.STATE,
        )


class PatchRefused(ValueError):
    """``patch_model`` cannot make packed batches exact on this model.

    Attributes:
        model_type: ``config.model_type``.
        reason: why, in words.
        kind: a :class:`RefusalKind` (a ``str``): ``"state"`` (a token mixer carries state across samples),
            ``"bidirectional"`` (an encoder's self-attention: every token sees the whole row), ``"alibi"``,
            ``"positions"`` (an attention term computed from positions along the whole row), ``"blocklist"`` (see
            :data:`BLOCKLIST`): packing would contaminate, so the trainer trains padded; ``"unreachable"`` (the
            attention or the mask is built outside transformers' interfaces, so the patch cannot reach it) and
            ``"unsupported"`` (a feature the packed helper does not implement, e.g. a sparse-attention indexer or a
            term of the attention call it does not apply): transformers' own packed path with its dense mask may
            still be exact, and the self-check decides.
    """

    def __init__(self, model_type: str, reason: str, kind: RefusalKind | str) -> None:
        self.model_type, self.reason, self.kind = model_type, reason, RefusalKind(kind)
        super().__init__(f"unpack_trainer cannot patch model_type '{model_type}': {reason}.")


# --------------------------------------------------------------------------------------------------------------------
# The checks: each reads a ModelStructure and returns a reason, or None
# --------------------------------------------------------------------------------------------------------------------


def _blocklisted(structure: ModelStructure) -> str | None:
    return BLOCKLIST.get(structure.model_type)


def _bidirectional(structure: ModelStructure) -> str | None:
    """Self-attention that is not causal (``is_causal=False``): an encoder (BERT, RoBERTa, ...) loaded as a causal LM
    without ``is_decoder=True``, whose every token attends to the tokens after it."""
    for decoder in structure.decoders:
        cross = cross_attention_modules(decoder.module)
        for module in decoder.attention:
            if id(module) in cross or getattr(module, "is_causal", True) is not False:
                continue
            reason = (
                f"its self-attention ({type(module).__name__}) is bidirectional: every token attends to the tokens "
                "after it, so it is not a causal LM and packed samples would attend to each other"
            )
            if any(mentions(cls, "is_decoder") for cls in structure.classes):
                reason += (
                    " (config.is_decoder=False); load it with is_decoder=True (e.g. "
                    "AutoModelForCausalLM.from_pretrained(name, is_decoder=True)) to train it as a causal LM"
                )
            return reason
    return None


def _alibi(structure: ModelStructure) -> str | None:
    config = structure.config
    flag = getattr(config, "alibi", None)
    if flag is None:
        flag = getattr(getattr(config, "attn_config", None), "alibi", None)
    if flag is None:
        flag = any(mentions_alibi(cls) for cls in structure.classes)
    attention = [module for decoder in structure.decoders for module in decoder.attention]
    if flag and attention and all(packed_forward_for(type(module)) for module in attention):
        return None  # bloom, mpt: their attention is replaced by one that applies ALiBi per sample
    if flag:
        return (
            "it adds ALiBi position biases computed from positions along the whole row, which the packed attention "
            "helper does not apply per sample"
        )
    return None


# Keyword arguments of the attention call that the packed helper applies
# (:func:`unpack_trainer.patches.attention.packed_attention_forward`: the scale, causality, and the keyword of every
# feature a backend or the dispatch serves), and those that carry no term of the attention (the mask, which the samples
# replace; the packing metadata; flags).
APPLIED_TERMS = frozenset(
    {"scaling", "is_causal", *(feature.keyword for feature in AttentionFeature if feature.keyword is not None)}
)
NOT_TERMS = frozenset(
    {
        "attention_mask",
        "position_ids",
        *METADATA_KEYS,
        "output_attentions",
        "use_cache",
        "layer_idx",
    }
)
# The attention function's own arguments, before the keywords: (module, query, key, value, attention_mask).
_LEADING_ARGUMENTS = 5


def _own_attention_calls(structure: ModelStructure) -> Iterator[tuple[torch.nn.Module, AttentionCall]]:
    """``(module, its attention call)`` for one attention module of each class that goes through the attention
    interface (not ALiBi: :func:`_alibi` decides; nor bloom's and mpt's packed forwards, which apply their bias per
    sample), where the call can be read."""
    seen: set[type] = set()
    for decoder in structure.decoders:
        for module in decoder.attention:
            cls = type(module)
            if cls in seen or packed_forward_for(cls) is not None or mentions_alibi(cls):
                continue
            seen.add(cls)
            call = attention_call(cls)
            if call is not None:
                yield module, call


def _corrected_by_patch(module: torch.nn.Module, argument: str) -> bool:
    """llama4's queries, scaled by positions along the row in its NoPE layers (attention temperature tuning): its fix
    (:mod:`unpack_trainer.models.fixes.llama4`) rescales them per sample; in its RoPE layers the scaling does not
    run."""
    return argument == "query" and hasattr(module, "attn_temperature_tuning")


def _row_positions(structure: ModelStructure) -> str | None:
    """An attention module that computes a term from positions it counts itself along the row (an ``arange`` over
    the row's length: Inkling's relative position bias and query scaling), or hands the attention function a
    ``position_bias`` of its own: on a packed row those positions run across samples. Read from the source of the
    attention's ``forward`` (:func:`~unpack_trainer.anatomy.structure.attention_call`), through its decorators."""
    for module, call in _own_attention_calls(structure):
        arguments = [a for a in call.row_positions if not _corrected_by_patch(module, a)]
        if arguments:
            return (
                f"its attention ({call.method}) computes {', '.join(arguments)} from positions it counts along the "
                "whole row (arange), not from each sample's position_ids: on a packed row they count on across "
                "sample boundaries"
            )
        if "position_bias" in call.keywords:
            return (
                f"its attention ({call.method}) adds a position bias (position_bias) computed from token offsets "
                "along the whole row, which the packed attention helper does not apply per sample"
            )
    return None


def _dropped_terms(structure: ModelStructure) -> str | None:
    """An attention module that hands the attention function a term the packed helper does not apply (a keyword
    outside :data:`APPLIED_TERMS` and :data:`NOT_TERMS` that the ``forward`` never leaves ``None``), or whose eager
    reference requires one: the helper would drop it."""
    for _, call in _own_attention_calls(structure):
        known = APPLIED_TERMS | NOT_TERMS
        terms = [
            f"{name}={value}"
            for name, value in call.keywords.items()
            if name not in known and name not in call.optional
        ]
        for eager in call.eager:
            for parameter in list(inspect.signature(eager).parameters.values())[_LEADING_ARGUMENTS:]:
                required = parameter.default is inspect.Parameter.empty and parameter.kind in (
                    parameter.POSITIONAL_OR_KEYWORD,
                    parameter.KEYWORD_ONLY,
                )
                if required and parameter.name not in known and parameter.name not in call.keywords:
                    terms.append(f"{parameter.name} (required by {eager.__name__})")
        if terms:
            return (
                f"its attention ({call.method}) hands the attention function {', '.join(terms)}, a term the packed "
                "attention helper does not apply"
            )
    return None


def _unowned_mixer(structure: ModelStructure) -> str | None:
    for mixer in structure.mixers:
        if handler_for(mixer) is None:
            reason = f"its {mixer.describe()} carries state along the row, across sample boundaries"
            return reason if mixer.problem is None else f"{reason}, and cannot run per sample: {mixer.problem}"
    return None


def _layer_without_attention(structure: ModelStructure) -> str | None:
    for decoder in structure.decoders:
        owned = {id(mixer.module) for mixer in decoder.mixers if handler_for(mixer) is not None}
        mixing = set(map(id, decoder.attention)) | owned
        layer_types = getattr(decoder.module.config, "layer_types", None) or ()
        for index, layer in enumerate(decoder.layers):
            if index < len(layer_types) and layer_types[index] in PER_TOKEN_LAYER_TYPES:
                continue  # an MLP or mixture-of-experts layer: mixes no tokens
            if not any(id(m) in mixing for m in layer.modules()):
                return (
                    f"decoder layer {index} ({type(layer).__name__}) has no attention module that goes through "
                    "transformers' attention interface, so it mixes tokens some other way"
                )
    return None


def _unsupported_feature(structure: ModelStructure) -> str | None:
    config = structure.config
    for decoder in structure.decoders:
        if attention_chunks(decoder) is None:
            return (
                f"its layers attend within chunks of attention_chunk_size={config.attention_chunk_size} tokens "
                "(chunked attention), but which layers do does not show (no config.layer_types naming "
                "'chunked_attention' layers, or attention modules without layer_idx)"
            )
        for module in decoder.attention:
            for name, child in module.named_modules():
                if "Indexer" in type(child).__name__:
                    return (
                        f"its sparse attention indexer ({type(child).__name__}, {name}) picks keys from the dense "
                        "mask of the whole row inside the attention module, outside the attention interface"
                    )
    return None


def _mask_unreachable(structure: ModelStructure) -> str | None:
    if structure.mask_builders or structure.decoders:
        return None
    return (
        f"{type(structure.pretrained).__name__} does not build its attention mask through transformers' mask "
        f"functions ({', '.join(MASK_BUILDERS[:2])}, ...), so a packed batch would still get a dense mask"
    )


def _attention_unreachable(structure: ModelStructure) -> str | None:
    if structure.decoders:
        return None
    named = ", ".join(sorted({cls.__name__ for cls in structure.classes if "Attention" in cls.__name__}))
    return (
        f"its attention ({named or 'none found'}) does not call transformers' attention interface "
        "(ALL_ATTENTION_FUNCTIONS), so the packed helper cannot reach it"
    )


# The checks in order: the first reason found refuses the model, with its kind.
REFUSAL_CHECKS: tuple[tuple[RefusalKind, Callable[[ModelStructure], str | None]], ...] = (
    (RefusalKind.BLOCKLIST, _blocklisted),
    (RefusalKind.BIDIRECTIONAL, _bidirectional),
    (RefusalKind.BIDIRECTIONAL, image_block_problem),
    (RefusalKind.POSITIONS, multi_axis_problem),
    (RefusalKind.UNSUPPORTED, decoders_problem),
    (RefusalKind.ALIBI, _alibi),
    (RefusalKind.POSITIONS, _row_positions),
    (RefusalKind.STATE, _unowned_mixer),
    (RefusalKind.STATE, _layer_without_attention),
    (RefusalKind.UNSUPPORTED, _unsupported_feature),
    (RefusalKind.UNSUPPORTED, _dropped_terms),
    (RefusalKind.UNREACHABLE, _mask_unreachable),
    (RefusalKind.UNREACHABLE, _attention_unreachable),
)


def check_model(model: torch.nn.Module) -> ModelStructure:
    """What ``model`` is made of (:func:`~unpack_trainer.anatomy.structure.discover`), once every check passed.

    Raises:
        PatchRefused: the first check of :data:`REFUSAL_CHECKS` that finds a reason, with its kind.
        TypeError: ``model`` holds no transformers ``PreTrainedModel``.
    """
    structure = discover(model, runs_attention=packed_forward_for)
    for kind, check in REFUSAL_CHECKS:
        reason = check(structure)
        if reason is not None:
            raise PatchRefused(structure.model_type, reason, kind)
    return structure


def refusal_reason(model_config: Any, *, blocking_only: bool = True) -> str | None:
    """Why a model of ``model_config`` cannot be packed exactly, found from its structure before any forward.

    The model is built on the ``meta`` device (no memory, no weights) and inspected as
    :func:`~unpack_trainer.models.patch_model` would. With ``blocking_only`` (the trainer's use), only reasons that
    make packing wrong are returned (:attr:`RefusalKind.blocking`: a token mixer that carries state across samples,
    ALiBi, a blocklisted type). ``None`` also when the configuration cannot be built here (e.g. remote code): the
    self-check then guards it.
    """
    model_type = getattr(model_config, "model_type", None)
    if model_type in BLOCKLIST:
        return BLOCKLIST[model_type]
    try:
        key = (type(model_config), model_config.to_json_string(use_diff=False))
    except Exception:  # noqa: BLE001 - not a transformers config: nothing to build
        return None
    if key not in _refusals:
        if len(_refusals) > 64:
            _refusals.clear()
        _refusals[key] = _structural_refusal(model_config)
    refused = _refusals[key]
    if refused is None or (blocking_only and not refused.kind.blocking):
        return None
    return refused.reason


# (config class, config JSON) -> the refusal its structure gives (None: patchable or not buildable here).
_refusals: dict[tuple[type, str], PatchRefused | None] = {}


def _structural_refusal(model_config: Any) -> PatchRefused | None:
    try:
        check_model(meta_model(model_config))
    except PatchRefused as refused:
        return refused
    except Exception:  # noqa: BLE001 - an unbuildable config is no refusal; the self-check still runs
        return None
    return None
