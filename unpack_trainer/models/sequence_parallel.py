"""Which patched models keep packed rows exact under sequence parallelism (DeepSpeed Ulysses), and why not the rest.

Under Ulysses (accelerate's ``ParallelismConfig(sp_size=N, sp_backend="deepspeed")``) each of ``N`` processes embeds
one contiguous shard of every row, and its attention gets, after an all-to-all, the whole row for ``H / N`` of the
heads. DeepSpeed registers its wrapper under the model's attention implementation name, around what that name maps to:
on a patched model, the packed attention (:mod:`unpack_trainer.models.routing`), which reads the whole row's
metadata, built by the collator before the row was cut (``PackedSeqInfo.for_sequence_shards``). So a model is exact
under Ulysses when every piece that reads the packing on the shard side needs nothing but the shard's own tokens and
positions (RoPE from the shard's ``position_ids``, a window applied in attention), and its attention has nothing per
head that Ulysses' head split leaves whole. [`sequence_parallel_reason`] says why a model is not, or ``None``.

What is refused, and why (each is a reason at start, never a silent run):

- token mixers (convolutions, recurrent scans): their state crosses the shard boundary, and no varlen kernel here
  takes the previous shard's state;
- attention sinks and ALiBi: one value per head, for all ``H`` heads, where Ulysses hands each process ``H / N``;
- heads that do not divide by ``N`` (DeepSpeed's own rule: query heads by ``N``, key/value heads by ``N`` or ``N`` by
  them);
- the model-family fixes that read the packing on the shard side (positions counted from each sample's start, a
  reward model's last token per sample), and a vision-language model of a family not verified under Ulysses.

A vision-language model of a verified family (:data:`SHARD_VERIFIED_VISION`: Qwen2.5-VL's multi-axis positions, Gemma
3's bidirectional image blocks) is exact: the collator carries the whole row's vision inputs and positions to every
process (:class:`unpack_trainer.data.vision.WholeRowInputs`), and each process hands its multimodal model the image
features of its own image tokens (``mm_encoder_outputs``, its vision tower run on the images with a token in the
shard) and its slice of the positions; the image blocks are the whole row's, for the attention
(:mod:`unpack_trainer.models.fixes.vision_language`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from unpack_trainer.anatomy.attention import attention_features
from unpack_trainer.anatomy.structure import model_type_of, pretrained_model
from unpack_trainer.models.state import decoder_state
from unpack_trainer.patches.attention import AttentionFeature

__all__ = ["SHARD_SAFE_FIXES", "SHARD_VERIFIED_VISION", "sequence_parallel_reason"]

SHARD_SAFE_FIXES: frozenset[str] = frozenset(
    {"rope", "sliding_window", "packed_view", "compact_lm_head", "classification_head"}
)
"""The model-family fixes (:data:`unpack_trainer.models.fixes.FIXES`) exact under Ulysses: the fused RoPE reads each
token's own position (the shard's ``position_ids``); a window is applied by the packed attention, on the whole row; a
prompt-sharing trainer's packed view runs the process's shard and gathers the row's hidden states before the view and
the compact LM head read them; a sequence classifier's packed row next to its padded view (the reward trainer's) runs
the process's shard and gathers the head's per-token scores before each sequence's is read."""

SHARD_VERIFIED_VISION: frozenset[str] = frozenset({"qwen2_5_vl", "gemma3"})
"""The vision-language model types whose packed image rows are verified exact under Ulysses (each process its shard's
image features, multi-axis positions and the whole row's image blocks: ``tests/test_sequence_parallel_vision.py``):
for them the fixes :data:`VISION_FIXES` are shard-safe too."""

VISION_FIXES: frozenset[str] = frozenset({"vision_language", "multimodal_rope", "image_blocks"})

