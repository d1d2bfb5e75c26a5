"""One packed forward of a patched decoder: the decoder hook decides, once per forward, whether the batch is packed,
and hands the decision to every layer.

The pre-hook reads the batch (:func:`packed_info_for_forward`, with the one detector
:func:`unpack_trainer.packed_seq_info.detect_packed`), puts the forward's
:class:`~unpack_trainer.packed_seq_info.PackedSeqInfo` into the decoder's keyword arguments as ``packed_seq_info``
(transformers' decoders hand it to every layer and attention call) and sets it as the decoder state's
:attr:`~unpack_trainer.models.state.DecoderState.running` for the readers no keyword reaches; the post-hook clears it.
A batch that is not packed runs exactly as without the patch.

Under ``torch.compile`` the decision and the packing metadata are made on the host (:func:`_start_packed_forward`,
outside the graph: one graph break at the decoder's boundary, none inside a layer); for a decoder patched with
``compiled=True`` the attention metadata the layers read is planned there too
(:func:`unpack_trainer.patches.attention.prepare_packed_attention`). A compiled or exported forward without packing
metadata is left exactly as it came, with no Python branch on tensor values.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from unpack_trainer._compat import attention_implementation, cache_argument, cache_length, is_tracing
from unpack_trainer._logging import log_once
from unpack_trainer.models.routing import release_route, route
from unpack_trainer.models.state import DecoderState, decoder_state
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
    detect_packed,
    hides_nothing,
)

__all__ = ["decoder_post_hook", "decoder_pre_hook", "packed_info_for_forward"]

logger = logging.getLogger("unpack_trainer.models")

# What marks a forward as packed without reading a tensor: the batch's own (or a carried) PackedSeqInfo, or metadata.
_PACKED_KEYS = (INFO_KEY, *BOUNDARY_KEYS)


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
    if reference is None or (is_tracing() and all(kwargs.get(key) is None for key in _PACKED_KEYS)):
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
            cu_k, max_k = kwargs.get(CU_SEQ_LENS_K_KEY), kwargs.get(MAX_LENGTH_K_KEY)
            info.check_key_side(None if cu_k is cu_q else cu_k, max_k)
        if attention_mask is not None:
            if not hides_nothing(attention_mask):
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


def _wants_attention_weights(module: torch.nn.Module, kwargs: dict) -> bool:
    requested = kwargs.get("output_attentions")
    if requested is None:
        requested = getattr(module.config, "output_attentions", False)
    return bool(requested)


def _follow_implementation(module: torch.nn.Module, state: DecoderState) -> None:
    """Route the decoder's packed batches through its implementation now: after
    ``model.set_attn_implementation(impl)`` changed it, and on the first forward of a copy."""
    current = attention_implementation(module.config) or "eager"
    changed = current != state.implementation
    route(current, module, state)
    if changed:
        release_route(state.implementation, state)
        logger.warning(
            "unpack_trainer: the attention implementation of this patched model was changed to %r; packed batches "
            "now use the packed helper on %r.",
            current,
            current,
        )
        state.implementation = current
    state.routed = True


# decoder class -> the names of its forward's positional parameters.
_forward_parameters: dict[type, list[str]] = {}


def decoder_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The decoder's forward pre-hook (with keyword arguments): the batch's positional arguments named, the keywords
    an outer model carried merged in, and, for a packed batch, the forward started (:func:`_start_packed_forward`)."""
    state = decoder_state(module)
    if state.attention and (not state.routed or attention_implementation(module.config) != state.implementation):
        _follow_implementation(module, state)
    if args:
        names = _forward_parameters.get(type(module))
        if names is None:
            names = [
                p.name
                for p in inspect.signature(module.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            _forward_parameters[type(module)] = names
        kwargs = {**dict(zip(names, args)), **kwargs}
        args = ()
    carried = state.carried
    if carried:  # bloom's and mpt's outer model, a vision-language model's multimodal model
        state.carried = None
        kwargs = {**carried, **{key: value for key, value in kwargs.items() if value is not None}}
    if is_tracing() and all(kwargs.get(key) is None for key in _PACKED_KEYS):
        kwargs[INFO_KEY] = None  # traced without packing metadata: as unpatched (see packed_info_for_forward)
        return args, kwargs
    return args, _start_packed_forward(module, state, kwargs)


@torch.compiler.disable
def _start_packed_forward(module: torch.nn.Module, state: DecoderState, kwargs: dict) -> dict:
    """Decide whether the batch of ``kwargs`` is packed and, if it is, start its forward: ``packed_seq_info`` in the
    returned keywords and ``state.running`` set (``state.dense`` where attention takes transformers' dense path). On
    the host under ``torch.compile`` (outside the graph)."""
    info = packed_info_for_forward(kwargs)
    if info is None:
        return kwargs
    dense = _wants_attention_weights(module, kwargs)
    if dense and state.no_dense_path is not None:
        raise ValueError(
            f"output_attentions=True with a packed batch is not supported for {state.model_type}: its packed "
            f"attention returns no weights and the model has no exact dense path for packed rows "
            f"({state.no_dense_path}); run the samples unpacked (or padded) to get attention weights."
        )
    if dense and info.is_branched:
        raise ValueError(
            "output_attentions=True with a packed batch of shared prompts (packed_seq_parents) is not supported: "
            "transformers' dense-mask path, which returns attention weights, cannot give a completion the prompt it "
            "continues; run each full sequence unpacked (or padded) to get attention weights."
        )
    if dense:
        # The packed helper returns no weights: transformers' own packed path (a dense block mask from the restarting
        # position_ids, which the metadata filled in) computes the same outputs and returns them.
        log_once(
            logging.getLogger("unpack_trainer.patches.attention"),
            logging.INFO,
            "unpack_trainer: output_attentions=True: packed batches take transformers' dense-mask path, which "
            "returns the attention weights.",
        )
        kwargs[INFO_KEY] = None
    elif state.compiled and state.attention:
        _prepare_attention(module, state, info, kwargs)
    state.running, state.dense = info, dense
    return kwargs


def _prepare_attention(module: torch.nn.Module, state: DecoderState, info: PackedSeqInfo, kwargs: dict) -> None:
    """Plan on the host what the compiled layers' attention reads (the backend the model takes, its buckets or block
    mask, on the batch's device)."""
    from unpack_trainer.patches.attention import Needs, compute_dtype, prepare_packed_attention

    reference = kwargs.get("input_ids")
    if reference is None:
        reference = kwargs["inputs_embeds"]
    parameter = next((p for p in module.parameters() if p.is_floating_point()), None)
    dtype = parameter.dtype if parameter is not None else torch.float32
    needs = Needs() if state.features is None else state.features
    prepare_packed_attention(
        info, reference.device, compute_dtype(reference.device, dtype), state.implementation, needs
    )


def decoder_post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """The decoder's forward hook (always called): the packed forward, if one ran, has ended."""
    state = decoder_state(module)
    if state is not None and state.running is not None:
        state.running, state.dense = None, False
