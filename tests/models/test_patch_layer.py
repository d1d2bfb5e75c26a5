"""The patch layer at the edges a user reaches without packing: generation with every cache implementation,
``torch.compile(fullgraph=True)`` and ``torch.export``, ``output_attentions`` and ``set_attn_implementation`` after
patching, and ``torch.save`` / ``torch.load`` of a patched model in a new process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

from unpack_trainer.models import is_patched, patch_model, unpatch_model

# On top of unpack_trainer.model_zoo.tiny's sizes (hidden 32, 2 layers, 4 heads, 2 key/value heads, initializer range 0.1,
# pad id 0); None takes the config class's default.
SIZES = dict(vocab_size=64, max_position_embeddings=128, head_dim=None, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def qwen2(tiny_model):
    """``qwen2(implementation="sdpa")``: Qwen2 with a sliding-window layer: ``config.layer_types`` = full, sliding (a
    dict of masks in generation)."""

    def build(implementation: str = "sdpa") -> torch.nn.Module:
        return tiny_model(
            "qwen2", attn_implementation=implementation, **SIZES, use_sliding_window=True, sliding_window=4
        ).eval()

    return build


@pytest.fixture(scope="module")
def llama(tiny_model):
    """``llama(implementation="sdpa")``: the tiny Llama, seed 0, in eval mode."""

    def build(implementation: str = "sdpa") -> torch.nn.Module:
        return tiny_model("llama", attn_implementation=implementation, **SIZES).eval()

    return build


def prompts() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def packed_row() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return {
        "input_ids": torch.randint(1, 64, (1, 9), generator=generator),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]]),
    }


# "quantized" needs optimum-quanto; the offloaded caches need a CUDA device.
@pytest.mark.parametrize(
    "cache_implementation", [c for c in ALL_CACHE_IMPLEMENTATIONS if c != "quantized" and "offloaded" not in c]
)
def test_generate_with_every_cache_implementation(cache_implementation, qwen2):
    """Issue 10 item 10: configs with ``layer_types`` hand the decoder a dict of masks under a static cache."""
    model = qwen2()
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation=cache_implementation)
    with torch.no_grad():
        expected = model.generate(**prompts(), **options)
        patch_model(model)
        generated = model.generate(**prompts(), **options)
    assert torch.equal(generated, expected)


def test_compile_fullgraph_of_a_patched_model(qwen2):
    """Issue 10 item 11: dynamo traces a patched model's generation forward without a graph break."""
    model = qwen2()
    inputs = prompts()
    with torch.no_grad():
        expected = model(**inputs).logits
        patch_model(model)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        got = compiled(**inputs).logits
        # A packed batch with the collator's metadata still takes the packed path when the model is compiled
        # (without fullgraph: the metadata is read on the host).
        row = {**packed_row(), "packed_seq_lengths": torch.tensor([4, 3, 2], dtype=torch.int32)}
        torch._dynamo.reset()
        packed = torch.compile(model, backend="eager")(**row).logits
        eager_packed = model(**row).logits
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed, eager_packed, rtol=1e-5, atol=1e-6)


def test_export_of_a_patched_model(llama):
    """Issue 10 item 11: ``torch.export`` of a patched model, with a mask and with a static cache."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model = patch_model(llama())
    inputs = prompts()
    exported = torch.export.export(model, args=(), kwargs={**inputs, "use_cache": False})
    with torch.no_grad():
        expected = model(**inputs, use_cache=False).logits
        torch.testing.assert_close(exported.module()(**inputs, use_cache=False).logits, expected)
    # Generation export recipe: the static cache lives in the exported module's buffers.
    model.generation_config.cache_implementation = "static"
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16)
    ids = inputs["input_ids"][:1, :3]
    program = exportable.export(input_ids=ids, cache_position=torch.arange(3))
    assert program.module()(input_ids=ids, cache_position=torch.arange(3)).shape == (1, 3, 64)


def test_output_attentions_after_patching(llama):
    """Issue 10 item 12: ``config.output_attentions = True`` works on a patched eager model, as it does unpatched,
    and is refused on a patched SDPA model with transformers' own message about its own implementation."""
    model = llama("eager")
    inputs = prompts()
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True).attentions
        patch_model(model)
        model.config.output_attentions = True
        got = model(**inputs).attentions
        # A packed batch with attention weights: each sample's block of weights is what the sample alone gets.
        row = packed_row()
        packed = model(**row).attentions
        ids, start = row["input_ids"][0], 0
        for length in (4, 3, 2):
            alone = model(input_ids=ids[start : start + length].unsqueeze(0)).attentions
            for layer, weights in zip(packed, alone):
                block = layer[0, :, start : start + length, start : start + length]
                torch.testing.assert_close(block, weights[0])
                if start:  # nothing from earlier samples
                    assert layer[0, :, start : start + length, :start].abs().max() == 0
            start += length
    assert len(got) == len(expected) == 2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    sdpa = patch_model(llama("sdpa"))
    with pytest.raises(ValueError, match="attn_implementation` set to sdpa"):
        sdpa.config.output_attentions = True


