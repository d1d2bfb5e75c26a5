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
import trl
from datasets import Dataset, IterableDataset
from transformers import AutoConfig, TrainingArguments
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from unpack_trainer._validation import check_dataset_token_ids
from unpack_trainer.collator import DataCollatorForPacking
from unpack_trainer.config import SFTConfig
from unpack_trainer.decision import PackingDecision, decide, env_flag, log_once
from unpack_trainer.packing import best_fit_decreasing
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
        if env_flag(env, "UNPACK_DISABLE"):
            self.unpack_decision = decide(args, model_config=None, env=env)
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
        check_dataset_token_ids(dataset, dataset_name)
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
            dataset, stats = _pack_dataset(dataset, max_length, seed=args.seed)
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


def _pack_dataset(dataset: Dataset, max_length: int, *, seed: int) -> tuple[Dataset, dict[str, Any]]:
    """Pack a tokenized dataset (``input_ids``, ``labels``) into rows with the global BFD packer.

    Returns a dataset with ``input_ids`` and ``labels`` (each row's samples concatenated) and ``seq_lengths`` (the
    samples' lengths), in rows shuffled with ``seed``, and the packing statistics.
    """
    table = dataset.with_format("arrow")[:]
    lengths = pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
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
