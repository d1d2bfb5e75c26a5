"""What is installed on a model on top of the patch, and how :func:`unpack_trainer.models.unpatch_model` takes it off.

A piece installed on a patched model after the patch itself (a sequence-classification model's score hooks, the
prompt-sharing view and compact LM head of :mod:`unpack_trainer.trainers.branched`) registers its undo on the module it
changed: a module-level function ``undo(module)``, kept in the module's ``__dict__``, so that a deep copy of the model
keeps it and it acts on the copy. ``unpatch_model`` calls every one once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["add_undo", "run_undos"]

# On any submodule: the functions ``undo(module)`` that run_undos calls once.
UNDO_ATTRIBUTE = "_unpack_trainer_undo"


def add_undo(module: Any, undo: Callable[[Any], None]) -> None:
    """Have :func:`run_undos` (``unpatch_model``) call ``undo(module)`` once."""
    module.__dict__.setdefault(UNDO_ATTRIBUTE, []).append(undo)


def run_undos(model: Any) -> None:
    """Call, once, every undo registered on ``model`` or one of its submodules (a ``torch.nn.Module``)."""
    for module in model.modules():
        for undo in module.__dict__.pop(UNDO_ATTRIBUTE, ()):
            undo(module)
