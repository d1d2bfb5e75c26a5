"""preview_patch: what the patch does with a model, asked of the patch itself, the model left as it was."""

from __future__ import annotations

import pytest

from unpack_trainer.models import RefusalKind, is_patched, patch_model, unpatch_model
from unpack_trainer.models.preview import preview_patch
from unpack_trainer.models.state import decoder_state


def _installed(model) -> list[str]:
    return [name for module in model.modules() if decoder_state(module) for name in decoder_state(module).fixes]


@pytest.mark.parametrize("model_type", ["mistral", "bloom", "qwen3_next"])
def test_the_preview_is_what_patch_model_installs(tiny_model, model_type):
    """A window applied through the mask and the fused RoPE (Mistral), ALiBi and the outer model's keywords (BLOOM),
    none and a RoPE of its own (Qwen3-Next): the preview names the fixes patch_model then installs, in their order,
    and leaves the model unpatched."""
    model = tiny_model(model_type)
    preview = preview_patch(model)
    assert preview.refusal is None and preview.fixes is not None
    assert not is_patched(model) and not _installed(model)
    patch_model(model)
    try:
        assert list(preview.fixes) == list(dict.fromkeys(_installed(model)))
    finally:
        unpatch_model(model)
    assert ("rope" in preview.fixes) == (preview.rope is not None and None in preview.rope.values())
    if model_type == "qwen3_next":
        assert set(preview.sequence_parallel) == {2, 4, 8}
        assert all("carry state along the row" in reason for reason in preview.sequence_parallel.values())


def test_the_sequence_parallel_answer_per_size(tiny_model):
    """The tiny Llama's 4 heads divide over 2 and 4 processes, not 8."""
    preview = preview_patch(tiny_model("llama"), sp_sizes=(2, 8))
    assert preview.sequence_parallel[2] is None
    assert "do not divide by sp_size=8" in preview.sequence_parallel[8]


def test_a_refused_model_gives_the_refusal(tiny_model):
    model = tiny_model("bert")  # loaded as an encoder: bidirectional self-attention
    preview = preview_patch(model)
    assert preview.refusal is not None and preview.refusal.kind is RefusalKind.BIDIRECTIONAL
    assert preview.fixes is None and not is_patched(model)


def test_a_patched_model_is_not_previewed(tiny_model):
    model = patch_model(tiny_model("llama"))
    with pytest.raises(ValueError, match="not patched"):
        preview_patch(model)
    assert is_patched(model)
