"""The plans of a batch (what the dispatch, the backends and the mixers derive from its ``PackedSeqInfo``, kept beside
it in a ``PlanCache``): each built once per forward, shared by every layer and by the recompute of gradient
checkpointing."""

from __future__ import annotations

import collections

import pytest
import torch

from unpack_trainer.model_zoo.tiny import packed_batch
from unpack_trainer.models import patch_model
from unpack_trainer.packed_seq_info import PlanCache
from unpack_trainer.patches.attention import ENV_BACKEND


@pytest.fixture
def builds(monkeypatch):
    """Every plan built during the test, counted by (cache, key); and the lookups, by kind of plan."""
    built: collections.Counter = collections.Counter()
    looked_up: collections.Counter = collections.Counter()
    caches = []  # held, so that no cache's id is reused by a later one
    get = PlanCache.get

    def counting(self, key, build):
        looked_up[type(key).__name__] += 1

        def counted():
            caches.append(self)
            built[(id(self), key)] += 1
            return build()

        return get(self, key, counted)

    monkeypatch.setattr(PlanCache, "get", counting)
    return built, looked_up


def _samples(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (length,), generator=generator) for length in lengths]


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_plan_is_built_once_per_forward(backend, checkpointing, builds, tiny_model, monkeypatch):
    """A tiny Mistral (a sliding window smaller than its samples, so the bucket backends build band masks), 3 layers:
    every plan built once in the forward, and not again in the backward's recomputed layers."""
    monkeypatch.setenv(ENV_BACKEND, backend)
    built, looked_up = builds
    layers = 3
    model = patch_model(tiny_model("mistral", attn_implementation="sdpa", num_hidden_layers=layers, sliding_window=4))
    if checkpointing:  # transformers 5.25 renamed gradient_checkpointing_enable
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss = model(**packed_batch(_samples([7, 3, 12, 5]))).loss
    loss.backward()
    assert built and set(built.values()) == {1}, built
    kinds = {type(key).__name__ for _, key in built}
    mask = {"sdpa": "_BandMask", "eager": "_AdditiveMask"}[backend]
    assert {"_BackendChoice", "_AttentionBuckets", mask} <= kinds, kinds
    # every layer (and every recomputed layer) found the plans the first one built
    lookups = layers * (2 if checkpointing else 1)
    assert looked_up["_BackendChoice"] == lookups and looked_up["_AttentionBuckets"] == lookups, looked_up


def test_another_batch_builds_its_own_plans(builds, tiny_model, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "sdpa")
    built, _ = builds
    model = patch_model(tiny_model("llama", attn_implementation="sdpa", num_hidden_layers=2)).eval()
    with torch.no_grad():
        model(**packed_batch(_samples([4, 6])))
        first = len(built)
        model(**packed_batch(_samples([5, 5], seed=1)))
    assert first and len(built) == 2 * first and set(built.values()) == {1}
