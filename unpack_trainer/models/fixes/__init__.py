"""Model-family fixes: what a family needs beyond the generic patch, one module and one record each, listed once in
:data:`FIXES`.

:func:`unpack_trainer.models.patch_model` is generic: it finds the decoder, its attention modules and token mixers from
the model's structure and routes them through transformers' interfaces. What a family needs beyond that is a *fix*,
declared as one :class:`~unpack_trainer.models.fixes.record.Fix` record by one module of this package (a window
applied through the mask only, llama4's chunks and temperature, bloom's and mpt's ALiBi, RoBERTa-style positions, a
vision-language model's vision tower kept out of the packing, its multi-axis positions and image blocks, ...).
Each module's docstring says what its family does and how the fix makes it exact; :data:`FIXES` lists them.

The record (:mod:`~unpack_trainer.models.fixes.record`), each function handed a
:class:`~unpack_trainer.models.fixes.record.FixSite` ``site`` (``site.model`` the ``PreTrainedModel``, ``site.module``
the decoder module, ``site.state`` its :class:`~unpack_trainer.models.state.DecoderState`, ``site.decoder`` what the
decoder is made of, ``site.structure`` what the whole model is made of, found once by ``patch_model``; both ``None`` in
``remove``)::

    Fix(
        name,             # unique; recorded in state.fixes
        applies,          # site -> why the family needs it (a str, logged), or None where it does not; reads only
        install,          # site -> None; keeps in state.undo[name] what remove needs (names, hook ids, never a module)
        remove,           # site -> None; undoes install
        automatic=True,   # patch_model installs it wherever it applies; False: a trainer asks (install_fix)
        per_model=False,  # once per model (on its first decoder) instead of once per decoder
    )

What a fix may set: the decoder state's fields (``mask_placeholder``, ``no_dense_path``, ``undo``), an attention
module's :class:`~unpack_trainer.models.state.AttentionState` (``sliding_window``, ``attention_chunk_size``,
``query_correction``; read by the registered attention function), hooks (their ids in ``undo``), or a module's own
``forward`` (an instance attribute). The packed forward running now is ``site.state.running`` (``None`` outside one).
Fixes are installed in the order of :data:`FIXES` (one may read what an earlier one installed: ``outer_carry`` follows
``alibi``; ``multimodal_rope`` and ``image_blocks`` follow ``vision_language``) and removed in the reverse order.

Adding a fix is one module declaring ``FIX`` and one line in :data:`FIXES`; ``tests/models/fixes/test_fixes.py`` checks
that every module of this package is in the table and that every entry applies to a model it is tested on.
"""

from __future__ import annotations

import logging

from unpack_trainer.models.fixes import (
    alibi,
    classification_head,
    compact_lm_head,
    image_blocks,
    liger_loss,
    llama4,
    multimodal_rope,
    outer_carry,
    packed_view,
    positions,
    rope,
    sliding_window,
    vision_language,
)
from unpack_trainer.models.fixes.record import Fix, FixSite

__all__ = ["FIXES", "Fix", "FixSite", "fix_named", "install_fix", "install_fixes", "remove_fixes"]

logger = logging.getLogger("unpack_trainer.models")

# Every fix, in the order they are installed (and removed in reverse): one line each.
FIXES: tuple[Fix, ...] = (
    sliding_window.FIX,
    llama4.FIX,
    alibi.FIX,
    outer_carry.FIX,
    positions.FIX,
    vision_language.FIX,
    multimodal_rope.FIX,
    image_blocks.FIX,
    rope.FIX,
    classification_head.FIX,
    packed_view.FIX,
    compact_lm_head.FIX,
    liger_loss.FIX,
)


def fix_named(name: str) -> Fix:
    """The fix of :data:`FIXES` called ``name`` (how a decoder's state records it).

    Raises:
        KeyError: no fix of that name.
    """
    for fix in FIXES:
        if fix.name == name:
            return fix
    raise KeyError(f"no model-family fix {name!r}; known: {', '.join(fix.name for fix in FIXES)}")


def _install(fix: Fix, site: FixSite) -> None:
    if fix.name in site.state.fixes:
        return
    reason = fix.applies(site)
    if reason is None:
        return
    logger.debug("unpack_trainer: fix %r on %s: %s.", fix.name, type(site.module).__name__, reason)
    fix.install(site)
    site.state.fixes.append(fix.name)


def install_fixes(sites: list[FixSite]) -> None:
    """Install every automatic fix of :data:`FIXES` that applies, on each of ``sites`` (the decoders of one model, just
    patched; a ``per_model`` fix on the first only)."""
    for fix in FIXES:
        if fix.automatic:
            for site in sites[:1] if fix.per_model else sites:
                _install(fix, site)


def install_fix(name: str, sites: list[FixSite]) -> None:
    """Install the fix ``name`` (one a trainer asks for, ``automatic=False``) where it applies, as
    :func:`install_fixes` would; a no-op where it is installed already.

    Raises:
        KeyError: no fix of that name.
    """
    fix = fix_named(name)
    for site in sites[:1] if fix.per_model else sites:
        _install(fix, site)


def remove_fixes(site: FixSite) -> None:
    """Remove every fix installed on ``site``, in the reverse order of their installation."""
    for name in reversed(site.state.fixes):
        fix_named(name).remove(site)
    site.state.fixes.clear()
