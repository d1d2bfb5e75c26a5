"""Model-level side of packed attention: detect a packed forward once, and build no ``(T, T)`` mask for it.

transformers builds the attention mask once per forward through ``AttentionMaskInterface``. For a packed batch the
mask function registered here returns ``None`` (the attention helper derives the per-sample mask from the packing
metadata); for anything else it returns exactly what the model's own implementation ("sdpa", "eager", ...) returns.

Whether the current forward is packed is decided by :func:`packed_info_for_forward`, called by the model hook before
the decoder runs, and published for the mask function through :func:`packed_forward_active` on a per-thread stack
(a plain list in a ``threading.local``: ``torch.compile(fullgraph=True)`` traces it, where it cannot trace a
``ContextVar``). Under ``torch.compile`` / ``torch.export`` a batch without packing metadata is left exactly as it
came, with no Python branch on tensor values, so a compiled or exported patched model traces as an unpatched one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from unpack_trainer.packed_seq_info import PackedSeqInfo

__all__ = ["SEQ_PARENTS_KEY", "make_mask_function", "packed_forward_active", "packed_info_for_forward"]

# Per thread (nn.DataParallel runs its replicas in threads): a stack of (decoder, PackedSeqInfo) for the packed
# forwards now running, innermost last.
_state = threading.local()

# The batch key of the branch structure (shared prefixes): ``(num_seqs,)`` int, ``-1`` or the sample each continues.
SEQ_PARENTS_KEY = "packed_seq_parents"

# Keys of a decoder forward's kwargs that mark a batch as explicitly packed.
_METADATA_KEYS = ("packed_seq_lengths", "cu_seq_lens_q")


def _stack() -> list[tuple[Any, PackedSeqInfo]]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def packed_forward_active(decoder: Any, info: PackedSeqInfo) -> None:
    """Mark the forward of ``decoder`` now starting as packed with ``info``; undo with :func:`reset_packed_forward`."""
    reset_packed_forward(decoder)  # an entry a failed trace left behind
    _stack().append((decoder, info))


def reset_packed_forward(decoder: Any) -> None:
    """End the packed forward of ``decoder`` (no-op when its forward was not packed)."""
    stack = _stack()
    if any(entry[0] is decoder for entry in stack):
        stack[:] = [entry for entry in stack if entry[0] is not decoder]


def current_packed_info(config: Any = None) -> PackedSeqInfo | None:
    """The packing metadata of the innermost packed forward running in this thread (of the decoder whose config is
    ``config``, when given), or ``None``."""
    stack = getattr(_state, "stack", None)
    if not stack:
        return None
    for decoder, info in reversed(stack):
        if config is None or getattr(decoder, "config", None) is config:
            return info
    return None


def is_tracing() -> bool:
    """Whether ``torch.compile`` (dynamo) or ``torch.export`` is tracing the code now running."""
    compiler = getattr(torch, "compiler", None)
    for name in ("is_compiling", "is_exporting"):
        check = getattr(compiler, name, None)
        if check is not None and check():
            return True
    return False


def make_mask_function(original_implementation: str) -> Callable[..., Any]:
    """An ``AttentionMaskInterface`` function: ``None`` inside a packed forward, else the original implementation's
    mask (``sdpa_mask``, ``eager_mask``, ...) called with the same arguments."""

    def unpack_mask(*args: Any, **kwargs: Any) -> Any:
        if current_packed_info(kwargs.get("config")) is not None:
            return None
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        original = ALL_MASK_ATTENTION_FUNCTIONS.get(original_implementation)
        if original is None:
            # transformers builds no mask for implementations without a mask function; neither do we.
            return None
        return original(*args, **kwargs)

    unpack_mask.original_implementation = original_implementation  # type: ignore[attr-defined]
    return unpack_mask


def _cache_length(past_key_values: Any) -> int:
    if past_key_values is None:
        return 0
    get_seq_length = getattr(past_key_values, "get_seq_length", None)
    return int(get_seq_length()) if callable(get_seq_length) else 0


def _is_2d_mask(attention_mask: Any) -> bool:
    """Whether ``attention_mask`` is a ``(B, T)`` padding mask (not a prepared 4D mask, nor a dict of masks by layer
    type as ``generate`` passes with a static cache)."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2


def _hides_nothing(attention_mask: Any) -> bool:
    """Whether ``attention_mask`` is absent or a 2D mask of ones (a padding-free batch that carries one anyway)."""
    if attention_mask is None:
        return True
    return _is_2d_mask(attention_mask) and bool(attention_mask.bool().all())


