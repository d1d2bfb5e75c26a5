"""BERT- and RoBERTa-family models trained as causal LMs (built with ``is_decoder=True``) on the packed path.

transformers maps these encoders to a causal LM class (``BertLMHeadModel``, ``RobertaForCausalLM``, ...) whose
self-attention is causal only when the config says ``is_decoder=True``. On tiny random models in fp32 on the CPU:

- packed rows == each sample run alone (logits, relative 1e-5), loss and every gradient == a padded batch, on SDPA
  and eager; for the RoBERTa family this needs the packed positions to be what their embeddings number each sample
  alone (from ``padding_idx + 1``, skipping padding tokens), not the restarting 0 of the packed ``position_ids``;
- the self-check passes on the patched model and fails when packed samples see each other (attention over the whole
  row) or when the RoBERTa positions are left as the packed row gives them;
- ``generate()`` with the cache and a padded batch with ``attention_mask`` are bit-identical with and without the patch;
  attention weights of a packed row (``output_attentions=True``) are a clear error where their decoders build the
  mask without ``position_ids`` (transformers' dense path would attend across samples), and each sample's own where
  they hand ``position_ids`` to the mask (transformers 5.25: its packed block mask);
- loaded as an encoder (``is_decoder=False``: bidirectional self-attention) the model is refused before any forward,
  with the fix in the reason, and the trainer trains it padded.
"""

from __future__ import annotations

import logging

import pytest
import torch
from contaminating_model import leak_every_backend
from packed_rows import (
    ROWS,
    assert_close,
    assert_packed_equals_alone,
    assert_same_loss_and_grads,
    random_samples,
    two_rows,
)

from unpack_trainer.model_zoo.tiny import loss_and_grads, padded_batch, tiny_model
from unpack_trainer.models import PatchRefused, RefusalKind, patch_model, refusal_reason, unpatch_model
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.selfcheck import check_uncontaminated

# BERT-style embeddings (positions from 0) and RoBERTa-style ones (positions from padding_idx + 1), the latter with
# the pre-layer-norm and the language-adapter (xmod) variants.
BERT_STYLE = ["bert", "bert-generation", "electra", "ernie", "roc_bert"]
ROBERTA_STYLE = ["roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "roberta-prelayernorm", "xmod"]
FAMILIES = BERT_STYLE + ROBERTA_STYLE
AS_DECODER = dict(is_decoder=True, add_cross_attention=False)
PAD = 0  # the tiny configs' pad_token_id, the RoBERTa embeddings' padding_idx


def _samples(seed=3):
    samples = random_samples(seed)
    samples[3][4] = PAD  # a padding token inside a sample: RoBERTa's embeddings skip it when numbering positions
    return samples


def _decoder(model_type, **kwargs):
    return tiny_model(model_type, **AS_DECODER, **kwargs)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_two_packed_rows_equal_each_sample_alone_and_padded(model_type, implementation):
    model = _decoder(model_type, attn_implementation=implementation).eval()
    samples = _samples()
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in samples]
    padded_loss, padded_grads = loss_and_grads(model, padded_batch(samples), use_cache=False)
    patch_model(model)
    try:
        batch = two_rows(samples)
        assert_packed_equals_alone(model, batch, alone)
        loss, grads = loss_and_grads(model, batch, use_cache=False)
    finally:
        unpatch_model(model)
    assert_same_loss_and_grads(loss, grads, padded_loss, padded_grads)


@pytest.mark.parametrize("model_type", ["roberta", "xmod"])
def test_packed_positions_without_input_ids(model_type):
    """From ``inputs_embeds`` RoBERTa numbers a sample's tokens from padding_idx + 1 (no padding to skip): so do the
    packed rows."""
    model = _decoder(model_type).eval()
    samples = [s.clamp_min(3) for s in _samples()]
    embed = model.get_input_embeddings()
    with torch.no_grad():
        alone = [model(inputs_embeds=embed(s.unsqueeze(0)), use_cache=False).logits[0] for s in samples]
        patch_model(model)
        try:
            batch = two_rows(samples)
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "input_ids")}
            logits = model(inputs_embeds=embed(batch["input_ids"]), **inputs).logits
        finally:
            unpatch_model(model)
    for index, (piece, expected) in enumerate(zip(torch.cat(list(logits)).split([5, 3, 1, 7]), alone)):
        assert_close(piece, expected, f"sample {index} logits")


