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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer.packed_seq_info import (
    MULTIMODAL_POSITIONS_KEY,
    PACKED_INPUT_IDS_KEY,
    TOKEN_INDEX_KEY,
    VIEW_INDEX_KEY,
    branched_row,
)

__all__ = [
    "DataCollatorForPackedPreference",
    "DataCollatorForPackedVisionPreference",
    "completion_view",
    "pack_preference_pairs",
    "pack_vision_pairs",
]


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


# The keys of TRL's vision preference batch that are not model inputs of the packed row (the view's own layout).
_VIEW_KEYS = ("input_ids", "attention_mask", "completion_mask")


def pack_vision_pairs(
    view: dict[str, Any],
    *,
    prefix_sharing: bool = True,
    positions: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The packed row of TRL's padded batch of image preference pairs, each image once per pair.

    ``view`` is what TRL's ``DataCollatorForVisionPreference`` returns for ``N`` pairs: ``input_ids``,
    ``attention_mask``, ``completion_mask`` ``(2N, L)`` int64 (chosen rows, then rejected rows; each row its prompt,
    with the prompt's image tokens, then its completion, flushed left and right-padded), the per-token keys of the
    processor (``mm_token_type_ids``, ``token_type_ids``: ``(2N, L)`` int64) and the vision tensors of its images
    (``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``, ...), which TRL computes from every pair's images
    listed twice (``images * 2``: the vision tensors of the rejected rows repeat those of the chosen rows, along
    dimension 0, whatever the family's layout).

    With ``prefix_sharing`` each pair is one branched segment ``[p, c, r]`` (``c`` and ``r`` continue ``p``, see
    [`pack_preference_pairs`]) and every vision tensor is its first half along dimension 0: each image once, in the
    order of the pairs, which is the order of their image tokens on the row. Without it, the packed row is TRL's rows
    one after the other (chosen rows, then rejected rows: the order of TRL's images), each a plain sample, and the
    vision tensors are TRL's. Per-token keys are read into the packed row (``(1, T)`` int64, under their own names).

    Args:
        view: TRL's vision preference batch (see above).
        prefix_sharing: share each pair's prompt (its text and image tokens) between its two completions.
        positions: ``(input_ids (2N, L), attention_mask (2N, L), inputs) -> (rows, 2N, L)`` int64, each row's
            positions as the model numbers the row alone (``inputs``: the view's per-token keys and vision tensors);
            for a text model of multi-axis positions (the Qwen2-VL family), see
            :class:`unpack_trainer.anatomy.vision.SequencePositions`. ``None``: the 1-D positions of the packed row.

    Returns:
        The packed row of :func:`unpack_trainer.packed_seq_info.branched_row` (``packed_input_ids``,
        ``packed_position_ids`` ``(1, T)`` int64, ``packed_seq_lengths`` ``(num_seqs,)`` int32, ``packed_seq_parents``
        ``(num_seqs,)`` int64, ``packed_seq_info``), ``packed_token_index`` ``(2N, L)`` int64 (the packed token of each
        view token, 0 on padding), the per-token keys ``(1, T)`` int64, the vision tensors, and with ``positions``
        ``packed_multimodal_position_ids`` ``(rows, 1, T)`` int64: each packed token's positions read from its full
        sequence (a prompt token from either of its two sequences, which must agree).

    Raises:
        ValueError: a row is not flushed left, the two rows of a pair do not start with the same prompt, the rejected
            rows' vision tensors do not repeat the chosen rows', or a prompt's positions depend on its completion.

    Example (one pair; ``p = [5, I, 6]`` with ``I`` an image token, ``c = [7]``, ``r = [8, 9]``; ``(1, 4, 4)`` grid)::

        input_ids        [[5, I, 6, 7, 0], [5, I, 6, 8, 9]]   image_grid_thw [[1, 4, 4], [1, 4, 4]]
        packed_input_ids [[5, I, 6, 7, 8, 9]]                   image_grid_thw [[1, 4, 4]]
        packed_seq_lengths [3, 1, 2]   packed_seq_parents [-1, 0, 0]   packed_position_ids [[0, 1, 2, 3, 3, 4]]
    """
    input_ids, attention_mask = view["input_ids"], view["attention_mask"].bool()
    completion_mask = view["completion_mask"].bool()
    rows, width = input_ids.shape
    if prefix_sharing and rows % 2:
        raise ValueError(f"A preference batch has chosen rows, then rejected rows; got {rows} rows.")
    num_pairs = rows // 2
    lengths = attention_mask.sum(dim=1)
    if not torch.equal(attention_mask, torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)):
        raise ValueError(
            "The preference batch's rows are not flushed left (TRL's vision preference collator's layout)."
        )
    has_completion = (completion_mask & attention_mask).any(dim=1)
    prompt_lengths = torch.where(has_completion, completion_mask.int().argmax(dim=1), lengths).tolist()
    lengths_list, ids = lengths.tolist(), input_ids.tolist()
    per_token = {
        key: value
        for key, value in view.items()
        if key not in _VIEW_KEYS and isinstance(value, torch.Tensor) and tuple(value.shape) == (rows, width)
    }
    if prefix_sharing:
        examples = []
        for pair in range(num_pairs):
            chosen, rejected = pair, num_pairs + pair
            prompt = prompt_lengths[chosen]
            same = prompt == prompt_lengths[rejected] and ids[chosen][:prompt] == ids[rejected][:prompt]
            same = same and all(torch.equal(v[chosen, :prompt], v[rejected, :prompt]) for v in per_token.values())
            if not same:
                raise ValueError(
                    f"Preference pair {pair}: its chosen and rejected sequences do not start with the same prompt "
                    f"({prompt} and {prompt_lengths[rejected]} prompt tokens), so the prompt cannot be shared."
                )
            examples.append(
                {
                    "prompt_ids": ids[chosen][:prompt],
                    "chosen_ids": ids[chosen][prompt : lengths_list[chosen]],
                    "rejected_ids": ids[rejected][prompt : lengths_list[rejected]],
                }
            )
        packed = pack_preference_pairs(examples, prefix_sharing=True, view_length=width)
    else:
        tokens = [token for row in range(rows) for token in ids[row][: lengths_list[row]]]
        packed = branched_row(tokens, lengths_list, [-1] * rows)
        starts = torch.cumsum(lengths, dim=0) - lengths
        token_index = (starts.unsqueeze(1) + torch.arange(width).unsqueeze(0)).masked_fill(~attention_mask, 0)
        packed[TOKEN_INDEX_KEY] = token_index.to(torch.int64)
    token_index = packed[TOKEN_INDEX_KEY]
    total = packed[PACKED_INPUT_IDS_KEY].shape[1]
    targets = token_index[attention_mask]

    def to_row(value: torch.Tensor) -> torch.Tensor:
        row = value.new_zeros(value.shape[:-2] + (total,))
        row[..., targets] = value[..., attention_mask]
        return row.unsqueeze(-2)

    out: dict[str, Any] = {**packed}
    vision: dict[str, Any] = {}
    for key, value in view.items():
        if key in _VIEW_KEYS or key in per_token:
            continue
        if prefix_sharing and isinstance(value, torch.Tensor) and value.dim() > 0:
            first, second = value[: value.shape[0] // 2], value[value.shape[0] // 2 :]
            if value.shape[0] % 2 or not torch.equal(first, second):
                raise ValueError(
                    f"`{key}` {tuple(value.shape)} of the preference batch does not list every pair's images twice "
                    "(chosen rows, then rejected rows, as TRL's vision preference collator does), so each image "
                    "cannot be encoded once per pair."
                )
            value = first
        vision[key] = value
    out.update(vision)
    out.update({key: to_row(value) for key, value in per_token.items()})
    if positions is not None:
        full = positions(input_ids, attention_mask.to(input_ids.dtype), {**per_token, **_vision_inputs(view)})
        row = to_row(full)
        if not torch.equal(row[:, 0][:, token_index][..., attention_mask], full[..., attention_mask]):
            raise ValueError(
                "A prompt's positions differ between its chosen and rejected sequences, so it cannot be shared; set "
                "prefix_sharing=False."
            )
        out[MULTIMODAL_POSITIONS_KEY] = row
    return out


def _vision_inputs(view: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a batch that are neither its view keys nor per-token: the vision tensors, as TRL made them."""
    rows, width = view["input_ids"].shape
    return {
        key: value
        for key, value in view.items()
        if key not in _VIEW_KEYS and isinstance(value, torch.Tensor) and tuple(value.shape) != (rows, width)
    }


@dataclass
class DataCollatorForPackedVisionPreference(DataCollatorMixin):
    """TRL's vision preference collator plus the packed row the model runs, each image once per pair.

    The view (what TRL's loss reads) is TRL's ``DataCollatorForVisionPreference``'s batch (the processor per batch,
    chat template, truncation), cut to the completions as for text ([`completion_view`]); the packed row, the vision
    tensors and the per-token keys the model runs are [`pack_vision_pairs`]'s.

    Args:
        view_collator (`Callable`):
            TRL's ``DataCollatorForVisionPreference`` (as TRL's ``__init__`` built it).
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            Each pair one branched segment ``[p, c, r]``, its images once; `False` packs TRL's rows as plain samples,
            every image twice as TRL encodes it.
        positions (`Callable` or `None`, *optional*):
            Each full sequence's positions (multi-axis RoPE, :class:`unpack_trainer.anatomy.vision.SequencePositions`);
            `None` for a text model of 1-D positions.
    """

    view_collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    prefix_sharing: bool = True
    positions: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor] | None = None
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        view = dict(self.view_collator(examples))
        packed = pack_vision_pairs(view, prefix_sharing=self.prefix_sharing, positions=self.positions)
        cut = completion_view(view, packed[TOKEN_INDEX_KEY])
        return {**view, **packed, **cut}
