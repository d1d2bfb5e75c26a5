"""Registration in transformers' interfaces: under the model's own implementation name (``"sdpa"``, ``"eager"``,
``"flash_attention_2"``, ...) a packed forward of a patched decoder takes the packed attention helper and builds no
``(T, T)`` mask; every other call (any unpatched model, padded batches, generation) runs exactly what the name mapped
to before.

The mapping is the interfaces' per-instance one (``interface[name] = function``), so the class-wide registry stays as
transformers and the user left it; it is restored when the last decoder using it is unpatched or collected (where the
user registered another function under the name since, theirs stays). So a patched model's
``config._attn_implementation`` reads what a stock one reads.

Which forward is packed: the registered attention function reads the ``packed_seq_info`` keyword each layer hands it
(:mod:`unpack_trainer.models.state`); the mask function, called with fixed arguments, finds the packed forward
running now on the states of the decoders routed under its name (the one whose ``config`` it is called with).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from unpack_trainer._compat import (
    attention_functions,
    locally_registered,
    mask_functions,
    skip_packed_sequence_detection,
)
from unpack_trainer.anatomy.structure import eager_attention_function
from unpack_trainer.models.state import DecoderState, attention_state
from unpack_trainer.packed_seq_info import INFO_KEY, OWN_KEYS, SEQ_LENGTHS_KEY, PackedSeqInfo
from unpack_trainer.patches.attention.dispatch import packed_attention_forward, packed_info_from_kwargs

__all__ = ["make_attention_function", "make_mask_function", "outside_wrappers", "release_route", "route"]

# implementation name -> id of a decoder's config -> weak references to the states of the live patched decoders routed
# under that name with that config (weakly: a state may reach its model, through what a fix keeps for its undo, and a
# module-level table must not keep a dropped model alive). The mask function reads the entry of the config it is called
# with, so a trace of one model's forward reads nothing of another's.
#
# A trace of a compiled or exported forward reads these entries, and dynamo builds its guards from the same paths after
# the trace; an entry that shrank in between (a collection finalizing a dead model mid-trace) fails the guard building.
# So the garbage collector never shrinks an entry: a collected decoder removes its config's entry only when no decoder
# of it is left (then no trace can be reading it), and route / release_route prune the rest.
_routed_states: dict[str, dict[int, tuple[weakref.ref[DecoderState], ...]]] = {}
_replaced: dict[str, tuple[tuple[Any, Any], tuple[Any, Any]]] = {}
# While any implementation is routed: what puts transformers' packed-sequence detector back.
_detector_restore: list[Callable[[], None] | None] = []


def _packed_forward_running() -> bool:
    """Whether a routed decoder is inside a packed forward whose attention follows it (its mask function then returns
    the placeholder whatever transformers detected)."""
    return any(
        state is not None and state.attention_info() is not None
        for table in _routed_states.values()
        for known_states in table.values()
        for state in (known() for known in known_states)
    )


def route(implementation: str, decoder: torch.nn.Module, state: DecoderState) -> None:
    """Route the packed batches of ``decoder`` (patched, with ``state``) through the packed helper under
    ``implementation``: register the packed attention and mask functions under that name the first time, and count
    the decoder among its users until it is released or collected."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    table = _routed_states.setdefault(implementation, {})
    if not _replaced and not _detector_restore:
        _detector_restore.append(skip_packed_sequence_detection(_packed_forward_running))
    if implementation not in _replaced:
        previous_attention = locally_registered(ALL_ATTENTION_FUNCTIONS, implementation)
        previous_mask = locally_registered(ALL_MASK_ATTENTION_FUNCTIONS, implementation)
        attention = make_attention_function(implementation, fallback=previous_attention)
        ALL_ATTENTION_FUNCTIONS[implementation] = attention
        mask = None
        if implementation in mask_functions():
            # (transformers builds no mask at all for a name missing there, packed or not)
            mask = make_mask_function(implementation, table, fallback=previous_mask)
            ALL_MASK_ATTENTION_FUNCTIONS[implementation] = mask
        _replaced[implementation] = ((previous_attention, attention), (previous_mask, mask))
    known_states = table.get(id(state.config), ())
    if not any(known() is state for known in known_states):
        known = weakref.ref(state)
        table[id(state.config)] = (*known_states, known)
        # A patched model that is garbage collected without unpatch_model releases the routing too.
        weakref.finalize(decoder, release_route, implementation, known, collected=True)


