"""Per-sample loss weighting (``loss_normalization="sample"``): every sample weighs the same, whatever its length.

Part of the trainers' room: the SFT trainer's loss ([`unpack_trainer.trainers.sft`]) weighs its token losses with it.
"""

from __future__ import annotations

from typing import Any

import torch


def sample_weights(batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Per-token weights that turn a sum of token losses into a sum of per-sample mean losses.

    A sample is a row of ``labels`` or, inside a row, a run of positions starting where ``position_ids`` is 0 (packed
    and padding-free rows). Label position ``j`` (``j >= 1``, label ``!= -100``) is scored from position ``j - 1``, as
    in a causal LM loss.

    Args:
        batch: ``labels`` ``(B, T)`` int64 and optionally ``position_ids`` ``(B, T)`` int64.

    Returns:
        ``weights`` ``(B, T - 1)`` float32 aligned with ``labels[:, 1:]``: ``1 / (trained tokens of the sample)`` at
        every trained position, 0 elsewhere; and the number of samples with at least one trained token.

    Example:
        labels ``[[-100, 5, 6, -100, 7]]``, position_ids ``[[0, 1, 2, 0, 1]]`` -> weights ``[[0.5, 0.5, 0, 1]]``, 2.
    """
    labels = batch["labels"]
    starts = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    starts[:, 0] = True
    position_ids = batch.get("position_ids")
    if position_ids is not None and position_ids.shape == labels.shape:
        starts |= position_ids.to(labels.device) == 0
    segment = starts.reshape(-1).cumsum(0) - 1
    trained = torch.zeros_like(starts)
    trained[:, 1:] = labels[:, 1:] != -100
    trained = trained.reshape(-1)
    counts = torch.bincount(segment[trained], minlength=int(segment[-1]) + 1)
    weights = torch.where(trained, 1.0 / counts[segment].clamp(min=1).to(torch.float32), 0.0)
    return weights.view(labels.shape)[:, 1:], int((counts > 0).sum())
