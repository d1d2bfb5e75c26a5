"""The one definition of the estimated packing speedup, shared by the trainer's start line and ``unpack-trainer analyze``.

    speedup = padded tokens of random batches of B samples / real tokens

Padded training shuffles the samples and pads each batch of ``B`` samples to its longest; packed and padding-free
training process only the real tokens. ``B`` is the number of samples a padded step would hold: the
``--batch-size`` of ``analyze``; for the trainer, ``per_device_train_batch_size`` samples (padding-free) or
``per_device_train_batch_size`` rows times the mean samples per row (packing). A token count, not a measurement: it
leaves out attention's quadratic cost and per-step overhead.
"""

from __future__ import annotations

import numpy as np

__all__ = ["estimated_speedup", "padded_batches"]


def padded_batches(lengths: np.ndarray, batch_size: int, *, seed: int | None = 0) -> tuple[np.ndarray, np.ndarray]:
    """Batches of ``batch_size`` samples (the last may be smaller), shuffled with ``seed`` (``None``: in the given
    order), each padded to its longest sample.

    Args:
        lengths: ``(num_samples,)`` integer token counts, all positive.
        batch_size: samples per batch, ``>= 1``.
        seed: seed of the shuffle, or ``None`` to keep the order of ``lengths``.

    Returns:
        ``(real, padded)``: ``(num_batches,)`` int64 real tokens and padded tokens of each batch.

    Example:
        >>> padded_batches(np.array([100, 10, 90, 10]), 2, seed=None)   # batches [100, 10] and [90, 10]
        (array([110, 100]), array([200, 180]))
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}.")
    array = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if seed is not None:
        array = array[np.random.default_rng(seed).permutation(array.size)]
    num_batches = -(-array.size // batch_size)
    grid = np.zeros(num_batches * batch_size, dtype=np.int64)
    grid[: array.size] = array
    grid = grid.reshape(num_batches, batch_size)
    sizes = (grid > 0).sum(axis=1)
    return grid.sum(axis=1), grid.max(axis=1) * sizes


def estimated_speedup(lengths: np.ndarray, batch_size: float, *, seed: int = 0) -> float:
    """Padded tokens of random batches of ``batch_size`` samples (rounded, at least 1) / real tokens.

    Example:
        >>> estimated_speedup(np.array([10, 1]), 2)   # one batch padded to 10: 20 tokens for 11 real ones
        1.8181818181818181
    """
    array = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if array.size == 0 or int(array.sum()) == 0:
        raise ValueError("No tokens to estimate a speedup from.")
    _, padded = padded_batches(array, max(1, round(batch_size)), seed=seed)
    return float(padded.sum()) / float(array.sum())
