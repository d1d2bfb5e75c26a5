"""Packed (padding-free) collator: a list of examples -> one flat row plus the packing metadata attention needs.

Stage 5 of the data path, its last (collate: rows -> one packed batch); the model side reads the batch from here on
([`unpack_trainer.packed_seq_info`], [`unpack_trainer.models`]).

Follows the contract of TRL's ``DataCollatorForLanguageModeling(padding_free=True)`` and adds
``packed_seq_lengths``, the one piece of metadata every attention backend can be driven from.

Worked example, two examples of lengths 3 and 2 (no ``seq_lengths``: each example is one sample)::

    input_ids           [[1, 2, 3, 4, 5]]
    position_ids        [[0, 1, 2, 0, 1]]
    labels              [[-100, 2, 3, -100, 5]]
    packed_seq_lengths  [3, 2]            int32
    cu_seq_lens_q/k     [0, 3, 5]         int32
    max_length_q/k      3                 Python int
    use_cache           False             (an unpatched model with a KV cache would ignore the packing)
"""

from __future__ import annotations

import math
import numbers
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer.data.validation import check_positive_int, check_seq_lengths, token_list
from unpack_trainer.packed_seq_info import (
    CU_SEQ_LENS_K_KEY,
    CU_SEQ_LENS_Q_KEY,
    INFO_KEY,
    MAX_LENGTH_K_KEY,
    MAX_LENGTH_Q_KEY,
    PACKED_BATCH_KEYS,
    SEQ_LENGTHS_COLUMN,
    SEQ_LENGTHS_KEY,
    PackedSeqInfo,
    restart_positions,
    zero_prefixed_cumsum,
)

__all__ = ["IGNORE_INDEX", "SEQUENCE_SHARDED_KEYS", "DataCollatorForPacking", "packed_metadata"]

IGNORE_INDEX = -100

# The tensors of a batch for sequence parallelism: each of shape (B, T), which DeepSpeed's data loader adapter cuts
# along T (every other tensor it refuses); the row's metadata goes whole, as the `packed_seq_info` object.
SEQUENCE_SHARDED_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids")


def packed_metadata(seq_lengths: torch.Tensor | Sequence[int]) -> dict[str, Any]:
    """Everything derived from the per-sample lengths of a flat row, computed once on the CPU (the model hook adopts
    it: :meth:`unpack_trainer.packed_seq_info.PackedSeqInfo.from_seq_lengths`).

    Args:
        seq_lengths: ``(num_samples,)`` lengths of the samples in the row, in order; all positive.

    Returns:
        ``position_ids`` ``(1, total_tokens)`` int64 restarting at 0 per sample; ``packed_seq_lengths``
        ``(num_samples,)`` int32; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``(num_samples + 1,)`` int32 zero-prefixed
        cumsum (one tensor under both keys); ``max_length_q`` / ``max_length_k`` the longest sample as a Python int.
        ``cu_seq_lens_*`` and ``max_length_*`` are transformers' flash-attention keywords: its own flash path reads
        them on an unpatched model instead of deriving them from ``position_ids`` in every layer.
    """
    lengths = torch.as_tensor(seq_lengths, dtype=torch.int32).reshape(-1)
    if lengths.numel() == 0 or bool((lengths <= 0).any()):
        raise ValueError(f"Every packed sample needs at least one token, got lengths {lengths.tolist()}.")
    cu_seqlens = zero_prefixed_cumsum(lengths)
    position_ids = restart_positions(lengths, cu_seqlens).unsqueeze(0)
    max_length = int(lengths.max())
    return {
        "position_ids": position_ids,
        SEQ_LENGTHS_KEY: lengths,
        CU_SEQ_LENS_Q_KEY: cu_seqlens,
        CU_SEQ_LENS_K_KEY: cu_seqlens,
        MAX_LENGTH_Q_KEY: max_length,
        MAX_LENGTH_K_KEY: max_length,
    }


