"""What a model is made of, read from the model and its code (unpack_trainer.anatomy.structure and .attention): the
decoder, its attention modules and layers, the eager function its attention falls back to, its cross-attention, the
model a config describes built on the meta device, and what its attention asks of a packed backend."""

from __future__ import annotations

import logging

import pytest
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.llama import modeling_llama

from unpack_trainer.anatomy.attention import attention_features
from unpack_trainer.anatomy.structure import (
    auto_model_class,
    cross_attention_modules,
    discover,
    eager_attention_function,
    meta_model,
)
from unpack_trainer.model_zoo.tiny import tiny_config
from unpack_trainer.patches.attention import AttentionFeature


def test_discovery_finds_decoder_and_attention_from_the_model(tiny_model):
    model = tiny_model("llama", num_hidden_layers=1)
    structure = discover(model)
    assert structure.model_type == "llama" and [d.module for d in structure.decoders] == [model.model]
    assert [type(m).__name__ for m in structure.decoders[0].attention] == ["LlamaAttention"]
    assert structure.decoders[0].layers == list(model.model.layers) and not structure.mixers


def test_the_eager_function_is_the_one_the_class_falls_back_to():
    """Looked up where the attention's forward is defined: gemma2's own (it applies softcapping), llama's for llama."""
    assert eager_attention_function(modeling_llama.LlamaAttention) is modeling_llama.eager_attention_forward
    assert eager_attention_function(modeling_gemma2.Gemma2Attention) is modeling_gemma2.eager_attention_forward
    assert modeling_gemma2.eager_attention_forward is not modeling_llama.eager_attention_forward


def test_cross_attention_is_found_with_everything_under_it(tiny_model):
    from transformers import BertLMHeadModel

    plain = tiny_model("llama", num_hidden_layers=1)
    assert cross_attention_modules(plain.model) == set()
    config = tiny_config("bert", is_decoder=True, add_cross_attention=True)
    bert = BertLMHeadModel(config)
    found = cross_attention_modules(bert.bert)
    layer = bert.bert.encoder.layer[0]
    assert set(map(id, layer.crossattention.modules())) <= found
    assert not found & set(map(id, layer.attention.modules()))


def test_a_config_is_built_on_the_meta_device_quietly(caplog):
    config = tiny_config("llama")
    assert auto_model_class(config).__name__ == "AutoModelForCausalLM"
    with caplog.at_level(logging.INFO):
        model = meta_model(config)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert {parameter.device.type for parameter in model.parameters()} == {"meta"}
    assert not [record for record in caplog.records if record.name.startswith(("transformers", "unpack_trainer"))]


def test_a_vision_language_config_is_built_as_image_text_to_text():
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig()
    assert auto_model_class(config).__name__ == "AutoModelForImageTextToText"


@pytest.mark.parametrize(
    ("model_type", "feature"),
    [("llama", None), ("gemma2", AttentionFeature.SOFTCAP), ("gpt_oss", AttentionFeature.SINKS)],
)
def test_what_the_attention_asks_of_a_backend(model_type, feature):
    """Read from the model built on the meta device: its features and its head dims (the tiny configs' 8)."""
    needs = attention_features(meta_model(tiny_config(model_type)))
    assert needs.features == (frozenset() if feature is None else frozenset({feature}))
    assert (needs.head_dim, needs.min_head_dim) == (8, 8)
