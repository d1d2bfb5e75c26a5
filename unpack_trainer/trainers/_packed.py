"""The packed-trainer core: the ``Trainer`` methods a packed trainer overrides, each handing its work to the core's
collaborators.

[`PackedTrainerMixin`] goes in front of a TRL trainer class (``class SFTTrainer(PackedTrainerMixin, trl.SFTTrainer)``).
It holds the methods transformers' ``Trainer`` and TRL call (``__init__``, the data loaders, the training and
evaluation steps, the sampler) and nothing else: what it does around them is in the modules beside it,

- [`unpack_trainer.trainers.packed_path`]: the packing decision ([`unpack_trainer.decision.decide`]) and the config
  conversion before TRL's ``__init__``, the environment switches (``UNPACK_DISABLE``, ...), the packed path (collator,
  attention patch) after it, the padded fallback, the balanced-step sampler;
- [`unpack_trainer.trainers.contamination`]: the contamination self-check right before the first data loader is built
  (``UNPACK_STRICT``);
- [`unpack_trainer.trainers.sequence_parallel`]: what the parallelism the run is under allows;
- [`unpack_trainer.trainers.loss`]: ``loss_normalization`` and the per-sample count of a step;
- [`unpack_trainer.trainers.evaluation`]: the padded evaluation collator and ``eval_loss`` weighed per batch;
- [`unpack_trainer.trainers.start_line`]: the line that says what was decided;

and what a run decides and keeps is one object, its run state ([`unpack_trainer.trainers.run_state.RunState`],
``trainer.unpack_run``). What differs between trainers (their collators, their models, their data columns, ...) are the
declarations and hooks of [`unpack_trainer.trainers.hooks.TrainerHooks`], the core's base. Trainers whose prompts are
shared by several completions (DPO's pairs, GRPO's groups) build on
[`unpack_trainer.trainers.branched.BranchedTrainerMixin`], this core plus the prompt-sharing pieces.

The core's ``__init__`` takes exactly the arguments of its TRL trainer's (bound to that ``__init__``'s signature,
whatever it is), decides (the ``_unpack_before_init`` hook), runs TRL's ``__init__`` with the config TRL should see
(``_unpack_trl_init``) and enables the packed path ([`unpack_trainer.trainers.packed_path.after_init`]); a trainer
built on it writes no ``__init__``.
"""

from __future__ import annotations

import inspect
from typing import Any

from unpack_trainer import _trl_compat
from unpack_trainer.trainers import evaluation, loss, packed_path
from unpack_trainer.trainers.hooks import TrainerHooks
from unpack_trainer.trainers.lora_casts import lora_input_casts_skipped, plain_lora_layers
from unpack_trainer.trainers.run_state import RunField, RunState

__all__ = ["PackedTrainerMixin"]


