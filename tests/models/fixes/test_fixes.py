"""unpack_trainer/models/fixes: the table of model-family fixes kept honest. Every module of the package declares one
record and is in ``FIXES``; every entry applies to a model named here, where ``patch_model`` (or, for the fixes a
trainer asks for, ``install_fix``) installs it, a packed batch then gives what its samples give alone, and
``unpatch_model`` takes it off again. Each family's own equivalence tests (every backend, gradients) are beside its
model's tests; this one is the one place that sees the whole table."""

from __future__ import annotations

import gc
import pkgutil
import types
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from unpack_trainer.model_zoo.tiny import tiny_config
from unpack_trainer.model_zoo.tiny_vision import FIRST_TEXT_ID, tiny_vision_model
from unpack_trainer.models import fixes as fixes_package
from unpack_trainer.models import install_fix, patch_model, unpatch_model
from unpack_trainer.models.fixes import FIXES, Fix, fix_named
from unpack_trainer.models.state import PATCH_ATTRIBUTE, decoder_state

# fix -> (model_type, config overrides, head): a tiny model that needs it. The head is "causal" (a causal LM),
# "classification" (a sequence classifier) or "vision" (a vision-language model, text-only rows here: the families'
# image rows are tests/models/test_vision.py's).
MODELS: dict[str, tuple[str, dict, str]] = {
    "sliding_window": ("phimoe", {}, "causal"),
    "llama4": ("llama4_text", dict(attention_chunk_size=4, no_rope_layers=[1, 0], floor_scale=4), "causal"),
    "alibi": ("bloom", {}, "causal"),
    "outer_carry": ("mpt", {}, "causal"),
    "positions": ("roberta", dict(is_decoder=True, add_cross_attention=False), "causal"),
    "rope": ("llama", {}, "causal"),
    "classification_head": ("llama", dict(num_labels=3), "classification"),
    "packed_view": ("llama", {}, "causal"),
    "compact_lm_head": ("llama", {}, "causal"),
    "liger_loss": ("llama", {}, "causal"),
    "vision_language": ("llava", {}, "vision"),
    "multimodal_rope": ("qwen2_5_vl", {}, "vision"),
    "image_blocks": ("gemma3", {}, "vision"),
}
LENGTHS = [7, 2, 11, 5]


def build(fix: str) -> torch.nn.Module:
    model_type, overrides, head = MODELS[fix]
    if head == "vision":
        return tiny_vision_model(model_type, attn_implementation="eager", **overrides).eval()
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(0)
    auto = AutoModelForSequenceClassification if head == "classification" else AutoModelForCausalLM
    return auto.from_config(config, attn_implementation="eager").eval()


def installed(model: torch.nn.Module) -> set[str]:
    return {name for module in model.modules() if decoder_state(module) for name in decoder_state(module).fixes}


def test_every_module_of_the_package_is_in_the_table():
    modules = {info.name for info in pkgutil.iter_modules(fixes_package.__path__)} - {"record"}
    declared = {name: getattr(getattr(fixes_package, name), "FIX", None) for name in modules}
    assert all(isinstance(record, Fix) for record in declared.values()), declared
    assert set(declared.values()) == set(FIXES)
    assert len({fix.name for fix in FIXES}) == len(FIXES)  # names are unique


def test_every_entry_is_tested_here():
    assert set(MODELS) == {fix.name for fix in FIXES}


@pytest.mark.parametrize("name", [fix.name for fix in FIXES])
def test_each_fix_applies_installs_and_comes_off(name):
    fix = fix_named(name)
    model = build(name)
    low = FIRST_TEXT_ID if MODELS[name][2] == "vision" else 3  # a vision-language model: text tokens only
    ids = torch.randint(low, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    samples = ids.split(LENGTHS, dim=1)
    with torch.no_grad():
        alone = [model(input_ids=sample).logits for sample in samples]
        patch_model(model)
        if not fix.automatic:
            install_fix(model, name)
        assert name in installed(model)
        packed = model(input_ids=ids, packed_seq_lengths=torch.tensor(LENGTHS, dtype=torch.int32)).logits
    # A classifier scores each sequence once (its rows are the samples); a causal LM's logits follow the tokens.
    expected = torch.cat(alone, dim=0 if MODELS[name][2] == "classification" else 1)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
    unpatch_model(model)
    assert not installed(model) and all(PATCH_ATTRIBUTE not in module.__dict__ for module in model.modules())
    assert "forward" not in model.__dict__


def test_a_trainers_fix_needs_a_patched_model():
    with pytest.raises(ValueError, match="needs a patched model"):
        install_fix(build("packed_view"), "packed_view")


@pytest.mark.parametrize("name", [fix.name for fix in FIXES])
def test_a_patched_model_with_each_fix_is_collected(name):
    """Nothing the patch or a fix keeps in module-level tables (the routing's users, the RoPE's users, a fix's undo)
    holds a patched model alive: dropped without ``unpatch_model``, it is collected (and gives back what it used).
    The model carries an instance ``forward`` bound to itself first, as TRL's fused LM head does."""
    model = build(name)
    model.forward = types.MethodType(type(model).forward, model)
    patch_model(model)
    if not fix_named(name).automatic:
        install_fix(model, name)
    assert name in installed(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
