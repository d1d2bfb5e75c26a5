"""``BalancedStepSampler``: the order in which packed rows are drawn so that every optimizer step holds balanced
numbers of samples ([`unpack_trainer.packing.balanced_step_order`])."""

from __future__ import annotations

import numpy as np
import torch

from unpack_trainer.packing import balanced_step_order


class BalancedStepSampler(torch.utils.data.Sampler):
    """Packed rows in an order where each optimizer step's rows hold balanced sample counts, reshuffled per epoch.

    Args:
        samples_per_row: ``(num_rows,)`` int64 samples in each packed row.
        rows_per_step: rows per optimizer step, all processes and accumulation steps together.
        seed: the order of epoch ``e`` uses seed ``seed + e``.
    """

    def __init__(self, samples_per_row: np.ndarray, rows_per_step: int, *, seed: int) -> None:
        self.samples_per_row = samples_per_row
        self.rows_per_step = rows_per_step
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples_per_row)

    def __iter__(self):
        yield from balanced_step_order(self.samples_per_row, self.rows_per_step, seed=self.seed + self.epoch)
