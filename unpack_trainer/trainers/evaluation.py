"""Evaluation of a packed trainer: which collator builds its batches, and ``eval_loss`` weighed by what each batch
holds where transformers would weigh the batches wrongly.

- [`eval_collator`]: evaluation batches padded (one row per example) or flattened as the decision said
  ([`unpack_trainer.decision.eval_batches`]), counted where their weights matter;
- [`record_batch`] / [`weighed_eval_loss`]: each counted batch's loss and weight, and the weighted mean they make.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers.trainer_utils import has_length

__all__ = ["EVAL_ITEMS_KEY", "batch_collator", "eval_collator", "record_batch", "weighed_eval_loss"]

EVAL_ITEMS_KEY = "unpack_eval_items"  # an evaluation batch's number of dataset items (int), read and removed


class _ItemCountingCollator:
    """``collator``'s batch plus how many dataset items it was built from (``EVAL_ITEMS_KEY``, a Python int), so
    that evaluation can weigh each batch by what it holds."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(features)
        batch[EVAL_ITEMS_KEY] = len(features)
        return batch


def batch_collator(trainer: Any) -> Any:
    """The collator that builds ``trainer``'s batches, under what evaluation puts around it (its count of dataset
    items per batch)."""
    collator = trainer.data_collator
    return collator.collator if isinstance(collator, _ItemCountingCollator) else collator


@contextlib.contextmanager
def eval_collator(trainer: Any, dataset: Any) -> Iterator[None]:
    """``trainer``'s collator, while an evaluation data loader is built on ``dataset``: padded (one row per example,
    the trainer's ``_padded_collator``) when [`unpack_trainer.decision.eval_batches`] said so, flattened otherwise;
    and counted (each batch carries its number of dataset items) when transformers would weigh the batches wrongly: a
    dataset without a length read without batch dispatching (accelerate cannot know the short last batch), or
    ``loss_normalization="sample"`` (a batch weighs its samples, not its rows)."""
    run = trainer.unpack_run
    collator = trainer.data_collator
    if trainer.unpack_decision.packed and not run.eval_flattened and trainer.unpack_packs_in == "collator":
        trainer.data_collator = trainer._padded_collator()
    streamed = run.batches_whole and not has_length(dataset)
    if streamed or run.sample_loss:
        trainer.data_collator = _ItemCountingCollator(trainer.data_collator)
    try:
        yield
    finally:
        trainer.data_collator = collator


def record_batch(trainer: Any, inputs: dict[str, Any], items: int | None, loss: torch.Tensor | None) -> None:
    """During an evaluation loop, record a counted batch's loss (``()`` or per row; ``items``: its dataset items,
    taken off the batch as ``EVAL_ITEMS_KEY`` before the model saw it, ``None`` for a batch not counted) with its
    weight: its dataset items, or with ``loss_normalization="sample"`` its samples with a trained token (the
    trainer's ``_count_samples`` of ``inputs``)."""
    run = trainer.unpack_run
    if items is None or loss is None or run.eval_weights is None:
        return
    weight = trainer._count_samples(inputs) if run.sample_loss else items
    run.eval_weights.append((loss.detach().float().mean(), weight))


def weighed_eval_loss(trainer: Any, metrics: dict[str, float], key: str, recorded: list[tuple[Any, int]]) -> None:
    """``metrics[key]`` (``eval_loss``) as the mean of the batch losses ``recorded`` weighed by what each batch holds
    (see [`record_batch`]), where batches were counted. Non-finite batch losses are left out as transformers does
    (``logging_nan_inf_filter``). Across processes, the sums are added up."""
    if not recorded or key not in metrics:
        return
    losses = torch.stack([loss for loss, _ in recorded]).double()
    weights = torch.tensor([weight for _, weight in recorded], dtype=torch.float64, device=losses.device)
    finite = torch.isfinite(losses)
    if trainer.args.logging_nan_inf_filter and bool(finite.any()):
        losses, weights = losses[finite], weights[finite]
    totals = torch.stack([(losses * weights).sum(), weights.sum()]).to(trainer.args.device)
    if trainer.accelerator.num_processes > 1:
        totals = trainer.accelerator.reduce(totals, reduction="sum")
    metrics[key] = float(totals[0] / totals[1].clamp(min=1))
