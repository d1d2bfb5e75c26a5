"""Packed == unpacked, architecture x backend, on tiny random models in fp32 on the CPU.

- packed logits == every sample run alone (relative 1e-5);
- packed loss and every parameter gradient == a padded batch of the same samples (token-mean loss), also with
  gradient checkpointing (reentrant and not), PEFT LoRA and bitsandbytes 4-bit QLoRA;
- sliding windows smaller than the samples (mistral, qwen2, qwen3);
- a padded batch with ``attention_mask`` and ``generate()`` with a KV cache are bit-identical with and without the
  patch; no (T, T) mask is built for a packed batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from unpack_trainer._compat import cache_keyword, enable_checkpointing, output_cache
from unpack_trainer.model_zoo.tiny import loss_and_grads, padded_batch
from unpack_trainer.models import patch_model, supported_model_types, unpatch_model
from unpack_trainer.models.state import attention_state
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches import attention as attention_module

VOCAB = 128
# On top of unpack_trainer.model_zoo.tiny's sizes (2 layers, 4 heads, 2 key/value heads, vocabulary 128, initializer range 0.1,
# larger than the usual 0.02 so that attention patterns, and any contamination, move the logits visibly); None takes
# the config class's default.
SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=512,
    head_dim=None,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    sliding_window=None,
    use_sliding_window=None,
    max_window_layers=None,
)

# model_type -> its sizes on top of SIZES. test_deep_tested_architectures_are_verified checks they are verified types.
ARCHITECTURES = {"llama": {}, "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=16)}
SLIDING = {
    "mistral": dict(sliding_window=16),
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
}
BACKENDS = ["sdpa", "eager"]
REL = 1e-5


@pytest.fixture(scope="module")
def build_model(tiny_model):
    """``build_model(arch, backend, **config_overrides)``: the architecture's tiny model, seed 0, in eval mode."""

    def build(arch: str, backend: str, **overrides) -> torch.nn.Module:
        sizes = {**SIZES, **ARCHITECTURES[arch], **overrides}
        return tiny_model(arch, attn_implementation=backend, **sizes).eval()

    return build


def make_samples(lengths, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator) for length in lengths]


