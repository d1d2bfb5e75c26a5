"""Prompts shared by several completions: the model-side pieces every such trainer uses (DPO's pairs, GRPO's and
RLOO's groups, reward models' pairs).

A batch of such a trainer carries TRL's padded *view* of its sequences (what TRL's loss reads, never run through the
model) and one packed row in which each prompt appears once and its completions follow as branches
(``packed_seq_parents``, see :mod:`unpack_trainer.packed_seq_info`), with the maps between the two. Here:

- [`install_packed_view`]: a hook on the decoder that runs the packed row instead of the view and hands back the last
  hidden state in the view's layout (and MoE router logits in TRL's batch layout);
- [`install_compact_lm_head`]: TRL's fused LM head (``add_fused_lm_head``) scoring only the labelled positions of the
  view, each per-token output scattered back where TRL expects it;
- [`BranchedTrainerMixin`] (and [`PackedPairsMixin`], for trainers whose collator packs pairs): the packed-trainer core
  plus what prompt sharing adds to a trainer: the policy and the
  reference model patched and hooked, sharing off for models whose token mixers carry state, and the branched
  self-check (a prompt and ``k`` completions) before the first batch, whose failure packs the completions unshared;
- [`pack_completions`]: the view and the packed row of TRL's own ``(rows, prompt + completion)`` batch (left-padded
  prompts, right-padded completions: GRPO's and RLOO's training forwards), each distinct prompt once.

Both hooks are undone by [`unpack_trainer.models.unpatch_model`]. How a trainer builds the view and the packed row is
its own: DPO's collator ([`unpack_trainer.data.preference`]), GRPO's and RLOO's step ([`pack_completions`],
[`unpack_trainer.trainers.grpo`]).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import is_peft_model

from unpack_trainer._compat import remove_hook
from unpack_trainer._logging import log_once
from unpack_trainer.data.collator import IGNORE_INDEX
from unpack_trainer.models.selfcheck import ContaminationReport, check_uncontaminated
from unpack_trainer.models.undo import add_undo
from unpack_trainer.packed_seq_info import (
    PACKED_INPUT_IDS_KEY,
    PACKED_POSITION_IDS_KEY,
    TOKEN_INDEX_KEY,
    VIEW_INDEX_KEY,
    branched_row,
)
from unpack_trainer.trainers._packed import PackedTrainerMixin

__all__ = [
    "BranchedTrainerMixin",
    "PackedPairsMixin",
    "install_branched_hooks",
    "install_compact_lm_head",
    "install_packed_view",
    "pack_completions",
]

logger = logging.getLogger("unpack_trainer")

_VIEW_ATTRIBUTE = "_unpack_packed_view"  # on the decoder: its _PackedView
_COMPACT_ATTRIBUTE = "_unpack_compact_lm_head"  # on the causal LM: the forward the compact head replaced


class _PackedView:
    """Forward hooks on a decoder (the backbone under the LM head): a call carrying ``packed_input_ids`` runs the
    packed row instead of the padded view, and its outputs come back in the view's layout."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        self.token_index: torch.Tensor | None = None
        self.hook_ids: list[int] = []

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from unpack_trainer.models import is_patched

        self.index = None
        if kwargs.get(PACKED_INPUT_IDS_KEY) is None:
            return args, kwargs
        if args:
            raise ValueError("A packed batch with shared prompts must reach the decoder as keyword arguments.")
        if not is_patched(module):
            raise ValueError(
                f"A packed batch with shared prompts reached {type(module).__name__}, which is not patched for "
                "packing (unpack_trainer.models.patch_model): its attention would not follow the packed samples."
            )
        view_ids = kwargs.pop("input_ids")
        index = kwargs.pop(VIEW_INDEX_KEY)
        self.token_index = kwargs.pop(TOKEN_INDEX_KEY)
        if index.shape != view_ids.shape:
            raise ValueError(
                f"`{VIEW_INDEX_KEY}` has shape {tuple(index.shape)} but the padded view is {tuple(view_ids.shape)}."
            )
        kwargs["input_ids"] = kwargs.pop(PACKED_INPUT_IDS_KEY).to(view_ids.device)
        kwargs["position_ids"] = kwargs.pop(PACKED_POSITION_IDS_KEY).to(view_ids.device)
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


