"""``DistillationTrainer``: TRL's on-policy distillation trainer whose student and teacher forwards run one packed row.

TRL 1.16's step is kept whole: the student generates one completion per prompt (transformers or vLLM, tools
included), the batch is TRL's ``(rows, P + C)`` of left-padded prompts and right-padded completions, and
``_compute_loss`` projects the student's and the teacher's hidden states through their own LM heads chunk by chunk
into the generalized Jensen-Shannon divergence of ``beta`` (0: forward KL, 1: reverse KL, between: JSD) at
``temperature``, on completion tokens only, with every logged metric. Both models' hidden states go through one
method, ``_get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep, **vision_inputs)`` ->
``(rows, logits_to_keep, hidden)``: the student with gradients, the teacher without, on the same ``input_ids``.
[`DistillationTrainer`] overrides that method (and ``_compute_loss`` only to read the micro-batch's image counts and
let its layout go after it). The first call of a micro-batch builds its packed layout
([`unpack_trainer.trainers.branched.pack_completions`]: one row, each distinct prompt once, every completion after
its prompt, the packing metadata as a ``PackedSeqInfo``), the second call (the teacher's, on the same tensors) reuses
it, and each model's backbone runs the packed row and hands its last hidden state back in TRL's layout (the decoder's
packed view, :mod:`unpack_trainer.models.fixes.packed_view`); hidden states at padded positions are those of some
real token, and TRL's loss masks them exactly as it masks its own padding. Image prompts (a vision-language model of
a family verified for packed image rows) are laid out as GRPO's ([`unpack_trainer.trainers.image_prompts`]): each
prompt segment's vision inputs once, every token at the positions of its full sequence alone; such a layout holds one
model type's positions, so a teacher of another type builds its own.

The teacher may be of another family (its vocabulary must be the student's, as TRL requires): it is patched as the
student is, and its own contamination self-check runs before the first batch. A teacher the patch refuses (its model
type blocked or unpackable, a vision-language model not verified for packed image rows, a failed self-check) runs
TRL's padded forward while the student packs, logged once with the reason; a trainer without a local teacher
(``teacher_model=None``, as TRL's experimental server distillation supplies its teacher over the network) has no
teacher forward to pack. A micro-batch whose rows are not TRL's layout, whose vision inputs fit no known layout, or
whose packed row would hold more than ``PACKED_TOKEN_SHARE`` of its padded tokens runs TRL's padded forwards for both
models (logged once).

Under sequence parallelism (DeepSpeed Ulysses, ``sp_size = N``) a step is the one-process step on the same batch: the
prompts go through DeepSpeed's data loader adapter whole and every process of the group generates the same
completions, counted once ([`unpack_trainer.trainers.generation_groups`], shared with GRPO and RLOO); the micro-batch
always packs, its row padded to a multiple of ``N``; the student (training mode) runs its shard, the shards' hidden
states gathered for TRL's loss (each process back-propagating ``1 / N`` of it), and the teacher (evaluation mode,
left whole by Ulysses) runs the whole row on every process, outside Ulysses' wrapper (which drops a padded batch's
mask even there). What cannot be exact is refused at start (``_sequence_parallel_reason``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch
import trl

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.configs import DistillationConfig
from unpack_trainer.data.sequence_shards import padded_for_shards
from unpack_trainer.models.routing import outside_wrappers
from unpack_trainer.packed_seq_info import PACKED_INPUT_IDS_KEY, PACKED_POSITION_IDS_KEY
from unpack_trainer.trainers.branched import BranchedRun, BranchedTrainerMixin, pack_completions, stateful_mixer
from unpack_trainer.trainers.contamination import self_check_failed
from unpack_trainer.trainers.generation_groups import GeneratingGroupMixin, generation_reason, padded_forward_refusal
from unpack_trainer.trainers.grpo import PACKED_TOKEN_SHARE, _ImageInputs, _prompt_ids
from unpack_trainer.trainers.run_state import RunField
from unpack_trainer.trainers.sequence_parallel import evaluation_mode_reason

__all__ = ["DistillationTrainer"]

logger = logging.getLogger("unpack_trainer")

# How the reason of a micro-batch that packing would barely shrink starts (an expected fallback, logged at INFO).
FEW_TOKENS_SAVED = "the packed row would hold"


class _Layout:
    """One micro-batch's packed layout, built by the first ``_get_last_hidden_state`` call on TRL's ``input_ids`` /
    ``attention_mask`` ``(rows, L)`` and reused by the next one on the same tensors (the teacher's).

    Attributes:
        batch: the model inputs of [`pack_completions`] (the view ``input_ids`` ``(rows, C + 1)``, its packed row and
            the maps between them, ``packed_seq_info`` built once), ``labels`` dropped; or ``None``.
        reason: why TRL's padded forward runs instead (``batch`` is then ``None``).
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 batch: dict[str, Any] | None, reason: str | None, family: str | None = None) -> None:  # fmt: skip
        """``family``: the model type whose multi-axis positions an image layout holds (``None``: a text layout)."""
        self.input_ids, self.attention_mask, self.logits_to_keep = input_ids, attention_mask, logits_to_keep
        self.batch, self.reason, self.family = batch, reason, family

    def serves(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
               family: str | None = None) -> bool:  # fmt: skip
        """Whether this layout was built from these very tensors (and, for image prompts, for this model type)."""
        return (
            self.input_ids is input_ids
            and self.attention_mask is attention_mask
            and self.logits_to_keep == logits_to_keep
            and self.family == family
        )


