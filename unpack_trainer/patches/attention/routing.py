"""Registered attention functions: a packed batch goes to the packed helper, anything else to the model's own
attention implementation unchanged."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from unpack_trainer._compat import attention_functions
from unpack_trainer.packed_seq_info import INFO_KEY, OWN_KEYS, SEQ_LENGTHS_KEY, PackedSeqInfo
from unpack_trainer.patches.attention.dispatch import packed_attention_forward
from unpack_trainer.patches.attention.metadata import packed_info_from_kwargs
from unpack_trainer.patches.masks import current_packed_info

__all__ = ["make_attention_function"]


@functools.cache
def _eager_function_of_class(cls: type) -> Callable[..., Any]:
    """The eager attention function a module class falls back to: the ``*eager_attention_forward`` its ``forward``
    passes to ``ALL_ATTENTION_FUNCTIONS.get_interface`` (looked up where that ``forward`` is defined), else its
    modeling file's ``eager_attention_forward``, else Llama's."""
    forward = inspect.unwrap(getattr(cls, "forward", None))
    code, namespace = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
    if code is not None:
        named = [n for n in dict.fromkeys(code.co_names) if n.endswith("eager_attention_forward") and n in namespace]
        if len(named) == 1:
            return namespace[named[0]]
    function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if function is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as function
    return function


def _eager_function_of(module: torch.nn.Module) -> Callable[..., Any]:
    """The eager attention function of ``module``'s class (what transformers falls back to for "eager")."""
    return _eager_function_of_class(type(module))


def _routed_info(module: torch.nn.Module, query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> PackedSeqInfo | None:
    """The packing metadata a registered function routes on, or ``None`` (then it runs the stock function exactly).

    Only what marks a batch as packed by this package: ``packed_seq_info`` (the model hook's decision, ``None``
    meaning "not packed"), ``packed_seq_lengths``, or, for an attention module whose decoder does not hand its
    keyword arguments down, the packed forward the hook published for the module's config. Keys transformers itself
    passes (``cu_seq_lens_q``, ``position_ids``) never reroute a call, so an unpatched model sharing the registered
    name runs exactly as stock.
    """
    if INFO_KEY in kwargs:
        return kwargs[INFO_KEY]
    if kwargs.get(SEQ_LENGTHS_KEY) is not None:
        return packed_info_from_kwargs(query, key, None, kwargs)
    config = getattr(module, "config", None)
    return current_packed_info(config) if config is not None else None


def make_attention_function(
    original_implementation: str, *, fallback: Callable[..., Any] | None = None
) -> Callable[..., tuple[Tensor, Any]]:
    """An ``AttentionInterface`` function: packed batches (see :func:`_routed_info`) go to
    :func:`packed_attention_forward`, anything else to ``original_implementation`` ("sdpa", "eager",
    "flash_attention_2", ...) exactly as without the patch: ``fallback`` when given, else transformers' own function
    of that name (the class-wide registry, so the returned function can be registered under the same name)."""
    # Looked up here, not inside the forward: torch 2.11's dynamo cannot import transformers' lazy module while
    # tracing (compile with fullgraph=True failed there). The mapping is the registry's own dict, read per call.
    stock_functions = attention_functions()

    def unpack_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        info = _routed_info(module, query, key, kwargs)
        if info is not None:
            kwargs[INFO_KEY] = info
            if kwargs.get("sliding_window") is None and getattr(module, "_unpack_sliding_window", None):
                # The model applies this window through its mask only (set by unpack_trainer.models.patch_model).
                kwargs["sliding_window"] = module._unpack_sliding_window
            if getattr(module, "_unpack_attention_chunk", None):
                # The layer attends in chunks, through its mask only (set by unpack_trainer.models.patch_model).
                kwargs["attention_chunk_size"] = module._unpack_attention_chunk
            correction = getattr(module, "_unpack_query_correction", None)
            if correction is not None:
                # The layer scaled its queries by positions along the row (set by unpack_trainer.models.patch_model).
                query = correction(module, query, info)
            return packed_attention_forward(
                module, query, key, value, None, original_implementation=original_implementation, **kwargs
            )
        for name in OWN_KEYS:  # transformers' own functions do not know them
            kwargs.pop(name, None)
        if fallback is not None:
            function = fallback
        elif original_implementation == "eager":
            function = _eager_function_of(module)
        else:
            function = stock_functions[original_implementation]
        return function(module, query, key, value, attention_mask, **kwargs)

    unpack_attention_forward.original_implementation = original_implementation  # type: ignore[attr-defined]
    return unpack_attention_forward
