"""Which token mixers can hand a packed row to their installed kernels' own varlen entry points, read from their code.

transformers' hybrid and state-space models call their sequence kernels through module-level functions decorated with
``use_kernel_func_from_hub_with_fallback`` (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``,
``mamba2_chunk_scan``, ...): each resolves, once at import, to the installed package's kernel (causal-conv1d,
flash-linear-attention, mamba-ssm; or a hub kernel when the ``kernels`` package is installed) or to transformers' torch
fallback. The kernels keep the samples of a packed row apart when they are told where each one starts:

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
pass ``**kwargs`` to every kernel; Kimi linear passes ``**kwargs`` to ``chunk_kda`` (so ``cu_seqlens`` itself); Zamba
and the Inkling convolutions pass ``seq_idx=kwargs.get("seq_idx")``; Mamba / Jamba / Falcon-Mamba call
``selective_scan_fn`` with no metadata at all.

:func:`varlen_plan` reads that from the mixer class (the calls its methods make to such functions, parsed from its
source) and from the functions themselves (which implementation is installed and which varlen arguments it takes):
the keywords the mixer's forward must receive for every sequence kernel it calls to get its varlen argument, or why it
cannot be done. The single-token decode steps (``causal_conv1d_update``, ``selective_state_update``,
``fused_recurrent_*``) only run with a cache, which packed forwards never have, and are not considered.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KERNEL_DEVICE_TYPES",
    "KernelEntry",
    "VarlenPlan",
    "kernel_entry",
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


def _fallback_wrapper(obj: Any) -> Callable[..., Any] | None:
    """transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper inside ``obj`` (the function itself, or the
    ``nn.Module`` the ``kernels`` package turns it into), or ``None``."""
    if isinstance(obj, torch.nn.Module):
        forward = getattr(type(obj), "forward", None)
        closure = inspect.getclosurevars(forward).nonlocals if inspect.isfunction(forward) else {}
        obj = closure.get("func")
    if not inspect.isfunction(obj):
        return None
    names = obj.__code__.co_freevars
    if {"implementation", "is_new_implementation", "torch_function", "func_name", "package"} <= set(names):
        return obj
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
    forward = vars(obj).get("forward") if isinstance(obj, torch.nn.Module) else None
    if forward is not None and getattr(forward, "__func__", None) is not type(obj).forward:
        # kernelize put a hub kernel layer's forward on this instance (it puts the class's own back where it has none)
        installed, implementation = True, vars(obj)["forward"]
    accepts = tuple(name for name in VARLEN_PARAMETERS if name in _parameters(implementation)) if installed else ()
    return KernelEntry(hub_name, _DISTRIBUTIONS.get(package, package), installed, accepts)


@dataclass(frozen=True)
class _CallSite:
    """A call in a mixer method to a global function (``name``): the varlen arguments it passes explicitly (parameter
    -> the forward keyword it reads them from, ``None`` where that does not show) and whether it passes ``**dict``."""

    method: str
    name: str
    explicit: tuple[tuple[str, str | None], ...]
    keywords: tuple[str, ...]
    splat: bool


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
def _call_sites(cls: type) -> tuple[tuple[_CallSite, dict[str, Any]], ...]:
    """The calls to global functions in the methods ``cls`` defines or inherits from transformers' modeling code, each
    with the globals of its method (the module's own dict: a global replaced later is seen)."""
    sites: list[tuple[_CallSite, dict[str, Any]]] = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers.models."):
            continue
        for attribute, value in vars(klass).items():
            function = inspect.unwrap(value) if inspect.isfunction(value) else None
            if function is None:
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
            except (OSError, TypeError, SyntaxError):
                continue
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                explicit = tuple(
                    (k.arg, _keyword_read(k.value)) for k in node.keywords if k.arg in VARLEN_PARAMETERS
                )
                keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
                splat = any(k.arg is None for k in node.keywords)
                sites.append((_CallSite(attribute, node.func.id, explicit, keywords, splat), function.__globals__))
    return tuple(sites)


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
    """

    keywords: tuple[tuple[str, str], ...]
    kernels: tuple[str, ...]
    reason: str | None


def varlen_plan(module: torch.nn.Module) -> VarlenPlan:
    """Whether, and with which forward keywords, the mixer ``module`` runs a packed row through its installed kernels'
    own varlen support (see the module docstring); read from its class's code and the functions it calls now."""
    cls = type(module)
    calls = [(site, kernel_entry(namespace.get(site.name))) for site, namespace in _call_sites(cls)]
    calls = [(site, e) for site, e in calls if e is not None and not DECODE_STEP_NAMES.search(e.hub_name)]
    kernels = tuple(dict.fromkeys(f"{entry.hub_name} ({entry.distribution})" for _, entry in calls))
    if not calls:
        return VarlenPlan((), (), f"{cls.__name__} calls no kernel with a varlen entry point")
    missing = [entry for _, entry in calls if not entry.installed]
    if missing:
        names = ", ".join(dict.fromkeys(f"`{e.hub_name}` ({e.distribution} is not installed)" for e in missing))
        return VarlenPlan((), kernels, f"transformers' torch fallback runs for {names}")
    keys: dict[str, str] = {}
    for site, entry in calls:
        if not entry.accepts:
            return VarlenPlan((), kernels, f"the installed `{entry.hub_name}` takes neither seq_idx nor cu_seqlens")
        explicit = [(parameter, key) for parameter, key in site.explicit if parameter in entry.accepts]
        if explicit:
            parameter, key = explicit[0]
            if key is None:
                return VarlenPlan(
                    (), kernels, f"{cls.__name__}.{site.method} passes `{parameter}` to `{entry.hub_name}` from no "
                    "keyword argument"
                )
            keys.setdefault(key, parameter)
        elif site.splat:
            parameter = next(p for p in entry.accepts if p not in site.keywords)
            keys.setdefault(parameter, parameter)
        else:
            return VarlenPlan(
                (), kernels, f"{cls.__name__}.{site.method} hands `{entry.hub_name}` no packing metadata"
            )
    for site, entry in calls:  # a keyword added to **kwargs must not collide with one the call passes itself
        clash = [key for key in keys if site.splat and key in site.keywords]
        if clash:
            return VarlenPlan(
                (), kernels, f"{cls.__name__}.{site.method} passes `{clash[0]}` to `{entry.hub_name}` twice"
            )
    return VarlenPlan(tuple(keys.items()), kernels, None)
