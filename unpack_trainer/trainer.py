"""``SFTTrainer``: ``trl.SFTTrainer`` that packs without cross-sample contamination, or turns padding-free on itself.

The decision ([`unpack_trainer.decision.decide`]) is made once, before TRL's ``__init__``; then TRL prepares the
data (tokenization, labels) and this class truncates it with counts, packs it with the global packer, swaps in the
packed collator and patches the model's attention. The contamination self-check runs when training (or evaluation)
starts, right before its data loader is built, on the model exactly as it will run (after everything ``train()``
applies: liger kernels, a resumed checkpoint, ...); if it fails, the collator and the datasets are switched to padded
before the first batch is drawn.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import trl
from datasets import Dataset, IterableDataset
from transformers import AutoConfig, TrainingArguments
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from unpack_trainer._logging import log_once
from unpack_trainer._validation import check_dataset_token_ids
from unpack_trainer.collator import DataCollatorForPacking
from unpack_trainer.config import SFTConfig
from unpack_trainer.data_utils import (
    TruncationCounts,
    check_packed_rows,
    column_names,
    pack_dataset,
    pack_iterable_dataset,
    sample_lengths,
    samples_per_row,
    split_packed_rows,
    truncate_dataset,
)
from unpack_trainer.decision import PackingDecision, decide, env_flag, eval_batches, neftune_note
from unpack_trainer.estimate import estimated_speedup
from unpack_trainer.packing import balanced_step_order
from unpack_trainer.selfcheck import ContaminationReport, check_uncontaminated

logger = logging.getLogger("unpack_trainer")


def _model_config(model: Any, args: Any) -> Any:
    if isinstance(model, str):
        return AutoConfig.from_pretrained(model, trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    return model.config


def _first_example(dataset: Any) -> dict[str, Any] | None:
    """The training set's first example; ``ValueError`` for an empty one (nothing to train on)."""
    if dataset is None:
        return None
    try:
        return next(iter(dataset))
    except StopIteration:
        raise ValueError("`train_dataset` is empty (0 examples); training needs at least one example.") from None


def _is_iterable(dataset: Any) -> bool:
    if isinstance(dataset, dict):
        return any(_is_iterable(value) for value in dataset.values())
    return isinstance(dataset, (IterableDataset, torch.utils.data.IterableDataset))


def _registry() -> tuple[frozenset[str], dict[str, str]]:
    from unpack_trainer import models

    return frozenset(models.supported_model_types()), dict(models.BLOCKLIST)


def _default_args(model: Any) -> SFTConfig:
    name = model if isinstance(model, str) else getattr(model.config, "name_or_path", None) or "model"
    return SFTConfig(f"{str(name).rstrip('/').split('/')[-1]}-SFT")


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


