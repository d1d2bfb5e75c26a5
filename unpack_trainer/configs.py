"""The config of every trainer: TRL's own config class with ``padding_free`` left unset by default (so the trainer
can decide) and the fields packing adds, one class per entry of [`unpack_trainer.trainers.TRAINERS`].

Every config lives here, and only configs (with [`convert_config`], which turns a plain TRL config into ours): the
command line builds its parsers from these classes (``unpack-trainer <command> --help``), so this module imports TRL's
configs and nothing of the trainers, models or kernels.

- [`SFTConfig`] (``trl.SFTConfig``): packing order, window, per-row bound, loss normalization, the loss kernel,
  balanced steps;
- [`DPOConfig`] (``trl.DPOConfig``) and [`RewardConfig`] (``trl.RewardConfig``): packed preference pairs,
  ``prefix_sharing``;
- [`GRPOConfig`] / [`RLOOConfig`] (``trl.GRPOConfig`` / ``trl.RLOOConfig``): packed training forwards,
  ``prefix_sharing``.
- [`DistillationConfig`] (``trl.DistillationConfig``): the student's and the teacher's forwards on one packed row,
  ``prefix_sharing``.
- [`KTOConfig`] (``trl.KTOConfig``): packed unpaired preference batches, ``prefix_sharing``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trl

from unpack_trainer.decision import env_flag, explicit_padding_free

__all__ = [
    "DPOConfig",
    "GRPOConfig",
    "RLOOConfig",
    "RewardConfig",
    "SFTConfig",
    "convert_config",
    "DistillationConfig",
    "KTOConfig",
]

ConfigT = TypeVar("ConfigT")

_DECIDES = "None (default) lets the trainer decide and log why; False is never overridden."


def _padding_free_field(help: str) -> Any:
    """``padding_free``: ``None`` by default (the trainer decides); ``help`` says what it turns on."""
    return field(default=None, metadata={"help": f"{help} {_DECIDES}"})


def _prefix_sharing_field(help: str) -> Any:
    """``prefix_sharing``: ``True`` by default; ``help`` says what runs once."""
    return field(default=True, metadata={"help": help})


_PAIRS_PADDING_FREE = "Run the pairs of each batch as one packed row without padding (exact: TRL's loss and metrics)."


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
            with `seed`), each into the best-fitting of the last few open rows (see `packing_window`), so a row
            holds samples that follow each other in that order, whatever their lengths, as a random padded batch
            does; at most 1% more rows than best-fit decreasing (docs/quality.md, "Packing efficiency"). On the quality
            benchmark (docs/quality.md) this is the
            order whose held-out loss matches padded training. `"shuffled"`: samples placed in a random order with
            best fit over every open row, the shortest ones kept back to fill the gaps; rows at least 99.5% full,
            but a long sample's row is topped up with the shortest samples. `"decreasing"`: best-fit decreasing,
            longest first (fewest rows): long samples share rows with the short ones that fill their gaps, medium
            ones share rows, and the last rows hold only short samples. All pack globally; an `IterableDataset` is
            always packed by its buffer (see `packing_buffer_size`).
        packing_window (`int` or `None`, *optional*, defaults to `None`):
            With `packing=True` and `packing_order="windowed"`, how many rows are open at once. `None`: the window
            starts at 4 and doubles only as far as needed for at most 1% more rows than best-fit decreasing (if even
            every open row is not enough, the shortest samples are kept back to fill the gaps); the choice is logged
            once and shown by `unpack-trainer analyze`. An integer fixes the window (`4` is the default before it
            widened by itself), with no bound on the rows: 4 open rows take 0.8% more rows than best-fit decreasing
            on lognormal lengths of median 180 in rows of 2,048 tokens, but 14.8% on uniform lengths of 700 to
            1,400.
        max_samples_per_row (`int` or `None`, *optional*, defaults to `None`):
            With `packing=True` and `packing_order="shuffled"`, the most samples one packed row may hold (rows close
            once they reach it, so they may be less full). `None`: no bound.
        loss_normalization (`str`, *optional*, defaults to `"token"`):
            How the training loss of an optimizer step is averaged. `"token"` (TRL's behavior on most models): the
            mean over every trained token of the step (all gradient-accumulation micro-batches and processes), so a
            sample weighs as much as its number of trained tokens, on every model (stock TRL averages each
            micro-batch's own mean on a class that declares `accepts_loss_kwargs = False`, e.g. Qwen2.5-VL).
            `"sample"`: the mean over the step's samples of each sample's mean token loss, so every sample weighs the
            same whatever its length; a packed row counts each of its samples, a padded or padding-free batch each of
            its examples. Applies to training and evaluation loss
            (`eval_loss`: the mean over the evaluation set's samples, each evaluation batch weighed by its samples).
            Not supported with `loss_type="dft"`, label smoothing or a custom `compute_loss_func`. On the quality
            benchmark's first, 2,000-sample run (docs/quality.md), `"sample"` raised the packed held-out loss per token by 0.12
            against padded training.
        loss_kernel (`str` or `None`, *optional*, defaults to `None`):
            The kernel that computes the loss of packed and padding-free rows (with the attention patch). `"trl"`:
            TRL's chunked fused LM head (its default loss, no full logits). `"liger"`: Liger-Kernel's fused linear
            cross-entropy (`pip install liger-kernel`; CUDA), which computes the LM head's gradients in the forward
            instead of projecting again in the backward (three of the head's four matrix multiplies); needs TRL's
            token loss (`loss_type="nll"`, `loss_normalization="token"`, no label smoothing or `compute_loss_func`),
            does not log the `entropy` metric, and raises at start where it cannot run. `None` lets the trainer
            decide: the environment variable `UNPACK_LOSS_KERNEL` (`trl` / `liger`) when set, else the kernel
            measured faster on the device (today TRL's everywhere). Padded batches always use TRL's.
        balance_samples_per_step (`bool`, *optional*, defaults to `True`):
            With `packing=True` and several packed rows per optimizer step (`per_device_train_batch_size *
            gradient_accumulation_steps * processes > 1`), compose each step from rows whose sample counts balance
            out (rows with many short samples with rows of few long ones) instead of rows drawn at random, so every
            step holds about the same number of samples. The order of the steps is shuffled with `data_seed` (or
            `seed` when it is `None`, as transformers does) each epoch. With several data-parallel processes, every
            process of a step also gets rows of the same cost (`tokens + attention_cost_ratio * sum of squared
            sample lengths`) and about the same number of samples, so that no process waits for a slower one, and
            every row is trained exactly once per epoch (rows are split so that every process gets as many full
            batches; none is repeated). An explicit `train_sampling_strategy` other than `"random"` is used as set
            instead (logged once).
            With one row per step it has nothing to balance (the rows are then drawn at random as usual). With
            best-fit rows (`packing_order="shuffled"`) it brought the packed held-out loss from +0.035 to +0.004 of
            the padded run's on 2,000 samples, but not at full data (+0.040, docs/quality.md). The default (windowed rows,
            balanced) is what the benchmark measured at parity; windowed rows without it were not measured.
        attention_cost_ratio (`float` or `None`, *optional*, defaults to `None`):
            With `balance_samples_per_step` and several data-parallel processes: `b / a` in the cost model `a *
            tokens + b * sum(L_i ** 2)` of a packed row (`L_i` its sample lengths: attention grows with their
            squares) that every process of a step gets equal. `None`: estimated from the model config's shapes as
            matrix-multiply FLOPs, `1 / (2 * hidden + 2 * kv_dim + 3 * intermediate)` (Llama-3-8B: attention 3.7%
            of a one-sample row of 2,048 tokens, 38% at 32,768); attention kernels run below the matrix multiplies'
            speed, so a value measured on your GPU (time rows of equal tokens and different sample lengths) is
            better. `0` balances tokens only.
    """

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": f"Flatten each batch into one row without padding. {_DECIDES} With packing=True rows are always "
            "padding-free."
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
            "random order (best fit over the last few open rows, at most 1 percent more rows than best-fit "
            "decreasing); "
            "'shuffled' mixes lengths at random with best fit over every row, the shortest samples kept back as "
            "fillers (rows at least 99.5 percent full); "
            "'decreasing' is plain best-fit decreasing (rows grouped by length).",
            "choices": ["windowed", "shuffled", "decreasing"],
        },
    )
    packing_window: int | None = field(
        default=None,
        metadata={
            "help": "With packing=True and packing_order='windowed': the number of rows open at once. None (default): "
            "starts at 4 and widens only as far as needed for at most 1 percent more rows than best-fit decreasing "
            "(logged); an integer fixes it."
        },
    )
    max_samples_per_row: int | None = field(
        default=None,
        metadata={"help": "With packing=True: the most samples one packed row may hold. None: no bound."},
    )
    loss_normalization: str = field(
        default="token",
        metadata={
            "help": "'token': the loss of a step is the mean over its trained tokens (TRL's behavior on most models); "
            "'sample': the mean over its samples of each sample's mean token loss (every sample weighs the same).",
            "choices": ["token", "sample"],
        },
    )
    loss_kernel: str | None = field(
        default=None,
        metadata={
            "help": "The kernel of the loss of packed rows: 'trl' (TRL's chunked fused LM head) or 'liger' "
            "(Liger-Kernel's fused linear cross-entropy, LM head gradients in the forward; CUDA). None: the "
            "environment variable UNPACK_LOSS_KERNEL when set, else the one measured faster (TRL's today).",
            "choices": ["trl", "liger"],
        },
    )
    balance_samples_per_step: bool = field(
        default=True,
        metadata={
            "help": "With packing=True and several rows per optimizer step: compose each step from rows whose sample "
            "counts balance out, so every step holds about the same number of samples."
        },
    )

    attention_cost_ratio: float | None = field(
        default=None,
        metadata={
            "help": "With packing=True, balanced steps and several processes: b/a in the cost a * tokens + b * sum of "
            "squared sample lengths that every process of a step gets equal. None: from the model config's shapes "
            "(matrix-multiply FLOPs, unpack_trainer.data.sampler.attention_cost_ratio)."
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
        if self.packing_window is not None and self.packing_window < 1:
            raise ValueError(f"`packing_window` must be at least 1 or None, got {self.packing_window}.")
        if self.packing_window is not None and self.packing_order != "windowed":
            raise ValueError(
                f"`packing_window` needs `packing_order='windowed'`; got packing_order={self.packing_order!r}."
            )
        if self.attention_cost_ratio is not None and not self.attention_cost_ratio >= 0:
            raise ValueError(f"`attention_cost_ratio` must be at least 0 or None, got {self.attention_cost_ratio}.")
        if self.loss_normalization not in ("token", "sample"):
            raise ValueError(f"`loss_normalization` must be 'token' or 'sample', got {self.loss_normalization!r}.")
        if self.loss_kernel not in (None, "trl", "liger"):
            raise ValueError(f"`loss_kernel` must be 'trl', 'liger' or None, got {self.loss_kernel!r}.")
        if self.packing_buffer_size <= 0:
            raise ValueError(f"`packing_buffer_size` must be positive, got {self.packing_buffer_size}.")


@dataclass
class DPOConfig(trl.DPOConfig):
    r"""
    [`trl.DPOConfig`] for [`unpack_trainer.DPOTrainer`]. Every TRL field keeps its meaning; these differ or are added:

    > Parameters that control packing of preference pairs

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether to run the pairs of each batch as one packed row without padding, instead of TRL's padded batch of
            `2 * per_device_train_batch_size` rows (chosen rows, then rejected rows). Pairs never attend to each other,
            and the loss, every logged metric and every gradient are those of TRL's padded batch. `None` lets the
            trainer decide: it turns it on when the model, collator and data allow it and logs why (set
            `UNPACK_DISABLE_AUTO_PADDING_FREE=1` to keep padded batches); it stays off for a custom `data_collator`,
            a vision dataset, prompt-learning PEFT or a model the packing patch refuses. `False` is never overridden
            and trains exactly as `trl.DPOTrainer` (TRL 1.16 turns its own `padding_free=True` off).
        packing (`bool`, *optional*, defaults to `False`):
            Asks for the packed rows explicitly (logged as a request if it cannot be honoured). Pairs are packed per
            batch, as with `padding_free`: each optimizer step keeps TRL's number of pairs, over which its loss is a
            mean.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run each prompt once: a pair is one segment `[prompt, chosen, rejected]` in which chosen
            and rejected both continue from the prompt (positions, attention, and the first completion token's
            prediction from the prompt's last token) and never see each other. `False` packs `[prompt, chosen]` and
            `[prompt, rejected]` as two ordinary samples. With `truncation_mode="keep_end"`, a truncated pair is
            packed unshared.
    """

    padding_free: bool | None = _padding_free_field(_PAIRS_PADDING_FREE)
    packing: bool = field(
        default=False,
        metadata={"help": "Ask for packed rows explicitly (pairs are packed per batch, as with padding_free)."},
    )
    prefix_sharing: bool = _prefix_sharing_field(
        "With packed rows, run each prompt once for its chosen and rejected completions."
    )


_DOC = r"""
    [`trl.{name}`] for [`unpack_trainer.{trainer}`]. Every TRL field keeps its meaning; these are added:

    > Parameters that control packing of the training forwards

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether the forwards that compute per-token log-probabilities (the policy with gradients, the old policy
            with `num_iterations > 1` or importance sampling, the reference model with `beta > 0`) run each batch as
            one packed row without padding, instead of TRL's `(completions, prompt + completion)` batch with
            left-padded prompts and right-padded completions. Completions never attend to each other, and the loss,
            every logged metric and every gradient are those of TRL's padded batch; generation is untouched. `None`
            lets the trainer decide: it turns it on when the model and the data allow it (not for vision inputs, a
            processor, prompt-learning PEFT or a model the packing patch refuses), logs why, and per forward runs
            TRL's padded batch instead where packing would not save enough tokens to be faster. `False` is never
            overridden and trains exactly as `trl.{trainer}`.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run each distinct prompt of a forward once, its completions (the `num_generations` of
            a group, wherever they are in the batch) as branches that continue from it (positions, attention, and
            each first completion token's prediction from the prompt's last token) and never see each other.
            `False` packs each completion after its own copy of its prompt.
"""


_RL_PADDING_FREE = (
    "Run the training forwards (policy, old policy, reference) as packed rows without padding (exact: TRL's loss and "
    "metrics)."
)
_RL_PREFIX_SHARING = "With packed rows, run each distinct prompt once for all its completions."


def _post_init_under_ulysses(config: Any, post_init: Callable[[], None]) -> None:
    """Run TRL's ``post_init`` of an online ``config`` (GRPO, RLOO, distillation). TRL's refuses
    ``parallelism_config`` with ``sp_size > 1`` (TRL's trainer cannot cut the rows it builds inside its step); ours
    cut them ([`unpack_trainer.GRPOTrainer`], [`unpack_trainer.DistillationTrainer`]), so DeepSpeed Ulysses
    (``sp_size``; torch's ``cp_size`` stays refused) passes TRL's check, and the trainer checks what else the run must
    hold (under ``UNPACK_DISABLE=1``, TRL's refusal). Where the config has ``steps_per_generation`` (GRPO, RLOO), it
    is 1 when left unset (with ``generation_batch_size``), not TRL's ``gradient_accumulation_steps``: DeepSpeed's data
    loader hands the sequence-parallel group each process's batch in turn, so each step generates for its own batch
    (a value set stays, and the trainer refuses it with the reason)."""
    parallelism = config.parallelism_config
    ulysses = parallelism is not None and not parallelism.cp_enabled and parallelism.sp_enabled
    ulysses = ulysses and not env_flag(os.environ, "UNPACK_DISABLE")  # disabled: TRL's own refusal
    if ulysses:
        config.parallelism_config = None  # read by TRL's check only
        unset = (getattr(config, "steps_per_generation", 0), getattr(config, "generation_batch_size", None))
        if unset == (None, None):
            config.steps_per_generation = 1
    try:
        post_init()
    finally:
        if ulysses:
            config.parallelism_config = parallelism


@dataclass
class GRPOConfig(trl.GRPOConfig):
    __doc__ = _DOC.format(name="GRPOConfig", trainer="GRPOTrainer")

    padding_free: bool | None = _padding_free_field(_RL_PADDING_FREE)
    prefix_sharing: bool = _prefix_sharing_field(_RL_PREFIX_SHARING)

    def __post_init__(self) -> None:
        _post_init_under_ulysses(self, super().__post_init__)


@dataclass
class RLOOConfig(trl.RLOOConfig):
    __doc__ = _DOC.format(name="RLOOConfig", trainer="RLOOTrainer")

    padding_free: bool | None = _padding_free_field(_RL_PADDING_FREE)
    prefix_sharing: bool = _prefix_sharing_field(_RL_PREFIX_SHARING)

    def __post_init__(self) -> None:
        _post_init_under_ulysses(self, super().__post_init__)


@dataclass
class RewardConfig(trl.RewardConfig):
    r"""
    [`trl.RewardConfig`] for [`unpack_trainer.RewardTrainer`]. Every TRL field keeps its meaning; these are added:

    > Parameters that control packing of preference pairs

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether to run the pairs of each batch as one packed row without padding, instead of TRL's padded batch
            of `2 * per_device_train_batch_size` rows (chosen rows, then rejected rows). Pairs never attend to each
            other, each sequence is scored at its own last token, and the loss, every logged metric and every
            gradient are those of TRL's padded batch. `None` lets the trainer decide: it turns it on when the model,
            collator and data allow it and logs why (set `UNPACK_DISABLE_AUTO_PADDING_FREE=1` to keep padded
            batches); it stays off for a custom `data_collator`, prompt-learning PEFT, a model the packing patch
            refuses, or a model whose score head cannot be read per packed sequence (logged with the reason).
            `False` is never overridden and trains exactly as `trl.RewardTrainer`.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run the tokens chosen and rejected start with once: a pair is one segment
            `[shared, chosen', rejected']` in which both continue the shared tokens (positions and attention) and
            never see each other. The shared tokens are the longest common start of the two tokenized sequences
            (the prompt, explicit or implicit, and what the completions share), at most all but one token of the
            shorter one. `False` packs `[prompt, chosen]` and `[prompt, rejected]` as two ordinary samples.
    """

    padding_free: bool | None = _padding_free_field(_PAIRS_PADDING_FREE)
    prefix_sharing: bool = _prefix_sharing_field(
        "With packed rows, run the tokens chosen and rejected start with once per pair."
    )


@dataclass
class DistillationConfig(trl.DistillationConfig):
    r"""
    [`trl.DistillationConfig`] for [`unpack_trainer.DistillationTrainer`]. Every TRL field keeps its meaning; these are
    added:

    > Parameters that control packing of the student's and the teacher's forwards

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether the student's forward (with gradients) and the teacher's (without) run each micro-batch as one
            packed row without padding, the same row for both, instead of TRL's `(prompts, prompt + completion)`
            batch with left-padded prompts and right-padded completions. Samples never attend to each other, and the
            loss (the generalized JSD of every `beta`, on completion tokens only), every logged metric and every
            gradient are those of TRL's padded batch; generation is untouched. `None` lets the trainer decide: it
            turns it on when the student allows it (image prompts on the vision-language families verified for
            packed image rows, each prompt's images once; not for a vision-language model not verified, images on a
            text-only model, prompt-learning PEFT or a model the packing patch refuses), logs why, and per
            micro-batch runs TRL's padded batch instead where packing would not save enough tokens to be faster. A
            teacher the patch refuses runs TRL's padded batch (logged once with the reason) while the student packs.
            `False` is never overridden and trains exactly as `trl.DistillationTrainer`.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run each distinct prompt of a micro-batch once (rows whose prompt ids, and images, are
            equal), their completions as branches that continue from it and never see each other. TRL generates one completion
            per prompt, so this saves tokens only where a batch holds a prompt more than once. `False` packs each
            completion after its own copy of its prompt.
    """

    padding_free: bool | None = _padding_free_field(
        "Run the student's and the teacher's forwards on one packed row without padding (exact: TRL's loss and "
        "metrics)."
    )
    prefix_sharing: bool = _prefix_sharing_field(_RL_PREFIX_SHARING)

    def __post_init__(self) -> None:
        _post_init_under_ulysses(self, super().__post_init__)


@dataclass
class KTOConfig(trl.KTOConfig):
    r"""
    [`trl.KTOConfig`] for [`unpack_trainer.KTOTrainer`]. Every TRL field keeps its meaning; these are added:

    > Parameters that control packing of unpaired preference batches

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether to run each batch as packed rows without padding, instead of TRL's padded batch of
            `per_device_train_batch_size` rows `[prompt, completion]` (and, with `loss_type="kto"`, as many KL rows
            `[prompt, previous example's completion]`), each padded to the batch's longest. Examples never attend to
            each other, and the loss, the KL estimate, every logged metric and every gradient are those of TRL's
            padded batch. `None` lets the trainer decide: it turns it on when the model, collator and data allow it and
            logs why (set `UNPACK_DISABLE_AUTO_PADDING_FREE=1` to keep padded batches); it stays off for a custom
            `data_collator`, a vision dataset, prompt-learning PEFT or a model the packing patch refuses. `False` is
            never overridden and trains exactly as `trl.KTOTrainer`.
        packing (`bool`, *optional*, defaults to `False`):
            Asks for the packed rows explicitly (logged as a request if it cannot be honoured). Examples are packed per
            batch, as with `padding_free`: each optimizer step keeps TRL's examples (and TRL's KL pairing, which needs
            `train_sampling_strategy="sequential"`).
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run each distinct prompt of a forward once: its completions (the examples' with
            gradient; the KL completions without, in the policy's KL forward; both in the reference's forward) are
            branches that continue from it (positions, attention, and each first completion token's prediction from
            the prompt's last token) and never see each other, and a `(prompt, completion)` that occurs twice in a
            forward runs once. `False` packs every sequence after its own copy of its prompt.
    """

    padding_free: bool | None = _padding_free_field(
        "Run each batch as packed rows without padding (exact: TRL's loss, KL estimate and metrics)."
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Ask for packed rows explicitly (examples are packed per batch, as with padding_free)."},
    )
    prefix_sharing: bool = _prefix_sharing_field(
        "With packed rows, run each distinct prompt of a forward once for all its completions (and KL completions)."
    )


def convert_config(args: Any, config_class: type[ConfigT]) -> ConfigT:
    """``args`` (any ``TrainingArguments``, e.g. a plain ``trl.SFTConfig``) as ``config_class`` (one of ours).

    Every field ``config_class`` shares with ``args`` is copied (tokens included, which ``to_dict`` hides); the fields
    only ours have take their documented defaults. An instance of the TRL config ``config_class`` extends is copied
    as it is, its ``__post_init__`` not run again (TRL's derives fields from others and refuses them both set, e.g.
    ``GRPOConfig``'s ``generation_batch_size`` and ``steps_per_generation``). ``padding_free`` is what the source
    config says
    ([`unpack_trainer.decision.explicit_padding_free`]): a plain TRL config cannot tell an explicit ``False`` from its
    default, so its ``False`` becomes ``None`` (not set: the trainer decides); ``True`` stays ``True``. An instance of
    ``config_class`` is returned as is.

    Example:
        ``convert_config(trl.SFTConfig("out", packing=True), SFTConfig)`` -> ``SFTConfig`` with ``packing=True``,
        ``packing_order="windowed"``, ``balance_samples_per_step=True``, ``padding_free=None``.
    """
    if isinstance(args, config_class):
        return args
    if isinstance(args, config_class.__bases__[0]):
        converted = copy.copy(args)
        converted.__class__ = config_class
        for declared in dataclasses.fields(config_class):
            if declared.name not in vars(args):
                factory = declared.default_factory
                value = declared.default if factory is dataclasses.MISSING else factory()
                setattr(converted, declared.name, value)
        if "padding_free" in vars(converted):
            converted.padding_free = explicit_padding_free(args)
        return converted
    values = args.to_dict()
    for name in values:
        if name.endswith("_token"):  # to_dict writes "<HUB_TOKEN>" for hub_token, "<EOS_TOKEN>" for eos_token, ...
            values[name] = getattr(args, name)
    names = {f.name for f in dataclasses.fields(config_class) if f.init}
    values = {name: value for name, value in values.items() if name in names}
    if "padding_free" in names and "padding_free" in values:
        values["padding_free"] = explicit_padding_free(args)
    return config_class(**values)
