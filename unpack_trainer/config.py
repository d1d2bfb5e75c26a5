"""``SFTConfig``: TRL's config with ``padding_free`` left unset by default, so the trainer can decide."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trl

ConfigT = TypeVar("ConfigT")


@dataclass
class SFTConfig(trl.SFTConfig):
    r"""
    [`trl.SFTConfig`] for [`unpack_trainer.SFTTrainer`]. Every TRL field keeps its meaning; these differ or are added:

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether to flatten each batch into one row without padding (positions restart per example, no example
            attends to another). `None` lets the trainer decide: it turns padding-free on when the model, collator and
            data allow it and logs why (set `UNPACK_DISABLE_AUTO_PADDING_FREE=1` to keep padded batches). `False` is
            never overridden. With `packing=True`, rows are always padding-free (`False` then has no effect, which a
            warning says once). Unlike stock TRL, `max_length` is
            enforced (truncation exactly as padded training does), on every attention backend. The automatic choice
            stays off with `neftune_noise_alpha` (its noise scale depends on the row length), and evaluation stays
            padded when `compute_metrics` / `preprocess_logits_for_metrics` is set (unless `eval_packing=True` or
            `padding_free=True`), so that metrics see one row per example.
        packing_buffer_size (`int`, *optional*, defaults to `10000`):
            With `packing=True` and an `IterableDataset`, how many samples are buffered and packed together with
            best-fit decreasing; rows less than 99.5% full are held back (at most 2 rounds) to be topped up by later
            samples. Larger buffers pack tighter (99.97% at 10,000 samples of ~180 tokens into rows of 2,048) and use
            more memory. Ignored for a map-style `Dataset`, which is packed globally.

    > Parameters that control how packed rows and optimizer steps are composed (map-style datasets)

    Args:
        packing_order (`str`, *optional*, defaults to `"windowed"`):
            Which samples share a row, with `packing=True`. `"windowed"`: samples are taken in a random order (seeded
            with `seed`), each into the best-fitting of the last 4 open rows, so a row holds samples that follow
            each other in that order, whatever their lengths, as a random padded batch does; rows are about 99%
            full (1% more rows than best-fit decreasing). On the quality benchmark (README, "Quality") this is the
            order whose held-out loss matches padded training. `"shuffled"`: samples placed in a random order with
            best fit over every open row, the shortest ones kept back to fill the gaps; rows at least 99.5% full,
            but a long sample's row is topped up with the shortest samples. `"decreasing"`: best-fit decreasing,
            longest first (fewest rows): long samples share rows with the short ones that fill their gaps, medium
            ones share rows, and the last rows hold only short samples. All pack globally; an `IterableDataset` is
            always packed by its buffer (see `packing_buffer_size`).
        max_samples_per_row (`int` or `None`, *optional*, defaults to `None`):
            With `packing=True` and `packing_order="shuffled"`, the most samples one packed row may hold (rows close
            once they reach it, so they may be less full). `None`: no bound.
        loss_normalization (`str`, *optional*, defaults to `"token"`):
            How the training loss of an optimizer step is averaged. `"token"` (TRL's behavior): the mean over every
            trained token of the step (all gradient-accumulation micro-batches and processes), so a sample weighs
            as much as its number of trained tokens. `"sample"`: the mean over the step's samples of each sample's
            mean token loss, so every sample weighs the same whatever its length; a packed row counts each of its
            samples, a padded or padding-free batch each of its examples. Applies to training and evaluation loss
            (`eval_loss`: the mean over the evaluation set's samples, each evaluation batch weighed by its samples).
            Not supported with `loss_type="dft"`, label smoothing or a custom `compute_loss_func`. On the quality
            benchmark's first, 2,000-sample run (README), `"sample"` raised the packed held-out loss per token by 0.12
            against padded training.
        balance_samples_per_step (`bool`, *optional*, defaults to `True`):
            With `packing=True` and several packed rows per optimizer step (`per_device_train_batch_size *
            gradient_accumulation_steps * processes > 1`), compose each step from rows whose sample counts balance
            out (rows with many short samples with rows of few long ones) instead of rows drawn at random, so every
            step holds about the same number of samples. The order of the steps is shuffled with `seed` each epoch.
            With one row per step it has nothing to balance (the rows are then drawn at random as usual). With
            best-fit rows (`packing_order="shuffled"`) it brought the packed held-out loss from +0.035 to +0.004 of
            the padded run's on 2,000 samples, but not at full data (+0.040, README). The default (windowed rows,
            balanced) is what the benchmark measured at parity; windowed rows without it were not measured.
    """

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Flatten each batch into one row without padding. None (default) lets the trainer decide and log "
            "why; False is never overridden. With packing=True rows are always padding-free."
        },
    )
    packing_buffer_size: int = field(
        default=10_000,
        metadata={"help": "With packing=True and an IterableDataset: number of samples buffered and packed together."},
    )

    packing_order: str = field(
        default="windowed",
        metadata={
            "help": "With packing=True: 'windowed' fills each row with samples that follow each other in a seeded "
            "random order (best fit over the last 4 open rows, 1 percent more rows than best-fit decreasing); "
            "'shuffled' mixes lengths at random with best fit over every row, the shortest samples kept back as "
            "fillers (rows at least 99.5 percent full); "
            "'decreasing' is plain best-fit decreasing (rows grouped by length).",
            "choices": ["windowed", "shuffled", "decreasing"],
        },
    )
    max_samples_per_row: int | None = field(
        default=None,
        metadata={"help": "With packing=True: the most samples one packed row may hold. None: no bound."},
    )
    loss_normalization: str = field(
        default="token",
        metadata={
            "help": "'token': the loss of a step is the mean over its trained tokens (TRL's behavior); 'sample': the "
            "mean over its samples of each sample's mean token loss (every sample weighs the same).",
            "choices": ["token", "sample"],
        },
    )
    balance_samples_per_step: bool = field(
        default=True,
        metadata={
            "help": "With packing=True and several rows per optimizer step: compose each step from rows whose sample "
            "counts balance out, so every step holds about the same number of samples."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.packing_order not in ("windowed", "shuffled", "decreasing"):
            raise ValueError(
                f"`packing_order` must be 'windowed', 'shuffled' or 'decreasing', got {self.packing_order!r}."
            )
        if self.max_samples_per_row is not None and self.max_samples_per_row < 1:
            raise ValueError(f"`max_samples_per_row` must be at least 1 or None, got {self.max_samples_per_row}.")
        if self.max_samples_per_row is not None and self.packing_order != "shuffled":
            raise ValueError(
                "`max_samples_per_row` needs `packing_order='shuffled'` (the windowed packer and best-fit decreasing "
                "have no bound); "
                f"got packing_order={self.packing_order!r}."
            )
        if self.loss_normalization not in ("token", "sample"):
            raise ValueError(f"`loss_normalization` must be 'token' or 'sample', got {self.loss_normalization!r}.")
        if self.packing_buffer_size <= 0:
            raise ValueError(f"`packing_buffer_size` must be positive, got {self.packing_buffer_size}.")


def convert_config(args: Any, config_class: type[ConfigT]) -> ConfigT:
    """``args`` (any ``TrainingArguments``, e.g. a plain ``trl.SFTConfig``) as ``config_class`` (one of ours).

    Every field ``config_class`` shares with ``args`` is copied (tokens included, which ``to_dict`` hides); the fields
    only ours have take their documented defaults. A plain TRL config cannot tell an explicit ``padding_free=False``
    from its default, so its ``False`` becomes ``None`` (not set: the trainer decides); ``True`` stays ``True``. An
    instance of ``config_class`` is returned as is.

    Example:
        ``convert_config(trl.SFTConfig("out", packing=True), SFTConfig)`` -> ``SFTConfig`` with ``packing=True``,
        ``packing_order="windowed"``, ``balance_samples_per_step=True``, ``padding_free=None``.
    """
    if isinstance(args, config_class):
        return args
    values = args.to_dict()
    for name in values:
        if name.endswith("_token"):  # to_dict writes "<HUB_TOKEN>" for hub_token, "<EOS_TOKEN>" for eos_token, ...
            values[name] = getattr(args, name)
    names = {f.name for f in dataclasses.fields(config_class) if f.init}
    values = {name: value for name, value in values.items() if name in names}
    if "padding_free" in names and values.get("padding_free") is False:
        values["padding_free"] = None
    return config_class(**values)
