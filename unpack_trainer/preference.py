"""Packed preference batches: many (prompt, chosen, rejected) pairs in one row, the prompt shared by both answers.

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

The model hook (:func:`install_packed_view`) runs the packed row and hands back the last hidden state gathered into
the view's layout (and MoE router logits into TRL's batch layout), so TRL's loss code reads exactly the per-token
values of its padded batch.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer.data.collator import IGNORE_INDEX
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.masks import SEQ_PARENTS_KEY

__all__ = [
    "PACKED_VIEW_KEYS",
    "DataCollatorForPackedPreference",
    "install_compact_lm_head",
    "install_packed_view",
    "pack_preference_pairs",
]

# The keys the packed preference collator adds to TRL's padded view; the model hook consumes them.
PACKED_VIEW_KEYS: tuple[str, ...] = (
    "packed_input_ids",
    "packed_position_ids",
    "packed_seq_lengths",
    SEQ_PARENTS_KEY,
    "packed_token_index",
    "packed_view_index",
)


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
    seq_lengths = torch.tensor(lengths, dtype=torch.int32)
    seq_parents = torch.tensor(parents, dtype=torch.int64)
    info = PackedSeqInfo.from_seq_lengths(seq_lengths, batch_size=1, seq_len=len(ids), seq_parents=seq_parents)
    return {
        "packed_input_ids": torch.tensor(ids, dtype=torch.int64).unsqueeze(0),
        "packed_position_ids": info.position_ids(),
        "packed_seq_lengths": seq_lengths,
        SEQ_PARENTS_KEY: seq_parents,
        "packed_token_index": view_index,
    }


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
        return {**view, **packed, **completion_view(view, packed["packed_token_index"], self.pad_to_multiple_of)}


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
        "packed_view_index": cut(token_index, 0),
    }


# -- the model side ---------------------------------------------------------------------------------------------------


class _PackedView:
    """Forward hooks on a decoder (the backbone under the LM head): a call carrying ``packed_input_ids`` runs the
    packed row instead of the padded view, and its outputs come back in the view's layout."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        self.token_index: torch.Tensor | None = None

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from unpack_trainer.models import is_patched

        self.index = None
        if kwargs.get("packed_input_ids") is None:
            return args, kwargs
        if args:
            raise ValueError("A packed preference batch must reach the decoder as keyword arguments.")
        if not is_patched(module):
            raise ValueError(
                f"A packed preference batch reached {type(module).__name__}, which is not patched for packing "
                "(unpack_trainer.models.patch_model): its attention would not follow the packed samples."
            )
        view_ids = kwargs.pop("input_ids")
        index = kwargs.pop("packed_view_index")
        self.token_index = kwargs.pop("packed_token_index")
        if index.shape != view_ids.shape:
            raise ValueError(
                f"`packed_view_index` has shape {tuple(index.shape)} but the padded view is {tuple(view_ids.shape)}."
            )
        kwargs["input_ids"] = kwargs.pop("packed_input_ids").to(view_ids.device)
        kwargs["position_ids"] = kwargs.pop("packed_position_ids").to(view_ids.device)
        kwargs.pop("attention_mask", None)
        self.index = index
        return args, kwargs

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        index, self.index = self.index, None
        if index is None:
            return output
        hidden = output.last_hidden_state
        flat = index.reshape(-1).to(hidden.device)
        output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat).view(*index.shape, -1)
        router_logits = getattr(output, "router_logits", None)
        if router_logits is not None:
            tokens = self.token_index.reshape(-1)
            output.router_logits = tuple(
                layer if layer is None else layer.reshape(-1, layer.shape[-1]).index_select(0, tokens.to(layer.device))
                for layer in router_logits
            )
        return output