def packed_batch(samples, *, row_len: int | None = None, rows: int = 1) -> dict:
    """The collator contract: (rows, T) input_ids, restarting position_ids, -100 at each sample's first label,
    packed_seq_lengths / cu_seq_lens / max_length, no attention_mask. Samples are dealt to rows in order; each row
    is padded to ``row_len`` with a trailing pseudo-sample."""
    per_row = [samples[i::rows] for i in range(rows)] if rows > 1 else [samples]
    row_len = row_len or max(sum(len(s) for s in row) for row in per_row)
    ids, positions, labels, lengths = [], [], [], []
    for row in per_row:
        row_lengths = [len(s) for s in row]
        pad = row_len - sum(row_lengths)
        assert pad >= 0
        row_ids = torch.cat([*row, torch.zeros(pad, dtype=torch.long)])
        row_labels = row_ids.clone()
        start = 0
        for length in row_lengths:
            row_labels[start] = -100
            start += length
        row_labels[start:] = -100
        if pad:
            row_lengths.append(pad)
        ids.append(row_ids)
        labels.append(row_labels)
        positions.append(torch.cat([torch.arange(length) for length in row_lengths]))
        lengths += row_lengths
    seq_lengths = torch.tensor(lengths, dtype=torch.int32)
    cu = torch.nn.functional.pad(seq_lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return {
        "input_ids": torch.stack(ids),
        "position_ids": torch.stack(positions),
        "labels": torch.stack(labels),
        "packed_seq_lengths": seq_lengths,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(seq_lengths.max()),
        "max_length_k": int(seq_lengths.max()),
    }


def logits_alone(model, samples) -> list[torch.Tensor]:
    """Each sample's logits from a forward of that sample alone (equal lengths share an unpadded batch)."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    by_length: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        by_length.setdefault(len(sample), []).append(index)
    with torch.no_grad():
        for indices in by_length.values():
            logits = model(input_ids=torch.stack([samples[i] for i in indices])).logits
            for row, index in enumerate(indices):
                out[index] = logits[row]
    return out


def packed_logits_per_sample(logits: torch.Tensor, samples, rows: int = 1) -> list[torch.Tensor]:
    per_row = [list(range(len(samples)))[i::rows] for i in range(rows)]
    out: list[torch.Tensor | None] = [None] * len(samples)
    for row, indices in enumerate(per_row):
        start = 0
        for index in indices:
            out[index] = logits[row, start : start + len(samples[index])]
            start += len(samples[index])
    return out


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL, what: str = "") -> None:
    scale = expected.abs().max().clamp_min(1e-12)
    error = (actual - expected).abs().max()
    assert error <= rel * scale, f"{what}: max abs error {error:.3e} > {rel} x max |expected| {scale:.3e}"


def assert_samples_match(model, samples, batch, rows: int = 1, rel: float = REL) -> None:
    with torch.no_grad():
        packed = model(**batch).logits
    for index, (got, want) in enumerate(
        zip(packed_logits_per_sample(packed, samples, rows), logits_alone(model, samples))
    ):
        assert_rel_close(got, want, rel, f"sample {index} (length {len(samples[index])})")


def assert_loss_and_grads_match(model, samples, rel: float = REL) -> None:
    padded_loss, padded_grads = loss_and_grads(model, padded_batch(samples))
    packed_loss, packed_grads = loss_and_grads(model, packed_batch(samples, row_len=sum(map(len, samples)) + 3))
    assert_rel_close(packed_loss, padded_loss, rel, "loss")
    assert padded_grads.keys() == packed_grads.keys() and padded_grads
    for name, grad in padded_grads.items():
        assert grad.abs().max() > 0, f"{name} got no gradient"
        assert_rel_close(packed_grads[name], grad, rel, f"grad of {name}")


@pytest.fixture
def backend_calls(wrap_backends):
    """Counts calls per packed backend, to check which one ran."""
    calls: dict[str, int] = dict.fromkeys(attention_module.REGISTRY, 0)

    def count(name, forward):
        def spy(*args, **kwargs):
            calls[name] += 1
            return forward(*args, **kwargs)

        return spy

    wrap_backends(count)
    return calls


LENGTHS = [7, 1, 12, 3, 9, 2, 5]
MATRIX = pytest.mark.parametrize("backend", BACKENDS)
ARCHS = pytest.mark.parametrize("arch", sorted(ARCHITECTURES))


@ARCHS
@MATRIX
def test_packed_logits_match_each_sample_alone(arch, backend, backend_calls, build_model):
    model = patch_model(build_model(arch, backend))
    samples = make_samples(LENGTHS)
    assert_samples_match(model, samples, packed_batch(samples, row_len=45))
    # 2 layers, one packed call each; nothing else ran.
    assert backend_calls[backend] == 2 and sum(backend_calls.values()) == 2


@ARCHS
@MATRIX
def test_position_ids_only_and_several_rows(arch, backend, backend_calls, build_model):
    model = patch_model(build_model(arch, backend))
    samples = make_samples([6, 4, 1, 8, 3, 5], seed=2)
    batch = packed_batch(samples, rows=2, row_len=18)
    assert_samples_match(model, samples, batch, rows=2)
    only_positions = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    assert_samples_match(model, samples, only_positions, rows=2)
    # A padding-free batch that carries an all-ones mask anyway (stock transformers then ignores the packing).
    ones = torch.ones_like(batch["input_ids"])
    assert_samples_match(model, samples, {**only_positions, "attention_mask": ones}, rows=2)
    assert backend_calls[backend] == 6


@ARCHS
@MATRIX
def test_packed_loss_and_grads_match_padded(arch, backend, build_model):
    model = patch_model(build_model(arch, backend)).train()
    assert_loss_and_grads_match(model, make_samples(LENGTHS))


@ARCHS
@MATRIX
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(arch, backend, reentrant, backend_calls, build_model):
    model = patch_model(build_model(arch, backend)).train()
    enable_checkpointing(model, {"use_reentrant": reentrant})
    assert_loss_and_grads_match(model, make_samples(LENGTHS))
    # Packed forward and its recomputation in backward both took the packed path: 2 layers x 2.
    assert backend_calls[backend] == 4


@ARCHS
@MATRIX
def test_peft_lora(arch, backend, build_model):
    from peft import LoraConfig, get_peft_model

    model = patch_model(build_model(arch, backend))
    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = patch_model(get_peft_model(model, lora)).train()  # patching twice is a no-op
    assert_loss_and_grads_match(peft_model, make_samples(LENGTHS))


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, build_model):
    """Each architecture saved once, to reload 4-bit quantized."""
    paths = {}
    for arch in ARCHITECTURES:
        path = tmp_path_factory.mktemp(arch)
        build_model(arch, "sdpa").save_pretrained(path)
        paths[arch] = path
    return paths


@ARCHS
@MATRIX
def test_qlora_4bit(arch, backend, saved_models):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        saved_models[arch], quantization_config=quantization, attn_implementation=backend, dtype=torch.float32
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = patch_model(get_peft_model(model, lora)).train()
    # bnb_4bit_compute_dtype=float32: the 4-bit weights are dequantized to fp32, so the fp32 tolerance holds.
    assert_loss_and_grads_match(peft_model, make_samples(LENGTHS))


@pytest.mark.parametrize(("forced", "loaded"), [("eager", "sdpa"), ("sdpa", "eager")])
def test_environment_variable_forces_the_backend(forced, loaded, monkeypatch, backend_calls, build_model):
    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", forced)
    model = patch_model(build_model("qwen2", loaded, **SLIDING["qwen2"]))
    samples = make_samples([40, 23, 9], seed=8)
    assert_samples_match(model, samples, packed_batch(samples))
    assert backend_calls[forced] == 2 and sum(backend_calls.values()) == 2


@pytest.mark.parametrize("arch", sorted(SLIDING))
@MATRIX
def test_sliding_window_smaller_than_samples(arch, backend, build_model):
    model = patch_model(build_model(arch, backend, **SLIDING[arch]))
    samples = make_samples([40, 23, 40, 9, 17], seed=3)
    assert_samples_match(model, samples, packed_batch(samples))
    model.train()
    assert_loss_and_grads_match(model, samples)


@ARCHS
@MATRIX
def test_padded_batch_and_generate_unchanged(arch, backend, build_model):
    samples = make_samples([9, 4, 13], seed=4)
    model = build_model(arch, backend)
    right, left = padded_batch(samples), padded_batch(samples, left=True)
    generate = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    generate_inputs = {"input_ids": left["input_ids"], "attention_mask": left["attention_mask"]}
    with torch.no_grad():
        expected_logits = model(**right).logits
        expected = model.generate(**generate_inputs, **generate, pad_token_id=0)
        patch_model(model)
        logits = model(**right).logits
        generated = model.generate(**generate_inputs, **generate, pad_token_id=0)
    assert torch.equal(logits, expected_logits)
    assert torch.equal(generated.sequences, expected.sequences)
    for got, want in zip(generated.scores, expected.scores):
        assert torch.equal(got, want)


@ARCHS
@MATRIX
def test_length_one_samples_and_hundreds_of_samples(arch, backend, build_model):
    model = patch_model(build_model(arch, backend))
    ones = make_samples([1, 1, 6, 1, 1, 3, 1], seed=5)
    assert_samples_match(model, ones, packed_batch(ones))
    generator = torch.Generator().manual_seed(6)
    many = make_samples(torch.randint(1, 7, (300,), generator=generator).tolist(), seed=6)
    assert_samples_match(model, many, packed_batch(many))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_no_dense_mask_for_packed_batches(arch, monkeypatch, build_model):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    built = []
    for name in ("sdpa", "eager"):
        original = ALL_MASK_ATTENTION_FUNCTIONS[name]

        def spy(*args, _original=original, **kwargs):
            mask = _original(*args, **kwargs)
            built.append(None if mask is None else tuple(mask.shape))
            return mask

        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS, name, spy)
    sdpa_masks = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa_spy(*args, **kwargs):
        mask = kwargs.get("attn_mask")
        sdpa_masks.append(None if mask is None else tuple(mask.shape))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_spy)
    model = patch_model(build_model(arch, "sdpa", **SLIDING.get(arch, {})))
    samples = make_samples([40, 30, 20, 10], seed=7)
    with torch.no_grad():
        model(**packed_batch(samples))
        assert built == [] and sdpa_masks and all(m is None or m[-1] <= 40 for m in sdpa_masks)
        model(**padded_batch(samples))  # the spies do see the stock path's mask
    assert built and built[0][-1] == 40


def test_metadata_derived_once_per_forward(monkeypatch, build_model):
    calls = []
    original = PackedSeqInfo.from_position_ids.__func__

    def counting(cls, position_ids):
        calls.append(position_ids.shape)
        return original(cls, position_ids)

    monkeypatch.setattr(PackedSeqInfo, "from_position_ids", classmethod(counting))
    model = patch_model(build_model("llama", "sdpa", num_hidden_layers=3)).train()
    enable_checkpointing(model, {"use_reentrant": False})
    batch = packed_batch(make_samples(LENGTHS))
    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss.backward()
    assert len(calls) == 1


def test_packed_forward_with_use_cache_is_not_contaminated(build_model):
    """transformers stops detecting packing when a cache is used; the patch does not."""
    samples = make_samples(LENGTHS)
    batch = packed_batch(samples)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": True}
    model = build_model("llama", "sdpa")
    expected = logits_alone(model, samples)
    with torch.no_grad():
        stock = packed_logits_per_sample(model(**inputs).logits, samples)
        patch_model(model)
        patched = packed_logits_per_sample(model(**inputs).logits, samples)
    # The stock path mixes samples (so this test can fail); the patched one does not.
    assert (stock[-1] - expected[-1]).abs().max() > 1e3 * REL * expected[-1].abs().max()
    for got, want in zip(patched, expected):
        assert_rel_close(got, want)


def test_packed_forward_builds_no_cache_unless_asked(build_model):
    model = patch_model(build_model("llama", "sdpa"))
    batch = packed_batch(make_samples([4, 3]))
    with torch.no_grad():
        assert output_cache(model(**batch)) is None
        assert output_cache(model(**batch, use_cache=True)) is not None
        assert output_cache(model(input_ids=batch["input_ids"])) is not None  # unpacked: as without the patch


def test_packed_batch_with_cached_tokens_is_an_error(build_model):
    model = patch_model(build_model("llama", "sdpa"))
    prompt = make_samples([5])[0][None]
    with torch.no_grad():
        cache = output_cache(model(input_ids=prompt, use_cache=True))
        batch = packed_batch(make_samples([3, 2]))
        batch.pop("labels")
        with pytest.raises(ValueError, match="KV cache that already holds 5 tokens"):
            model(**batch, **{cache_keyword(model): cache})


def test_unpatch_restores_stock_behaviour(build_model):
    samples = make_samples(LENGTHS)
    batch = {**packed_batch(samples), "use_cache": False}  # with a cache, stock transformers ignores the packing
    model = build_model("llama", "eager")
    with torch.no_grad():
        stock = model(**batch).logits
        patch_model(model)
        patched = model(**batch).logits
        unpatch_model(model)
        again = model(**batch).logits
    assert model.config._attn_implementation == "eager"
    assert torch.equal(again, stock)
    assert_rel_close(patched, stock)  # stock eager builds the dense block mask: same numbers, T x T memory


def test_deep_tested_architectures_are_verified():
    """This module tests these types in depth (several rows, checkpointing, LoRA, QLoRA, generation); every verified
    type gets the one-by-one / padded checks in tests/models/test_coverage.py."""
    assert set(ARCHITECTURES) <= set(supported_model_types())


# ---------------------------------------------------------------------------------------------------------------------
# Chunked attention (llama4_text, issue 18 item 3): chunks counted from each sample's start
# ---------------------------------------------------------------------------------------------------------------------

# Chunks of 4 tokens, smaller than most samples; in the packed row no sample starts at a multiple of 4, so chunks
# counted from the row's start (what transformers' dense chunked mask does) would differ.
CHUNKED = dict(attention_chunk_size=4, max_position_embeddings=512, no_rope_layers=[1, 0])
CHUNKED_LENGTHS = [11, 2, 9, 5, 1, 14]


@pytest.fixture(scope="module")
def llama4(tiny_model):
    """``llama4(backend)``: a tiny llama4_text (layer 0 chunked attention, layer 1 full), seed 0, eval mode."""

    def build(backend: str) -> torch.nn.Module:
        return tiny_model("llama4_text", attn_implementation=backend, **CHUNKED).eval()

    return build


@MATRIX
def test_chunked_attention_counts_chunks_from_each_sample_start(backend, backend_calls, llama4):
    model = llama4(backend)
    assert model.config.layer_types[:2] == ["chunked_attention", "full_attention"]
    patch_model(model)
    assert attention_state(model.model.layers[0].self_attn).attention_chunk_size == 4
    assert attention_state(model.model.layers[1].self_attn).attention_chunk_size is None
    samples = make_samples(CHUNKED_LENGTHS, seed=11)
    assert_samples_match(model, samples, packed_batch(samples, row_len=45))
    assert backend_calls[backend] == 2 and sum(backend_calls.values()) == 2
    model.train()
    assert_loss_and_grads_match(model, samples)
    unpatch_model(model)
    assert attention_state(model.model.layers[0].self_attn) is None


def spy_on_masks(monkeypatch) -> list:
    """The shapes of the masks transformers' sdpa / eager mask functions return (``None``: no mask) from now on."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    built = []
    for name in ("sdpa", "eager"):
        original = ALL_MASK_ATTENTION_FUNCTIONS[name]

        def spy(*args, _original=original, **kwargs):
            mask = _original(*args, **kwargs)
            if mask is not None:
                built.append(tuple(mask.shape))
            return mask

        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS, name, spy)
    return built