def _remove_packed_view(decoder: torch.nn.Module) -> None:
    view = decoder.__dict__.pop(_VIEW_ATTRIBUTE, None)
    for hook_id in view.hook_ids if view is not None else ():
        remove_hook(decoder, hook_id)


def install_packed_view(decoder: torch.nn.Module) -> None:
    """Let ``decoder`` (the model's backbone, e.g. ``LlamaModel``) run packed batches with shared prompts; idempotent;
    undone by [`unpack_trainer.models.unpatch_model`].

    A forward with ``packed_input_ids`` ``(1, T)`` (and ``packed_position_ids`` ``(1, T)``, ``packed_seq_lengths``,
    ``packed_seq_parents``, ``packed_token_index`` ``(rows, L)`` and ``packed_view_index`` ``(rows, L')``, all int)
    runs the packed row; its ``last_hidden_state`` ``(1, T, H)`` comes back as ``(rows, L', H)``, each view token's
    hidden state read from its packed token (a shared prompt token feeds every row of its group), and
    ``router_logits`` (one ``(T, num_experts)`` per layer) as ``(rows * L, num_experts)`` through
    ``packed_token_index``, so the LM head, the loss and the MoE auxiliary loss (with TRL's ``attention_mask``
    ``(rows, L)``) see the padded batch's values. The hook runs before the packing patch's own hook, which then finds
    the packing metadata. A forward without ``packed_input_ids`` is untouched.
    """
    if decoder.__dict__.get(_VIEW_ATTRIBUTE) is not None:
        return
    view = _PackedView()
    view.hook_ids.append(decoder.register_forward_pre_hook(view.before, with_kwargs=True, prepend=True).id)
    view.hook_ids.append(decoder.register_forward_hook(view.after, with_kwargs=True).id)
    decoder.__dict__[_VIEW_ATTRIBUTE] = view
    add_undo(decoder, _remove_packed_view)


# The per-token fields of TRL's fused LM head output (``add_fused_lm_head``), each ``(rows, L - 1)`` or ``None``.
_FUSED_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_NO_INSTANCE_FORWARD = object()


def _remove_compact_lm_head(model: torch.nn.Module) -> None:
    replaced = model.__dict__.pop(_COMPACT_ATTRIBUTE, None)
    if replaced is _NO_INSTANCE_FORWARD:
        model.__dict__.pop("forward", None)
    elif replaced is not None:
        model.forward = replaced


