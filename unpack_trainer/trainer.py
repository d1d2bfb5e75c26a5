"""``SFTTrainer``: ``trl.SFTTrainer`` that packs without cross-sample contamination, or turns padding-free on itself.

The decision ([`unpack_trainer.decision.decide`]) is made once, before TRL's ``__init__``; then TRL prepares the
data (tokenization, labels, truncation) and this class packs it with the global packer, swaps in the packed collator,
patches the model's attention and runs the contamination self-check, falling back to padded training if it fails.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import trl
from datasets import Dataset, IterableDataset
from transformers import AutoConfig, TrainingArguments
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from unpack_trainer.collator import DataCollatorForPacking
from unpack_trainer.config import SFTConfig
from unpack_trainer.decision import PackingDecision, decide, env_flag, log_once
from unpack_trainer.packing import balanced_step_order, best_fit_decreasing, shuffled_best_fit
from unpack_trainer.selfcheck import ContaminationReport, check_uncontaminated

logger = logging.getLogger("unpack_trainer")


def _model_config(model: Any, args: Any) -> Any:
    if isinstance(model, str):
        return AutoConfig.from_pretrained(model, trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    return model.config


def _first_example(dataset: Any) -> dict[str, Any] | None:
    if dataset is None:
        return None
    return next(iter(dataset))


def _registry() -> tuple[frozenset[str], dict[str, str]]:
    from unpack_trainer import models

    return frozenset(models.supported_model_types()), dict(models.BLOCKLIST)


def _default_args(model: Any) -> SFTConfig:
    name = model if isinstance(model, str) else getattr(model.config, "name_or_path", None) or "model"
    return SFTConfig(f"{str(name).rstrip('/').split('/')[-1]}-SFT")


def _padded_tokens(lengths: np.ndarray, batch_size: int, seed: int) -> int:
    """Tokens a padded batch of ``batch_size`` random examples computes on (each batch padded to its longest)."""
    order = np.random.default_rng(seed).permutation(lengths.size)
    shuffled = lengths[order]
    pad = (-shuffled.size) % batch_size
    batches = np.concatenate([shuffled, np.zeros(pad, dtype=shuffled.dtype)]).reshape(-1, batch_size)
    return int((batches.max(axis=1) * (batches > 0).sum(axis=1)).sum())


class SFTTrainer(trl.SFTTrainer):
    """Drop-in for [`trl.SFTTrainer`]: ``from unpack_trainer import SFTTrainer`` and nothing else changes.

    With ``packing=True`` the whole training set is packed with global best-fit decreasing into rows of
    ``max_length`` tokens; with packing off and ``padding_free`` not set, each batch is flattened into one row
    (padding-free). Either way positions restart per sample, no label crosses a sample boundary, and attention never
    crosses a sample: the model's attention is patched for registered architectures, and a contamination probe runs
    on the actual model before training. Every decision is logged once with its reason; see
    [`unpack_trainer.decision`] for the full table. ``UNPACK_DISABLE=1`` makes this class behave exactly like
    ``trl.SFTTrainer``.

    Attributes:
        unpack_decision (`PackingDecision`): what was decided and why (after a failed self-check: ``"padded"``).
        unpack_stats (`dict`): samples, rows, real tokens, packing efficiency and the padded-token estimate, for the
            training set.
        unpack_selfcheck (`ContaminationReport` or `None`): the self-check's result.
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
        decision = decide(
            args,
            model_config=_model_config(model, args),
            data_collator=data_collator,
            processing_class=processing_class,
            dataset_sample=_first_example(train_dataset),
            supported_model_types=supported,
            blocklist=blocklist,
            env=env,
        )
        self.unpack_decision = decision
        log_once(logger, logging.WARNING if decision.overridden_request else logging.INFO, decision.reason)

        trl_args = copy.copy(args)
        trl_args.padding_free = False
        trl_args.packing = bool(args.packing) and decision.mode in ("pack", "stock")
        self._unpack_mode = decision.mode
        self._unpack_raw = {"train": train_dataset, "eval": eval_dataset}
        super().__init__(model, trl_args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs)
        self._enable_sample_loss()
        if decision.packed:
            self._enable_packed_path()

    # ------------------------------------------------------------------------------------------------ packed path

    def _packed_collator(self) -> DataCollatorForPacking:
        return DataCollatorForPacking(
            pad_token_id=self._tokenizer.pad_token_id,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
            completion_only_loss=self.completion_only_loss,
        )

    def _enable_packed_path(self) -> None:
        decision = self.unpack_decision
        self.data_collator = self._packed_collator()
        if decision.patch:
            from unpack_trainer.models import patch_model

            patch_model(self.model)
        report = check_uncontaminated(self.model, measure_contamination=False)
        self.unpack_selfcheck = report
        if not report.ok:
            message = f"Contamination self-check failed, training padded instead: {report.summary()}"
            if env_flag(os.environ, "UNPACK_STRICT"):
                raise RuntimeError(message + " (UNPACK_STRICT=1)")
            logger.error(message)
            self._fall_back_to_padded()
            return
        if not report.conclusive:
            log_once(logger, logging.WARNING, f"Self-check inconclusive on this model: {report.summary()}")
        logger.info("Self-check passed: %s", report.summary())
        self._log_start_line()

    def _fall_back_to_padded(self) -> None:
        if self.unpack_decision.patch:
            from unpack_trainer.models import unpatch_model

            unpatch_model(self.model)
        self.unpack_decision = PackingDecision("padded", "contamination self-check failed", automatic=True)
        self._unpack_mode = "padded"
        self.data_collator = DataCollatorForLanguageModeling(
            pad_token_id=self._tokenizer.pad_token_id, pad_to_multiple_of=self.args.pad_to_multiple_of
        )
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
        stats = self.unpack_stats
        parts = [f"mode={self.unpack_decision.mode}", f"reason: {self.unpack_decision.reason}"]
        parts.append(f"attention={_attention_backend(self.model, self.unpack_decision.patch)}")
        if stats:
            parts.append(f"samples={stats['samples']:,}")
            if "rows" in stats:
                parts.append(f"rows={stats['rows']:,}")
                parts.append(f"packing efficiency={stats['efficiency']:.2%}")
            parts.append(f"estimated speedup vs padded={stats['estimated_speedup']:.2f}x (token count)")
        if self.unpack_selfcheck is not None:
            parts.append(f"self-check {self.unpack_selfcheck.seconds * 1000:.0f} ms")
        logger.warning("unpack_trainer: " + ", ".join(parts))

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
        if self._unpack_mode not in ("pack", "padding_free"):
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        max_length = args.max_length
        args.max_length = None  # tokenize and build labels only; truncation is done here, with counts
        try:
            dataset = super()._prepare_dataset(dataset, processing_class, args, False, formatting_func, dataset_name)
        finally:
            args.max_length = max_length
        split = packing and args.packing_strategy == "bfd_split"
        if max_length is not None:
            dataset = _enforce_max_length(dataset, max_length, args.truncation_mode, split, dataset_name)
        if packing:
            if max_length is None:
                raise ValueError("When packing is enabled, `max_length` can't be `None`.")
            if isinstance(dataset, IterableDataset):
                from unpack_trainer.streaming import pack_iterable_dataset

                return pack_iterable_dataset(
                    dataset, max_length, buffer_size=getattr(args, "packing_buffer_size", 10_000), seed=args.seed
                )
            dataset, stats = _pack_dataset(
                dataset,
                max_length,
                seed=args.seed,
                order=getattr(args, "packing_order", "decreasing"),
                max_samples_per_row=getattr(args, "max_samples_per_row", None),
            )
        elif isinstance(dataset, Dataset):
            stats = {"samples": len(dataset), "tokens": int(_lengths(dataset).sum())}
        else:
            stats = {}
        if dataset_name == "train" and stats:
            lengths = stats.pop("lengths", None)
            if lengths is None and isinstance(dataset, Dataset):
                lengths = _lengths(dataset)
            if lengths is not None and lengths.size:
                padded = _padded_tokens(lengths, args.per_device_train_batch_size, args.seed)
                stats["padded_tokens"] = padded
                stats["estimated_speedup"] = padded / max(int(lengths.sum()), 1)
            self.unpack_stats = stats
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
            table = dataset.with_format("arrow")[:]
            counts = pc.list_value_length(table["seq_lengths"]).to_numpy(zero_copy_only=False).astype(np.int64)
            return BalancedStepSampler(counts, rows_per_step, seed=args.seed)
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


