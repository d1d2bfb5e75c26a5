"""Per-token log-probabilities of the LM head without the logits, through Liger-Kernel's fused linear cross-entropy.

TRL's fused LM head (``add_fused_lm_head``, SFT's default loss) projects the hidden states onto the vocabulary in
tiles and folds each tile into online-logsumexp statistics; its backward projects every tile again, so the head costs
four ``(tokens x hidden x vocab)`` matrix multiplies per step. :func:`linear_log_probs` returns the same per-token
log-probabilities (and whether each label is the top-1 prediction) from Liger-Kernel's chunked fused linear
cross-entropy, which computes the gradients of the summed loss in the forward, chunk by chunk, while each chunk's
logits are at hand: three matrix multiplies, no second projection. The backward only scales what the forward stored.

That is exact for a loss whose gradient reaches every scored token with one and the same factor: a sum or a mean of
the log-probabilities, as TRL's token loss (``-sum(log_probs) / num_items_in_batch``). The gradient of the hidden
states is scaled per token and so exact for any loss; the LM head's weight and bias gradients are sums over tokens and
need the common factor, which the backward checks on the device (a loss that weighs tokens differently, as DFT or a
per-sample mean, fails that check; the trainer keeps TRL's kernel for those).

Precision: the projection runs in the compute dtype (the autocast dtype under mixed precision, else the hidden
states'), as TRL's does; the softmax statistics and the loss in float32; the head's gradients are accumulated in
float32 over the chunks and returned in the compute dtype (stock autocast rounds the head's weight gradient to it too).

Liger-Kernel is optional: :func:`liger_unavailable_reason` says why it cannot run (not installed, a version without
per-token losses with forward gradients, a device its Triton kernels do not run on). Its kernels run on CUDA tensors,
and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` before Liger-Kernel is imported; slow, for
tests). Nothing is imported or compiled when this module is imported.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from unpack_trainer import _compat

__all__ = ["linear_log_probs", "liger_unavailable_reason"]


def _interpreted() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``): Liger's kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def liger_unavailable_reason(device: torch.device | str) -> str | None:
    """Why :func:`linear_log_probs` cannot run for tensors on ``device``, or ``None`` when it can."""
    device = torch.device(device)
    if _compat.liger_linear_cross_entropy() is None:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "Liger-Kernel is not installed (pip install liger-kernel)"
        return (
            "the installed Liger-Kernel's fused linear cross-entropy has no per-token losses with the gradients "
            "computed in the forward (liger-kernel 0.8.5 has them)"
        )
    if device.type == "cuda":
        return None
    if device.type == "cpu" and _interpreted():
        return None
    return (
        f"Liger-Kernel's Triton kernels do not run on {device.type} tensors (CUDA only; CPU under TRITON_INTERPRET=1)"
    )


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


class _LigerLogProbs(torch.autograd.Function):
    """``(log_probs (N,) float32, is_top1 (N,) bool)`` of ``hidden @ weight.T + bias``; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        compute_dtype = _compute_dtype(hidden)
        wants_weight = weight.requires_grad or (bias is not None and bias.requires_grad)
        wants_grads = hidden.requires_grad or wants_weight
        kernel = _compat.liger_linear_cross_entropy()
        with torch.autocast(hidden.device.type, enabled=False):
            loss, _, top1, _, grad_hidden, grad_weight, grad_bias = kernel(
                hidden.to(compute_dtype),
                weight.to(compute_dtype),
                targets,
                bias=None if bias is None else bias.to(compute_dtype),
                reduction="none",
                softcap=softcap,
                accum_dtype=torch.float32,
                return_token_accuracy=True,
                compute_gradients=wants_grads,
                weight_requires_grad=weight.requires_grad,
            )
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(top1)
        return -loss, top1 > 0.5

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None, _: Any) -> tuple[torch.Tensor | None, ...]:
        if grad_log_probs is None:
            return None, None, None, None, None
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        scale = -grad_log_probs.float()  # the stored gradients are those of the summed loss, -sum(log_probs)
        if grad_hidden is not None and ctx.needs_input_grad[0]:
            grad_hidden = (grad_hidden.float() * scale.unsqueeze(1)).to(hidden_dtype)
        else:
            grad_hidden = None
        common = scale[0]
        if (grad_weight is not None and ctx.needs_input_grad[1]) or (
            grad_bias is not None and ctx.needs_input_grad[2]
        ):
            # The weight and bias gradients were summed over the tokens: only one factor for all of them applies.
            _compat.assert_on_device(
                (scale == common).all(),
                "linear_log_probs: the LM head's gradients need the same gradient for every token's log-probability "
                "(a sum or mean of them); this loss weighs the tokens differently. Use TRL's kernel for it.",
            )
        grad_weight = (grad_weight.float() * common).to(weight_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = (
            (grad_bias.float() * common).to(bias_dtype) if grad_bias is not None and ctx.needs_input_grad[2] else None
        )
        return grad_hidden, grad_weight, grad_bias, None, None


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of each target under ``softmax(softcap(hidden @ weight.T + bias))``, and whether it is the
    most likely token, without the ``(N, vocab)`` logits.

    Args:
        hidden: ``(N, hidden_size)`` float, the scored positions' last hidden states (any float dtype; projected in
            the compute dtype: the autocast dtype under mixed precision, else ``hidden``'s).
        weight: ``(vocab, hidden_size)`` float, the LM head's weight.
        bias: ``(vocab,)`` or ``None``.
        targets: ``(N,)`` int64 labels in ``[0, vocab)`` (``-100`` is ignored: log-probability 0, not top-1).
        softcap: ``final_logit_softcapping`` (logits ``softcap * tanh(z / softcap)``) or ``None``.

    Returns:
        ``log_probs`` ``(N,)`` float32 and ``is_top1`` ``(N,)`` bool (the target is the first index of the largest
        logit, as TRL's ``is_top1``). ``log_probs`` is differentiable for a loss that weighs every token alike (see
        the module docstring); a loss that does not fails a check on the device in the backward.

    Raises:
        RuntimeError: Liger-Kernel cannot run here ([`liger_unavailable_reason`]).
    """
    reason = liger_unavailable_reason(hidden.device)
    if reason is not None:
        raise RuntimeError(f"linear_log_probs: {reason}.")
    if hidden.shape[0] == 0:  # nothing to score: zero-size outputs that stay connected to the graph
        empty = (hidden.float().sum(-1) + weight.float().sum() * 0)[:0]
        return empty, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return _LigerLogProbs.apply(hidden, weight, bias, targets, softcap)
