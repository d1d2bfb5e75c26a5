"""The private names of torch that the patches use, in one place, each with what it is for and when it can go."""

from __future__ import annotations

import contextlib

__all__ = ["recompile_limit_at_least"]


def recompile_limit_at_least(limit: int) -> contextlib.AbstractContextManager:
    """A context in which ``torch.compile`` recompiles a function up to ``limit`` times (its default is 8) before it
    falls back to eager: the flex attention backend compiles once per shape class and mask variant, which a long run
    can exceed. ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before torch 2.7) has no public
    equivalent; without either, nothing changes."""
    from torch._dynamo import config

    for name in ("recompile_limit", "cache_size_limit"):
        current = getattr(config, name, None)
        if isinstance(current, int):
            return config.patch(**{name: max(limit, current)})
    return contextlib.nullcontext()
