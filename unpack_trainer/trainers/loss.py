"""The loss of a packed trainer: its normalization over a step, per-sample weighting and the LM head's kernel.

- [`enable_loss_normalization`] / [`step_sample_count`]: ``loss_normalization`` (our configs'; TRL's token loss for a
  config without it): ``"sample"`` turns the per-sample loss on and counts the samples of each accumulated step,
  ``"token"`` leaves the loss to the trainer's ``_enable_token_loss`` hook;
- [`sample_weights`]: per-sample loss weighting (``loss_normalization="sample"``): every sample weighs the same,
  whatever its length.
- [`choose_loss_kernel`]: which kernel computes the loss of packed rows (``loss_kernel``): TRL's chunked fused LM head
  (``"trl"``) or Liger-Kernel's fused linear cross-entropy (``"liger"``,
  [`unpack_trainer.patches.linear_cross_entropy`]), and why.

Liger's kernel is installed on the model as the fix [`unpack_trainer.models.fixes.liger_loss`] (TRL's fused LM head
with Liger's kernel for packed rows, TRL's own for any other call).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "LOSS_KERNELS",
    "LOSS_KERNEL_ENV",
    "choose_loss_kernel",
    "enable_loss_normalization",
    "head_unsupported_reason",
    "loss_normalization",
    "sample_weights",
    "step_sample_count",
]


LOSS_KERNELS = ("trl", "liger")
"""The values of ``SFTConfig.loss_kernel`` besides ``None`` (automatic)."""
LOSS_KERNEL_ENV = "UNPACK_LOSS_KERNEL"
"""Environment variable read when ``loss_kernel`` is ``None``: ``trl`` / ``liger`` as if set in the config."""

# The automatic choice per device type: TRL's kernel until Liger's is measured faster there in a training step
# (``benchmarks/bench_gpu.py``); a device type missing here takes TRL's.
AUTOMATIC_LOSS_KERNEL: dict[str, str] = {"cpu": "trl", "cuda": "trl"}


def loss_normalization(args: Any) -> str:
    """``args.loss_normalization`` (ours), ``"token"`` (TRL's) for a config without it."""
    return getattr(args, "loss_normalization", "token")


def enable_loss_normalization(trainer: Any) -> None:
    """``loss_normalization="sample"`` on ``trainer`` (after TRL's ``__init__``): the trainer's ``_check_sample_loss``
    raises where it cannot be honoured, the run counts samples per step ([`step_sample_count`]) and the loss is
    divided by them (``loss_is_scaled_for_ga``); ``"token"``: the trainer's ``_enable_token_loss``."""
    if loss_normalization(trainer.args) != "sample":
        trainer._enable_token_loss()
        return
    trainer._check_sample_loss()
    trainer.unpack_run.sample_loss = True
    if trainer.loss_is_scaled_for_ga is None:
        trainer.loss_is_scaled_for_ga = True  # divided by the samples of the whole accumulated step


def step_sample_count(trainer: Any, batch_samples: list[dict[str, Any]], device: Any) -> torch.Tensor:
    """``()`` int64 on ``device``: the samples with a trained token in the batches of one accumulated step (the
    trainer's ``_count_samples`` of each), over all processes when ``average_tokens_across_devices``."""
    count = torch.tensor(sum(trainer._count_samples(batch) for batch in batch_samples), device=device)
    if trainer.args.average_tokens_across_devices and trainer.accelerator.num_processes > 1:
        count = trainer.accelerator.gather(count).sum()
    return count


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


def choose_loss_kernel(
    requested: str | None, *, device: torch.device | str, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """The kernel that computes the loss of packed rows, and why.

    | ``loss_kernel``          | kernel                                                                           |
    |--------------------------|----------------------------------------------------------------------------------|
    | ``"trl"``                | TRL's chunked fused LM head                                                      |
    | ``"liger"``              | Liger-Kernel's fused linear cross-entropy; ``ValueError`` where it cannot run    |
    | ``None``, env set        | ``UNPACK_LOSS_KERNEL`` (``trl`` / ``liger``), as if set in the config            |
    | ``None``                 | [`AUTOMATIC_LOSS_KERNEL`] for the device type: ``"trl"`` until Liger's measures  |
    |                          | faster in a training step on it (CPU: Liger's Triton kernels do not run there)   |

    Args:
        requested: ``SFTConfig.loss_kernel``.
        device: the device the model trains on.
        env: environment variables (defaults to ``os.environ``).
    """
    from unpack_trainer.patches.linear_cross_entropy import liger_unavailable_reason

    env = os.environ if env is None else env
    source = "loss_kernel"
    if requested is None and env.get(LOSS_KERNEL_ENV, "").strip():
        requested, source = env[LOSS_KERNEL_ENV].strip().lower(), LOSS_KERNEL_ENV
    if requested is None:
        device_type = torch.device(device).type
        kernel = AUTOMATIC_LOSS_KERNEL.get(device_type, "trl")
        return kernel, f"automatic on {device_type}"
    if requested not in LOSS_KERNELS:
        raise ValueError(f"`{source}`={requested!r} is not supported; use one of {', '.join(LOSS_KERNELS)}.")
    if requested == "liger":
        reason = liger_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"`{source}='liger'` cannot run: {reason}. Set `{source}` to 'trl' or leave it unset.")
    return requested, f"{source}={requested!r}"


def head_unsupported_reason(config: Any) -> str | None:
    """Why Liger's kernel cannot compute this model's LM head as TRL's fused head does, or ``None``: TRL scales the
    logits by ``logit_scale`` / ``output_multiplier`` / ``lm_head_multiplier`` / ``logits_scaling`` (Liger's kernel
    takes no scale; only a softcap), and a mixture of experts adds its router loss."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(text_config, name, None)
        if value is not None and value != 1:
            return f"the model scales its logits ({name}={value})"
    if getattr(text_config, "output_router_logits", False):
        return "the model adds a router loss (output_router_logits)"
    return None