def packed_info_for_forward(kwargs: dict[str, Any]) -> PackedSeqInfo | None:
    """Decide, once per forward of the decoder model, whether the batch in ``kwargs`` is packed; edit ``kwargs``.

    ``kwargs`` are the keyword arguments of the decoder model's ``forward`` (``input_ids`` or ``inputs_embeds``,
    ``attention_mask``, ``position_ids``, ``past_key_values``, and the packing metadata ``packed_seq_lengths`` /
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``).

    The batch is packed when it carries packing metadata, or when it has no cached tokens, no ``attention_mask`` (or
    one of all ones) and ``position_ids`` that restart inside a row. On return ``kwargs["packed_seq_info"]`` holds the
    metadata (``None`` for an unpacked batch, which then runs exactly as without the patch). For a packed batch, an
    all-ones ``attention_mask`` is dropped, missing ``position_ids`` are filled in (restarting per sample), and
    ``use_cache`` defaults to ``False`` (an explicit ``use_cache=True`` is kept).

    Raises:
        ValueError: inconsistent metadata, a packed batch with cached tokens, or with a mask that hides tokens.
    """
    embeds = kwargs.get("inputs_embeds")
    input_ids = kwargs.get("input_ids")
    reference = input_ids if input_ids is not None else embeds
    if reference is None or (is_tracing() and all(kwargs.get(key) is None for key in _METADATA_KEYS)):
        # Nothing to pack, or a compiled / exported forward without packing metadata: run as unpatched, with no
        # Python branch on tensor values (a packed batch given only by `position_ids` then takes transformers' path).
        kwargs["packed_seq_info"] = None
        return None
    batch_size, seq_len = reference.shape[0], reference.shape[1]
    attention_mask = kwargs.get("attention_mask")
    position_ids = kwargs.get("position_ids")
    cached = _cache_length(kwargs.get("past_key_values"))

    info = None
    lengths, cu_q, cu_k = kwargs.get("packed_seq_lengths"), kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if lengths is not None or cu_q is not None:
        parents = kwargs.pop(SEQ_PARENTS_KEY, None)
        if lengths is not None:
            info = PackedSeqInfo.from_seq_lengths(
                lengths, batch_size=batch_size, seq_len=seq_len, seq_parents=parents
            )
        elif parents is not None:
            raise ValueError(f"`{SEQ_PARENTS_KEY}` needs `packed_seq_lengths` (the samples the parents refer to).")
        else:
            info = PackedSeqInfo.from_cu_seqlens(cu_q, batch_size=batch_size, seq_len=seq_len)
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            given = kwargs.get(name)
            if given is not None and not torch.equal(given.detach().cpu().to(torch.int32), info.cu_seqlens):
                raise ValueError(
                    f"`{name}` does not match the packed sample lengths: expected the zero-prefixed cumsum "
                    f"{info.cu_seqlens.tolist()[:8]}..., got {given.tolist()[:8]}..."
                )
        if cu_k is not None and cu_q is not None and lengths is None and not torch.equal(cu_q.cpu(), cu_k.cpu()):
            raise ValueError("Packed self-attention needs `cu_seq_lens_q` == `cu_seq_lens_k`.")
        for name in ("max_length_q", "max_length_k"):
            given = kwargs.get(name)
            if given is not None and int(given) != info.max_seqlen:
                raise ValueError(f"`{name}`={int(given)} but the longest packed sample has {info.max_seqlen} tokens.")
        if attention_mask is not None:
            if not _hides_nothing(attention_mask):
                raise ValueError(
                    "A packed batch (with `packed_seq_lengths` / `cu_seq_lens_q`) cannot also hide tokens with an "
                    "`attention_mask`; make trailing padding a sample of its own and drop the mask."
                )
            kwargs["attention_mask"] = None
        if position_ids is None:
            kwargs["position_ids"] = info.position_ids(reference.device)
        elif info.is_branched and not torch.equal(position_ids.detach().cpu().expand(batch_size, -1), info.position_ids()):
            raise ValueError(
                "`position_ids` do not match the branched samples (`packed_seq_parents`): every branch continues its "
                "prefix's positions; pass no `position_ids` to have them filled in."
            )
    elif position_ids is not None and seq_len > 1 and cached == 0 and _hides_nothing(attention_mask):
        if position_ids.shape[0] != batch_size:
            position_ids = position_ids.expand(batch_size, -1)
        info = PackedSeqInfo.from_position_ids(position_ids)
        if info is not None:
            kwargs["attention_mask"] = None

    if info is not None and cached:
        raise ValueError(
            f"A packed batch cannot be run on top of a KV cache that already holds {cached} tokens; pass no "
            "`past_key_values` (and `use_cache=False`) for packed training batches."
        )
    if info is not None and kwargs.get("use_cache") is None:
        # A cache of a packed row is of no use for generation (its keys span several samples): do not build one.
        kwargs["use_cache"] = False
    kwargs["packed_seq_info"] = info
    return info
