"""TRL's fused LM head scoring only the labelled positions of a packed batch with shared prompts.

TRL's trainers replace a causal LM's ``forward`` with a fused LM head (``add_fused_lm_head``) that scores every position
of the padded view; on a packed batch with shared prompts (:mod:`unpack_trainer.models.fixes.packed_view`) this fix
has it score one compact row of the labelled positions instead, each per-token output scattered back where TRL expects
it. Not automatic: the prompt-sharing trainers install it after TRL has added its head
(:func:`unpack_trainer.models.fixes.install_fix`).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from unpack_trainer.data.collator import IGNORE_INDEX
from unpack_trainer.models.fixes.record import FixSite, forward_wrapping_fix
from unpack_trainer.packed_seq_info import VIEW_INDEX_KEY

__all__ = ["FIX", "install_compact_lm_head"]

# The per-token fields of TRL's fused LM head output (``add_fused_lm_head``), each ``(rows, L - 1)`` or ``None``.
_FUSED_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def install_compact_lm_head(model: torch.nn.Module) -> None:
    """Let TRL's fused LM head score only the labelled positions of a packed batch with shared prompts
    (``model.forward`` wrapped on the instance; :data:`FIX`'s ``remove`` gives back the one it wrapped).

    ``model`` is the causal LM whose ``forward`` TRL's ``add_fused_lm_head`` replaced (under PEFT, the base model).
    Without Triton (on CPU, for one), TRL's fused head scores every position of the padded view ``(rows, L)``,
    padding and unlabelled columns included, then zeroes them. A call with ``fused_lm_head=True``, ``labels`` and
    ``packed_view_index`` instead runs TRL's forward on one compact row ``(1, K + 1)``: the ``K`` positions whose
    next-token label is not ``-100``, in the view's row-major order, then one unscored position (TRL shifts labels by
    one: the row's labels are ``[-100, l_1, .., l_K]``). The decoder hook ([`install_packed_view`]) reads each one's
    hidden state from its packed token as before, and every per-token field of TRL's output is scattered back into the
    view's ``(rows, L - 1)`` with zeros where the label is ``-100``, as TRL returns it. So each scored value is
    computed from the same hidden state and label as in the view (the LM head projects each position on its own), the
    loss TRL's trainer computes from them and the gradients are those of the view (fp32 rel 1e-5: the sums run in
    another order); the MoE auxiliary loss still sees the view's ``attention_mask`` and the router logits in its
    layout. Any other call goes to TRL's forward unchanged.
    """
    fused_forward = model.forward

    @functools.wraps(type(model).forward)  # the class's signature, as TRL keeps it (`generate` checks kwargs on it)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        index = kwargs.get(VIEW_INDEX_KEY)
        if (
            not kwargs.get("fused_lm_head")
            or labels is None
            or index is None
            or kwargs.get("shift_labels") is not None
        ):
            return fused_forward(*args, **kwargs)
        if labels.shape != index.shape:
            raise ValueError(
                f"`labels` has shape {tuple(labels.shape)} but `{VIEW_INDEX_KEY}` is {tuple(index.shape)}."
            )
        mask = labels[:, 1:] != IGNORE_INDEX
        num_scored = int(mask.sum())
        if num_scored == 0:  # nothing to score: TRL's own path keeps the output connected to the model
            return fused_forward(*args, **kwargs)
        compact_index = torch.cat([index[:, :-1][mask], index.new_zeros(1)]).unsqueeze(0)
        compact_labels = torch.cat([labels.new_full((1,), IGNORE_INDEX), labels[:, 1:][mask]]).unsqueeze(0)
        kwargs["labels"] = compact_labels
        kwargs[VIEW_INDEX_KEY] = compact_index
        if kwargs.get("input_ids") is not None:  # the decoder hook checks the view's shape against the index's
            kwargs["input_ids"] = compact_labels.clamp(min=0)
        output = fused_forward(*args, **kwargs)
        for name in _FUSED_PER_TOKEN_FIELDS:
            value = getattr(output, name, None)
            if value is not None:
                setattr(output, name, value.new_zeros(mask.shape).masked_scatter(mask.to(value.device), value[0]))
        if getattr(output, "label_mask", None) is not None:
            output.label_mask = mask.to(output.label_mask.device)
        return output

    model.forward = types.MethodType(forward, model)


def _applies(site: FixSite) -> str | None:
    return "TRL's fused LM head scores every position of the padded view"


FIX = forward_wrapping_fix("compact_lm_head", _applies, install_compact_lm_head)
