"""llama4: chunked-attention layers, and the temperature tuning of its NoPE layers' queries.

- **Chunks.** Its chunked layers (``config.layer_types`` ``"chunked_attention"``) attend within chunks of
  ``config.attention_chunk_size`` tokens through the mask only. On a packed row the chunks count from each sample's
  start, as for the sample alone: the registered attention function hands ``attention_chunk_size`` to the packed
  helper (:meth:`unpack_trainer.packed_seq_info.PackedSeqInfo.chunked`), read from the layer's
  :class:`~unpack_trainer.models.state.AttentionState`.
- **Temperature.** Its NoPE layers (``attn_temperature_tuning``, no RoPE) scale each query by
  ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` of the token's position ``p`` along the row (an ``arange``
  of the row's length), which on a packed row is not its position in its sample: the query correction rescales them
  per sample (rows shorter than ``floor_scale`` are unchanged: every scale is 1 there).
"""

from __future__ import annotations

from typing import Any

import torch

from unpack_trainer.anatomy.structure import attention_chunks
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import attention_state

__all__ = ["FIX", "temperature_per_sample"]


def _temperature_scales(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` per position ``p``, float32, as
    ``Llama4TextAttention.forward`` computes it."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def temperature_per_sample(module: torch.nn.Module, query: torch.Tensor, info: Any) -> torch.Tensor:
    """``query`` ``(B, H, T, D)`` scaled as for each sample alone (see the module docstring); same dtype."""
    seq_len = query.shape[2]
    if seq_len < module.floor_scale:
        return query
    row = _temperature_scales(module, torch.arange(seq_len, device=query.device))  # (T,)
    sample = _temperature_scales(module, info.position_ids(query.device))  # (B, T)
    return (query * (sample / row).unsqueeze(1).unsqueeze(-1)).to(query.dtype)


def _scales_queries_by_row_position(module: torch.nn.Module) -> bool:
    """Whether the attention module scales its queries by positions along the row (temperature tuning on a NoPE
    layer: ``attn_temperature_tuning`` and no RoPE)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and getattr(module, "use_rope", True) in (0, False)


def _applies(site: FixSite) -> str | None:
    chunks = [chunk for chunk in attention_chunks(site.decoder) or [] if chunk is not None]
    tuned = sum(map(_scales_queries_by_row_position, site.decoder.attention))
    reasons = []
    if chunks:
        reasons.append(f"{len(chunks)} layer(s) attend within chunks of {chunks[0]} tokens through the mask only")
    if tuned:
        reasons.append(f"{tuned} layer(s) scale their queries by positions along the row")
    return "; ".join(reasons) or None


def _install(site: FixSite) -> None:
    for module, chunk in zip(site.decoder.attention, attention_chunks(site.decoder) or []):
        state = attention_state(module)
        state.attention_chunk_size = chunk
        if _scales_queries_by_row_position(module):
            state.query_correction = temperature_per_sample


def _remove(site: FixSite) -> None:
    for module in site.module.modules():
        state = attention_state(module)
        if state is not None:
            state.attention_chunk_size, state.query_correction = None, None


FIX = Fix("llama4", _applies, _install, _remove)