@contextlib.contextmanager
def outside_wrappers() -> Iterator[None]:
    """The packed attention functions registered again under their implementation names for the duration, where
    something registered a wrapper around one under the same name since (DeepSpeed Ulysses does: its wrapper drops a
    padded batch's 4-D mask even where it leaves an evaluating module whole), the wrappers restored afterwards. For
    what must run as one process runs it under sequence parallelism (GRPO's generation)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    wrapped = {}
    for implementation, ((_, ours), _) in list(_replaced.items()):
        current = locally_registered(ALL_ATTENTION_FUNCTIONS, implementation)
        if current is not None and current is not ours:
            wrapped[implementation] = current
            ALL_ATTENTION_FUNCTIONS[implementation] = ours
    try:
        yield
    finally:
        for implementation, wrapper in wrapped.items():
            ALL_ATTENTION_FUNCTIONS[implementation] = wrapper


def release_route(
    implementation: str, state: DecoderState | weakref.ref[DecoderState], *, collected: bool = False
) -> None:
    """Drop ``state`` (or a weak reference to it) from the users of ``implementation``'s routing, and any user
    collected since; restore the interfaces once none is left. ``collected``: called by the garbage collector, which
    only drops an entry with no decoder left (see ``_routed_states``)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    table = _routed_states.get(implementation, {})
    for key, known_states in list(table.items()):
        kept = tuple(known for known in known_states if known is not state and known() not in (None, state))
        if not kept:
            del table[key]
        elif len(kept) < len(known_states) and not collected:
            table[key] = kept
    if table or implementation not in _replaced:
        return
    for interface, (previous, registered) in zip(
        (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS), _replaced.pop(implementation)
    ):
        if registered is None or locally_registered(interface, implementation) is not registered:
            continue  # registered by someone else since: theirs stays
        if previous is not None:
            interface[implementation] = previous
        else:
            del interface[implementation]
    if not _replaced and _detector_restore:
        restore = _detector_restore.pop()
        if restore is not None:
            restore()


def make_mask_function(
    original_implementation: str,
    states: dict[int, tuple[weakref.ref[DecoderState], ...]],
    *,
    fallback: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """An ``AttentionMaskInterface`` function: inside a packed forward of one of the decoders of ``states`` (weak
    references to their states by the id of their config; the one whose ``config`` it is called with; without a
    config, any), that decoder's
    mask placeholder (``None``: no mask); else the original implementation's mask (``sdpa_mask``, ``eager_mask``,
    ...) called with the same arguments: ``fallback`` when given, else transformers' own function of that name (the
    class-wide registry)."""
    # Looked up here, not inside the mask function (which a compiled forward traces); the registry's own dict, read
    # per call.
    stock_functions = mask_functions()

    def unpack_mask(*args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config")
        if config is None:
            known_states: tuple[weakref.ref[DecoderState], ...] = sum(states.values(), ())
        else:
            known_states = states.get(id(config), ())
        for known in reversed(known_states):
            state = known()
            if state is not None and (config is None or state.config is config) and state.attention_info() is not None:
                return state.mask_placeholder
        original = fallback or stock_functions.get(original_implementation)
        if original is None:
            # transformers builds no mask for implementations without a mask function; neither do we.
            return None
        return original(*args, **kwargs)

    unpack_mask.original_implementation = original_implementation  # type: ignore[attr-defined]
    return unpack_mask


def _routed_info(module: torch.nn.Module, query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> PackedSeqInfo | None:
    """The packing metadata a registered function routes on, or ``None`` (then it runs the stock function exactly).

    Only what marks a batch as packed by this package: ``packed_seq_info`` (the decoder hook's decision, ``None``
    meaning "not packed"), ``packed_seq_lengths`` (a layer called without the hook), or, for an attention module
    whose decoder does not hand its keyword arguments down, the packed forward running on its decoder. Keys
    transformers itself passes (``cu_seq_lens_q``, ``position_ids``) never reroute a call, so an unpatched model
    sharing the registered name runs exactly as stock.
    """
    if INFO_KEY in kwargs:
        return kwargs[INFO_KEY]
    if kwargs.get(SEQ_LENGTHS_KEY) is not None:
        return packed_info_from_kwargs(query, key, kwargs)
    state = attention_state(module)
    return None if state is None else state.decoder.attention_info()


def make_attention_function(
    original_implementation: str, *, fallback: Callable[..., Any] | None = None
) -> Callable[..., tuple[Tensor, Any]]:
    """An ``AttentionInterface`` function: packed batches (see :func:`_routed_info`) go to
    :func:`~unpack_trainer.patches.attention.packed_attention_forward` with what the module's
    :class:`~unpack_trainer.models.state.AttentionState` adds (a window, chunks, a query correction), anything else
    to ``original_implementation`` ("sdpa", "eager", "flash_attention_2", ...) exactly as without the patch:
    ``fallback`` when given, else transformers' own function of that name (the class-wide registry, so the returned
    function can be registered under the same name)."""
    # Looked up here, not inside the forward: dynamo cannot import transformers' lazy module while tracing. The
    # mapping is the registry's own dict, read per call.
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
            state = attention_state(module)
            if state is not None and not state.image_blocks:
                info = info.without_bidirectional_spans()
            kwargs[INFO_KEY] = info
            if state is not None:
                if kwargs.get("sliding_window") is None and state.sliding_window:
                    kwargs["sliding_window"] = state.sliding_window
                if state.attention_chunk_size:
                    kwargs["attention_chunk_size"] = state.attention_chunk_size
                if state.query_correction is not None:
                    query = state.query_correction(module, query, info)
            return packed_attention_forward(
                module, query, key, value, None, original_implementation=original_implementation, **kwargs
            )
        for name in OWN_KEYS:  # transformers' own functions do not know them
            kwargs.pop(name, None)
        if fallback is not None:
            function = fallback
        elif original_implementation == "eager":
            function = eager_attention_function(type(module))
        else:
            function = stock_functions[original_implementation]
        return function(module, query, key, value, attention_mask, **kwargs)

    unpack_attention_forward.original_implementation = original_implementation  # type: ignore[attr-defined]
    return unpack_attention_forward