@dataclass
class DataCollatorForPacking(DataCollatorMixin):
    """Flatten a batch of examples into one row of shape ``(1, T)`` with per-sample positions and no attention mask.

    Each example is a dict with ``input_ids`` and optionally ``labels``, ``completion_mask``, ``assistant_masks`` (all
    the same length as ``input_ids``), and ``seq_lengths`` when the example is a row packed ahead of time (several
    samples; their lengths must sum to ``len(input_ids)``). Without ``seq_lengths`` each example is one sample
    (padding-free batching).

    Output keys (:data:`unpack_trainer.packed_seq_info.PACKED_BATCH_KEYS`, then ``use_cache``): ``input_ids``
    ``(1, T)`` int64; ``labels`` ``(1, T)`` int64 with ``-100`` at every sample's first token, wherever the example's
    labels are ``-100``, where ``assistant_masks == 0``, and where ``completion_mask == 0`` when
    ``completion_only_loss``; ``position_ids`` ``(1, T)`` int64; ``packed_seq_lengths`` ``(num_samples,)`` int32
    summing to ``T``; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` int32; ``max_length_q`` / ``max_length_k`` int;
    ``use_cache=False`` (unless ``use_cache=None``); ``packed_seq_info`` with ``seq_info=True``. No
    ``attention_mask``: a mask would make transformers ignore the packing.

    Safe by default for any model, patched or not: transformers' own models detect a packed row from
    ``position_ids`` that restart, but only when they build no KV cache; with their default ``use_cache=True`` an
    unpatched model attends across samples (logits off by 0.1-0.3 on a tiny Llama). The batch therefore carries
    ``use_cache=False``, which every transformers causal LM ``forward`` accepts (TRL's ``SFTTrainer.compute_loss``
    sets the same value). A cache of a packed row would be of no use anyway: its keys span several samples.

    Every example is validated (``ValueError`` naming the example and the field): ids, labels and masks must be flat
    1-D sequences of integers (lists, arrays or tensors; masks may be booleans), of equal lengths, and
    ``seq_lengths`` positive integers summing to the number of tokens.

    Args:
        pad_token_id (`int`):
            Token id used for padding when ``pad_to_multiple_of`` is set.
        pad_to_multiple_of (`int` or `None`, *optional*, defaults to `None`):
            Pad ``T`` up to a multiple of this value. The padding is one more pseudo-sample (its own positions from 0,
            all labels ``-100``, included in ``packed_seq_lengths``) so it never attends to or is seen by real tokens.
        completion_only_loss (`bool` or `None`, *optional*, defaults to `None`):
            Whether ``completion_mask`` masks the labels. ``None`` applies it whenever the examples have it.
        return_tensors (`str`, *optional*, defaults to `"pt"`):
            Only ``"pt"`` is supported.
        use_cache (`bool` or `None`, *optional*, defaults to `False`):
            Value of the ``use_cache`` key added to every batch. ``False`` keeps packed batches exact on models whose
            attention is not patched (see above). ``None`` leaves the key out, for a model whose ``forward`` does not
            take ``use_cache``; then pass ``use_cache=False`` yourself unless the model is patched.
        seq_info (`bool`, *optional*, defaults to `False`):
            Also return ``packed_seq_info``: the batch's
            [`~unpack_trainer.packed_seq_info.PackedSeqInfo`], built here on the CPU. A patched model's hook adopts
            it instead of reading ``packed_seq_lengths`` / ``cu_seq_lens_*`` back once they are on the GPU, so no
            forward waits for the device. Only for a patched model (an unpatched one would receive a keyword it does
            not know); the trainers set it when they patch.
        sequence_shards (`int`, *optional*, defaults to `1`):
            Under sequence parallelism (DeepSpeed Ulysses, ``N`` processes): each row is padded to a multiple of ``N``
            (the padding a pseudo-sample, as above) and the batch holds only what the engine's data loader can cut
            along the row or copy whole: ``input_ids``, ``labels``, ``position_ids`` ``(1, T)`` and ``packed_seq_info``,
            the whole row's metadata marked with the shards
            ([`~unpack_trainer.packed_seq_info.PackedSeqInfo.for_sequence_shards`]), which every process gets whole.
            ``packed_seq_lengths`` and transformers' flash keys (1-D, not along the row) are left out. Only for a
            patched model.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    completion_only_loss: bool | None = None
    return_tensors: str = "pt"
    use_cache: bool | None = False
    seq_info: bool = False
    sequence_shards: int = 1

    def __post_init__(self) -> None:
        if self.pad_token_id is None:
            raise ValueError("`pad_token_id` is None; set the tokenizer's pad token (or use its eos token).")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, numbers.Integral):
            raise ValueError(f"`pad_token_id` must be an integer token id, got {self.pad_token_id!r}.")
        if self.pad_to_multiple_of is not None:
            check_positive_int(
                self.pad_to_multiple_of,
                "pad_to_multiple_of",
                requirement="positive: an integer >= 1, or None for no padding",
            )
        check_positive_int(self.sequence_shards, "sequence_shards", requirement="positive: an integer >= 1")
        if self.use_cache not in (None, True, False):
            raise ValueError(f"`use_cache` must be True, False or None, got {self.use_cache!r}.")
        if self.return_tensors != "pt":
            raise ValueError(f"Only return_tensors='pt' is supported, got {self.return_tensors!r}.")

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if not examples:
            raise ValueError("Cannot collate an empty batch.")
        packed_ahead = SEQ_LENGTHS_COLUMN in examples[0]
        input_ids, labels, seq_lengths = [], [], []
        for index, example in enumerate(examples):
            ids, example_labels = self._example_tokens(example, index)
            if packed_ahead != (SEQ_LENGTHS_COLUMN in example):
                raise ValueError(
                    f"Example {index} {'lacks' if packed_ahead else 'has'} `seq_lengths` while example 0 "
                    f"{'has' if packed_ahead else 'does not'}; mix packed and unpacked rows in different batches."
                )
            if packed_ahead:
                lengths = check_seq_lengths(example[SEQ_LENGTHS_COLUMN], len(ids), index, "example {index}")
            else:
                lengths = [len(ids)]
            input_ids.extend(ids)
            labels.extend(example_labels)
            seq_lengths.extend(lengths)

        padding = self._padding_length(len(input_ids))
        if padding:
            input_ids.extend([self.pad_token_id] * padding)
            labels.extend([IGNORE_INDEX] * padding)
            seq_lengths.append(padding)

        output = packed_metadata(seq_lengths)
        input_tensor, label_tensor = _int64_row(input_ids), _int64_row(labels)
        if input_tensor is None or label_tensor is None:
            self._raise_for_bad_values(examples)
        output["input_ids"] = input_tensor
        label_tensor[0, output[CU_SEQ_LENS_Q_KEY][:-1].long()] = IGNORE_INDEX
        output["labels"] = label_tensor
        sharded = self.sequence_shards > 1
        batch = {key: output[key] for key in (SEQUENCE_SHARDED_KEYS if sharded else PACKED_BATCH_KEYS)}
        if self.use_cache is not None:
            batch["use_cache"] = self.use_cache
        if self.seq_info or sharded:
            batch[INFO_KEY] = PackedSeqInfo.from_seq_lengths(
                output[SEQ_LENGTHS_KEY],
                batch_size=1,
                seq_len=input_tensor.shape[1],
                cu_seqlens=output[CU_SEQ_LENS_Q_KEY],
                max_seqlen=output[MAX_LENGTH_Q_KEY],
            ).for_sequence_shards(self.sequence_shards)
        return batch

    def _example_tokens(
        self, example: dict[str, Any], index: int, *, scan: bool = False
    ) -> tuple[list[int], list[int]]:
        """An example's ids and labels with its masks applied; ``ValueError`` naming ``index`` on bad input.

        Ids and labels get the O(1) check here (``scan=False``); every value is checked when the batch tensors are
        built (see [`_int64_row`]), and a failure there re-checks the examples with ``scan=True`` to name the culprit.
        """
        if "input_ids" not in example:
            raise ValueError(f"Example {index} has no `input_ids` (keys: {sorted(example)}).")
        ids = token_list(example["input_ids"], index, "`input_ids` of example {index}", scan=scan)
        if not ids:
            raise ValueError(f"Example {index} is empty; every example needs at least one token.")
        if example.get("labels") is not None:
            labels = token_list(example["labels"], index, "`labels` of example {index}", scan=scan)
        else:
            labels = ids
        masks = [("labels", labels)]
        use_completion = self.completion_only_loss is not False and example.get("completion_mask") is not None
        if use_completion:
            mask = token_list(
                example["completion_mask"], index, "`completion_mask` of example {index}", allow_bool=True
            )
            masks.append(("completion_mask", mask))
        if example.get("assistant_masks") is not None:
            mask = token_list(
                example["assistant_masks"], index, "`assistant_masks` of example {index}", allow_bool=True
            )
            masks.append(("assistant_masks", mask))
        for name, values in masks:
            if len(values) != len(ids):
                raise ValueError(
                    f"Example {index} has {len(ids)} input_ids but {len(values)} `{name}`; they must have equal length."
                )
        for _name, values in masks[1:]:
            labels = [label if keep else IGNORE_INDEX for label, keep in zip(labels, values)]
        return ids, labels

    def _raise_for_bad_values(self, examples: list[dict[str, Any]]) -> None:
        """Check every value of every example (``token_list`` with ``scan=True``) and raise the error naming it."""
        for index, example in enumerate(examples):
            self._example_tokens(example, index, scan=True)
        raise ValueError("A token id or label of this batch is not an integer in int64 range.")

    def _padding_length(self, total: int) -> int:
        multiple = math.lcm(self.pad_to_multiple_of or 1, self.sequence_shards)
        return (-total) % multiple


def _int64_row(values: list[int]) -> torch.Tensor | None:
    """``values`` as a ``(1, len(values))`` int64 tensor, or ``None`` if one is not an integer in int64 range or is a
    ``bool``. ``array("q")`` checks and converts every value in C: several times faster than ``torch.tensor``."""
    if bool in set(map(type, values)):
        return None
    try:
        buffer = array("q", values)
    except (TypeError, OverflowError):
        return None
    return torch.frombuffer(buffer, dtype=torch.int64).clone().unsqueeze(0)
