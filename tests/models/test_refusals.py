"""Refusals that follow the code: what an attention module computes is read from the source of its ``forward``
(through any decorator), so an attention that changed between transformers releases is refused before training,
with its reason, instead of being patched and caught by the self-check.

transformers 5.24 decorated the attention forwards (``@deprecate_kwarg("past_key_values", ..., new_name="cache")``)
and so hid Inkling's relative position bias from a check that read the wrapper's code: Inkling was patched and its
packed logits were wrong. Here ``LlamaAttention.forward`` is replaced, for one test, by variants of a release that
changed it: with or without a decorator (one that sets ``__wrapped__``, one that does not), computing a term from
positions counted along the row, handing the attention function a term the packed helper does not apply, or neither.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from unpack_trainer.anatomy import structure
from unpack_trainer.model_zoo.tiny import packed_batch, tiny_config, tiny_model
from unpack_trainer.models import (
    PatchRefused,
    RefusalKind,
    is_patched,
    patch_model,
    refusal_reason,
    refusals,
    unpatch_model,
)
from unpack_trainer.models.refusals import APPLIED_TERMS
from unpack_trainer.patches.attention import AttentionFeature, packed_attention_forward


def _project(self, hidden_states, position_embeddings):
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    return query, key, value


def _finish(self, hidden_states, attn_output, attn_weights):
    return self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()), attn_weights


def forward_as_stock(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kwargs):
    """Llama's attention; positions counted only where ``position_ids`` is missing (a fallback: not a refusal)."""
    query, key, value = _project(self, hidden_states, position_embeddings)
    if position_ids is None:
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, position_ids=position_ids, **kwargs
    )
    return _finish(self, hidden_states, attn_output, attn_weights)


def forward_with_row_bias(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """A relative position bias from positions counted along the row (as Inkling's)."""
    query, key, value = _project(self, hidden_states, position_embeddings)
    positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)
    distance = positions[:, None] - positions[None, :]
    row_bias = -0.1 * distance.clamp_min(0).float()
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, rel_bias=row_bias, **kwargs
    )
    return _finish(self, hidden_states, attn_output, attn_weights)


def forward_with_new_term(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """A term of the attention call the packed helper does not apply (not computed from positions)."""
    query, key, value = _project(self, hidden_states, position_embeddings)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, head_gates=self.scaling, **kwargs
    )
    return _finish(self, hidden_states, attn_output, attn_weights)


def eager_with_required_term(
    module, query, key, value, attention_mask, scaling, dropout=0.0, gates=1.0, *, temperature, **kwargs
):
    return eager_attention_forward(module, query / temperature, key, value, attention_mask, scaling, dropout, **kwargs)


def forward_with_required_eager_term(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """An eager reference that requires a term (``temperature``) the call hands over in ``kwargs`` only."""
    query, key, value = _project(self, hidden_states, position_embeddings)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_with_required_term
    )
    attn_output, attn_weights = attention_interface(
        self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )
    return _finish(self, hidden_states, attn_output, attn_weights)


