"""Which token mixers can hand a packed row to their installed kernels' own varlen entry points, read from their code.

transformers' hybrid and state-space models call their sequence kernels through module-level functions decorated with
``use_kernel_func_from_hub_with_fallback`` (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``,
``mamba2_chunk_scan``, ...): each resolves, once at import, to the installed package's kernel (causal-conv1d,
flash-linear-attention, mamba-ssm) or to transformers' torch fallback; from transformers 5.25 it runs the package only
on the device types the package supports and takes the torch fallback elsewhere (which refuses ``seq_idx`` /
``cu_seqlens``; :data:`KERNEL_DEVICE_TYPES` keeps the varlen path to CUDA). The kernels keep the samples of a packed
row apart when they are told where each one starts:

===========================================  ==========================  =============================================
kernel (package)                             varlen argument             shape, dtype
===========================================  ==========================  =============================================
``causal_conv1d_fn`` (causal-conv1d)          ``seq_idx``                 ``(batch, seqlen)`` int32, sample index
``mamba_chunk_scan_combined``,               ``seq_idx``                 ``(batch, seqlen)`` int32, sample index
``mamba_split_conv1d_scan_combined``
(mamba-ssm)
``chunk_gated_delta_rule``, ``chunk_kda``    ``cu_seqlens``              ``(num_seqs + 1,)`` int32, batch of 1
(flash-linear-attention)
===========================================  ==========================  =============================================

and the model's forward hands them on from its own keyword arguments, each family its way: Qwen3.5 / Qwen3-Next /
OLMo hybrid pass ``cu_seqlens=kwargs.pop("cu_seq_lens_q")`` to the gated delta rule and ``**kwargs`` (hence
``seq_idx``) to the convolution; the Mamba2 mixers (Bamba, Granite 4, Nemotron-H, Falcon-H1, Zamba2, Mamba2) and LFM2
pass ``**kwargs`` to every kernel; Kimi linear passes ``**kwargs`` to ``chunk_kda`` (so ``cu_seqlens`` itself);
Mamba / Jamba / Falcon-Mamba call ``selective_scan_fn`` (or the fused ``mamba_inner_fn``) with no metadata at all.
Up to transformers 5.24 a mixer's methods call the kernels themselves (Zamba and the Inkling convolutions with
``seq_idx=kwargs.get("seq_idx")``); from 5.25 they call module-level helpers, themselves decorated with
``use_kernel_forward_from_hub``, which call the kernels with the ``**kwargs`` they receive: e.g. LFM2's
``causal_conv1d_forward(self.conv, hidden_states, cache, self.layer_idx, **kwargs)`` calls
``causal_conv1d_fn(..., **kwargs)``, Granite 4's ``mamba2_scan_forward(self, ..., **kwargs)`` calls
``mamba2_chunk_scan(..., **kwargs)``.

:func:`varlen_plan` reads that from the mixer class (the calls its methods make to such functions, parsed from its
source and followed into the module-level helpers of transformers' modeling code they call, at most
:data:`HELPER_DEPTH` helpers deep) and from the functions themselves (which implementation is installed and which
varlen arguments it takes): the keywords the mixer's forward must receive for every sequence kernel it calls to get its
varlen argument, or why it cannot be done. A forward keyword reaches a kernel inside a helper only through an unbroken
chain of ``**kwargs`` splats (and not past a helper that takes it as a named parameter): ``seq_idx=kwargs.get(...)``
inside a helper reads the forward's keyword only then, and a kernel called inside a helper reached without the splat
gets no packing metadata. The single-token decode steps (``causal_conv1d_update``, ``selective_state_update``,
``fused_recurrent_*``) only run with a cache, which packed forwards never have, and are not considered.

What it reads of transformers and ``kernels`` that is not public API, each recognised by its shape (no version checks):

- the closure of the ``use_kernel_func_from_hub_with_fallback`` wrapper (its free variables ``implementation``,
  ``is_new_implementation``, ``torch_function``, ``func_name``, ``package``): which implementation runs;
- with the ``kernels`` package installed (transformers 5.25), the ``nn.Module`` instance ``kernels``'
  ``use_kernel_forward_from_hub`` makes of a decorated function, kernel or helper (``_create_func_module``: its class
  ``forward`` closes over the function as ``func``; read through :func:`unpack_trainer._compat.hub_kernel_function`),
  and the ``forward`` ``kernelize`` sets on such an instance when it chose a hub kernel for it (an instance attribute
  that is not the class's own ``forward``): a kernel so replaced runs that forward, a helper so replaced is not
  followed;
- the per-layer copies of those instances ``kernels``' ``use_kernelized_func`` keeps on a mixer (``_kernel_funcs``,
  each an instance of its global's own class): the mixer's forward dispatches a call to the global to its copy, and
  ``kernelize`` replaces the copy's forward, not the global's, so the copy is what is read.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from unpack_trainer._compat import hub_kernel_function, kernel_function_copies

__all__ = [
    "HELPER_DEPTH",
    "KERNEL_DEVICE_TYPES",
    "REPLACED_WHEN_MISSING",
    "KernelEntry",
    "VarlenPlan",
    "kernel_entry",
    "masked_causal_taps",
    "packed_causal_conv1d",
    "replaced_kernels",
    "varlen_plan",
]

# Device types the installed varlen kernels run on (Triton / CUDA kernels; ROCm builds of torch report "cuda" too).
KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# The varlen arguments of the kernels, in order of preference when a call passes ``**kwargs`` and the kernel takes
# both (mamba-ssm's ``mamba_chunk_scan_combined`` separates samples by ``seq_idx``; its ``cu_seqlens`` only selects
# per-sample final states).
VARLEN_PARAMETERS = ("seq_idx", "cu_seqlens")
# Kernels that advance a cached state by one step (decode with a cache; never reached by a packed forward).
DECODE_STEP_NAMES = re.compile(r"_update$|^fused_recurrent")
# Package import names whose distribution is named otherwise (as transformers' hub_kernels names them).
_DISTRIBUTIONS = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}
# How many calls into module-level helpers of transformers' modeling code the call-site analysis follows from a mixer
# method (transformers 5.25: ``forward -> mamba2_scan_forward -> mamba2_chunk_scan`` is one helper deep).
HELPER_DEPTH = 3
# Where transformers' modeling code lives: the classes and helpers the call-site analysis reads.
_MODELING = "transformers.models."


@dataclass(frozen=True)
class KernelEntry:
    """A sequence-kernel function of transformers' modeling code, as resolved in this process.

    Attributes:
        hub_name: the kernel's name (``"chunk_gated_delta_rule"``).
        distribution: the package that provides it (``"flash-linear-attention"``).
        installed: whether the function runs that package's (or a hub) kernel, not transformers' torch fallback.
        accepts: the varlen arguments (:data:`VARLEN_PARAMETERS`) the running implementation takes.
    """

    hub_name: str
    distribution: str
    installed: bool
    accepts: tuple[str, ...]


def _parameters(function: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _kernelized(obj: torch.nn.Module) -> bool:
    """Whether ``kernels``' ``kernelize`` put a hub kernel layer's forward on the function module ``obj`` (it puts the
    class's own forward back where it chose none)."""
    forward = vars(obj).get("forward")
    return forward is not None and getattr(forward, "__func__", None) is not type(obj).forward


def _fallback_wrapper(obj: Any) -> Callable[..., Any] | None:
    """transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper inside ``obj`` (the function itself, or the
    ``nn.Module`` the ``kernels`` package turns it into), or ``None``."""
    function = hub_kernel_function(obj)
    if function is None:
        return None
    names = function.__code__.co_freevars
    if {"implementation", "is_new_implementation", "torch_function", "func_name", "package"} <= set(names):
        return function
    return None


def kernel_entry(obj: Any) -> KernelEntry | None:
    """What ``obj`` (a global of a modeling module) runs, when it is a function transformers resolves to an installed
    kernel or its torch fallback; ``None`` for anything else.

    With the ``kernels`` package installed the function is an ``nn.Module`` whose ``forward`` a hub kernel may replace
    (``kernelize``); the replacing forward is then what runs, and its signature says what it takes.
    """
    wrapper = _fallback_wrapper(obj)
    if wrapper is None:
        return None
    closure = inspect.getclosurevars(wrapper).nonlocals
    hub_name, package = closure["func_name"], closure["package"]
    installed = bool(closure["is_new_implementation"])
    implementation = closure["implementation"]
    if isinstance(obj, torch.nn.Module) and _kernelized(obj):
        installed, implementation = True, vars(obj)["forward"]
    accepts = tuple(name for name in VARLEN_PARAMETERS if name in _parameters(implementation)) if installed else ()
    return KernelEntry(hub_name, _DISTRIBUTIONS.get(package, package), installed, accepts)


@dataclass(frozen=True)
class _Call:
    """A call to a global name (``name``) in one function's body: the varlen arguments it passes explicitly
    (parameter -> the keyword it reads them from, as ``kwargs.get("seq_idx")``; ``None`` where that does not show),
    the keywords it passes by name, and whether it passes ``**dict``."""

    name: str
    explicit: tuple[tuple[str, str | None], ...]
    keywords: tuple[str, ...]
    splat: bool


@dataclass(frozen=True)
class _CallSite:
    """A call to a sequence kernel (the global ``name``) reached from the mixer method ``method``, in its own body or
    inside the module-level helpers ``via`` (outermost first) it calls.

    Attributes:
        explicit: the varlen arguments the call passes explicitly: parameter -> the forward keyword it reads them
            from; ``None`` where that does not show (an expression, or the ``kwargs`` of a helper that did not receive
            the forward's).
        keywords: the keywords the call passes by name.
        splat: whether the forward's keyword arguments reach the kernel as ``**kwargs`` (every call on the way splats
            them, into helpers that take ``**kwargs``).
        via: the helpers the call is reached through, ``()`` in the method itself.
        dropped: the forward keywords a helper on the way takes as a named parameter (they go no further).
        clashing: the keywords passed by name by the calls on the way (this one included) that also splat the
            forward's keyword arguments: a keyword added to the forward's must be none of them.
    """

    method: str
    name: str
    explicit: tuple[tuple[str, str | None], ...]
    keywords: tuple[str, ...]
    splat: bool
    via: tuple[str, ...] = ()
    dropped: frozenset[str] = frozenset()
    clashing: tuple[str, ...] = ()

    def where(self, cls: type) -> str:
        """``"Lfm2ShortConv.forward"``, then the helpers the call is reached through."""
        through = f" (through {' -> '.join(f'`{name}`' for name in self.via)})" if self.via else ""
        return f"{cls.__name__}.{self.method}{through}"


def _keyword_read(node: ast.expr) -> str | None:
    """``"seq_idx"`` for ``kwargs.get("seq_idx")`` / ``kwargs.pop("seq_idx", None)`` / ``kwargs["seq_idx"]``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop"):
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return None


@functools.cache
def _calls(function: Callable[..., Any]) -> tuple[_Call, ...]:
    """The calls to global names in the body of ``function`` (its decorators left out), parsed from its source once;
    ``()`` where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return ()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.decorator_list = []
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        explicit = tuple((k.arg, _keyword_read(k.value)) for k in node.keywords if k.arg in VARLEN_PARAMETERS)
        keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
        splat = any(k.arg is None for k in node.keywords)
        calls.append(_Call(node.func.id, explicit, keywords, splat))
    return tuple(calls)


def _from_modeling_code(function: Any) -> bool:
    return (getattr(function, "__module__", None) or "").startswith(_MODELING)


@functools.cache
def _methods(cls: type) -> tuple[tuple[str, Callable[..., Any]], ...]:
    """``(name, function)`` of the methods ``cls`` defines or inherits from transformers' modeling code, unwrapped from
    their decorators (wrappers defined elsewhere, such as the ``__init__`` of ``kernels``' ``use_kernelized_func``,
    left out)."""
    methods = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith(_MODELING):
            continue
        for attribute, value in vars(klass).items():
            function = inspect.unwrap(value) if inspect.isfunction(value) else None
            if function is not None and _from_modeling_code(function):
                methods.append((attribute, function))
    return tuple(methods)


def _per_instance(module: torch.nn.Module) -> Callable[[Any], Any]:
    """``resolve(global) ->`` what a call to a modeling module's global runs inside ``module``'s forward: the copy
    ``kernels``' ``use_kernelized_func`` keeps of it on ``module`` (``_kernel_funcs``, an instance of the global's own
    class) where there is one, else the global itself."""
    wrappers = kernel_function_copies(module)
    copies = {type(copy): copy for copy in wrappers.values() if isinstance(copy, torch.nn.Module)}
    return lambda obj: copies.get(type(obj), obj) if isinstance(obj, torch.nn.Module) else obj


def _helper(obj: Any) -> Callable[..., Any] | None:
    """The function of transformers' modeling code a call to ``obj`` (what a modeling module's global runs) runs, when
    it is a helper to follow: a plain function, or the ``kernels`` function module of one whose forward no
    ``kernelize`` replaced; ``None`` for a sequence kernel or anything else."""
    if kernel_entry(obj) is not None or (isinstance(obj, torch.nn.Module) and _kernelized(obj)):
        return None
    function = hub_kernel_function(obj)
    return inspect.unwrap(function) if function is not None and _from_modeling_code(function) else None


def _keyword_parameters(function: Callable[..., Any]) -> tuple[frozenset[str], bool] | None:
    """The parameters of ``function`` a keyword argument binds to by name, and whether it takes ``**kwargs``; ``None``
    where its signature cannot be read."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    named = frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return named, any(p.kind is p.VAR_KEYWORD for p in parameters)


@dataclass(frozen=True)
class _Way:
    """How a call in a mixer method reaches the function being read: the helpers on the way (``via``), whether the
    function's ``kwargs`` are the forward's keyword arguments (``carried``), and what :class:`_CallSite` says of them
    (``dropped``, ``clashing``)."""

    via: tuple[str, ...] = ()
    carried: bool = True
    dropped: frozenset[str] = frozenset()
    clashing: tuple[str, ...] = ()


def _walk(
    function: Callable[..., Any],
    method: str,
    way: _Way,
    resolve: Callable[[Any], Any],
    found: list[tuple[_CallSite, KernelEntry, dict[str, Any]]],
) -> None:
    """Appends to ``found`` every sequence-kernel call in ``function`` (reached from ``method`` by ``way``) and in
    the helpers it calls, with the kernel's entry and the globals of the function that makes the call (the module's
    own dict: a global replaced later is seen)."""
    namespace = function.__globals__
    for call in _calls(function):
        obj = resolve(namespace.get(call.name))
        splat = way.carried and call.splat
        clashing = way.clashing + (call.keywords if splat else ())
        entry = kernel_entry(obj)
        if entry is not None:
            explicit = tuple(
                (parameter, key if way.carried and key not in way.dropped else None)
                for parameter, key in call.explicit
            )
            site = _CallSite(method, call.name, explicit, call.keywords, splat, way.via, way.dropped, clashing)
            found.append((site, entry, namespace))
            continue
        helper = _helper(obj) if len(way.via) < HELPER_DEPTH else None
        if helper is None or helper is function:
            continue
        parameters = _keyword_parameters(helper)
        if parameters is None:
            continue
        named, takes_kwargs = parameters
        inner = _Way((*way.via, call.name), splat and takes_kwargs, way.dropped | named, clashing)
        _walk(helper, method, inner, resolve, found)


def _call_sites(module: torch.nn.Module) -> list[tuple[_CallSite, KernelEntry, dict[str, Any]]]:
    """The sequence-kernel calls the methods of the mixer ``module`` make, in their bodies and through the
    module-level helpers of transformers' modeling code they call: each with the entry of what it runs now (the
    mixer's own copy of the kernel where ``kernels`` keeps one) and the globals of the function that makes it."""
    found: list[tuple[_CallSite, KernelEntry, dict[str, Any]]] = []
    resolve = _per_instance(module)
    for method, function in _methods(type(module)):
        _walk(function, method, _Way(), resolve, found)
    return found


