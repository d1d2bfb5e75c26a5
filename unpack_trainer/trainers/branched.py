"""Prompts shared by several completions: the model-side pieces every such trainer uses (DPO's pairs, GRPO's and
RLOO's groups, reward models' pairs).

A batch of such a trainer carries TRL's padded *view* of its sequences (what TRL's loss reads, never run through the
model) and one packed row in which each prompt appears once and its completions follow as branches
(``packed_seq_parents``, see :mod:`unpack_trainer.packed_seq_info`), with the maps between the two. Here:

- [`install_branched_hooks`]: the model-family fixes such a batch needs on the model: the decoder's packed view (the
  packed row run instead of the view, its last hidden state handed back in the view's layout) and the compact LM head
  (TRL's fused head scoring only the labelled positions), :mod:`unpack_trainer.models.fixes`;
- [`BranchedTrainerMixin`] (and [`PackedPairsMixin`], for trainers whose collator packs pairs): the packed-trainer core
  plus what prompt sharing adds to a trainer: the policy and the
  reference model patched and hooked, sharing off for models whose token mixers carry state, and the branched
  self-check (a prompt and ``k`` completions) before the first batch, whose failure packs the completions unshared;
- [`pack_completions`]: the view and the packed row of TRL's own ``(rows, prompt + completion)`` batch (left-padded
  prompts, right-padded completions: GRPO's and RLOO's training forwards), each distinct prompt once.

Both fixes are undone by [`unpack_trainer.models.unpatch_model`]. How a trainer builds the view and the packed row is
its own: DPO's collator ([`unpack_trainer.data.preference`]), GRPO's and RLOO's step ([`pack_completions`],
[`unpack_trainer.trainers.grpo`]).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from unpack_trainer import _trl_compat
from unpack_trainer._compat import sequence_parallel_gradients_averaged
from unpack_trainer._logging import log_once
from unpack_trainer.data.collator import IGNORE_INDEX
from unpack_trainer.decision import sequence_parallel_size
from unpack_trainer.packed_seq_info import (
    INFO_KEY,
    SHARDED_BATCH_KEY,
    TOKEN_INDEX_KEY,
    VIEW_INDEX_KEY,
    branched_row,
)
from unpack_trainer.selfcheck import ContaminationReport, check_uncontaminated
from unpack_trainer.trainers._packed import PackedTrainerMixin
from unpack_trainer.trainers.contamination import self_check_failed
from unpack_trainer.trainers.run_state import RunField, RunState
from unpack_trainer.trainers.sequence_parallel import evaluation_mode_reason

__all__ = ["BranchedRun", "BranchedTrainerMixin", "PackedPairsMixin", "install_branched_hooks", "pack_completions"]

logger = logging.getLogger("unpack_trainer")


def install_branched_hooks(model: torch.nn.Module) -> None:
    """The fixes a packed batch with shared prompts needs on ``model`` (the decoder's packed view, the compact LM head:
    :mod:`unpack_trainer.models.fixes.packed_view`, :mod:`unpack_trainer.models.fixes.compact_lm_head`); ``model`` is
    patched ([`unpack_trainer.models.patch_model`]) first if it is not yet. Undone by
    [`unpack_trainer.models.unpatch_model`]."""
    from unpack_trainer.models import patch_model

    patch_model(model)
    _install_view_and_head(model)


def _install_view_and_head(model: torch.nn.Module) -> None:
    """The fixes of [`install_branched_hooks`] on a model that is patched already."""
    from unpack_trainer.models import install_fix

    install_fix(model, "packed_view")
    install_fix(model, "compact_lm_head")


def pack_completions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    prefix_sharing: bool = True,
    device: torch.device | str | None = None,
    keys: Sequence[Hashable] | None = None,
) -> tuple[dict[str, torch.Tensor], int] | str:
    """The view and the packed row of TRL's batch of prompts and completions, each distinct prompt once.

    ``input_ids`` / ``attention_mask`` ``(R, L)`` are what GRPO's and RLOO's ``_get_per_token_logps_and_entropies``
    receive: each row a prompt left-padded to ``P = L - logits_to_keep`` columns followed by its completion
    right-padded to ``C = logits_to_keep`` (``attention_mask`` 0 on padding, and on a completion TRL masks whole,
    ``mask_truncated_completions``). Rows whose prompts are equal (the ``G`` completions of a group, wherever they
    are in the batch) share one prompt segment, and each non-empty completion is a branch of it
    (``packed_seq_parents``); a prompt with one completion is one plain sample; with ``prefix_sharing=False`` every
    row is the plain sample ``[prompt; completion]``. ``keys`` (one per row) is what else two rows must share to share
    their prompt segment (a vision-language prompt's images: equal token ids, other pixels): rows share one where their
    prompts and their keys are equal. Segments are in the order of their first row. Positions restart
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
        key = (tuple(prompt), None if keys is None else keys[row]) if prefix_sharing else row
        groups.setdefault(key, []).append(row)
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


@dataclasses.dataclass
class BranchedRun(RunState):
    """The run state ([`RunState`]) of a trainer whose prompts are shared.

    Attributes:
        selfcheck_branched (`ContaminationReport` or `None`): the branched probe's report (``unpack_selfcheck_branched``).
        sharing_failed (`bool`): the branched probe failed: completions are packed unshared.
        mixer (`str`, `None` or `False`): the policy's state-carrying token mixer (``None``: none; ``False``: not
            looked for yet).
        padded_collator: TRL's padded collator as its ``__init__`` built it (trainers whose collator packs pairs).
        positions: each model's multi-axis positions (``SequencePositions`` or ``None``), for image prompts laid out in
            the step.
    """

    selfcheck_branched: ContaminationReport | None = None
    sharing_failed: bool = False
    mixer: str | None | bool = False
    padded_collator: Any = None
    positions: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)