def packed_layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    prefix_sharing: bool,
    vision: dict[str, Any] | None = None,
    positions: Any = None,
    shards: int = 1,
) -> tuple[dict[str, Any] | None, str | None]:
    """The packed row of TRL's distillation micro-batch, or why TRL's padded batch runs instead.

    ``input_ids`` / ``attention_mask`` ``(rows, L)`` int64 (``L = P + C``, ``C = logits_to_keep``): each row a prompt
    left-padded to ``P`` columns and its completion right-padded to ``C``. Returns ``(batch, None)`` with ``batch``
    [`pack_completions`]'s (``labels`` dropped; the packed ``(1, T)`` ids and positions moved to ``input_ids``'
    device once, for both models; ``packed_seq_lengths`` / ``packed_seq_parents`` and the ``packed_seq_info`` built
    from them stay on the host), or ``(None, reason)``: the rows are not TRL's layout, or the packed row would hold
    more than ``PACKED_TOKEN_SHARE`` of the padded batch's tokens.

    Example (prompts ``[5, 6]`` and ``[7]``, completions ``[8]`` and ``[9, 10]``; ``P = C = 2``)::

        input_ids        [[5, 6, 8, 0], [0, 7, 9, 10]]
        packed_input_ids [[5, 6, 8, 7, 9, 10]]    packed_position_ids [[0, 1, 2, 0, 1, 2]]
        input_ids (view) [[6, 8, 0], [7, 9, 10]]  packed_view_index   [[1, 2, 0], [3, 4, 5]]

    The backbone's last hidden state in the view's layout, ``(rows, C + 1, H)`` without its last column, is TRL's
    ``(rows, C, H)``: the hidden state that predicts each completion token.

    Image prompts: ``vision`` holds TRL's vision inputs of the micro-batch (``pixel_values``, ``image_grid_thw``,
    ``mm_token_type_ids`` / ``token_type_ids`` ``(rows, L)``, ..., and ``num_images`` / ``num_tiles``, the counts per
    row); the batch then carries each prompt segment's vision entries once, in the order of the row
    ([`unpack_trainer.trainers.image_prompts`], as GRPO's), rows sharing a segment only where their images are equal
    too, and ``positions`` (the model's ``SequencePositions``, or ``None`` for a text model of 1-D positions) numbers
    every token as its full sequence alone. A layout TRL's vision inputs do not fit is a reason.

    Under sequence parallelism (``shards`` > 1: the processes of a DeepSpeed Ulysses group, in a training step) the
    row is padded to a multiple of ``shards`` tokens, the padding one more sample on no view position, and its
    ``packed_seq_info`` marked for the cut ([`unpack_trainer.data.sequence_shards.padded_for_shards`]): the student
    (training mode) runs its shard, the teacher (evaluation mode) the whole row. It packs however little that saves
    (TRL's padded batch cannot be cut), and image prompts are a reason (their vision inputs are not cut into shards).
    """
    ids, mask = input_ids.detach().cpu(), attention_mask.detach().cpu()  # one copy to the host per micro-batch
    images = None
    if vision and shards > 1:
        return None, "image prompts are not cut into shards"
    if vision:
        images = _ImageInputs(vision, ids, mask, logits_to_keep, _prompt_ids(ids, mask, logits_to_keep)
                              if prefix_sharing else None)  # fmt: skip
        if images.problem is not None:
            return None, images.problem
    device = "cpu" if images is not None else input_ids.device
    keys = None if images is None else images.keys
    packed = pack_completions(ids, mask, logits_to_keep, prefix_sharing=prefix_sharing, device=device, keys=keys)
    if isinstance(packed, str):
        return None, packed
    batch, total = packed
    rows, width = ids.shape
    if shards == 1 and total > PACKED_TOKEN_SHARE * rows * width:
        return None, f"{FEW_TOKENS_SAVED} {total / (rows * width):.0%} of the padded batch's tokens"
    if images is not None:
        batch = images.packed(batch, 0, rows, positions, input_ids.device)
    batch.pop("labels")
    if shards > 1:
        batch = padded_for_shards(batch, shards)
    for name in (PACKED_INPUT_IDS_KEY, PACKED_POSITION_IDS_KEY):
        batch[name] = batch[name].to(input_ids.device, non_blocking=True)
    return batch, None