def test_sample_positions_by_hand():
    """RoBERTa's numbering (padding_idx 0 here) per sample, a padding token inside a sample, and branched samples
    (a prompt with two completions: each branch numbered as [prompt; branch] alone)."""
    from unpack_trainer.models.fixes.positions import own_position_embeddings, sample_positions

    model = _decoder("roberta")
    [(name, embeddings)] = own_position_embeddings(model.roberta)
    assert name == "embeddings" and embeddings.padding_idx == PAD
    ids = torch.tensor([[5, 6, 7, 8, PAD, 9]])
    plain = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 3]), batch_size=1, seq_len=6)
    assert sample_positions(embeddings, plain, input_ids=ids).tolist() == [[1, 2, 3, 1, 0, 2]]
    branched = PackedSeqInfo.from_seq_lengths(
        torch.tensor([3, 2, 1]), batch_size=1, seq_len=6, seq_parents=torch.tensor([-1, 0, 0])
    )
    assert sample_positions(embeddings, branched, input_ids=ids).tolist() == [[1, 2, 3, 4, 0, 4]]
    embeds = torch.zeros(1, 6, 32)
    assert sample_positions(embeddings, plain, inputs_embeds=embeds).tolist() == [[1, 2, 3, 1, 2, 3]]
    assert own_position_embeddings(_decoder("bert").bert) == []  # BERT counts from 0 with a buffer: nothing to do


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xmod"])
def test_selfcheck_passes_and_catches_a_leak(model_type, monkeypatch):
    from unpack_trainer.models.fixes import positions as positions_fix

    model = _decoder(model_type)
    patch_model(model)
    try:
        report = check_uncontaminated(model)
        assert report.ok and report.conclusive, report.summary()
        with monkeypatch.context() as leaking:
            leak_every_backend(leaking)
            report = check_uncontaminated(model)
            assert not report.ok, f"attention over the whole row passed the self-check: {report.summary()}"
    finally:
        unpatch_model(model)
    if model_type in ROBERTA_STYLE:
        # The same patch without the positions: every packed token looked up padding_idx + 1 positions early.
        monkeypatch.setattr(positions_fix, "own_position_embeddings", lambda decoder: [])
        patch_model(model)
        try:
            report = check_uncontaminated(model)
            assert not report.ok, f"packed positions off by padding_idx + 1 passed the self-check: {report.summary()}"
        finally:
            unpatch_model(model)


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xmod"])
def test_generation_with_cache_and_padded_batches_unchanged(model_type):
    model = _decoder(model_type).eval()
    prompt = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding
    prompt[1, :2] = PAD
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        stock = model.generate(input_ids=prompt[:1], **options)
        stock_batch = model.generate(input_ids=prompt, attention_mask=mask, **options)
        stock_logits = model(input_ids=prompt, attention_mask=mask, use_cache=False).logits
    patch_model(model)
    try:
        with torch.no_grad():
            patched = model.generate(input_ids=prompt[:1], **options)
            patched_batch = model.generate(input_ids=prompt, attention_mask=mask, **options)
            patched_logits = model(input_ids=prompt, attention_mask=mask, use_cache=False).logits
    finally:
        unpatch_model(model)
    assert torch.equal(patched, stock)
    assert torch.equal(patched_batch, stock_batch)
    assert torch.equal(patched_logits, stock_logits)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_attention_weights_of_a_packed_row(model_type):
    """``output_attentions=True`` sends attention down transformers' dense path. Where their decoders build the mask
    without ``position_ids`` (transformers <= 5.24: ``_create_attention_masks`` takes none) that path would attend
    across the samples of a packed row: a clear error. Where they hand ``position_ids`` to ``create_causal_mask``
    (5.25) it builds transformers' packed block mask from them: each sample's logits and block of weights are what
    it gets alone, and nothing comes from the samples before it in its row."""
    from unpack_trainer.anatomy.structure import mask_without_positions

    model = patch_model(_decoder(model_type, attn_implementation="eager").eval())
    samples = _samples()
    batch = two_rows(samples)
    batch.pop("labels")
    try:
        if mask_without_positions(type(model.base_model)) is not None:
            with torch.no_grad(), pytest.raises(ValueError, match="builds the mask without position_ids"):
                model(**batch, output_attentions=True)
            return
        with torch.no_grad():
            outputs = model(**batch, output_attentions=True)
            alone = [model(input_ids=s.unsqueeze(0), use_cache=False, output_attentions=True) for s in samples]
        assert len(outputs.attentions) == model.config.num_hidden_layers
        index = 0
        for row, lengths in enumerate(ROWS):
            start = 0
            for length in lengths:
                span = slice(start, start + length)
                assert_close(outputs.logits[row, span], alone[index].logits[0], f"sample {index} logits")
                for layer, (packed, own) in enumerate(zip(outputs.attentions, alone[index].attentions)):
                    assert_close(packed[row, :, span, span], own[0], f"sample {index} weights, layer {layer}")
                    if start:  # nothing from an earlier sample of its row
                        assert packed[row, :, span, :start].abs().max() == 0, f"sample {index} attends back"
                start += length
                index += 1
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_an_encoder_is_refused_with_the_fix(model_type):
    """Loaded as an encoder (is_decoder=False) its self-attention is bidirectional: refused before any forward, by
    the decision (meta device) and by patch_model, with the fix named."""
    from unpack_trainer.model_zoo.tiny import tiny_config

    encoder = tiny_config(model_type)
    assert not encoder.is_decoder
    reason = refusal_reason(encoder)
    assert reason is not None and "bidirectional" in reason and "is_decoder=True" in reason, reason
    assert refusal_reason(tiny_config(model_type, **AS_DECODER)) is None
    with pytest.raises(PatchRefused) as refused:
        patch_model(tiny_model(model_type))
    assert refused.value.kind is RefusalKind.BIDIRECTIONAL and refused.value.kind.blocking
    assert refused.value.reason == reason