def test_set_attn_implementation_after_patching_keeps_packed_routing(wrap_backends, llama):
    """Issue 10 item 12: switching the implementation after ``patch_model`` re-routes packed batches through the
    helper on the new implementation (and ``is_patched`` tells the truth)."""
    calls = wrap_backends()
    model = patch_model(llama("sdpa"))
    model.set_attn_implementation("eager")
    assert is_patched(model)
    row = packed_row()
    with torch.no_grad():
        got = model(**row).logits[0]
        ids = row["input_ids"][0]
        alone = torch.cat([model(input_ids=ids[a:b].unsqueeze(0)).logits[0] for a, b in ((0, 4), (4, 7), (7, 9))])
    assert calls[:2] == ["eager", "eager"]  # the packed batch ran the packed helper on eager, in both layers
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)
    unpatch_model(model)
    assert model.config._attn_implementation == "eager" and not is_patched(model)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_patched_model_reports_the_stock_attention_implementation(wrap_backends, implementation, llama):
    """Issue 20 item 12: a patched model's ``config._attn_implementation`` reads what a stock one reads (transformers'
    ``test_can_set_attention_dynamically`` / ``test_sdpa_can_dispatch_non_composite_models`` and user code checking
    ``== "sdpa"``), packed batches still take the packed helper, an unpatched model of the same class next to it runs
    exactly as stock, and switching with ``set_attn_implementation`` keeps both true."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = wrap_backends()
    gc.collect()  # patched models of earlier tests, released
    interfaces = (dict(ALL_ATTENTION_FUNCTIONS.items()), dict(ALL_MASK_ATTENTION_FUNCTIONS.items()))
    row, inputs = packed_row(), prompts()
    stock = llama(implementation)
    with torch.no_grad():
        stock_packed, stock_padded = stock(**row).logits, stock(**inputs).logits
        ids = row["input_ids"][0]
        alone = torch.cat([stock(input_ids=ids[a:b].unsqueeze(0)).logits[0] for a, b in ((0, 4), (4, 7), (7, 9))])
    model = patch_model(llama(implementation))
    assert model.config._attn_implementation == implementation
    assert all(m.config._attn_implementation == implementation for m in model.modules() if hasattr(m, "config"))
    with torch.no_grad():
        assert torch.equal(stock(**row).logits, stock_packed) and torch.equal(stock(**inputs).logits, stock_padded)
        assert not calls  # the unpatched model next to a patched one: transformers' own path, unchanged
        torch.testing.assert_close(model(**row).logits[0], alone, rtol=1e-5, atol=1e-6)
        assert calls == [implementation] * 2
        assert torch.equal(model(**inputs).logits, stock_padded)
    other = "eager" if implementation == "sdpa" else "sdpa"
    model.set_attn_implementation(other)
    assert model.config._attn_implementation == other and is_patched(model)
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(**row).logits[0], alone, rtol=1e-5, atol=1e-6)
    assert calls == [other] * 2 and model.config._attn_implementation == other
    unpatch_model(model)
    assert model.config._attn_implementation == other and not is_patched(model)
    del model
    gc.collect()
    # No patched model left: transformers' interfaces hold exactly what they held before.
    assert (dict(ALL_ATTENTION_FUNCTIONS.items()), dict(ALL_MASK_ATTENTION_FUNCTIONS.items())) == interfaces


def test_torch_save_and_load_in_a_new_process(tmp_path, qwen2):
    """Issue 10 item 13: a pickled patched model loads and runs in a fresh process (unpack_trainer installed)."""
    model = patch_model(qwen2())
    row = packed_row()
    with torch.no_grad():
        expected = model(**row).logits
    torch.save(model, tmp_path / "model.pt")
    torch.save({"row": row, "expected": expected}, tmp_path / "data.pt")
    script = textwrap.dedent(
        f"""
        import torch
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        data = torch.load({str(tmp_path / "data.pt")!r})
        import unpack_trainer.models as models
        assert models.is_patched(model)
        with torch.no_grad():
            torch.testing.assert_close(model(**data["row"]).logits, data["expected"])
            model(input_ids=data["row"]["input_ids"])  # an unpacked batch too
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
