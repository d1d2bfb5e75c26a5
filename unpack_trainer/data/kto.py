"""Packed unpaired preference batches (KTO): each prompt of a batch once per packed row, its completions as branches.

Stage 5 of the data path (collate) for unpaired preference examples, as [`unpack_trainer.data.preference`] is for
pairs; the model side ([`unpack_trainer.trainers.branched`]) runs a packed row in place of TRL's padded view.

TRL's ``DataCollatorForUnpairedPreference`` pads ``B`` rows ``[p_i, c_i]`` (the examples) and, for the KL estimate of
``loss_type="kto"``, ``B`` rows ``[p_i, y_i]`` (each prompt with the previous example's completion,
``KL_completion_ids``), each set to its longest row: the policy runs both (the KL rows without gradient) and the
reference model both again, so every prompt runs four times. Here the same batch carries packed rows instead, in
which each distinct prompt appears once and the completions that follow it are branches (``packed_seq_parents``, see
:mod:`unpack_trainer.packed_seq_info`), each distinct ``(prompt, completion)`` once:

- the **main row** (the policy, with gradient): the examples' completions;
- the **KL row** (``packed_kl_row``: the policy, without gradient, as TRL's KL forward): the KL completions;
- the **reference row** (``packed_ref_row``: both sets at once, since the reference runs both without gradient; left
  out when the reference log-probs are precomputed): the examples' completions and the KL completions, so a KL
  sequence that is also an example (a prompt that repeats in the batch with another completion) runs once.

The policy's KL forward is a row of its own rather than branches of the main row: the main row runs with gradient, so
a KL branch there (its log-probs detached) would pay the backward pass over its tokens, three times its forward,
where the KL row pays one forward over it and its prompt again; the separate row is cheaper whenever a prompt is
shorter than twice its KL completion (50% prompt tokens: 2 units against 3), and it keeps TRL's loss code whole.

Each row keeps TRL's padded *view* of its sequences cut to the completions ([`completion_view`]), so TRL's loss reads
exactly the per-token values of its padded batch. Sequences are truncated as TRL's collator truncates them:
``(prompt + completion)[:max_length]``. Example (one prompt ``[5, 6]``, completions ``[7]`` and ``[9, 8]``, each the
other's KL completion)::

    packed_input_ids     [[5, 6, 7, 9, 8]]   seq_lengths [2, 1, 2]   seq_parents [-1, 0, 0]   the main row
    input_ids (view)     [[6, 7, 0], [6, 9, 8]]            completion_mask [[0, 1, 0], [0, 1, 1]]
    packed_view_index    [[1, 2, 0], [1, 3, 4]]
    packed_kl_row        packed_input_ids [[5, 6, 9, 8, 7]], input_ids [[6, 9, 8], [6, 7, 0]]
    packed_ref_row       packed_input_ids [[5, 6, 7, 9, 8]], packed_view_index [[1, 2, 0], [1, 3, 4], [1, 3, 4],
                         [1, 2, 0]]  (main rows, then KL rows: each sequence once)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer.data.collator import IGNORE_INDEX
from unpack_trainer.data.preference import completion_view
from unpack_trainer.packed_seq_info import TOKEN_INDEX_KEY, VIEW_INDEX_KEY, branched_row

__all__ = [
    "KL_ROW_KEY",
    "REF_ROW_KEY",
    "DataCollatorForPackedUnpairedPreference",
    "pack_unpaired_sequences",
]

KL_ROW_KEY = "packed_kl_row"
"""Batch key of the KL row (a dict of model inputs: the policy's forward without gradient)."""
REF_ROW_KEY = "packed_ref_row"
"""Batch key of the reference row (a dict of model inputs: main sequences, then KL sequences)."""


def pack_unpaired_sequences(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_length: int | None = None,
    prefix_sharing: bool = True,
    view_length: int | None = None,
) -> dict[str, Any]:
    """The packed row of ``(prompt, completion)`` sequences and its map to TRL's padded view of them.

    Each sequence is ``(prompt + completion)[:max_length]`` (TRL's truncation), its prompt the first
    ``min(len(prompt), len(sequence))`` tokens. With ``prefix_sharing``, sequences whose kept prompts are equal share
    one prompt segment, each distinct non-empty rest of a sequence one branch of it (a sequence equal to an earlier
    one reads the same tokens); a prompt with a single branch is one plain sample ``[prompt; completion]``. Without
    it, every sequence is a plain sample of its own. Segments are in the order of their first sequence, branches in
    the order of theirs.

    Args:
        sequences: ``(prompt_ids, completion_ids)`` per view row, lists of ints.
        max_length: TRL's truncation (``None``: none).
        prefix_sharing: share prompts (see above).
        view_length: ``L`` of the padded view (default: its longest sequence).

    Returns:
        :func:`unpack_trainer.packed_seq_info.branched_row`'s keys (``packed_input_ids`` / ``packed_position_ids``
        ``(1, T)`` int64, ``packed_seq_lengths`` ``(num_seqs,)`` int32, ``packed_seq_parents`` ``(num_seqs,)`` int64,
        ``packed_seq_info``) and ``packed_token_index`` ``(len(sequences), L)`` int64: the packed token of each view
        token, 0 on the view's padding.

    Example::

        pack_unpaired_sequences([([5, 6], [7]), ([5, 6], [9, 8]), ([5, 6], [7])])
        -> packed_input_ids [[5, 6, 7, 9, 8]], packed_seq_lengths [2, 1, 2], packed_seq_parents [-1, 0, 0],
           packed_token_index [[0, 1, 2, 0], [0, 1, 3, 4], [0, 1, 2, 0]]
    """
    full = []
    for prompt, completion in sequences:
        tokens = list(prompt) + list(completion)
        if max_length is not None:
            tokens = tokens[:max_length]
        full.append((tokens, min(len(prompt), len(tokens))))
    longest = max((len(tokens) for tokens, _ in full), default=0)
    view_length = longest if view_length is None else view_length
    if view_length < longest:
        raise ValueError(f"view_length={view_length} is shorter than the longest sequence ({longest} tokens).")
    # group -> (its first row, {branch tokens -> its first row})
    groups: dict[Any, tuple[int, dict[tuple[int, ...], int]]] = {}
    row_group: list[Any] = []
    for row, (tokens, shared) in enumerate(full):
        key = tuple(tokens[:shared]) if prefix_sharing else row
        head, branches = groups.setdefault(key, (row, {}))
        if len(tokens) > shared:
            branches.setdefault(tuple(tokens[shared:]), row)
        row_group.append(key)
    ids: list[int] = []
    lengths: list[int] = []
    parents: list[int] = []
    prompt_start: dict[Any, int] = {}
    branch_start: dict[tuple[Any, tuple[int, ...]], int] = {}

    def add(tokens: Sequence[int], parent: int) -> int:
        start = len(ids)
        ids.extend(tokens)
        lengths.append(len(tokens))
        parents.append(parent)
        return start

    for key, (head, branches) in groups.items():
        prompt = full[head][0][: full[head][1]]
        if len(branches) <= 1:  # one plain sample [prompt; completion] (or the prompt alone)
            branch = next(iter(branches), ())
            if not prompt and not branch:
                continue
            start = add(list(prompt) + list(branch), -1)
            prompt_start[key] = start
            if branch:
                branch_start[(key, branch)] = start + len(prompt)
            continue
        root = len(lengths)
        prompt_start[key] = add(prompt, -1) if prompt else len(ids)
        for branch in branches:
            branch_start[(key, branch)] = add(branch, root if prompt else -1)
    if not ids:
        raise ValueError(f"Every one of the {len(full)} sequences of the batch is empty; nothing to run.")
    token_index = torch.zeros(len(full), view_length, dtype=torch.int64)
    for row, (tokens, shared) in enumerate(full):
        key = row_group[row]
        if shared:
            token_index[row, :shared] = torch.arange(prompt_start[key], prompt_start[key] + shared)
        if len(tokens) > shared:
            start = branch_start[(key, tuple(tokens[shared:]))]
            token_index[row, shared : len(tokens)] = torch.arange(start, start + len(tokens) - shared)
    return {**branched_row(ids, lengths, parents), TOKEN_INDEX_KEY: token_index}


def _pad_columns(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


@dataclass
class DataCollatorForPackedUnpairedPreference(DataCollatorMixin):
    """TRL's unpaired preference collator (KTO) plus the packed rows the models run (see the module docstring).

    Args:
        pad_token_id (`int`):
            Token ID of the padded view's padding (never run through the model).
        max_length (`int` or `None`, *optional*):
            Truncation of ``prompt + completion``, as in TRL's ``DataCollatorForUnpairedPreference``.
        pad_to_multiple_of (`int` or `None`, *optional*):
            Padding of the views, as in TRL.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            Run each prompt of a row once, its completions as branches; `False` packs every sequence as a plain
            sample ``[prompt; completion]``.
        reference (`bool`, *optional*, defaults to `True`):
            Build the reference model's row (``packed_ref_row``); `False` when the batch carries precomputed reference
            log-probs.

    Returns (``torch_call``), for ``B`` examples: TRL's ``attention_mask`` ``(B, L)``, ``label`` ``(B,)`` bool and,
    when the examples have them, ``ref_logps`` / ``ref_KL_logps`` ``(B,)`` float; the view cut to the completions
    (``input_ids``, ``completion_mask``, ``packed_view_index`` ``(B, L')`` int64) and the main row's keys
    ([`pack_unpaired_sequences`]); with ``KL_completion_ids`` in the examples, ``packed_kl_row``; with ``reference``,
    ``packed_ref_row`` (``2B`` view rows with KL sequences, else ``B``). Each of the two is a dict of model inputs:
    ``input_ids`` / ``labels`` (``-100`` off the completions) / ``packed_view_index`` ``(rows, L')`` int64,
    ``packed_token_index`` ``(rows, L)`` int64 and the row's keys. TRL's ``KL_*`` tensors are not in the batch.
    """

    pad_token_id: int
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    prefix_sharing: bool = True
    reference: bool = True
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        from unpack_trainer._trl_compat import kto_padded_collator_class

        padded = kto_padded_collator_class()(
            pad_token_id=self.pad_token_id, max_length=self.max_length, pad_to_multiple_of=self.pad_to_multiple_of
        ).torch_call(examples)
        views = {"": {name: padded[name] for name in ("input_ids", "attention_mask", "completion_mask")}}
        sequences = {"": [(e["prompt_ids"], e["completion_ids"]) for e in examples]}
        if "KL_completion_ids" in examples[0]:
            views["KL_"] = {name: padded[f"KL_{name}"] for name in ("input_ids", "attention_mask", "completion_mask")}
            sequences["KL_"] = [(e["prompt_ids"], e["KL_completion_ids"]) for e in examples]
        batch = {key: value for key, value in padded.items() if not key.startswith("KL_")}
        main = pack_unpaired_sequences(
            sequences[""],
            max_length=self.max_length,
            prefix_sharing=self.prefix_sharing,
            view_length=views[""]["input_ids"].shape[1],
        )
        batch.update(main)
        batch.update(completion_view(views[""], main[TOKEN_INDEX_KEY], self.pad_to_multiple_of))
        if "KL_" in views:
            batch[KL_ROW_KEY] = self._row(views["KL_"], sequences["KL_"])
        if self.reference:
            width = max(view["input_ids"].shape[1] for view in views.values())
            fills = {"input_ids": self.pad_token_id, "attention_mask": 0, "completion_mask": 0}
            both = {
                name: torch.cat([_pad_columns(view[name], width, fill) for view in views.values()])
                for name, fill in fills.items()
            }
            batch[REF_ROW_KEY] = self._row(both, [pair for part in sequences.values() for pair in part])
        return batch

    def _row(self, view: dict[str, torch.Tensor], sequences: list[tuple[Any, Any]]) -> dict[str, Any]:
        """The model inputs of one packed row: its view cut to the completions, labels, maps and the row."""
        packed = pack_unpaired_sequences(
            sequences,
            max_length=self.max_length,
            prefix_sharing=self.prefix_sharing,
            view_length=view["input_ids"].shape[1],
        )
        cut = completion_view(view, packed[TOKEN_INDEX_KEY], self.pad_to_multiple_of)
        labels = cut["input_ids"].masked_fill(cut["completion_mask"] == 0, IGNORE_INDEX)
        return {**packed, "input_ids": cut["input_ids"], "labels": labels, VIEW_INDEX_KEY: cut[VIEW_INDEX_KEY]}