def test_the_trainer_trains_an_encoder_padded_and_packs_it_as_a_decoder(
    tmp_path, tokenizer, sft_args, prompt_completion, caplog
):
    """Only the import swapped: BERT loaded as an encoder is trained padded with the reason logged; built as a decoder
    it is packed and patched, and the self-check passes."""
    from unpack_trainer import SFTTrainer
    from unpack_trainer.models import is_patched

    encoder = tiny_model("bert", vocab_size=len(tokenizer))
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=encoder,
            args=sft_args(tmp_path / "encoder", packing=True),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    assert trainer.unpack_decision.mode == "padded", trainer.unpack_decision
    assert "is_decoder=True" in trainer.unpack_decision.reason
    assert "is_decoder=True" in caplog.text
    assert not is_patched(trainer.model)

    decoder = tiny_model("bert", vocab_size=len(tokenizer), **AS_DECODER)
    trainer = SFTTrainer(
        model=decoder,
        args=sft_args(tmp_path / "decoder", packing=True),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    trainer.train()
    try:
        assert trainer.unpack_decision.packed and trainer.unpack_decision.patch, trainer.unpack_decision
        assert is_patched(trainer.model)
        assert trainer.unpack_selfcheck is not None and trainer.unpack_selfcheck.ok, trainer.unpack_selfcheck
    finally:
        unpatch_model(trainer.model)  # hands transformers' interfaces back now, not when the trainer is collected
