"""The fused RoPE for packed positions, where a model applies RoPE exactly as Llama does.

Where the modeling module of an attention class defines ``apply_rotary_pos_emb`` and ``rotate_half`` with Llama's
code (compared bytecode to bytecode, through any replacement already made), the module's ``apply_rotary_pos_emb`` is
replaced by :func:`unpack_trainer.patches.rope.apply_rotary_pos_emb` (same signature and result, a fused kernel where
Triton runs). The modeling module is shared by every model of its family, so the original is restored when the last
patched decoder using the replacement is unpatched or collected, unless another library replaced it since
(Liger-Kernel's RoPE, applied by ``use_liger_kernel=True`` when training starts, stays; and a function another library
put there is never replaced: only transformers' own). Installed with ``patch_model(rope=True)`` (the
default).

Since transformers 5.25 (with its ``kernels`` dependency) ``apply_rotary_pos_emb`` is decorated with
``use_kernel_forward_from_hub("rotary_pos_emb")``: the module's global is an ``nn.Module`` instance that calls the
function unless a model's ``kernelize`` chose a hub kernel for it. The function inside is compared as above
(:func:`unpack_trainer._compat.hub_kernel_function`), the global is replaced by the fused function made into a module
the same way (``kernels`` rebuilds the layers' copies from the global's type when a model is deep-copied or
unpickled) and restored as above, and a model whose attention layers run a hub kernel chosen by ``kernelize``
(``from_pretrained(use_kernels=True)``) keeps it. Where a modeling module has an ``apply_rotary_pos_emb`` the fix does
not replace, :func:`rope_reasons` says why; the reason is logged once when the patch is installed (a warning where the
function cannot be read at all) and ``unpack-trainer env --model`` prints it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import types
import weakref
from typing import Any

from unpack_trainer._compat import hub_kernel_chosen, hub_kernel_function
from unpack_trainer._logging import log_once
from unpack_trainer.models.fixes.record import Fix, FixSite

__all__ = ["FIX", "rope_reasons"]

logger = logging.getLogger("unpack_trainer.models")

# modeling module name -> its original RoPE function, and the live decoders using the replacement.
_originals: dict[str, Any] = {}
_users: dict[str, weakref.WeakSet] = {}


def _same_code(a: Any, b: Any) -> bool:
    a, b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if a is None or b is None:
        return False

    def key(code: types.CodeType) -> tuple:
        consts = tuple(c for c in code.co_consts if not isinstance(c, (str, types.CodeType)))
        return code.co_code, code.co_names, code.co_varnames, consts

    return key(a) == key(b)


def _why_not(site: FixSite, name: str) -> tuple[int, str] | None:
    """Why the RoPE of the modeling module ``name`` is not replaced, with the level to log it at, or ``None`` where it
    is (or would be). The module has an ``apply_rotary_pos_emb`` (else there is nothing to say: not asked)."""
    from transformers.models.llama import modeling_llama as llama

    modeling = sys.modules[name]
    current = _originals.get(name, modeling.apply_rotary_pos_emb)  # ours installed: the function it replaced
    function = hub_kernel_function(current)
    if function is None:
        return logging.WARNING, (  # the fused kernel would be lost without a word
            f"{name}.apply_rotary_pos_emb is a {type(current).__module__}.{type(current).__qualname__} whose function "
            "this release of unpack_trainer cannot read, so it cannot tell whether it is Llama's RoPE"
        )
    if not function.__module__.startswith("transformers."):
        return logging.INFO, (
            f"{name}.apply_rotary_pos_emb is {function.__module__}.{function.__qualname__}, another library's: it runs"
        )
    reference = hub_kernel_function(_originals.get(llama.__name__, llama.apply_rotary_pos_emb))
    if not (_same_code(function, reference) and _same_code(getattr(modeling, "rotate_half", None), llama.rotate_half)):
        return logging.DEBUG, f"{name} applies RoPE otherwise than Llama: its own code runs"
    chosen = next(
        (repo for module in site.decoder.attention if (repo := hub_kernel_chosen(module, "apply_rotary_pos_emb"))),
        None,
    )
    if chosen is not None:
        return logging.INFO, f"the model's kernelize chose the hub kernel {chosen} for its RoPE: it runs"
    return None


def _survey(site: FixSite) -> dict[str, tuple[int, str] | None]:
    """:func:`_why_not` of each modeling module of ``site``'s attention layers that defines
    ``apply_rotary_pos_emb``."""
    names = dict.fromkeys(type(module).__module__ for module in site.decoder.attention)
    return {
        name: _why_not(site, name)
        for name in names
        if sys.modules.get(name) is not None and getattr(sys.modules[name], "apply_rotary_pos_emb", None) is not None
    }


def rope_reasons(site: FixSite) -> dict[str, str | None]:
    """For each modeling module of ``site``'s attention layers that defines ``apply_rotary_pos_emb``: why the fused
    RoPE does not replace it, or ``None`` where it does (or would, once installed)."""
    return {name: None if why is None else why[1] for name, why in _survey(site).items()}


def _modeling_modules(site: FixSite) -> list[str]:
    return [name for name, why in _survey(site).items() if why is None]


def _applies(site: FixSite) -> str | None:
    if not site.state.rope:
        return None
    modules = []
    for name, why in _survey(site).items():
        if why is None:
            modules.append(name)
        else:
            log_once(logger, why[0], f"unpack_trainer: the fused RoPE is not applied: {why[1]}.")
    return f"{', '.join(modules)} applies Llama's RoPE" if modules else None


@functools.cache
def _fused_function_module() -> Any:
    """The fused RoPE as the ``kernels`` package makes a function into a module (transformers' own
    ``use_kernel_forward_from_hub``), for a modeling module whose original is one: ``kernels`` rebuilds the layers'
    copies of it from the type of the module's global when a model is unpickled or deep-copied, so the replacement
    must be of that kind too."""
    from transformers.integrations import use_kernel_forward_from_hub

    from unpack_trainer.patches.rope import apply_rotary_pos_emb

    return use_kernel_forward_from_hub("rotary_pos_emb")(apply_rotary_pos_emb)


def _replacement(original: Any) -> Any:
    """What replaces ``original`` (transformers' RoPE of one modeling module): the fused function where it is a
    function, the fused function module where it is a ``kernels`` function module."""
    from unpack_trainer.patches.rope import apply_rotary_pos_emb

    return apply_rotary_pos_emb if inspect.isfunction(original) else _fused_function_module()


def _install(site: FixSite) -> None:
    modules = _modeling_modules(site)
    for name in modules:
        modeling = sys.modules[name]
        if name not in _originals:
            _originals[name] = modeling.apply_rotary_pos_emb
            modeling.apply_rotary_pos_emb = _replacement(modeling.apply_rotary_pos_emb)
        _users.setdefault(name, weakref.WeakSet()).add(site.module)
        # A patched model that is garbage collected without unpatch_model releases the RoPE function too.
        weakref.finalize(site.module, _release, name)
    site.state.undo["rope"] = modules


def _release(name: str) -> None:
    """Restore the modeling module's RoPE function once no live patched decoder uses the replacement."""
    users = _users.get(name)
    if users is not None and next(iter(users), None) is not None:  # iterating skips decoders being collected
        return
    if name in _originals:
        from unpack_trainer.patches.rope import apply_rotary_pos_emb

        original = _originals.pop(name)
        modeling = importlib.import_module(name)
        # another library's since (Liger-Kernel's) stays
        if hub_kernel_function(modeling.apply_rotary_pos_emb) is apply_rotary_pos_emb:
            modeling.apply_rotary_pos_emb = original


def _remove(site: FixSite) -> None:
    for name in site.state.undo.pop("rope", ()):
        users = _users.get(name)
        if users is not None:
            users.discard(site.module)
        _release(name)


FIX = Fix("rope", _applies, _install, _remove)
