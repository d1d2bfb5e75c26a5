"""unpack_trainer/models/fixes/rope.py: the fused RoPE replaces transformers' ``apply_rotary_pos_emb`` whether the
modeling module holds the function itself (transformers 5.24 and older, or without the ``kernels`` package) or the
``nn.Module`` the ``kernels`` package makes of it (``use_kernel_forward_from_hub("rotary_pos_emb")``, transformers
5.25), and says why wherever it does not: a module it cannot read (a warning: the kernel would otherwise be lost
without a word), a hub kernel the model's ``kernelize`` chose (kept), another library's RoPE (kept)."""

from __future__ import annotations

import gc
import json
import logging

import pytest
import torch
from transformers.models.llama import modeling_llama

from unpack_trainer._compat import hub_kernel_chosen, hub_kernel_function
from unpack_trainer._logging import reset_log_once
from unpack_trainer.models import patch_model, unpatch_model
from unpack_trainer.patches import rope


@pytest.fixture
def llama_rope(monkeypatch):
    """Llama's plain RoPE function; the modeling module's global is put back as found after the test."""
    gc.collect()  # patched Llamas of earlier tests give transformers' RoPE back when collected
    assert hub_kernel_function(modeling_llama.apply_rotary_pos_emb) is not rope.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    reset_log_once()
    return hub_kernel_function(modeling_llama.apply_rotary_pos_emb)


def _kernels_function_module(function):
    kernels = pytest.importorskip("kernels", reason="the `kernels` package is not installed (pip install kernels)")
    return kernels.use_kernel_forward_from_hub("rotary_pos_emb")(function)


def test_the_function_behind_a_kernels_function_module_is_read(llama_rope):
    assert llama_rope is not None and llama_rope.__name__ == "apply_rotary_pos_emb"
    assert hub_kernel_function(llama_rope) is llama_rope
    assert hub_kernel_function(_kernels_function_module(llama_rope)) is llama_rope
    assert hub_kernel_function(torch.nn.Linear(2, 2)) is None and hub_kernel_function(3) is None


def test_a_kernels_function_module_is_replaced_and_given_back(llama_rope, monkeypatch, tiny_model):
    """What transformers 5.25 does to every copy of Llama's RoPE, made here on any release."""
    wrapped = _kernels_function_module(llama_rope)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", wrapped)
    model = tiny_model("llama", vocab_size=64)
    patch_model(model)
    assert hub_kernel_function(modeling_llama.apply_rotary_pos_emb) is rope.apply_rotary_pos_emb
    unpatch_model(model)
    assert modeling_llama.apply_rotary_pos_emb is wrapped


def test_a_patched_model_with_a_kernels_rope_pickles(llama_rope, monkeypatch, tiny_model):
    """``kernels`` rebuilds each layer's copy of the RoPE module from the type of the modeling module's global when a
    model is unpickled: a plain function there (the replacement of 5.24) made a patched model unpicklable."""
    import pickle

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _kernels_function_module(llama_rope))
    model = tiny_model("llama", vocab_size=64).eval()
    patch_model(model)
    ids = torch.randint(3, 64, (1, 7))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        again = pickle.loads(pickle.dumps(model))(input_ids=ids).logits
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    unpatch_model(model)


def test_a_module_it_cannot_read_is_a_warning_not_silence(llama_rope, monkeypatch, tiny_model, caplog, capsys):
    class Unreadable(torch.nn.Module):  # a future `kernels` whose function module holds the function otherwise
        kernel_layer_name = "rotary_pos_emb"

        def forward(self, *args, **kwargs):
            return llama_rope(*args, **kwargs)

    unreadable = Unreadable()
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", unreadable)
    model = tiny_model("llama", vocab_size=64)
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        patch_model(model)
    assert modeling_llama.apply_rotary_pos_emb is unreadable
    [warning] = [r for r in caplog.records if "fused RoPE is not applied" in r.getMessage()]
    assert warning.levelno == logging.WARNING and "cannot read" in warning.getMessage()
    assert "transformers.models.llama.modeling_llama.apply_rotary_pos_emb" in warning.getMessage()
    unpatch_model(model)

    from unpack_trainer.cli.main import main

    assert main(["env", "--model", "llama", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["model"]
    assert "rope" not in report["fixes"]
    assert report["rope"].startswith("not fused: ") and "cannot read" in report["rope"]


def test_a_hub_kernel_chosen_by_kernelize_is_kept(llama_rope, tiny_model, caplog):
    model = tiny_model("llama", vocab_size=64)

    class Chosen(torch.nn.Module):  # what kernelize leaves in a layer's private wrapper
        pass

    chosen = Chosen()
    vars(chosen)["_kernel_repo"] = "kernels-community/rotary"
    for layer in model.model.layers:
        vars(layer.self_attn)["_kernel_funcs"] = {"apply_rotary_pos_emb": chosen}
    assert hub_kernel_chosen(model.model.layers[0].self_attn, "apply_rotary_pos_emb") == "kernels-community/rotary"
    original = modeling_llama.apply_rotary_pos_emb
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        patch_model(model)
    assert modeling_llama.apply_rotary_pos_emb is original
    assert any("kernels-community/rotary" in r.getMessage() for r in caplog.records)
    unpatch_model(model)


def test_a_family_with_llamas_rope_says_so_in_env(llama_rope, capsys):
    from unpack_trainer.cli.main import main

    assert main(["env", "--model", "qwen3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["model"]
    assert "rope" in report["fixes"] and report["rope"].startswith("unpack_trainer's fused RoPE")
