"""The contamination self-check is read-only: parameters, buffers, quantization states and training flags as found."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from unpack_trainer.models.selfcheck import check_uncontaminated

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _lora_4bit(path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    )
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    model = get_peft_model(model, config)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # non-zero B so that every LoRA matrix gets a gradient
            torch.nn.init.normal_(parameter, std=0.02)
    return model


def _lora_gradients(model):
    model.train()
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _quant_snapshot(model):
    out = {}
    for name, module in model.named_modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            out[name] = (
                module.weight.data.clone(),
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(state).items() if k != "state2"},
            )
    return out


def test_selfcheck_leaves_a_4bit_model_and_its_gradients_unchanged(tmp_path, tiny_llama):
    """On AVX512-BF16 CPUs bitsandbytes converts 4-bit weights to an inference-only layout in an eval-mode no-grad
    forward; the probe must not leave that behind (training then got wrong gradients)."""
    pytest.importorskip("bitsandbytes")
    # hidden 64 / intermediate 128: shapes bitsandbytes' CPU conversion accepts (N % 32 == 0, K % blocksize == 0)
    torch.manual_seed(0)
    config = tiny_llama().config
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    reference = _lora_4bit(tmp_path / "base")
    probed = _lora_4bit(tmp_path / "base")
    before = _quant_snapshot(probed)
    assert before, "the model has no 4-bit layer"
    report = check_uncontaminated(probed)
    assert report.ok, report.summary()
    after = _quant_snapshot(probed)
    assert before.keys() == after.keys()
    for name, (weight, state) in before.items():
        assert torch.equal(weight, after[name][0]), name
        assert state.keys() == after[name][1].keys(), name
        for key, value in state.items():
            other = after[name][1][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, (name, key)
    loss, gradients = _lora_gradients(reference)
    probed_loss, probed_gradients = _lora_gradients(probed)
    torch.testing.assert_close(probed_loss, loss, rtol=0, atol=0)
    assert gradients.keys() == probed_gradients.keys() and len(gradients) == 12
    for name, gradient in gradients.items():
        torch.testing.assert_close(probed_gradients[name], gradient, rtol=1e-6, atol=1e-7, msg=name)


class _Rewrites(torch.nn.Module):
    """A causal LM stand-in whose eval forward reassigns a weight's data, swaps a buffer and flips a submodule's
    mode: everything the probe must undo."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.config = self.inner.config
        self.register_buffer("counter", torch.zeros(1))

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        if not self.training:
            head = self.inner.lm_head
            head.weight.data = head.weight.data.clone()
            self.counter = self.counter + 1
            self.inner.model.norm.train()
        return self.inner(**kwargs)


def test_selfcheck_restores_reassigned_tensors_and_training_flags(tiny_llama):
    model = _Rewrites(tiny_llama())
    model.train()
    model.inner.model.layers[0].eval()  # a mixed state, kept as is
    weight, pointer, counter = model.inner.lm_head.weight, model.inner.lm_head.weight.data_ptr(), model.counter
    modes = {name: m.training for name, m in model.named_modules()}
    assert check_uncontaminated(model).ok
    assert model.inner.lm_head.weight is weight and weight.data_ptr() == pointer
    assert model.counter is counter and float(counter) == 0.0
    assert {name: m.training for name, m in model.named_modules()} == modes


def _hooks_and_flags(model):
    """Every hook dictionary of every module (copied: the hook objects themselves) and the attributes transformers
    sets when it installs its output-capturing hooks."""
    return {
        (name, key): dict(value) if isinstance(value, dict) else value
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if ("hooks" in key and isinstance(value, dict)) or key == "_output_capturing_hooks_installed"
    }


def test_selfcheck_leaves_hooks_as_found_and_the_model_picklable(tiny_llama):
    """Issue 20 item 3: the probe's ``output_hidden_states=True`` forward made transformers install permanent forward
    hooks (local functions), so ``torch.save(model)`` failed after a packed run."""
    import io

    model = tiny_llama()
    before = _hooks_and_flags(model)
    report = check_uncontaminated(model)
    assert report.ok, report.summary()
    assert _hooks_and_flags(model) == before
    torch.save(model, io.BytesIO())
    model(input_ids=torch.tensor([[3, 4, 5]]), output_hidden_states=True)  # transformers' own install still works
    assert getattr(model.model, "_output_capturing_hooks_installed", False)