# --------------------------------------------------------------------------------------------------------------------
# A causal convolution kept per sample where causal-conv1d is missing
# --------------------------------------------------------------------------------------------------------------------

# Sequence kernels this module runs varlen itself where their package is missing and the mixer's other sequence
# kernels are installed (Qwen3.5 / Qwen3-Next with flash-linear-attention but without causal-conv1d): hub name -> the
# varlen argument the replacement takes. transformers' torch fallback of ``causal_conv1d_fn`` refuses
# ``seq_idx``; :func:`packed_causal_conv1d` keeps the samples apart.
REPLACED_WHEN_MISSING: dict[str, str] = {"causal_conv1d_fn": "seq_idx"}


def _fla_causal_conv1d() -> Callable[..., Any] | None:
    """flash-linear-attention's varlen causal convolution (``fla.modules.convolution.causal_conv1d``, takes
    ``cu_seqlens``), or ``None`` when that package is not importable."""
    try:
        from fla.modules.convolution import causal_conv1d
    except Exception:  # noqa: BLE001 - missing, or a build that does not import here: the torch path serves
        return None
    return causal_conv1d


def masked_causal_taps(x: torch.Tensor, weight: torch.Tensor, keep: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A depthwise causal convolution whose taps stop at sample boundaries, without bias or activation.

    Args:
        x: ``(B, C, T)`` the packed rows, channels first.
        weight: ``(C, W)`` the depthwise kernel (tap ``s`` reads ``x[t - s]`` with ``weight[:, W - 1 - s]``).
        keep: for each shift ``1 <= s < W``, a ``(B, 1, T)`` mask in ``x``'s dtype, 1 where ``x[t - s]`` belongs to
            ``t``'s sample (its values at ``t < s`` do not matter: the shifted input is zero there).

    Returns:
        ``(B, C, T)``: ``y[t] = sum_{s < W} weight[:, W - 1 - s] * x[t - s] * keep(s)[t]`` (``keep(0)`` is 1), the
        products in that order. The exact torch path of :func:`packed_causal_conv1d` and
        :func:`unpack_trainer.patches.mixers.packed_conv1d`.
    """
    width, seq_len = weight.shape[-1], x.shape[-1]
    out = x * weight[:, width - 1 : width]
    for shift in range(1, min(width, seq_len)):
        shifted = torch.nn.functional.pad(x[..., : seq_len - shift], (shift, 0))
        out = out + shifted * keep(shift) * weight[:, width - 1 - shift : width - shift]
    return out


def packed_causal_conv1d(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    seq_idx: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` on packed samples: no tap reads across a sample boundary.

    Args:
        hidden_states: ``(B, C, T)``, channels first, the samples of each row back to back.
        weight: ``(C, W)`` the depthwise kernel; bias: ``(C,)`` or ``None``.
        activation: ``None``, ``"silu"`` or ``"swish"`` (applied after the convolution).
        seq_idx: ``(B, T)`` int32 on ``hidden_states``' device, the sample index of every token.
        cu_seqlens: ``(num_seqs + 1,)`` int32 of a batch of one row, or ``None``.

    Returns:
        ``(B, C, T)`` in ``hidden_states``' dtype: ``y[t] = act(bias + sum_{s < W, seq_idx[t - s] == seq_idx[t]}
        weight[:, W - 1 - s] * x[t - s])``, computed in ``weight``'s dtype as the torch fallback does.
        flash-linear-attention's varlen kernel (``cu_seqlens``) where it is importable and the tensors are on
        :data:`KERNEL_DEVICE_TYPES`; else an exact torch path: ``W`` shifted, masked multiply-adds over the row.
    """
    fla_conv = _fla_causal_conv1d()
    if fla_conv is not None and cu_seqlens is not None and hidden_states.device.type in KERNEL_DEVICE_TYPES:
        x = hidden_states.to(weight.dtype).transpose(1, 2)  # (1, T, C) in the weight's dtype, as the torch fallback
        out, _ = fla_conv(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens.long())
        return out.transpose(1, 2).to(hidden_states.dtype)
    x = hidden_states.to(weight.dtype)

    def same_sample(shift: int) -> torch.Tensor:  # (B, 1, T): x[t - shift] is in t's sample
        same = (seq_idx[:, shift:] == seq_idx[:, :-shift]).unsqueeze(1).to(x.dtype)
        return torch.nn.functional.pad(same, (shift, 0))

    out = masked_causal_taps(x, weight, same_sample)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation is not None:
        if activation not in ("silu", "swish"):
            raise ValueError(f"packed_causal_conv1d: activation {activation!r}; only silu / swish or None")
        out = torch.nn.functional.silu(out)
    return out.to(hidden_states.dtype)


def _replacement(original: Callable[..., Any], cu_seqlens: torch.Tensor | None) -> Callable[..., Any]:
    """What runs in place of ``original`` (transformers' ``causal_conv1d_fn`` resolved to its torch fallback) during
    one varlen forward: :func:`packed_causal_conv1d` when the call carries ``seq_idx``, ``original`` otherwise."""

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        if seq_idx is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return packed_causal_conv1d(hidden_states, weight, bias, activation, seq_idx, cu_seqlens)

    return causal_conv1d_fn


@contextlib.contextmanager
def replaced_kernels(plan: VarlenPlan, cu_seqlens: torch.Tensor | None) -> Iterator[None]:
    """While active, the module globals ``plan.replaced`` names run :func:`packed_causal_conv1d` for calls that carry
    ``seq_idx`` (the varlen forward of one mixer; restored right after, also on error)."""
    saved = []
    try:
        for module_name, name in plan.replaced:
            module = sys.modules[module_name]
            original = getattr(module, name)
            saved.append((module, name, original))
            setattr(module, name, _replacement(original, cu_seqlens))
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


@dataclass(frozen=True)
class VarlenPlan:
    """How a mixer class hands a packed row to its installed kernels' varlen entry points.

    Attributes:
        keywords: ``(keyword, varlen argument)`` pairs: the keywords its forward must receive and what each carries to
            the kernel (``"seq_idx"``: ``(1, total_tokens)`` int32, the sample index of every token;
            ``"cu_seqlens"``: ``(num_seqs + 1,)`` int32, zero-prefixed cumsum of the sample lengths), the rows
            flattened into one (flash-linear-attention takes a batch of 1). E.g. Qwen3.5:
            ``(("seq_idx", "seq_idx"), ("cu_seq_lens_q", "cu_seqlens"))``.
        kernels: the sequence kernels its forward calls, ``"name (distribution)"``.
        reason: why the varlen entry points cannot be used, in words; ``None`` when they can.
        replaced: ``(module, global name)`` of the kernels whose package is missing that run
            :func:`packed_causal_conv1d` instead during the varlen forward (:data:`REPLACED_WHEN_MISSING`).
    """

    keywords: tuple[tuple[str, str], ...]
    kernels: tuple[str, ...]
    reason: str | None
    replaced: tuple[tuple[str, str], ...] = ()


def varlen_plan(module: torch.nn.Module) -> VarlenPlan:
    """Whether, and with which forward keywords, the mixer ``module`` runs a packed row through its installed kernels'
    own varlen support (see the module docstring); read from its class's code, the helpers of transformers' modeling
    code it calls, and the functions those calls run now."""
    cls = type(module)
    found = [
        (site, e, namespace) for site, e, namespace in _call_sites(module) if not DECODE_STEP_NAMES.search(e.hub_name)
    ]
    calls = [(site, entry) for site, entry, _ in found]
    kernels = tuple(dict.fromkeys(f"{entry.hub_name} ({entry.distribution})" for _, entry in calls))
    if not calls:
        return VarlenPlan((), (), f"{cls.__name__} calls no kernel with a varlen entry point")
    missing = [entry for _, entry in calls if not entry.installed]
    replaced: dict[tuple[str, str], None] = {}
    if missing and len(missing) < len(calls) and all(e.hub_name in REPLACED_WHEN_MISSING for e in missing):
        # The mixer's other kernels are installed: the missing convolution runs packed_causal_conv1d instead.
        for index, (site, entry, namespace) in enumerate(found):
            if not entry.installed:
                replaced[(namespace["__name__"], site.name)] = None
                calls[index] = (site, replace(entry, accepts=(REPLACED_WHEN_MISSING[entry.hub_name],)))
        missing = []
    if missing:
        names = ", ".join(dict.fromkeys(f"`{e.hub_name}` ({e.distribution} is not installed)" for e in missing))
        return VarlenPlan((), kernels, f"transformers' torch fallback runs for {names}")
    keys: dict[str, str] = {}
    for site, entry in calls:
        if not entry.accepts:
            return VarlenPlan((), kernels, f"the installed `{entry.hub_name}` takes neither seq_idx nor cu_seqlens")
        explicit = [(parameter, key) for parameter, key in site.explicit if parameter in entry.accepts]
        # what a keyword added to the forward's **kwargs reaches, where the call passes none of them itself
        splatted = next((p for p in entry.accepts if p not in site.keywords and p not in site.dropped), None)
        if explicit:
            parameter, key = explicit[0]
            if key is None:
                return VarlenPlan(
                    (),
                    kernels,
                    f"{site.where(cls)} passes `{parameter}` to `{entry.hub_name}` from no keyword argument",
                )
            keys.setdefault(key, parameter)
        elif site.splat and splatted is not None:
            keys.setdefault(splatted, splatted)
        else:
            return VarlenPlan((), kernels, f"{site.where(cls)} hands `{entry.hub_name}` no packing metadata")
    for site, entry in calls:  # a keyword added to **kwargs must not collide with one a call on the way passes itself
        clash = [key for key in keys if key in site.clashing]
        if clash:
            return VarlenPlan((), kernels, f"{site.where(cls)} passes `{clash[0]}` to `{entry.hub_name}` twice")
    return VarlenPlan(tuple(keys.items()), kernels, None, tuple(replaced))
