"""``BalancedStepSampler``: the order in which packed rows are drawn so that every optimizer step holds balanced
numbers of samples ([`unpack_trainer.data.packing.balanced_step_order`]) and, with several data-parallel processes,
every process of a step gets rows of the same cost and about the same number of samples
([`unpack_trainer.data.packing.balanced_rank_order`]).

Stage 4 of the data path (order: which packed rows each step and each process takes); the rows it picks go to the
collator of stage 5 ([`unpack_trainer.data.collator`])."""

from __future__ import annotations

import numpy as np
import torch

from unpack_trainer.data.collator import DataCollatorForPacking
from unpack_trainer.data.packing import balanced_rank_order, balanced_step_order


class BalancedStepSampler(torch.utils.data.Sampler):
    """Packed rows in an order where each optimizer step's rows hold balanced sample counts, reshuffled per epoch.

    With one process the order is [`balanced_step_order`]'s. With ``num_ranks > 1`` it is [`balanced_rank_order`]'s,
    laid out for accelerate's sharding (consecutive batches of ``batch_size`` rows to processes 0, 1, ... in turn):
    every process of a step gets rows of the same cost under ``costs`` and about the same number of samples, and
    every row comes exactly once per epoch when the rows divide into ``batch_size * num_ranks`` (the trainer splits
    rows so that they do).

    Args:
        samples_per_row: ``(num_rows,)`` int64 samples in each packed row.
        rows_per_step: rows per optimizer step, all processes and accumulation steps together.
        seed: the order of epoch ``e`` uses seed ``seed + e`` (the trainer passes ``data_seed``, else ``seed``).
        num_ranks: data-parallel processes.
        batch_size: rows per process per forward (``per_device_train_batch_size``); with ``num_ranks > 1``.
        costs: ``(num_rows,)`` float64 cost of each row ([`unpack_trainer.data.packing.row_costs`]); with
            ``num_ranks > 1`` (``None``: the row's sample count stands in).
    """

    def __init__(
        self,
        samples_per_row: np.ndarray,
        rows_per_step: int,
        *,
        seed: int,
        num_ranks: int = 1,
        batch_size: int = 1,
        costs: np.ndarray | None = None,
    ) -> None:
        self.samples_per_row = samples_per_row
        self.rows_per_step = rows_per_step
        self.seed = seed
        self.num_ranks = num_ranks
        self.batch_size = batch_size
        self.costs = costs
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples_per_row)

    def __iter__(self):
        seed = self.seed + self.epoch
        if self.num_ranks == 1:
            yield from balanced_step_order(self.samples_per_row, self.rows_per_step, seed=seed)
            return
        costs = self.samples_per_row if self.costs is None else self.costs
        yield from balanced_rank_order(
            self.samples_per_row,
            costs,
            num_ranks=self.num_ranks,
            batch_size=self.batch_size,
            accumulation_steps=max(1, self.rows_per_step // (self.num_ranks * self.batch_size)),
            seed=seed,
        )


def measure_attention_cost_ratio(
    model: torch.nn.Module, max_length: int, *, pieces: int = 16, repeats: int = 3
) -> float:
    """Measure ``b / a`` of the step cost model ``a * tokens + b * sum(L_i ** 2)`` on ``model`` as it will train:
    the median time of a forward and backward of one packed row of ``max_length`` tokens holding one sample, and of
    one holding ``pieces`` samples of ``max_length / pieces`` tokens (same tokens, ``pieces`` times less attention),
    ``repeats`` times each, interleaved. The model must be patched ([`unpack_trainer.patch_model`]) so that packed
    rows cost what their samples cost; its gradients are cleared afterwards. The result can be passed as
    ``SFTConfig.attention_cost_ratio``; it is ``0.0`` when attention is too cheap to measure.

    Args:
        model: a causal LM taking the packed batch of [`DataCollatorForPacking`] (without ``use_cache``).
        max_length: tokens per row (``>= pieces``).
        pieces: samples in the second row.
        repeats: timings per row.
    """
    import time

    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 2))
    generator = torch.Generator().manual_seed(0)
    piece = max_length // pieces
    rows = {
        "one": [torch.randint(vocab, (piece * pieces,), generator=generator)],
        "many": [torch.randint(vocab, (piece,), generator=generator) for _ in range(pieces)],
    }
    collate = DataCollatorForPacking(pad_token_id=0, use_cache=None)
    batches = {
        name: {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate([{"input_ids": x} for x in s]).items()}
        for name, s in rows.items()
    }
    times: dict[str, list[float]] = {"one": [], "many": []}
    for _ in range(repeats + 1):  # the first round warms up
        for name, batch in batches.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(**batch).loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    one, many = (sorted(t[1:])[len(t[1:]) // 2] for t in (times["one"], times["many"]))
    tokens = piece * pieces
    b = (one - many) / (tokens**2 - pieces * piece**2)
    a = (many - b * pieces * piece**2) / tokens
    return max(b, 0.0) / a if a > 0 else 0.0
