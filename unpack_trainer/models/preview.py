"""What :func:`~unpack_trainer.models.patch_model` does with a model, asked of the patch itself: whether it refuses
the model (and why), which model-family fixes it installs, whose RoPE then runs, and whether the packed rows stay
exact under sequence parallelism (``unpack-trainer env --model`` prints it).

The answer is read from the model patched and unpatched again, so there is no second copy of the rules (which fix
applies where, what Ulysses can shard) to drift from the patch's own. Works on a model built on the ``meta`` device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from unpack_trainer.anatomy.attention import attention_features
from unpack_trainer.anatomy.structure import ModelStructure
from unpack_trainer.models.fixes import FIXES, FixSite
from unpack_trainer.models.fixes.rope import rope_reasons
from unpack_trainer.models.patch import is_patched, patch_model, unpatch_model
from unpack_trainer.models.refusals import PatchRefused, check_model
from unpack_trainer.models.sequence_parallel import sequence_parallel_reason
from unpack_trainer.models.state import decoder_state
from unpack_trainer.patches.attention import Needs

__all__ = ["PatchPreview", "preview_patch"]


class PatchPreview(NamedTuple):
    """What the patch does with one model (:func:`preview_patch`).

    Attributes:
        refusal: why the patch refuses the model, or ``None`` where it patches it; the fields below are then
            ``None``.
        structure: what the model is made of (its decoders, attention modules, token mixers).
        features: what its attention asks of a packed backend
            (:func:`~unpack_trainer.anatomy.attention.attention_features`).
        fixes: the model-family fixes ``patch_model`` installs, in the order of
            :data:`~unpack_trainer.models.fixes.FIXES`.
        rope: per modeling module of its attention layers that defines ``apply_rotary_pos_emb``: why the fused RoPE
            does not replace it, or ``None`` where it does.
        sequence_parallel: per ``sp_size`` asked: why the packed rows are not exact under DeepSpeed Ulysses, or
            ``None`` where they are.
    """

    refusal: PatchRefused | None
    structure: ModelStructure | None = None
    features: Needs | None = None
    fixes: tuple[str, ...] | None = None
    rope: dict[str, str | None] | None = None
    sequence_parallel: dict[int, str | None] | None = None


def preview_patch(model: torch.nn.Module, *, sp_sizes: tuple[int, ...] = (2, 4, 8)) -> PatchPreview:
    """Patch ``model``, read what the patch did, and unpatch it (see :class:`PatchPreview`).

    Raises:
        ValueError: ``model`` is patched already (what the patch installed then says nothing of its defaults).
    """
    if is_patched(model):
        raise ValueError("preview_patch needs a model that is not patched (unpack_trainer.models.unpatch_model).")
    try:
        structure = check_model(model)
    except PatchRefused as refused:
        return PatchPreview(refused)
    patch_model(model)
    try:
        sites = [
            FixSite(structure.pretrained, decoder.module, decoder_state(decoder.module), decoder, structure)
            for decoder in structure.decoders
        ]
        rope: dict[str, str | None] = {}
        for site in sites:
            rope.update(rope_reasons(site))
        installed = {name for site in sites for name in site.state.fixes}
        return PatchPreview(
            None,
            structure,
            attention_features(model, structure),
            tuple(fix.name for fix in FIXES if fix.name in installed),
            rope,
            {size: sequence_parallel_reason(model, size) for size in sp_sizes},
        )
    finally:
        unpatch_model(model)
