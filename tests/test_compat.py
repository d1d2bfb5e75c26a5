"""unpack_trainer._compat: the names of transformers, torch and datasets that moved between releases or are private,
each found by feature and checked once."""

from __future__ import annotations

import importlib
import re
import types

import pytest
import torch

from unpack_trainer import _compat
from unpack_trainer._compat import (
    cache_argument,
    cache_keyword,
    cache_length,
    checkpointing_enabled,
    disable_checkpointing,
    enable_checkpointing,
    output_cache,
)
from unpack_trainer.model_zoo.tiny import tiny_model


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


# --------------------------------------------------------------------------------------------------------------------
# Private names: each found once, and a missing one is one clear error naming it
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_checks(monkeypatch):
    """Every private name looked up again in the test, and again after it (so a name taken away is not remembered):
    the module's memory of what each name resolved to, emptied for the test."""
    monkeypatch.setattr(_compat, "_resolved", {})


def _take_away(monkeypatch, where: str, name: str) -> None:
    """Delete ``name`` from ``where`` (a module, or a class and every base class that defines it)."""
    module, _, attribute = where.rpartition(".")
    try:
        owner = importlib.import_module(where)
    except ImportError:
        owner = getattr(importlib.import_module(module), attribute)
    for holder in owner.__mro__ if isinstance(owner, type) else (owner,):
        if name in vars(holder):
            monkeypatch.delattr(holder, name)


@pytest.mark.parametrize(
    ("call", "owner", "name", "named"),
    [
        (_compat.attention_functions, "transformers.AttentionInterface", "_global_mapping", "AttentionInterface"),
        (_compat.mask_functions, "transformers.masking_utils.AttentionMaskInterface", "_global_mapping", "Mask"),
        (lambda: _compat.in_backward(), "torch._C", "_current_graph_task_id", "_current_graph_task_id"),
        (
            lambda: _compat.attention_implementation(None),
            "transformers.PretrainedConfig",
            "_attn_implementation",
            "PretrainedConfig._attn_implementation",
        ),
        (lambda: _compat.supports_sdpa(object), "transformers.PreTrainedModel", "_supports_sdpa", "_supports_sdpa"),
        (
            lambda: _compat.ignore_in_ddp(torch.nn.Linear(1, 1), []),
            "torch.nn.parallel.DistributedDataParallel",
            "_set_params_and_buffers_to_ignore_for_model",
            "_set_params_and_buffers_to_ignore_for_model",
        ),
    ],
)
def test_a_missing_private_name_is_one_clear_error(fresh_checks, monkeypatch, call, owner, name, named):
    _take_away(monkeypatch, owner, name)
    with pytest.raises(
        RuntimeError, match=rf"needs `[^`]*{re.escape(named)}[^`]*`.*Known to work: transformers 5\.22"
    ):
        call()


def test_a_private_name_is_checked_once(fresh_checks, monkeypatch):
    """The first use looks the name up; later uses take what it found (no lookup on the hot path)."""
    assert _compat.in_backward() is False
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    assert _compat.in_backward() is False  # found before: not looked up again
    _compat._resolved.clear()
    with pytest.raises(RuntimeError, match="torch._C._current_graph_task_id"):
        _compat.in_backward()


def test_the_attention_and_mask_registries_are_transformers_own():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert _compat.attention_functions()["sdpa"] is sdpa_attention_forward
    assert _compat.attention_functions() is AttentionInterface._global_mapping
    assert _compat.mask_functions()["sdpa"] is sdpa_mask
    assert _compat.mask_functions() is AttentionMaskInterface._global_mapping
    assert _compat.locally_registered(ALL_ATTENTION_FUNCTIONS, "unpack_test_nothing") is None
    assert _compat.locally_registered(ALL_MASK_ATTENTION_FUNCTIONS, "unpack_test_nothing") is None


def test_the_attention_implementation_of_a_model():
    model = tiny_model("llama")
    assert _compat.attention_implementation(model.config) == model.config._attn_implementation
    _compat.set_attention_implementation(model.config, "eager")
    assert model.config._attn_implementation == "eager"
    assert _compat.attention_implementation(None) is None
    assert _compat.supports_sdpa(type(model)) is True


def test_in_backward_is_true_only_inside_a_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(_compat.in_backward()) or grad)
    assert _compat.in_backward() is False
    y.sum().backward()
    assert seen == [True]


def test_ddp_ignores_the_named_buffers():
    module = torch.nn.BatchNorm1d(2)
    _compat.ignore_in_ddp(module, ["running_mean"])
    assert module._ddp_params_and_buffers_to_ignore == ["running_mean"]


def test_a_hook_is_removed_by_id_and_every_hook_dict_is_listed():
    module = torch.nn.Linear(2, 2)
    pre = module.register_forward_pre_hook(lambda m, args: None)
    post = module.register_forward_hook(lambda m, args, kwargs, out: None, with_kwargs=True, always_call=True)
    assert {id(hooks) for hooks in _compat.hook_dicts(module)} >= {
        id(module._forward_pre_hooks),
        id(module._forward_hooks),
    }
    _compat.remove_hook(module, pre.id)
    _compat.remove_hook(module, post.id)
    assert not module._forward_pre_hooks and not module._forward_hooks and not module._forward_hooks_always_called


def test_the_output_capturing_flag_is_the_one_transformers_sets():
    model = tiny_model("llama").eval()
    flag = _compat.output_capturing_flag()
    assert flag == "_output_capturing_hooks_installed"
    with torch.no_grad():
        model(input_ids=torch.arange(3, 8)[None], output_hidden_states=True)
    assert any(vars(module).get(flag) is True for module in model.modules())


def test_the_format_of_a_stream():
    from datasets import Dataset

    stream = Dataset.from_dict({"a": [1, 2]}).to_iterable_dataset()
    assert _compat.stream_format_type(stream) is None
    assert _compat.stream_format_type(stream.with_format("torch")) == "torch"


def test_the_recompile_limit_is_raised_in_its_context():
    from torch._dynamo import config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    with _compat.recompile_limit_at_least(before + 7):
        assert getattr(config, name) == before + 7
    assert getattr(config, name) == before
