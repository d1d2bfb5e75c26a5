"""transformers names that moved between releases, each found by feature (no version numbers).

- The KV cache keyword of a model's ``forward``: ``cache`` since transformers 5.24 (``past_key_values`` stays a
  deprecated alias until 5.40, renamed by a decorator before the model's own code runs), ``past_key_values`` before:
  :data:`CACHE_KEYWORDS`, :func:`cache_argument`, :func:`cache_keyword`, :func:`output_cache`; how many tokens a cache
  holds, for a cache of recurrent states too (:func:`cache_length`). A hook on a decoder
  sees whichever name the outer model passed.
- Activation checkpointing on a ``PreTrainedModel``: ``activation_checkpointing_enable`` / ``_disable`` /
  ``is_activation_checkpointing`` since 5.24, ``gradient_checkpointing_*`` before (deprecated in 5.24, with a
  ``FutureWarning`` per call): :func:`checkpointing_enabled`, :func:`enable_checkpointing`,
  :func:`disable_checkpointing`.

When transformers drops an old name, this is the one file to change.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CACHE_KEYWORDS",
    "cache_argument",
    "cache_keyword",
    "cache_length",
    "checkpointing_enabled",
    "disable_checkpointing",
    "enable_checkpointing",
    "output_cache",
]

# The KV cache keyword of a model's forward: the current name first.
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The KV cache in a forward's keyword arguments under either name of :data:`CACHE_KEYWORDS`, or ``None``."""
    for name in CACHE_KEYWORDS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def cache_keyword(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache under (``cache`` or ``past_key_values``)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in parameters), CACHE_KEYWORDS[-1])


def output_cache(output: Any) -> Any:
    """The cache a model's forward returned: its output's ``cache`` field (transformers 5.24), ``past_key_values`` or,
    for state-space models before 5.24, ``cache_params``; read without touching a deprecated alias."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    name = next((name for name in (*CACHE_KEYWORDS, "cache_params") if name in fields), CACHE_KEYWORDS[-1])
    return getattr(output, name, None)


def cache_length(cache: Any) -> int:
    """How many tokens ``cache`` already holds; 0 for ``None`` or an object without ``get_seq_length``.

    A cache of recurrent states only (Mamba's since transformers 5.24) keeps no sequence length, and its
    ``get_seq_length`` raises ``ValueError``: it counts as 1 once it holds a state (it has seen tokens), else 0.
    """
    get_seq_length = getattr(cache, "get_seq_length", None)
    if not callable(get_seq_length):
        return 0
    try:
        return int(get_seq_length())
    except ValueError:
        has_previous_state = getattr(cache, "has_previous_state", None)
        return int(bool(has_previous_state())) if callable(has_previous_state) else 0


def _method(model: Any, new: str, old: str) -> Any:
    return getattr(model, new, None) or getattr(model, old)


def checkpointing_enabled(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on for ``model`` (a ``PreTrainedModel``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    """Turn activation checkpointing on, with ``kwargs`` for ``torch.utils.checkpoint`` (``{"use_reentrant": False}``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: Any) -> None:
    """Turn activation checkpointing off."""
    _method(model, "activation_checkpointing_disable", "gradient_checkpointing_disable")()
