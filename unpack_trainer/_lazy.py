"""A package face whose public names are imported on first use (PEP 562): ``import unpack_trainer`` (and
``unpack_trainer.models``, ``unpack_trainer.trainers``) imports neither torch nor transformers, and patches nothing."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the face of ``package``: ``exports`` maps each public name to the module that
    defines it, imported when the name is first read; the name is then kept in the package's namespace. Any other
    name is an ``AttributeError``, as for a module without it.

    Example::

        __getattr__ = lazy_exports(__name__, {"patch_model": "unpack_trainer.models.patch"})
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
