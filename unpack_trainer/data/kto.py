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

Under sequence parallelism (``sequence_shards = N``) the KL and reference rows come padded to a multiple of ``N`` and
marked for the cut ([`unpack_trainer.data.sequence_shards.padded_for_shards`]): the policy's KL forward runs in
training mode, which DeepSpeed Ulysses cuts into shards (and so does a PEFT reference's); the main row is cut by
DeepSpeed's data loader adapter ([`unpack_trainer.data.sequence_shards.ShardReadyCollator`] around this collator).

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer.data.collator import IGNORE_INDEX
from unpack_trainer.data.preference import completion_view, pack_vision_pairs
from unpack_trainer.data.sequence_shards import padded_for_shards
from unpack_trainer.packed_seq_info import TOKEN_INDEX_KEY, VIEW_INDEX_KEY, branched_row

__all__ = [
    "KL_ROW_KEY",
    "REF_ROW_KEY",
    "DataCollatorForPackedUnpairedPreference",
    "DataCollatorForPackedVisionUnpairedPreference",
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
        sequence_shards (`int`, *optional*, defaults to `1`):
            Under sequence parallelism (DeepSpeed Ulysses, ``sp_size``): the KL row and the reference row each padded
            to a multiple of ``sequence_shards`` tokens (the padding one more sample, on no view position) and their
            ``packed_seq_info`` marked for that many shards
            ([`unpack_trainer.data.sequence_shards.padded_for_shards`]), so that a training-mode forward of them (the
            policy's KL forward; a PEFT reference, the policy with its adapter off) is cut into the group's shards;
            the main row is made ready for DeepSpeed's adapter around this collator
            ([`unpack_trainer.data.sequence_shards.ShardReadyCollator`]). ``1``: rows as they are.

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
    sequence_shards: int = 1
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
        row = {**packed, "input_ids": cut["input_ids"], "labels": labels, VIEW_INDEX_KEY: cut[VIEW_INDEX_KEY]}
        return row if self.sequence_shards == 1 else padded_for_shards(row, self.sequence_shards)


# The keys of TRL's vision unpaired batch that belong to its view only (never model inputs of a packed row).
_VIEW_ONLY_KEYS = ("completion_mask", "label", "ref_logps", "ref_KL_logps")


def _vision_views(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The main and (with ``KL_input_ids``) KL views of TRL's vision unpaired batch, each the layout
    [`unpack_trainer.data.preference.pack_vision_pairs`] reads: ``input_ids`` / ``attention_mask`` /
    ``completion_mask`` and the per-token keys (``mm_token_type_ids``, ``token_type_ids``) ``(B, L)`` (the KL view's
    from TRL's ``KL_*`` tensors), and the vision tensors both share (TRL processes each example's images once, for its
    prompt, and passes them with the main and the KL sequences alike)."""
    main = {key: value for key, value in batch.items() if not key.startswith("KL_") and key not in _VIEW_ONLY_KEYS}
    main["completion_mask"] = batch["completion_mask"]
    if "KL_input_ids" not in batch:
        return main, None
    rows, width = batch["input_ids"].shape
    kl = {
        key: value
        for key, value in main.items()
        if not (isinstance(value, torch.Tensor) and tuple(value.shape) == (rows, width))
    }
    kl.update({key[len("KL_") :]: value for key, value in batch.items() if key.startswith("KL_")})
    return main, kl


def _both_views(main: dict[str, Any], kl: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """The ``2B`` rows of the reference row's view: the main rows, then the KL rows, padded on the right to one width
    (``input_ids`` with ``pad_token_id``, every other per-token key with 0), and every vision tensor listed twice
    along dimension 0 (the main rows' images, then the KL rows' images: each example's images, twice), the layout of
    TRL's vision preference batch that [`unpack_trainer.data.preference.pack_vision_pairs`] shares."""
    rows = main["input_ids"].shape[0]
    width = max(main["input_ids"].shape[1], kl["input_ids"].shape[1])
    both: dict[str, Any] = {}
    for key, value in main.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            both[key] = value
        elif tuple(value.shape) == tuple(main["input_ids"].shape):
            fill = pad_token_id if key == "input_ids" else 0
            both[key] = torch.cat([_pad_columns(value, width, fill), _pad_columns(kl[key], width, fill)])
        else:
            both[key] = torch.cat([value, value])
    if rows != both["input_ids"].shape[0] // 2:
        raise ValueError("The main and KL views of a KTO batch have different numbers of rows.")
    return both


def _vision_row(
    view: dict[str, Any],
    *,
    prefix_sharing: bool,
    positions: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor] | None,
) -> dict[str, Any]:
    """The model inputs of one packed row of image sequences: ``view``'s ``attention_mask`` (TRL's, as its model call
    receives it), the packed row of [`unpack_trainer.data.preference.pack_vision_pairs`] (its vision tensors and
    per-token rows ``(1, T)`` included), the view cut to the completions (``input_ids``, ``packed_view_index``
    ``(rows, L')`` int64) and ``labels`` ``(rows, L')`` int64 (``-100`` off the completions)."""
    packed = pack_vision_pairs(view, prefix_sharing=prefix_sharing, positions=positions)
    cut = completion_view(view, packed[TOKEN_INDEX_KEY])
    labels = cut["input_ids"].masked_fill(cut["completion_mask"] == 0, IGNORE_INDEX)
    return {
        "attention_mask": view["attention_mask"],
        **packed,
        "input_ids": cut["input_ids"],
        "labels": labels,
        VIEW_INDEX_KEY: cut[VIEW_INDEX_KEY],
    }


@dataclass
class DataCollatorForPackedVisionUnpairedPreference(DataCollatorMixin):
    """TRL's vision unpaired preference collator (KTO on image data) plus the packed rows the models run, each image
    once per prompt per row.

    The view (what TRL's loss reads) is TRL's ``DataCollatorForVisionUnpairedPreference``'s batch (the processor per
    batch, chat template, truncation, the KL completions cycled by one), cut to the completions as for text; the rows
    are [`unpack_trainer.data.preference.pack_vision_pairs`]'s:

    - the main row: TRL's ``B`` rows ``[p_i, c_i]`` one after the other, each example's images once (as TRL);
    - the KL row (``packed_kl_row``, with TRL's ``KL_*`` tensors): the rows ``[p_i, y_i]``, each example's images once;
    - the reference row (``packed_ref_row``, unless the reference log-probs are precomputed): with ``prefix_sharing``
      and KL sequences, each example one branched segment ``[p_i, c_i, y_i]``, its prompt (text and image tokens) and
      its images once, where TRL's reference encodes them twice; else the main and KL rows' sequences as plain samples
      (without KL sequences, the main row's inputs).

    A prompt is shared by its own example's sequences only (examples with equal prompt text may hold other images).

    Args:
        view_collator (`Callable`):
            TRL's ``DataCollatorForVisionUnpairedPreference`` (as TRL's ``__init__`` built it).
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            Share each example's prompt between its completion and its KL completion on the reference row.
        positions (`Callable` or `None`, *optional*):
            Each full sequence's positions (multi-axis RoPE, :class:`unpack_trainer.anatomy.vision.SequencePositions`);
            `None` for a text model of 1-D positions.
        reference (`bool`, *optional*, defaults to `True`):
            Build the reference row.

    Returns (``torch_call``), for ``B`` examples: TRL's batch without its ``KL_*`` tensors (``attention_mask``
    ``(B, L)``, ``label`` ``(B,)`` bool, ...), the main row's keys (the vision tensors and per-token rows in place of
    TRL's, ``packed_multimodal_position_ids`` ``(rows, 1, T)`` int64 with ``positions``), the view cut to the
    completions (``input_ids``, ``completion_mask``, ``packed_view_index`` ``(B, L')`` int64); ``packed_kl_row`` and
    ``packed_ref_row`` as dicts of model inputs ([`_vision_row`]; the reference row's view rows: main, then KL).
    """

    view_collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    prefix_sharing: bool = True
    positions: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor] | None = None
    reference: bool = True
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        padded = dict(self.view_collator(examples))
        main, kl = _vision_views(padded)
        batch = {key: value for key, value in padded.items() if not key.startswith("KL_")}
        packed = pack_vision_pairs(main, prefix_sharing=False, positions=self.positions)
        batch.update(packed)
        batch.update(completion_view(main, packed[TOKEN_INDEX_KEY]))
        if kl is not None:
            batch[KL_ROW_KEY] = _vision_row(kl, prefix_sharing=False, positions=self.positions)
        if self.reference:
            if kl is None:
                batch[REF_ROW_KEY] = _vision_row(main, prefix_sharing=False, positions=self.positions)
            else:
                processor = getattr(self.view_collator, "processor", None)
                pad_token_id = getattr(getattr(processor, "tokenizer", processor), "pad_token_id", None) or 0
                both = _both_views(main, kl, pad_token_id)
                batch[REF_ROW_KEY] = _vision_row(both, prefix_sharing=self.prefix_sharing, positions=self.positions)
        return batch
