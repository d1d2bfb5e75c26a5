"""A packed forward of a patched ``*ForSequenceClassification`` model scores each sequence at its own last non-pad
token (unpack_trainer.models.fixes.classification_head): packed scores == each sequence padded / alone (fp32 1e-5), plain
and branched rows, on decoders written like ``GenericForSequenceClassification`` and on GPT-2 / GPT-NeoX / OPT's own
classes; a model whose score cannot be read per sequence refuses a packed forward with the reason."""

from __future__ import annotations

import pytest
import torch

from unpack_trainer.anatomy.score_head import find_score_head, score_head_refusal
from unpack_trainer.model_zoo.tiny import tiny_config
from unpack_trainer.models import patch_model, unpatch_model
from unpack_trainer.packed_seq_info import PackedSeqInfo

PAD = 0
# a prompt with two branches (the first ends with padding tokens), then a plain sample of padding only after its
# first token, then one with no padding
PROMPT, CHOSEN, REJECTED = [5, 6, 0, 7], [8, 0], [9, 10, 11]
OTHERS = [[12, 0, 0], [13, 14]]


def _classifier(model_type: str, **overrides):
    from transformers import AutoModelForSequenceClassification

    config = tiny_config(model_type, num_labels=2, max_position_embeddings=64, **overrides)
    torch.manual_seed(0)
    attention = "eager" if model_type == "gemma2" else "sdpa"  # gemma2's softcap: no SDPA in transformers
    return AutoModelForSequenceClassification.from_config(config, attn_implementation=attention).eval()


def _padded_scores(model, sequences: list[list[int]]) -> torch.Tensor:
    """Stock scores of ``sequences``: one right-padded batch (or one by one, for a model without ``pad_token_id``)."""
    if model.config.pad_token_id is None:
        return torch.cat([model(input_ids=torch.tensor([s])).logits for s in sequences])
    width = max(map(len, sequences))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    return model(input_ids=ids, attention_mask=mask).logits


def _packed_scores(model) -> torch.Tensor:
    ids = torch.tensor([PROMPT + CHOSEN + REJECTED + OTHERS[0] + OTHERS[1]])
    lengths = torch.tensor([len(PROMPT), len(CHOSEN), len(REJECTED), *map(len, OTHERS)], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0, -1, -1])
    info = PackedSeqInfo.from_seq_lengths(lengths, batch_size=1, seq_len=ids.shape[1], seq_parents=parents)
    return model(input_ids=ids, position_ids=info.position_ids(), packed_seq_lengths=lengths,
                 packed_seq_parents=parents).logits  # fmt: skip


SEQUENCES = [PROMPT + CHOSEN, PROMPT + REJECTED, *OTHERS]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "qwen3_moe", "gpt2", "gpt_neox", "opt"])
def test_packed_scores_equal_each_sequence_padded(model_type):
    model = _classifier(model_type)
    with torch.no_grad():
        expected = _padded_scores(model, SEQUENCES)
        patch_model(model)
        actual = _packed_scores(model)
    assert actual.shape == expected.shape == (4, 2)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_without_pad_token_id_each_sequence_is_scored_at_its_last_token():
    """Stock pools the last token when the config has no ``pad_token_id`` (one sequence per batch): so does each
    packed sequence, padding ids included."""
    model = _classifier("llama", pad_token_id=None)
    with torch.no_grad():
        expected = _padded_scores(model, SEQUENCES)
        patch_model(model)
        actual = _packed_scores(model)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_gradients_through_the_packed_scores_equal_padded():
    model = _classifier("llama").train()
    weights = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 1.0], [2.0, 0.25]])
    (_padded_scores(model, SEQUENCES) * weights).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    patch_model(model)
    (_packed_scores(model) * weights).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-5 * float(expected[name].abs().max()))


def test_the_head_is_found_from_the_structure_under_peft_too():
    from peft import LoraConfig, get_peft_model

    model = _classifier("llama")
    assert (find_score_head(model).decoder, find_score_head(model).head) == ("model", "score")
    peft = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=2, target_modules="all-linear"))
    assert score_head_refusal(peft) is None
    patch_model(peft)
    with torch.no_grad():
        assert _packed_scores(peft).shape == (4, 2)


def test_a_causal_lm_is_no_sequence_classifier(tiny_model):
    assert "not a sequence-classification model" in score_head_refusal(tiny_model("llama"))


def test_a_model_that_pools_elsewhere_refuses_a_packed_forward():
    """BERT's classifier reads its pooler (the first token), not the last non-pad token: its packed forward raises
    with the reason instead of scoring a wrong token; unpacked forwards run as before, and unpatch_model takes the
    hooks off."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_config("bert", num_labels=2, is_decoder=True)).eval()
    assert "pad_token_id" in score_head_refusal(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        patch_model(model)
        with pytest.raises(ValueError, match="cannot score the sequences of a packed batch"):
            model(input_ids=ids, packed_seq_lengths=torch.tensor([2, 2], dtype=torch.int32))
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    unpatch_model(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_head_applied_after_pooling_is_refused_at_the_packed_forward():
    """A model that pools before its head hands the head one vector per row, not every token: the packed forward
    raises, naming the head and what it got."""
    from transformers import LlamaForSequenceClassification
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    class MeanPooled(LlamaForSequenceClassification):
        def forward(self, input_ids=None, **kwargs):
            hidden = self.model(input_ids, **kwargs).last_hidden_state
            assert self.config.pad_token_id is not None
            return SequenceClassifierOutputWithPast(logits=self.score(hidden.mean(1)))

    model = MeanPooled(_classifier("llama").config).eval()
    patch_model(model)
    with torch.no_grad(), pytest.raises(ValueError, match="head 'score' was not applied once to every token"):
        _packed_scores(model)


def test_the_self_check_tolerance_of_a_bf16_classifier_is_bf16s():
    """A sequence classifier has no output embedding: the self-check reads its dtype from the input embedding (before:
    float32's tolerance for a bf16 model, which bf16 rounding on another kernel would fail)."""
    from unpack_trainer.selfcheck import check_uncontaminated

    model = _classifier("llama").to(torch.bfloat16)
    patch_model(model)
    report = check_uncontaminated(model, branched=True)
    assert report.ok and report.dtype == torch.bfloat16
