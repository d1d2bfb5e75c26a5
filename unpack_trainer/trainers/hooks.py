"""What differs between the packed trainers: the declarations and hooks a trainer built on the core implements.

[`TrainerHooks`] is the contract between the core ([`unpack_trainer.trainers._packed.PackedTrainerMixin`], which holds
the ``Trainer`` methods it overrides) and a trainer: class attributes that declare what the trainer is, and hooks with
defaults, each one short. What the hooks start is done by the core's collaborators, which a trainer's hook may call
too: [`unpack_trainer.trainers.packed_path`] (the decision before TRL's ``__init__``, the packed path after it, the
padded fallback), [`unpack_trainer.trainers.contamination`], [`unpack_trainer.trainers.sequence_parallel`],
[`unpack_trainer.trainers.loss`], [`unpack_trainer.trainers.evaluation`] and
[`unpack_trainer.trainers.start_line`]; what a run decides and keeps is its run state
([`unpack_trainer.trainers.run_state.RunState`], ``trainer.unpack_run``).

The hooks, what differs between SFT, DPO, GRPO, ...:

- [`_unpack_before_init`] / [`_enable_packed_path`] / [`_fall_back_to_padded`]: the decision before TRL's
  ``__init__``, the packed path after it, the padded fallback (a trainer adds to the core's);
- [`_unpack_trl_init`]: TRL's own ``__init__``; [`_unpack_trl_packs`]: the ``packing`` TRL's data path sees;
- [`_unpack_has_metrics`]: whether evaluation computes metrics from predictions (they then see one row per example);
- [`_packed_collator`] / [`_padded_collator`]: the collators of packed training and of padded batches (trainers
  whose collator packs, ``unpack_packs_in = "collator"``; a trainer that packs inside its step, ``"step"``, keeps
  TRL's collator and needs neither);
- [`_prepare_padded_datasets`]: prepare the raw datasets again as padded (the fallback); by default nothing, for
  trainers whose padded and packed batches come from the same prepared data;
- [`_count_samples`] / [`_check_sample_loss`] / [`_enable_token_loss`]: ``loss_normalization`` (the samples with a
  trained token in one collated batch; whether ``"sample"`` can be honoured; what ``"token"`` needs beyond TRL's);
- [`_unpack_models`]: the models the packed path patches (default: the policy); the fallback unpatches them all;
- [`_unpack_vision_reason`]: why vision-language data stays padded; [`_sequence_parallel_reason`]: why this run
  cannot pack under sequence parallelism;
- [`_unpack_check_before_first_batch`] / [`_unpack_training_precision`]: the self-check, in training's precision;
- [`unpack_data_columns`]: the dataset columns the command line checks.
"""

from __future__ import annotations

import contextlib
from typing import Any

from unpack_trainer.decision import PackingDecision
from unpack_trainer.trainers import contamination, packed_path, sequence_parallel

__all__ = ["TrainerHooks"]