# Why each other fix is not exact on a shard (a fix missing here is named as not verified).
_SHARD_REASONS = {
    "alibi": "its ALiBi slopes are one per head, for all heads, where Ulysses hands each process a share of the heads",
    "outer_carry": "its ALiBi slopes are one per head, for all heads, where Ulysses hands each process a share of the "
    "heads",
    "positions": "its embeddings number each sample's tokens from the sample's start, which a later shard does not "
    "hold",
    "vision_language": "vision-language rows under sequence parallelism are not supported for this model type: each "
    "shard's image features and multi-axis positions are cut from the whole row's for the verified types only ("
    + ", ".join(sorted(SHARD_VERIFIED_VISION))
    + ")",
    "multimodal_rope": "vision-language rows under sequence parallelism are not supported for this model type: each "
    "shard's multi-axis positions are cut from the whole row's for the verified types only ("
    + ", ".join(sorted(SHARD_VERIFIED_VISION))
    + ")",
    "image_blocks": "vision-language rows under sequence parallelism are not supported for this model type: the "
    "whole row's image blocks reach a shard's attention for the verified types only ("
    + ", ".join(sorted(SHARD_VERIFIED_VISION))
    + ")",
    "liger_loss": "Liger-Kernel's fused loss takes unshifted labels, where the engine's loss hands each shard "
    "pre-shifted ones",
}


def _head_reason(config: Any, shards: int) -> str | None:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return None  # DeepSpeed reads the same fields and raises its own error
    if heads % shards:
        return f"its {heads} attention heads do not divide by sp_size={shards} (Ulysses splits the heads)"
    if kv_heads % shards and shards % kv_heads:
        return (
            f"its {kv_heads} key/value heads and sp_size={shards} do not divide one another (Ulysses splits them, or "
            "replicates them when there are fewer than sp_size)"
        )
    return None


def sequence_parallel_reason(model: torch.nn.Module, shards: int, *, vision_rows: bool = True) -> str | None:
    """Why the packed rows of ``model`` (patched) cannot be exact under Ulysses with ``shards`` processes, or ``None``.

    Args:
        model: the model the trainer patched (a PEFT model or a wrapper of it too).
        shards: ``sp_size``, the processes each row is cut over.
        vision_rows: whether the trainer's rows of a vision-language model come with the whole row's vision inputs
            for every shard (:class:`unpack_trainer.data.vision.WholeRowInputs`: SFT's vision packing collator with
            ``sequence_shards``); ``False`` refuses every vision-language model (a shard could not find its image
            features and positions).

    Example:
        a tiny Llama (4 heads, 2 key/value heads) at ``shards=2`` -> ``None``; at ``shards=3`` -> ``"its 4 attention
        heads do not divide by sp_size=3 (Ulysses splits the heads)"``; a Qwen3.5 (GatedDeltaNet layers) -> ``"token
        mixers (...) carry state along the row ..."``.
    """
    base = pretrained_model(model)
    if AttentionFeature.SINKS in attention_features(model).features:
        return (
            "its attention sinks are one learned logit per head, for all heads, where Ulysses hands each process a "
            "share of the heads"
        )
    for module in base.modules():
        state = decoder_state(module)
        if state is None:
            continue
        if state.mixers:
            names = ", ".join(sorted({type(module.get_submodule(name)).__name__ for name, _ in state.mixers}))
            return (
                f"token mixers ({names}) carry state along the row, across the shard boundary, and no varlen kernel "
                "here takes the previous shard's state"
            )
        for name in state.fixes:
            if name in SHARD_SAFE_FIXES or (name in VISION_FIXES and vision_rows and _vision_verified(base)):
                continue
            if name in VISION_FIXES and not vision_rows:
                return (
                    "vision-language rows under sequence parallelism are cut with the whole row's vision inputs by "
                    "SFT's packing only, not in this trainer"
                )
            why = _SHARD_REASONS.get(name, "it is not verified under sequence parallelism")
            return f"the model-family fix {name!r}: {why}"
    return _head_reason(base.config.get_text_config(), shards)


def _vision_verified(base: torch.nn.Module) -> bool:
    """Whether the vision-language model ``base`` is of a verified type (:data:`SHARD_VERIFIED_VISION`) and its
    multimodal model takes image features in place of pixel values (``mm_encoder_outputs``), which a shard's forward
    hands it."""
    from unpack_trainer.anatomy.vision import find_vision_language

    if model_type_of(base) not in SHARD_VERIFIED_VISION:
        return False
    vision = find_vision_language(base)
    return vision is not None and "mm_encoder_outputs" in inspect.signature(type(vision.module).forward).parameters