def test_chunked_attention_builds_no_dense_mask(monkeypatch, llama4):
    built = spy_on_masks(monkeypatch)
    model = patch_model(llama4("sdpa"))
    samples = make_samples(CHUNKED_LENGTHS, seed=12)
    with torch.no_grad():
        model(**packed_batch(samples))
        assert built == []
        model(**padded_batch(samples))  # the spies do see the stock path's masks
    assert built


@MATRIX
def test_llama4_temperature_tuning_counts_positions_within_each_sample(backend, tiny_model):
    """llama4 scales its NoPE layers' queries by ``log1p(floor((p + 1) / floor_scale))``, ``p`` the position along
    the row; from ``floor_scale`` tokens on, a packed row must use each token's position in its sample (default
    ``floor_scale`` 8192: rows of 8192 tokens or more; 4 here)."""
    model = tiny_model("llama4_text", attn_implementation=backend, **CHUNKED, floor_scale=4, attn_scale=0.5).eval()
    samples = make_samples(CHUNKED_LENGTHS, seed=14)
    patch_model(model)
    assert attention_state(model.model.layers[1].self_attn).query_correction is not None  # the NoPE layer
    assert_samples_match(model, samples, packed_batch(samples, row_len=45))
    model.train()
    assert_loss_and_grads_match(model, samples)