def forward_outside_the_interface(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Attention computed by hand: the packed helper cannot reach it."""
    query, key, value = _project(self, hidden_states, position_embeddings)
    attn_output = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    return _finish(self, hidden_states, attn_output.transpose(1, 2), None)


def with_wraps(function: Callable) -> Callable:
    """A decorator as transformers' ``deprecate_kwarg``: ``functools.wraps`` sets ``__wrapped__``."""

    @functools.wraps(function)
    def wrapped_func(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapped_func


def without_wraps(function: Callable) -> Callable:
    """A hand-written decorator that sets no ``__wrapped__``: the function is only in its closure."""

    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


DECORATORS = {"plain": lambda f: f, "functools.wraps": with_wraps, "no __wrapped__": without_wraps}


def _as_method(function: Callable) -> Callable:
    """``function`` under the name ``forward`` (as a method defined in the class would be)."""
    copy = type(function)(function.__code__.replace(co_name="forward"), function.__globals__, "forward")
    copy.__defaults__, copy.__kwdefaults__ = function.__defaults__, function.__kwdefaults__
    return copy


@pytest.fixture
def llama_forward(monkeypatch):
    """``llama_forward(function, decorator)``: ``LlamaAttention.forward`` replaced for this test, the structure caches
    cleared before and after."""

    def clear():
        structure.class_references.cache_clear()
        structure.attention_call.cache_clear()
        refusals._refusals.clear()

    def replace(function: Callable, decorator: str = "plain") -> None:
        monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", DECORATORS[decorator](_as_method(function)))
        clear()

    clear()
    yield replace
    monkeypatch.undo()
    clear()


def _tiny_llama():
    return tiny_model("llama", num_hidden_layers=1).eval()


@pytest.mark.parametrize("decorator", list(DECORATORS))
def test_a_term_from_row_positions_is_refused_through_any_decorator(llama_forward, decorator):
    llama_forward(forward_with_row_bias, decorator)
    model = _tiny_llama()
    with pytest.raises(PatchRefused, match=r"LlamaAttention\.forward\) computes rel_bias from positions") as refused:
        patch_model(model)
    assert refused.value.kind is RefusalKind.POSITIONS and refused.value.kind.blocking and not is_patched(model)
    # The trainer's decision names it before any forward, from the config alone (meta device).
    assert "computes rel_bias from positions it counts along the whole row" in refusal_reason(tiny_config("llama"))


@pytest.mark.parametrize("decorator", list(DECORATORS))
def test_a_term_the_helper_does_not_apply_is_refused(llama_forward, decorator):
    llama_forward(forward_with_new_term, decorator)
    with pytest.raises(PatchRefused, match=r"hands the attention function head_gates=self\.scaling") as refused:
        patch_model(_tiny_llama())
    assert refused.value.kind is RefusalKind.UNSUPPORTED and not refused.value.kind.blocking


def test_a_term_the_eager_reference_requires_is_refused(llama_forward):
    llama_forward(forward_with_required_eager_term)
    with pytest.raises(PatchRefused, match=r"temperature \(required by eager_with_required_term\)"):
        patch_model(_tiny_llama())


def test_attention_outside_the_interface_is_unreachable(llama_forward):
    llama_forward(forward_outside_the_interface)
    with pytest.raises(PatchRefused, match="LlamaAttention") as refused:
        patch_model(_tiny_llama())
    assert refused.value.kind is RefusalKind.UNREACHABLE


@pytest.mark.parametrize("decorator", list(DECORATORS))
def test_the_same_attention_without_such_terms_is_patched_and_exact(llama_forward, decorator):
    """Control: a decorated forward that counts positions only as a fallback for missing ``position_ids`` and passes
    only terms the helper applies is patched, and its packed logits equal each sample alone."""
    llama_forward(forward_as_stock, decorator)
    model = _tiny_llama()
    samples = [torch.arange(3, 3 + n) for n in (5, 3)]
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in samples]
        patch_model(model)
        batch = packed_batch(samples)
        batch.pop("labels")
        packed = model(**batch).logits[0]
    unpatch_model(model)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-6)


def test_inkling_is_refused_before_any_forward_for_its_row_positions():
    """Inkling's attention computes a relative position bias (and, in its global layers, a query scale) from
    positions it counts along the row; refused as such on every transformers release (5.24 decorated its forward)."""
    reason = refusal_reason(tiny_config("inkling_text"))
    assert reason is not None and "InklingAttention.forward) computes" in reason and "position_bias" in reason
    model = tiny_model("inkling_text")
    with pytest.raises(PatchRefused) as refused:
        patch_model(model)
    assert refused.value.kind is RefusalKind.POSITIONS and not is_patched(model)


def test_applied_terms_are_what_the_packed_helper_applies():
    """Every term the check lets through is a parameter of the packed helper or a keyword it reads (by name, or as
    the keyword of the attention feature that declares it)."""
    parameters = inspect.signature(packed_attention_forward).parameters
    source = inspect.getsource(packed_attention_forward)
    declared = {feature.keyword: f"AttentionFeature.{feature.name}.keyword" for feature in AttentionFeature}
    for term in APPLIED_TERMS:
        assert term in parameters or f'"{term}"' in source or declared.get(term, "?") in source, term


def test_partial_rotary_tiny_models_run_stock():
    """GPT-J and CodeGen rotate the first ``rotary_dim`` dims of each head; the tiny config rotates half a head (a
    default of 64 is more than the tiny head of 8, and the stock model then fails)."""
    for model_type in ("gptj", "codegen"):
        config = tiny_config(model_type)
        assert 0 < config.rotary_dim < config.hidden_size // config.num_attention_heads
        with torch.no_grad():
            assert tiny_model(model_type).eval()(input_ids=torch.arange(3, 9)[None]).logits.shape == (1, 6, 128)
