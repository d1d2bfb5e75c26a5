"""``use_liger_kernel=True`` with packed rows: whose kernel runs where, said once when training starts.

transformers' ``Trainer`` applies Liger-Kernel's kernels to the model when training starts
(``_apply_liger_kernel_to_instance``, with TRL's ``fused_linear_cross_entropy=False``), after the packing patch. What
then runs, and why each piece stays exact on packed rows:

- RoPE: Liger-Kernel's ``liger_rotary_pos_emb`` replaces the modeling module's ``apply_rotary_pos_emb``, ours
  included. It reads ``cos`` / ``sin`` per token (the ``(rows, T, head_dim)`` the model's rotary embedding computes
  from the packed ``position_ids``), so positions that restart at every sample stay exact; the user asked for Liger's
  kernels, so Liger's runs (``liger_kernel_config={"rope": False}`` keeps ours; the two measure within 2x of each
  other either way on an H100, FACTS). Unpatching leaves Liger's in place.
- RMSNorm, SwiGLU (and the other per-token kernels Liger applies): per token, exact on packed rows.
- Attention and the packing metadata: ours (Liger does not replace attention).
- The loss: TRL's fused LM head, or Liger's fused linear cross-entropy with ``loss_kernel="liger"``
  ([`unpack_trainer.trainers.loss`]).

The contamination self-check runs on the model as it trains, Liger's kernels applied, before the first batch.
"""

from __future__ import annotations

import sys

import torch

from unpack_trainer._compat import hub_kernel_function

__all__ = ["liger_note", "rope_owner"]


def rope_owner(model: torch.nn.Module) -> str | None:
    """Whose ``apply_rotary_pos_emb`` the modeling module of ``model`` (a ``PreTrainedModel``, unwrapped) calls now:
    ``"Liger-Kernel"``, ``"unpack_trainer"`` or ``"transformers"``; ``None`` when the module has none."""
    modeling = sys.modules.get(type(model).__module__)
    function = getattr(modeling, "apply_rotary_pos_emb", None)
    if function is None:
        return None
    owner = getattr(hub_kernel_function(function) or function, "__module__", "") or ""  # kernels' module: its function
    if owner.startswith("liger_kernel"):
        return "Liger-Kernel"
    if owner.startswith("unpack_trainer"):
        return "unpack_trainer"
    return "transformers"


def _liger_modules(model: torch.nn.Module) -> list[str]:
    """The names of the Liger-Kernel modules ``model`` runs (classes swapped in, or instances whose ``forward`` Liger
    rebound, which then report Liger's class name), in first-seen order."""
    names: dict[str, None] = {}
    for module in model.modules():
        name = module._get_name()
        if name.startswith("Liger") or type(module).__module__.startswith("liger_kernel"):
            names[name] = None
    return list(names)


def liger_note(model: torch.nn.Module, *, attention: str, loss_kernel: str | None) -> str:
    """The one line that says, for a model training packed rows with ``use_liger_kernel=True``, whose RoPE, whose
    per-token kernels, whose attention and whose loss run (``attention``: the packed attention backend's name;
    ``loss_kernel``: the SFT trainer's, ``None`` for a trainer whose loss is TRL's own)."""
    owner = rope_owner(model)
    if owner == "Liger-Kernel":
        rope = (
            "RoPE: Liger-Kernel's (it reads cos/sin per token, so positions restarting at every sample stay exact; "
            "liger_kernel_config={'rope': False} keeps unpack_trainer's)"
        )
    elif owner is None:
        rope = "RoPE: none in the modeling module (the model's own position handling, patched as without Liger)"
    else:
        rope = f"RoPE: {owner}'s"
    kernels = _liger_modules(model)
    per_token = (
        f"Liger-Kernel's {', '.join(kernels)} (per token, exact on packed rows)"
        if kernels
        else "no Liger-Kernel module (none applies to this model type)"
    )
    if loss_kernel == "liger":
        loss = "loss: Liger-Kernel's fused linear cross-entropy (loss_kernel='liger')"
    else:
        loss = "loss: TRL's chunked fused LM head (loss_kernel='liger' for Liger-Kernel's fused linear cross-entropy)"
    return (
        f"use_liger_kernel=True with packed rows: {rope}; {per_token}; attention: unpack_trainer's packed "
        f"{attention}; {loss}. The contamination self-check runs on the model with these kernels."
    )