class PackedTrainerMixin(TrainerHooks):
    """The packed-trainer core, in front of a TRL trainer class; see the module docstring for its collaborators and
    [`TrainerHooks`] for what a trainer built on it declares and implements.

    What every trainer built on it does, whatever its batches: with ``padding_free`` unset (our configs' default; a
    plain TRL config is converted, and a ``False`` there counts as unset since it cannot be told from TRL's default)
    the packed path turns on by itself wherever the model, the collator and the data allow it, and the decision is
    logged once with its reason; ``padding_free=False`` trains exactly as TRL; ``UNPACK_DISABLE=1`` makes the class
    behave exactly as its TRL trainer. A contamination self-check runs on the model as it will train, right before the
    first batch, and the trainer falls back to TRL's padded batches if it fails (``UNPACK_STRICT=1`` raises).

    Attributes:
        unpack_run (`RunState`): what this run decided and keeps (the class ``unpack_run_class``: [`RunState`], or a
            trainer's subclass of it).
        unpack_decision (`PackingDecision`): what was decided and why (after a failed self-check: ``"padded"``).
        unpack_stats (`dict`): samples, rows, real tokens, packing efficiency and the estimated speedup
            ([`unpack_trainer.data.estimate`]) for the training set; for a streamed training set, the truncation counts
            (``"truncation"``) as they are read (an image dataset's: its text cut after the last image token, up front
            when packed ahead).
        unpack_selfcheck (`ContaminationReport` or `None`): the self-check's result, once training or evaluation has
            started (``None`` before, and when nothing is packed).
    """

    unpack_run_class: type[RunState] = RunState
    unpack_run: RunState
    unpack_decision = RunField("decision")
    unpack_stats = RunField("stats")
    unpack_selfcheck = RunField("selfcheck")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A trainer class that declares its config (``unpack_config_class`` in its own body) takes its own name as
        ``unpack_name`` and the TRL trainer class it derives from as ``unpack_trl_class``; a user's subclass that
        declares no config inherits both."""
        super().__init_subclass__(**kwargs)
        if "unpack_config_class" not in cls.__dict__:
            return
        cls.unpack_name = cls.__name__
        cls.unpack_trl_class = next(base for base in cls.__mro__ if base.__module__.split(".")[0] == "trl")

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
        packed_path.after_init(self, given.get("train_dataset"), given.get("eval_dataset"))

    # ------------------------------------------------------------------------------------------------ data loaders

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
        with evaluation.eval_collator(self, dataset):
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        self._unpack_check_before_first_batch()
        with evaluation.eval_collator(self, test_dataset):
            return super().get_test_dataloader(test_dataset)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """With ``balance_samples_per_step`` and packed rows: a sampler whose optimizer steps hold balanced numbers of
        samples ([`unpack_trainer.trainers.packed_path.balanced_sampler`]); otherwise the Trainer's own sampler."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        sampler = packed_path.balanced_sampler(self, dataset)
        return super()._get_train_sampler(train_dataset) if sampler is None else sampler

    # ------------------------------------------------------------------------------------------------ evaluation

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, with ``eval_loss`` the mean of the batch losses weighed by what each batch holds when its
        batches were counted ([`unpack_trainer.trainers.evaluation.eval_collator`]): its dataset items (what
        transformers weighs by, but it counts a short last batch of a stream as full), or with
        ``loss_normalization="sample"`` its samples with a trained token (a packed row holds several)
        ([`unpack_trainer.trainers.evaluation.weighed_eval_loss`])."""
        run = self.unpack_run
        run.eval_weights = []
        try:
            output = super().evaluation_loop(*args, **kwargs)
            recorded = run.eval_weights
        finally:
            run.eval_weights = None
        prefix = _trl_compat.evaluation_loop_argument(args, kwargs, "metric_key_prefix")
        evaluation.weighed_eval_loss(self, output.metrics, f"{prefix}_loss", recorded)
        return output

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> Any:
        """The parent's, after taking the batch's item count off ``inputs`` (see [`evaluation_loop`])."""
        items = inputs.pop(evaluation.EVAL_ITEMS_KEY, None) if isinstance(inputs, dict) else None
        output = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        evaluation.record_batch(self, inputs, items, output[0])
        return output

    # ------------------------------------------------------------------------------------------------ training

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """The Trainer's, but with ``loss_normalization="sample"`` the count returned is that of the samples with a
        trained token in the whole accumulated step ([`unpack_trainer.trainers.loss.step_sample_count`])."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.unpack_run.sample_loss and batch_samples:
            num_items_in_batch = loss.step_sample_count(self, batch_samples, device)
        return batch_samples, num_items_in_batch

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The parent's step, with LoRA's input casts that are exact round trips under autocast skipped
        ([`unpack_trainer.trainers.lora_casts`]: bit-identical, two activation-sized copies fewer per LoRA layer
        and call; the trainers that generate inside their step, GRPO / RLOO, generate with PEFT's own path:
        [`RunState.peft_lora_path`]); as the parent's under ``UNPACK_DISABLE=1`` and under ``torch_compile=True``
        (dynamo would inline the per-step hooks into a graph that outlives the step)."""
        run = self.unpack_run
        if run.disabled or getattr(self.args, "torch_compile", False):
            return super().training_step(model, inputs, *args, **kwargs)
        cached = run.lora_layers
        if cached is None or cached[0] is not model:
            cached = run.lora_layers = (model, plain_lora_layers(model))
        skip = lora_input_casts_skipped(cached[1])
        with skip:
            run.lora_skip = skip
            try:
                return super().training_step(model, inputs, *args, **kwargs)
            finally:
                run.lora_skip = None