def stateful_mixer(model: torch.nn.Module) -> str | None:
    """The class name of the first token mixer of ``model`` that carries state along the sequence (a convolution or
    a recurrent scan: :func:`unpack_trainer.patches.mixers.mixer_kind`), else ``None``; of a vision-language model,
    its text decoder's (the vision tower's convolutions embed image patches, not a sequence a branch continues)."""
    from unpack_trainer.anatomy.structure import pretrained_model
    from unpack_trainer.anatomy.vision import text_model
    from unpack_trainer.patches.mixers import mixer_kind

    decoder = text_model(pretrained_model(model))
    for module in (decoder if decoder is not None else model).modules():
        if mixer_kind(module) is not None:
            return type(module).__name__
    return None


def _one_row_per_forward(args: Any, decision: Any) -> None:
    """Under sequence parallelism, where the trainer packs: DeepSpeed's micro-batch (``train_micro_batch_size_per_gpu``
    in the DeepSpeed config of ``args``) set to 1, logged once. Each training forward of a prompt-sharing trainer is
    one packed row (a batch's pairs, a chunk of GRPO's completions), and Ulysses checks every attention call against
    that micro-batch (accelerate registers it with the config's), where transformers fills it with
    ``per_device_train_batch_size``: the pairs or prompt-completion rows of a batch."""
    shards = sequence_parallel_size(getattr(args, "parallelism_config", None), {})
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if shards == 1 or not decision.packed or config is None:
        return
    micro = config.get("train_micro_batch_size_per_gpu")
    if micro != 1:
        config["train_micro_batch_size_per_gpu"] = 1
        if isinstance(micro, int) and isinstance(config.get("train_batch_size"), int):
            config["train_batch_size"] //= micro  # micro-batch x accumulation x processes, as filled
        log_once(
            logger,
            logging.INFO,
            f"sequence parallelism (sp_size={shards}): DeepSpeed's train_micro_batch_size_per_gpu is 1, each training "
            f"forward one packed row (of the {args.per_device_train_batch_size} examples of a batch)",
        )


