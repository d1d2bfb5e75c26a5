"""Model-level side of packed attention: detect a packed forward once, publish it, and build no ``(T, T)`` mask for it.

transformers builds the attention mask once per forward through ``AttentionMaskInterface``. For a packed batch the
mask function registered here returns ``None`` (the attention helper derives the per-sample mask from the packing
metadata); for anything else it returns exactly what the model's own implementation ("sdpa", "eager", ...) returns.

Whether a batch is packed is decided in one place, :func:`detect_packed`. The model hook calls it once per forward
through :func:`packed_info_for_forward` before the decoder runs; a direct call of the attention helper without the
hook decides with it too. Under ``torch.compile`` / ``torch.export`` a batch without packing metadata is left exactly
as it came, with no Python branch on tensor values, so a compiled or exported patched model traces as an unpatched
one.

How the decision reaches the layers: the hook puts the forward's :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`
in the decoder's keyword arguments (``packed_seq_info``), which transformers' decoders hand down to every attention
call; it survives gradient checkpointing, whose recomputation runs after the forward has ended. The one other channel
is the packed forward the hook publishes here for its duration (:data:`RUNNING_FORWARDS`, :func:`packed_forward_active`,
read with :func:`current_packed_info`), for what a keyword cannot reach: the mask function (transformers calls it with
fixed arguments), attention modules whose decoder does not hand its keyword arguments down (bloom, mpt) and the token
mixers (their forwards take no such keyword; :mod:`unpack_trainer.patches.mixers`). One entry per packed forward
serves all three: with ``output_attentions`` the forward is published for the mixers only, since attention then takes
transformers' dense path, which returns the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from unpack_trainer._compat import cache_argument, cache_length, mask_functions
from unpack_trainer.packed_seq_info import (
    BOUNDARY_KEYS,
    CU_SEQ_LENS_K_KEY,
    CU_SEQ_LENS_Q_KEY,
    INFO_KEY,
    MAX_LENGTH_K_KEY,
    MAX_LENGTH_Q_KEY,
    SEQ_LENGTHS_KEY,
    SEQ_PARENTS_KEY,
    PackedSeqInfo,
)

__all__ = [
    "RUNNING_FORWARDS",
    "PackedForwards",
    "carried_info",
    "current_packed_info",
    "detect_packed",
    "make_mask_function",
    "packed_forward_active",
    "packed_info_for_forward",
    "reset_packed_forward",
]


class PackedForwards:
    """Per thread (``nn.DataParallel`` runs its replicas in threads): ``(decoder, info, attention)`` of the packed
    forwards now running, innermost last, in a plain list in a ``threading.local`` (``torch.compile(fullgraph=True)``
    traces it, where it cannot trace a ``ContextVar``). ``attention`` is whether attention and the mask function follow
    the packing (``False`` when ``output_attentions`` sends attention down transformers' dense path while the token
    mixers stay per sample)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def stack(self) -> list[tuple[Any, PackedSeqInfo, bool]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def clear(self) -> None:
        self._local.stack = []

    def start(self, decoder: Any, info: PackedSeqInfo, *, attention: bool = True) -> None:
        """Mark the forward of ``decoder`` now starting as packed with ``info``; undo with :meth:`end`."""
        self.end(decoder)  # an entry a failed forward or trace left behind
        self.stack.append((decoder, info, attention))

    def end(self, decoder: Any) -> None:
        """End the packed forward of ``decoder`` (no-op when its forward was not packed)."""
        stack = self.stack
        if any(entry[0] is decoder for entry in stack):
            stack[:] = [entry for entry in stack if entry[0] is not decoder]

    def innermost(self, config: Any = None, *, for_attention: bool = True) -> tuple[Any, PackedSeqInfo] | None:
        """``(decoder, info)`` of the innermost packed forward (of the decoder whose config is ``config``, when
        given; one whose attention follows the packing, when ``for_attention``), or ``None``."""
        for decoder, info, attention in reversed(self.stack):
            if (config is None or getattr(decoder, "config", None) is config) and (attention or not for_attention):
                return decoder, info
        return None


# The packed forwards running now, published by the model hook.
RUNNING_FORWARDS = PackedForwards()


def packed_forward_active(decoder: Any, info: PackedSeqInfo, *, attention: bool = True) -> None:
    """Publish the forward of ``decoder`` now starting as packed with ``info`` (for attention and the mask function
    too unless ``attention=False``); undo with :func:`reset_packed_forward`."""
    RUNNING_FORWARDS.start(decoder, info, attention=attention)


def reset_packed_forward(decoder: Any) -> None:
    """End the packed forward of ``decoder`` (no-op when its forward was not packed)."""
    RUNNING_FORWARDS.end(decoder)


def current_packed_info(config: Any = None, *, for_attention: bool = True) -> PackedSeqInfo | None:
    """The packing metadata of the innermost packed forward running in this thread (of the decoder whose config is
    ``config``, when given; for the token mixers, ``for_attention=False``, also a forward whose attention takes the
    dense path), or ``None``."""
    entry = RUNNING_FORWARDS.innermost(config, for_attention=for_attention)
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
    # Looked up here, not inside the mask function (which a compiled forward traces); the registry's own dict, read
    # per call.
    stock_functions = mask_functions()

    def unpack_mask(*args: Any, **kwargs: Any) -> Any:
        entry = RUNNING_FORWARDS.innermost(kwargs.get("config"))
        if entry is not None:
            return entry[0].__dict__.get(MASK_PLACEHOLDER_ATTRIBUTE)
        original = fallback or stock_functions.get(original_implementation)
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
    packed_seq_parents: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: Any = None,
    cached: int = 0,
    packed_seq_info: PackedSeqInfo | None = None,
) -> PackedSeqInfo | None:
    """The one detector of a packed batch: its metadata, or ``None`` when the batch is not packed.

    The keyword arguments are the batch's keys of the same names. A batch of ``batch_size`` rows of ``seq_len`` tokens
    is packed when it carries packing metadata (``packed_seq_lengths`` ``(num_seqs,)`` int, else ``cu_seq_lens_q``
    ``(num_seqs + 1,)`` int32, zero-prefixed), or when ``position_ids`` ``(B, T)`` or ``(1, T)`` int restart inside a
    row and the batch has more than one token, no ``cached`` tokens before it and no ``attention_mask`` (or a
    ``(B, T)`` one of all ones; a 4D mask counts as one that hides tokens). With metadata the mask is not looked at
    (the caller checks it); the collator's ``cu_seq_lens_q`` and ``max_length_q`` are adopted, not derived again
    (:meth:`PackedSeqInfo.from_seq_lengths`). ``packed_seq_parents`` ``(num_seqs,)`` int (with ``packed_seq_lengths``
    only): for each sample, -1 or the index of the earlier sample whose prefix it continues (branched segments, e.g.
    a DPO prompt with its chosen and rejected completions).

    ``packed_seq_info``: the batch's :class:`PackedSeqInfo`, built with the batch on the host (the collator's
    ``packed_seq_info`` key, see :func:`carried_info`): adopted as it is after checking its shape against the batch,
    and the other metadata keys are not read (on a GPU they are device copies: reading them would wait for the
    device).

    :func:`packed_info_for_forward` (the model hook, once per forward) and
    :func:`unpack_trainer.patches.attention.packed_info_from_kwargs` (a direct call of the packed attention helper)
    both decide with it.
    """
    if packed_seq_info is not None:
        return carried_info(packed_seq_info, batch_size, seq_len)
    if packed_seq_lengths is not None:
        return PackedSeqInfo.from_seq_lengths(
            packed_seq_lengths,
            batch_size=batch_size,
            seq_len=seq_len,
            seq_parents=packed_seq_parents,
            cu_seqlens=cu_seq_lens_q,
            max_seqlen=max_length_q,
        )
    if cu_seq_lens_q is not None:
        return PackedSeqInfo.from_cu_seqlens(
            cu_seq_lens_q, batch_size=batch_size, seq_len=seq_len, max_seqlen=max_length_q
        )
    if position_ids is None or seq_len <= 1 or cached or not _hides_nothing(attention_mask):
        return None
    if position_ids.shape[0] != batch_size:
        position_ids = position_ids.expand(batch_size, -1)
    return PackedSeqInfo.from_position_ids(position_ids)


