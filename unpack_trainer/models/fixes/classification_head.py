"""Sequence-classification heads on packed rows: each packed sequence scored at its own last token.

transformers' ``*ForSequenceClassification`` decoders (``GenericForSequenceClassification`` and the models written
like it: GPT-2, GPT-NeoX, OPT, BLOOM, ...) run their decoder, apply a head (a ``Linear`` to ``num_labels``, usually
``score``) to every token's hidden state, and keep one row per batch row: the rightmost token that is not
``config.pad_token_id`` (the last token when the config has none). On a packed row that is one score for the whole
row, read from its last sample. Here, for a packed forward of such a model, every scored sequence gets the score that
model gives it alone: the head's per-token output read at the sequence's rightmost non-pad token, found as stock
finds it in that sequence (its last token without ``pad_token_id``; its first when every token is padding, as
``argmax`` of zeros gives).

The scored sequences of a packed batch are its leaves: a sample that no other sample continues, and every branch of a
shared prefix (``packed_seq_parents``, see :mod:`unpack_trainer.packed_seq_info`), read as ``[prefix; branch]``; a
prefix with branches is not scored itself. In row-major order::

    packed_input_ids    [[5, 6, 7, 8, 9, 4, 3]]   a prefix [5, 6], branches [7] and [8, 9], a sample [4, 3]
    packed_seq_lengths  [2, 1, 2, 2]   packed_seq_parents [-1, 0, 0, -1]
    scored sequences    [5, 6, 7], [5, 6, 8, 9], [4, 3]  -> logits (3, num_labels), read at tokens 2, 4, 6

What is found from the model's structure, not from a list of models (:func:`find_score_head`): the decoder is the
module named by the class's ``base_model_prefix``; the head is the one other child that is (or wraps, under PEFT) a
``Linear`` with ``config.num_labels`` outputs; the class's code must pool by ``pad_token_id``. The model's own
forward runs unchanged: the head's output for every token is taken as the head returns it (a forward hook), so
whatever the model does to the hidden states before its head (a norm, dropout) stays its own, and the one score per
sequence replaces the forward's ``logits``. A head that is not applied to every token of the packed row (a model that
pools before its head) is refused at that forward, with the reason.

The fix (:data:`FIX`, installed by :func:`unpack_trainer.models.patch_model` on such a model: [`install_score_hooks`])
installs this; a model whose head is not found gets a hook that refuses every packed forward instead, with the reason,
so that no packed forward pools the wrong token. Unpacked forwards run exactly as before.

Under DeepSpeed Ulysses (a packed row next to its padded view, cut for ``N`` processes, in a training forward) each
process runs its shard of the row and the head's per-token output of the ``N`` shards is gathered (differentiably)
into the whole row's before each sequence's score is read, so every process holds every score, as the reward trainer's
loss needs ([`unpack_trainer.models.fixes.packed_view.gathered_shards`]).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from unpack_trainer._compat import cache_argument, cache_length
from unpack_trainer.anatomy.score_head import ScoreHead, find_score_head, is_sequence_classifier
from unpack_trainer.models.fixes.packed_view import gathered_shards, take_shard
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.packed_seq_info import (
    CU_SEQ_LENS_Q_KEY,
    INFO_KEY,
    MAX_LENGTH_Q_KEY,
    PACKED_INPUT_IDS_KEY,
    PACKED_POSITION_IDS_KEY,
    SCORE_ORDER_KEY,
    SEQ_LENGTHS_KEY,
    SEQ_PARENTS_KEY,
    detect_packed,
)

__all__ = ["FIX", "install_score_hooks", "score_token_index"]


class _ScoreHead(NamedTuple):
    """The plan of a batch's scored tokens (:func:`_score_plan`)."""


# ------------------------------------------------------------------------------------------------ where to score


def _score_plan(seq_lengths: list[int], seq_parents: list[int] | None) -> dict[str, torch.Tensor]:
    """The scored sequences of a packed batch as slots over its tokens (CPU, int64): ``gather`` ``(S,)`` the token
    (row-major) of each slot, ``unit`` ``(S,)`` the scored sequence of each slot, ``local`` ``(S,)`` the slot's
    position in its sequence, ``starts`` and ``lengths`` ``(U,)`` each sequence's first slot and length."""
    parents = seq_parents if seq_parents is not None else [-1] * len(seq_lengths)
    starts = [0]
    for length in seq_lengths[:-1]:
        starts.append(starts[-1] + length)
    children: dict[int, list[int]] = {}
    for index, parent in enumerate(parents):
        if parent >= 0:
            children.setdefault(parent, []).append(index)
    pieces: list[torch.Tensor] = []
    for index, parent in enumerate(parents):
        if parent < 0 and index in children:
            continue  # a prefix: scored in each of its branches
        own = torch.arange(starts[index], starts[index] + seq_lengths[index], dtype=torch.int64)
        if parent >= 0:
            own = torch.cat([torch.arange(starts[parent], starts[parent] + seq_lengths[parent]), own])
        pieces.append(own)
    lengths = torch.tensor([len(piece) for piece in pieces], dtype=torch.int64)
    first = torch.cumsum(lengths, 0) - lengths
    unit = torch.repeat_interleave(torch.arange(len(pieces), dtype=torch.int64), lengths)
    return {
        "gather": torch.cat(pieces),
        "unit": unit,
        "local": torch.arange(int(lengths.sum()), dtype=torch.int64) - first[unit],
        "starts": first,
        "lengths": lengths,
    }


