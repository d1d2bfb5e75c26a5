"""Model-level side of packed attention: detect a packed forward once, and build no ``(T, T)`` mask for it.

transformers builds the attention mask once per forward through ``AttentionMaskInterface``. For a packed batch the
mask function registered here returns ``None`` (the attention helper derives the per-sample mask from the packing
metadata); for anything else it returns exactly what the model's own implementation ("sdpa", "eager", ...) returns.

Whether a batch is packed is decided in one place, :func:`detect_packed`. The model hook calls it once per forward
through :func:`packed_info_for_forward` before the decoder runs, and publishes the result for the mask function and the
token mixers (:func:`current_packed_info`) through :func:`packed_forward_active` on a per-thread stack (a plain list in
a ``threading.local``: ``torch.compile(fullgraph=True)`` traces it, where it cannot trace a ``ContextVar``); a direct
call of the attention helper without the hook decides with it too. Under ``torch.compile`` / ``torch.export`` a batch without packing metadata is left exactly as it
came, with no Python branch on tensor values, so a compiled or exported patched model traces as an unpatched one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from unpack_trainer._transformers_compat import cache_argument, cache_length
from unpack_trainer.packed_seq_info import PackedSeqInfo

__all__ = [
    "ATTENTION_FORWARDS",
    "SEQ_PARENTS_KEY",
    "PackedForwards",
    "current_packed_info",
    "detect_packed",
    "make_mask_function",
    "packed_forward_active",
    "packed_info_for_forward",
    "reset_packed_forward",
]


# The batch key of the branch structure (shared prefixes): ``(num_seqs,)`` int, ``-1`` or the sample each continues.
SEQ_PARENTS_KEY = "packed_seq_parents"

# Keys of a decoder forward's kwargs that mark a batch as explicitly packed.
_METADATA_KEYS = ("packed_seq_lengths", "cu_seq_lens_q")


class PackedForwards:
    """Per thread (``nn.DataParallel`` runs its replicas in threads): ``(decoder, PackedSeqInfo)`` of the packed
    forwards now running, innermost last, in a plain list in a ``threading.local`` (``torch.compile(fullgraph=True)``
    traces it, where it cannot trace a ``ContextVar``). Attention (:data:`ATTENTION_FORWARDS`) and the token mixers
    (``unpack_trainer.patches.mixers``) each read one, since a forward can be packed for one and not the other
    (``output_attentions`` sends attention down transformers' dense path while the mixers stay per sample)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def stack(self) -> list[tuple[Any, PackedSeqInfo]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def clear(self) -> None:
        self._local.stack = []

    def start(self, decoder: Any, info: PackedSeqInfo) -> None:
        """Mark the forward of ``decoder`` now starting as packed with ``info``; undo with :meth:`end`."""
        self.end(decoder)  # an entry a failed forward or trace left behind
        self.stack.append((decoder, info))

    def end(self, decoder: Any) -> None:
        """End the packed forward of ``decoder`` (no-op when its forward was not packed)."""
        stack = self.stack
        if any(entry[0] is decoder for entry in stack):
            stack[:] = [entry for entry in stack if entry[0] is not decoder]

    def innermost(self, config: Any = None) -> tuple[Any, PackedSeqInfo] | None:
        """``(decoder, info)`` of the innermost packed forward (of the decoder whose config is ``config``, when
        given), or ``None``."""
        for decoder, info in reversed(self.stack):
            if config is None or getattr(decoder, "config", None) is config:
                return decoder, info
        return None


# The packed forwards attention and the mask function see.
ATTENTION_FORWARDS = PackedForwards()


def packed_forward_active(decoder: Any, info: PackedSeqInfo) -> None:
    """Mark the forward of ``decoder`` now starting as packed with ``info`` for attention and the mask function; undo
    with :func:`reset_packed_forward`."""
    ATTENTION_FORWARDS.start(decoder, info)


def reset_packed_forward(decoder: Any) -> None:
    """End the packed forward of ``decoder`` (no-op when its forward was not packed)."""
    ATTENTION_FORWARDS.end(decoder)


def current_packed_info(config: Any = None) -> PackedSeqInfo | None:
    """The packing metadata of the innermost packed forward running in this thread (of the decoder whose config is
    ``config``, when given), or ``None``."""
    entry = ATTENTION_FORWARDS.innermost(config)
    return None if entry is None else entry[1]


# A decoder whose own code needs a tensor where the mask goes (mpt calls ``.to(torch.bool)`` on it) carries this
# attribute, a placeholder its packed attention ignores; the mask function returns it instead of ``None``.
MASK_PLACEHOLDER_ATTRIBUTE = "_unpack_mask_placeholder"


def is_tracing() -> bool:
    """Whether ``torch.compile`` (dynamo) or ``torch.export`` is tracing the code now running."""
    compiler = getattr(torch, "compiler", None)
    for name in ("is_compiling", "is_exporting"):
        check = getattr(compiler, name, None)
        if check is not None and check():
            return True
    return False


def make_mask_function(
    original_implementation: str, *, fallback: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """An ``AttentionMaskInterface`` function: ``None`` inside a packed forward of the model whose ``config`` it is
    called with, else the original implementation's mask (``sdpa_mask``, ``eager_mask``, ...) called with the same
    arguments: ``fallback`` when given, else transformers' own function of that name (the class-wide registry, so the
    returned function can be registered under the same name)."""

    def unpack_mask(*args: Any, **kwargs: Any) -> Any:
        entry = ATTENTION_FORWARDS.innermost(kwargs.get("config"))
        if entry is not None:
            return entry[0].__dict__.get(MASK_PLACEHOLDER_ATTRIBUTE)
        from transformers.masking_utils import AttentionMaskInterface

        original = fallback or AttentionMaskInterface._global_mapping.get(original_implementation)
        if original is None:
            # transformers builds no mask for implementations without a mask function; neither do we.
            return None
        return original(*args, **kwargs)

    unpack_mask.original_implementation = original_implementation  # type: ignore[attr-defined]
    return unpack_mask


def _is_2d_mask(attention_mask: Any) -> bool:
    """Whether ``attention_mask`` is a ``(B, T)`` padding mask (not a prepared 4D mask, nor a dict of masks by layer
    type as ``generate`` passes with a static cache)."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2


def _hides_nothing(attention_mask: Any) -> bool:
    """Whether ``attention_mask`` is absent or a 2D mask of ones (a padding-free batch that carries one anyway)."""
    if attention_mask is None:
        return True
    return _is_2d_mask(attention_mask) and bool(attention_mask.bool().all())


def detect_packed(
    batch_size: int,
    seq_len: int,
    *,
    packed_seq_lengths: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    seq_parents: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: Any = None,
    cached: int = 0,
) -> PackedSeqInfo | None:
    """The one detector of a packed batch: its metadata, or ``None`` when the batch is not packed.

    A batch of ``batch_size`` rows of ``seq_len`` tokens is packed when it carries packing metadata
    (``packed_seq_lengths`` ``(num_seqs,)`` int, else ``cu_seq_lens_q`` ``(num_seqs + 1,)`` int32, zero-prefixed), or
    when ``position_ids`` ``(B, T)`` or ``(1, T)`` int restart inside a row and the batch has more than one token, no
    ``cached`` tokens before it and no ``attention_mask`` (or a ``(B, T)`` one of all ones; a 4D mask counts as one
    that hides tokens). With metadata the mask is not looked at (the caller checks it). ``seq_parents``
    ``(num_seqs,)`` int (with ``packed_seq_lengths`` only): for each sample, -1 or the index of the earlier sample
    whose prefix it continues (branched segments, e.g. a DPO prompt with its chosen and rejected completions).

    :func:`packed_info_for_forward` (the model hook, once per forward) and
    :func:`unpack_trainer.patches.attention.packed_info_from_kwargs` (a direct call of the packed attention helper)
    both decide with it.
    """
    if packed_seq_lengths is not None:
        return PackedSeqInfo.from_seq_lengths(
            packed_seq_lengths, batch_size=batch_size, seq_len=seq_len, seq_parents=seq_parents
        )
    if cu_seq_lens_q is not None:
        return PackedSeqInfo.from_cu_seqlens(cu_seq_lens_q, batch_size=batch_size, seq_len=seq_len)
    if position_ids is None or seq_len <= 1 or cached or not _hides_nothing(attention_mask):
        return None
    if position_ids.shape[0] != batch_size:
        position_ids = position_ids.expand(batch_size, -1)
    return PackedSeqInfo.from_position_ids(position_ids)


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
    cached = cache_length(cache_argument(kwargs))  # `cache` since transformers 5.24, `past_key_values` before

    lengths, cu_q, cu_k = kwargs.get("packed_seq_lengths"), kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    explicit = lengths is not None or cu_q is not None
    parents = kwargs.pop(SEQ_PARENTS_KEY, None)
    if parents is not None and lengths is None:
        raise ValueError(f"`{SEQ_PARENTS_KEY}` needs `packed_seq_lengths` (the samples the parents refer to).")
    info = detect_packed(
        batch_size,
        seq_len,
        packed_seq_lengths=lengths,
        cu_seq_lens_q=cu_q,
        seq_parents=parents,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cached=cached,
    )
    if explicit:
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
    elif info is not None:
        kwargs["attention_mask"] = None

    if info is not None and cached:
        raise ValueError(
            f"A packed batch cannot be run on top of a KV cache that already holds {cached} tokens; pass no "
            "`cache` / `past_key_values` (and `use_cache=False`) for packed training batches."
        )
    if info is not None and kwargs.get("use_cache") is None:
        # A cache of a packed row is of no use for generation (its keys span several samples): do not build one.
        kwargs["use_cache"] = False
    kwargs["packed_seq_info"] = info
    return info
