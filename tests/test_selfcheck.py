"""The contamination self-check is read-only: parameters, buffers, quantization states and training flags as found."""

from __future__ import annotations

import pytest
import torch
from contaminating_model import DropsPackingMetadata
from transformers import LlamaForCausalLM

from unpack_trainer.selfcheck import ContaminationReport, check_uncontaminated

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
    from unpack_trainer.model_zoo.tiny import tiny_model
    from unpack_trainer.models import patch_model

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
    from unpack_trainer.model_zoo.tiny import tiny_model
    from unpack_trainer.models import patch_model

    model = patch_model(tiny_model("gemma3n_text").eval())
    report = check_uncontaminated(model, branched=branched)
    assert report.ok and report.conclusive, report.summary()


# -- low precision: noise against contamination ----------------------------------------------------------------------


def _gpt_oss(dtype=torch.bfloat16):
    """The benchmark's gpt_oss family (``benchmarks/bench_gpu.py``: attention sinks, 16 experts routed top-4, windows
    of 128 on every other layer, eager attention) at 4 layers of 512, built in ``dtype`` as the benchmark builds it,
    patched. In bf16 on the CPU its routers flip between the packed and the unpacked forward: max |packed -
    one-by-one| 0.35 against a tolerance of 0.15 here, on the unpacked run's tokens, 0 across the packed rows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from unpack_trainer.models import patch_model

    config = AutoConfig.for_model(
        "gpt_oss",
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=512,
        num_local_experts=16,
        num_experts_per_tok=4,
        vocab_size=1024,
        max_position_embeddings=8192,
        sliding_window=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    finally:
        torch.set_default_dtype(previous)
    return patch_model(model)


def test_bf16_routing_noise_passes():
    """A bf16 mixture of experts whose routers flip between two summation orders moves a few tokens far beyond the
    tolerance and no packed token; the benchmark's gpt_oss trained padded on an H200 because of it."""
    report = check_uncontaminated(_gpt_oss())
    assert report.ok and report.conclusive, report.summary()
    assert report.dtype == torch.bfloat16 and report.compared_tokens == 8
    assert report.off_share <= 0.25 and report.max_abs_diff <= report.hard_bound
    assert "packed tokens above it" in report.summary()
    if not report.max_abs_diff > report.tolerance:
        pytest.skip(f"no router flipped on this CPU's bf16 kernels: nothing to forgive ({report.summary()})")


def test_bf16_contamination_fails():
    """The same model with the packing metadata dropped (each row one causal sequence): every packed token moves."""
    report = check_uncontaminated(DropsPackingMetadata(_gpt_oss()))
    assert not report.ok and report.error is None, report.summary()
    assert report.off_tokens == report.compared_tokens == 8
    assert report.max_abs_diff > report.hard_bound
    failure = report.failure()
    assert failure.startswith("contamination measured: max |packed - one-by-one| = ")
    assert "8 of 8 packed tokens (100%) differ by more than the tolerance" in failure


def test_bf16_contamination_in_one_layer_fails():
    """Only the last layer's attention runs over the whole row: still every packed token moves beyond the
    tolerance."""
    from unpack_trainer.packed_seq_info import INFO_KEY, PackedSeqInfo

    def whole_rows(module, args, kwargs):
        info = kwargs.get(INFO_KEY)
        if info is not None:
            rows = torch.full((info.batch_size,), info.seq_len, dtype=torch.int32)
            kwargs[INFO_KEY] = PackedSeqInfo.from_seq_lengths(rows, batch_size=info.batch_size, seq_len=info.seq_len)
        return args, kwargs

    model = _gpt_oss()
    model.model.layers[-1].self_attn.register_forward_pre_hook(whole_rows, with_kwargs=True)
    report = check_uncontaminated(model, measure_contamination=False)
    assert not report.ok, report.summary()
    assert report.off_share > 0.25


def test_fp32_keeps_the_max_rule():
    report = check_uncontaminated(_gpt_oss(torch.float32))
    assert report.ok and report.conclusive, report.summary()
    assert report.hard_bound is None and report.bound == report.tolerance and report.off_tokens == 0
    assert "packed tokens" not in report.summary()
    failed = ContaminationReport(False, 0.5, 1e-4, 0.5, torch.float32, 0.01)
    assert (
        failed.failure()
        == "contamination measured: max |packed - one-by-one| = 0.5 > tolerance 0.0001 (torch.float32)"
    )


# Hand-written per-token differences (tolerance 0.1, max|alone| 1: hard bound 0.5 in low precision).
JUDGE_CASES = {
    "one packed token of four off": ([0.01, 0.3, 0.01, 0.01], [], {torch.bfloat16: True, torch.float32: False}),
    "two of four off": ([0.01, 0.3, 0.2, 0.01], [], {torch.bfloat16: False, torch.float32: False}),
    "every packed token off, each below the hard bound": ([0.2] * 4, [], {torch.bfloat16: False}),
    "every unpacked token off": ([0.0] * 4, [0.4, 0.4, 0.4], {torch.float16: True, torch.float32: False}),
    "an unpacked token beyond the hard bound": ([0.0] * 4, [0.6, 0.0, 0.0], {torch.bfloat16: False}),
    "a packed token beyond the hard bound": ([0.6, 0.0, 0.0, 0.0], [], {torch.bfloat16: False}),
    "every token within the tolerance": ([0.05] * 4, [0.05], {torch.bfloat16: True, torch.float32: True}),
}


def test_judge_fails_a_nan_token_in_every_dtype():
    from unpack_trainer.selfcheck import _judge

    nan = float("nan")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for diffs, unpacked in (([nan, 0.0, 0.0, 0.0], []), ([0.0] * 4, [nan])):
            ok, *_ = _judge(torch.tensor(diffs), torch.tensor(unpacked), tolerance=0.1, scale=1.0, dtype=dtype)
            assert ok is False, (dtype, diffs, unpacked)


@pytest.mark.parametrize("case", list(JUDGE_CASES))
def test_judge(case):
    from unpack_trainer.selfcheck import _judge

    diffs, unpacked, verdicts = JUDGE_CASES[case]
    for dtype, expected in verdicts.items():
        ok, max_diff, hard_bound, off_tokens = _judge(
            torch.tensor(diffs), torch.tensor(unpacked), tolerance=0.1, scale=1.0, dtype=dtype
        )
        assert ok is expected, (case, dtype)
        assert max_diff == pytest.approx(max(diffs + unpacked))
        assert off_tokens == sum(d > 0.1 for d in diffs)
        if dtype == torch.float32:
            assert hard_bound is None
        else:
            assert hard_bound == pytest.approx(0.5 + 1e-5)


def test_the_vision_probe_holds_only_ids_the_model_can_embed():
    """Issue 46 item 5: a Qwen2.5-VL config whose ``vision_end_token_id`` keeps transformers' default (151653) on a
    small vocabulary: the probe put that id on its rows (``IndexError``: "training padded instead", while stock
    trains); the processor never emits it, so the probe leaves it out. An image placeholder the model cannot embed is
    refused with that reason."""
    from unpack_trainer.model_zoo.tiny_vision import tiny_vision_model
    from unpack_trainer.models import patch_model, unpatch_model

    model = tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa")
    model.config.vision_end_token_id = 151653
    patch_model(model)
    report = check_uncontaminated(model, measure_contamination=False)
    assert report.ok and report.conclusive, report.summary()
    model.config.image_token_id = 151655
    report = check_uncontaminated(model, measure_contamination=False)
    assert not report.ok and "image_token_id 151655 is outside its text vocabulary of 128 ids" in report.summary()
    unpatch_model(model)
