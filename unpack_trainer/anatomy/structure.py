"""What a transformers model is made of, found from the model itself (no list of architectures).

- **The decoder**: the innermost module whose class builds its attention mask through transformers' mask functions
  (:data:`MASK_BUILDERS`) and holds attention modules.
- **The attention modules**: modules of the decoder whose class looks its attention function up in
  ``ALL_ATTENTION_FUNCTIONS`` (so the patch reaches them through ``AttentionInterface``), or whose class the caller
  says the package runs itself (``discover(model, runs_attention=...)``: the classes a model-family fix gives a packed
  forward, :mod:`unpack_trainer.models.fixes.alibi`'s bloom and mpt).
- **The decoder layers**: the longest ``ModuleList`` directly under the decoder.
- **The token mixers** (:func:`find_token_mixers`): modules other than attention that mix tokens along the row and
  carry state from one token to the next (recurrent / state-space scans, causal convolutions). Whether one can be
  packed exactly is :mod:`unpack_trainer.models.mixers`'s question, whether that refuses the model
  :mod:`unpack_trainer.models.refusals`'.
- **What an attention module hands its attention function** (:func:`attention_call`): the keyword terms of the call,
  and which of its arguments it computes from positions it counts itself along the row, read from the source of its
  ``forward``; every read of modeling code goes through the decorators around it (:func:`unwrapped`).

Everything here only reads the model (it also works on a model built on the ``meta`` device) and raises nothing but
``TypeError`` for an object that holds no transformers model.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "AttentionCall",
    "Decoder",
    "ModelStructure",
    "TokenMixer",
    "attention_call",
    "attention_chunks",
    "auto_model_class",
    "cross_attention_modules",
    "discover",
    "eager_attention_function",
    "find_token_mixers",
    "meta_model",
    "pretrained_model",
]

# Mask builders of transformers.masking_utils a patchable decoder calls (the mask interface is what we replace).
MASK_BUILDERS = (
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
)
# Layer types (config.layer_types) of decoder layers that mix no tokens: an MLP or a mixture of experts alone.
PER_TOKEN_LAYER_TYPES = ("mlp", "moe")


# --------------------------------------------------------------------------------------------------------------------
# What a class refers to
# --------------------------------------------------------------------------------------------------------------------


def code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return names


def unwrapped(function: Any, name: str | None = None) -> Any:
    """The function a chain of decorators wraps (the modeling code itself), or ``function`` when it wraps none.

    Follows ``__wrapped__`` (decorators built with ``functools.wraps``, such as transformers' ``deprecate_kwarg``)
    and, given the ``name`` the method is stored under, a wrapper that does not set it: a function of another name
    whose closure holds one function called ``name``. A check that reads the wrapper's code reads the decorator's
    instead (transformers 5.24 decorated ``InklingAttention.forward``, which hid its ``position_bias`` from a check
    that read ``__code__`` directly).
    """
    seen: set[int] = set()
    while id(function) not in seen:
        seen.add(id(function))
        function = inspect.unwrap(function)
        code = getattr(function, "__code__", None)
        if name is None or code is None or code.co_name == name:
            break
        inner = []
        for cell in getattr(function, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, types.FunctionType) and value.__code__.co_name == name:
                inner.append(value)
        if len(inner) != 1:
            break
        function = inner[0]
    return function


def transformers_methods(cls: type) -> Iterator[tuple[type, str, types.FunctionType]]:
    """``(defining class, attribute name, function)`` for every method ``cls`` defines or inherits from transformers'
    modeling code (``transformers.models.*``), unwrapped (:func:`unwrapped`); static and class methods and property
    getters included, most derived class first."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers.models."):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            if not callable(value):
                continue
            function = unwrapped(value, name)
            if isinstance(getattr(function, "__code__", None), types.CodeType):
                yield klass, name, function