def whole_in_evaluation_reason(config: Any, shards: int) -> str | None:
    """Why a prompt-sharing trainer cannot run under Ulysses with ``config`` (accelerate's ``ParallelismConfig``):
    the reference model runs in evaluation mode, and so do evaluation and GRPO's / RLOO's generation, which Ulysses
    must leave whole (``sp_disable_in_eval=True``, accelerate's default) for the whole rows our hooks give them
    ([`unpack_trainer.trainers.sequence_parallel.evaluation_mode_reason`])."""
    return evaluation_mode_reason(
        config, shards, "the reference model, evaluation and generation run each packed row or sequence whole"
    )


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
    unpack_run_class = BranchedRun
    unpack_selfcheck_branched = RunField("selfcheck_branched")

    def _unpack_before_init(self, model: Any, args: Any, **arguments: Any) -> Any:
        """The core's, and under sequence parallelism one packed row per forward ([`_one_row_per_forward`])."""
        trl_args = super()._unpack_before_init(model, args, **arguments)
        _one_row_per_forward(trl_args, self.unpack_decision)
        return trl_args

    def _unpack_probe_branches(self) -> int:
        """How many completions share the prompt of the branched probe (DPO: 2)."""
        return 2

    def _unpack_stop_sharing(self) -> None:
        """Called once when the branched probe failed (``self.unpack_run.sharing_failed`` is set): switch to unshared
        packing (a collator rebuilt, ...); by default nothing, for trainers that read [`_unpack_sharing`] per batch."""

    def _unpack_sharing(self) -> bool:
        """Whether prompts are shared now: ``prefix_sharing``, the branched probe has not failed, and the model has no
        token mixer that carries state ([`_stateful_mixer`])."""
        return bool(self.args.prefix_sharing) and not self.unpack_run.sharing_failed and self._stateful_mixer() is None

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
        first = not self.unpack_run.checked
        super()._unpack_check_before_first_batch()
        if not (first and self.unpack_decision.packed and self._unpack_sharing()):
            return
        branches = self._unpack_probe_branches()
        lengths = (3, *((1, 4, 2)[i % 3] for i in range(max(branches, 2))))
        with self._unpack_training_precision():
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
        self_check_failed(message)
        self.unpack_run.sharing_failed = True
        self._unpack_stop_sharing()

    def _unpack_sequence_positions(self, model: Any) -> Any:
        """``model``'s (unwrapped) :class:`~unpack_trainer.anatomy.vision.SequencePositions` (``None`` for a text
        model of 1-D positions), cached per model in the run state: what image prompts laid out in the step read."""
        from unpack_trainer.anatomy.vision import sequence_positions_of

        unwrapped = self.accelerator.unwrap_model(model)
        cache = self.unpack_run.positions
        if unwrapped not in cache:
            cache[unwrapped] = sequence_positions_of(unwrapped)
        return cache[unwrapped]

    # ------------------------------------------------------------------------------------------------ sequence parallel

    def _fall_back_to_padded(self, reason: str = "contamination self-check failed") -> None:
        """The core's fallback, but under sequence parallelism an error: TRL's padded batches cannot be cut into
        shards (DeepSpeed's data loader adapter takes only batches cut along one row, and a padded forward inside the
        step would run each process's whole batch as a shard of one row), so the run stops at start with the reason
        instead of failing, or training on wrong rows, later."""
        shards = sequence_parallel_size(getattr(self.accelerator, "parallelism_config", None), {})
        if shards > 1:
            raise ValueError(
                f"{self.unpack_name} cannot train padded under sequence parallelism (sp_size={shards}): TRL's padded "
                f"batches cannot be cut into shards of one row (DeepSpeed's sequence-parallel data loader takes only "
                f"such batches), and the packed rows are off ({reason})."
            )
        super()._fall_back_to_padded(reason)

    def _sequence_parallel_reason(self, config: Any, shards: int) -> str | None:
        """[`whole_in_evaluation_reason`]'s. Not the core's batch-size rule: a batch of any size is one packed row
        here (the pairs, or a chunk of completions, each prompt once), and DeepSpeed's micro-batch is set to one row
        ([`_one_row_per_forward`]); nor its loss rules (the loss is TRL's, from the whole row)."""
        return whole_in_evaluation_reason(config, shards)

    @staticmethod
    def _sequence_parallel_share(model: Any, result: Any, return_outputs: bool, shards: int) -> Any:
        """``result`` (TRL's ``compute_loss``: the loss, or ``(loss, outputs)``) of a training step in which every
        process of a sequence-parallel group of ``shards`` computed the same loss from the whole row (the model's
        packed view gathers the shards' hidden states), with ``1 / shards`` of the loss back-propagated on each (the
        value logged unchanged): the gradient that reaches each process's own shard through the gather is the loss's
        own, the LM head's is ``1 / N`` of it on each, and DeepSpeed sums the group's. Unchanged outside training,
        for one shard, and where DeepSpeed averages the group's gradients instead (ZeRO-3 before deepspeed 0.20.2)."""
        if shards == 1 or not model.training or sequence_parallel_gradients_averaged():
            return result
        loss = result[0] if return_outputs else result
        loss = loss / shards + (loss - loss / shards).detach()
        return (loss, *result[1:]) if return_outputs else loss

    def _stateful_mixer(self) -> str | None:
        """The class name of a token mixer of the model that carries state along the sequence (a convolution or a
        recurrent scan), logged once when it turns prefix sharing off; ``None`` when there is none. Such mixers run
        per sample on packed rows, so a branch could not continue its prompt's state: the completions are packed
        unshared."""
        if not self.args.prefix_sharing:
            return None
        if self.unpack_run.mixer is not False:
            return self.unpack_run.mixer
        name = self.unpack_run.mixer = stateful_mixer(self.accelerator.unwrap_model(self.model))
        if name is not None:
            log_once(
                logger,
                logging.WARNING,
                f"{self.unpack_name}: prefix_sharing is off for this model: its token mixer {name} carries state "
                "along the sequence and runs per sample on packed rows, so a completion cannot continue its "
                f"prompt's state; {self.unpack_unshared} (exact, without sharing). Set prefix_sharing=False to "
                "silence this.",
            )
        return name


