"""Packed attention: every sample of a packed row attends only to itself, at the cost of the samples alone, on one of
the backends of :data:`~unpack_trainer.patches.attention.registry.REGISTRY` (its docstring tells the whole story)."""

from unpack_trainer.patches.attention import dispatch, registry
from unpack_trainer.patches.attention._common import AttentionBackend, AttentionFeature, CallOptions, Needs, logger
from unpack_trainer.patches.attention.dispatch import *  # noqa: F403  (each module's __all__: one list, not two in step)
from unpack_trainer.patches.attention.registry import *  # noqa: F403

__all__ = [
    *registry.__all__,
    *dispatch.__all__,
    "AttentionBackend",
    "AttentionFeature",
    "CallOptions",
    "Needs",
    "logger",
]
