"""The model_type registry, the blocklist, and patch_model / unpatch_model bookkeeping."""

from __future__ import annotations

import gc
import pkgutil

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, MambaConfig
from transformers.models.llama import modeling_llama

import unpack_trainer
import unpack_trainer.models as models
from unpack_trainer._compat import hub_kernel_function
from unpack_trainer.models import (
    PatchRefused,
    RefusalKind,
    is_patched,
    mixers,
    patch_model,
    resolve_backend,
    unpatch_model,
)
from unpack_trainer.models.refusals import REFUSAL_CHECKS
from unpack_trainer.patches import attention, rope

# On top of unpack_trainer.model_zoo.tiny's sizes; None takes LlamaConfig's default.
SIZES = dict(
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=64,
    head_dim=None,
    max_position_embeddings=None,
    initializer_range=None,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


@pytest.fixture(scope="module")
def llama(tiny_model):
    """``llama(attn_implementation=None)``: a one-layer tiny Llama (hidden 32, 2 heads, 1 key/value head), seed 0."""

    def build(**kwargs):
        return tiny_model("llama", **kwargs, **SIZES)

    return build


def test_no_module_per_architecture():
    """The patch is generic: the room holds one module per responsibility, and what a model family needs beyond it
    lives in ``fixes/`` (one module and one record each, tests/models/fixes/test_fixes.py); what a model is made of is
    read in ``anatomy/`` (tests/anatomy/), the models the package builds live in ``model_zoo/``, the self-check beside
    the trainer's decision; which patched models stay exact under sequence parallelism is read from the patch's state.
    Beside the patch: the verified types (data)."""
    modules = {info.name for info in pkgutil.iter_modules(models.__path__)}
    assert modules == {
        "fixes", "mixers", "packed_forward", "patch", "preview", "refusals", "routing", "sequence_parallel", "state",
        "verified",
    }  # fmt: skip


def test_public_exports():
    assert unpack_trainer.patch_model is patch_model
    assert unpack_trainer.unpatch_model is unpatch_model
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2"} <= set(
        unpack_trainer.supported_model_types()
    )


@pytest.mark.parametrize(
    ("config", "kind", "fragment"),
    [
        # ALiBi in attention without a packed forward (bloom and mpt have one: unpack_trainer.models.fixes.alibi)
        (
            FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64, alibi=True),
            "alibi",
            "ALiBi",
        ),
    ],
)
def test_refusals_name_the_reason(config, kind, fragment):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(PatchRefused, match=fragment) as refused:
        patch_model(model)
    assert refused.value.kind == kind and isinstance(refused.value, ValueError)
    assert not is_patched(model)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        patch_model(torch.nn.Linear(2, 2))


def test_a_mixer_no_handler_owns_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(mixers, "MIXER_HANDLERS", [])
    model = AutoModelForCausalLM.from_config(MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=64))
    with pytest.raises(PatchRefused, match=r"MambaMixer \(backbone\.layers\.0\.mixer\)") as refused:
        patch_model(model)
    assert refused.value.kind == "state" and not is_patched(model)


def test_refusal_checks_are_ordered_and_typed():
    """The checks run in a fixed order, each with an enum kind; the blocking kinds are the ones the trainer pads."""
    kinds = [kind for kind, _ in REFUSAL_CHECKS]
    assert all(isinstance(kind, RefusalKind) for kind in kinds)
    assert kinds.index(RefusalKind.BIDIRECTIONAL) < kinds.index(RefusalKind.ALIBI)
    assert kinds.index(RefusalKind.ALIBI) < kinds.index(RefusalKind.STATE) < kinds.index(RefusalKind.UNREACHABLE)
    assert {kind for kind in RefusalKind if kind.blocking} == {"blocklist", "bidirectional", "alibi", "positions", "state"}
    assert PatchRefused("x", "why", "state").kind is RefusalKind.STATE