class TrainerHooks:
    """The declarations and hooks of a packed trainer (see the module docstring); the base of the core.

    Class attributes: ``unpack_config_class`` (our config class, e.g. [`unpack_trainer.SFTConfig`]; any other
    ``TrainingArguments`` is converted to it; declaring it makes a class one of the package's trainers, which takes its
    own name as ``unpack_name``, the start line's prefix, and the TRL trainer class it derives from as
    ``unpack_trl_class``, whose private names [`unpack_trainer._trl_compat`] checks), ``unpack_packs_in``,
    ``unpack_packs_vision``, ``unpack_sequence_parallel``, ``unpack_packing_means`` and ``unpack_run_class`` (below).
    The core reads from the config only what it has: TRL's fields the decision reads (``packing``, ``padding_free``, ``max_length``, ...) and
    ours (``loss_normalization``, ``balance_samples_per_step``; see [`unpack_trainer.SFTConfig`] for their meaning; a
    config without them trains with TRL's token loss and TRL's sampler).
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
    # carry the whole row's boundaries to every shard (SFT, DPO; GRPO and RLOO cut the rows of their step); elsewhere
    # `sp_size > 1` is refused like context parallelism.
    unpack_sequence_parallel: bool = False
    # What packing=True does in this trainer, where it differs from packing a dataset ahead (DPO: "the pairs of each
    # batch in one packed row"): said as the decision's reason.
    unpack_packing_means: str | None = None
    unpack_trl_methods: tuple[str, ...] = ()  # private methods of the TRL class the subclass relies on
    unpack_trl_attributes: tuple[str, ...] = ()  # attributes TRL's __init__ sets that the subclass reads

    # ------------------------------------------------------------------------------------------------ construction

    def _unpack_before_init(self, model: Any, args: Any, **arguments: Any) -> Any:
        """Before TRL's ``__init__``: the run state built, the config converted, the decision made; returns the config
        TRL's ``__init__`` should see ([`unpack_trainer.trainers.packed_path.decide_run`]; ``arguments``:
        ``data_collator``, ``processing_class``, ``train_dataset``, ``eval_dataset``, ``peft_config``,
        ``has_metrics``)."""
        return packed_path.decide_run(self, model, args, **arguments)

    def _unpack_trl_init(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """TRL's own ``__init__`` with the config TRL should see (``args`` / ``kwargs`` as the user passed them)."""
        super().__init__(*args, **kwargs)

    def _unpack_trl_packs(self, args: Any, decision: PackingDecision, first_example: dict[str, Any] | None) -> bool:
        """The ``packing`` TRL's ``__init__`` sees (its data path packs when it is ``True``): the user's, where TRL's
        own path runs (``"stock"``) or the trainer packs through it (``"pack"``); ``False`` otherwise."""
        return bool(args.packing) and decision.mode in ("pack", "stock")

    def _unpack_has_metrics(self, given: dict[str, Any]) -> bool:
        """Whether the trainer's arguments ``given`` (by name) compute metrics from evaluation predictions: by default
        a ``compute_metrics`` or ``preprocess_logits_for_metrics`` (evaluation then stays padded, one row per
        example, unless asked otherwise)."""
        return any(given.get(name) is not None for name in ("compute_metrics", "preprocess_logits_for_metrics"))

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

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """The column sets a training or evaluation dataset of this trainer is read by, in TRL's order of precedence
        (``unpack-trainer <command>`` checks a data file's rows against them before training); empty: not checked."""
        return ()

    # ------------------------------------------------------------------------------------------------ packed path

    def _enable_packed_path(self) -> None:
        """The packed path after TRL's ``__init__`` (the decision packs): the packed collator, the patch, the
        self-check armed ([`unpack_trainer.trainers.packed_path.enable_packed_path`])."""
        packed_path.enable_packed_path(self)

    def _fall_back_to_padded(self, reason: str = "contamination self-check failed") -> None:
        """TRL's padded batches from now on, with ``reason``
        ([`unpack_trainer.trainers.packed_path.fall_back_to_padded`])."""
        packed_path.fall_back_to_padded(self, reason)

    def _unpack_models(self) -> list[Any]:
        """The models the packed path patches (the policy; trainers with a reference model add it), unwrapped."""
        return [self.accelerator.unwrap_model(self.model)]

    def _packed_collator(self) -> Any:
        """The collator of packed (and padding-free) batches."""
        raise NotImplementedError(f"{type(self).__name__} must implement _packed_collator")

    def _padded_collator(self) -> Any:
        """The collator of padded batches (one row per example): padded evaluation and the padded fallback."""
        raise NotImplementedError(f"{type(self).__name__} must implement _padded_collator")

    def _prepare_padded_datasets(self, raw_train: Any, raw_eval: Any) -> None:
        """Prepare the raw datasets again for padded batches (``self.unpack_decision`` is already ``"padded"``); by
        default nothing: padded and packed batches are made from the same prepared data."""

    def _sequence_parallel_reason(self, config: Any, shards: int) -> str | None:
        """Why this run cannot pack exactly under DeepSpeed Ulysses with ``shards`` processes per row, or ``None``
        ([`unpack_trainer.trainers.sequence_parallel.run_reason`]; ``config``: accelerate's ``ParallelismConfig``)."""
        return sequence_parallel.run_reason(self, config, shards)

    # ------------------------------------------------------------------------------------------------ self-check

    def _unpack_check_before_first_batch(self) -> None:
        """The contamination self-check, once, right before the first data loader is built, and its fallback
        ([`unpack_trainer.trainers.contamination.check_before_first_batch`])."""
        contamination.check_before_first_batch(self)

    def _unpack_training_precision(self) -> contextlib.AbstractContextManager:
        """The precision training runs the model's forward in, for the self-check to run exactly so: accelerate's
        autocast of this trainer's mixed precision (``bf16=True`` / ``fp16=True`` with float32 weights: the forward
        computes in bf16 / fp16, and the check judges it by that dtype's tolerance); a no-op without mixed
        precision."""
        return self.accelerator.autocast()

    # ------------------------------------------------------------------------------------------------ loss

    def _count_samples(self, batch: dict[str, Any]) -> int:
        """The samples with at least one trained token in one collated batch (``loss_normalization="sample"``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _count_samples")

    def _check_sample_loss(self) -> None:
        """Raise ``ValueError`` if ``loss_normalization="sample"`` is not supported with this configuration."""

    def _enable_token_loss(self) -> None:
        """With ``loss_normalization="token"`` (not under ``UNPACK_DISABLE=1``): make the loss of an optimizer step the
        mean over every trained token of the step (all its micro-batches and processes) where the TRL trainer's own
        loss would not be; by default nothing (the TRL trainer's loss is kept as it is)."""