def install_compact_lm_head(model: torch.nn.Module) -> None:
    """Let TRL's fused LM head score only the labelled positions of a packed batch with shared prompts; idempotent;
    undone by [`unpack_trainer.models.unpatch_model`].

    ``model`` is the causal LM whose ``forward`` TRL's ``add_fused_lm_head`` replaced (under PEFT, the base model).
    Without Triton (on CPU, for one), TRL's fused head scores every position of the padded view ``(rows, L)``,
    padding and unlabelled columns included, then zeroes them. A call with ``fused_lm_head=True``, ``labels`` and
    ``packed_view_index`` instead runs TRL's forward on one compact row ``(1, K + 1)``: the ``K`` positions whose
    next-token label is not ``-100``, in the view's row-major order, then one unscored position (TRL shifts labels by
    one: the row's labels are ``[-100, l_1, .., l_K]``). The decoder hook ([`install_packed_view`]) reads each one's
    hidden state from its packed token as before, and every per-token field of TRL's output is scattered back into the
    view's ``(rows, L - 1)`` with zeros where the label is ``-100``, as TRL returns it. So each scored value is
    computed from the same hidden state and label as in the view (the LM head projects each position on its own), the
    loss TRL's trainer computes from them and the gradients are those of the view (fp32 rel 1e-5: the sums run in
    another order); the MoE auxiliary loss still sees the view's ``attention_mask`` and the router logits in its
    layout. Any other call goes to TRL's forward unchanged.
    """
    if _COMPACT_ATTRIBUTE in model.__dict__:
        return
    fused_forward = model.forward

    @functools.wraps(type(model).forward)  # the class's signature, as TRL keeps it (`generate` checks kwargs on it)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        index = kwargs.get(VIEW_INDEX_KEY)
        if (
            not kwargs.get("fused_lm_head")
            or labels is None
            or index is None
            or kwargs.get("shift_labels") is not None
        ):
            return fused_forward(*args, **kwargs)
        if labels.shape != index.shape:
            raise ValueError(
                f"`labels` has shape {tuple(labels.shape)} but `{VIEW_INDEX_KEY}` is {tuple(index.shape)}."
            )
        mask = labels[:, 1:] != IGNORE_INDEX
        num_scored = int(mask.sum())
        if num_scored == 0:  # nothing to score: TRL's own path keeps the output connected to the model
            return fused_forward(*args, **kwargs)
        compact_index = torch.cat([index[:, :-1][mask], index.new_zeros(1)]).unsqueeze(0)
        compact_labels = torch.cat([labels.new_full((1,), IGNORE_INDEX), labels[:, 1:][mask]]).unsqueeze(0)
        kwargs["labels"] = compact_labels
        kwargs[VIEW_INDEX_KEY] = compact_index
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

    model.__dict__[_COMPACT_ATTRIBUTE] = model.__dict__.get("forward", _NO_INSTANCE_FORWARD)
    model.forward = types.MethodType(forward, model)
    add_undo(model, _remove_compact_lm_head)


def install_branched_hooks(model: torch.nn.Module) -> None:
    """[`install_packed_view`] on ``model``'s decoder and [`install_compact_lm_head`] on its causal LM (under PEFT,
    the base model's); ``model`` is patched ([`unpack_trainer.models.patch_model`]) first if it is not yet."""
    from unpack_trainer.models import patch_model

    patch_model(model)
    _install_view_and_head(model)


def _install_view_and_head(model: torch.nn.Module) -> None:
    """The two hooks of [`install_branched_hooks`] on a model that is patched already."""
    pretrained = model.get_base_model() if is_peft_model(model) else model
    install_packed_view(pretrained.base_model)
    install_compact_lm_head(pretrained)