def test_a_mixer_handler_turns_the_state_refusal_into_a_patch(monkeypatch, tiny_model):
    """The seam of unpack_trainer.models.mixers: a handler that owns LFM2's short convolutions makes the model
    patchable; it is called on each mixer, sees the packing metadata inside a packed forward (and none otherwise), and
    is undone by unpatch_model."""
    model = tiny_model("lfm2")  # layer 0 a short convolution, layer 1 attention
    monkeypatch.setattr(mixers, "MIXER_HANDLERS", [])
    with pytest.raises(PatchRefused, match="Lfm2ShortConv") as refused:
        patch_model(model)
    assert refused.value.kind is RefusalKind.STATE

    seen = []

    class ShortConvHandler:
        name = "test_short_conv"

        def handles(self, mixer):
            return type(mixer.module).__name__ == "Lfm2ShortConv"

        def patch(self, module, decoder):
            hook = module.register_forward_pre_hook(lambda m, args: seen.append(decoder.running))
            module._test_hook = hook

        def unpatch(self, module):
            module.__dict__.pop("_test_hook").remove()

    monkeypatch.setattr(mixers, "MIXER_HANDLERS", [ShortConvHandler()])
    patch_model(model)
    conv = model.model.layers[0].conv
    assert is_patched(model) and hasattr(conv, "_test_hook")
    with torch.no_grad():
        model(input_ids=torch.randint(3, 64, (1, 5)), position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
        model(input_ids=torch.randint(3, 64, (1, 5)))
    assert seen[0].seq_lengths.tolist() == [3, 2] and seen[1] is None
    unpatch_model(model)
    assert not hasattr(conv, "_test_hook") and not conv._forward_pre_hooks and not is_patched(model)


@pytest.mark.parametrize("family", ["llama", "qwen2_vl", "gemma3"])
def test_patch_discovers_the_model_once(monkeypatch, family):
    """patch_model reads what the model is made of once, for all its decoders, its attention features and every fix
    (a vision-language model's three fixes included), not once per decoder or per fix."""
    from unpack_trainer.anatomy import structure
    from unpack_trainer.model_zoo.tiny import tiny_model
    from unpack_trainer.model_zoo.tiny_vision import family_unavailable_reason, tiny_vision_model
    from unpack_trainer.models.state import decoder_state

    if family != "llama" and family_unavailable_reason(family) is not None:
        pytest.skip(family_unavailable_reason(family))
    model = tiny_model(family) if family == "llama" else tiny_vision_model(family)
    found = []

    class Counted(structure.ModelStructure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            found.append(type(self.pretrained).__name__)

    monkeypatch.setattr(structure, "ModelStructure", Counted)
    patch_model(model)
    try:
        assert len(found) == 1, found
        if family != "llama":
            installed = {
                name for module in model.modules() if decoder_state(module) for name in decoder_state(module).fixes
            }
            assert "vision_language" in installed, installed
    finally:
        unpatch_model(model)


def test_patch_is_idempotent_and_undone(llama):
    model = llama(attn_implementation="sdpa")
    original_rope = modeling_llama.apply_rotary_pos_emb
    decoder = model.model
    assert patch_model(model) is model and patch_model(model) is model
    assert is_patched(model)
    assert model.config._attn_implementation == "sdpa"  # transformers' own name (issue 20 item 12)
    assert len(decoder._forward_pre_hooks) == 1 and len(decoder._forward_hooks) == 1
    assert hub_kernel_function(modeling_llama.apply_rotary_pos_emb) is rope.apply_rotary_pos_emb
    assert unpatch_model(model) is model and unpatch_model(model) is model
    assert not is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert not decoder._forward_pre_hooks and not decoder._forward_hooks
    assert modeling_llama.apply_rotary_pos_emb is original_rope


def test_flags_and_repatching(llama):
    model = llama(attn_implementation="eager")
    original_rope = modeling_llama.apply_rotary_pos_emb
    patch_model(model, rope=False)
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert model.config._attn_implementation == "eager"
    patch_model(model, attention=False)  # other flags: re-patch
    assert model.config._attn_implementation == "eager" and not model.model._forward_pre_hooks
    assert hub_kernel_function(modeling_llama.apply_rotary_pos_emb) is rope.apply_rotary_pos_emb
    unpatch_model(model)
    assert modeling_llama.apply_rotary_pos_emb is original_rope


def test_rope_restored_only_after_the_last_patched_model(llama):
    first, second = llama(), llama()
    original_rope = modeling_llama.apply_rotary_pos_emb
    patch_model(first)
    patch_model(second)
    unpatch_model(first)
    assert hub_kernel_function(modeling_llama.apply_rotary_pos_emb) is rope.apply_rotary_pos_emb
    unpatch_model(second)
    assert modeling_llama.apply_rotary_pos_emb is original_rope


def test_peft_wrapped_model_is_patched_in_place(llama):
    from peft import LoraConfig, get_peft_model

    model = llama()
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    patch_model(peft_model)
    assert is_patched(model) and model.config._attn_implementation == "sdpa"
    patch_model(model)  # the same decoder: still one hook
    assert len(model.model._forward_pre_hooks) == 1
    unpatch_model(peft_model)
    assert not is_patched(model)


def test_resolve_backend(monkeypatch, llama, stand_in_kernel):
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    model = llama(attn_implementation="sdpa")
    choice = resolve_backend(model)
    assert choice.name == "sdpa" and "flash" in choice.reason
    name, reason = resolve_backend(patch_model(model))
    assert name == "sdpa"
    assert resolve_backend(llama(attn_implementation="eager")).name == "eager"
    monkeypatch.setenv(attention.ENV_BACKEND, "eager")
    assert tuple(resolve_backend(model)) == ("eager", "forced by UNPACK_ATTENTION_BACKEND")
    # The trainer's test seam: pretend flash-attn runs on this device.
    monkeypatch.delenv(attention.ENV_BACKEND)
    stand_in_kernel("flash", object(), cpu=True)
    assert resolve_backend(model.to(torch.bfloat16)).name == "flash"


def test_explicit_metadata_checks(llama):
    model = patch_model(llama())
    ids = torch.randint(0, 64, (1, 5))
    lengths = torch.tensor([3, 2], dtype=torch.int32)
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_length_q`=2 but the longest packed sample has 3"):
            model(input_ids=ids, packed_seq_lengths=lengths, max_length_q=2)
        with pytest.raises(ValueError, match="`cu_seq_lens_k` does not match"):
            model(input_ids=ids, packed_seq_lengths=lengths, cu_seq_lens_k=torch.tensor([0, 2, 5], dtype=torch.int32))
        with pytest.raises(ValueError, match="cannot also hide tokens with an `attention_mask`"):
            model(input_ids=ids, packed_seq_lengths=lengths, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]))
        # Without position_ids they are filled in per sample; an all-ones mask is dropped.
        filled = model(input_ids=ids, packed_seq_lengths=lengths, attention_mask=torch.ones(1, 5)).logits
        explicit = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]])).logits
    assert torch.equal(filled, explicit)


def test_deep_copy_of_a_patched_model(llama):
    import copy

    model = patch_model(llama())
    clone = copy.deepcopy(model)
    assert is_patched(clone) and len(clone.model._forward_pre_hooks) == 1
    ids = torch.randint(0, 64, (1, 6))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=positions).logits
        assert torch.equal(clone(input_ids=ids, position_ids=positions).logits, expected)
    unpatch_model(clone)
    assert not clone.model._forward_pre_hooks and not clone.model._forward_hooks
    assert clone.config._attn_implementation == "sdpa"
    assert is_patched(model) and len(model.model._forward_pre_hooks) == 1
    unpatch_model(model)
    assert not model.model._forward_pre_hooks


def test_rope_released_when_the_last_patched_model_is_collected(llama):

    gc.collect()
    original_rope = modeling_llama.apply_rotary_pos_emb
    assert original_rope is not rope.apply_rotary_pos_emb  # no earlier test left a patched model alive
    model = patch_model(llama())
    assert hub_kernel_function(modeling_llama.apply_rotary_pos_emb) is rope.apply_rotary_pos_emb
    del model
    gc.collect()
    assert modeling_llama.apply_rotary_pos_emb is original_rope


@pytest.mark.parametrize(
    ("model_type", "feature"), [("gemma2", "softcap"), ("gpt_oss", "sinks")], ids=["softcap", "sinks"]
)
def test_resolve_backend_sees_what_the_attention_applies(monkeypatch, model_type, feature, tiny_model):
    """A forced backend that cannot apply what the model's attention applies (softcapping, sinks) is an error when
    the backend is resolved (the trainer's start), not at the first packed step."""
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    model = tiny_model(model_type, attn_implementation="eager")  # both types support eager only
    assert resolve_backend(model).name == "eager"
    monkeypatch.setenv(attention.ENV_BACKEND, "sdpa")
    with pytest.raises(ValueError, match=f"UNPACK_ATTENTION_BACKEND=sdpa cannot apply .*{feature[:4]}"):
        resolve_backend(model)
    monkeypatch.setenv(attention.ENV_BACKEND, "eager")
    assert resolve_backend(model).name == "eager"