def _function_references(function: Any, seen: set[int]) -> dict[str, Any]:
    """Global names ``function`` uses -> their objects, following module-level helpers of transformers' models."""
    function = unwrapped(function)
    code = getattr(function, "__code__", None)
    if code is None or id(code) in seen:
        return {}
    seen.add(id(code))
    namespace = getattr(function, "__globals__", {})
    found: dict[str, Any] = {}
    for name in code_names(code):
        if name not in namespace:
            continue
        value = namespace[name]
        found[name] = value
        if isinstance(value, types.FunctionType) and value.__module__.startswith("transformers.models."):
            found.update(_function_references(value, seen))
    return found


@functools.cache
def class_references(cls: type) -> dict[str, Any]:
    """Global names used by the methods ``cls`` defines or inherits from transformers' modeling code."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for _, _, function in transformers_methods(cls):
        found.update(_function_references(function, seen))
    return found


def mentions(cls: type, attribute: str) -> bool:
    """Whether a method of ``cls`` (from transformers' modeling code) reads an attribute named ``attribute``."""
    return any(attribute in code_names(function.__code__) for _, _, function in transformers_methods(cls))


@functools.cache
def eager_attention_function(cls: type) -> Callable[..., Any]:
    """The eager attention function a module class falls back to: the ``*eager_attention_forward`` its ``forward``
    passes to ``ALL_ATTENTION_FUNCTIONS.get_interface`` (looked up where that ``forward`` is defined), else its
    modeling file's ``eager_attention_forward``, else Llama's."""
    forward = inspect.unwrap(getattr(cls, "forward", None))
    code, namespace = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
    if code is not None:
        named = [n for n in dict.fromkeys(code.co_names) if n.endswith("eager_attention_forward") and n in namespace]
        if len(named) == 1:
            return namespace[named[0]]
    function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if function is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as function
    return function


def uses_attention_interface(cls: type) -> bool:
    """Whether ``cls`` looks its attention function up in transformers' ``ALL_ATTENTION_FUNCTIONS``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return any(value is ALL_ATTENTION_FUNCTIONS for value in class_references(cls).values())


def builds_mask_with_transformers(cls: type) -> bool:
    """Whether ``cls`` builds its attention mask with one of transformers' :data:`MASK_BUILDERS`."""
    from transformers import masking_utils

    builders = {id(getattr(masking_utils, name)) for name in MASK_BUILDERS if hasattr(masking_utils, name)}
    return any(id(value) in builders for value in class_references(cls).values())


def mask_without_positions(cls: type) -> str | None:
    """``"Class.method"`` of the first method of ``cls`` (transformers' modeling code) that builds a mask with one of
    :data:`MASK_BUILDERS` without ``position_ids`` at hand (BERT's ``_create_attention_masks``), or ``None``. Such a
    mask cannot be transformers' packed block mask, which is found from ``position_ids``."""
    for klass, _, function in transformers_methods(cls):
        code = function.__code__
        if set(MASK_BUILDERS) & set(code.co_names) and "position_ids" not in code.co_varnames:
            return f"{klass.__name__}.{code.co_name}"
    return None


def mentions_alibi(cls: type) -> bool:
    """Whether ``cls``'s code uses a global whose name mentions ALiBi (``build_alibi_tensor``, ...)."""
    return any("alibi" in name.lower() for name in class_references(cls))


# --------------------------------------------------------------------------------------------------------------------
# What an attention module hands its attention function
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCall:
    """What an attention class's ``forward`` hands the attention function it looks up in ``ALL_ATTENTION_FUNCTIONS``
    (read from the source of the ``forward``, through its decorators: :func:`attention_call`).

    Attributes:
        method: ``"Class.forward"``, where that ``forward`` is defined.
        keywords: keyword name -> the source of its value, for every keyword argument of the call (``**kwargs`` left
            out), in the order written.
        optional: the keywords whose value the ``forward`` also sets to ``None`` (a term computed in some
            configurations only, such as a sparse indexer's block indices).
        row_positions: the arguments (``"query"``, ``"key"``, ``"value"`` or a keyword) computed from positions the
            ``forward`` counts itself along the row (an ``arange`` over the row's length), not from ``position_ids``:
            on a packed row those positions run across samples instead of restarting at each sample's start. A
            fallback ``if position_ids is None: position_ids = arange(...)`` is not counted (a packed batch carries
            ``position_ids``).
        eager: the eager attention functions the lookup falls back to (the reference of what the attention applies).
    """

    method: str
    keywords: dict[str, str]
    optional: frozenset[str]
    row_positions: tuple[str, ...]
    eager: tuple[types.FunctionType, ...]


_POSITIONAL = ("query", "key", "value")  # the attention function's arguments after the module


def _is_arange(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "arange") or (
        isinstance(func, ast.Name) and func.id == "arange"
    )


def _names_in(node: ast.AST) -> set[str]:
    """The bare names read or assigned anywhere in ``node`` (an expression, or an assignment target)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _none_fallbacks(tree: ast.AST) -> set[int]:
    """ids of the assignments inside ``if X is None:`` that assign ``X`` (a default for a missing input)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if not isinstance(node, ast.If) or not isinstance(test, ast.Compare) or not isinstance(test.left, ast.Name):
            continue
        if not (len(test.ops) == 1 and isinstance(test.ops[0], ast.Is)):
            continue
        if not (isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
            continue
        for statement in node.body:
            for child in ast.walk(statement):
                if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                    if any(test.left.id in _names_in(t) for t in targets):
                        found.add(id(child))
    return found


def _row_position_names(tree: ast.AST) -> set[str]:
    """Local names whose value derives from an ``arange`` in ``tree``, following the assignments in source order
    (branches are not told apart, and a tainted name stays tainted when it is bound again); a tuple assigned from a
    tuple pairs its elements."""
    skipped = _none_fallbacks(tree)
    assignments = sorted(
        (
            node
            for node in ast.walk(tree)
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            and node.value is not None
            and id(node) not in skipped
        ),
        key=lambda node: (node.lineno, node.col_offset),
    )

    def derived(value: ast.AST) -> bool:
        return any(_is_arange(n) for n in ast.walk(value)) or bool(_names_in(value) & tainted)

    tainted: set[str] = set()
    for node in assignments:
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            value = node.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                pairs = list(zip(target.elts, value.elts))
            else:
                pairs = [(target, value)]
            for part, part_value in pairs:
                if derived(part_value):
                    tainted |= _names_in(part)
    return tainted


@functools.cache
def attention_call(cls: type) -> AttentionCall | None:
    """What ``cls.forward`` hands its attention function (see :class:`AttentionCall`); ``None`` when ``cls`` has no
    ``forward`` in transformers' modeling code, its source cannot be read, or it makes no such call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    found = next(((klass, f) for klass, name, f in transformers_methods(cls) if name == "forward"), None)
    if found is None:
        return None
    klass, function = found
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    namespace = function.__globals__
    interface = {name for name, value in namespace.items() if value is ALL_ATTENTION_FUNCTIONS}
    # Local names bound to the looked-up function, and the eager functions the lookup names.
    bound: set[str] = set()
    eager: dict[int, types.FunctionType] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            names = _names_in(node.value)
            functions = [namespace[n] for n in names if isinstance(namespace.get(n), types.FunctionType)]
            # the fallback of a lookup (``get_interface(impl, eager_attention_forward)``), or a default bound first
            eager_here = [f for f in functions if names & interface or f.__name__.endswith("attention_forward")]
            if names & interface or eager_here:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound |= set().union(*map(_names_in, targets))
                eager.update((id(f), f) for f in eager_here)
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ((isinstance(node.func, ast.Name) and node.func.id in bound) or _names_in(node.func) & interface)
    ]
    if not calls:
        return None
    assigned_none = {
        name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Constant)
        and node.value.value is None
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for name in _names_in(target)
    }
    row = _row_position_names(tree)
    keywords: dict[str, str] = {}
    optional: set[str] = set()
    row_positions: list[str] = []
    for call in calls:
        # (module, query, key, value, attention_mask, ...): the first positional argument is the module
        for label, argument in zip(_POSITIONAL, call.args[1:4]):
            if _names_in(argument) & row and label not in row_positions:
                row_positions.append(label)
        for keyword in call.keywords:
            if keyword.arg is None:
                continue
            keywords.setdefault(keyword.arg, ast.unparse(keyword.value))
            value_names = _names_in(keyword.value)
            if (isinstance(keyword.value, ast.Constant) and keyword.value.value is None) or (
                isinstance(keyword.value, ast.Name) and keyword.value.id in assigned_none
            ):
                optional.add(keyword.arg)
            if value_names & row and keyword.arg not in row_positions:
                row_positions.append(keyword.arg)
    return AttentionCall(
        method=f"{klass.__name__}.forward",
        keywords=keywords,
        optional=frozenset(optional),
        row_positions=tuple(row_positions),
        eager=tuple(eager.values()),
    )


# --------------------------------------------------------------------------------------------------------------------
# The model, its decoders, layers, attention modules and token mixers
# --------------------------------------------------------------------------------------------------------------------


def pretrained_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``PreTrainedModel`` inside ``model`` (itself, or the model a ``PeftModel`` wraps).

    Raises:
        TypeError: ``model`` is no ``torch.nn.Module`` or holds no ``PreTrainedModel``.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"patch_model expects a torch.nn.Module, got {type(model).__name__}.")
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(
        f"patch_model expects a transformers PreTrainedModel (or a PeftModel wrapping one), got {type(model).__name__}."
    )


def auto_model_class(config: Any) -> type:
    """The transformers auto class that builds a trainable model of ``config``: ``AutoModelForImageTextToText`` for a
    vision-language config (a ``vision_config``), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def meta_model(config: Any) -> torch.nn.Module:
    """The trainable model ``config`` describes (:func:`auto_model_class`), built on the ``meta`` device: its
    structure without memory or weights, to be read, with transformers' and this package's notices quiet.

    Raises:
        Exception: whatever transformers raises for a config it cannot build.
    """
    from unpack_trainer._logging import quiet_loggers

    with torch.device("meta"), quiet_loggers():
        return auto_model_class(config).from_config(config)


def cross_attention_modules(decoder: torch.nn.Module) -> set[int]:
    """ids of the cross-attention modules of ``decoder`` (run on an encoder's outputs, only when the forward gets
    them): a module flagged ``is_cross_attention`` and everything under it, and classes named ``*CrossAttention``."""
    found = set()
    for module in decoder.modules():
        if getattr(module, "is_cross_attention", False) is True or "CrossAttention" in type(module).__name__:
            found.update(map(id, module.modules()))
    return found


def model_type_of(pretrained: torch.nn.Module) -> str:
    """``config.model_type``, or the class name where the config has none."""
    return getattr(pretrained.config, "model_type", None) or type(pretrained).__name__


def layers_of(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the longest ``ModuleList`` directly under the decoder."""
    lists = [child for child in decoder.children() if isinstance(child, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


@dataclass
class TokenMixer:
    """A module other than attention that mixes tokens and carries state along the row: the unit that runs per sample
    on packed rows (see :func:`find_token_mixers`).

    Attributes:
        name: its qualified name under the decoder module (``"layers.0.conv"``).
        module: the module.
        what: ``"convolution"`` or ``"recurrent / state-space"``.
        layer: the decoder layer that holds it (``None`` for a mixer outside the layers).
        problem: why it cannot run per sample, in words (``None``: it can).
    """

    name: str
    module: torch.nn.Module
    what: str
    layer: torch.nn.Module | None = None
    problem: str | None = None

    def describe(self) -> str:
        """``"convolution token mixer ShortConv (layers.0.conv)"``."""
        return f"{self.what} token mixer {type(self.module).__name__} ({self.name})"


def _outermost_without_attention(module: torch.nn.Module, holds_attention: dict[int, bool]) -> list[torch.nn.Module]:
    """The highest descendants of ``module`` (which holds attention) that hold no attention module, in module order."""
    found = []
    for child in module.children():
        if holds_attention[id(child)]:
            found.extend(_outermost_without_attention(child, holds_attention))
        else:
            found.append(child)
    return found


def _mixer_what(module: torch.nn.Module) -> str | None:
    """What kind of token mixer ``module`` is or holds (the first found in module order), or ``None``."""
    from unpack_trainer.patches.mixers import mixer_kind

    return next((kind for kind in map(mixer_kind, module.modules()) if kind is not None), None)


def find_token_mixers(
    decoder: torch.nn.Module, layers: list[torch.nn.Module], attention_classes: list[type]
) -> list[TokenMixer]:
    """The token mixers of ``decoder``, as the units that run per sample on packed rows, in module order.

    A token mixer is a module whose class names a state-carrying mixer (Mamba, SSM, ShortConv, DeltaNet,
    LinearAttention, Lightning, RG-LRU, RWKV, LSTM, ...), a ``torch.nn.ConvNd``, or a module owning state-space
    parameters (``A_log``, ``dt_bias``): :func:`unpack_trainer.patches.mixers.mixer_kind`. Per decoder layer, the unit
    is the layer's child that holds a mixer, when that child holds no attention module (``linear_attn``, ``mamba``,
    ``conv``, ...); inside an attention module, each mixer's outermost ancestor that holds no attention (a projection
    with its convolutions, a short convolution; attention keeps running packed); a layer named after its mixer family
    with no mixer child, the layer itself. A bare convolution inside an attention module must be a depthwise causal
    ``nn.Conv1d``; a mixer outside the layers cannot be reached: both get a :attr:`TokenMixer.problem`.

    Args:
        decoder: the module the names are relative to (the decoder, or the model that receives the batch).
        layers: the decoder layers, in order.
        attention_classes: the classes that go through ``ALL_ATTENTION_FUNCTIONS``.
    """
    from unpack_trainer.patches.mixers import conv_problem, mixer_kind

    names = {id(module): name for name, module in decoder.named_modules()}
    mixers: list[TokenMixer] = []
    for layer in layers:
        holds_attention = {id(m): any(type(x) in attention_classes for x in m.modules()) for m in layer.modules()}
        found_in_layer = False
        for child in layer.children():
            what = _mixer_what(child)
            if what is None:
                continue
            found_in_layer = True
            if not holds_attention[id(child)]:
                mixers.append(TokenMixer(names[id(child)], child, what, layer))
                continue
            for module in _outermost_without_attention(child, holds_attention):
                what = _mixer_what(module)
                if what is None:
                    continue
                problem = None
                if isinstance(module, torch.nn.modules.conv._ConvNd):
                    problem = conv_problem(module)
                    if problem is not None:
                        problem = f"inside the attention module {type(child).__name__}, {problem}"
                mixers.append(TokenMixer(names[id(module)], module, what, layer, problem))
        if not found_in_layer and mixer_kind(layer) is not None and not holds_attention[id(layer)]:
            mixers.append(TokenMixer(names[id(layer)], layer, mixer_kind(layer), layer))
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    for name, module in decoder.named_modules():
        what = mixer_kind(module)
        if what is not None and id(module) not in in_layers:
            mixers.append(
                TokenMixer(
                    name, module, what, None, "it sits outside the decoder layers, where no packed path reaches"
                )
            )
    return mixers


@dataclass
class Decoder:
    """A patchable decoder: the innermost module that builds its mask through transformers and holds attention.

    Attributes:
        module: the decoder module (``LlamaModel``, the text model of a multimodal model, ...).
        attention: its attention modules (each goes through ``ALL_ATTENTION_FUNCTIONS``, or the package runs it
            itself), in module order.
        layers: its decoder layers (:func:`layers_of`).
        mixers: its token mixers (:func:`find_token_mixers`).
    """

    module: torch.nn.Module
    attention: list[torch.nn.Module]
    layers: list[torch.nn.Module] = field(default_factory=list)
    mixers: list[TokenMixer] = field(default_factory=list)


def attention_chunks(decoder: Decoder) -> list[int | None] | None:
    """The chunk size each attention module of ``decoder`` attends in (chunked attention, llama4), ``None`` for a
    module that does not; ``None`` in place of the list when the decoder builds a chunked mask but which layers use
    it does not show (no ``config.layer_types``, or a module without ``layer_idx``).

    A layer attends in chunks when the decoder builds transformers' chunked mask (``create_chunked_causal_mask``),
    ``config.attention_chunk_size`` is set and ``config.layer_types`` names the layer ``"chunked_attention"``.
    """
    from transformers import masking_utils

    config = decoder.module.config
    chunk = getattr(config, "attention_chunk_size", None)
    builder = getattr(masking_utils, "create_chunked_causal_mask", None)
    if not chunk or not any(value is builder for value in class_references(type(decoder.module)).values()):
        return [None] * len(decoder.attention)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or any(not isinstance(getattr(m, "layer_idx", None), int) for m in decoder.attention):
        return None
    return [int(chunk) if layer_types[m.layer_idx] == "chunked_attention" else None for m in decoder.attention]


@dataclass
class ModelStructure:
    """What :func:`discover` found in a model.

    Attributes:
        pretrained: the ``PreTrainedModel``.
        model_type: ``config.model_type``.
        classes: every module class of the model, once each, in module order.
        attention_classes: the classes of those that go through ``ALL_ATTENTION_FUNCTIONS`` or that the package runs
            itself (``runs_attention``).
        mask_builders: the innermost modules that build their mask through transformers' :data:`MASK_BUILDERS`.
        mixers: the token mixers of the decoders (of the whole model when it has none).
        decoders: the mask builders that hold attention modules or token mixers, as :class:`Decoder`; without mask
            builders, a decoder of token mixers only (its module the ``PreTrainedModel``).
    """

    pretrained: torch.nn.Module
    model_type: str
    classes: list[type]
    attention_classes: list[type]
    mask_builders: list[torch.nn.Module]
    mixers: list[TokenMixer]
    decoders: list[Decoder]

    @property
    def config(self) -> Any:
        return self.pretrained.config


def discover(model: torch.nn.Module, *, runs_attention: Callable[[type], Any] | None = None) -> ModelStructure:
    """What ``model`` (a ``PreTrainedModel``, or a ``PeftModel`` wrapping one) is made of; see the module docstring.
    ``runs_attention(cls)``: truthy for an attention class outside transformers' interface that the package runs
    itself (its modules then count as attention modules).

    Raises:
        TypeError: ``model`` holds no transformers ``PreTrainedModel``.
    """
    pretrained = pretrained_model(model)
    modules = list(model.modules())
    classes = list(dict.fromkeys(type(module) for module in modules))
    attention_classes = [
        cls for cls in classes if uses_attention_interface(cls) or (runs_attention is not None and runs_attention(cls))
    ]
    builders = [m for m in modules if builds_mask_with_transformers(type(m))]
    innermost = [
        candidate
        for candidate in builders
        # not the innermost (e.g. the multimodal wrapper around the text model)
        if not any(other is not candidate and other in set(candidate.modules()) for other in builders)
    ]
    decoders = []
    mixers: list[TokenMixer] = []
    for candidate in innermost:
        attention = [m for m in candidate.modules() if type(m) in attention_classes]
        layers = layers_of(candidate)
        found = find_token_mixers(candidate, layers, attention_classes)
        mixers.extend(found)
        if attention or found:
            decoders.append(Decoder(candidate, attention, layers, found))
    if not innermost:
        decoder = _mixer_only_decoder(pretrained, modules, attention_classes)
        if decoder is not None:
            decoders.append(decoder)
            mixers.extend(decoder.mixers)
        else:
            mixers = find_token_mixers(model, [], attention_classes)
    return ModelStructure(
        pretrained=pretrained,
        model_type=model_type_of(pretrained),
        classes=classes,
        attention_classes=attention_classes,
        mask_builders=innermost,
        mixers=mixers,
        decoders=decoders,
    )


def _mixer_only_decoder(
    pretrained: torch.nn.Module, modules: list[torch.nn.Module], attention_classes: list[type]
) -> Decoder | None:
    """A decoder of token mixers only that builds no mask (Mamba, RWKV, xLSTM, ...): the innermost module whose every
    decoder layer holds a mixer. Its hook goes on the ``PreTrainedModel`` that receives the batch (these models do
    not hand the packing keywords down to their backbone); ``None`` when there is none."""
    for candidate in reversed(modules):  # innermost first
        layers = layers_of(candidate)
        if layers and all(_mixer_what(layer) is not None for layer in layers):
            return Decoder(pretrained, [], layers, find_token_mixers(pretrained, layers, attention_classes))
    return None