def pack_completions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    prefix_sharing: bool = True,
    device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], int] | str:
    """The view and the packed row of TRL's batch of prompts and completions, each distinct prompt once.

    ``input_ids`` / ``attention_mask`` ``(R, L)`` are what GRPO's and RLOO's ``_get_per_token_logps_and_entropies``
    receive: each row a prompt left-padded to ``P = L - logits_to_keep`` columns followed by its completion
    right-padded to ``C = logits_to_keep`` (``attention_mask`` 0 on padding, and on a completion TRL masks whole,
    ``mask_truncated_completions``). Rows whose prompts are equal (the ``G`` completions of a group, wherever they
    are in the batch) share one prompt segment, and each non-empty completion is a branch of it
    (``packed_seq_parents``); a prompt with one completion is one plain sample; with ``prefix_sharing=False`` every
    row is the plain sample ``[prompt; completion]``. Segments are in the order of their first row. Positions restart
    at 0 per prompt and continue from it in each completion, as generation numbered them (from the attention mask).

    Example (prompts ``[5, 6]`` twice and ``[7]``, completions ``[8]``, ``[9, 10]``, ``[11]``; ``P = C = 2``)::

        input_ids           [[5, 6, 8, 0], [5, 6, 9, 10], [0, 7, 11, 0]]
        packed_input_ids    [[5, 6, 8, 9, 10, 7, 11]]      seq_lengths [2, 1, 2, 2]  seq_parents [-1, 0, 0, -1]
        packed_position_ids [[0, 1, 2, 2, 3, 0, 1]]
        packed_token_index  [[0, 1, 2, 0], [0, 1, 3, 4], [0, 5, 6, 0]]   packed token of each of TRL's tokens
        input_ids (view)    [[6, 8, 0], [6, 9, 10], [7, 11, 0]]         the last prompt token, then the completion
        labels              [[-100, 8, -100], [-100, 9, 10], [-100, 11, -100]]
        packed_view_index   [[1, 2, 0], [1, 3, 4], [5, 6, 0]]

    Returns:
        ``(batch, packed_tokens)``: ``batch`` holds the view ``input_ids`` and ``labels`` ``(R, C + 1)`` int64 on
        ``device`` (default: ``input_ids``' device), ``packed_view_index`` ``(R, C + 1)`` and ``packed_token_index``
        ``(R, L)`` int64 on that device (0 on padding), ``packed_input_ids`` / ``packed_position_ids`` ``(1, T)`` int64,
        ``packed_seq_lengths`` ``(num_seqs,)`` int32 and ``packed_seq_parents`` ``(num_seqs,)`` int64 on the CPU;
        ``packed_tokens`` is ``T``. Or a string saying why the batch is not TRL's layout (a prompt that is not
        left-padded or empty, a completion that is not right-padded): the caller runs it as TRL does.
    """
    ids = input_ids.detach().to("cpu", torch.int64)
    mask = attention_mask.detach().to("cpu").bool()
    rows, width = ids.shape
    num_completion = int(logits_to_keep)
    num_prompt = width - num_completion
    prompt_lengths, completion_lengths = mask[:, :num_prompt].sum(1), mask[:, num_prompt:].sum(1)
    columns = torch.arange(width)
    in_prompt = columns < num_prompt
    expected = torch.where(
        in_prompt, columns >= num_prompt - prompt_lengths[:, None], columns - num_prompt < completion_lengths[:, None]
    )
    if num_prompt < 1 or not torch.equal(mask, expected):
        return "the batch's prompts are not left-padded or its completions not right-padded"
    if bool((prompt_lengths == 0).any()):
        return f"row {int(torch.nonzero(prompt_lengths == 0)[0, 0])} has an empty prompt"
    rows_list, prompt_list, completion_list = ids.tolist(), prompt_lengths.tolist(), completion_lengths.tolist()
    groups: dict[Any, list[int]] = {}
    for row in range(rows):
        prompt = rows_list[row][num_prompt - prompt_list[row] : num_prompt]
        groups.setdefault(tuple(prompt) if prefix_sharing else row, []).append(row)
    tokens: list[int] = []
    lengths: list[int] = []
    parents: list[int] = []
    token_index = torch.zeros(rows, width, dtype=torch.int64)
    view_index = torch.zeros(rows, num_completion + 1, dtype=torch.int64)

    def add(row: int, start: int, stop: int, parent: int) -> int:
        """Append row ``row``'s columns ``start:stop`` as a packed sample continuing ``parent``; its first token."""
        first = len(tokens)
        tokens.extend(rows_list[row][start:stop])
        lengths.append(stop - start)
        parents.append(parent)
        token_index[row, start:stop] = torch.arange(first, first + stop - start)
        return first

    for members in groups.values():
        head = members[0]
        prompt_start = num_prompt - prompt_list[head]
        if len(members) == 1:  # a prompt with one completion: one plain sample [prompt; completion]
            first = add(head, prompt_start, num_prompt + completion_list[head], -1)
            end = first + prompt_list[head] + completion_list[head]
            view_index[head, : completion_list[head] + 1] = torch.arange(first + prompt_list[head] - 1, end)
            continue
        root = len(lengths)
        last_prompt_token = add(head, prompt_start, num_prompt, -1) + prompt_list[head] - 1
        for row in members:
            token_index[row, prompt_start:num_prompt] = token_index[head, prompt_start:num_prompt]
            view_index[row, 0] = last_prompt_token
            if completion_list[row] > 0:
                start = add(row, num_prompt, num_prompt + completion_list[row], root)
                view_index[row, 1 : completion_list[row] + 1] = torch.arange(start, start + completion_list[row])
    completion = ids[:, num_prompt:]
    view_ids = torch.cat([ids[:, num_prompt - 1 : num_prompt], completion], dim=1)
    labels = torch.cat(
        [torch.full((rows, 1), IGNORE_INDEX), completion.masked_fill(~mask[:, num_prompt:], IGNORE_INDEX)], dim=1
    )
    device = input_ids.device if device is None else device
    batch = {
        "input_ids": view_ids.to(device, non_blocking=True),
        "labels": labels.to(device, non_blocking=True),
        VIEW_INDEX_KEY: view_index.to(device, non_blocking=True),
        TOKEN_INDEX_KEY: token_index.to(device, non_blocking=True),
        **branched_row(tokens, lengths, parents),
    }
    return batch, len(tokens)


