"""The record every model-family fix declares (:class:`Fix`), and what its functions are handed (:class:`FixSite`).
The contract is told in :mod:`unpack_trainer.models.fixes`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from unpack_trainer.models.state import DecoderState

if TYPE_CHECKING:
    from unpack_trainer.anatomy.structure import Decoder, ModelStructure

__all__ = ["Fix", "FixSite", "forward_wrapping_fix"]


class FixSite(NamedTuple):
    """Where a fix applies: one patched decoder of one model.

    Attributes:
        model: the ``PreTrainedModel`` (under PEFT, the base model).
        module: the decoder module (``LlamaModel``, the text model of a multimodal model; the ``PreTrainedModel``
            itself for a decoder of token mixers only).
        state: the decoder's :class:`~unpack_trainer.models.state.DecoderState`; ``install`` keeps in
            ``state.undo[name]`` what ``remove`` needs (names, hook ids: a deep copy keeps them valid).
        decoder: what the decoder is made of (its attention modules, layers, token mixers), for ``applies`` and
            ``install``; ``None`` for ``remove`` (which works from ``module`` and ``state`` alone).
        structure: what the whole model is made of, as :func:`unpack_trainer.models.patch_model` found it once for
            all its decoders (hand it on to what would otherwise discover the model again, such as
            :func:`~unpack_trainer.anatomy.vision.find_vision_language`); ``None`` outside ``patch_model``.
    """

    model: torch.nn.Module
    module: torch.nn.Module
    state: DecoderState
    decoder: Decoder | None = None
    structure: ModelStructure | None = None


class Fix(NamedTuple):
    """One model-family fix.

    Attributes:
        name: unique; what ``state.fixes`` records (a copy of the model finds the record again by it).
        applies: ``(site) -> str | None``: why the fix is needed on this decoder, in words (logged at DEBUG), or
            ``None`` where it is not. Reads the model only.
        install: ``(site) -> None``: install it. Called once per site where ``applies`` gave a reason.
        remove: ``(site) -> None``: undo ``install`` (by :func:`unpack_trainer.models.unpatch_model`).
        automatic: whether :func:`unpack_trainer.models.patch_model` installs it wherever it applies; ``False`` for one
            a trainer asks for by name (:func:`unpack_trainer.models.fixes.install_fix`).
        per_model: installed once per model (on its first decoder), not once per decoder.
    """

    name: str
    applies: Callable[[FixSite], str | None]
    install: Callable[[FixSite], None]
    remove: Callable[[FixSite], None]
    automatic: bool = True
    per_model: bool = False

    def __repr__(self) -> str:
        return f"Fix({self.name!r})"


def forward_wrapping_fix(
    name: str, applies: Callable[[FixSite], str | None], wrap: Callable[[torch.nn.Module], None]
) -> Fix:
    """A fix a trainer asks for, once per model, that wraps the model's ``forward`` on the instance (TRL's fused LM
    head): ``wrap(model)`` sets ``model.forward``; ``remove`` gives back the instance ``forward`` it replaced (or none,
    the class's), kept in ``state.undo[name]``."""

    def install(site: FixSite) -> None:
        site.state.undo[name] = site.model.__dict__.get("forward")
        wrap(site.model)

    def remove(site: FixSite) -> None:
        if name not in site.state.undo:
            return
        replaced = site.state.undo.pop(name)
        if replaced is None:
            site.model.__dict__.pop("forward", None)
        else:
            site.model.forward = replaced

    return Fix(name, applies, install, remove, automatic=False, per_model=True)
