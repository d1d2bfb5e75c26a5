"""Liger-Kernel's fused linear cross-entropy computing TRL's fused LM head output for packed rows.

TRL's trainers replace a causal LM's ``forward`` with a fused LM head (``add_fused_lm_head``: chunked projection and
log-softmax). For a packed or padding-free row of a patched model this fix has Liger-Kernel's fused linear
cross-entropy (:func:`unpack_trainer.patches.linear_cross_entropy.linear_log_probs`: the head's gradients computed in
the forward, no second projection) score the labelled positions instead, returning what TRL's head returns. Not
automatic: the SFT trainer installs it where ``loss_kernel`` chooses Liger's kernel for TRL's token loss
(:func:`unpack_trainer.trainers.loss.choose_loss_kernel`, :func:`unpack_trainer.models.install_fix`).
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.models.fixes.record import FixSite, forward_wrapping_fix
from unpack_trainer.packed_seq_info import INFO_KEY

__all__ = ["FIX", "LIGER_OUTPUT_MARK", "install_liger_loss"]

logger = logging.getLogger("unpack_trainer")

LIGER_OUTPUT_MARK = "unpack_liger_kernel"
"""Set (``True``) on the output of a forward whose loss Liger's kernel computed: its ``entropy`` is not computed."""


def install_liger_loss(model: torch.nn.Module) -> None:
    """Compute TRL's fused LM head output with Liger-Kernel's fused linear cross-entropy for packed rows; ``model.forward``
    wrapped on the instance; :data:`FIX`'s ``remove`` gives back the one it wrapped.

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

    model.forward = types.MethodType(forward, model)
    log_once(
        logger,
        logging.INFO,
        "unpack_trainer: packed rows compute their loss with Liger-Kernel's fused linear cross-entropy (the gradients "
        "of the LM head in the forward, no second projection); the `entropy` metric is not logged (the kernel does "
        "not compute it).",
    )


def _applies(site: FixSite) -> str | None:
    return "the loss of packed rows runs on Liger-Kernel's fused linear cross-entropy (loss_kernel)"


FIX = forward_wrapping_fix("liger_loss", _applies, install_liger_loss)