def packed_info_for_forward(kwargs: dict[str, Any]) -> PackedSeqInfo | None:
    """Decide, once per forward of the decoder model, whether the batch in ``kwargs`` is packed; edit ``kwargs``.

    ``kwargs`` are the keyword arguments of the decoder model's ``forward`` (``input_ids`` or ``inputs_embeds``,
    ``attention_mask``, ``position_ids``, ``past_key_values``, and the packing metadata ``packed_seq_lengths`` /
    ``packed_seq_parents`` / ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``, or the
    batch's own ``packed_seq_info``).

    Device reads: a batch that carries its ``packed_seq_info`` (built by the collator on the host; the trainers' do)
    is adopted and no metadata tensor is read, so a forward never waits for the device here. Metadata given only as
    tensors on a device is read back once per forward (and ``cu_seq_lens_k``, when it is another tensor than
    ``cu_seq_lens_q``, checked against it).

    The batch is packed when it carries packing metadata, or when it has no cached tokens, no ``attention_mask`` (or
    one of all ones) and ``position_ids`` that restart inside a row. On return ``kwargs["packed_seq_info"]`` holds the
    metadata (``None`` for an unpacked batch, which then runs exactly as without the patch), built from the collator's
    ``packed_seq_lengths``, ``cu_seq_lens_q`` and ``max_length_q`` (the key ``cu_seq_lens_k`` / ``max_length_k`` is
    checked against them; the collator passes the same objects). For a packed batch, an all-ones ``attention_mask`` is
    dropped, missing ``position_ids`` are filled in (restarting per sample), and ``use_cache`` defaults to ``False``
    (an explicit ``use_cache=True`` is kept).

    Raises:
        ValueError: inconsistent metadata, a packed batch with cached tokens, or with a mask that hides tokens.
    """
    embeds = kwargs.get("inputs_embeds")
    input_ids = kwargs.get("input_ids")
    reference = input_ids if input_ids is not None else embeds
    if reference is None or (is_tracing() and all(kwargs.get(key) is None for key in BOUNDARY_KEYS)):
        # Nothing to pack, or a compiled / exported forward without packing metadata: run as unpatched, with no
        # Python branch on tensor values (a packed batch given only by `position_ids` then takes transformers' path).
        kwargs[INFO_KEY] = None
        return None
    batch_size, seq_len = reference.shape[0], reference.shape[1]
    attention_mask = kwargs.get("attention_mask")
    position_ids = kwargs.get("position_ids")
    cached = cache_length(cache_argument(kwargs))  # `cache` since transformers 5.24, `past_key_values` before

    lengths, cu_q, max_q = kwargs.get(SEQ_LENGTHS_KEY), kwargs.get(CU_SEQ_LENS_Q_KEY), kwargs.get(MAX_LENGTH_Q_KEY)
    carried = kwargs.get(INFO_KEY)
    explicit = carried is not None or lengths is not None or cu_q is not None
    parents = kwargs.pop(SEQ_PARENTS_KEY, None)
    if parents is not None and lengths is None and carried is None:
        raise ValueError(f"`{SEQ_PARENTS_KEY}` needs `{SEQ_LENGTHS_KEY}` (the samples the parents refer to).")
    info = detect_packed(
        batch_size,
        seq_len,
        packed_seq_lengths=lengths,
        packed_seq_parents=parents,
        cu_seq_lens_q=cu_q,
        max_length_q=max_q,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cached=cached,
        packed_seq_info=carried,
    )
    if explicit:
        if carried is None:  # the batch's own metadata was built with it on the host: nothing to compare
            _check_key_side(kwargs, info)
        if attention_mask is not None:
            if not _hides_nothing(attention_mask):
                raise ValueError(
                    f"A packed batch (with `{SEQ_LENGTHS_KEY}` / `{CU_SEQ_LENS_Q_KEY}`) cannot also hide tokens with "
                    "an `attention_mask`; make trailing padding a sample of its own and drop the mask."
                )
            kwargs["attention_mask"] = None
        if position_ids is None:
            kwargs["position_ids"] = info.position_ids(reference.device)
        elif (
            carried is None
            and info.is_branched
            and not torch.equal(position_ids.detach().cpu().expand(batch_size, -1), info.position_ids())
        ):
            raise ValueError(
                f"`position_ids` do not match the branched samples (`{SEQ_PARENTS_KEY}`): every branch continues its "
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
    kwargs[INFO_KEY] = info
    return info


def carried_info(info: Any, batch_size: int, seq_len: int) -> PackedSeqInfo:
    """``info``, a batch's own :class:`PackedSeqInfo` (its ``packed_seq_info`` key: built with the batch on the host
    by the collator, so that no forward reads the metadata back from the device), checked against the batch's shape
    ``(batch_size, seq_len)``; ``ValueError`` naming the key otherwise."""
    if not isinstance(info, PackedSeqInfo):
        raise ValueError(f"`{INFO_KEY}` must be a PackedSeqInfo or None, got {type(info).__name__}.")
    if (info.batch_size, info.seq_len) != (batch_size, seq_len):
        raise ValueError(
            f"`{INFO_KEY}` describes {info.batch_size} row(s) of {info.seq_len} tokens but the batch has {batch_size} "
            f"row(s) of {seq_len}."
        )
    return info


def _check_key_side(kwargs: dict[str, Any], info: PackedSeqInfo) -> None:
    """``cu_seq_lens_k`` / ``max_length_k`` (keys of packed self-attention: the queries' own samples) checked against
    ``info``, built from the query side; nothing to compare when they are the query side's objects."""
    cu_k, max_k = kwargs.get(CU_SEQ_LENS_K_KEY), kwargs.get(MAX_LENGTH_K_KEY)
    if cu_k is not None and cu_k is not kwargs.get(CU_SEQ_LENS_Q_KEY):
        if not torch.equal(cu_k.detach().cpu().to(torch.int32), info.cu_seqlens):
            raise ValueError(
                f"`{CU_SEQ_LENS_K_KEY}` does not match the packed sample lengths: expected the zero-prefixed cumsum "
                f"{info.cu_seqlens.tolist()[:8]}..., got {cu_k.tolist()[:8]}..."
            )
    if max_k is not None and int(max_k) != info.max_seqlen:
        raise ValueError(
            f"`{MAX_LENGTH_K_KEY}`={int(max_k)} but the longest packed sample has {info.max_seqlen} tokens."
        )
