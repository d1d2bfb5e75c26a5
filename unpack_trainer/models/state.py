"""What the patch keeps on the modules it changes: one attribute, :data:`PATCH_ATTRIBUTE`, and one record per kind of
module that carries it.

- a patched **decoder** carries its :class:`DecoderState`: what was patched (for the undo), the model-family fixes
  installed on it (:mod:`unpack_trainer.models.fixes`) and what each keeps for its ``remove``, and, while a packed
  forward of it runs, that forward's :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo` (:attr:`DecoderState.running`);
- each of its **attention modules** carries an :class:`AttentionState`: what the registered attention function adds
  to that module's calls (a window, chunks, a query correction) and its decoder's state.

How the packed metadata reaches the code that needs it: every layer gets it as the ``packed_seq_info`` keyword, which
transformers' decoders hand down to each attention call (and which survives gradient checkpointing). Where no keyword
reaches (transformers calls mask functions with fixed arguments; bloom's and mpt's decoders hand no keywords down;
token mixers and position embeddings take none), the reader finds it on the state of the decoder running now,
:attr:`DecoderState.running`: the mask function through the decoders routed under its implementation name, an
attention module through its :class:`AttentionState`, a token mixer and an embeddings hook through the state they were
given when patched. No other channel exists (no thread-local, no module-level cache).

A deep copy or a pickled model carries its states along (the running forward is not carried).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unpack_trainer.packed_seq_info import PackedSeqInfo

if TYPE_CHECKING:
    from unpack_trainer.patches.attention import Needs

__all__ = ["PATCH_ATTRIBUTE", "AttentionState", "DecoderState", "attention_state", "decoder_state"]

# The one attribute the patch sets on a module it changes (in its ``__dict__``): a DecoderState on a decoder, an
# AttentionState on an attention module.
PATCH_ATTRIBUTE = "_unpack_patch"


@dataclass
class DecoderState:
    """What the patch keeps on one decoder (``LlamaModel``, the text model of a multimodal model, ...).

    Attributes:
        model_type: ``config.model_type``.
        implementation: the attention implementation whose registered name routes this decoder's packed batches.
        attention, rope: the flags it was patched with (:func:`unpack_trainer.models.patch_model`).
        config: the decoder's config (the mask function finds the running forward of its model by it).
        compiled: the model runs under ``torch.compile``: the packed metadata is planned on the host before the layers
            (attention buckets on a fixed shape grid), so the compiled layers read it without a graph break and
            recompile only when its shapes change class.
        features: what the model's attention asks of a backend (a :class:`~unpack_trainer.patches.attention.Needs`,
            :func:`unpack_trainer.anatomy.attention.attention_features`; ``None`` when unknown), for that planning.
        hook_ids: ids of the decoder's own hooks (ids, not handles: a deep copy keeps the ids).
        mixers: ``(qualified name under the decoder, handler name)`` of each patched token mixer.
        fixes: the names of the fixes installed (:data:`unpack_trainer.models.fixes.FIXES`), in order.
        undo: what each fix keeps for its ``remove``, by fix name.
        routed: ``False`` on a copy until its first forward routes its implementation again.
        no_dense_path: why transformers' dense path (``output_attentions=True``) is not exact on packed rows, or
            ``None``.
        mask_placeholder: what the mask function returns in a packed forward (``None``, or a tensor where the decoder
            needs one: mpt calls ``.to(torch.bool)`` on its mask; its packed attention ignores it).
        running: the packed forward running now (set by the decoder hook, cleared after the forward), or ``None``.
        dense: in that forward, attention takes transformers' dense path (``output_attentions``): only the token
            mixers and position embeddings follow ``running``.
        carried: packing keywords an outer model that drops them hands to this decoder's hook (bloom, mpt).
    """

    model_type: str
    implementation: str
    attention: bool
    rope: bool
    config: Any = None
    compiled: bool = False
    features: Needs | None = None
    hook_ids: list[int] = field(default_factory=list)
    mixers: list[tuple[str, str]] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    undo: dict[str, Any] = field(default_factory=dict)
    routed: bool = True
    no_dense_path: str | None = None
    mask_placeholder: torch.Tensor | None = None
    running: PackedSeqInfo | None = None
    dense: bool = False
    carried: dict[str, Any] | None = None

    def attention_info(self) -> PackedSeqInfo | None:
        """The running packed forward's metadata where attention follows it (not on transformers' dense path)."""
        return None if self.dense else self.running

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deep copy, pickle) is not inside this forward, and routes its implementation on its first forward.
        return {**self.__dict__, "running": None, "dense": False, "carried": None, "routed": False}


@dataclass
class AttentionState:
    """What the registered attention function adds to one attention module's packed calls.

    Attributes:
        decoder: the state of the module's decoder: where its packed forward is found when the decoder hands the
            module no ``packed_seq_info`` keyword (bloom, mpt).
        sliding_window: a window the model applies through its mask only (handed as ``sliding_window``), or ``None``.
        attention_chunk_size: the chunk size of a chunked-attention layer (llama4), or ``None``.
        query_correction: ``(module, query (B, H, T, D), info) -> query`` for a layer that scales its queries by
            positions along the row (llama4's temperature tuning), or ``None``.
        image_blocks: whether the layer applies the batch's bidirectional spans (a vision-language model's image
            blocks); ``False`` for a layer whose model keeps it causal (Gemma 4's full-attention layers).
    """

    decoder: DecoderState
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    query_correction: Callable[[torch.nn.Module, torch.Tensor, PackedSeqInfo], torch.Tensor] | None = None
    image_blocks: bool = True


def decoder_state(module: torch.nn.Module) -> DecoderState | None:
    """The :class:`DecoderState` of ``module``, a patched decoder, else ``None``."""
    state = module.__dict__.get(PATCH_ATTRIBUTE)
    return state if isinstance(state, DecoderState) else None


def attention_state(module: torch.nn.Module) -> AttentionState | None:
    """The :class:`AttentionState` of ``module``, an attention module of a patched decoder, else ``None``."""
    state = module.__dict__.get(PATCH_ATTRIBUTE)
    return state if isinstance(state, AttentionState) else None