def _patch_and_assert_generation_unchanged(model, samples):
    """Greedy ``generate()`` of ``samples`` left-padded, 6 new tokens: sequences and every step's scores bit-identical
    before and after ``patch_model`` (which leaves ``model`` patched)."""
    left = padded_batch(samples, left=True)
    generate = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    inputs = {"input_ids": left["input_ids"], "attention_mask": left["attention_mask"]}
    with torch.no_grad():
        expected = model.generate(**inputs, **generate, pad_token_id=0)
        patch_model(model)
        generated = model.generate(**inputs, **generate, pad_token_id=0)
    assert torch.equal(generated.sequences, expected.sequences)
    for got, want in zip(generated.scores, expected.scores):
        assert torch.equal(got, want)


@MATRIX
def test_chunked_attention_generates_as_stock(backend, llama4):
    _patch_and_assert_generation_unchanged(llama4(backend), make_samples([9, 4, 13], seed=4))


# ---------------------------------------------------------------------------------------------------------------------
# ALiBi (bloom, mpt; issue 18 item 2): the bias counts distance within each sample
# ---------------------------------------------------------------------------------------------------------------------

ALIBI_TYPES = ["bloom", "mpt"]


@pytest.fixture(scope="module")
def alibi_model(tiny_model):
    """``alibi_model(model_type)``: a tiny bloom / mpt (eager attention, the only one they have), seed 0, eval mode."""

    def build(model_type: str) -> torch.nn.Module:
        overrides = dict(max_seq_len=512) if model_type == "mpt" else {}
        return tiny_model(model_type, **overrides).eval()

    return build