class BranchedTrainerMixin(PackedTrainerMixin):
    """The packed-trainer core for trainers whose prompts are shared by several completions (``prefix_sharing``).

    On top of [`PackedTrainerMixin`]: the packed path always patches (branched rows need the patch, so an unverified
    model type is patched too and the self-check guards it), the policy and the reference model (``ref_model``, when
    the trainer has one) get the hooks of [`install_branched_hooks`], and with prompts shared the self-check also runs
    the branched probe (``check_uncontaminated(branched=True)``: a prompt and [`_unpack_probe_branches`] completions
    after another sample, each against ``[prompt; completion]`` alone). If the plain probe fails, training falls
    back to TRL's padded batches; if only the branched one fails, to the narrowest fallback: packed, unshared
    (``unpack_unshared`` says how), logged once with the measured difference (``UNPACK_STRICT=1`` raises instead).
    A model whose token mixers carry state along the sequence (convolutions, recurrent scans) cannot continue a
    prompt's state in a branch, so sharing is off for it from the start (logged once).

    The config has ``prefix_sharing`` (`bool`). Hooks: [`_unpack_probe_branches`], [`_unpack_stop_sharing`] and
    [`_unpack_install_hooks`].

    Attributes:
        unpack_selfcheck_branched (`ContaminationReport` or `None`): the branched probe's result, once training or
            evaluation has started with prompts shared (``None`` before, and when no prompt is shared).
    """

    unpack_unshared: str = "each completion is packed after its own copy of the prompt"
    unpack_selfcheck_branched: ContaminationReport | None = None
    _unpack_sharing_failed: bool = False
    _unpack_mixer: str | None | bool = False  # False: not looked for yet

    def _unpack_probe_branches(self) -> int:
        """How many completions share the prompt of the branched probe (DPO: 2)."""
        return 2

    def _unpack_stop_sharing(self) -> None:
        """Called once when the branched probe failed (``self._unpack_sharing_failed`` is set): switch to unshared
        packing (a collator rebuilt, ...); by default nothing, for trainers that read [`_unpack_sharing`] per batch."""

    def _unpack_sharing(self) -> bool:
        """Whether prompts are shared now: ``prefix_sharing``, the branched probe has not failed, and the model has no
        token mixer that carries state ([`_stateful_mixer`])."""
        return bool(self.args.prefix_sharing) and not self._unpack_sharing_failed and self._stateful_mixer() is None

    def _unpack_models(self) -> list[Any]:
        models = [self.model, getattr(self, "ref_model", None)]
        return [self.accelerator.unwrap_model(model) for model in models if model is not None]

    def _enable_packed_path(self) -> None:
        """The core's (the packed collator if any, every model of [`_unpack_models`] patched), each model hooked to
        run packed batches with shared prompts, its fused LM head scoring only the labelled positions."""
        if not self.unpack_decision.patch:
            self.unpack_decision = dataclasses.replace(self.unpack_decision, patch=True)
        super()._enable_packed_path()
        for model in self._unpack_models():
            self._unpack_install_hooks(model)

    def _unpack_install_hooks(self, model: Any) -> None:
        """What a model of [`_unpack_models`] needs to run this trainer's packed batches, on top of the patch (the
        core's [`_enable_packed_path`] patched it): by default the hooks of [`install_branched_hooks`] (the decoder's
        packed view, the compact LM head)."""
        _install_view_and_head(model)

    def _unpack_check_before_first_batch(self) -> None:
        """The core's self-check, then (with prompts shared) the branched probe; if that fails, the completions are
        packed unshared from the first batch on."""
        first = not self._unpack_checked
        super()._unpack_check_before_first_batch()
        if not (first and self.unpack_decision.packed and self._unpack_sharing()):
            return
        branches = self._unpack_probe_branches()
        lengths = (3, *((1, 4, 2)[i % 3] for i in range(max(branches, 2))))
        report = check_uncontaminated(self.model, branched=True, lengths=lengths, measure_contamination=False)
        self.unpack_selfcheck_branched = report
        if report.ok:
            log_once(logger, logging.INFO, f"Self-check of shared prompts passed: {report.summary()}")
            return
        message = (
            f"Self-check of shared prompts failed ({report.failure()}): on this model a completion packed after its "
            f"shared prompt does not give what [prompt; completion] gives alone, so prefix sharing is off; "
            f"{self.unpack_unshared} (the plain packed self-check passed). Set prefix_sharing=False to silence this"
        )
        self._unpack_self_check_failed(message)
        self._unpack_sharing_failed = True
        self._unpack_stop_sharing()

    def _stateful_mixer(self) -> str | None:
        """The class name of a token mixer of the model that carries state along the sequence (a convolution or a
        recurrent scan), logged once when it turns prefix sharing off; ``None`` when there is none. Such mixers run
        per sample on packed rows, so a branch could not continue its prompt's state: the completions are packed
        unshared."""
        if not self.args.prefix_sharing:
            return None
        if self._unpack_mixer is not False:
            return self._unpack_mixer
        from unpack_trainer.patches.mixers import mixer_kind

        self._unpack_mixer = None
        for module in self.model.modules():
            if mixer_kind(module) is not None:
                name = self._unpack_mixer = type(module).__name__
                log_once(
                    logger,
                    logging.WARNING,
                    f"{self.unpack_name}: prefix_sharing is off for this model: its token mixer {name} carries state "
                    "along the sequence and runs per sample on packed rows, so a completion cannot continue its "
                    f"prompt's state; {self.unpack_unshared} (exact, without sharing). Set prefix_sharing=False to "
                    "silence this.",
                )
                return name
        return None


