"""The packed path of one trainer run: decided before TRL's ``__init__`` ([`decide_run`]), enabled after it
([`after_init`], [`enable_packed_path`]), given up for TRL's padded batches when something rules it out
([`fall_back_to_padded`]); and the sampler of packed rows ([`balanced_sampler`]).

The core ([`unpack_trainer.trainers._packed.PackedTrainerMixin`]) calls these with the trainer; what differs between
trainers reaches them through the trainer's hooks ([`unpack_trainer.trainers.hooks.TrainerHooks`]: its collators,
its models, what TRL's data path should pack, ...). Everything they decide is kept on the trainer's run state
([`unpack_trainer.trainers.run_state.RunState`], ``trainer.unpack_run``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Any

from datasets import Dataset
from transformers import AutoConfig

from unpack_trainer import _trl_compat
from unpack_trainer._logging import announce_level, log_once
from unpack_trainer.configs import convert_config
from unpack_trainer.data.preparation import samples_per_row
from unpack_trainer.data.sampler import BalancedStepSampler, attention_cost_ratio, row_costs
from unpack_trainer.decision import PackingDecision, decide, env_flag, eval_batches, neftune_note, parallelism_reason
from unpack_trainer.packed_seq_info import SEQ_LENGTHS_COLUMN
from unpack_trainer.trainers import sequence_parallel
from unpack_trainer.trainers.loss import enable_loss_normalization, loss_normalization
from unpack_trainer.trainers.start_line import autocast_dtype, log_start_line

__all__ = [
    "after_init",
    "balanced_sampler",
    "decide_run",
    "empty_train_dataset_error",
    "enable_packed_path",
    "fall_back_to_padded",
    "verified_model_types",
]

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


def verified_model_types() -> tuple[frozenset[str], dict[str, str]]:
    """The model types the patch is verified on, and the blocked ones with their reasons (what the decision reads)."""
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


def _default_args(trainer: Any, model: Any) -> Any:
    """The config of a trainer built without one: the trainer's config class at its defaults, its output directory
    named after the model and the trainer (``SmolLM2-135M-SFT``)."""
    name = model if isinstance(model, str) else getattr(model.config, "name_or_path", None) or "model"
    suffix = trainer.unpack_name.removesuffix("Trainer")
    return trainer.unpack_config_class(f"{str(name).rstrip('/').split('/')[-1]}-{suffix}")


def decide_run(
    trainer: Any,
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
    """Before TRL's ``__init__``: check TRL's names, build ``trainer.unpack_run`` (the trainer's ``unpack_run_class``),
    convert the config, decide, and return the config TRL's ``__init__`` should see (a copy of ours with ``packing`` /
    ``padding_free`` set for TRL's own data path, and batches kept whole when they are packed). The arguments are
    TRL's trainer's, as the user passed them."""
    trl_class = trainer.unpack_trl_class
    _trl_compat.require_methods(trl_class, _trl_compat.TRAINER_METHODS, "transformers.Trainer")
    _trl_compat.require_methods(trl_class, trainer.unpack_trl_methods, f"trl.{trl_class.__name__}")
    env = os.environ
    trainer.unpack_run = run = trainer.unpack_run_class(
        disabled=env_flag(env, "UNPACK_DISABLE"), raw_train=train_dataset, raw_eval=eval_dataset
    )
    if args is not None:
        args = convert_config(args, trainer.unpack_config_class)
    if run.disabled:
        run.decision, run.args = decide(args, model_config=None, env=env), args
        if args is not None and loss_normalization(args) != "token":
            log_once(logger, logging.WARNING, "loss_normalization ignored: UNPACK_DISABLE=1 trains as trl does")
        return args
    if args is None:
        args = _default_args(trainer, model)
    if peft_config is None and not isinstance(model, str):
        peft_config = getattr(model, "peft_config", None)
    supported, blocklist = verified_model_types()
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
        vision=trainer._unpack_vision_reason(model_config),
        parallelism=parallelism_reason(
            getattr(args, "parallelism_config", None), env, sequence_parallel=trainer.unpack_sequence_parallel
        ),
    )
    if decision.mode == "pack" and trainer.unpack_packing_means is not None:
        decision = dataclasses.replace(decision, reason=f"packing=True: {trainer.unpack_packing_means}")
    run.decision, run.args = decision, args
    run.eval_flattened, run.eval_note = eval_batches(args, decision, has_metrics=has_metrics)
    trl_args = copy.copy(args)
    if hasattr(trl_args, "padding_free"):
        trl_args.padding_free = False
    if hasattr(trl_args, "packing"):
        trl_args.packing = trainer._unpack_trl_packs(args, decision, first_example)
    if decision.packed and trainer.unpack_packs_in == "collator":
        _keep_batches_whole(trl_args, args)
        run.batches_whole = True
    return trl_args


def after_init(trainer: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """After TRL's ``__init__``: check what TRL set, log the notes, enable the loss normalization and the packed path
    (the trainer's ``_enable_packed_path``, once the parallelism is checked), and log the start line."""
    run = trainer.unpack_run
    trl_name = f"trl.{trainer.unpack_trl_class.__name__}"
    if run.disabled:
        log_once(
            logger,
            announce_level(),
            f"{trainer.unpack_name}: UNPACK_DISABLE=1: unpack_trainer is off, this trainer runs exactly as {trl_name} "
            "(no packing, no padding-free, no attention patch, no self-check)",
        )
        return
    _trl_compat.require_attributes(trainer, _trl_compat.TRAINER_ATTRIBUTES, "transformers.Trainer")
    _trl_compat.require_attributes(trainer, trainer.unpack_trl_attributes, trl_name)
    if isinstance(trainer.train_dataset, Dataset) and len(trainer.train_dataset) == 0:
        total = len(train_dataset) if isinstance(train_dataset, Dataset) else "all"
        raise ValueError(
            f"The training dataset is empty after preparation: all {total} examples were dropped (no trained "
            "token left, e.g. every prompt longer than max_length or every label masked). Raise max_length or "
            "check the labels."
        )
    decision, args = run.decision, run.args
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
    if run.eval_note is not None and eval_dataset is not None:
        log_once(logger, logging.WARNING if run.eval_flattened else logging.INFO, run.eval_note)
    enable_loss_normalization(trainer)
    if decision.packed:
        sequence_parallel.check_parallelism(trainer)
    if run.decision.packed:
        trainer._enable_packed_path()
    log_start_line(trainer)


def enable_packed_path(trainer: Any) -> None:
    """The core's packed path on ``trainer``: its packed collator (a trainer whose collator packs), every model of its
    ``_unpack_models`` patched where the decision patches (an impossible ``UNPACK_ATTENTION_BACKEND`` raises here),
    what sequence parallelism refuses checked, and the self-check armed to run before the first batch."""
    run = trainer.unpack_run
    if trainer.unpack_packs_in == "collator":
        trainer.data_collator = trainer._packed_collator()
    if sequence_parallel.refuse_unpatched(trainer):
        return  # padded now
    if run.decision.patch:
        from unpack_trainer.models import patch_model, resolve_backend

        resolve_backend(trainer.model, compute_dtype=autocast_dtype(trainer.args))
        for model in trainer._unpack_models():
            # torch_compile=True: the packed metadata is planned on the host before the compiled layers.
            patch_model(model, compiled=bool(getattr(trainer.args, "torch_compile", False)))
        if sequence_parallel.refuse_model(trainer):
            return  # padded now
    run.checked = False  # the self-check runs right before the first data loader is built


def fall_back_to_padded(trainer: Any, reason: str) -> None:
    """Give the packed path up for TRL's padded batches, with ``reason``: every model of the trainer's
    ``_unpack_models`` unpatched, the decision ``"padded"``, the padded collator back (a trainer whose collator packs)
    and the raw datasets prepared again (the trainer's ``_prepare_padded_datasets``)."""
    run = trainer.unpack_run
    if run.decision.patch:
        from unpack_trainer.models import unpatch_model

        for model in trainer._unpack_models():
            unpatch_model(model)
    run.decision = PackingDecision("padded", reason, automatic=True)
    if trainer.unpack_packs_in == "collator":
        trainer.data_collator = trainer._padded_collator()
    trainer._prepare_padded_datasets(run.raw_train, run.raw_eval)


def balanced_sampler(trainer: Any, dataset: Any) -> Any:
    """With ``balance_samples_per_step`` and rows packed ahead (a ``Dataset`` with a ``seq_lengths`` column): a sampler
    whose optimizer steps hold balanced numbers of samples ([`unpack_trainer.data.sampler.BalancedStepSampler`]);
    ``None`` where the Trainer's own sampler draws (logged once where a ``train_sampling_strategy`` keeps it)."""
    args = trainer.args
    if not (
        trainer.unpack_decision.mode == "pack"
        and getattr(args, "balance_samples_per_step", False)
        and isinstance(dataset, Dataset)
        and SEQ_LENGTHS_COLUMN in dataset.column_names
    ):
        return None
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy != "random":
        log_once(
            logger,
            logging.WARNING,
            f"train_sampling_strategy={strategy!r} is used as set, so packed rows are not composed into "
            "balanced steps (balance_samples_per_step); set train_sampling_strategy='random' for balanced "
            "steps, or balance_samples_per_step=False to silence this.",
        )
        return None
    rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    # as transformers does: `data_seed` seeds the data order when set, `seed` otherwise
    seed = args.data_seed if args.data_seed is not None else args.seed
    costs = None
    if args.world_size > 1:
        ratio = getattr(args, "attention_cost_ratio", None)
        if ratio is None:
            ratio = attention_cost_ratio(getattr(trainer.model, "config", None)) or 0.0
        costs = row_costs(dataset[SEQ_LENGTHS_COLUMN], ratio)
    return BalancedStepSampler(
        samples_per_row(dataset),
        rows_per_step,
        seed=seed,
        num_ranks=args.world_size,
        batch_size=args.per_device_train_batch_size,
        costs=costs,
    )
