"""unpack_trainer._transformers_compat: transformers names that moved between releases, found by feature."""

from __future__ import annotations

import types

import pytest
import torch

from unpack_trainer._transformers_compat import (
    cache_argument,
    cache_keyword,
    cache_length,
    checkpointing_enabled,
    disable_checkpointing,
    enable_checkpointing,
    output_cache,
)
from unpack_trainer.tiny import tiny_model


def test_the_cache_is_found_under_either_keyword():
    cache = object()
    assert cache_argument({"cache": cache}) is cache
    assert cache_argument({"past_key_values": cache}) is cache
    assert cache_argument({"input_ids": 1}) is None


@pytest.mark.parametrize("model_type", ["llama", "mamba"])
def test_cache_length_of_a_real_cache_after_a_forward(model_type):
    """An attention cache counts its tokens; a cache of recurrent states only (Mamba's since transformers 5.24,
    whose get_seq_length raises) counts as holding tokens once it holds a state."""
    model = tiny_model(model_type).eval()
    with torch.no_grad():
        output = model(input_ids=torch.arange(3, 8)[None], use_cache=True)
    cache = output_cache(output)
    assert cache is not None
    if model_type == "llama":
        assert cache_length(cache) == 5 and cache_keyword(model) in ("cache", "past_key_values")
    else:
        assert cache_length(cache) >= 1


def test_cache_length_without_a_cache_or_a_length():
    assert cache_length(None) == 0
    assert cache_length(types.SimpleNamespace(get_seq_length=lambda: 7)) == 7
    assert cache_length(object()) == 0


def test_checkpointing_under_whichever_name_the_model_has():
    model = tiny_model("llama").train()
    assert not checkpointing_enabled(model)
    enable_checkpointing(model, {"use_reentrant": False})
    assert checkpointing_enabled(model)
    disable_checkpointing(model)
    assert not checkpointing_enabled(model)