class PackedPairsMixin(BranchedTrainerMixin):
    """[`BranchedTrainerMixin`] for trainers whose collator packs the pairs of each batch (DPO, reward models): TRL's
    padded collator is kept as TRL's ``__init__`` built it (it makes the padded view of every packed batch, padded
    evaluation and the padded fallback) before the core replaces it with the packed one, and a failed branched probe
    rebuilds the packed collator unshared.

    Class attribute ``unpack_trl_collator``: the [`unpack_trainer._trl_compat`] function that returns TRL's padded
    collator class of the trainer (checked when the collator is kept).
    """

    unpack_trl_collator: Callable[[], type]

    def _padded_collator(self) -> Any:
        collator = getattr(self, "_unpack_padded_collator", None)
        if collator is None:
            collator = self._unpack_padded_collator = self.data_collator  # TRL's, as its __init__ built it
            expected = type(self).unpack_trl_collator()
            if not isinstance(collator, expected):
                raise TypeError(
                    f"{self.unpack_name} expected TRL's {expected.__name__}, found {type(collator).__name__}"
                )
        return collator

    def _unpack_stop_sharing(self) -> None:
        self.data_collator = self._packed_collator()

    def _enable_packed_path(self) -> None:
        self._padded_collator()  # keep TRL's collator before the core replaces it
        super()._enable_packed_path()