class SFTTrainer(trl.SFTTrainer):
    """Drop-in for [`trl.SFTTrainer`]: ``from unpack_trainer import SFTTrainer`` and nothing else changes.

    With ``packing=True`` the whole training set is packed into rows of ``max_length`` tokens (``packing_order``:
    by default rows of samples that follow each other in a seeded random order, see [`SFTConfig`]); with packing off and ``padding_free`` not set, each batch is flattened into one row
    (padding-free). Either way positions restart per sample, no label crosses a sample boundary, and attention never
    crosses a sample: the model's attention is patched for registered architectures, and a contamination probe runs
    on the actual model before training. Every decision is logged once with its reason; see
    [`unpack_trainer.decision`] for the full table. ``UNPACK_DISABLE=1`` makes this class behave exactly like
    ``trl.SFTTrainer``.

    Attributes:
        unpack_decision (`PackingDecision`): what was decided and why (after a failed self-check: ``"padded"``).
        unpack_stats (`dict`): samples, rows, real tokens, packing efficiency and the estimated speedup
            ([`unpack_trainer.estimate`]) for the training set; for a streamed training set, the truncation counts
            (``"truncation"``) as they are read.
        unpack_selfcheck (`ContaminationReport` or `None`): the self-check's result, once training or evaluation has
            started (``None`` before, and when nothing is packed).
    """

    def __init__(
        self,
        model: Any,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        env = os.environ
        self.unpack_stats: dict[str, Any] = {}
        self.unpack_selfcheck: ContaminationReport | None = None
        self._unpack_mode = "stock"
        self._unpack_checked = True
        self._unpack_train_prepared = False
        self._unpack_eval_flattened = False
        self._unpack_user_collator = data_collator is not None
        self._unpack_counts: list[TruncationCounts] = []
        self._unpack_sample_loss = False
        if env_flag(env, "UNPACK_DISABLE"):
            self.unpack_decision = decide(args, model_config=None, env=env)
            if getattr(args, "loss_normalization", "token") != "token":
                log_once(logger, logging.WARNING, "loss_normalization ignored: UNPACK_DISABLE=1 trains as trl does")
            super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs)
            return

        if args is None:
            args = _default_args(model)
        elif not isinstance(args, trl.SFTConfig):
            dict_args = args.to_dict()
            dict_args["hub_token"] = args.hub_token
            args = SFTConfig(**dict_args)
        supported, blocklist = _registry()
        peft_config = kwargs.get("peft_config")
        if peft_config is None and not isinstance(model, str):
            peft_config = getattr(model, "peft_config", None)
        decision = decide(
            args,
            model_config=_model_config(model, args),
            data_collator=data_collator,
            processing_class=processing_class,
            dataset_sample=_first_example(train_dataset),
            supported_model_types=supported,
            blocklist=blocklist,
            env=env,
            peft_config=peft_config,
        )
        self.unpack_decision = decision
        has_metrics = any(
            kwargs.get(name) is not None for name in ("compute_metrics", "preprocess_logits_for_metrics")
        )
        self._unpack_eval_flattened, eval_note = eval_batches(args, decision, has_metrics=has_metrics)

        trl_args = copy.copy(args)
        trl_args.padding_free = False
        trl_args.packing = bool(args.packing) and decision.mode in ("pack", "stock")
        if decision.packed:
            _keep_batches_whole(trl_args, args)
        self._unpack_mode = decision.mode
        self._unpack_raw = {"train": train_dataset, "eval": eval_dataset}
        super().__init__(model, trl_args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs)
        if isinstance(self.train_dataset, Dataset) and len(self.train_dataset) == 0:
            total = len(train_dataset) if isinstance(train_dataset, Dataset) else "all"
            raise ValueError(
                f"The training dataset is empty after preparation: all {total} examples were dropped (no trained "
                "token left, e.g. every prompt longer than max_length or every label masked). Raise max_length or "
                "check the labels."
            )
        note = neftune_note(args, decision)
        if note is not None:
            log_once(logger, logging.WARNING, note)
        if eval_note is not None and eval_dataset is not None:
            log_once(logger, logging.INFO if not self._unpack_eval_flattened else logging.WARNING, eval_note)
        self._enable_sample_loss()
        if decision.packed:
            self._enable_packed_path()
        self._log_start_line()

    # ------------------------------------------------------------------------------------------------ packed path

    def _packed_collator(self) -> DataCollatorForPacking:
        return DataCollatorForPacking(
            pad_token_id=self._tokenizer.pad_token_id,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
            completion_only_loss=self.completion_only_loss,
        )

    def _padded_collator(self) -> DataCollatorForLanguageModeling:
        return DataCollatorForLanguageModeling(
            pad_token_id=self._tokenizer.pad_token_id, pad_to_multiple_of=self.args.pad_to_multiple_of
        )

    def _enable_packed_path(self) -> None:
        self.data_collator = self._packed_collator()
        if self.unpack_decision.patch:
            from unpack_trainer.models import patch_model, resolve_backend

            resolve_backend(self.model)  # an impossible UNPACK_ATTENTION_BACKEND raises here, naming the variable
            patch_model(self.model)
        self._unpack_checked = False  # the self-check runs right before the first data loader is built

    def get_train_dataloader(self) -> Any:
        self._unpack_check_before_first_batch()
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        self._unpack_check_before_first_batch()
        with self._unpack_eval_collator():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        self._unpack_check_before_first_batch()
        with self._unpack_eval_collator():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _unpack_eval_collator(self) -> Iterator[None]:
        """Evaluation batches padded (one row per example) when [`eval_batches`] said so, flattened otherwise."""
        if not self.unpack_decision.packed or self._unpack_eval_flattened:
            yield
            return
        collator, self.data_collator = self.data_collator, self._padded_collator()
        try:
            yield
        finally:
            self.data_collator = collator

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
        report = check_uncontaminated(self.model, measure_contamination=False)
        self.unpack_selfcheck = report
        if report.ok:
            if not report.conclusive:
                log_once(logger, logging.WARNING, f"Self-check inconclusive on this model: {report.summary()}")
            log_once(logger, logging.INFO, f"Contamination self-check passed: {report.summary()}")
            return
        if report.error is not None:
            what = f"the packed forward raised {report.error}"
        else:
            what = (
                f"contamination measured: max |packed - one-by-one| = {report.max_abs_diff:.3g} > tolerance "
                f"{report.tolerance:.3g} ({report.dtype})"
            )
        message = f"Contamination self-check failed ({what}); training padded instead"
        if env_flag(os.environ, "UNPACK_STRICT"):
            raise RuntimeError(message + " (UNPACK_STRICT=1)")
        log_once(logger, logging.ERROR, message)
        self._fall_back_to_padded(f"contamination self-check failed: {what}")

    def _fall_back_to_padded(self, reason: str = "contamination self-check failed") -> None:
        if self.unpack_decision.patch:
            from unpack_trainer.models import unpatch_model

            unpatch_model(self.model)
        self.unpack_decision = PackingDecision("padded", reason, automatic=True)
        self._unpack_mode = "padded"
        self.data_collator = self._padded_collator()
        args = self.args
        if self._unpack_raw["train"] is not None and not self._skip_prepare_dataset:
            self.train_dataset = self._prepare_dataset(
                self._unpack_raw["train"], self.processing_class, args, False, self._formatting_func, "train"
            )
        raw_eval = self._unpack_raw["eval"]
        if raw_eval is not None and not self._skip_prepare_dataset:
            if isinstance(raw_eval, dict):
                self.eval_dataset = {
                    key: self._prepare_dataset(ds, self.processing_class, args, False, self._formatting_func, key)
                    for key, ds in raw_eval.items()
                }
            else:
                self.eval_dataset = self._prepare_dataset(
                    raw_eval, self.processing_class, args, False, self._formatting_func, "eval"
                )

    def _log_start_line(self) -> None:
        """One line, once, on the main process: the decision, its reason and the training set's statistics. INFO;
        WARNING when a request (packing / padding-free) was overridden."""
        decision = self.unpack_decision
        stats = self.unpack_stats
        parts = [f"mode={decision.mode}", f"reason: {decision.reason}"]
        if decision.packed:
            parts.append(f"attention={_attention_backend(self.model, decision.patch)}")
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
        level = logging.WARNING if decision.overridden_request else logging.INFO
        log_once(logger, level, "SFTTrainer: " + ", ".join(parts))

    # ------------------------------------------------------------------------------------------------ data

    def _prepare_dataset(
        self,
        dataset: Dataset | IterableDataset,
        processing_class: Any,
        args: Any,
        packing: bool,
        formatting_func: Any,
        dataset_name: str,
    ) -> Dataset | IterableDataset:
        is_train = dataset_name == "train" and not self._unpack_train_prepared  # an eval split may be named "train"
        self._unpack_train_prepared = True
        if self._unpack_mode == "stock":
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        packed_ahead = "seq_lengths" in column_names(dataset)
        flatten = self._unpack_mode in ("pack", "padding_free") and (is_train or self._unpack_eval_flattened)
        if not flatten:
            if self._unpack_user_collator:  # the user's collator decides what seq_lengths mean
                return super()._prepare_dataset(
                    dataset, processing_class, args, packing, formatting_func, dataset_name
                )
            if packed_ahead:  # padded batches cannot keep boundaries inside a row: one row per sample
                dataset = split_packed_rows(dataset, dataset_name)
            return super()._prepare_dataset(dataset, processing_class, args, False, formatting_func, dataset_name)
        if packed_ahead and packing:
            dataset = split_packed_rows(dataset, dataset_name)  # boundaries kept; the samples are packed anew
            packed_ahead = False
        max_length = args.max_length
        args.max_length = None  # tokenize and build labels only; truncation is done here, with counts
        try:
            dataset = super()._prepare_dataset(dataset, processing_class, args, False, formatting_func, dataset_name)
        finally:
            args.max_length = max_length
        check_dataset_token_ids(dataset, dataset_name)
        split = packing and args.packing_strategy == "bfd_split"
        if max_length is not None:
            if packed_ahead:
                dataset = check_packed_rows(dataset, max_length, dataset_name)
            else:
                dataset, counts = truncate_dataset(
                    dataset, max_length, truncation_mode=args.truncation_mode, split=split, name=dataset_name
                )
                if isinstance(dataset, IterableDataset):
                    self._unpack_counts.append(counts)
                    if is_train:
                        self.unpack_stats["truncation"] = counts
        if packing:
            if max_length is None:
                raise ValueError("When packing is enabled, `max_length` can't be `None`.")
            if isinstance(dataset, IterableDataset):
                return pack_iterable_dataset(
                    dataset, max_length, buffer_size=getattr(args, "packing_buffer_size", 10_000), seed=args.seed
                )
        stats: dict[str, Any] = {}
        if packing or isinstance(dataset, Dataset):
            lengths = sample_lengths(dataset, packed_ahead)  # of the samples, in the dataset's order
            if packing:
                dataset = pack_dataset(
                    dataset,
                    max_length,
                    seed=args.seed,
                    order=getattr(args, "packing_order", "decreasing"),
                    max_samples_per_row=getattr(args, "max_samples_per_row", None),
                )
            stats = {"samples": int(lengths.size), "tokens": int(lengths.sum()), "lengths": lengths}
            if (packing or packed_ahead) and max_length is not None:
                stats["rows"] = len(dataset)
                stats["efficiency"] = stats["tokens"] / max(len(dataset) * max_length, 1)
        if is_train and stats:
            lengths = stats.pop("lengths", None)
            if lengths is not None and lengths.size:
                rows = stats.get("rows") or len(dataset)
                batch = args.per_device_train_batch_size * lengths.size / max(rows, 1)
                stats["padded_batch_size"] = batch
                stats["estimated_speedup"] = estimated_speedup(lengths, batch, seed=args.seed)
            self.unpack_stats.update(stats)
        stats.pop("lengths", None)
        return dataset

    # ------------------------------------------------------------------------------------------------ step composition

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """With ``balance_samples_per_step`` and packed rows: a sampler whose optimizer steps hold balanced numbers of
        samples ([`unpack_trainer.packing.balanced_step_order`]); otherwise the Trainer's own sampler."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        args = self.args
        if (
            getattr(args, "balance_samples_per_step", False)
            and self._unpack_mode == "pack"
            and isinstance(dataset, Dataset)
            and "seq_lengths" in dataset.column_names
        ):
            rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
            return BalancedStepSampler(samples_per_row(dataset), rows_per_step, seed=args.seed)
        return super()._get_train_sampler(train_dataset)

    # ------------------------------------------------------------------------------------------------ loss

    def _enable_sample_loss(self) -> None:
        if getattr(self.args, "loss_normalization", "token") != "sample":
            return
        args = self.args
        if args.loss_type != "nll" or self.label_smoother is not None or self.compute_loss_func is not None:
            raise ValueError(
                "`loss_normalization='sample'` is not supported with `loss_type='dft'`, label smoothing or a custom "
                "`compute_loss_func`; use `loss_normalization='token'`."
            )
        self._unpack_sample_loss = True
        if self.loss_is_scaled_for_ga is None:
            self.loss_is_scaled_for_ga = True  # divided by the samples of the whole accumulated step below

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """The Trainer's, but with ``loss_normalization="sample"`` the count returned is that of the samples with a
        trained token in the whole accumulated step (all processes when ``average_tokens_across_devices``)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._unpack_sample_loss and batch_samples:
            count = torch.tensor(sum(sample_weights(batch)[1] for batch in batch_samples), device=device)
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                count = self.accelerator.gather(count).sum()
            num_items_in_batch = count
        return batch_samples, num_items_in_batch

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's loss, or with ``loss_normalization="sample"`` the sum over samples of each sample's mean token loss,
        divided by the number of samples in the step (``num_items_in_batch``, see [`get_batch_samples`]) or, outside
        a training step, in the batch."""
        if not self._unpack_sample_loss:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if "shift_labels" in inputs:
            raise ValueError(
                "`loss_normalization='sample'` does not support pre-shifted `shift_labels` (context parallel)."
            )
        weights, num_samples = sample_weights(inputs)
        fused: list[Any] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            # TRL's loss calls the model once with fused_lm_head=True (per-token log-probs); keep those outputs
            out = model(*args, **kwargs)
            if kwargs.get("fused_lm_head"):
                fused.append(out)
            return out

        result = super().compute_loss(
            forward, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not fused:
            raise RuntimeError(
                "`loss_normalization='sample'` needs TRL's fused LM head outputs, which were not computed."
            )
        outputs = fused[0]
        log_probs = outputs.log_probs
        denominator = num_samples if num_items_in_batch is None else num_items_in_batch
        denominator = torch.as_tensor(denominator, device=log_probs.device).clamp(min=1)
        loss = -(log_probs.float() * weights.to(log_probs.device)).sum() / denominator
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
        return (loss, result[1]) if return_outputs else loss


class BalancedStepSampler(torch.utils.data.Sampler):
    """Packed rows in an order where each optimizer step's rows hold balanced sample counts, reshuffled per epoch.

    Args:
        samples_per_row: ``(num_rows,)`` int64 samples in each packed row.
        rows_per_step: rows per optimizer step, all processes and accumulation steps together.
        seed: the order of epoch ``e`` uses seed ``seed + e``.
    """

    def __init__(self, samples_per_row: np.ndarray, rows_per_step: int, *, seed: int) -> None:
        self.samples_per_row = samples_per_row
        self.rows_per_step = rows_per_step
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples_per_row)

    def __iter__(self):
        yield from balanced_step_order(self.samples_per_row, self.rows_per_step, seed=self.seed + self.epoch)


def sample_weights(batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Per-token weights that turn a sum of token losses into a sum of per-sample mean losses.

    A sample is a row of ``labels`` or, inside a row, a run of positions starting where ``position_ids`` is 0 (packed
    and padding-free rows). Label position ``j`` (``j >= 1``, label ``!= -100``) is scored from position ``j - 1``, as
    in a causal LM loss.

    Args:
        batch: ``labels`` ``(B, T)`` int64 and optionally ``position_ids`` ``(B, T)`` int64.

    Returns:
        ``weights`` ``(B, T - 1)`` float32 aligned with ``labels[:, 1:]``: ``1 / (trained tokens of the sample)`` at
        every trained position, 0 elsewhere; and the number of samples with at least one trained token.

    Example:
        labels ``[[-100, 5, 6, -100, 7]]``, position_ids ``[[0, 1, 2, 0, 1]]`` -> weights ``[[0.5, 0.5, 0, 1]]``, 2.
    """
    labels = batch["labels"]
    starts = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    starts[:, 0] = True
    position_ids = batch.get("position_ids")
    if position_ids is not None and position_ids.shape == labels.shape:
        starts |= position_ids.to(labels.device) == 0
    segment = starts.reshape(-1).cumsum(0) - 1
    trained = torch.zeros_like(starts)
    trained[:, 1:] = labels[:, 1:] != -100
    trained = trained.reshape(-1)
    counts = torch.bincount(segment[trained], minlength=int(segment[-1]) + 1)
    weights = torch.where(trained, 1.0 / counts[segment].clamp(min=1).to(torch.float32), 0.0)
    return weights.view(labels.shape)[:, 1:], int((counts > 0).sum())


def _attention_backend(model: Any, patched: bool) -> str:
    if patched:
        from unpack_trainer.models import resolve_backend

        return str(resolve_backend(model))
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return f"{implementation} (transformers' own packed-position path, unpatched)"
