"""What a model's attention asks of a packed attention backend, read from the model (:func:`attention_features`):
the backend choice (:func:`unpack_trainer.patches.attention.choose_backend`), the patch's per-decoder planning and the
sequence-parallel rules read it.
"""

from __future__ import annotations

import torch

from unpack_trainer.anatomy.structure import ModelStructure, pretrained_model
from unpack_trainer.anatomy.vision import has_image_blocks, text_model
from unpack_trainer.patches.attention import AttentionFeature, Needs

__all__ = ["attention_features"]


def attention_features(model: torch.nn.Module, structure: ModelStructure | None = None) -> Needs:
    """What the attention of ``model`` asks of a packed backend, as the choice reads it
    (:class:`~unpack_trainer.patches.attention.Needs`): its features (logit softcapping,
    ``config.attn_logit_softcapping``; sinks, a ``sinks`` parameter of an attention module; bidirectional image
    blocks, :func:`unpack_trainer.anatomy.vision.has_image_blocks`) and the largest and smallest query / value head
    dims (``None`` when unknown). Of a vision-language model, its text model's attention (the vision tower's is never
    packed). Works on a model built on the ``meta`` device. ``structure``: what the model is made of, where the
    caller found it already (it is not discovered again)."""
    config = pretrained_model(model).config.get_text_config()
    packed = text_model(model, structure) or model
    head_dims = [
        getattr(module, "head_dim", None)
        for module in packed.modules()
        if isinstance(getattr(module, "head_dim", None), int)
    ]
    for name in ("v_head_dim", "qk_head_dim"):
        if isinstance(getattr(config, name, None), int):
            head_dims.append(getattr(config, name))
    present = (
        (AttentionFeature.SOFTCAP, bool(getattr(config, "attn_logit_softcapping", None))),
        (AttentionFeature.SINKS, any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in packed.modules())),
        (AttentionFeature.BIDIRECTIONAL, has_image_blocks(model, structure)),
    )
    return Needs(
        frozenset(feature for feature, found in present if found),
        max(head_dims) if head_dims else None,
        min(head_dims) if head_dims else None,
    )
