"""Every private name of the trainer classes the packed-trainer core touches (TRL's trainers and transformers'
``Trainer`` they extend), each behind a feature check.

The core ([`unpack_trainer.trainers._packed`]) and its trainers override or read names that are not public API in TRL
or transformers: the SFT trainer's ``_prepare_dataset``, the Trainer's ``_get_train_sampler``, attributes TRL sets in
``__init__``, TRL's padded collator, an argument of the Trainer's ``evaluation_loop`` passed by position. They are all
listed here, checked when a trainer is built (methods: before TRL's ``__init__``; attributes: right after it) or at
first use, and a missing one raises one clear error that names it and the versions known to work, instead of an
``AttributeError`` somewhere inside a training step. When TRL makes a name public or renames it, this is the one file
to change. The model side's private names (transformers' modeling code, torch, datasets) are
``unpack_trainer._compat``'s.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

KNOWN_TO_WORK = "TRL 1.16 with transformers 5.22 to 5.24 (pyproject allows trl>=1.16,<2 and transformers>=5.22,<6)"

# Methods of transformers' Trainer the core overrides or calls (every packed trainer).
TRAINER_METHODS: tuple[str, ...] = (
    "_get_train_sampler",  # the balanced sampler replaces the random one
    "get_batch_samples",  # counts the samples of an accumulated step (loss_normalization="sample")
    "get_train_dataloader",  # the self-check runs right before the first data loader is built
    "get_eval_dataloader",
    "get_test_dataloader",
    "get_tp_size",
    "evaluation_loop",  # eval_loss weighed by what each batch holds (streamed sets, per-sample loss)
    "prediction_step",
)
# Attributes transformers' Trainer sets in ``__init__`` or per step that the core reads or writes.
TRAINER_ATTRIBUTES: tuple[str, ...] = (
    "loss_is_scaled_for_ga",
    "label_smoother",
    "compute_loss_func",
    "accelerator",
    "model_accepts_loss_kwargs",  # whether the Trainer counts each step's trained tokens (count_step_tokens)
)

# ``trl.SFTTrainer``: methods overridden or called with their TRL 1.16 signature, attributes read after ``__init__``.
SFT_TRAINER_METHODS: tuple[str, ...] = (
    "_prepare_dataset",
    "compute_loss",
    "_set_signature_columns_if_needed",  # rows of image examples packed ahead keep their keys
    "_get_dataloader",  # image examples read with their dataset's name and index (the vision collator's errors)
    "_remove_unused_columns",  # ... their unused columns taken off first, as the Trainer does
)
SFT_TRAINER_ATTRIBUTES: tuple[str, ...] = (
    "_tokenizer",  # the tokenizer inside the processing class: pad_token_id of the collators
    "_is_vision_dataset",  # an image dataset: TRL's vision collator processes its batches
    "completion_only_loss",  # the packed collator masks prompts as TRL's does
    "_skip_prepare_dataset",  # the padded fallback prepares the raw datasets again unless TRL skipped preparation
    "_formatting_func",
    "aux_loss_enabled",  # the per-sample loss adds the router loss as TRL's does
    "router_aux_loss_coef",
)

# ``trl.DPOTrainer``: the packed path keeps TRL's ``_compute_loss`` whole and hooks the decoder its fused LM head calls
# (``model.base_model``); it reads the reference model TRL set up.
DPO_TRAINER_METHODS: tuple[str, ...] = ("_compute_loss", "compute_ref_log_probs")
DPO_TRAINER_ATTRIBUTES: tuple[str, ...] = ("ref_model", "precompute_ref_logps")

# ``trl.GRPOTrainer`` and ``trl.RLOOTrainer``: the packed path overrides the one method every per-token log-prob
# forward goes through (policy, old policy, reference), called with TRL 1.16's arguments (checked by name below), and
# reads the group size and the reference model; its generation (``_generate``) runs PEFT's own LoRA path.
ONLINE_TRAINER_METHODS: tuple[str, ...] = (
    "_get_per_token_logps_and_entropies",
    "_generate_and_score_completions",
    "_generate",
    "_calculate_rewards",  # under sequence parallelism: the gathered rewards, for the logged standard deviations
    "_prepare_inputs",  # under sequence parallelism: the prompts of the adapter's batch, the group's random state
)
ONLINE_TRAINER_ATTRIBUTES: tuple[str, ...] = ("num_generations", "ref_model", "_metrics", "reward_func_names")
ONLINE_LOGPS_PARAMETERS: tuple[str, ...] = (
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
)
# ``trl.RewardTrainer``: TRL's ``compute_loss`` is kept whole (the model call returns its padded batch's logits);
# its padded collator builds the view of every packed batch.
REWARD_TRAINER_METHODS: tuple[str, ...] = ("compute_loss", "_prepare_dataset")
# ``trl.DistillationTrainer``: the packed path overrides the one method both the student's and the teacher's forward
# go through (the backbone's last hidden state aligned to the completion tokens, called with TRL 1.16's arguments,
# checked by name below) and keeps ``_compute_loss`` whole (it calls that method for the student, then for the teacher
# on the same tensors); its generation (``_generate``) runs PEFT's own LoRA path; it reads the teacher TRL set up.
DISTILLATION_TRAINER_METHODS: tuple[str, ...] = ("_get_last_hidden_state", "_compute_loss", "_generate")
DISTILLATION_TRAINER_ATTRIBUTES: tuple[str, ...] = ("teacher_model",)
DISTILLATION_HIDDEN_STATE_PARAMETERS: tuple[str, ...] = (
    "unwrapped_model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
)
# ``trl.KTOTrainer``: the packed path keeps TRL's ``_compute_loss`` whole, gives it the reference log-probs of one
# packed reference forward (as precomputed ones) and the policy's KL log-probs of a packed row
# (``_compute_kl_logps``), and computes ``compute_ref_log_probs`` of a packed batch; it reads the reference model, the
# precompute switch and whether the loss has a KL term.
KTO_TRAINER_METHODS: tuple[str, ...] = ("_compute_loss", "_compute_kl_logps", "compute_ref_log_probs")
KTO_TRAINER_ATTRIBUTES: tuple[str, ...] = ("ref_model", "precompute_ref_logps", "calculate_KL")


def _missing(where: str, name: str, kind: str) -> RuntimeError:
    return RuntimeError(
        f"unpack_trainer needs the {kind} `{where}.{name}`, which the installed TRL / transformers does not have. "
        f"Known to work: {KNOWN_TO_WORK}. Install a version in that range, or set UNPACK_DISABLE=1 to train exactly "
        "as TRL does."
    )


def require_methods(cls: type, names: tuple[str, ...], where: str) -> None:
    """Raise ``RuntimeError`` naming the first of ``names`` that ``cls`` (a TRL trainer class) lacks."""
    for name in names:
        if not callable(getattr(cls, name, None)):
            raise _missing(where, name, "method")


def require_attributes(obj: Any, names: tuple[str, ...], where: str) -> None:
    """Raise ``RuntimeError`` naming the first of ``names`` that ``obj`` (a trainer after TRL's ``__init__``) lacks."""
    for name in names:
        if not hasattr(obj, name):
            raise _missing(where, name, "attribute")


def require_parameters(cls: type, method: str, names: tuple[str, ...], where: str) -> None:
    """Raise ``RuntimeError`` naming ``cls.method`` where ``cls`` lacks it (as :func:`require_methods`), else the first
    of ``names`` that it does not take."""
    require_methods(cls, (method,), where)
    parameters = inspect.signature(getattr(cls, method)).parameters
    for name in names:
        if name not in parameters:
            raise _missing(f"{where}.{method}", name, "parameter")


def evaluation_loop_argument(args: tuple, kwargs: dict[str, Any], name: str) -> Any:
    """The argument ``name`` of a call ``Trainer.evaluation_loop(self, *args, **kwargs)`` (transformers' ``Trainer``),
    by keyword or by position, or its default; found from the method's signature, which must have it."""
    from transformers import Trainer

    signature = inspect.signature(Trainer.evaluation_loop)
    if name not in signature.parameters:
        raise _missing("transformers.Trainer.evaluation_loop", name, "parameter")
    bound = signature.bind_partial(None, *args, **kwargs).arguments
    return bound[name] if name in bound else signature.parameters[name].default


def counts_step_tokens(trainer: Any) -> bool:
    """Whether transformers' ``Trainer`` counts the trained tokens of every accumulated step for ``trainer``'s loss.

    The ``Trainer`` counts them (``get_batch_samples``: ``labels[..., 1:] != -100`` of every micro-batch of the step,
    summed over the processes with ``average_tokens_across_devices``), hands the count to ``compute_loss`` as
    ``num_items_in_batch`` and takes the loss it gets back as already scaled for gradient accumulation
    (``training_step`` does not divide it by the accumulation steps) only where ``trainer.model_accepts_loss_kwargs`` is true (or a
    ``compute_loss_func`` is set). ``Trainer.__init__`` copies that attribute from the model class's
    ``accepts_loss_kwargs``, which says whether the model's *own* loss takes ``num_items_in_batch``; otherwise the loss
    of a step is the mean of its micro-batches' own means."""
    return bool(trainer.model_accepts_loss_kwargs) or trainer.compute_loss_func is not None


def count_step_tokens(trainer: Any) -> None:
    """Have transformers' ``Trainer`` count the trained tokens of every accumulated step for ``trainer``'s loss and
    hand them to its ``compute_loss`` as ``num_items_in_batch`` (see :func:`counts_step_tokens`), whatever the model
    class's ``accepts_loss_kwargs`` says: ``trainer.model_accepts_loss_kwargs`` set on this trainer only (the model
    class is left alone). Only for a ``compute_loss`` that never hands ``num_items_in_batch`` to the model's own loss
    (TRL's SFT loss: from its fused LM head's log-probs, or the logits given to ``compute_loss_func`` / the label
    smoother), since the ``Trainer``'s own ``compute_loss`` would pass it to the model's forward."""
    trainer.model_accepts_loss_kwargs = True


def profiled(method: Any) -> Any:
    """``method`` under TRL's ``profiling_decorator`` (``trl.extras.profiling``: the time of a trainer method, logged
    to the trackers the trainer reports to), as TRL's own method of that name is; ``method`` itself where TRL has no
    such decorator."""
    try:
        from trl.extras.profiling import profiling_decorator
    except ImportError:
        return method
    return profiling_decorator(method)


def fused_lm_head_names() -> tuple[type, Any]:
    """What TRL's fused LM head (``add_fused_lm_head``) is made of that a replacement kernel reuses, from
    ``trl.trainer.utils``: its output class ``FusedCausalLMOutput`` and ``maybe_gather_lm_head_ctx`` (gathers a
    ZeRO-3 partitioned LM head for a direct read of its weight)."""
    from trl.trainer import utils

    names = []
    for name in ("FusedCausalLMOutput", "maybe_gather_lm_head_ctx"):
        value = getattr(utils, name, None)
        if value is None:
            raise _missing("trl.trainer.utils", name, "class" if name[0].isupper() else "function")
        names.append(value)
    return names[0], names[1]


@contextlib.contextmanager
def tokens_counted_once(trainer: Any, copies: int) -> Iterator[None]:
    """Inside the block, the tokens a TRL preference trainer's loss counts (DPO's, the reward trainer's and KTO's
    ``_compute_loss`` add the ``attention_mask`` sum gathered over every process to ``trainer._total_train_tokens``
    and log it as the ``num_tokens`` metric) count once where every batch is held by ``copies`` processes (a
    sequence-parallel group: each process runs the group's batch); ``copies == 1`` changes nothing."""
    counted = getattr(trainer, "_total_train_tokens", None)
    if copies > 1 and not isinstance(counted, int):
        raise _missing(f"trl.{type(trainer).__name__}", "_total_train_tokens", "attribute")
    yield
    if copies == 1:
        return
    trainer._total_train_tokens = counted + (trainer._total_train_tokens - counted) // copies
    metrics = getattr(trainer, "_metrics", {}).get("train" if trainer.model.training else "eval", {})
    if metrics.get("num_tokens"):
        metrics["num_tokens"][-1] = trainer._total_train_tokens


def drop_last_metric(trainer: Any, name: str) -> None:
    """Take back the value of metric ``name`` TRL's trainer appended last (``trainer._metrics[mode][name]``, ``mode``
    ``"train"`` or ``"eval"`` as the model is training or not), for a value its loss did not compute; a metric left
    without values is removed (TRL's ``log`` averages every list it holds)."""
    metrics = getattr(trainer, "_metrics", None)
    if not isinstance(metrics, dict):
        raise _missing(f"trl.{type(trainer).__name__}", "_metrics", "attribute")
    values = metrics.get("train" if trainer.model.training else "eval", {})
    if values.get(name):
        values[name].pop()
    if name in values and not values[name]:
        del values[name]


def sft_padded_collator_class() -> type:
    """TRL's padded language-modeling collator (``trl.trainer.sft_trainer.DataCollatorForLanguageModeling``), the
    collator of padded evaluation and of the padded fallback."""
    from trl.trainer import sft_trainer

    collator = getattr(sft_trainer, "DataCollatorForLanguageModeling", None)
    if collator is None:
        raise _missing("trl.trainer.sft_trainer", "DataCollatorForLanguageModeling", "class")
    return collator


def vision_collator_without_truncation(collator: Any) -> Any:
    """A copy of TRL's ``DataCollatorForVisionLanguageModeling`` ``collator`` that neither truncates nor pads to a
    multiple (``max_length=None``, ``pad_to_multiple_of=None``): the vision packing collator truncates each sample
    itself, text only, and pads the packed row."""
    import dataclasses

    from trl.trainer import sft_trainer

    vision = getattr(sft_trainer, "DataCollatorForVisionLanguageModeling", None)
    if vision is None:
        raise _missing("trl.trainer.sft_trainer", "DataCollatorForVisionLanguageModeling", "class")
    if not isinstance(collator, vision) or not dataclasses.is_dataclass(collator):
        raise TypeError(f"expected TRL's DataCollatorForVisionLanguageModeling, got {type(collator).__name__}")
    return dataclasses.replace(collator, max_length=None, pad_to_multiple_of=None)


def dpo_padded_collator_class() -> type:
    """TRL's padded preference collator (``trl.trainer.dpo_trainer.DataCollatorForPreference``): the view of every
    packed preference batch, padded evaluation and the padded fallback."""
    from trl.trainer import dpo_trainer

    collator = getattr(dpo_trainer, "DataCollatorForPreference", None)
    if collator is None:
        raise _missing("trl.trainer.dpo_trainer", "DataCollatorForPreference", "class")
    return collator


def reward_padded_collator_class() -> type:
    """TRL's padded reward collator (``trl.trainer.reward_trainer.DataCollatorForPreference``: chosen rows, then
    rejected rows): the view of every packed reward batch, the padded fallback."""
    from trl.trainer import reward_trainer

    collator = getattr(reward_trainer, "DataCollatorForPreference", None)
    if collator is None:
        raise _missing("trl.trainer.reward_trainer", "DataCollatorForPreference", "class")
    return collator


def dpo_vision_collator_class() -> type:
    """TRL's padded vision preference collator (``trl.trainer.dpo_trainer.DataCollatorForVisionPreference``): the
    view of every packed image preference batch, padded evaluation and the padded fallback on image data."""
    from trl.trainer import dpo_trainer

    collator = getattr(dpo_trainer, "DataCollatorForVisionPreference", None)
    if collator is None:
        raise _missing("trl.trainer.dpo_trainer", "DataCollatorForVisionPreference", "class")
    return collator


def kto_vision_collator_class() -> type:
    """TRL's padded vision unpaired preference collator
    (``trl.trainer.kto_trainer.DataCollatorForVisionUnpairedPreference``): the views of every packed KTO batch of image
    data, padded evaluation and the padded fallback on image data."""
    from trl.trainer import kto_trainer

    collator = getattr(kto_trainer, "DataCollatorForVisionUnpairedPreference", None)
    if collator is None:
        raise _missing("trl.trainer.kto_trainer", "DataCollatorForVisionUnpairedPreference", "class")
    return collator


def kto_padded_collator_class() -> type:
    """TRL's padded unpaired preference collator (``trl.trainer.kto_trainer.DataCollatorForUnpairedPreference``): the
    views of every packed KTO batch, padded evaluation and the padded fallback."""
    from trl.trainer import kto_trainer

    collator = getattr(kto_trainer, "DataCollatorForUnpairedPreference", None)
    if collator is None:
        raise _missing("trl.trainer.kto_trainer", "DataCollatorForUnpairedPreference", "class")
    return collator


def reference_forward_context(trainer: Any) -> Any:
    """The context of a reference forward of TRL's preference trainers (KTO's ``_compute_loss`` and
    ``compute_ref_log_probs``): no gradient, ``trainer.model``'s gradient checkpointing off
    (``trl.models.utils.disable_gradient_checkpointing``) and, where the reference is the policy itself (no
    ``trainer.ref_model``, a PEFT model), its frozen ``"ref"`` adapter active or, without one, its adapters disabled
    (``trl.trainer.utils.use_adapter``)."""
    import contextlib

    import torch
    from accelerate.utils import is_peft_model
    from trl.models import utils as model_utils
    from trl.trainer import utils

    for module, name in ((model_utils, "disable_gradient_checkpointing"), (utils, "use_adapter")):
        if not callable(getattr(module, name, None)):
            raise _missing(module.__name__, name, "function")
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(
        model_utils.disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)
    )
    if trainer.ref_model is None and is_peft_model(trainer.model):
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        stack.enter_context(utils.use_adapter(unwrapped, "ref" if "ref" in unwrapped.peft_config else None))
    return stack