def score_token_index(info: Any, input_ids: torch.Tensor | None, pad_token_id: int | None) -> torch.Tensor:
    """The token whose score each scored sequence of a packed batch keeps, as a stock model finds it in that sequence
    alone: the rightmost token that is not ``pad_token_id``, the first one if every token is, the last one when
    ``pad_token_id`` or ``input_ids`` is ``None``.

    Args:
        info: the batch's ``PackedSeqInfo`` (``seq_lengths``, ``seq_parents``; CPU).
        input_ids: ``(B, T)`` int token ids of the packed batch, or ``None`` (``inputs_embeds``).
        pad_token_id: the model's ``pad_token_id``, or ``None``.

    Returns:
        ``(num_scored,)`` int64 on ``input_ids``' device (the CPU without it): each sequence's token, row-major over
        ``B * T``, the sequences in row-major order (see the module docstring). No host synchronisation: the plan is
        built on the CPU from the metadata, once per batch.
    """
    parents = None if info.seq_parents is None else info.seq_parents.tolist()
    plan = info.plans.get(_ScoreHead(), lambda: _score_plan(info.seq_lengths.tolist(), parents))
    device = input_ids.device if input_ids is not None else torch.device("cpu")
    plan = {key: value.to(device, non_blocking=True) for key, value in plan.items()}
    if input_ids is None or pad_token_id is None:
        pick = plan["lengths"] - 1
    else:
        kept = input_ids.reshape(-1).index_select(0, plan["gather"]) != pad_token_id
        pick = torch.zeros_like(plan["lengths"]).scatter_reduce(0, plan["unit"], plan["local"] * kept, "amax")
    return plan["gather"].index_select(0, plan["starts"] + pick)


# ------------------------------------------------------------------------------------------------ the hooks


@dataclass
class _ScoreCall:
    """One packed forward of the model: what its post-hook needs."""

    info: Any
    input_ids: torch.Tensor | None
    shape: tuple[int, int]
    order: torch.Tensor | None
    labels: torch.Tensor | None
    head_hook: Any = None
    captured: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    group: Any = None  # under DeepSpeed Ulysses: the group whose shards of the row the head's output is gathered over


@dataclass
class _ScoreHooks:
    """The hooks on one sequence-classification model: its head ([`ScoreHead`]), or why it has none."""

    head: ScoreHead | None
    refusal: str | None
    calls: list[_ScoreCall] = field(default_factory=list)
    positional: tuple[str, ...] = ()

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            kwargs = {**dict(zip(self.positional, args)), **kwargs}
            args = ()
        packed_ids = kwargs.pop(PACKED_INPUT_IDS_KEY, None)
        order = kwargs.pop(SCORE_ORDER_KEY, None)
        if packed_ids is not None:  # a packed row next to its padded view: the model runs the row
            kwargs.pop("attention_mask", None)
            view = kwargs.pop("input_ids", None)
            kwargs["input_ids"] = packed_ids if view is None else packed_ids.to(view.device)
            kwargs["position_ids"] = kwargs.pop(PACKED_POSITION_IDS_KEY, None)
        reference = kwargs.get("input_ids")
        reference = reference if reference is not None else kwargs.get("inputs_embeds")
        if reference is None or reference.dim() < 2 or cache_length(cache_argument(kwargs)) > 0:
            return args, kwargs
        info = detect_packed(
            reference.shape[0],
            reference.shape[1],
            packed_seq_lengths=kwargs.get(SEQ_LENGTHS_KEY),
            packed_seq_parents=kwargs.get(SEQ_PARENTS_KEY),
            cu_seq_lens_q=kwargs.get(CU_SEQ_LENS_Q_KEY),
            max_length_q=kwargs.get(MAX_LENGTH_Q_KEY),
            position_ids=kwargs.get("position_ids"),
            attention_mask=kwargs.get("attention_mask"),
            packed_seq_info=kwargs.get(INFO_KEY),
        )
        if info is None:
            if packed_ids is not None or order is not None:
                raise ValueError(f"{type(module).__name__}: a packed row was passed without its packing metadata.")
            return args, kwargs
        if self.refusal is not None:
            raise ValueError(
                f"{type(module).__name__} cannot score the sequences of a packed batch: {self.refusal} Its stock "
                "forward would keep one score per row, from the last sample; run the sequences unpacked (padded)."
            )
        if kwargs.get("return_dict") is False:
            raise ValueError(f"{type(module).__name__}: return_dict=False is not supported for a packed batch.")
        call = _ScoreCall(
            info,
            kwargs.get("input_ids"),
            (reference.shape[0], reference.shape[1]),
            order,
            kwargs.pop("labels", None),
        )
        if info.sequence_shards > 1 and module.training:
            # Under DeepSpeed Ulysses (a training forward): this process runs its shard of the row; the head's
            # per-token output of the shards is gathered back into the whole row's before the scores are read.
            if packed_ids is None:
                raise ValueError(
                    f"{type(module).__name__}: a packed batch cut for {info.sequence_shards} sequence-parallel "
                    "processes is scored per sequence only as a packed row next to its padded view (the reward "
                    "trainer's batches), where every process runs its shard and the scores are gathered."
                )
            call.group = take_shard(kwargs, info.sequence_shards)
        call.head_hook = module.get_submodule(self.head.head).register_forward_hook(
            lambda head, head_args, output: call.captured.append((tuple(head_args[0].shape), output))
        )
        self.calls.append(call)
        return args, kwargs

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        call = self._pop_call()
        if call is None or output is None:  # not a packed forward, or it raised
            return output
        name = type(module).__name__
        batch, seq_len = call.shape
        shards = 1 if call.group is None else call.info.sequence_shards
        if len(call.captured) != 1 or call.captured[0][0][:2] != (batch, seq_len // shards):
            shapes = [shape for shape, _ in call.captured]
            raise ValueError(
                f"{name} cannot score the sequences of a packed batch: its head {self.head.head!r} was not applied "
                f"once to every token's hidden state ({batch} x {seq_len} tokens; its inputs: {shapes}), so the "
                "score of each sequence cannot be read at its last token. Run the sequences unpacked (padded)."
            )
        per_token = call.captured[0][1]
        if call.group is not None:
            per_token = gathered_shards(per_token, call.group, dim=1)
        index = score_token_index(call.info, call.input_ids, module.config.get_text_config().pad_token_id)
        logits = per_token.reshape(batch * seq_len, -1).index_select(0, index.to(per_token.device))
        if call.order is not None:
            logits = logits.index_select(0, call.order.to(logits.device))
        output.logits = logits
        if call.labels is not None:
            if call.labels.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"{name}: a packed batch of {logits.shape[0]} scored sequences got labels of shape "
                    f"{tuple(call.labels.shape)}; pass one label per scored sequence."
                )
            output.loss = module.loss_function(
                logits=per_token, labels=call.labels.to(logits.device), pooled_logits=logits, config=module.config
            )
        return output

    def _pop_call(self) -> _ScoreCall | None:
        if not self.calls:
            return None
        call = self.calls.pop()
        call.head_hook.remove()
        return call


