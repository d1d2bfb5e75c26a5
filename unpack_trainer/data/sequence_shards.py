"""Batches of the prompt-sharing trainers made ready for sequence parallelism: a packed row beside a padded view
(DPO's pairs, and GRPO's / RLOO's groups inside the step), and the prompts GRPO / RLOO turn into rows in the step.

DeepSpeed's Ulysses data loader adapter (``UlyssesSPDataLoaderAdapter``, which transformers' Trainer puts around the
training data loader under ``ParallelismConfig(sp_size=N, sp_backend="deepspeed")``) takes batches whose tensors are
all ``(B, T)`` along one row: it gathers the batch of every process of the group, cuts each tensor into ``N``
contiguous shards, one per process, and copies everything else whole. A batch of a prompt-sharing trainer is TRL's
padded view (what its loss reads) beside one packed row (what the model runs), so [`ShardReadyCollator`] hands the
adapter the packed row's tokens and positions to cut, padded to a multiple of ``N`` (the padding one more sample, on
no view position), and the whole batch, its packing metadata marked with the shards
([`unpack_trainer.packed_seq_info.PackedSeqInfo.for_sequence_shards`]), under ``SHARDED_BATCH_KEY`` to copy.

Worked example, ``N = 2``, a pair whose row is 7 tokens (prompt 3, chosen 2, rejected 2)::

    input_ids          (1, 8)  the packed row and one padding token, cut by the adapter into (1, 4) per process
    position_ids       (1, 8)  its positions (the padding's from 0)
    labels             (1, 8)  all -100 (the loss is TRL's, from the view)
    packed_sequence_parallel_batch
                       the collator's whole batch: the view, packed_input_ids (1, 8), packed_seq_lengths [3, 2, 2, 1],
                       packed_seq_parents [-1, 0, 0, -1], packed_seq_info (sequence_shards=2)

GRPO and RLOO build their rows inside the training step, from prompts TRL's collator hands on as a list: their
batches go through the adapter as a placeholder row of ``N`` tokens beside the prompts, copied whole
([`prompts_ready`]), and each packed row they build in the step is padded and marked the same way
([`padded_for_shards`]) before the model cuts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from unpack_trainer.data.collator import IGNORE_INDEX
from unpack_trainer.packed_seq_info import (
    INFO_KEY,
    PACKED_INPUT_IDS_KEY,
    PACKED_POSITION_IDS_KEY,
    SEQ_LENGTHS_KEY,
    SEQ_PARENTS_KEY,
    SHARDED_BATCH_KEY,
    PackedSeqInfo,
)

__all__ = ["ShardReadyCollator", "padded_for_shards", "prompts_ready", "shard_ready"]


def padded_for_shards(batch: dict[str, Any], shards: int) -> dict[str, Any]:
    """``batch`` (a view beside a packed row: ``packed_input_ids`` / ``packed_position_ids`` ``(1, T)`` int64 and
    ``packed_seq_info``) with its row padded to a multiple of ``shards`` tokens (the padding one more sample, on no
    view position, its positions from 0) and its metadata marked for ``shards`` processes
    ([`unpack_trainer.packed_seq_info.PackedSeqInfo.for_sequence_shards`]); a new dict, ``batch`` unchanged.

    Raises:
        ValueError: a batch with no packed row, or one of several rows, or one with image spans.
    """
    if PACKED_INPUT_IDS_KEY not in batch or not isinstance(batch.get(INFO_KEY), PackedSeqInfo):
        raise ValueError(
            f"Sequence parallelism needs a batch with one packed row (`{PACKED_INPUT_IDS_KEY}` and `{INFO_KEY}`), got "
            f"the keys {sorted(batch)}."
        )
    ids, positions, info = batch[PACKED_INPUT_IDS_KEY], batch[PACKED_POSITION_IDS_KEY], batch[INFO_KEY]
    if ids.shape[0] != 1 or info.bidirectional_spans is not None:
        raise ValueError("Sequence parallelism cuts one packed row of text; this batch has several rows or images.")
    padding = (-ids.shape[1]) % shards
    whole = dict(batch)
    if padding:
        lengths = torch.cat([info.seq_lengths, torch.tensor([padding], dtype=info.seq_lengths.dtype)])
        parents = None
        if info.seq_parents is not None:
            parents = torch.cat([info.seq_parents, torch.tensor([-1], dtype=info.seq_parents.dtype)])
        ids = torch.nn.functional.pad(ids, (0, padding))
        positions = torch.cat([positions, torch.arange(padding, dtype=positions.dtype)[None]], dim=1)
        info = PackedSeqInfo(lengths, batch_size=1, seq_len=ids.shape[1], seq_parents=parents)
        if SEQ_LENGTHS_KEY in whole:
            whole[SEQ_LENGTHS_KEY] = lengths.to(whole[SEQ_LENGTHS_KEY].dtype)
        if SEQ_PARENTS_KEY in whole and parents is not None:
            whole[SEQ_PARENTS_KEY] = parents.to(whole[SEQ_PARENTS_KEY].dtype)
    whole[PACKED_INPUT_IDS_KEY], whole[PACKED_POSITION_IDS_KEY] = ids, positions
    whole[INFO_KEY] = info.for_sequence_shards(shards)
    return whole


def shard_ready(batch: dict[str, Any], shards: int) -> dict[str, Any]:
    """``batch`` (a view beside a packed row, as [`padded_for_shards`] takes it) as DeepSpeed's adapter takes it for
    ``shards`` processes (see the module docstring).

    Raises:
        ValueError: as [`padded_for_shards`].
    """
    whole = padded_for_shards(batch, shards)
    return _adapter_batch(whole[PACKED_INPUT_IDS_KEY], whole[PACKED_POSITION_IDS_KEY], whole)


def prompts_ready(examples: Any, shards: int) -> dict[str, Any]:
    """A batch of examples that the trainer turns into rows inside its step (GRPO's and RLOO's prompts: TRL's collator
    hands the examples on as they are) as DeepSpeed's adapter takes it for ``shards`` processes: a placeholder row of
    ``shards`` tokens for the adapter to cut (``input_ids`` / ``position_ids`` / ``labels`` ``(1, shards)`` int64, one
    token per process, read by no one) and ``examples`` under ``SHARDED_BATCH_KEY``, which the adapter copies whole to
    every process of the group (each process's batch in turn, as it does for every batch)."""
    return _adapter_batch(torch.zeros(1, shards, dtype=torch.int64), torch.arange(shards)[None], examples)


def _adapter_batch(ids: torch.Tensor, positions: torch.Tensor, whole: Any) -> dict[str, Any]:
    """What DeepSpeed's adapter takes: the row it cuts (``ids`` / ``positions`` ``(1, T)`` int64, labels all -100: the
    loss is the trainer's) and ``whole``, copied to every process, under ``SHARDED_BATCH_KEY``."""
    return {
        "input_ids": ids,
        "position_ids": positions,
        "labels": torch.full_like(ids, IGNORE_INDEX),
        SHARDED_BATCH_KEY: whole,
    }


@dataclass
class ShardReadyCollator:
    """``collator`` whose batches come ready for DeepSpeed's adapter for ``shards`` processes: [`shard_ready`] (a
    prompt-sharing trainer's packed collator) or, with ``prompts=True``, [`prompts_ready`] (a trainer that builds its
    rows inside the step). ``collator`` stays reachable as the attribute of the same name."""

    collator: Any
    shards: int
    prompts: bool = False

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        ready = prompts_ready if self.prompts else shard_ready
        return ready(self.collator(features), self.shards)
