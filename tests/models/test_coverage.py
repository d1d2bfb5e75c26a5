"""Generated coverage: every model type of transformers' causal-LM auto mapping is on the fast packed path (verified),
refused with a named reason, or skipped with a reason. Nothing fails, nothing is silently dense.

Each type builds a tiny model from its config class (2 layers, hidden size 32; see
``unpack_trainer.model_zoo.tiny.tiny_config``) and runs ``check_model_type``: packed logits == each sample alone (fp32,
relative 1e-5), loss and every gradient == the padded batch, SDPA and eager, the packed helper in every attention layer
and transformers' mask function never called for the packed batch (no (T, T) mask).
"""

from __future__ import annotations

from pathlib import Path

import model_coverage
import pytest
import transformers
from model_coverage import TABLE_END, TABLE_PAGE, TABLE_START, check_model_type, coverage_table, model_types

from unpack_trainer.decision import blocked_reason
from unpack_trainer.model_zoo.tiny import config_class, tiny_config
from unpack_trainer.models import BLOCKLIST, RefusalKind, refusal_reason, supported_model_types
from unpack_trainer.models.verified import (
    NOT_VERIFIED_ON,
    VERIFIED_MODEL_TYPES,
    VERIFIED_WITH,
    verified_model_types,
    verified_vision_model_types,
)

MODEL_TYPES = model_types()
MEASURED = transformers.__version__ in VERIFIED_WITH  # a release the verified lists were generated with
NEWEST = transformers.__version__ == VERIFIED_WITH[-1]  # the release the docs' table was generated with
VERIFIED = verified_model_types()
_outcomes: dict[str, object] = {}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_model_type(model_type):
    outcome = check_model_type(model_type)
    _outcomes[model_type] = outcome
    assert outcome.status in ("fast", "refused", "skipped"), f"{model_type}: {outcome.reason}"
    assert outcome.reason
    if outcome.status == "fast":
        assert outcome.implementations, "no attention implementation was verified"
        if MEASURED:
            assert model_type in VERIFIED, (
                f"{model_type} passes: add it to unpack_trainer/models/verified.json (text: fast, or not_fast_on)"
            )
        if outcome.note:  # an encoder checked as a decoder: loaded with its defaults, the trainer trains it padded
            config = config_class(model_type)()
            assert refusal_reason(config) is not None and "is_decoder=True" in refusal_reason(config)
        return
    if MEASURED:
        assert model_type not in VERIFIED, f"{model_type} is listed as verified but {outcome.status}"
    if outcome.status == "refused" and RefusalKind(outcome.kind).blocking:
        # The trainer's decision names the same reason before any forward (from the structure, on the meta device).
        config = config_class(model_type)() if outcome.source == "default" else tiny_config(model_type)
        assert refusal_reason(config) == outcome.reason
        blocked = blocked_reason(
            model_config=config, data_collator=None, processing_class=None, dataset_sample=None, blocklist=BLOCKLIST
        )
        assert blocked is not None and outcome.reason in blocked


def test_goal_and_supported_model_types():
    assert supported_model_types() == sorted(VERIFIED | verified_vision_model_types())
    assert len(VERIFIED) >= 120  # issue 18's goal
    assert VERIFIED <= set(MODEL_TYPES) or not MEASURED
    # What was not fast on an older release is a subset of the newest release's verified types.
    assert set(NOT_VERIFIED_ON) < set(VERIFIED_WITH)
    assert all(set(types) <= VERIFIED_MODEL_TYPES for types in NOT_VERIFIED_ON.values())


@pytest.mark.skipif(not NEWEST, reason=f"the docs' table was generated with transformers {VERIFIED_WITH[-1]}")
def test_docs_table_is_generated_from_this_run():
    if set(_outcomes) != set(MODEL_TYPES):
        pytest.skip("needs the whole parametrized run of test_model_type")
    page = (Path(__file__).parents[2] / TABLE_PAGE).read_text()
    table = page.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    expected = coverage_table([_outcomes[model_type] for model_type in MODEL_TYPES])
    assert table == expected, f"{TABLE_PAGE}'s table is stale: run python tools/model_coverage.py --write-docs"


def test_refusal_needs_no_forward(monkeypatch):
    """The decision refuses a state-space model no mixer handler owns from its config alone (meta device), naming
    the mixer; with the per-sample handler the same model is packed."""
    from transformers import MambaConfig

    from unpack_trainer.models import mixers, refusals

    config = MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64)
    assert refusal_reason(config) is None
    monkeypatch.setattr(mixers, "MIXER_HANDLERS", [])
    monkeypatch.setattr(refusals, "_refusals", {})
    reason = refusal_reason(config)
    assert reason is not None and "MambaMixer" in reason and "across sample boundaries" in reason


def test_gradient_spread_rule_still_catches_a_leak(monkeypatch):
    """A gradient past 1e-5 of its largest entry is held to twice the stock path's own spread of it (how far stock
    transformers' own other summations land: each sample alone, the padded rows reversed; a tiny CTRL's ReLU at its
    kink moves a gradient by 0.5% of its largest entry between them). Packed rows whose samples attend to the samples
    before them still fail it: their gradients move far beyond that spread."""
    from contaminating_model import leak_every_backend
    from model_coverage import _close, _samples

    from unpack_trainer.model_zoo.tiny import loss_and_grads, packed_batch, padded_batch, tiny_model
    from unpack_trainer.model_zoo.tiny_vision import gradient_mismatch
    from unpack_trainer.models import patch_model, unpatch_model

    model = tiny_model("llama", attn_implementation="eager").eval()
    samples = _samples()
    as_inputs = [{"input_ids": sample.unsqueeze(0)} for sample in samples]
    _, padded = loss_and_grads(model, padded_batch(samples), use_cache=False)
    patch_model(model)
    try:
        _, packed = loss_and_grads(model, packed_batch(samples), use_cache=False)
        assert gradient_mismatch(model, as_inputs, packed, padded, _close, use_cache=False) is None
        leak_every_backend(monkeypatch)
        _, leaked = loss_and_grads(model, packed_batch(samples), use_cache=False)
        problem = gradient_mismatch(model, as_inputs, leaked, padded, _close, use_cache=False)
    finally:
        unpatch_model(model)
    assert problem is not None and "beyond 2.0 x the stock path's own spread" in problem, problem


def test_a_stock_failure_is_reported_as_the_tiny_configs(monkeypatch):
    """The coverage check tells a tiny config the stock model cannot run from a failure of the patch."""

    def fails(*args, **kwargs):
        raise RuntimeError("The size of tensor a (8) must match the size of tensor b (64)")

    monkeypatch.setattr(model_coverage, "loss_and_grads", fails)
    outcome = model_coverage.check_model_type("llama")
    assert outcome.status == "failed"
    assert (
        "the stock model (not patched) fails on its tiny config" in outcome.reason
        and "tensor b (64)" in outcome.reason
    )