def install_packed_view(decoder: torch.nn.Module) -> None:
    """Let ``decoder`` (the model's backbone, e.g. ``LlamaModel``) run packed preference batches; idempotent.

    A forward with ``packed_input_ids`` (and the other :data:`PACKED_VIEW_KEYS`) runs the packed row; its
    ``last_hidden_state`` ``(1, T, H)`` comes back as ``(2 * num_pairs, L, H)``, each view token's hidden state read
    from its packed token (a shared prompt token feeds both its chosen and its rejected row), and ``router_logits``
    (one ``(T, num_experts)`` per layer) as ``(2 * num_pairs * L, num_experts)``, so the LM head, the loss and the MoE
    auxiliary loss see the padded batch's values. The hook runs before the packing patch's own hook, which then finds
    the packing metadata. A forward without ``packed_input_ids`` is untouched.
    """
    if getattr(decoder, "_unpack_packed_view", None) is not None:
        return
    view = _PackedView()
    decoder.register_forward_pre_hook(view.before, with_kwargs=True, prepend=True)
    decoder.register_forward_hook(view.after, with_kwargs=True)
    decoder._unpack_packed_view = view


# The per-token fields of TRL's fused LM head output (``add_fused_lm_head``), each ``(rows, L - 1)`` or ``None``.
_FUSED_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def install_compact_lm_head(model: torch.nn.Module) -> None:
    """Let TRL's fused LM head score only the labelled positions of a packed preference batch; idempotent.

    ``model`` is the causal LM whose ``forward`` TRL's ``add_fused_lm_head`` replaced (under PEFT, the base model).
    Without Triton (on CPU, for one), TRL's fused head scores every position of the padded view ``(2 * num_pairs, L)``,
    padding and unlabelled columns included, then zeroes them. A call with ``fused_lm_head=True``, ``labels`` and
    ``packed_view_index`` instead runs TRL's forward on one compact row ``(1, K + 1)``: the ``K`` positions whose
    next-token label is not ``-100``, in the view's row-major order, then one unscored position (TRL shifts labels by
    one: the row's labels are ``[-100, l_1, .., l_K]``). The decoder hook ([`install_packed_view`]) reads each one's
    hidden state from its packed token as before, and every per-token field of TRL's output is scattered back into the
    view's ``(2 * num_pairs, L - 1)`` with zeros where the label is ``-100``, as TRL returns it. So each scored value
    is computed from the same hidden state and label as in the view (the LM head projects each position on its own),
    the loss TRL's trainer computes from them and the gradients are those of the view (fp32 rel 1e-5: the sums run in
    another order); the MoE auxiliary loss still sees the view's ``attention_mask`` and the router logits in its
    layout. Any other call goes to TRL's forward unchanged.
    """
    if getattr(model, "_unpack_compact_lm_head", False):
        return
    fused_forward = model.forward

    @functools.wraps(type(model).forward)  # the class's signature, as TRL keeps it (`generate` checks kwargs on it)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        index = kwargs.get("packed_view_index")
        if (
            not kwargs.get("fused_lm_head")
            or labels is None
            or index is None
            or kwargs.get("shift_labels") is not None
        ):
            return fused_forward(*args, **kwargs)
        if labels.shape != index.shape:
            raise ValueError(
                f"`labels` has shape {tuple(labels.shape)} but `packed_view_index` is {tuple(index.shape)}."
            )
        mask = labels[:, 1:] != IGNORE_INDEX
        num_scored = int(mask.sum())
        if num_scored == 0:  # nothing to score: TRL's own path keeps the output connected to the model
            return fused_forward(*args, **kwargs)
        compact_index = torch.cat([index[:, :-1][mask], index.new_zeros(1)]).unsqueeze(0)
        compact_labels = torch.cat([labels.new_full((1,), IGNORE_INDEX), labels[:, 1:][mask]]).unsqueeze(0)
        kwargs["labels"] = compact_labels
        kwargs["packed_view_index"] = compact_index
        if kwargs.get("input_ids") is not None:  # the decoder hook checks the view's shape against the index's
            kwargs["input_ids"] = compact_labels.clamp(min=0)
        output = fused_forward(*args, **kwargs)
        for name in _FUSED_PER_TOKEN_FIELDS:
            value = getattr(output, name, None)
            if value is not None:
                setattr(output, name, value.new_zeros(mask.shape).masked_scatter(mask.to(value.device), value[0]))
        if getattr(output, "label_mask", None) is not None:
            output.label_mask = mask.to(output.label_mask.device)
        return output

    model.forward = types.MethodType(forward, model)
    model._unpack_compact_lm_head = True
