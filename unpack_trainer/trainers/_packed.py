"""The packed-trainer core: everything around packing that does not depend on what a batch holds.

[`PackedTrainerMixin`] goes in front of a TRL trainer class (``class SFTTrainer(PackedTrainerMixin, trl.SFTTrainer)``)
and owns the packing decision ([`unpack_trainer.decision.decide`]), the config conversion, the environment switches
(``UNPACK_DISABLE``, ``UNPACK_STRICT``, ...), enabling the packed path (collator, attention patch), the contamination
self-check right before the first data loader is built and the padded fallback if it fails, the padded evaluation
collator, the balanced-step sampler, the per-sample count of ``loss_normalization="sample"`` and the start line.
Trainers whose prompts are shared by several completions (DPO's pairs, GRPO's groups) build on
[`unpack_trainer.trainers.branched.BranchedTrainerMixin`], this core plus the prompt-sharing pieces.

The core's ``__init__`` takes exactly the arguments of its TRL trainer's (bound to that ``__init__``'s signature,
whatever it is), decides ([`_unpack_before_init`]), runs TRL's ``__init__`` with the config TRL should see
([`_unpack_trl_init`]) and enables the packed path ([`_unpack_after_init`]); a trainer built on it writes no
``__init__`` and implements the hooks below (they are what differs between SFT, DPO, GRPO, ...):

- [`_unpack_has_metrics`]: whether evaluation computes metrics from predictions (they then see one row per example);

- [`_packed_collator`] / [`_padded_collator`]: the collators of packed training and of padded batches (trainers
  whose collator packs, ``unpack_packs_in = "collator"``; a trainer that packs inside its step, ``"step"``, keeps
  TRL's collator and needs neither).
- [`_prepare_padded_datasets`]: prepare the raw datasets again as padded (the self-check's fallback); by default
  nothing, for trainers whose padded and packed batches come from the same prepared data.
- [`_count_samples`]: the samples with a trained token in one collated batch (``loss_normalization="sample"``).
- [`_check_sample_loss`]: raise if ``loss_normalization="sample"`` cannot be honoured with this configuration.
- [`_enable_token_loss`]: make ``loss_normalization="token"`` the mean over every trained token of an accumulated
  step where the TRL trainer's own loss would not be (default: nothing).
- [`_unpack_models`]: the models the packed path patches (default: the policy); the fallback unpatches them all.

Class attributes: ``unpack_config_class`` (our config class, e.g. [`unpack_trainer.SFTConfig`]; any other
``TrainingArguments`` is converted to it), ``unpack_trl_class`` (the TRL trainer class behind the mixin, whose private
names [`unpack_trainer._trl_compat`] checks), ``unpack_name`` (the start line's prefix) and ``unpack_packs_in``; the
first three are read from the trainer's entry in [`unpack_trainer.trainers.TRAINERS`] and its TRL base class. The
core reads from the config only what it has: TRL's fields the decision reads (``packing``, ``padding_free``,
``max_length``, ...) and ours (``loss_normalization``, ``balance_samples_per_step``; see [`unpack_trainer.SFTConfig`]
for their meaning; a config without them trains with TRL's token loss and TRL's sampler).

Evaluation: ``eval_loss`` is recomputed from batch weights (see [`PackedTrainerMixin.evaluation_loop`]) when
transformers would weigh the batches wrongly; the hooks above are all it needs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoConfig
from transformers.trainer_utils import has_length

from unpack_trainer import _trl_compat
from unpack_trainer._compat import attention_implementation
from unpack_trainer._logging import announce_level, log_once
from unpack_trainer.configs import convert_config
from unpack_trainer.data.preparation import TruncationCounts, samples_per_row
from unpack_trainer.data.sampler import BalancedStepSampler, attention_cost_ratio, row_costs
from unpack_trainer.decision import (
    PackingDecision,
    decide,
    env_flag,
    eval_batches,
    explicit_padding_free,
    neftune_note,
    parallelism_reason,
    parallelism_refusal,
    sequence_parallel_size,
)
from unpack_trainer.models.selfcheck import ContaminationReport, check_uncontaminated
from unpack_trainer.packed_seq_info import SEQ_LENGTHS_COLUMN
from unpack_trainer.trainers.lora_casts import lora_input_casts_skipped, plain_lora_layers

logger = logging.getLogger("unpack_trainer")


def _model_config(model: Any, args: Any) -> Any:
    if isinstance(model, str):
        return AutoConfig.from_pretrained(model, trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    return model.config


def _first_example(dataset: Any) -> dict[str, Any] | None:
    """What the decision reads of the training set, consuming nothing from it where it can.

    A map-style dataset: ``dataset[0]``. An ``IterableDataset`` whose features are declared: its columns (values
    ``None``), so nothing is read and a one-shot stream keeps its first example. Any other iterable: its first example
    (TRL's ``__init__`` reads it too). ``ValueError`` for an empty dataset (nothing to train on).
    """
    if dataset is None:
        return None
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        if len(dataset) == 0:
            raise empty_train_dataset_error()
        return dataset[0]
    features = getattr(dataset, "features", None)
    if features is not None:
        return dict.fromkeys(features)
    try:
        return next(iter(dataset))
    except StopIteration:
        raise empty_train_dataset_error() from None


def empty_train_dataset_error() -> ValueError:
    """The error for a training set with no example (raise it where TRL's ``__init__`` hits the end of an empty
    stream: ``StopIteration``)."""
    return ValueError("`train_dataset` is empty (0 examples); training needs at least one example.")


def _registry() -> tuple[frozenset[str], dict[str, str]]:
    from unpack_trainer import models

    return frozenset(models.supported_model_types()), dict(models.BLOCKLIST)


def _keep_batches_whole(trl_args: Any, args: Any) -> None:
    """Turn accelerate's batch dispatching off for packed batches (on ``trl_args``, a copy of the user's config).

    ``DataLoaderDispatcher`` (accelerate's default for iterable data) slices every tensor of a batch to the batch
    dimension, which cuts the 1-D ``packed_seq_lengths`` / ``cu_seq_lens_*`` of a ``(1, T)`` packed batch. Each process
    then reads its own batches (what TRL already does for an iterable training set).
    """
    config = copy.copy(args.accelerator_config)
    if getattr(config, "dispatch_batches", None) is True:
        log_once(
            logger,
            logging.WARNING,
            "accelerator_config.dispatch_batches=True ignored: dispatching slices every tensor of a batch to its "
            "first dimension, which would cut the packing metadata (packed_seq_lengths, cu_seq_lens); each process "
            "reads its own batches instead. Set padding_free=False to keep dispatching.",
        )
    config.dispatch_batches = False
    trl_args.accelerator_config = config


def _autocast_dtype(args: Any) -> torch.dtype | None:
    """The dtype the Trainer's mixed precision (``bf16`` / ``fp16``, run through autocast) computes float32
    parameters in; ``None`` without mixed precision. Packed attention computes in it, and chooses its backend for it."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def _attention_backend(model: Any, patched: bool, args: Any) -> str:
    if patched:
        from unpack_trainer.models import resolve_backend

        return str(resolve_backend(model, compute_dtype=_autocast_dtype(args)))
    implementation = attention_implementation(getattr(model, "config", None))
    return f"{implementation} (transformers' own packed-position path, unpatched)"


EVAL_ITEMS_KEY = "unpack_eval_items"  # an evaluation batch's number of dataset items (int), read and removed


class _ItemCountingCollator:
    """``collator``'s batch plus how many dataset items it was built from (``EVAL_ITEMS_KEY``, a Python int), so
    that evaluation can weigh each batch by what it holds (see [`PackedTrainerMixin.evaluation_loop`])."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(features)
        batch[EVAL_ITEMS_KEY] = len(features)
        return batch


def _loss_normalization(args: Any) -> str:
    """``args.loss_normalization`` (ours), ``"token"`` (TRL's) for a config without it."""
    return getattr(args, "loss_normalization", "token")


class PackedTrainerMixin:
    """The packed-trainer core, in front of a TRL trainer class; see the module docstring for the hooks.

    What every trainer built on it does, whatever its batches: with ``padding_free`` unset (our configs' default; a
    plain TRL config is converted, and a ``False`` there counts as unset since it cannot be told from TRL's default)
    the packed path turns on by itself wherever the model, the collator and the data allow it, and the decision is
    logged once with its reason; ``padding_free=False`` trains exactly as TRL; ``UNPACK_DISABLE=1`` makes the class
    behave exactly as its TRL trainer. A contamination self-check runs on the model as it will train, right before the
    first batch, and the trainer falls back to TRL's padded batches if it fails (``UNPACK_STRICT=1`` raises).

    Attributes:
        unpack_decision (`PackingDecision`): what was decided and why (after a failed self-check: ``"padded"``).
        unpack_stats (`dict`): samples, rows, real tokens, packing efficiency and the estimated speedup
            ([`unpack_trainer.data.estimate`]) for the training set; for a streamed training set, the truncation counts
            (``"truncation"``) as they are read (an image dataset's: its text cut after the last image token, up front
            when packed ahead).
        unpack_selfcheck (`ContaminationReport` or `None`): the self-check's result, once training or evaluation has
            started (``None`` before, and when nothing is packed).
    """

    unpack_config_class: type
    unpack_trl_class: type
    unpack_name: str = "Trainer"
    # "collator": the collator packs each batch (the core swaps collators, keeps batches whole); "step": the trainer
    # packs inside its training step from TRL's own batches (GRPO's generated groups), its collator untouched.
    unpack_packs_in: str = "collator"
    # Whether the trainer packs vision-language data (a vision-language model, a processor, images); the decision
    # keeps such a set-up padded, with that reason, where it does not.
    unpack_packs_vision: bool = False
    # Whether the trainer packs under sequence parallelism (DeepSpeed Ulysses): its collator's rows, ready to be cut,
    # carry the whole row's boundaries to every shard (SFT, DPO); elsewhere `sp_size > 1` is refused like context
    # parallelism.
    unpack_sequence_parallel: bool = False
    _unpack_trl_methods: tuple[str, ...] = ()  # private methods of the TRL class the subclass relies on
    _unpack_trl_attributes: tuple[str, ...] = ()  # attributes TRL's __init__ sets that the subclass reads

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A trainer declared in [`unpack_trainer.trainers.TRAINERS`] takes what its entry says: ``unpack_name`` (its
        class name), ``unpack_config_class`` (the entry's config class); and ``unpack_trl_class``, the TRL trainer
        class it derives from. A user's subclass inherits them."""
        super().__init_subclass__(**kwargs)
        from unpack_trainer.trainers import TRAINERS

        spec = next((spec for spec in TRAINERS if spec.trainer_module == cls.__module__), None)
        if spec is None or spec.trainer != cls.__name__:
            return
        cls.unpack_name = spec.trainer
        cls.unpack_config_class = spec.config_class()
        cls.unpack_trl_class = next(base for base in cls.__mro__ if base.__module__.split(".")[0] == "trl")

    # ------------------------------------------------------------------------------------------------ hooks

    def _packed_collator(self) -> Any:
        """The collator of packed (and padding-free) batches."""
        raise NotImplementedError(f"{type(self).__name__} must implement _packed_collator")

    def _padded_collator(self) -> Any:
        """The collator of padded batches (one row per example): padded evaluation and the padded fallback."""
        raise NotImplementedError(f"{type(self).__name__} must implement _padded_collator")

    def _prepare_padded_datasets(self, raw_train: Any, raw_eval: Any) -> None:
        """Prepare the raw datasets again for padded batches (``self.unpack_decision`` is already ``"padded"``); by
        default nothing: padded and packed batches are made from the same prepared data."""

    def _count_samples(self, batch: dict[str, Any]) -> int:
        """The samples with at least one trained token in one collated batch (``loss_normalization="sample"``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _count_samples")

    def _check_sample_loss(self) -> None:
        """Raise ``ValueError`` if ``loss_normalization="sample"`` is not supported with this configuration."""

    def _enable_token_loss(self) -> None:
        """With ``loss_normalization="token"`` (not under ``UNPACK_DISABLE=1``): make the loss of an optimizer step the
        mean over every trained token of the step (all its micro-batches and processes) where the TRL trainer's own
        loss would not be; by default nothing (the TRL trainer's loss is kept as it is)."""

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """The column sets a training or evaluation dataset of this trainer is read by, in TRL's order of precedence
        (``unpack-trainer <command>`` checks a data file's rows against them before training); empty: not checked."""
        return ()

    def _unpack_trl_packs(self, args: Any, decision: PackingDecision, first_example: dict[str, Any] | None) -> bool:
        """The ``packing`` TRL's ``__init__`` sees (its data path packs when it is ``True``): the user's, where TRL's
        own path runs (``"stock"``) or the trainer packs through it (``"pack"``); ``False`` otherwise."""
        return bool(args.packing) and decision.mode in ("pack", "stock")

    def _unpack_models(self) -> list[Any]:
        """The models the packed path patches (the policy; trainers with a reference model add it), unwrapped."""
        return [self.accelerator.unwrap_model(self.model)]

    def _unpack_vision_reason(self, model_config: Any) -> str | None:
        """Why this trainer keeps vision-language data (a vision-language model, a processor, images) padded, or
        ``None`` where it packs it (``model_config``: the model's ``PretrainedConfig``, or ``None``); by default from
        ``unpack_packs_vision``."""
        if self.unpack_packs_vision:
            return None
        return (
            f"{self.unpack_name} does not pack vision-language data (a vision-language model, a processor or images) "
            "yet"
        )

    def _unpack_has_metrics(self, given: dict[str, Any]) -> bool:
        """Whether the trainer's arguments ``given`` (by name) compute metrics from evaluation predictions: by default
        a ``compute_metrics`` or ``preprocess_logits_for_metrics`` (evaluation then stays padded, one row per
        example, unless asked otherwise)."""
        return any(given.get(name) is not None for name in ("compute_metrics", "preprocess_logits_for_metrics"))

    # ------------------------------------------------------------------------------------------------ construction

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """TRL's trainer's own arguments (``unpack_trl_class.__init__``'s, by position or by name): the core decides
        before TRL's ``__init__`` runs and enables the packed path after it."""
        bound = inspect.signature(self.unpack_trl_class.__init__).bind(self, *args, **kwargs)
        given = bound.arguments
        given["args"] = self._unpack_before_init(
            given["model"],
            given.get("args"),
            data_collator=given.get("data_collator"),
            processing_class=given.get("processing_class"),
            train_dataset=given.get("train_dataset"),
            eval_dataset=given.get("eval_dataset"),
            peft_config=given.get("peft_config"),
            has_metrics=self._unpack_has_metrics(given),
        )
        self._unpack_trl_init(bound.args[1:], bound.kwargs)
        self._unpack_after_init(given.get("train_dataset"), given.get("eval_dataset"))

    def _unpack_trl_init(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """TRL's own ``__init__`` with the config TRL should see (``args`` / ``kwargs`` as the user passed them)."""
        super().__init__(*args, **kwargs)

    def _unpack_before_init(
        self,
        model: Any,
        args: Any,
        *,
        data_collator: Any,
        processing_class: Any,
        train_dataset: Any,
        eval_dataset: Any,
        peft_config: Any,
        has_metrics: bool,
    ) -> Any:
        """Convert the config, decide, and return the config TRL's ``__init__`` should see (a copy of ours with
        ``packing`` / ``padding_free`` set for TRL's own data path, and batches kept whole when they are packed)."""
        trl_class = self.unpack_trl_class
        _trl_compat.require_methods(trl_class, _trl_compat.TRAINER_METHODS, "transformers.Trainer")
        _trl_compat.require_methods(trl_class, self._unpack_trl_methods, f"trl.{trl_class.__name__}")
        env = os.environ
        self.unpack_stats: dict[str, Any] = {}
        self.unpack_selfcheck: ContaminationReport | None = None
        self._unpack_mode = "stock"
        self._unpack_disabled = env_flag(env, "UNPACK_DISABLE")
        self._unpack_checked = True
        self._unpack_train_prepared = False
        self._unpack_eval_flattened = False
        self._unpack_user_collator = data_collator is not None
        self._unpack_counts: list[TruncationCounts] = []
        self._unpack_sample_loss = False
        self._unpack_batches_whole = False
        self._unpack_sequence_shards = 1
        self._unpack_eval_weights: list[tuple[torch.Tensor, int]] | None = None
        self._unpack_raw = {"train": train_dataset, "eval": eval_dataset}
        if args is not None:
            args = convert_config(args, self.unpack_config_class)
        if self._unpack_disabled:
            self.unpack_decision = decide(args, model_config=None, env=env)
            if args is not None and _loss_normalization(args) != "token":
                log_once(logger, logging.WARNING, "loss_normalization ignored: UNPACK_DISABLE=1 trains as trl does")
            return args
        if args is None:
            args = self._default_args(model)
        if peft_config is None and not isinstance(model, str):
            peft_config = getattr(model, "peft_config", None)
        supported, blocklist = _registry()
        first_example = _first_example(train_dataset)
        model_config = _model_config(model, args)
        decision = decide(
            args,
            model_config=model_config,
            data_collator=data_collator,
            processing_class=processing_class,
            dataset_sample=first_example,
            supported_model_types=supported,
            blocklist=blocklist,
            env=env,
            peft_config=peft_config,
            vision=self._unpack_vision_reason(model_config),
            parallelism=parallelism_reason(
                getattr(args, "parallelism_config", None), env, sequence_parallel=self.unpack_sequence_parallel
            ),
        )
        self.unpack_decision = decision
        self._unpack_args = args
        self._unpack_eval_flattened, self._unpack_eval_note = eval_batches(args, decision, has_metrics=has_metrics)
        trl_args = copy.copy(args)
        if hasattr(trl_args, "padding_free"):
            trl_args.padding_free = False
        if hasattr(trl_args, "packing"):
            trl_args.packing = self._unpack_trl_packs(args, decision, first_example)
        if decision.packed and self.unpack_packs_in == "collator":
            _keep_batches_whole(trl_args, args)
            self._unpack_batches_whole = True
        self._unpack_mode = decision.mode
        return trl_args

    def _default_args(self, model: Any) -> Any:
        name = model if isinstance(model, str) else getattr(model.config, "name_or_path", None) or "model"
        suffix = self.unpack_name.removesuffix("Trainer")
        return self.unpack_config_class(f"{str(name).rstrip('/').split('/')[-1]}-{suffix}")

    def _unpack_after_init(self, train_dataset: Any, eval_dataset: Any) -> None:
        """After TRL's ``__init__``: check what TRL set, log the notes, enable the per-sample loss and the packed
        path, and log the start line."""
        if self._unpack_disabled:
            log_once(
                logger,
                announce_level(),
                f"{self.unpack_name}: UNPACK_DISABLE=1: unpack_trainer is off, this trainer runs exactly as "
                f"trl.{self.unpack_trl_class.__name__} (no packing, no padding-free, no attention patch, no "
                "self-check)",
            )
            return
        _trl_compat.require_attributes(self, _trl_compat.TRAINER_ATTRIBUTES, "transformers.Trainer")
        _trl_compat.require_attributes(self, self._unpack_trl_attributes, f"trl.{self.unpack_trl_class.__name__}")
        if isinstance(self.train_dataset, Dataset) and len(self.train_dataset) == 0:
            total = len(train_dataset) if isinstance(train_dataset, Dataset) else "all"
            raise ValueError(
                f"The training dataset is empty after preparation: all {total} examples were dropped (no trained "
                "token left, e.g. every prompt longer than max_length or every label masked). Raise max_length or "
                "check the labels."
            )
        decision = self.unpack_decision
        args = self._unpack_args
        if decision.mode == "pack" and getattr(args, "padding_free", None) is False:
            log_once(
                logger,
                logging.WARNING,
                "padding_free=False has no effect with packing=True: packed rows are always padding-free (samples "
                "share a row without padding between them, positions restart per sample and attention stays inside "
                "each sample). Set packing=False to train on padded batches, or leave padding_free unset to silence "
                "this.",
            )
        note = neftune_note(args, decision)
        if note is not None:
            log_once(logger, logging.WARNING, note)
        if self._unpack_eval_note is not None and eval_dataset is not None:
            level = logging.INFO if not self._unpack_eval_flattened else logging.WARNING
            log_once(logger, level, self._unpack_eval_note)
        self._enable_sample_loss()
        if decision.packed:
            self._refuse_sequence_splitting()
        if self.unpack_decision.packed:
            self._enable_packed_path()
        self._log_start_line()

    # ------------------------------------------------------------------------------------------------ packed path

    def _refuse_sequence_splitting(self) -> None:
        """The parallelism the accelerator was built with, checked again (an accelerate config file reaches it
        without ``args.parallelism_config``): packed rows it would split are refused (``ValueError``) when asked for,
        and the automatic choice falls back to padded batches, logged with the reason. Under sequence parallelism in
        a trainer that packs there, what the run must hold for its rows to stay exact ([`_sequence_parallel_reason`]),
        and the shards the collator cuts rows for."""
        config = getattr(self.accelerator, "parallelism_config", None)
        reason = parallelism_reason(config, {}, sequence_parallel=self.unpack_sequence_parallel)
        shards = sequence_parallel_size(config, {}) if reason is None else 1
        if reason is None and shards > 1:
            reason = self._sequence_parallel_reason(config, shards)
        if reason is None:
            self._unpack_sequence_shards = shards
            if shards > 1:
                self.unpack_decision = dataclasses.replace(
                    self.unpack_decision,
                    reason=f"{self.unpack_decision.reason}; sequence parallelism (sp_size={shards}, DeepSpeed "
                    "Ulysses): each row cut into that many shards, every shard's attention given the whole row's "
                    "sample boundaries",
                )
            return
        self._refuse_or_pad(reason)

    def _refuse_or_pad(self, reason: str) -> None:
        """``reason`` rules packed rows out: an explicit ``packing=True`` / ``padding_free=True`` is refused
        (``ValueError``), the automatic padding-free falls back to padded batches, logged with the reason; no row is
        cut for sequence parallelism either way."""
        self._unpack_sequence_shards = 1
        if getattr(self._unpack_args, "packing", False):
            raise parallelism_refusal("packing=True", reason)
        if explicit_padding_free(self._unpack_args):
            raise parallelism_refusal("padding_free=True", reason)
        log_once(logger, logging.INFO, f"{self.unpack_name}: automatic padding-free off ({reason})")
        self._fall_back_to_padded(f"automatic padding-free off ({reason})")

    def _sequence_parallel_reason(self, config: Any, shards: int) -> str | None:
        """Why this run cannot pack exactly under DeepSpeed Ulysses with ``shards`` processes per row, or ``None``
        (the model itself is checked once patched, [`unpack_trainer.models.sequence_parallel`])."""
        what = f"sequence parallelism (sp_size={shards}, DeepSpeed Ulysses)"
        if self._unpack_sample_loss:
            return (
                f"{what} with loss_normalization='sample': the engine computes the loss, the token mean over the "
                "sequence-parallel group; use loss_normalization='token'"
            )
        if self.args.per_device_train_batch_size != 1:
            return (
                f"{what} with per_device_train_batch_size={self.args.per_device_train_batch_size}: each batch is one "
                "packed row, cut into shards, and Ulysses expects as many rows as that batch size; set "
                "per_device_train_batch_size=1 (and a longer max_length to fill the row)"
            )
        handler = getattr(config, "sp_handler", None)
        if getattr(handler, "sp_disable_in_eval", True) is False and self.eval_dataset is not None:
            return (
                f"{what} with sp_disable_in_eval=False: transformers' Trainer does not cut evaluation batches, so "
                "every process would take its whole batch for a shard of one row; set "
                "DeepSpeedSequenceParallelConfig(sp_disable_in_eval=True) (the default) to evaluate each batch whole"
            )
        return None

    def _enable_packed_path(self) -> None:
        if self.unpack_packs_in == "collator":
            self.data_collator = self._packed_collator()
        if self._unpack_sequence_shards > 1 and not self.unpack_decision.patch:
            self._refuse_or_pad(
                f"sequence parallelism (sp_size={self._unpack_sequence_shards}, DeepSpeed Ulysses) with a model type "
                "that is not verified: only the patched attention keeps the samples of a cut row apart (stock Ulysses "
                "runs the row as one causal document)"
            )
            return  # padded now
        if self.unpack_decision.patch:
            from unpack_trainer.models import patch_model, resolve_backend

            # An impossible UNPACK_ATTENTION_BACKEND raises here, naming the variable.
            resolve_backend(self.model, compute_dtype=_autocast_dtype(self.args))
            for model in self._unpack_models():
                # torch_compile=True: the packed metadata is planned on the host before the compiled layers.
                patch_model(model, compiled=bool(getattr(self.args, "torch_compile", False)))
            if self._unpack_sequence_shards > 1 and self._refuse_model_under_sequence_parallelism():
                return  # padded now
        self._unpack_checked = False  # the self-check runs right before the first data loader is built

    def _refuse_model_under_sequence_parallelism(self) -> bool:
        """The patched model under Ulysses ([`unpack_trainer.models.sequence_parallel.sequence_parallel_reason`]):
        refused (``ValueError``, the model unpatched), or padded for the automatic padding-free (returns ``True``),
        with the reason; ``False`` where it is exact."""
        from unpack_trainer.models import unpatch_model
        from unpack_trainer.models.sequence_parallel import sequence_parallel_reason

        shards = self._unpack_sequence_shards
        why = sequence_parallel_reason(self.model, shards)
        if why is None:
            return False
        try:
            self._refuse_or_pad(f"sequence parallelism (sp_size={shards}, DeepSpeed Ulysses): {why}")
        except ValueError:
            for model in self._unpack_models():
                unpatch_model(model)
            raise
        return True

    def _unpack_batch_collator(self) -> Any:
        """The collator that builds this trainer's batches, under what the core puts around it (evaluation's count of
        dataset items per batch)."""
        collator = self.data_collator
        return collator.collator if isinstance(collator, _ItemCountingCollator) else collator

    def get_train_dataloader(self) -> Any:
        self._unpack_check_before_first_batch()
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        self._unpack_check_before_first_batch()
        if eval_dataset is None or isinstance(eval_dataset, str):
            named = self.eval_dataset
            dataset = named[eval_dataset] if isinstance(eval_dataset, str) and isinstance(named, dict) else named
        else:
            dataset = eval_dataset
        with self._unpack_eval_collator(dataset):
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        self._unpack_check_before_first_batch()
        with self._unpack_eval_collator(test_dataset):
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _unpack_eval_collator(self, dataset: Any) -> Iterator[None]:
        """Evaluation batches padded (one row per example) when [`eval_batches`] said so, flattened otherwise; and
        counted (each batch carries its number of dataset items) when transformers would weigh them wrongly: a
        dataset without a length read without batch dispatching (accelerate cannot know the short last batch), or
        ``loss_normalization="sample"`` (a batch weighs its samples, not its rows)."""
        collator = self.data_collator
        if self.unpack_decision.packed and not self._unpack_eval_flattened and self.unpack_packs_in == "collator":
            self.data_collator = self._padded_collator()
        streamed = self._unpack_batches_whole and not has_length(dataset)
        if streamed or self._unpack_sample_loss:
            self.data_collator = _ItemCountingCollator(self.data_collator)
        try:
            yield
        finally:
            self.data_collator = collator

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, with ``eval_loss`` the mean of the batch losses weighed by what each batch holds when its
        batches were counted ([`_unpack_eval_collator`]): its dataset items (what transformers weighs by, but it
        counts a short last batch of a stream as full), or with ``loss_normalization="sample"`` its samples with a
        trained token (a packed row holds several). Non-finite batch losses are left out as transformers does
        (``logging_nan_inf_filter``). Across processes, the sums are added up."""
        self._unpack_eval_weights = []
        try:
            output = super().evaluation_loop(*args, **kwargs)
            recorded = self._unpack_eval_weights
        finally:
            self._unpack_eval_weights = None
        prefix = _trl_compat.evaluation_loop_argument(args, kwargs, "metric_key_prefix")
        key = f"{prefix}_loss"
        if recorded and key in output.metrics:
            losses = torch.stack([loss for loss, _ in recorded]).double()
            weights = torch.tensor([weight for _, weight in recorded], dtype=torch.float64, device=losses.device)
            finite = torch.isfinite(losses)
            if self.args.logging_nan_inf_filter and bool(finite.any()):
                losses, weights = losses[finite], weights[finite]
            totals = torch.stack([(losses * weights).sum(), weights.sum()]).to(self.args.device)
            if self.accelerator.num_processes > 1:
                totals = self.accelerator.reduce(totals, reduction="sum")
            output.metrics[key] = float(totals[0] / totals[1].clamp(min=1))
        return output

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> Any:
        """The parent's, after taking the batch's item count off ``inputs`` (see [`evaluation_loop`])."""
        items = inputs.pop(EVAL_ITEMS_KEY, None) if isinstance(inputs, dict) else None
        output = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        loss = output[0]
        if items is not None and loss is not None and self._unpack_eval_weights is not None:
            weight = self._count_samples(inputs) if self._unpack_sample_loss else items
            self._unpack_eval_weights.append((loss.detach().float().mean(), weight))
        return output

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The parent's step, with LoRA's input casts that are exact round trips under autocast skipped
        ([`unpack_trainer.trainers.lora_casts`]: bit-identical, two activation-sized copies fewer per LoRA layer
        and call; the trainers that generate inside their step, GRPO / RLOO, generate with PEFT's own path:
        [`_unpack_peft_lora_path`]); as the parent's under ``UNPACK_DISABLE=1`` and under ``torch_compile=True``
        (dynamo would inline the per-step hooks into a graph that outlives the step)."""
        if self._unpack_disabled or getattr(self.args, "torch_compile", False):
            return super().training_step(model, inputs, *args, **kwargs)
        cached = getattr(self, "_unpack_lora_layers", None)
        if cached is None or cached[0] is not model:
            cached = self._unpack_lora_layers = (model, plain_lora_layers(model))
        skip = lora_input_casts_skipped(cached[1])
        with skip:
            self._unpack_lora_skip = skip
            try:
                return super().training_step(model, inputs, *args, **kwargs)
            finally:
                self._unpack_lora_skip = None

    def _unpack_peft_lora_path(self) -> contextlib.AbstractContextManager:
        """Within a training step, a context in which every LoRA layer runs PEFT's own path (the skip of
        [`training_step`] paused); outside a step, nothing."""
        skip = getattr(self, "_unpack_lora_skip", None)
        return contextlib.nullcontext() if skip is None else skip.paused()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            for counts in self._unpack_counts:
                if counts.read:
                    log_once(logger, logging.WARNING if counts.changed else logging.INFO, counts.summary())

    def _unpack_check_before_first_batch(self) -> None:
        """Run the contamination self-check once, on ``self.model`` as it is when its first data loader is built
        (``train()`` has applied liger kernels, loaded a checkpoint, ... by then), and fall back to padded batches
        before any batch is drawn if it fails."""
        if self._unpack_checked:
            return
        self._unpack_checked = True
        with self._unpack_training_precision():
            report = check_uncontaminated(self.model, measure_contamination=False)
        self.unpack_selfcheck = report
        if report.ok:
            if not report.conclusive:
                log_once(logger, logging.WARNING, f"Self-check inconclusive on this model: {report.summary()}")
            log_once(logger, logging.INFO, f"Contamination self-check passed: {report.summary()}")
            if getattr(self.args, "use_liger_kernel", False):
                self._log_liger_note()
            return
        what = report.failure()
        self._unpack_self_check_failed(f"Contamination self-check failed ({what}); training padded instead")
        self._fall_back_to_padded(f"contamination self-check failed: {what}")

    def _unpack_training_precision(self) -> contextlib.AbstractContextManager:
        """The precision training runs the model's forward in, for the self-check to run exactly so: accelerate's
        autocast of this trainer's mixed precision (``bf16=True`` / ``fp16=True`` with float32 weights: the forward
        computes in bf16 / fp16, and the check judges it by that dtype's tolerance); a no-op without mixed
        precision."""
        return self.accelerator.autocast()

    def _log_liger_note(self) -> None:
        """With ``use_liger_kernel=True`` (Liger's kernels applied by now): one line on whose RoPE, per-token kernels,
        attention and loss run ([`unpack_trainer.trainers.liger.liger_note`])."""
        from accelerate.utils import is_peft_model

        from unpack_trainer.trainers.liger import liger_note

        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if is_peft_model(model) else model
        attention = _attention_backend(model, self.unpack_decision.patch, self.args)
        note = liger_note(model, attention=attention, loss_kernel=getattr(self, "unpack_loss_kernel", None))
        log_once(logger, logging.INFO, f"{self.unpack_name}: {note}")

    @staticmethod
    def _unpack_self_check_failed(message: str) -> None:
        """A failed self-check, before its fallback: raise ``message`` under ``UNPACK_STRICT=1``, else log it once as
        an error."""
        if env_flag(os.environ, "UNPACK_STRICT"):
            raise RuntimeError(message + " (UNPACK_STRICT=1)")
        log_once(logger, logging.ERROR, message)

    def _fall_back_to_padded(self, reason: str = "contamination self-check failed") -> None:
        if self.unpack_decision.patch:
            from unpack_trainer.models import unpatch_model

            for model in self._unpack_models():
                unpatch_model(model)
        self.unpack_decision = PackingDecision("padded", reason, automatic=True)
        self._unpack_mode = "padded"
        if self.unpack_packs_in == "collator":
            self.data_collator = self._padded_collator()
        self._prepare_padded_datasets(self._unpack_raw["train"], self._unpack_raw["eval"])

    def _log_start_line(self) -> None:
        """One line, once, on the main process: the decision, its reason and the training set's statistics, at the
        level a user sees by default (:func:`~unpack_trainer._logging.announce_level`: silenced by ``log_level`` /
        transformers' verbosity above WARNING); WARNING whenever a request (packing / padding-free) was overridden."""
        decision = self.unpack_decision
        stats = self.unpack_stats
        parts = [f"mode={decision.mode}", f"reason: {decision.reason}"]
        if decision.packed:
            parts.append(f"attention={_attention_backend(self.model, decision.patch, self.args)}")
        if stats.get("samples"):
            parts.append(f"samples={stats['samples']:,}")
            if "rows" in stats:
                parts.append(f"rows={stats['rows']:,}")
                parts.append(f"packing efficiency={stats['efficiency']:.2%}")
            if "estimated_speedup" in stats:
                parts.append(
                    f"estimated speedup vs padded batches of {stats['padded_batch_size']:.3g} samples="
                    f"{stats['estimated_speedup']:.2f}x (token count)"
                )
        if decision.packed:
            parts.append("the contamination self-check runs when training starts")
        level = logging.WARNING if decision.overridden_request else announce_level()
        log_once(logger, level, f"{self.unpack_name}: " + ", ".join(parts))

    # ------------------------------------------------------------------------------------------------ step composition

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """With ``balance_samples_per_step`` and packed rows: a sampler whose optimizer steps hold balanced numbers of
        samples ([`unpack_trainer.data.sampler.balanced_step_order`]); otherwise the Trainer's own sampler."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        args = self.args
        if (
            self._unpack_mode == "pack"
            and getattr(args, "balance_samples_per_step", False)
            and isinstance(dataset, Dataset)
            and SEQ_LENGTHS_COLUMN in dataset.column_names
        ):
            strategy = getattr(args, "train_sampling_strategy", "random")
            if strategy != "random":
                log_once(
                    logger,
                    logging.WARNING,
                    f"train_sampling_strategy={strategy!r} is used as set, so packed rows are not composed into "
                    "balanced steps (balance_samples_per_step); set train_sampling_strategy='random' for balanced "
                    "steps, or balance_samples_per_step=False to silence this.",
                )
                return super()._get_train_sampler(train_dataset)
            rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
            # as transformers does: `data_seed` seeds the data order when set, `seed` otherwise
            seed = args.data_seed if args.data_seed is not None else args.seed
            costs = None
            if args.world_size > 1:
                ratio = getattr(args, "attention_cost_ratio", None)
                if ratio is None:
                    ratio = attention_cost_ratio(getattr(self.model, "config", None)) or 0.0
                costs = row_costs(dataset[SEQ_LENGTHS_COLUMN], ratio)
            return BalancedStepSampler(
                samples_per_row(dataset),
                rows_per_step,
                seed=seed,
                num_ranks=args.world_size,
                batch_size=args.per_device_train_batch_size,
                costs=costs,
            )
        return super()._get_train_sampler(train_dataset)

    # ------------------------------------------------------------------------------------------------ loss

    def _enable_sample_loss(self) -> None:
        """``loss_normalization="sample"``: the per-sample loss and its count per step; ``"token"``: the trainer's
        [`_enable_token_loss`]."""
        if _loss_normalization(self.args) != "sample":
            self._enable_token_loss()
            return
        self._check_sample_loss()
        self._unpack_sample_loss = True
        if self.loss_is_scaled_for_ga is None:
            self.loss_is_scaled_for_ga = True  # divided by the samples of the whole accumulated step

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """The Trainer's, but with ``loss_normalization="sample"`` the count returned is that of the samples with a
        trained token in the whole accumulated step (all processes when ``average_tokens_across_devices``)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._unpack_sample_loss and batch_samples:
            count = torch.tensor(sum(self._count_samples(batch) for batch in batch_samples), device=device)
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                count = self.accelerator.gather(count).sum()
            num_items_in_batch = count
        return batch_samples, num_items_in_batch