@dataclasses.dataclass
class DistillationRun(BranchedRun):
    """The run state of [`DistillationTrainer`].

    Attributes:
        teacher_reason (`str` or `None`): why the teacher runs TRL's padded forward (``unpack_teacher_reason``).
        selfcheck_teacher (`ContaminationReport` or `None`): the teacher's self-check (``unpack_selfcheck_teacher``).
        teacher_mixer (`str`, `None` or `False`): a packed teacher's state-carrying token mixer (``None``: none;
            ``False``: not looked for yet).
        layout (`_Layout` or `None`): the packed layout of the micro-batch running now.
        image_counts (`dict`): that micro-batch's image counts per row (``num_images`` / ``num_tiles``).
    """

    teacher_reason: str | None = None
    selfcheck_teacher: Any = None
    teacher_mixer: str | None | bool = False
    layout: _Layout | None = None
    image_counts: dict[str, Any] = dataclasses.field(default_factory=dict)


class DistillationTrainer(GeneratingGroupMixin, BranchedTrainerMixin, trl.DistillationTrainer):
    """Drop-in for [`trl.DistillationTrainer`]: ``from unpack_trainer import DistillationTrainer``; the arguments are
    TRL's.

    The student's and the teacher's forwards run one packed row per micro-batch, built once for both (see the module
    docstring); generation, the loss and every metric are TRL's. The decision, switches, self-checks and fallbacks
    are those of [`BranchedTrainerMixin`] (and its core [`PackedTrainerMixin`], which documents the attributes),
    made on the student; the teacher is patched and self-checked beside it, or runs padded with the reason logged.
    ``args`` may be any ``TrainingArguments`` (converted to our [`DistillationConfig`]).

    Attributes:
        unpack_teacher_reason (`str` or `None`): why the teacher runs TRL's padded forward (``None``: it runs the
            packed row, or nothing is packed).
        unpack_selfcheck_teacher (`ContaminationReport` or `None`): the teacher's self-check, once training or
            evaluation has started with a packed teacher.
    """

    unpack_packs_in = "step"
    unpack_packs_vision = True  # image prompts: each prompt segment's images once (trainers.image_prompts)
    unpack_sequence_parallel = True  # prompts copied to the group, each micro-batch's row padded and cut in the step
    unpack_unshared = "each completion is packed after its own copy of its prompt"
    unpack_config_class = DistillationConfig
    unpack_trl_methods = _trl_compat.DISTILLATION_TRAINER_METHODS
    unpack_trl_attributes = _trl_compat.DISTILLATION_TRAINER_ATTRIBUTES
    unpack_run_class = DistillationRun
    unpack_run: DistillationRun
    unpack_teacher_reason = RunField("teacher_reason")
    unpack_selfcheck_teacher = RunField("selfcheck_teacher")

    # ------------------------------------------------------------------------------------------------ construction

    def _unpack_before_init(self, model: Any, args: Any, **arguments: Any) -> Any:
        """The core's decision, after checking the arguments of the one method both forwards go through."""
        where = f"trl.{self.unpack_trl_class.__name__}"
        method = "_get_last_hidden_state"
        parameters = _trl_compat.DISTILLATION_HIDDEN_STATE_PARAMETERS
        _trl_compat.require_parameters(self.unpack_trl_class, method, parameters, where)
        return super()._unpack_before_init(model, args, **arguments)

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """``prompt``."""
        return (("prompt",),)

    def _unpack_teacher(self) -> Any:
        """The teacher TRL set up, unwrapped (``None`` without a local teacher)."""
        teacher = getattr(self, "teacher_model", None)
        return None if teacher is None else self.accelerator.unwrap_model(teacher)

    def _unpack_models(self) -> list[Any]:
        """The student, and the teacher where it runs the packed row."""
        models = [self.accelerator.unwrap_model(self.model)]
        teacher = self._unpack_teacher()
        if teacher is not None and self.unpack_teacher_reason is None:
            models.append(teacher)
        return models

    def _unpack_teacher_refusal(self) -> str | None:
        """Why the teacher cannot run packed rows (the decision's own reasons, on the teacher's config and PEFT
        config), or ``None``."""
        from unpack_trainer.decision import blocked_reason
        from unpack_trainer.trainers.packed_path import verified_model_types

        teacher = self._unpack_teacher()
        if teacher is None:
            return "there is no local teacher model (it is supplied another way)"
        supported, blocklist = verified_model_types()
        config = getattr(teacher, "config", None)
        return blocked_reason(
            model_config=config,
            data_collator=None,
            processing_class=None,
            dataset_sample=None,
            blocklist=blocklist,
            peft_config=getattr(teacher, "peft_config", None),
            supported_model_types=supported,
            vision=self._unpack_vision_reason(config),
        )

    def _enable_packed_path(self) -> None:
        """The teacher's own decision (logged once when it stays padded), then the core's: the student and a packed
        teacher patched, each with the decoder's packed view."""
        if self._unpack_teacher() is not None:
            self._unpack_teacher_padded(self._unpack_teacher_refusal())
        super()._enable_packed_path()  # under sequence parallelism the prompts then go to the adapter whole

    def _unpack_teacher_padded(self, reason: str | None) -> None:
        """Record ``reason`` (``None``: the teacher packs) and log it once."""
        self.unpack_teacher_reason = reason
        if reason is not None:
            log_once(
                logger,
                logging.WARNING,
                f"{self.unpack_name}: the teacher runs TRL's padded forwards ({reason}); the student's forwards are "
                "packed. Set padding_free=False to run both padded.",
            )

    def _unpack_install_hooks(self, model: Any) -> None:
        """The decoder's packed view only: TRL's distillation loss reads the backbone's hidden states and the LM
        head's weight itself (no fused LM head to make compact)."""
        from unpack_trainer.models import install_fix

        install_fix(model, "packed_view")

    # ------------------------------------------------------------------------------------------------ sequence parallel

    def _sequence_parallel_reason(self, config: Any, shards: int) -> str | None:
        """Why this run cannot train exactly under DeepSpeed Ulysses with ``shards`` processes per row, or ``None``.

        The adapter hands the group each process's batch of prompts in turn; every process generates the same
        completions ([`unpack_trainer.trainers.generation_groups.GeneratingGroupMixin`]) and packs the same
        micro-batch into one row: the student runs its shard of it, the teacher (evaluation mode, which Ulysses leaves
        whole with ``sp_disable_in_eval=True``) the whole row.
        So generation must be one process's (no vLLM, no tools: [`generation_reason`]), the teacher a local model,
        and each batch generated for and trained on in its own step (TRL's statistics over its gather of every
        process's batch, which holds each batch once per process of the group, are means, or sums divided by the
        process count, and stay unchanged; the token count is counted once in generation)."""
        what = f"sequence parallelism (sp_size={shards}, DeepSpeed Ulysses)"
        reason = generation_reason(self, shards)
        if reason is not None:
            return reason
        if self._unpack_teacher() is None:
            return (
                f"{what} without a local teacher model (a teacher served over the network, as TRL's server "
                "distillation supplies it): its scores are not verified to be the whole row's on every process of the "
                "group; pass teacher_model"
            )
        accumulation = self.args.gradient_accumulation_steps
        if accumulation != 1:
            return (
                f"{what} with gradient_accumulation_steps={accumulation}: TRL generates once for "
                "per_device_train_batch_size * gradient_accumulation_steps prompts and trains on them over that many "
                "micro-batches, where DeepSpeed's data loader hands the group each process's batch in turn (the other "
                "processes' prompts would be skipped); set gradient_accumulation_steps=1 (a batch of any size is one "
                "packed row, cut into shards)"
            )
        return evaluation_mode_reason(
            config,
            shards,
            "the teacher runs in evaluation mode, and so do evaluation and generation, each packed row or sequence "
            "whole",
        )

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's loss; under sequence parallelism every process of the group computed it from the same whole rows
        (the student's packed view gathers the shards' hidden states, the teacher runs the whole row), so each
        back-propagates its share ([`unpack_trainer.trainers.branched.BranchedTrainerMixin._sequence_parallel_share`])."""
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        return self._sequence_parallel_share(model, result, return_outputs, self.unpack_run.sequence_shards)

    # ------------------------------------------------------------------------------------------------ self-checks

    def _unpack_sharing(self) -> bool:
        """The core's, and no state-carrying token mixer in a packed teacher either (the layout serves both)."""
        return super()._unpack_sharing() and self._unpack_teacher_stateful_mixer() is None

    def _unpack_teacher_stateful_mixer(self) -> str | None:
        """The class name of a token mixer of a packed teacher that carries state along the sequence (logged once when
        it turns prefix sharing off), else ``None``."""
        if not self.args.prefix_sharing or self.unpack_teacher_reason is not None:
            return None
        if self.unpack_run.teacher_mixer is not False:
            return self.unpack_run.teacher_mixer
        teacher = self._unpack_teacher()
        name = self.unpack_run.teacher_mixer = None if teacher is None else stateful_mixer(teacher)
        if name is not None:
            log_once(
                logger,
                logging.WARNING,
                f"{self.unpack_name}: prefix_sharing is off: the teacher's token mixer {name} carries state along "
                f"the sequence and runs per sample on packed rows; {self.unpack_unshared} (exact, without "
                "sharing). Set prefix_sharing=False to silence this.",
            )
        return name

    def _unpack_check_before_first_batch(self) -> None:
        """The student's self-checks (the core's), then the teacher's on the model as it will run: the plain probe
        (a failure: the teacher runs padded, unpatched) and, with prompts shared, the branched one (a failure: the
        completions are packed unshared for both). ``UNPACK_STRICT=1`` raises on a failure."""
        from unpack_trainer.models import unpatch_model
        from unpack_trainer.selfcheck import check_uncontaminated

        first = not self.unpack_run.checked
        super()._unpack_check_before_first_batch()
        teacher = self._unpack_teacher()
        if not (first and self.unpack_decision.packed and teacher is not None and self.unpack_teacher_reason is None):
            return
        with self._unpack_training_precision():
            report = check_uncontaminated(teacher, measure_contamination=False)
        self.unpack_selfcheck_teacher = report
        if not report.ok:
            what = report.failure()
            self_check_failed(f"Self-check of the teacher failed ({what})")
            unpatch_model(teacher)
            self._unpack_teacher_padded(f"its contamination self-check failed: {what}")
            return
        log_once(logger, logging.INFO, f"Self-check of the teacher passed: {report.summary()}")
        if not self._unpack_sharing():
            return
        branches = self._unpack_probe_branches()
        lengths = (3, *((1, 4, 2)[i % 3] for i in range(max(branches, 2))))
        with self._unpack_training_precision():
            branched = check_uncontaminated(teacher, branched=True, lengths=lengths, measure_contamination=False)
        if branched.ok:
            return
        self_check_failed(
            f"Self-check of the teacher's shared prompts failed ({branched.failure()}): prefix sharing is off; "
            f"{self.unpack_unshared}. Set prefix_sharing=False to silence this"
        )
        self.unpack_run.sharing_failed = True

    # ------------------------------------------------------------------------------------------------ the forwards

    def _unpack_count_forward(self, kind: str) -> None:
        """Count a model forward (student or teacher) as ``"packed"`` or ``"padded"`` (TRL's batch) in
        ``unpack_stats["forwards"]``."""
        counts = self.unpack_stats.setdefault("forwards", {"packed": 0, "padded": 0})
        counts[kind] += 1

    def _unpack_packed_layout(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                              vision: dict[str, Any], model: Any) -> _Layout:  # fmt: skip
        """The micro-batch's [`packed_layout`], built on the first call with these tensors and reused after (an image
        layout by a model of the same type: its multi-axis positions are the model's)."""
        family = None
        if vision:
            vision = {**vision, **self.unpack_run.image_counts}
            family = str(getattr(getattr(model, "config", None), "model_type", None))
        layout = self.unpack_run.layout
        if layout is None or not layout.serves(input_ids, attention_mask, logits_to_keep, family):
            positions = self._unpack_sequence_positions(model) if vision else None
            # cut under sequence parallelism in a training step (the student's forward); an evaluation runs it whole
            shards = self.unpack_run.sequence_shards if self.model.training else 1
            batch, reason = packed_layout(input_ids, attention_mask, logits_to_keep,
                                          prefix_sharing=self._unpack_sharing(), vision=vision,
                                          positions=positions, shards=shards)  # fmt: skip
            layout = self.unpack_run.layout = _Layout(input_ids, attention_mask, logits_to_keep, batch, reason, family)
        return layout

    def _compute_loss(self, unwrapped_student: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """TRL's loss of one micro-batch (the student's forward, then the teacher's, on one layout), with the
        micro-batch's image counts (``num_images`` / ``num_tiles``, per row: TRL keeps them beside its vision tensors
        and does not hand them to the forwards) at hand for the layout; the layout is let go after it, so it lives no
        longer than its micro-batch."""
        counts = {name: inputs[name] for name in ("num_images", "num_tiles") if inputs.get(name) is not None}
        self.unpack_run.image_counts = counts
        try:
            return super()._compute_loss(unwrapped_student, inputs, *args, **kwargs)
        finally:
            self.unpack_run.layout, self.unpack_run.image_counts = None, {}

    @_trl_compat.profiled
    def _get_last_hidden_state(
        self,
        unwrapped_model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        **kwargs: Any,
    ) -> torch.Tensor:
        """TRL's method, on the micro-batch's packed row: the backbone's last hidden state ``(rows, logits_to_keep,
        hidden)`` (the model's dtype) at the positions that predict each completion token, as TRL returns it, from
        ``input_ids`` / ``attention_mask`` ``(rows, L)`` int64 (see the module docstring). ``kwargs`` are TRL's
        vision inputs (``pixel_values``, ``image_grid_thw``, per-token ``mm_token_type_ids`` / ``token_type_ids``,
        ...), laid out per prompt segment with the micro-batch's image counts. TRL's own code runs when the trainer
        is not packing, for a teacher that runs padded, and for a micro-batch not in TRL's layout, whose vision
        inputs fit no known layout (or come without the counts that place them), or that packing would barely shrink
        (each logged once).

        Under sequence parallelism the student's training forward runs its shard of the row (a micro-batch that
        cannot be packed is an error: DeepSpeed Ulysses would cut TRL's padded batch as one row), and every forward in
        evaluation mode (the teacher's, packed or padded; evaluation) runs whole, outside Ulysses' wrapper, which drops
        a padded batch's mask even where it leaves the module whole
        ([`unpack_trainer.models.routing.outside_wrappers`])."""
        shards = self.unpack_run.sequence_shards
        whole = outside_wrappers() if shards > 1 and not unwrapped_model.training else contextlib.nullcontext()

        def stock(reason: str | None = None) -> torch.Tensor:
            if shards > 1 and unwrapped_model.training:
                raise padded_forward_refusal(self.unpack_name, shards, reason or "the forward is not packed")
            if self.unpack_decision.packed:
                self._unpack_count_forward("padded")
            with whole:
                return super(DistillationTrainer, self)._get_last_hidden_state(
                    unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs
                )

        if not self.unpack_decision.packed:
            return stock()
        from accelerate.utils import is_peft_model

        if self.unpack_teacher_reason is not None and unwrapped_model is self._unpack_teacher():
            return stock()
        model = unwrapped_model.base_model.model if is_peft_model(unwrapped_model) else unwrapped_model
        vision = {name: value for name, value in kwargs.items() if value is not None}
        layout = self._unpack_packed_layout(input_ids, attention_mask, logits_to_keep, vision, model)
        if layout.batch is None:
            if shards > 1 and unwrapped_model.training:
                return stock(layout.reason)
            expected = layout.reason.startswith(FEW_TOKENS_SAVED)  # else: not TRL's layout, or no known image layout
            level = logging.INFO if expected else logging.WARNING
            log_once(logger, level, f"{self.unpack_name}: a micro-batch ran TRL's padded forwards: {layout.reason}")
            return stock()
        self._unpack_count_forward("packed")
        # the decoder's packed view runs the packed row (or, cut for Ulysses in a training forward, this process's
        # shard, the shards' hidden states gathered) and hands back the view's (rows, C + 1, H)
        with whole:
            hidden = model.base_model(**layout.batch, use_cache=False).last_hidden_state
        return hidden[:, :-1, :]
