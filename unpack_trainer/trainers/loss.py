"""The SFT trainer's loss ([`unpack_trainer.trainers.sft`]): per-sample weighting and the LM head's kernel.

- [`sample_weights`]: per-sample loss weighting (``loss_normalization="sample"``): every sample weighs the same,
  whatever its length.
- [`choose_loss_kernel`]: which kernel computes the loss of packed rows (``loss_kernel``): TRL's chunked fused LM head
  (``"trl"``) or Liger-Kernel's fused linear cross-entropy (``"liger"``,
  [`unpack_trainer.patches.linear_cross_entropy`]), and why.
- [`install_liger_loss`]: TRL's fused LM head with Liger's kernel for packed rows, TRL's own for any other call.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from collections.abc import Mapping
from typing import Any

import torch

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.models.undo import add_undo
from unpack_trainer.packed_seq_info import INFO_KEY

__all__ = [
    "LIGER_OUTPUT_MARK",
    "LOSS_KERNELS",
    "LOSS_KERNEL_ENV",
    "choose_loss_kernel",
    "head_unsupported_reason",
    "install_liger_loss",
    "sample_weights",
]

logger = logging.getLogger("unpack_trainer")

LOSS_KERNELS = ("trl", "liger")
"""The values of ``SFTConfig.loss_kernel`` besides ``None`` (automatic)."""
LOSS_KERNEL_ENV = "UNPACK_LOSS_KERNEL"
"""Environment variable read when ``loss_kernel`` is ``None``: ``trl`` / ``liger`` as if set in the config."""

LIGER_OUTPUT_MARK = "unpack_liger_kernel"
"""Set (``True``) on the output of a forward whose loss Liger's kernel computed: its ``entropy`` is not computed."""

# The automatic choice per device type: TRL's kernel until Liger's is measured faster there in a training step
# (``benchmarks/bench_gpu.py``); a device type missing here takes TRL's.
AUTOMATIC_LOSS_KERNEL: dict[str, str] = {"cpu": "trl", "cuda": "trl"}


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


def _remove_liger_loss(model: torch.nn.Module) -> None:
    replaced = model.__dict__.pop(_LIGER_ATTRIBUTE, None)
    if replaced is not None:
        model.forward = replaced


_LIGER_ATTRIBUTE = "_unpack_liger_loss"  # on the causal LM: the forward the Liger loss wraps (TRL's fused head)


def install_liger_loss(model: torch.nn.Module) -> None:
    """Compute TRL's fused LM head output with Liger-Kernel's fused linear cross-entropy for packed rows; idempotent;
    undone by [`unpack_trainer.models.unpatch_model`].

    ``model`` is the causal LM whose ``forward`` TRL's ``add_fused_lm_head`` replaced (under PEFT, the base model).
    A call with ``fused_lm_head=True``, ``labels`` and the batch's ``packed_seq_info`` (a packed or padding-free
    row of the patched model) runs the backbone, then scores the positions whose next-token label is not ``-100``
    with [`unpack_trainer.patches.linear_cross_entropy.linear_log_probs`] and returns TRL's ``FusedCausalLMOutput``:
    ``log_probs``, ``is_top1`` and ``label_mask`` ``(rows, T - 1)`` with zeros where the label is ``-100``, ``loss``
    ``-sum(log_probs) / num_items_in_batch`` (their count without it), as TRL's head returns them; ``entropy`` is
    zeros (Liger's kernel does not compute it; the output carries [`LIGER_OUTPUT_MARK`]). The log-probabilities' gradient is exact for a loss that weighs every
    token alike (TRL's token loss); the trainer uses this only for it. Any other call (padded rows, pre-shifted
    ``shift_labels``, a mixture of experts' router logits, ``fused_lm_head=False``) goes to TRL's forward unchanged.
    """
    if _LIGER_ATTRIBUTE in model.__dict__:
        return
    from unpack_trainer.patches.linear_cross_entropy import linear_log_probs

    fused_forward = model.forward
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    output_class, gather_lm_head = _trl_compat.fused_lm_head_names()

    @functools.wraps(type(model).forward)  # the class's signature, as TRL keeps it (`generate` checks kwargs on it)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if (
            not kwargs.get("fused_lm_head")
            or labels is None
            or kwargs.get(INFO_KEY) is None
            or kwargs.get("shift_labels") is not None
            or kwargs.get("output_router_logits")
            or getattr(text_config, "output_router_logits", False)
        ):
            return fused_forward(*args, **kwargs)
        for name in ("fused_lm_head", "labels", "shift_labels"):
            kwargs.pop(name, None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        hidden = hidden.to(weight.device)
        targets = labels[:, 1:].to(weight.device)
        mask = targets != -100
        with gather_lm_head(weight, bias):
            scored, top1 = linear_log_probs(hidden[mask], weight, bias, targets[mask], softcap=softcap)
        log_probs = scored.new_zeros(mask.shape).masked_scatter(mask, scored)
        is_top1 = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device).masked_scatter(mask, top1)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        output = output_class(
            loss=-log_probs.sum() / count,
            log_probs=log_probs,
            entropy=torch.zeros_like(log_probs),
            is_top1=is_top1,
            label_mask=mask,
        )
        setattr(output, LIGER_OUTPUT_MARK, True)
        return output

    model.__dict__[_LIGER_ATTRIBUTE] = fused_forward
    model.forward = types.MethodType(forward, model)
    add_undo(model, _remove_liger_loss)
    log_once(
        logger,
        logging.INFO,
        "unpack_trainer: packed rows compute their loss with Liger-Kernel's fused linear cross-entropy (the gradients "
        "of the LM head in the forward, no second projection); the `entropy` metric is not logged (the kernel does "
        "not compute it).",
    )