def test_selfcheck_keeps_hooks_installed_before_it(tiny_llama):
    model = tiny_llama()
    model(input_ids=torch.tensor([[3, 4, 5]]), output_hidden_states=True)
    handle = model.model.layers[0].register_forward_hook(lambda module, args, output: None)
    before = _hooks_and_flags(model)
    assert check_uncontaminated(model).ok
    assert _hooks_and_flags(model) == before
    handle.remove()


# -- the branched probe (prompts shared by their completions, DPO's prefix sharing) ---------------------------------

BRANCHED_MODELS = {
    "llama/sdpa": ("llama", "sdpa", {}),
    "llama/eager": ("llama", "eager", {}),
    "qwen3/window": ("qwen3", "sdpa", dict(use_sliding_window=True, max_window_layers=1, sliding_window=3)),
    "gemma2/softcap": ("gemma2", "eager", dict(attn_logit_softcapping=20.0, sliding_window=3)),
    # numbers its own positions from padding_idx + 1: the branches' must continue the prompt's
    "roberta/decoder": ("roberta", "sdpa", dict(is_decoder=True)),
}


def _branched_model(key):
    from unpack_trainer.models import patch_model
    from unpack_trainer.models.tiny import tiny_model

    model_type, backend, overrides = BRANCHED_MODELS[key]
    model = tiny_model(model_type, attn_implementation=backend, hidden_size=32, head_dim=8, **overrides)
    patch_model(model)
    return model


@pytest.mark.parametrize("key", list(BRANCHED_MODELS))
def test_branched_probe_passes_on_patched_models_and_is_conclusive(key):
    report = check_uncontaminated(_branched_model(key), branched=True)
    assert report.ok, report.summary()
    assert report.conclusive, report.summary()


@pytest.mark.parametrize("kind", ["sibling", "parents"])
def test_branched_probe_fails_when_branches_leak_and_the_plain_probe_still_passes(kind, leak_branches):
    model = _branched_model("llama/sdpa")
    leak_branches(kind)
    assert check_uncontaminated(model).ok
    report = check_uncontaminated(model, branched=True)
    assert not report.ok and report.error is None, report.summary()
    assert report.max_abs_diff > report.tolerance


def test_branched_probe_fails_on_an_unpatched_model(tiny_llama):
    """transformers' own packed-position path reads a branch as continuing its sibling (its positions do not
    restart), which the probe sees."""
    report = check_uncontaminated(tiny_llama(), branched=True)
    assert not report.ok, report.summary()


def test_branched_probe_is_read_only(tiny_llama):
    from unpack_trainer.models import patch_model

    model = tiny_llama()
    patch_model(model)
    model.train()
    before = _hooks_and_flags(model)
    state = {name: (t, t.data_ptr(), t.clone()) for name, t in model.state_dict(keep_vars=True).items()}
    modes = {name: m.training for name, m in model.named_modules()}
    assert check_uncontaminated(model, branched=True).ok
    assert _hooks_and_flags(model) == before
    assert {name: m.training for name, m in model.named_modules()} == modes
    for name, tensor in model.state_dict(keep_vars=True).items():
        found, pointer, values = state[name]
        assert tensor is found and tensor.data_ptr() == pointer and torch.equal(tensor, values), name


@pytest.mark.parametrize("branched", [False, True], ids=["plain", "branched"])
def test_selfcheck_reads_every_stream_of_a_model_with_stacked_hidden_states(branched):
    """Gemma3n's hidden states are ``(altup streams, batch, tokens, hidden)``: the probe crashed on them (the plain
    probe split the streams as if they were rows). Every stream of every token is compared now."""
    from unpack_trainer.models import patch_model
    from unpack_trainer.models.tiny import tiny_model

    model = patch_model(tiny_model("gemma3n_text").eval())
    report = check_uncontaminated(model, branched=branched)
    assert report.ok and report.conclusive, report.summary()
