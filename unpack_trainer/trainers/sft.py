"""``SFTTrainer``: ``trl.SFTTrainer`` that packs without cross-sample contamination, or turns padding-free on itself.

The SFT data path and loss on the packed-trainer core ([`unpack_trainer.trainers._packed.PackedTrainerMixin`]: the
decision, the patch, the self-check and the padded fallback): TRL prepares the data (tokenization, labels), this
class truncates it with counts and packs it with the global packer, and its collator flattens the rows.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
import trl
from datasets import Dataset, IterableDataset

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.configs import SFTConfig
from unpack_trainer.data.collator import DataCollatorForPacking
from unpack_trainer.data.estimate import estimated_speedup
from unpack_trainer.data.preparation import (
    TruncationCounts,
    check_packed_rows,
    column_names,
    pack_dataset,
    pack_iterable_dataset,
    sample_lengths,
    split_packed_rows,
    truncate_dataset,
)
from unpack_trainer.data.validation import check_dataset_token_ids
from unpack_trainer.data.vision import (
    VISION_ROWS_KEY,
    VISION_SOURCE_KEY,
    DataCollatorForVisionPacking,
    VisionRows,
    pack_vision_dataset,
    with_sources,
)
from unpack_trainer.decision import parallelism_reason
from unpack_trainer.models import install_fix
from unpack_trainer.models.fixes.liger_loss import LIGER_OUTPUT_MARK
from unpack_trainer.packed_seq_info import SEQ_LENGTHS_COLUMN
from unpack_trainer.trainers._packed import PackedTrainerMixin
from unpack_trainer.trainers.evaluation import batch_collator
from unpack_trainer.trainers.loss import choose_loss_kernel, head_unsupported_reason, sample_weights
from unpack_trainer.trainers.packed_path import empty_train_dataset_error
from unpack_trainer.trainers.run_state import RunField, RunState

logger = logging.getLogger("unpack_trainer")


@dataclasses.dataclass
class SFTRun(RunState):
    """The run state ([`RunState`]) of [`SFTTrainer`].

    Attributes:
        user_collator (`bool`): the user passed a ``data_collator`` (it decides what ``seq_lengths`` mean).
        train_prepared (`bool`): TRL's ``__init__`` prepared the training set (a later split named ``"train"`` is an
            evaluation set).
        vision_collator: TRL's vision collator, when TRL prepared an image dataset (it processes images per batch).
        vision_train: the raw training examples, while the training set is rows of them packed ahead.
        counts (`list[TruncationCounts]`): truncation counts taken as examples are read (a streamed training set, an
            image dataset's), logged with their totals at the end of ``train()``.
        loss_kernel (`str` or `None`): the kernel of the packed rows' loss, ``"trl"`` or ``"liger"``, once chosen.
            Public as ``trainer.unpack_loss_kernel``.
    """

    user_collator: bool = False
    train_prepared: bool = False
    vision_collator: Any = None
    vision_train: Any = None
    counts: list[TruncationCounts] = dataclasses.field(default_factory=list)
    loss_kernel: str | None = None


class SFTTrainer(PackedTrainerMixin, trl.SFTTrainer):
    """Drop-in for [`trl.SFTTrainer`]: ``from unpack_trainer import SFTTrainer`` and nothing else changes.

    With ``packing=True`` the whole training set is packed into rows of ``max_length`` tokens (``packing_order``:
    by default rows of samples that follow each other in a seeded random order, see [`SFTConfig`]); with packing off
    and ``padding_free`` not set, each batch is flattened into one row (padding-free). Either way positions restart
    per sample, no label crosses a sample boundary, and attention never crosses a sample. The decision (see
    [`unpack_trainer.decision`] for the full table), switches, self-check, fallback and attributes are the core's
    ([`PackedTrainerMixin`]); ``args`` may be any ``TrainingArguments`` (converted to [`SFTConfig`], every shared
    field copied and ours at their documented defaults).
    """

    unpack_packs_vision = True  # image data and vision-language models pack (unpack_trainer.data.vision)
    unpack_sequence_parallel = True  # packed rows cut by DeepSpeed Ulysses, the whole row's boundaries carried along
    unpack_config_class = SFTConfig
    unpack_trl_methods = _trl_compat.SFT_TRAINER_METHODS
    unpack_trl_attributes = _trl_compat.SFT_TRAINER_ATTRIBUTES
    unpack_run_class = SFTRun
    unpack_run: SFTRun
    unpack_loss_kernel = RunField("loss_kernel")

    def _unpack_before_init(self, model: Any, args: Any, **arguments: Any) -> Any:
        """The core's decision, and whether the user passed a collator (it decides what ``seq_lengths`` mean)."""
        trl_args = super()._unpack_before_init(model, args, **arguments)
        self.unpack_run.user_collator = arguments["data_collator"] is not None
        return trl_args

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's; at its end, the truncation counts taken as examples were read (``unpack_run.counts``) logged once
        with their totals."""
        try:
            return super().train(*args, **kwargs)
        finally:
            for counts in self.unpack_run.counts:
                if counts.read:
                    log_once(logger, logging.WARNING if counts.changed else logging.INFO, counts.summary())

    def _unpack_trl_init(self, args: tuple, kwargs: dict[str, Any]) -> None:
        try:
            super()._unpack_trl_init(args, kwargs)
        except StopIteration:  # TRL reads the first example of the training set: an empty stream
            if self.unpack_run.disabled:
                raise
            raise empty_train_dataset_error() from None

    # ------------------------------------------------------------------------------------------------ hooks

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """``input_ids``; ``prompt`` + ``completion``; ``messages``; ``conversations``; ``dataset_text_field``."""
        text_field = getattr(args, "dataset_text_field", None) or "text"
        return (("input_ids",), ("prompt", "completion"), ("messages",), ("conversations",), (text_field,))

    def _unpack_trl_packs(self, args: Any, decision: Any, first_example: dict[str, Any] | None) -> bool:
        # TRL refuses packing for image data; the vision collator packs it here
        vision = first_example is not None and any(key in first_example for key in ("image", "images"))
        return super()._unpack_trl_packs(args, decision, first_example) and not (vision and decision.mode == "pack")

    def _packed_collator(self) -> Any:
        if self.unpack_run.vision_collator is not None:
            return self._vision_packing_collator()
        return DataCollatorForPacking(
            pad_token_id=self._tokenizer.pad_token_id,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
            completion_only_loss=self.completion_only_loss,
            seq_info=self.unpack_decision.patch,  # the patched hook adopts it: no metadata read back from the GPU
            sequence_shards=self.unpack_run.sequence_shards,
        )

    def _padded_collator(self) -> Any:
        if self.unpack_run.vision_collator is not None:
            return self.unpack_run.vision_collator
        return _trl_compat.sft_padded_collator_class()(
            pad_token_id=self._tokenizer.pad_token_id, pad_to_multiple_of=self.args.pad_to_multiple_of
        )

    def _prepare_padded_datasets(self, raw_train: Any, raw_eval: Any) -> None:
        if self.unpack_run.vision_train is not None:  # rows packed ahead: the examples again, one per row
            self.train_dataset = self.unpack_run.vision_train
            self.unpack_run.vision_train = None
        if self._skip_prepare_dataset:
            return
        args = self.args
        if raw_train is not None:
            self.train_dataset = self._prepare_dataset(
                raw_train, self.processing_class, args, False, self._formatting_func, "train"
            )
        if raw_eval is not None:
            if isinstance(raw_eval, dict):
                self.eval_dataset = {
                    key: self._prepare_dataset(ds, self.processing_class, args, False, self._formatting_func, key)
                    for key, ds in raw_eval.items()
                }
            else:
                self.eval_dataset = self._prepare_dataset(
                    raw_eval, self.processing_class, args, False, self._formatting_func, "eval"
                )

    def _count_samples(self, batch: dict[str, Any]) -> int:
        return sample_weights(batch)[1]

    def _enable_loss_kernel(self) -> None:
        """Choose the kernel of the packed rows' loss ([`choose_loss_kernel`]) and install Liger's where chosen
        (the fix [`unpack_trainer.models.fixes.liger_loss`]); an explicit ``loss_kernel="liger"`` that cannot be honoured raises ``ValueError``."""
        args = self.args
        kernel, why = choose_loss_kernel(getattr(args, "loss_kernel", None), device=args.device)
        self.unpack_loss_kernel = "trl"
        if kernel != "liger":
            return
        reason = None
        if not self.unpack_decision.patch:
            reason = "the model runs without the attention patch, so its packed rows are not marked as such"
        elif self.unpack_run.sequence_shards > 1:
            reason = (
                "under sequence parallelism the engine computes the loss from labels it shifted before cutting the "
                "row, which Liger's kernel does not take"
            )
        elif args.loss_type != "nll" or self.unpack_run.sample_loss:
            reason = "it needs TRL's token loss (loss_type='nll', loss_normalization='token')"
        elif self.label_smoother is not None or self.compute_loss_func is not None:
            reason = "label smoothing and a custom compute_loss_func take the full logits"
        else:
            reason = head_unsupported_reason(self.model.config)
        if reason is not None:
            raise ValueError(f"Liger-Kernel's fused linear cross-entropy ({why}) cannot compute this loss: {reason}.")
        install_fix(self.model, "liger_loss")
        self.unpack_loss_kernel = "liger"

    def _enable_token_loss(self) -> None:
        """``loss_normalization="token"``: TRL's loss of every micro-batch divided by the trained tokens of the whole
        accumulated step (all its micro-batches, and all processes with ``average_tokens_across_devices``), so the
        step's loss and gradients are the mean over every trained token of the step, for every model.

        transformers' ``Trainer`` counts the step's tokens for TRL's loss only where the model class declares
        ``accepts_loss_kwargs`` true ([`_trl_compat.counts_step_tokens`]); the classes that declare it false
        (Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE, Gemma 4: their own loss does not take the count) got each
        micro-batch's own mean divided by the accumulation steps, a short row's tokens weighing more than a long one's.
        TRL's SFT loss never asks the model for its loss, so this trainer has the ``Trainer`` count them
        ([`_trl_compat.count_step_tokens`]); for the classes already counted nothing changes. Left as TRL's where a
        subclass scales the loss itself (``loss_is_scaled_for_ga`` set) and under context or sequence parallelism
        (whose engine computes the loss)."""
        if _trl_compat.counts_step_tokens(self) or self.loss_is_scaled_for_ga is not None:
            return
        if parallelism_reason(getattr(self.accelerator, "parallelism_config", None), {}) is not None:
            return
        _trl_compat.count_step_tokens(self)

    def _check_sample_loss(self) -> None:
        if self.args.loss_type != "nll" or self.label_smoother is not None or self.compute_loss_func is not None:
            raise ValueError(
                "`loss_normalization='sample'` is not supported with `loss_type='dft'`, label smoothing or a custom "
                "`compute_loss_func`; use `loss_normalization='token'`."
            )

    # ------------------------------------------------------------------------------------------------ vision

    def _enable_packed_path(self) -> None:
        """The core's, and for an image dataset (TRL's vision collator): the vision packing collator, and with
        ``packing=True`` the training examples packed ahead into rows ([`unpack_trainer.data.vision`]), and its
        truncation counts ([`_count_vision_truncation`]); then the loss kernel ([`_enable_loss_kernel`])."""
        if self._is_vision_dataset and not self.unpack_run.user_collator:
            self.unpack_run.vision_collator = self.data_collator
        super()._enable_packed_path()
        if self.unpack_run.vision_collator is not None:
            if self.unpack_decision.mode == "pack":
                self._pack_vision_training_set()
            self._count_vision_truncation()
        self._enable_loss_kernel()

    def _count_vision_truncation(self) -> None:
        """With ``max_length``: ``unpack_stats["truncation"]``, the training set's text cut after the last image token
        as the vision packing collator counts it (complete here for examples packed ahead, filled as they are read
        otherwise); counts taken as examples are read (the training set's, every evaluation set's) are logged with
        their totals at the end of ``train()``, as a streamed text dataset's."""
        if self.args.max_length is None:
            return
        collator = self.data_collator
        counts = collator.truncation_counts("train")
        self.unpack_stats["truncation"] = counts
        if not isinstance(self.train_dataset, VisionRows):
            self.unpack_run.counts.append(counts)
        if self.unpack_run.eval_flattened and self.eval_dataset is not None:
            names = list(self.eval_dataset) if isinstance(self.eval_dataset, dict) else ["eval"]
            self.unpack_run.counts.extend(collator.truncation_counts(name) for name in names)

    def _vision_packing_collator(self) -> DataCollatorForVisionPacking:
        """TRL's vision collator, run without truncation (the packing collator truncates text only, never an
        image), each batch one packed row; the model's multi-axis positions computed with it where its text model
        takes them."""
        from unpack_trainer.anatomy.vision import sample_positions_of

        process = _trl_compat.vision_collator_without_truncation(self.unpack_run.vision_collator)
        positions = sample_positions_of(self.model) if self.unpack_decision.patch else None
        return DataCollatorForVisionPacking(
            process=process,
            processor=self.processing_class,
            max_length=self.args.max_length,
            positions=positions,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
            seq_info=self.unpack_decision.patch,  # the patched hook adopts it: no metadata read back from the GPU
            sequence_shards=self.unpack_run.sequence_shards,
        )

    def _pack_vision_training_set(self) -> None:
        """``packing=True`` on an image dataset: every example processed once for its length, then rows chosen as
        for text (``packing_order``, ``max_samples_per_row``, ``packing_window``) and read by the collator row by
        row. A stream has no lengths ahead: each batch is flattened into one row instead (logged once)."""
        args = self.args
        dataset = self.train_dataset
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            log_once(
                logger,
                logging.WARNING,
                "packing=True with a streamed image dataset: rows cannot be packed ahead (every example's length is "
                "needed first), so each batch is flattened into one packed row instead (padding-free).",
            )
            return
        if args.max_length is None:
            raise ValueError("When packing is enabled, `max_length` can't be `None`.")
        rows = pack_vision_dataset(
            dataset,
            self.data_collator,
            args.max_length,
            seed=args.seed,
            order=args.packing_order,
            max_samples_per_row=args.max_samples_per_row,
            window=args.packing_window if args.packing_order == "windowed" else None,
            rows_multiple_of=args.per_device_train_batch_size * args.world_size if args.world_size > 1 else 1,
        )
        self.unpack_run.vision_train = dataset
        self.train_dataset = rows
        lengths = np.asarray(rows.lengths, dtype=np.int64)
        batch = args.per_device_train_batch_size * lengths.size / max(len(rows), 1)
        self.unpack_stats.update(
            samples=int(lengths.size),
            tokens=int(lengths.sum()),
            rows=len(rows),
            efficiency=int(lengths.sum()) / max(len(rows) * args.max_length, 1),
            padded_batch_size=batch,
            estimated_speedup=estimated_speedup(lengths, batch, seed=args.seed),
        )

    def _set_signature_columns_if_needed(self) -> None:
        """TRL's, and the keys the vision packing collator reads on an image dataset (where each example comes from;
        a row packed ahead: its examples and their lengths), which the Trainer would otherwise take off each item
        before the collator sees it."""
        super()._set_signature_columns_if_needed()
        keys: tuple[str, ...] = ()
        if self.unpack_run.vision_collator is not None:
            keys = (VISION_SOURCE_KEY,)
        if self.unpack_run.vision_train is not None:
            keys = (VISION_ROWS_KEY, SEQ_LENGTHS_COLUMN, VISION_SOURCE_KEY)
        if keys:
            self._signature_columns = [
                *self._signature_columns,
                *(key for key in keys if key not in self._signature_columns),
            ]

    def _get_dataloader(self, dataset: Any, description: str, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, and where the vision packing collator reads the batches, each example with its dataset's
        name (``"train"``, ``"eval"``, an evaluation dict's key, ``"test"``) and its index, for the collator's errors
        and counts ([`unpack_trainer.data.vision.with_sources`]: a view of the dataset, nothing copied; the collator
        takes the key off before TRL's processing): unused columns taken off first, as the Trainer does, and the
        sampler drawn on the dataset the Trainer would have read, so the batches are the same."""
        collator = batch_collator(self)
        if dataset is None or not isinstance(collator, DataCollatorForVisionPacking):
            return super()._get_dataloader(dataset, description, *args, **kwargs)
        name = "train" if kwargs.get("is_training") else kwargs.get("dataloader_key") or description.lower()
        if isinstance(dataset, Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        sourced = with_sources(dataset, name)
        sampler_fn = kwargs.get("sampler_fn")
        if sampler_fn is not None and sourced is not dataset:
            kwargs["sampler_fn"] = lambda _: sampler_fn(dataset)
        return super()._get_dataloader(sourced, description, *args, **kwargs)

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
        is_train = dataset_name == "train" and not self.unpack_run.train_prepared  # an eval split may be named "train"
        self.unpack_run.train_prepared = True
        if self.unpack_decision.mode == "stock":
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        packed_ahead = SEQ_LENGTHS_COLUMN in column_names(dataset)
        flatten = self.unpack_decision.mode in ("pack", "padding_free") and (
            is_train or self.unpack_run.eval_flattened
        )
        if not flatten:
            if self.unpack_run.user_collator:  # the user's collator decides what seq_lengths mean
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
                    self.unpack_run.counts.append(counts)
                    if is_train:
                        self.unpack_stats["truncation"] = counts
        if packing:
            if max_length is None:
                raise ValueError("When packing is enabled, `max_length` can't be `None`.")
            if isinstance(dataset, IterableDataset):
                return pack_iterable_dataset(dataset, max_length, buffer_size=args.packing_buffer_size, seed=args.seed)
        stats: dict[str, Any] = {}
        if packing or isinstance(dataset, Dataset):
            lengths = sample_lengths(dataset, packed_ahead)  # of the samples, in the dataset's order
            if packing:
                dataset = pack_dataset(
                    dataset,
                    max_length,
                    seed=args.seed,
                    order=args.packing_order,
                    max_samples_per_row=args.max_samples_per_row,
                    window=args.packing_window if args.packing_order == "windowed" else None,
                    # every process gets as many full batches: no row repeated to even them out
                    rows_multiple_of=args.per_device_train_batch_size * args.world_size if args.world_size > 1 else 1,
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

    # ------------------------------------------------------------------------------------------------ loss

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's loss, or with ``loss_normalization="sample"`` the sum over samples of each sample's mean token loss,
        divided by the number of samples in the step (``num_items_in_batch``, see [`get_batch_samples`]) or, outside
        a training step, in the batch."""
        if not self.unpack_run.sample_loss:
            if getattr(self, "unpack_loss_kernel", "trl") != "liger":
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
            liger_calls = []

            def counted(*args: Any, **kwargs: Any) -> Any:
                out = model(*args, **kwargs)
                liger_calls.append(getattr(out, LIGER_OUTPUT_MARK, False))
                return out

            result = super().compute_loss(
                counted, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            if any(liger_calls):  # TRL logged the zeros Liger's kernel returns for the entropy it does not compute
                _trl_compat.drop_last_metric(self, "entropy")
            return result
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
