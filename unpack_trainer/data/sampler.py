"""``BalancedStepSampler``: the order in which packed rows are drawn so that every optimizer step holds balanced
numbers of samples ([`balanced_step_order`]) and, with several data-parallel processes, every process of a step gets
rows of the same cost ([`row_costs`]: tokens plus attention's share, [`attention_cost_ratio`]) and about the same
number of samples ([`balanced_rank_order`]).

Stage 4 of the data path (order: which packed rows each step and each process takes); the rows it picks go to the
collator of stage 5 ([`unpack_trainer.data.collator`])."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from unpack_trainer.data.collator import DataCollatorForPacking
from unpack_trainer.data.validation import check_positive_int


def balanced_step_order(samples_per_row: Sequence[int] | np.ndarray, rows_per_step: int, *, seed: int) -> list[int]:
    """An order of the rows in which every ``rows_per_step`` consecutive rows (one optimizer step) hold about the same
    number of samples.

    The rows are ranked by sample count (ties in an order shuffled with ``seed``) and cut into ``rows_per_step``
    strata of consecutive ranks; step ``j`` takes the ``j``-th row of each stratum, going up the even strata and down
    the odd ones, so rows with many samples are paired with rows with few. The steps are then shuffled with
    ``seed``. With ``rows_per_step == 1`` this is a plain shuffle. When the rows do not divide evenly, the left-over
    rows (the middle ranks) form the last, smaller step.

    Args:
        samples_per_row: ``(num_rows,)`` number of samples in each row.
        rows_per_step: rows in one optimizer step (all processes and accumulation steps).
        seed: seed of the tie order and of the order of the steps.

    Returns:
        A permutation of ``range(num_rows)`` as a list.

    Example:
        >>> order = balanced_step_order([1, 9, 5, 5, 2, 8], rows_per_step=2, seed=0)
        >>> sorted(sum([1, 9, 5, 5, 2, 8][i] for i in order[k : k + 2]) for k in range(0, 6, 2))
        [10, 10, 10]
    """
    counts = np.asarray(samples_per_row, dtype=np.int64)
    if rows_per_step < 1:
        raise ValueError(f"`rows_per_step` must be at least 1, got {rows_per_step}.")
    rng = np.random.default_rng(seed)
    if rows_per_step == 1 or counts.size <= rows_per_step:
        return rng.permutation(counts.size).tolist()
    shuffled = rng.permutation(counts.size)
    ranked = shuffled[np.argsort(counts[shuffled], kind="stable")]
    num_steps = counts.size // rows_per_step
    strata = []
    for r in range(rows_per_step):
        # strata at both ends of the ranking; the left-over middle ranks are set aside
        start = r * num_steps if r < rows_per_step // 2 else counts.size - (rows_per_step - r) * num_steps
        stratum = ranked[start : start + num_steps]
        strata.append(stratum if r % 2 == 0 else stratum[::-1])
    steps = np.stack(strata, axis=1)  # (num_steps, rows_per_step)
    half = rows_per_step // 2
    leftover = ranked[half * num_steps : counts.size - (rows_per_step - half) * num_steps].tolist()
    order = steps[rng.permutation(num_steps)].reshape(-1).tolist()
    return order + leftover


def attention_cost_ratio(config: object) -> float | None:
    """``b / a`` of the step cost model ``a * tokens + b * sum(L_i ** 2)`` from a transformers model config's shapes,
    counting matrix-multiply FLOPs per layer: ``2 * P`` per token for the ``P`` weights of the attention projections
    and the MLP (``hidden * (2 * hidden + 2 * kv_dim) + 3 * hidden * intermediate``), and ``2 * hidden * L ** 2`` for
    causal attention over a sample of ``L`` tokens (scores and values, half the square each). So
    ``b / a = 1 / (2 * hidden + 2 * kv_dim + 3 * intermediate)``: for Llama-3-8B's shapes 1.9e-5, attention 3.7% of a
    row holding one sample of 2,048 tokens and 38% at 32,768. Kernels make attention slower per FLOP than the matrix
    multiplies, so this is a lower bound; set ``SFTConfig.attention_cost_ratio`` to a measured value to override.
    ``None`` when the config lacks ``hidden_size`` or ``intermediate_size``.
    """
    hidden = getattr(config, "hidden_size", None)
    intermediate = getattr(config, "intermediate_size", None)
    if not hidden or not intermediate:
        return None
    heads = getattr(config, "num_attention_heads", None) or 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 1.0 / (2 * hidden + 2 * kv_heads * head_dim + 3 * intermediate)


def row_costs(seq_lengths: Sequence[Sequence[int]], attention_ratio: float) -> np.ndarray:
    """``(num_rows,)`` float64 cost of each packed row under ``tokens + attention_ratio * sum(L_i ** 2)`` (``a = 1``).

    Example:
        >>> row_costs([[3, 1], [4]], attention_ratio=0.5).tolist()
        [9.0, 12.0]
    """
    return np.asarray(
        [sum(row) + attention_ratio * sum(length * length for length in row) for row in seq_lengths], dtype=np.float64
    )


def balanced_rank_order(
    samples_per_row: Sequence[int] | np.ndarray,
    cost_per_row: Sequence[float] | np.ndarray,
    *,
    num_ranks: int,
    batch_size: int,
    accumulation_steps: int = 1,
    seed: int,
) -> list[int]:
    """An order of the packed rows for ``num_ranks`` data-parallel processes in which every process of an optimizer
    step gets rows of the same total cost and about the same number of samples, and the steps hold about the same
    number of samples, each row exactly once.

    The order is laid out for the usual sharding of a map-style sampler (accelerate's, with ``batch_size`` rows per
    batch): consecutive batches of ``batch_size`` rows go to processes ``0, 1, ..., num_ranks - 1`` in turn, and
    ``accumulation_steps`` such rounds make one optimizer step. Composition:

    1. Rows are ranked by cost (ties in an order shuffled with ``seed``) and cut into *bands* of ``num_ranks``
       consecutive ranks: the rows of a band cost about the same.
    2. Each step takes ``batch_size * accumulation_steps`` bands (each process gets one row of every band), chosen
       with [`balanced_step_order`] on the bands' sample counts, so every step holds about the same number of
       samples; the steps come in an order shuffled with ``seed``, the left-over bands last.
    3. Inside a step, band by band (the band with the widest cost spread first), the costliest row goes to the
       process with the least cost so far; then rows of one band are swapped between the costliest and the cheapest
       process while that narrows the gap, then between the processes with the most and the fewest samples while
       the costs stay within 0.5% of their mean.

    When the rows do not divide into ``batch_size * num_ranks``, the last ``len(rows) % num_ranks`` rows (the
    middle of the cost ranking) come last, unbalanced; the trainer splits rows so that this does not happen
    ([`split_rows`]).

    Args:
        samples_per_row: ``(num_rows,)`` samples in each row.
        cost_per_row: ``(num_rows,)`` cost of each row (e.g. [`row_costs`]).
        num_ranks: data-parallel processes (``>= 1``).
        batch_size: rows per process per forward (``per_device_train_batch_size``).
        accumulation_steps: forwards per optimizer step (``gradient_accumulation_steps``).
        seed: seed of the tie order and of the order of the steps.

    Returns:
        A permutation of ``range(num_rows)`` as a list.

    Example:
        >>> order = balanced_rank_order([1, 4, 2, 3], [4.0, 1.0, 2.0, 3.0], num_ranks=2, batch_size=1, seed=0)
        >>> sorted(sorted([4.0, 1.0, 2.0, 3.0][i] for i in order[k : k + 2]) for k in (0, 2))
        [[1.0, 2.0], [3.0, 4.0]]
    """
    counts = np.asarray(samples_per_row, dtype=np.int64)
    costs = np.asarray(cost_per_row, dtype=np.float64)
    if counts.shape != costs.shape or counts.ndim != 1:
        raise ValueError(f"`samples_per_row` {counts.shape} and `cost_per_row` {costs.shape} must be 1-D and match.")
    num_ranks = check_positive_int(num_ranks, "num_ranks")
    batch_size = check_positive_int(batch_size, "batch_size")
    accumulation_steps = check_positive_int(accumulation_steps, "accumulation_steps")
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(counts.size)
    ranked = shuffled[np.argsort(costs[shuffled], kind="stable")]
    num_bands = counts.size // num_ranks
    extra = counts.size - num_bands * num_ranks  # rows left over: the middle of the ranking
    middle = (counts.size - extra) // 2
    leftover = ranked[middle : middle + extra].tolist()
    ranked = np.concatenate((ranked[:middle], ranked[middle + extra :]))
    bands = ranked.reshape(num_bands, num_ranks)  # (num_bands, num_ranks) row ids, each band of similar cost
    bands_per_step = batch_size * accumulation_steps
    band_order = balanced_step_order(counts[bands].sum(axis=1), bands_per_step, seed=int(rng.integers(2**63 - 1)))
    order: list[int] = []
    for start in range(0, num_bands, bands_per_step):
        step = bands[band_order[start : start + bands_per_step]]  # (bands in this step, num_ranks)
        per_rank = _assign_bands(step, costs, counts)  # (num_ranks, bands in this step) row ids
        for micro in range(0, per_rank.shape[1], batch_size):  # one batch of `batch_size` rows per process, in turn
            order.extend(per_rank[:, micro : micro + batch_size].reshape(-1).tolist())
    return order + leftover


def _assign_bands(step: np.ndarray, costs: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Give every rank one row of each band of ``step`` (``(num_bands, num_ranks)`` row ids) so that the ranks' total
    costs match (greedy by band, then swaps inside a band between the costliest and the cheapest rank), then their
    sample counts (swaps that keep the costs within 0.5% of their mean)."""
    num_bands, num_ranks = step.shape
    if num_ranks == 1:
        return step.T.copy()
    band_costs = costs[step]
    assigned = np.empty((num_ranks, num_bands), dtype=np.int64)
    totals = np.zeros(num_ranks)
    for band in np.argsort(-(band_costs.max(axis=1) - band_costs.min(axis=1)), kind="stable").tolist():
        by_cost = np.argsort(-band_costs[band], kind="stable")
        ranks = np.argsort(totals, kind="stable")  # cheapest rank first gets the costliest row
        assigned[ranks, band] = step[band, by_cost]
        totals[ranks] += band_costs[band, by_cost]
    for _ in range(4 * num_bands * num_ranks):
        high, low = int(np.argmax(totals)), int(np.argmin(totals))
        gap = totals[high] - totals[low]
        deltas = costs[assigned[high]] - costs[assigned[low]]  # what moves from high to low per band swap
        band = int(np.argmin(np.abs(deltas - gap / 2)))
        if not 0 < deltas[band] < gap:
            break
        assigned[[high, low], band] = assigned[[low, high], band]
        totals[high] -= deltas[band]
        totals[low] += deltas[band]
    # Then the sample counts: swaps inside a band between the ranks with the most and the fewest samples, kept when
    # the cost gap stays within `_COST_SLACK` of the mean cost (or does not widen).
    samples = counts[assigned].sum(axis=1)
    limit = max(float(totals.max() - totals.min()), _COST_SLACK * float(totals.mean()))
    for _ in range(4 * num_bands * num_ranks):
        high, low = int(np.argmax(samples)), int(np.argmin(samples))
        gap = samples[high] - samples[low]
        moved = counts[assigned[high]] - counts[assigned[low]]
        shift = costs[assigned[high]] - costs[assigned[low]]
        best, best_gap = -1, gap
        for band in np.flatnonzero((moved > 0) & (moved < gap)).tolist():
            new = totals.copy()
            new[high] -= shift[band]
            new[low] += shift[band]
            if new.max() - new.min() <= limit and abs(gap - 2 * moved[band]) < best_gap:
                best, best_gap = band, abs(gap - 2 * moved[band])
        if best < 0:
            break
        assigned[[high, low], best] = assigned[[low, high], best]
        totals[high] -= shift[best]
        totals[low] += shift[best]
        samples[high] -= moved[best]
        samples[low] += moved[best]
    return assigned


_COST_SLACK = 0.005


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
        costs: ``(num_rows,)`` float64 cost of each row ([`row_costs`]); with
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