def _lengths(dataset: Dataset) -> np.ndarray:
    table = dataset.with_format("arrow")[:]
    return pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)


def _enforce_max_length(
    dataset: Dataset | IterableDataset, max_length: int, truncation_mode: str, split: bool, name: str
) -> Dataset | IterableDataset:
    """Truncate (or, with ``split``, cut into chunks) samples longer than ``max_length``, exactly as TRL's padded path
    truncates, then drop samples left without any trained token. Both counts are logged."""
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"Unsupported truncation mode: {truncation_mode}, expected 'keep_start' or 'keep_end'")
    if isinstance(dataset, Dataset):
        lengths = _lengths(dataset)
        over = lengths > max_length
        if over.any():
            action = "split into chunks of max_length" if split else f"truncated ({truncation_mode})"
            cut = int((lengths[over] - max_length).sum())
            logger.warning(
                "%s dataset: %d of %d samples are longer than max_length=%d and were %s%s.",
                name,
                int(over.sum()),
                lengths.size,
                max_length,
                action,
                "" if split else f", dropping {cut:,} tokens",
            )
    columns = ["input_ids", "labels"]

    def truncate(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {column: [] for column in columns}
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            if split:
                for start in range(0, len(ids), max_length):
                    out["input_ids"].append(ids[start : start + max_length])
                    out["labels"].append(labels[start : start + max_length])
            else:
                window = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
                out["input_ids"].append(ids[window])
                out["labels"].append(labels[window])
        return out

    remove = [c for c in (dataset.column_names or []) if c not in columns]
    dataset = dataset.map(truncate, batched=True, remove_columns=remove or None)
    before = len(dataset) if isinstance(dataset, Dataset) else None
    dataset = dataset.filter(lambda example: any(label != -100 for label in example["labels"]))
    if before is not None and len(dataset) != before:
        logger.warning(
            "%s dataset: dropped %d sample(s) with no trained token left after truncation (as padded training does).",
            name,
            before - len(dataset),
        )
    return dataset


def _pack_dataset(
    dataset: Dataset,
    max_length: int,
    *,
    seed: int,
    order: str = "decreasing",
    max_samples_per_row: int | None = None,
) -> tuple[Dataset, dict[str, Any]]:
    """Pack a tokenized dataset (``input_ids``, ``labels``) into rows with a global packer: best-fit decreasing
    (``order="decreasing"``) or [`shuffled_best_fit`] (``order="shuffled"`` or a ``max_samples_per_row`` bound).

    Returns a dataset with ``input_ids`` and ``labels`` (each row's samples concatenated) and ``seq_lengths`` (the
    samples' lengths), in rows shuffled with ``seed``, and the packing statistics.
    """
    table = dataset.with_format("arrow")[:]
    lengths = pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    if order == "shuffled" or max_samples_per_row is not None:
        rows = shuffled_best_fit(lengths, max_length, seed=seed, max_samples_per_row=max_samples_per_row)
    else:
        rows = best_fit_decreasing(lengths, max_length, seed=seed)
    order = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=lengths.size)
    samples_per_row = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    sample_offsets = np.concatenate(([0], np.cumsum(samples_per_row)))
    token_ends = np.concatenate(([0], np.cumsum(lengths[order])))
    row_offsets = token_ends[sample_offsets]

    def regroup(column: pa.ChunkedArray) -> pa.Array:
        values = pc.list_flatten(column.take(pa.array(order)))
        return pa.LargeListArray.from_arrays(pa.array(row_offsets, pa.int64()), values.combine_chunks())

    seq_lengths = pa.LargeListArray.from_arrays(
        pa.array(sample_offsets, pa.int64()), pa.array(lengths[order], pa.int64())
    )
    packed = Dataset(
        pa.table(
            {"input_ids": regroup(table["input_ids"]), "labels": regroup(table["labels"]), "seq_lengths": seq_lengths}
        )
    )
    total = int(lengths.sum())
    stats = {
        "samples": int(lengths.size),
        "rows": len(rows),
        "tokens": total,
        "efficiency": total / max(len(rows) * max_length, 1),
        "lengths": lengths,
    }
    return packed, stats
