"""Hybrid and state-space models on the packed path: the families whose token mixers (gated delta rule, Mamba / Mamba2
SSD, short convolutions, RG-LRU, RWKV, ...) now run per sample.

For each family, on tiny random models in fp32 on the CPU (sizes: ``unpack_trainer.model_zoo.tiny``):

- two packed rows (four samples, one of a single token) == each sample alone (logits, relative 1e-5), loss and every
  gradient == a padded batch, on SDPA and eager;
- the trainer's self-check passes on the patched model and fails when the same patch leaves the mixers running on the
  whole row (a leak: the handler owns the mixers but does nothing);
- ``generate()`` with the model's own cache and a left-padded batch with ``attention_mask`` are bit-identical with and
  without the patch.
"""

from __future__ import annotations

import pytest
import torch
from packed_rows import assert_packed_equals_alone, assert_same_loss_and_grads, random_samples, two_rows

from unpack_trainer.model_zoo.tiny import loss_and_grads, padded_batch, tiny_model
from unpack_trainer.models import mixers, patch_model, unpatch_model
from unpack_trainer.models.verified import VERIFIED_MODEL_TYPES
from unpack_trainer.selfcheck import check_uncontaminated

# The families of issue 18 first (Qwen3.5, Qwen3-Next, LFM2, Granite 4, Nemotron-H, Falcon-H1), then one of each other
# mixer kind: attention-free Mamba / Mamba2, RWKV, RG-LRU, lightning attention, Kimi delta attention.
FAMILIES = [
    "qwen3_5_text",
    "qwen3_next",
    "lfm2",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "jamba",
    "mamba",
    "mamba2",
    "rwkv",
    "recurrent_gemma",
    "minimax",
    "kimi_linear",
]
ATTENTION_FREE = {"mamba", "mamba2", "rwkv"}


def test_families_are_verified_types():
    assert set(FAMILIES) <= VERIFIED_MODEL_TYPES


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_two_packed_rows_equal_each_sample_alone_and_padded(model_type, implementation):
    if implementation == "sdpa" and model_type in ATTENTION_FREE:
        pytest.skip("attention-free: no SDPA")
    model = tiny_model(model_type, attn_implementation=implementation).eval()
    samples = random_samples()
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in samples]
    padded_loss, padded_grads = loss_and_grads(model, padded_batch(samples), skip_unused=True, use_cache=False)
    patch_model(model)
    try:
        batch = two_rows(samples)
        assert_packed_equals_alone(model, batch, alone)
        loss, grads = loss_and_grads(model, batch, skip_unused=True, use_cache=False)
    finally:
        unpatch_model(model)
    assert_same_loss_and_grads(loss, grads, padded_loss, padded_grads)


class _LeakyHandler:
    """Owns every mixer and leaves it running on the whole row: a patch without the mixer handling."""

    name = "leaky"

    def handles(self, mixer):
        return True

    def patch(self, module, decoder):
        pass

    def unpatch(self, module):
        pass


@pytest.mark.parametrize("model_type", FAMILIES)
def test_selfcheck_passes_and_catches_a_leaking_mixer(model_type, monkeypatch):
    model = tiny_model(model_type)
    patch_model(model)
    try:
        report = check_uncontaminated(model)
        assert report.ok and report.conclusive, report.summary()
    finally:
        unpatch_model(model)
    monkeypatch.setattr(mixers, "MIXER_HANDLERS", [_LeakyHandler()])
    patch_model(model)
    try:
        report = check_uncontaminated(model)
        assert not report.ok, f"a mixer running on the whole row passed the self-check: {report.summary()}"
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generation_with_cache_and_padded_batches_unchanged(model_type):
    model = tiny_model(model_type).eval()
    prompt = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        stock = model.generate(input_ids=prompt[:1], **options)
        stock_logits = model(input_ids=prompt, attention_mask=mask, use_cache=False).logits
    patch_model(model)
    try:
        with torch.no_grad():
            patched = model.generate(input_ids=prompt[:1], **options)
            patched_logits = model(input_ids=prompt, attention_mask=mask, use_cache=False).logits
    finally:
        unpatch_model(model)
    assert torch.equal(patched, stock)
    assert torch.equal(patched_logits, stock_logits)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "granitemoehybrid", "falcon_h1", "mamba2"])
def test_packed_row_on_cuda_in_bf16_with_the_installed_kernels(model_type):
    """On CUDA the mixers run with whatever kernels are installed (flash-linear-attention, causal-conv1d, mamba-ssm
    from the `gpu` extra; once on the packed row with their varlen arguments where the model hands them on, see
    tests/patches/test_mixer_kernels.py): packed == each sample alone, within a small multiple of the bf16 error the
    same model makes against its fp32 self."""
    samples = [s.cuda() for s in random_samples()]
    model = tiny_model(model_type).eval().cuda()
    with torch.no_grad():
        reference = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0].float() for s in samples]
        model.to(torch.bfloat16)
        alone = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0].float() for s in samples]
        patch_model(model)
        try:
            batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in two_rows(samples).items()}
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        finally:
            unpatch_model(model)
    packed = torch.cat(list(logits)).split([5, 3, 1, 7])
    for index, (piece, single, exact) in enumerate(zip(packed, alone, reference)):
        bf16_error = float((single - exact).abs().max())
        error = float((piece - exact).abs().max())
        assert error <= 4 * bf16_error + 1e-2, f"sample {index}: {error:.3e} vs bf16 error {bf16_error:.3e}"


@pytest.mark.parametrize("model_type", ["lfm2"])
def test_the_trainer_packs_a_hybrid_by_default(model_type, tmp_path, tokenizer, sft_args, prompt_completion):
    """Only the import swapped: a hybrid model is packed and patched like any other type, and the self-check passes."""
    from unpack_trainer import SFTTrainer
    from unpack_trainer.models import is_patched

    model = tiny_model(model_type, vocab_size=len(tokenizer))
    trainer = SFTTrainer(
        model=model,
        args=sft_args(tmp_path, packing=True),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    trainer.train()
    assert trainer.unpack_decision.packed and trainer.unpack_decision.patch, trainer.unpack_decision
    assert is_patched(trainer.model)
    assert trainer.unpack_selfcheck is not None and trainer.unpack_selfcheck.ok, trainer.unpack_selfcheck