class PackedPairsMixin(BranchedTrainerMixin):
    """[`BranchedTrainerMixin`] for trainers whose collator packs the pairs of each batch (DPO, reward models): TRL's
    padded collator is kept as TRL's ``__init__`` built it (it makes the padded view of every packed batch, padded
    evaluation and the padded fallback) before the core replaces it with the packed one, and a failed branched probe
    rebuilds the packed collator unshared.

    Class attributes ``unpack_trl_collator`` and ``unpack_trl_vision_collator``: the [`unpack_trainer._trl_compat`]
    functions that return TRL's padded collator classes of the trainer, for text and (``None``: none) for image data
    (checked when the collator is kept).
    """

    unpack_trl_collator: Callable[[], type]
    unpack_trl_vision_collator: Callable[[], type] | None = None

    def _padded_collator(self) -> Any:
        collator = self.unpack_run.padded_collator
        if collator is None:
            collator = self.unpack_run.padded_collator = self.data_collator  # TRL's, as its __init__ built it
            expected = (type(self).unpack_trl_collator(),)
            if self.unpack_trl_vision_collator is not None:
                expected += (type(self).unpack_trl_vision_collator(),)
            if not isinstance(collator, expected):
                names = " or ".join(cls.__name__ for cls in expected)
                raise TypeError(f"{self.unpack_name} expected TRL's {names}, found {type(collator).__name__}")
        return collator

    def _unpack_stop_sharing(self) -> None:
        self.data_collator = self._shard_ready(self._packed_collator())

    def _enable_packed_path(self) -> None:
        self._padded_collator()  # keep TRL's collator before the core replaces it
        super()._enable_packed_path()
        if self.unpack_decision.packed:
            self.data_collator = self._shard_ready(self.data_collator)

    def _shard_ready(self, collator: Any) -> Any:
        """``collator``, under sequence parallelism (``self.unpack_run.sequence_shards`` > 1) with its batches made ready
        for DeepSpeed's adapter ([`unpack_trainer.data.sequence_shards.ShardReadyCollator`])."""
        if self.unpack_run.sequence_shards == 1:
            return collator
        from unpack_trainer.data.sequence_shards import ShardReadyCollator

        return ShardReadyCollator(collator, self.unpack_run.sequence_shards)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's loss; a batch through DeepSpeed's adapter (``SHARDED_BATCH_KEY``) is read whole (the model's packed
        view runs this process's shard of the row and gathers the hidden states:
        [`unpack_trainer.models.fixes.packed_view`]), its loss shared out over the group
        ([`_sequence_parallel_share`]) and its tokens counted once ([`unpack_trainer._trl_compat.tokens_counted_once`]:
        TRL gathers the count over every process, each holding the group's batch)."""
        whole = inputs.get(SHARDED_BATCH_KEY) if isinstance(inputs, dict) else None
        if whole is None:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        shards = whole[INFO_KEY].sequence_shards
        with _trl_compat.tokens_counted_once(self, shards):
            result = super().compute_loss(
                model, whole, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        return self._sequence_parallel_share(model, result, return_outputs, shards)
