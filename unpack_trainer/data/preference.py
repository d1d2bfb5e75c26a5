"""Packed preference batches: many (prompt, chosen, rejected) pairs in one row, the prompt shared by both answers.

Stage 5 of the data path (collate) for preference pairs, as [`unpack_trainer.data.collator`] is for plain samples;
the model side ([`unpack_trainer.trainers.branched`]) runs the packed row in place of TRL's view.

TRL's ``DataCollatorForPreference`` pads ``[p, c]`` and ``[p, r]`` to the longest sequence of the batch (chosen rows
first, then rejected rows), so every prompt runs twice and every row pays for the longest. Here the pairs of a batch
go into one packed row instead. With ``prefix_sharing=True`` a pair is one branched segment ``[p, c, r]``: ``c`` and
``r`` both continue from ``p`` (``packed_seq_parents``, see :mod:`unpack_trainer.packed_seq_info`), so the prompt runs
once; with ``prefix_sharing=False`` the pair is the two plain samples ``[p, c]`` and ``[p, r]``.

The batch keeps TRL's padded *view* of the pairs (what TRL's loss reads, never run through the model) next to the
packed row that is run, and the maps between the two. The view is TRL's padded batch cut to the completions, each
row from the token before its completion (whose hidden state predicts the completion's first token), so the LM head
scores no prompt token; ``attention_mask`` stays TRL's, uncut (TRL counts tokens and weighs the MoE auxiliary loss
with it)::

    pair                (p=[5, 6], c=[7], r=[8, 9])
    packed_input_ids    [[5, 6, 7, 8, 9]]                  the row the model runs (1, T)
    packed_seq_lengths  [2, 1, 2]   packed_seq_parents [-1, 0, 0]
    packed_position_ids [[0, 1, 2, 2, 3]]
    attention_mask      [[1, 1, 1, 0], [1, 1, 1, 1]]       TRL's (2 * num_pairs, L)
    packed_token_index  [[0, 1, 2, 0], [0, 1, 3, 4]]       packed token of each token of TRL's batch (0: padding)
    input_ids           [[6, 7, 0], [6, 8, 9]]             the view (2 * num_pairs, L'), chosen rows first
    completion_mask     [[0, 1, 0], [0, 1, 1]]
    packed_view_index   [[1, 2, 0], [1, 3, 4]]             packed token of each view token

The model side (:mod:`unpack_trainer.trainers.branched`: ``install_packed_view``) runs the packed row and hands back
the last hidden state gathered into the view's layout (and MoE router logits into TRL's batch layout), so TRL's loss
code reads exactly the per-token values of its padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer.packed_seq_info import TOKEN_INDEX_KEY, VIEW_INDEX_KEY, branched_row

__all__ = ["DataCollatorForPackedPreference", "completion_view", "pack_preference_pairs"]


def _truncate(ids: list[int], max_length: int | None, mode: str) -> list[int]:
    if max_length is None:
        return ids
    if mode == "keep_start":
        return ids[:max_length]
    if mode == "keep_end":
        return ids[-max_length:]
    raise ValueError(f"Unsupported truncation mode: {mode}, expected 'keep_start' or 'keep_end'")


def pack_preference_pairs(
    examples: list[dict[str, Any]],
    *,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    prefix_sharing: bool = True,
    view_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """The packed row of ``examples`` and its map to TRL's padded view.

    Sequences are truncated as TRL's ``DataCollatorForPreference`` truncates them (``[p, c]`` and ``[p, r]`` each to
    ``max_length``). With ``prefix_sharing``, the prompt tokens both truncated sequences keep at the same positions
    are shared (all of ``p``, or its first ``max_length`` tokens, with ``keep_start``; with ``keep_end``, a pair that
    was cut is packed unshared); an empty branch (a completion cut away) is left out.

    Args:
        examples: dicts with ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (lists of ints).
        view_length: ``L`` of the padded view (default: its longest sequence).

    Returns:
        ``packed_input_ids`` / ``packed_position_ids`` ``(1, T)`` int64, ``packed_seq_lengths`` ``(num_seqs,)`` int32,
        ``packed_seq_parents`` ``(num_seqs,)`` int64 (``-1`` or the prompt a branch continues), ``packed_token_index``
        ``(2 * num_pairs, L)`` int64: the packed token of each view token, chosen rows first, 0 on view padding.
    """
    ids: list[int] = []
    lengths: list[int] = []
    parents: list[int] = []
    views: list[list[int]] = []  # per view row: packed positions, chosen rows then rejected rows
    chosen_views, rejected_views = [], []

    def add(tokens: list[int], parent: int) -> list[int]:
        start = len(ids)
        ids.extend(tokens)
        lengths.append(len(tokens))
        parents.append(parent)
        return list(range(start, start + len(tokens)))

    for index, example in enumerate(examples):
        prompt = list(example["prompt_ids"])
        chosen = _truncate(prompt + list(example["chosen_ids"]), max_length, truncation_mode)
        rejected = _truncate(prompt + list(example["rejected_ids"]), max_length, truncation_mode)
        if not chosen or not rejected:
            raise ValueError(f"Preference pair {index} has an empty sequence after truncation to {max_length}.")
        cut = len(chosen) < len(prompt) + len(example["chosen_ids"]) or len(rejected) < len(prompt) + len(
            example["rejected_ids"]
        )
        shared = 0
        if prefix_sharing and not (cut and truncation_mode == "keep_end"):
            shared = min(len(prompt), len(chosen), len(rejected))
        if shared == 0:
            chosen_views.append(add(chosen, -1))
            rejected_views.append(add(rejected, -1))
            continue
        root = len(lengths)
        prefix = add(chosen[:shared], -1)
        chosen_views.append(prefix + (add(chosen[shared:], root) if len(chosen) > shared else []))
        rejected_views.append(prefix + (add(rejected[shared:], root) if len(rejected) > shared else []))
    views = chosen_views + rejected_views
    longest = max(len(view) for view in views)
    view_length = longest if view_length is None else view_length
    if view_length < longest:
        raise ValueError(f"view_length={view_length} is shorter than the longest sequence ({longest} tokens).")
    view_index = torch.zeros(len(views), view_length, dtype=torch.int64)
    for row, view in enumerate(views):
        view_index[row, : len(view)] = torch.tensor(view, dtype=torch.int64)
    return {**branched_row(ids, lengths, parents), TOKEN_INDEX_KEY: view_index}


@dataclass
class DataCollatorForPackedPreference(DataCollatorMixin):
    """TRL's preference collator plus the packed row the model runs (see the module docstring).

    Args:
        pad_token_id (`int`):
            Token ID of the padded view's padding (never run through the model).
        max_length (`int` or `None`, *optional*):
            Truncation of ``[p, c]`` and ``[p, r]``, as in TRL's ``DataCollatorForPreference``.
        truncation_mode (`str`, *optional*, defaults to `"keep_start"`):
            `"keep_start"` or `"keep_end"`, as in TRL.
        pad_to_multiple_of (`int` or `None`, *optional*):
            Padding of the view, as in TRL.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            Run each prompt once, ``[p, c, r]`` as one branched segment; `False` packs ``[p, c]`` and ``[p, r]`` as two
            plain samples.
    """

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    prefix_sharing: bool = True
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        from unpack_trainer._trl_compat import dpo_padded_collator_class

        view = dpo_padded_collator_class()(
            pad_token_id=self.pad_token_id,
            max_length=self.max_length,
            truncation_mode=self.truncation_mode,
            pad_to_multiple_of=self.pad_to_multiple_of,
        ).torch_call(examples)
        packed = pack_preference_pairs(
            examples,
            max_length=self.max_length,
            truncation_mode=self.truncation_mode,
            prefix_sharing=self.prefix_sharing,
            view_length=view["input_ids"].shape[1],
        )
        return {**view, **packed, **completion_view(view, packed[TOKEN_INDEX_KEY], self.pad_to_multiple_of)}


def completion_view(
    view: dict[str, torch.Tensor], token_index: torch.Tensor, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """TRL's padded view cut to what its loss reads: each row from the token before its completion (the one whose
    hidden state predicts the completion's first token) to its end, so the LM head scores ``1 + |completion|``
    positions per row instead of the longest ``|prompt| + |completion|`` of the batch.

    Args:
        view: ``input_ids`` / ``attention_mask`` / ``completion_mask`` ``(2 * num_pairs, L)`` from TRL's collator.
        token_index: ``(2 * num_pairs, L)`` int64, the packed token of each view token.
        pad_to_multiple_of: pad the cut width to a multiple of this, as TRL pads ``L``.

    Returns:
        ``input_ids``, ``completion_mask`` and ``packed_view_index`` ``(2 * num_pairs, L')`` (padding: the pad id of
        ``input_ids``' padding, 0, 0). ``attention_mask`` stays ``(2 * num_pairs, L)``: TRL counts the batch's tokens
        with it, and weighs the MoE auxiliary loss by it over every token (``packed_token_index`` gives the router
        logits that layout).

    Example::

        input_ids [[5, 6, 7, 0], [5, 6, 8, 9]], completion_mask [[0, 0, 1, 0], [0, 0, 1, 1]]
        -> input_ids [[6, 7, 0], [6, 8, 9]], completion_mask [[0, 1, 0], [0, 1, 1]]
    """
    input_ids, completion_mask = view["input_ids"], view["completion_mask"]
    lengths = view["attention_mask"].sum(dim=1)
    has_completion = completion_mask.bool().any(dim=1)
    first = torch.where(has_completion, completion_mask.argmax(dim=1), lengths)
    start = (first - 1).clamp(min=0)
    width = int((lengths - start).max())
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    columns = start.unsqueeze(1) + torch.arange(width).unsqueeze(0)
    valid = columns < lengths.unsqueeze(1)
    columns = columns.clamp(max=input_ids.shape[1] - 1)
    pad_id = input_ids[~view["attention_mask"].bool()]
    pad_id = int(pad_id[0]) if pad_id.numel() else 0

    def cut(x: torch.Tensor, fill: int) -> torch.Tensor:
        return x.gather(1, columns).masked_fill(~valid, fill)

    return {
        "input_ids": cut(input_ids, pad_id),
        "completion_mask": cut(completion_mask, 0),
        VIEW_INDEX_KEY: cut(token_index, 0),
    }