@pytest.mark.parametrize("model_type", ALIBI_TYPES)
@MATRIX
def test_alibi_per_sample(model_type, backend, backend_calls, monkeypatch, alibi_model):
    """Packed logits == each sample alone, loss and every gradient == padded, on the SDPA buckets and eager."""
    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", backend)
    model = alibi_model(model_type)
    samples = make_samples(LENGTHS, seed=13)
    with torch.no_grad():
        stock_packed = model(**packed_batch(samples)).logits  # stock: ALiBi and attention across the whole row
    patch_model(model)
    assert_samples_match(model, samples, packed_batch(samples, row_len=45))
    assert backend_calls[backend] == 2 and sum(backend_calls.values()) == 2
    expected = torch.cat(logits_alone(model, samples))
    assert (stock_packed[0] - expected).abs().max() > 1e-3  # what the patch fixes
    model.train()
    assert_loss_and_grads_match(model, samples)
    unpatch_model(model)
    assert not is_alibi_patched(model)


def is_alibi_patched(model) -> bool:
    """Whether a module of ``model`` still has a forward of its own (the ALiBi fix's packed attention forward)."""
    return any("forward" in module.__dict__ for module in model.modules())


@pytest.mark.parametrize("model_type", ALIBI_TYPES)
def test_alibi_builds_no_dense_mask(model_type, monkeypatch, alibi_model):
    built = spy_on_masks(monkeypatch)
    model = patch_model(alibi_model(model_type))
    samples = make_samples([40, 30, 20, 10], seed=7)
    with torch.no_grad():
        model(**packed_batch(samples))
        assert all(shape == (1, 1, 1, 1) for shape in built)  # at most mpt's placeholder, never (T, T)
        model(**padded_batch(samples))
    assert any(shape[-1] == 40 for shape in built)


@pytest.mark.parametrize("model_type", ALIBI_TYPES)
def test_alibi_generates_as_stock_and_refuses_weights_of_a_packed_batch(model_type, alibi_model):
    samples = make_samples([9, 4, 13], seed=4)
    model = alibi_model(model_type)
    _patch_and_assert_generation_unchanged(model, samples)
    match = f"output_attentions=True with a packed batch is not supported for {model_type}"
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model(**packed_batch(samples), output_attentions=True)