def install_score_hooks(model: torch.nn.Module) -> ScoreHead | None:
    """Make a packed forward of ``model`` (a sequence-classification ``PreTrainedModel``) return one score per scored
    sequence, or refuse it with the reason (``model.forward`` wrapped on the instance; :data:`FIX`'s ``remove`` takes
    it off). Any other model is left as it is (``None``).

    A packed forward is one the patch's detector calls packed (:func:`unpack_trainer.packed_seq_info.detect_packed`:
    ``packed_seq_lengths`` / ``cu_seq_lens_q`` (with ``packed_seq_parents``), or ``position_ids`` restarting inside a
    row), on ``input_ids`` ``(B, T)``; or a packed row next to a padded view of the same sequences: ``input_ids`` /
    ``attention_mask`` the view (not run), ``packed_input_ids`` / ``packed_position_ids`` ``(1, T)`` the row, with its
    metadata. Its ``logits`` are ``(num_scored, num_labels)``: the scored sequences in row-major order (see the module
    docstring), or in the order of ``packed_score_order`` ``(n,)`` int64 (indices into them) when given. ``labels``
    ``(num_scored,)`` give ``loss`` as the model's own loss function computes it from those logits. Every other
    forward runs exactly as without the hooks.

    Returns:
        The model's [`ScoreHead`], or ``None`` (not a sequence-classification model, or its head refused: packed
        forwards then raise ``ValueError`` naming the reason).
    """
    if not is_sequence_classifier(model):
        return None
    try:
        head, refusal = find_score_head(model), None
    except ValueError as error:
        head, refusal = None, str(error)
    positional = tuple(
        p.name
        for p in inspect.signature(type(model).forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    )
    hooks = _ScoreHooks(head, refusal, positional=positional)
    # The model's own ``forward`` wrapped on the instance, not module hooks: PEFT (0.18, for one) calls the wrapped
    # model's ``forward`` directly, which skips its forward hooks, and its stock pooling would then score one token
    # per row without an error.
    stock_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = hooks.before(self, args, kwargs)
        try:
            output = stock_forward(*args, **kwargs)
        except BaseException:
            hooks.after(self, args, kwargs, None)  # drops the call and its head hook
            raise
        return hooks.after(self, args, kwargs, output)

    model.forward = forward.__get__(model)
    return head


def _applies(site: FixSite) -> str | None:
    if not is_sequence_classifier(site.model):
        return None
    return "a sequence classifier scores one token per row, not one per packed sequence"


def _install(site: FixSite) -> None:
    install_score_hooks(site.model)
    site.state.undo["classification_head"] = True


def _remove(site: FixSite) -> None:
    if site.state.undo.pop("classification_head", False):
        site.model.__dict__.pop("forward", None)


FIX = Fix("classification_head", _applies, _install, _remove, per_model=True)
