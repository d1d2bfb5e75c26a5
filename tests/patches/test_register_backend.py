"""A packed attention backend registered from outside the package (``unpack_trainer.register_backend``): chosen when it
serves what a call asks for, refused with its reason when it does not or cannot run here, listed by ``unpack-trainer
env``, and on a tiny Llama its packed logits equal SDPA's."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import unpack_trainer
from unpack_trainer import AttentionFeature, register_backend
from unpack_trainer._logging import reset_log_once
from unpack_trainer.cli.commands.env import environment, format_environment
from unpack_trainer.model_zoo.tiny import packed_batch
from unpack_trainer.models import patch_model
from unpack_trainer.patches import attention
from unpack_trainer.patches.attention import ENV_BACKEND, REGISTRY, Needs, choose_backend, packed_attention_forward

CPU = torch.device("cpu")


def per_sample(query, key, value, info, options):
    """Each sample alone through ``F.scaled_dot_product_attention``: what a user writes, nothing of the package's
    backends. q ``(B, H, T, D)``, k / v ``(B, H_kv, T, D)`` -> ``(B, T, H, D_v)``."""
    per_sample.calls += 1
    batch_size, num_heads, seq_len, _ = query.shape
    q, k, v = (x.transpose(1, 2).flatten(0, 1).transpose(0, 1)[None] for x in (query, key, value))
    bounds = info.cu_seqlens.tolist()
    out = torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=options.scaling, enable_gqa=True
            )
            for a, b in zip(bounds[:-1], bounds[1:])
        ],
        dim=2,
    )
    return out[0].transpose(0, 1).reshape(batch_size, seq_len, num_heads, -1)


per_sample.calls = 0


class FakeModule(torch.nn.Module):
    is_causal = True


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """The registry, restored as it was after the test; no forced backend during it."""
    saved = list(REGISTRY.items())
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    reset_log_once()
    per_sample.calls = 0
    yield REGISTRY
    REGISTRY.clear()
    REGISTRY.update(saved)
    reset_log_once()


def test_is_public():
    assert unpack_trainer.register_backend is register_backend
    assert "register_backend" in unpack_trainer.__all__ and "AttentionFeature" in unpack_trainer.__all__


def test_chosen_first_when_it_serves_the_call():
    record = register_backend("per_sample", per_sample, serves=())
    assert list(REGISTRY)[0] == "per_sample" and REGISTRY["per_sample"] is record
    assert choose_backend(CPU, torch.float32, "sdpa").name == "per_sample"
    register_backend("per_sample", per_sample, serves=(), before="sdpa")  # registered again: moved, not doubled
    assert list(REGISTRY).index("per_sample") == list(REGISTRY).index("sdpa") - 1
    assert list(REGISTRY).count("per_sample") == 1


def test_packed_logits_through_it_equal_sdpa(tiny_model, monkeypatch):
    """A tiny Llama's packed logits through the registered backend == through the package's SDPA buckets."""
    register_backend("per_sample", per_sample, serves=())
    model = patch_model(tiny_model("llama", attn_implementation="sdpa").eval())
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 100, (length,), generator=generator) for length in (7, 3, 12, 5)]
    batch = packed_batch(samples)
    with torch.no_grad():
        ours = model(**batch).logits
        assert per_sample.calls == model.config.num_hidden_layers
        monkeypatch.setenv(ENV_BACKEND, "sdpa")
        reference = model(**batch).logits
    assert per_sample.calls == model.config.num_hidden_layers  # the forced SDPA run did not call it
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_refused_with_its_reason_for_a_feature_it_does_not_serve(monkeypatch, caplog):
    register_backend("per_sample", per_sample, serves=())
    windowed = Needs({AttentionFeature.SLIDING_WINDOW})
    choice = choose_backend(CPU, torch.float32, "sdpa", windowed)
    assert choice.name == "sdpa" and "per_sample cannot apply sliding-window attention" in choice.reason
    # a windowed call is handed over (logged once), and computes what SDPA computes
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=generator) for _ in range(3))
    lengths = {"packed_seq_lengths": torch.tensor([5, 4], dtype=torch.int32)}
    with caplog.at_level(logging.WARNING, logger="unpack_trainer.patches.attention"):
        out, _ = packed_attention_forward(FakeModule(), q, k, v, None, sliding_window=2, **lengths)
    assert per_sample.calls == 0
    assert "per_sample cannot apply sliding-window attention; using sdpa" in caplog.text
    expected, _ = packed_attention_forward(FakeModule(), q, k, v, None, sliding_window=2, backend="sdpa", **lengths)
    torch.testing.assert_close(out, expected)
    # named, it is refused with the reason and the backends that can
    monkeypatch.setenv(ENV_BACKEND, "per_sample")
    with pytest.raises(ValueError, match=f"{ENV_BACKEND}=per_sample cannot apply sliding-window attention; use"):
        choose_backend(CPU, torch.float32, "sdpa", windowed)
    with pytest.raises(ValueError, match="backend='per_sample' cannot apply sliding-window attention"):
        packed_attention_forward(FakeModule(), q, k, v, None, sliding_window=2, backend="per_sample", **lengths)
    # serving the window, it takes the windowed call too
    register_backend("per_sample", per_sample, serves=("sliding_window",))
    assert choose_backend(CPU, torch.float32, "sdpa", windowed) == ("per_sample", f"forced by {ENV_BACKEND}")


def test_refused_with_its_reason_where_it_cannot_run(monkeypatch):
    register_backend("per_sample", per_sample, serves=(), requires=lambda device, dtype: f"no moon over {device.type}")
    choice = choose_backend(CPU, torch.float32, "sdpa")
    assert choice.name == "sdpa" and "no moon over cpu" in choice.reason
    monkeypatch.setenv(ENV_BACKEND, "per_sample")
    with pytest.raises(ValueError, match=f"{ENV_BACKEND}=per_sample cannot run here: no moon over cpu"):
        choose_backend(CPU, torch.float32, "sdpa")


def test_listed_by_env():
    register_backend("per_sample", per_sample, serves=(AttentionFeature.DROPOUT,), before="eager")
    register_backend("moonless", per_sample, requires=lambda device, dtype: "no moon", automatic=False)
    report = environment()
    for backends in report["attention_backends"].values():
        assert list(backends) == list(REGISTRY)
        assert backends["per_sample"] == "available" and backends["moonless"] == "no moon"
    assert report["attention_backend_features"]["per_sample"] == ["dropout"]
    assert report["attention_backend_features"]["moonless"] == []
    text = format_environment(report)
    assert "per_sample: available" in text and "moonless: no moon" in text and "- per_sample: dropout" in text
    assert "- moonless: nothing more" in text


def test_bad_registrations_are_refused():
    with pytest.raises(ValueError, match="lower case"):
        register_backend("Per Sample", per_sample)
    with pytest.raises(ValueError, match="serve some of sliding_window, softcap"):
        register_backend("per_sample", per_sample, serves=("telepathy",))
    with pytest.raises(ValueError, match="before='nowhere'"):
        register_backend("per_sample", per_sample, before="nowhere")
    with pytest.raises(TypeError, match="must be callable"):
        register_backend("per_sample", "not a function")
    assert "per_sample" not in REGISTRY


def test_no_backend_is_named_outside_its_own_module():
    """The registry, the dispatch and the shared pieces read everything from the records: a built-in backend's name
    is spelled (as a string) only in the module that declares it."""
    package = Path(attention.__file__).parent
    for name, record in REGISTRY.items():
        home = Path(sys.modules[record.forward.__module__].__file__).name
        for path in package.glob("*.py"):
            if path.name != home:
                assert f'"{name}"' not in path.read_text() and f"'{name}'" not in path.read_text(), (name, path.name)


def test_features_are_declared_once():
    """Every feature has a description; a backend declares only what it applies itself (the dispatch serves chunks
    and branches on every backend), and every built-in one applies sliding windows."""
    for feature in AttentionFeature:
        assert feature.description and feature.value == feature.value.lower()
    for record in REGISTRY.values():
        assert record.serves <= set(AttentionFeature) and not any(feature.by_dispatch for feature in record.serves)
        assert AttentionFeature.SLIDING_WINDOW in record.serves, record.name
        assert not record.cannot_apply(Needs({AttentionFeature.CHUNKS, AttentionFeature.BRANCHES}))
