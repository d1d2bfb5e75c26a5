"""The fused RoPE for packed positions, where a model applies RoPE exactly as Llama does.

Where the modeling module of an attention class defines ``apply_rotary_pos_emb`` and ``rotate_half`` with Llama's
code (compared bytecode to bytecode, through any replacement already made), the module's ``apply_rotary_pos_emb`` is
replaced by :func:`unpack_trainer.patches.rope.apply_rotary_pos_emb` (same signature and result, a fused kernel where
Triton runs). The modeling module is shared by every model of its family, so the original is restored when the last
patched decoder using the replacement is unpatched or collected, unless another library replaced it since
(Liger-Kernel's RoPE, applied by ``use_liger_kernel=True`` when training starts, stays; and a function another library
put there is never replaced: only transformers' own). Installed with ``patch_model(rope=True)`` (the
default).
"""

from __future__ import annotations

import importlib
import sys
import types
import weakref
from typing import Any

from unpack_trainer.models.fixes.record import Fix, FixSite

__all__ = ["FIX"]

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


def _llama_rope_module(modeling: types.ModuleType) -> bool:
    """Whether ``modeling`` applies RoPE exactly as Llama does (``apply_rotary_pos_emb`` and ``rotate_half``), with
    transformers' own function: one another library put there (Liger-Kernel's) is left to run."""
    from transformers.models.llama import modeling_llama as llama

    function = _originals.get(modeling.__name__, getattr(modeling, "apply_rotary_pos_emb", None))
    reference = _originals.get(llama.__name__, llama.apply_rotary_pos_emb)  # Llama's own may be replaced now
    return (
        getattr(function, "__module__", "").startswith("transformers.")
        and _same_code(function, reference)
        and _same_code(getattr(modeling, "rotate_half", None), llama.rotate_half)
    )


def _modeling_modules(site: FixSite) -> list[str]:
    names = dict.fromkeys(type(module).__module__ for module in site.decoder.attention)
    return [name for name in names if sys.modules.get(name) is not None and _llama_rope_module(sys.modules[name])]


def _applies(site: FixSite) -> str | None:
    if not site.state.rope:
        return None
    modules = _modeling_modules(site)
    return f"{', '.join(modules)} applies Llama's RoPE" if modules else None


def _install(site: FixSite) -> None:
    from unpack_trainer.patches.rope import apply_rotary_pos_emb

    modules = _modeling_modules(site)
    for name in modules:
        modeling = sys.modules[name]
        if name not in _originals:
            _originals[name] = modeling.apply_rotary_pos_emb
            modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
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
        if modeling.apply_rotary_pos_emb is apply_rotary_pos_emb:  # another library's since (Liger-Kernel's) stays
            modeling.apply_rotary_pos_emb = original


def _remove(site: FixSite) -> None:
    for name in site.state.undo.pop("rope", ()):
        users = _users.get(name)
        if users is not None:
            users.discard(site.module)
        _release(name)


FIX = Fix("rope", _applies, _install, _remove)
