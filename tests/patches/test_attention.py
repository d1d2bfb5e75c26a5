"""The packed attention helper against a per-sample reference, its metadata, and its backend dispatch.

flash-attn and xformers are checked on CPU with stand-in kernels that verify what the dispatcher hands them
(``cu_seqlens``, ``max_seqlen``, window, layout, scale) and compute the reference; the real kernels are checked by the
``gpu`` tests, skipped without CUDA.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unpack_trainer import _logging
from unpack_trainer.models.routing import make_attention_function
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches import attention, buckets
from unpack_trainer.patches.attention import (
    REGISTRY,
    AttentionFeature,
    BackendChoice,
    Needs,
    choose_backend,
    packed_attention_forward,
)
from unpack_trainer.patches.attention import _common as attention_common
from unpack_trainer.patches.attention import _varlen as varlen_common


class FakeModule(torch.nn.Module):
    """Stands in for a transformers attention module: only ``training`` and ``is_causal`` are read."""

    is_causal = True


def reference_tokens(q, k, v, lengths, *, scaling, window=None, softcap=None, sinks=None, alibi=None):
    """Dense per-sample causal attention in float64. q: (total, H, D); k: (total, H_kv, D); v: (total, H_kv, D_v)
    -> (total, H, D_v). ``sinks``: (H,) extra logit per head in the softmax denominator (gpt_oss ``s_aux``).
    ``alibi``: (H,) ALiBi slopes, ``-slope * (i - j)`` added to the scores, i and j within the sample."""
    groups = q.shape[1] // k.shape[1]
    outputs, start = [], 0
    for length in lengths:
        qs = q[start : start + length].double().transpose(0, 1)
        ks = k[start : start + length].double().transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[start : start + length].double().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qs @ ks.transpose(1, 2) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(length, device=q.device).unsqueeze(1)  # on the inputs' device: CUDA inputs, CUDA mask
        j = torch.arange(length, device=q.device).unsqueeze(0)
        if alibi is not None:
            scores = scores - alibi.double().view(-1, 1, 1) * (i - j).double()
        allowed = j <= i
        if window is not None:
            allowed &= j > i - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            weights = scores.softmax(-1)
        else:
            sink = sinks.double().view(-1, 1, 1).expand(-1, length, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        outputs.append((weights @ vs).transpose(0, 1))
        start += length
    return torch.cat(outputs).to(q.dtype)


def reference(query, key, value, lengths, **options):
    """(B, H, T, D) inputs -> (B, T, H, D), like the helper."""
    batch, heads, seq_len, dim = query.shape
    out = reference_tokens(
        attention_common.tokens_major(query),
        attention_common.tokens_major(key),
        attention_common.tokens_major(value),
        lengths,
        **options,
    )
    return out.view(batch, seq_len, heads, -1)


def random_qkv(lengths, *, rows=1, heads=4, kv_heads=2, dim=8, v_dim=None, dtype=torch.float32, device="cpu", seed=0):
    """q (rows, heads, T, dim), k (rows, kv_heads, T, dim), v (rows, kv_heads, T, v_dim or dim), leaves."""
    total = sum(lengths)
    assert total % rows == 0
    generator = torch.Generator().manual_seed(seed)

    def make(h, d):
        x = torch.randn(rows, h, total // rows, d, generator=generator)
        return x.to(device=device, dtype=dtype).requires_grad_()

    return make(heads, dim), make(kv_heads, dim), make(kv_heads, v_dim or dim)


def info_kwargs(lengths, rows=1):
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths_t.cumsum(0, dtype=torch.int32), (1, 0))
    return {"packed_seq_lengths": lengths_t, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}


def assert_close_to_reference(out, expected, rel=1e-5):
    scale = expected.abs().max()
    assert (out - expected).abs().max() <= rel * scale


def grads(tensors):
    return [t.grad.detach().clone() for t in tensors]


# ---------------------------------------------------------------------------------------------------------------------
# SDPA buckets (PackedSeqInfo itself: tests/test_packed_seq_info.py)
# ---------------------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=80))
def test_sdpa_plan_places_every_token_once(lengths):
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=sum(lengths))
    plan = buckets.attention_plan(info, torch.device("cpu"))
    num_slots = sum(b.count * b.length for b in plan.buckets)
    assert plan.sizes == [b.count * b.length for b in plan.buckets]
    assert plan.gather.shape == plan.pad_slots.shape == (num_slots,)
    # Every token has exactly one slot, a real one, and that slot reads the token itself.
    assert torch.equal(plan.gather[plan.scatter], torch.arange(sum(lengths)))
    assert torch.unique(plan.scatter).numel() == sum(lengths)
    assert not plan.pad_slots[plan.scatter].any() and int((~plan.pad_slots).sum()) == sum(lengths)
    # Within a bucket row: one sample's tokens, in order, then padding that reads that sample's first token.
    sample_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for bucket, gather, pad in zip(plan.buckets, plan.gather.split(plan.sizes), plan.pad_slots.split(plan.sizes)):
        gather, pad = gather.view(bucket.count, bucket.length), pad.view(bucket.count, bucket.length)
        owner = sample_of[gather]
        assert torch.equal(owner, owner[:, :1].expand_as(owner))
        real = (~pad).sum(1)
        assert torch.equal(~pad, torch.arange(bucket.length).unsqueeze(0) < real.unsqueeze(1))
        assert int(real.max()) == bucket.length
        assert torch.equal(gather[:, 0] + real - 1, gather.gather(1, (real - 1).unsqueeze(1)).squeeze(1))
        assert torch.equal(gather[pad], gather[:, :1].expand_as(gather)[pad])


def plan_cost(plan_buckets):
    return sum(buckets.CALL_COST_PAIRS + b.count * b.length**2 for b in plan_buckets)


def test_many_tiny_samples_need_few_calls():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 12, (1000,), generator=generator)
    info = PackedSeqInfo.from_seq_lengths(lengths, batch_size=1, seq_len=int(lengths.sum()))
    assert len(buckets.attention_plan(info, torch.device("cpu")).buckets) <= 8


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=256), min_size=1, max_size=200))
def test_bucketing_beats_the_trivial_plans(lengths):
    """The grouping is optimal for its cost model: no worse than one call per length, or one call for all."""
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=sum(lengths))
    chosen = buckets.attention_plan(info, torch.device("cpu")).buckets
    per_length = [buckets.Bucket(n, lengths.count(n)) for n in set(lengths)]
    single = [buckets.Bucket(max(lengths), len(lengths))]
    assert plan_cost(chosen) <= min(plan_cost(per_length), plan_cost(single))


# ---------------------------------------------------------------------------------------------------------------------
# SDPA and eager against the reference
# ---------------------------------------------------------------------------------------------------------------------

CASES = [
    # lengths, rows, heads, kv_heads, window
    ([5, 1, 9, 3, 1, 12, 1], 1, 4, 2, None),
    ([5, 1, 9, 3, 1, 12, 1], 1, 4, 4, 4),
    ([4, 6, 2, 3, 1, 8], 2, 4, 1, None),
    ([30, 7, 17, 1, 25], 1, 6, 2, 8),
]


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(("lengths", "rows", "heads", "kv_heads", "window"), CASES)
def test_backend_matches_reference_forward_and_backward(backend, lengths, rows, heads, kv_heads, window):
    q, k, v = random_qkv(lengths, rows=rows, heads=heads, kv_heads=kv_heads)
    out, weights = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.3, sliding_window=window, backend=backend, **info_kwargs(lengths)
    )
    assert weights is None and out.shape == (rows, sum(lengths) // rows, heads, 8)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    got = grads([q, k, v])
    for t in (q, k, v):
        t.grad = None
    expected = reference(q, k, v, lengths, scaling=0.3, window=window)
    (expected * upstream).sum().backward()
    assert_close_to_reference(out.detach(), expected.detach())
    for name, g, e in zip("qkv", got, grads([q, k, v])):
        assert torch.isfinite(g).all(), f"non-finite gradient of {name}"
        assert_close_to_reference(g, e)


def assert_matches_reference(out, leaves, lengths, **options):
    """Forward and the gradient of every leaf (q, k, v, and sinks when given) against :func:`reference`."""
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * upstream).sum().backward()
    got = grads(leaves)
    for t in leaves:
        t.grad = None
    expected = reference(*leaves[:3], lengths, **options)
    (expected * upstream).sum().backward()
    assert out.shape == expected.shape
    assert_close_to_reference(out.detach(), expected.detach())
    for index, (g, e) in enumerate(zip(got, grads(leaves))):
        assert torch.isfinite(g).all(), f"non-finite gradient of leaf {index}"
        assert_close_to_reference(g, e)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(("dim", "v_dim", "window"), [(8, 12, None), (12, 5, 4), (20, 12, 6)])
def test_value_head_dim_differs_from_query_head_dim(backend, dim, v_dim, window):
    """MLA (deepseek_v3): values have their own head dim; scaling is not 1/sqrt(dim)."""
    lengths = [5, 1, 9, 3, 12, 1]
    q, k, v = random_qkv(lengths, dim=dim, v_dim=v_dim)
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.37, sliding_window=window, backend=backend, **info_kwargs(lengths)
    )
    assert out.shape == (1, sum(lengths), 4, v_dim)
    assert_matches_reference(out, [q, k, v], lengths, scaling=0.37, window=window)


def random_sinks(heads=4, seed=3):
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).requires_grad_()


@pytest.mark.parametrize(("window", "kv_heads"), [(None, 2), (4, 1), (3, 4)])
def test_sinks_on_eager_buckets(window, kv_heads):
    """gpt_oss attention sinks: one extra logit per head in every query's softmax denominator; exact gradients for
    q, k, v and the sinks themselves."""
    lengths = [5, 1, 9, 3, 12, 1, 30]
    q, k, v = random_qkv(lengths, kv_heads=kv_heads)
    sinks = random_sinks()
    out, _ = packed_attention_forward(
        FakeModule(),
        q,
        k,
        v,
        None,
        scaling=0.4,
        sliding_window=window,
        s_aux=sinks,
        backend="eager",
        **info_kwargs(lengths),
    )
    without = reference(q, k, v, lengths, scaling=0.4, window=window)
    assert (out - without).abs().max() > 0.05, "the sinks must change the output for this test to mean anything"
    assert_matches_reference(out, [q, k, v, sinks], lengths, scaling=0.4, window=window, sinks=sinks)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_eager_rounds_as_transformers_eager(kv_heads):
    """One sample in the row: the eager buckets give bit for bit transformers' own eager attention (scores
    ``(QK^T) * scaling`` then the mask, softmax in float32), forward and every gradient. Scaling q before the matmul
    instead rounds differently, which CTRL's tied embedding gradient amplifies past rel 1e-5 against the padded batch."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    length, scaling = 29, 8**-0.5
    q, k, v = random_qkv([length], kv_heads=kv_heads, seed=3)
    module = FakeModule()
    module.num_key_value_groups = 4 // kv_heads
    module.training = False
    mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
    upstream = torch.randn(1, length, 4, 8, generator=torch.Generator().manual_seed(7))
    stock, _ = eager_attention_forward(module, q, k, v, mask, scaling=scaling)
    (stock * upstream).sum().backward()
    stock_grads = grads([q, k, v])
    for t in (q, k, v):
        t.grad = None
    out, _ = packed_attention_forward(module, q, k, v, None, scaling=scaling, backend="eager", **info_kwargs([length]))
    (out * upstream).sum().backward()
    assert torch.equal(out, stock)
    for name, got, expected in zip("qkv", grads([q, k, v]), stock_grads):
        assert torch.equal(got, expected), f"gradient of {name}"


def test_softcap_on_eager_buckets():
    lengths = [6, 3, 9, 1, 20]
    q, k, v = random_qkv(lengths, kv_heads=1)
    out, _ = packed_attention_forward(
        FakeModule(),
        q,
        k,
        v,
        None,
        scaling=1.0,
        softcap=1.5,
        sliding_window=5,
        backend="eager",
        **info_kwargs(lengths),
    )
    without = reference(q, k, v, lengths, scaling=1.0, window=5)
    assert (out - without).abs().max() > 0.05, "the softcap must change the output for this test to mean anything"
    assert_matches_reference(out, [q, k, v], lengths, scaling=1.0, softcap=1.5, window=5)


@pytest.mark.parametrize(
    ("option", "feature"), [("softcap", "attention logit softcapping"), ("s_aux", "attention sinks")]
)
def test_automatic_choice_hands_quirks_to_eager(caplog, monkeypatch, option, feature):
    """On the CPU the automatic choice is SDPA, which can apply neither: eager buckets take over, logged once."""
    monkeypatch.setattr(_logging, "_logged", set())
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    ran = spy_backends(monkeypatch)
    lengths = [6, 3, 9]
    q, k, v = random_qkv(lengths)
    value = 2.0 if option == "softcap" else random_sinks()
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        out, _ = packed_attention_forward(
            FakeModule(), q, k, v, None, scaling=1.0, **{option: value}, **info_kwargs(lengths)
        )
    assert ran == ["eager"]
    assert f"sdpa cannot apply {feature}" in caplog.text and "using eager" in caplog.text
    leaves = [q, k, v] + ([value] if option == "s_aux" else [])
    options = {"softcap": value} if option == "softcap" else {"sinks": value}
    assert_matches_reference(out, leaves, lengths, scaling=1.0, **options)


def spy_backends(monkeypatch) -> list[str]:
    """Record the name of every backend whose forward runs."""
    ran: list[str] = []
    for name, record in list(REGISTRY.items()):

        def spy(*args, _name=name, _function=record.forward, **kwargs):
            ran.append(_name)
            return _function(*args, **kwargs)

        monkeypatch.setitem(REGISTRY, name, record._replace(forward=spy))
    return ran


def never_called(*args, **kwargs):
    raise AssertionError("the kernel must not run: the backend has to refuse first")


@pytest.mark.parametrize(
    ("backend", "option", "feature"),
    [
        ("sdpa", "softcap", "attention logit softcapping"),
        ("xformers", "softcap", "attention logit softcapping"),
        ("torch_varlen", "softcap", "attention logit softcapping"),
        ("sdpa", "s_aux", "attention sinks"),
        ("xformers", "s_aux", "attention sinks"),
        ("flash", "s_aux", "attention sinks"),
        ("torch_varlen", "s_aux", "attention sinks"),
        ("torch_varlen", "dropout", "attention dropout"),
    ],
)
def test_explicit_backend_refuses_what_it_cannot_apply(cpu_kernels, monkeypatch, backend, option, feature):
    """Issue 10 item 21: ``backend="sdpa"`` with ``softcap`` used to return the output without softcapping."""
    cpu_kernels("flash", never_called)
    cpu_kernels("torch_varlen", never_called)
    cpu_kernels("xformers", types.SimpleNamespace(memory_efficient_attention=never_called))
    lengths = [6, 3]
    q, k, v = random_qkv(lengths)
    value = {"softcap": 2.0, "s_aux": random_sinks(), "dropout": 0.1}[option]
    with pytest.raises(ValueError, match=f"backend='{backend}' cannot apply {feature}"):
        packed_attention_forward(
            FakeModule(), q, k, v, None, backend=backend, **{option: value}, **info_kwargs(lengths)
        )


@pytest.mark.parametrize(
    ("backend", "option", "feature"),
    [
        ("sdpa", "softcap", "attention logit softcapping"),
        ("xformers", "softcap", "attention logit softcapping"),
        ("torch_varlen", "softcap", "attention logit softcapping"),
        ("sdpa", "s_aux", "attention sinks"),
        ("flash", "s_aux", "attention sinks"),
        ("torch_varlen", "dropout", "attention dropout"),
    ],
)
def test_forced_backend_that_cannot_apply_a_quirk_is_an_error(cpu_kernels, monkeypatch, backend, option, feature):
    cpu_kernels("flash", never_called)
    cpu_kernels("torch_varlen", never_called)
    cpu_kernels("xformers", types.SimpleNamespace(memory_efficient_attention=never_called))
    monkeypatch.setenv(attention.ENV_BACKEND, backend)
    lengths = [6, 3]
    q, k, v = random_qkv(lengths)
    value = {"softcap": 2.0, "s_aux": random_sinks(), "dropout": 0.1}[option]
    with pytest.raises(ValueError, match=f"{attention.ENV_BACKEND}={backend} cannot apply {feature}"):
        packed_attention_forward(FakeModule(), q, k, v, None, **{option: value}, **info_kwargs(lengths))


def test_dropout_is_passed_to_sdpa_and_applied_by_eager(monkeypatch):
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["dropout_p"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    lengths = [6, 3, 9]
    q, k, v = random_qkv(lengths)
    packed_attention_forward(FakeModule(), q, k, v, None, dropout=0.25, backend="sdpa", **info_kwargs(lengths))
    assert seen and set(seen) == {0.25}
    module = FakeModule().train()
    torch.manual_seed(0)
    dropped, _ = packed_attention_forward(module, q, k, v, None, dropout=0.5, backend="eager", **info_kwargs(lengths))
    clean, _ = packed_attention_forward(module, q, k, v, None, dropout=0.0, backend="eager", **info_kwargs(lengths))
    assert not torch.allclose(dropped, clean)


def test_no_dense_mask_and_few_sdpa_calls(monkeypatch):
    shapes = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        shapes.append((tuple(query.shape), None if attn_mask is None else tuple(attn_mask.shape)))
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 9, (400,), generator=generator).tolist() + [40, 37]
    q, k, v = random_qkv(lengths, heads=2, kv_heads=1, dim=4)
    out, _ = packed_attention_forward(FakeModule(), q, k, v, None, sliding_window=16, **info_kwargs(lengths))
    assert len(shapes) <= 4
    assert all(mask is None or mask == (40, 40) for _, mask in shapes)
    expected = reference(q, k, v, lengths, scaling=0.5, window=16)
    assert_close_to_reference(out.detach(), expected.detach())


# ---------------------------------------------------------------------------------------------------------------------
# Errors, choice, and the registered function
# ---------------------------------------------------------------------------------------------------------------------


def test_packed_attention_errors():
    lengths = [3, 2]
    q, k, v = random_qkv(lengths)
    with pytest.raises(ValueError, match="needs packing metadata"):
        packed_attention_forward(FakeModule(), q, k, v, None)
    with pytest.raises(ValueError, match="cannot be combined with a KV cache"):
        longer = torch.cat([k, k], dim=2)
        packed_attention_forward(FakeModule(), q, longer, longer, None, **info_kwargs(lengths))
    with pytest.raises(ValueError, match="sum to 5 tokens but the batch has 1 row"):
        packed_attention_forward(FakeModule(), q[:, :, :4], k[:, :, :4], v[:, :, :4], None, **info_kwargs(lengths))
    bidirectional = FakeModule()
    bidirectional.is_causal = False
    with pytest.raises(ValueError, match="causal only"):
        packed_attention_forward(bidirectional, q, k, v, None, **info_kwargs(lengths))
    with pytest.raises(ValueError, match="is not a packed attention backend"):
        packed_attention_forward(FakeModule(), q, k, v, None, backend="magic", **info_kwargs(lengths))


def test_choose_backend(monkeypatch, stand_in_kernel):
    cpu = torch.device("cpu")
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    assert choose_backend(cpu, torch.float32, "sdpa").name == "sdpa"
    assert choose_backend(cpu, torch.float32, "eager") == BackendChoice(
        "eager", "the model was loaded with attn_implementation='eager'"
    )
    monkeypatch.setenv(attention.ENV_BACKEND, "eager")
    assert choose_backend(cpu, torch.float32, "sdpa") == BackendChoice("eager", "forced by UNPACK_ATTENTION_BACKEND")
    monkeypatch.setenv(attention.ENV_BACKEND, "magic")
    with pytest.raises(ValueError, match="is not a packed attention backend"):
        choose_backend(cpu, torch.float32, "sdpa")
    stand_in_kernel("flash", None)
    monkeypatch.setenv(attention.ENV_BACKEND, "flash")
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        choose_backend(cpu, torch.bfloat16, "sdpa")


def test_choose_backend_prefers_available_kernels(monkeypatch, stand_in_kernel):
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    stand_in_kernel("flash", object())
    stand_in_kernel("torch_varlen", None)
    stand_in_kernel("xformers", object())
    cuda = torch.device("cuda")
    assert choose_backend(cuda, torch.bfloat16, "sdpa").name == "flash"
    assert choose_backend(cuda, torch.float32, "sdpa").name == "xformers"  # flash-attn needs half precision
    assert choose_backend(torch.device("cpu"), torch.bfloat16, "sdpa").name == "sdpa"
    stand_in_kernel("flash", None)
    assert choose_backend(cuda, torch.bfloat16, "flash_attention_2").name == "xformers"


def test_unpacked_calls_run_the_original_implementation():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = FakeModule()
    module.num_key_value_groups = 2
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[0, :, :, :2] = False
    function = make_attention_function("sdpa")
    for attention_mask in (None, mask):
        got, _ = function(module, q, k, v, attention_mask, scaling=0.2, dropout=0.0, packed_seq_info=None)
        expected, _ = sdpa_attention_forward(module, q, k, v, attention_mask, scaling=0.2, dropout=0.0)
        assert torch.equal(got, expected)
    # Plain arange positions are not packed either.
    positions = torch.arange(6).expand(2, 6)
    got, _ = function(module, q, k, v, None, scaling=0.2, position_ids=positions)
    assert torch.equal(got, sdpa_attention_forward(module, q, k, v, None, scaling=0.2)[0])


def test_direct_calls_derive_metadata_on_every_call(monkeypatch):
    """The helper called directly (no decoder hook hands it ``packed_seq_info``) derives the metadata of its
    ``cu_seq_lens_q`` on every call: there is no cache beside the keyword."""
    calls = []
    original = PackedSeqInfo.from_cu_seqlens.__func__

    def counting(cls, *args, **kwargs):
        calls.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PackedSeqInfo, "from_cu_seqlens", classmethod(counting))
    lengths = [3, 5, 2]
    q, k, v = random_qkv(lengths)
    cu = info_kwargs(lengths)["cu_seq_lens_q"]
    with torch.no_grad():
        first, _ = packed_attention_forward(FakeModule(), q, k, v, None, scaling=0.5, cu_seq_lens_q=cu)
        second, _ = packed_attention_forward(FakeModule(), q, k, v, None, scaling=0.5, cu_seq_lens_q=cu)
    assert len(calls) == 2 and torch.equal(first, second)
    assert_close_to_reference(first, reference(q, k, v, lengths, scaling=0.5).detach())


def test_registered_function_routes_only_what_this_package_marks():
    """Issue 20 item 12: the registered function stands under transformers' own name for every model, so only the
    package's own marks (``packed_seq_info``, ``packed_seq_lengths``) reroute a call; keys transformers passes itself
    (``cu_seq_lens_q``) run the stock function exactly, as for an unpatched model."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    lengths = [3, 5, 2]
    q, k, v = random_qkv(lengths)
    kwargs = info_kwargs(lengths)
    function = make_attention_function("sdpa")
    module = FakeModule()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    with torch.no_grad():
        stock, _ = function(module, q, k, v, None, scaling=0.5, cu_seq_lens_q=kwargs["cu_seq_lens_q"])
        assert torch.equal(stock, sdpa_attention_forward(module, q, k, v, None, scaling=0.5)[0])
        lengths_tensor = torch.tensor(lengths, dtype=torch.int32)
        packed, _ = function(FakeModule(), q, k, v, None, scaling=0.5, packed_seq_lengths=lengths_tensor)
    assert_close_to_reference(packed, reference(q, k, v, lengths, scaling=0.5).detach())


# ---------------------------------------------------------------------------------------------------------------------
# flash-attn and xformers dispatch, with stand-in kernels on the CPU
# ---------------------------------------------------------------------------------------------------------------------


class StandInFlash:
    """Checks the arguments of ``flash_attn_varlen_func`` and computes the reference."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
        assert q.dim() == k.dim() == v.dim() == 3, "flash-attn varlen takes (total_tokens, num_heads, head_dim)"
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn 2 takes one head dim for q, k and v"
        assert q.shape[0] == k.shape[0] == int(cu_seqlens_q[-1])
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and int(cu_seqlens_q[0]) == 0
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        assert isinstance(max_seqlen_q, int) and max_seqlen_q == max(lengths)
        assert options["causal"] is True
        window = options.get("window_size", (-1, -1))
        assert window[1] in (0, -1)
        self.calls.append({"lengths": lengths, "head_dims": (q.shape[-1], k.shape[-1], v.shape[-1]), **options})
        return reference_tokens(
            q,
            k,
            v,
            lengths,
            scaling=options["softmax_scale"],
            window=None if window[0] < 0 else window[0] + 1,
            softcap=options.get("softcap"),
            alibi=options.get("alibi_slopes"),
        )


@pytest.fixture
def cpu_kernels(monkeypatch, stand_in_kernel):
    """``cpu_kernels(backend, kernel)``: a stand-in kernel for a kernel backend, 'available' on the CPU in fp32 too.
    torch's real varlen_attn (it imports on a CPU build too) is not installed unless a test installs a stand-in."""
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)

    def install(backend, kernel):
        stand_in_kernel(backend, kernel, cpu=True, dtypes=(torch.float16, torch.bfloat16, torch.float32))

    install("torch_varlen", None)
    return install


@pytest.mark.parametrize(("window", "kv_heads"), [(None, 2), (4, 1), (50, 4)])
def test_flash_dispatch(cpu_kernels, monkeypatch, window, kv_heads):
    kernel = StandInFlash()
    cpu_kernels("flash", kernel)
    lengths = [5, 1, 9, 1, 12, 4]
    q, k, v = random_qkv(lengths, rows=2, kv_heads=kv_heads)
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.4, sliding_window=window, dropout=0.1, **info_kwargs(lengths)
    )
    (call,) = kernel.calls
    assert call["lengths"] == lengths
    assert call["softmax_scale"] == 0.4 and call["dropout_p"] == 0.1
    # transformers' window w (i - w < j <= i) is flash-attn's inclusive (w - 1, 0); no window when it cannot bind.
    assert call.get("window_size") == (None if window in (None, 50) else (window - 1, 0))
    expected = reference(q, k, v, lengths, scaling=0.4, window=window)
    assert_close_to_reference(out.detach(), expected.detach())


def test_flash_splits_rows_past_the_int32_limit(cpu_kernels, monkeypatch, caplog):
    kernel = StandInFlash()
    cpu_kernels("flash", kernel)
    monkeypatch.setattr(_logging, "_logged", set())
    heads, dim = 4, 8  # one token costs 4 * 32 elements of the (head_dim rounded up to 32) accumulator
    lengths = [30, 10, 50, 2, 20, 7]
    monkeypatch.setattr(varlen_common, "MAX_ELEMENTS", (60 + 128 * 2) * heads * 32)
    q, k, v = random_qkv(lengths, heads=heads, kv_heads=2, dim=dim)
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        out, _ = packed_attention_forward(FakeModule(), q, k, v, None, scaling=0.3, **info_kwargs(lengths))
    assert "chunks split at sample boundaries" in caplog.text
    # Chunks follow sample boundaries, each under the limit (tokens + 128 per sample, x heads x 32).
    assert [call["lengths"] for call in kernel.calls] == [[30, 10], [50, 2], [20, 7]]
    expected = reference(q, k, v, lengths, scaling=0.3)
    assert_close_to_reference(out.detach(), expected.detach())
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize(("softcap", "fallback"), [(None, "sdpa"), (1.5, "eager")])
def test_flash_sample_too_large_alone_falls_back(cpu_kernels, monkeypatch, caplog, softcap, fallback):
    kernel = StandInFlash()
    cpu_kernels("flash", kernel)
    monkeypatch.setattr(_logging, "_logged", set())
    lengths = [10, 400, 12]
    monkeypatch.setattr(varlen_common, "MAX_ELEMENTS", (40 + 128 * 2) * 4 * 32)
    q, k, v = random_qkv(lengths)
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        out, _ = packed_attention_forward(
            FakeModule(), q, k, v, None, scaling=0.3, softcap=softcap, **info_kwargs(lengths)
        )
    assert (
        f"Packed sample 1 (400 tokens) alone exceeds flash-attn's 32-bit offsets; it runs on {fallback}" in caplog.text
    )
    assert [call["lengths"] for call in kernel.calls] == [[10], [12]]
    expected = reference(q, k, v, lengths, scaling=0.3, softcap=softcap)
    assert_close_to_reference(out.detach(), expected.detach())


def make_fake_xformers(record):
    class BlockDiagonalCausalMask:
        def __init__(self, seqlens, window=None):
            self.seqlens, self.window = list(seqlens), window

        @classmethod
        def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
            record["from_seqlens"] = (list(q_seqlen), kv_seqlen, device)
            return cls(q_seqlen)

        def make_local_attention(self, window_size):
            record["window"] = window_size
            return BlockDiagonalCausalMask(self.seqlens, window_size)

    def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
        record["shapes"] = (tuple(query.shape), tuple(key.shape))
        record["p"], record["scale"] = p, scale
        assert query.shape[0] == 1, "the block-diagonal bias takes all samples in one batch row"
        if query.dim() == 5:  # (1, M, G, H, K): kv heads broadcast across each group
            assert key.stride(3) == 0
            total, kv_heads, groups, dim = query.shape[1:]
            q = query.reshape(total, kv_heads * groups, dim)
            k, v = key[0, :, :, 0], value[0, :, :, 0]
        else:
            q, k, v = query[0], key[0], value[0]
        out = reference_tokens(q, k, v, attn_bias.seqlens, scaling=scale, window=attn_bias.window)
        return out.view(*query.shape[:-1], out.shape[-1])

    fmha = types.SimpleNamespace(
        attn_bias=types.SimpleNamespace(BlockDiagonalCausalMask=BlockDiagonalCausalMask),
        memory_efficient_attention=memory_efficient_attention,
    )
    return fmha


@pytest.mark.parametrize(("window", "kv_heads"), [(None, 2), (4, 4), (3, 1)])
def test_xformers_dispatch(cpu_kernels, monkeypatch, window, kv_heads):
    record = {}
    cpu_kernels("flash", None)
    cpu_kernels("xformers", make_fake_xformers(record))
    lengths = [5, 1, 9, 1, 12, 4]
    q, k, v = random_qkv(lengths, rows=2, kv_heads=kv_heads)
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.4, sliding_window=window, dropout=0.1, **info_kwargs(lengths)
    )
    assert record["from_seqlens"][0] == lengths
    assert record.get("window") == window
    assert record["p"] == 0.1 and record["scale"] == 0.4
    groups = 4 // kv_heads
    expected_q = (1, 32, kv_heads, groups, 8) if groups > 1 else (1, 32, 4, 8)
    assert record["shapes"][0] == expected_q
    expected = reference(q, k, v, lengths, scaling=0.4, window=window)
    assert_close_to_reference(out.detach(), expected.detach())


def test_flash_gets_one_head_dim_for_q_k_v(cpu_kernels, monkeypatch):
    """flash-attn 2 takes one head dim for q, k and v: MLA values are zero-padded to the query head dim and the
    output cropped back (as transformers' flash_attention_forward does)."""
    kernel = StandInFlash()
    cpu_kernels("flash", kernel)
    lengths = [5, 1, 9, 1, 12, 4]
    q, k, v = random_qkv(lengths, dim=20, v_dim=12)
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.3, sliding_window=4, **info_kwargs(lengths)
    )
    assert [call["head_dims"] for call in kernel.calls] == [(20, 20, 20)]
    assert_matches_reference(out, [q, k, v], lengths, scaling=0.3, window=4)


def test_flash_applies_softcap(cpu_kernels, monkeypatch):
    kernel = StandInFlash()
    cpu_kernels("flash", kernel)
    lengths = [5, 1, 9, 1, 12, 4]
    q, k, v = random_qkv(lengths)
    out, _ = packed_attention_forward(FakeModule(), q, k, v, None, scaling=1.0, softcap=1.5, **info_kwargs(lengths))
    assert [call["softcap"] for call in kernel.calls] == [1.5]
    assert_matches_reference(out, [q, k, v], lengths, scaling=1.0, softcap=1.5)


@pytest.mark.parametrize(("window", "kv_heads", "v_dim"), [(None, 2, None), (4, 2, 12), (3, 4, None)])
def test_xformers_dispatch_quirks(cpu_kernels, monkeypatch, window, kv_heads, v_dim):
    record = {}
    cpu_kernels("flash", None)
    cpu_kernels("torch_varlen", None)
    cpu_kernels("xformers", make_fake_xformers(record))
    lengths = [5, 1, 9, 1, 12, 4]
    q, k, v = random_qkv(lengths, kv_heads=kv_heads, v_dim=v_dim)
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.4, sliding_window=window, **info_kwargs(lengths)
    )
    assert record["from_seqlens"][0] == lengths
    assert_matches_reference(out, [q, k, v], lengths, scaling=0.4, window=window)


def make_stand_in_varlen(calls: list, *, gqa_parameter: bool = True):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` with its signature (with or without ``enable_gqa``),
    checking what the real kernel requires and computing the reference."""

    def check_and_compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa):
        assert query.dim() == key.dim() == value.dim() == 3, "varlen_attn takes (total_tokens, num_heads, head_dim)"
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], "one head dim for q, k and v"
        assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 256, "flash kernels need head_dim % 8 == 0, <= 256"
        assert all(x.stride(-1) == 1 for x in (query, key, value))
        assert cu_seq_q.dtype == torch.int32 and cu_seq_q.device == query.device and cu_seq_q.dim() == 1
        assert int(cu_seq_q[0]) == 0 and int(cu_seq_q[-1]) == query.shape[0] == key.shape[0]
        assert torch.equal(cu_seq_q, cu_seq_k)
        lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
        assert isinstance(max_q, int) and max_q == max_k == max(lengths)
        assert isinstance(window_size, tuple) and window_size[1] == 0, "causal: (-1, 0), or (left, 0) for a window"
        assert window_size[0] == -1 or window_size[0] >= 0
        assert scale is not None
        if enable_gqa:
            assert query.shape[1] % key.shape[1] == 0
        else:
            assert key.shape[1] == value.shape[1] == query.shape[1]
        calls.append(
            {
                "lengths": lengths,
                "window_size": window_size,
                "enable_gqa": enable_gqa,
                "kv_heads": key.shape[1],
                "head_dim": query.shape[-1],
                "scale": scale,
                "dtypes": (query.dtype, key.dtype, value.dtype),
            }
        )
        window = None if window_size[0] < 0 else window_size[0] + 1
        return reference_tokens(query, key, value, lengths, scaling=scale, window=window)

    if gqa_parameter:

        def varlen_attn(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            *,
            return_aux=None,
            scale=None,
            window_size=(-1, -1),
            enable_gqa=False,
            seqused_k=None,
            block_table=None,
            num_splits=None,
        ):
            return check_and_compute(
                query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa
            )

    else:

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            return check_and_compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, False)

    return varlen_attn


@pytest.mark.parametrize(
    ("window", "kv_heads", "gqa_parameter", "dim", "v_dim"),
    [
        (None, 2, True, 8, None),
        (4, 1, False, 8, None),
        (50, 4, True, 8, None),
        (4, 2, True, 10, 6),  # head dims padded to a multiple of 8, values to the query head dim
        (None, 1, False, 20, 12),
    ],
)
def test_torch_varlen_dispatch(cpu_kernels, monkeypatch, window, kv_heads, gqa_parameter, dim, v_dim):
    calls = []
    cpu_kernels("flash", None)
    cpu_kernels("torch_varlen", make_stand_in_varlen(calls, gqa_parameter=gqa_parameter))
    lengths = [5, 1, 9, 1, 12, 4]
    q, k, v = random_qkv(lengths, rows=2, kv_heads=kv_heads, dim=dim, v_dim=v_dim)
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.4, sliding_window=window, **info_kwargs(lengths)
    )
    (call,) = calls
    assert call["lengths"] == lengths and call["scale"] == 0.4
    # transformers' window w (i - w < j <= i) is the kernel's inclusive (w - 1, 0); causal alone is (-1, 0).
    assert call["window_size"] == ((-1, 0) if window in (None, 50) else (window - 1, 0))
    # GQA: the kernel's enable_gqa where its signature has it, the kv heads repeated where it does not.
    assert call["enable_gqa"] == (gqa_parameter and kv_heads < 4)
    assert call["kv_heads"] == (kv_heads if gqa_parameter else 4)
    assert call["head_dim"] == -(-max(dim, v_dim or dim) // 8) * 8
    assert out.shape == (2, sum(lengths) // 2, 4, v_dim or dim)
    assert_matches_reference(out, [q, k, v], lengths, scaling=0.4, window=window)


@pytest.mark.parametrize(
    ("option", "value", "fallback"), [("softcap", 2.0, "eager"), ("s_aux", "sinks", "eager"), ("dropout", 0.2, "sdpa")]
)
def test_torch_varlen_hands_over_what_it_cannot_apply(cpu_kernels, monkeypatch, caplog, option, value, fallback):
    monkeypatch.setattr(_logging, "_logged", set())
    cpu_kernels("flash", None)
    cpu_kernels("torch_varlen", never_called)
    ran = spy_backends(monkeypatch)
    lengths = [6, 3, 9]
    q, k, v = random_qkv(lengths)
    value = random_sinks() if value == "sinks" else value
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        out, _ = packed_attention_forward(
            FakeModule(), q, k, v, None, scaling=0.5, **{option: value}, **info_kwargs(lengths)
        )
    assert ran == [fallback]
    assert "torch_varlen cannot apply attention" in caplog.text and f"using {fallback}" in caplog.text
    if option != "dropout":
        leaves = [q, k, v] + ([value] if option == "s_aux" else [])
        options = {"softcap": value} if option == "softcap" else {"sinks": value}
        assert_matches_reference(out, leaves, lengths, scaling=0.5, **options)


def test_autocast_runs_the_varlen_kernel_in_the_autocast_dtype(monkeypatch, caplog, stand_in_kernel):
    """Issue 26 item 1: fp32 weights under bf16 autocast (TRL's default on a GPU) hand attention fp32 q / k (RoPE
    multiplied them by fp32 cos / sin) and a bf16 v. The backend is chosen for the dtype attention computes in, bf16,
    and the varlen kernel (a stand-in that only takes half precision, as the real one) receives bf16 q / k / v.
    Before: the choice saw fp32, skipped the kernel ("needs float16 or bfloat16") and ran the SDPA buckets."""
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    stand_in_kernel("flash", None, cpu=True)
    calls = []
    stand_in_kernel("torch_varlen", make_stand_in_varlen(calls), cpu=True)
    lengths = [5, 1, 9, 12, 4]
    q, k, v = random_qkv(lengths, dim=16)
    v_bf16 = v.detach().to(torch.bfloat16).requires_grad_()
    with caplog.at_level(logging.INFO, logger=attention.__name__), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packed_attention_forward(FakeModule(), q, k, v_bf16, None, scaling=0.25, **info_kwargs(lengths))
    (call,) = calls
    assert call["dtypes"] == (torch.bfloat16,) * 3
    assert "Packed attention backend: torch_varlen (torch_varlen available on cpu for torch.bfloat16" in caplog.text
    assert out.dtype == torch.bfloat16
    expected = reference(q.detach().bfloat16(), k.detach().bfloat16(), v_bf16.detach(), lengths, scaling=0.25)
    assert_close_to_reference(out.detach().float(), expected.float(), rel=1e-2)
    out.float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.float32 and v_bf16.grad.dtype == torch.bfloat16
    # Without autocast the same fp32 inputs cannot take the kernel: the choice follows the compute dtype.
    assert choose_backend(torch.device("cpu"), torch.float32, "sdpa").name == "sdpa"


def test_autocast_model_takes_the_varlen_kernel_and_says_so(monkeypatch, caplog, tiny_llama, stand_in_kernel):
    """A patched fp32 Llama under bf16 autocast: the stand-in varlen kernel runs every layer in bf16, the
    packed logits match each sample alone under the same autocast, and ``resolve_backend`` with the trainer's
    compute dtype names the backend the forward logs."""
    from unpack_trainer.models import patch_model, resolve_backend

    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    stand_in_kernel("flash", None, cpu=True)
    calls = []
    stand_in_kernel("torch_varlen", make_stand_in_varlen(calls), cpu=True)
    model = patch_model(tiny_llama(head_dim=8).eval())
    assert resolve_backend(model).name == "sdpa"  # fp32 without mixed precision
    choice = resolve_backend(model, compute_dtype=torch.bfloat16)
    lengths = [7, 3, 11]
    ids = torch.randint(3, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with caplog.at_level(logging.INFO, logger=attention.__name__), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = model(input_ids=ids, position_ids=positions).logits.float()
        alone = [model(input_ids=part).logits.float() for part in ids.split(lengths, dim=1)]
    assert choice.name == "torch_varlen" and f"Packed attention backend: {choice}." in caplog.text
    assert len(calls) == model.config.num_hidden_layers
    assert all(call["dtypes"] == (torch.bfloat16,) * 3 for call in calls)
    assert_close_to_reference(packed, torch.cat(alone, dim=1), rel=2e-2)


def test_choose_torch_varlen(monkeypatch, stand_in_kernel):
    """On CUDA in half precision: flash-attn when installed, else torch's varlen_attn, before xformers."""
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    monkeypatch.setitem(
        REGISTRY, "torch_varlen", REGISTRY["torch_varlen"]._replace(requires=lambda device, dtype: None)
    )
    stand_in_kernel("flash", object())
    stand_in_kernel("torch_varlen", object())
    stand_in_kernel("xformers", object())
    cuda = torch.device("cuda")
    assert choose_backend(cuda, torch.bfloat16, "sdpa").name == "flash"
    stand_in_kernel("flash", None)
    assert choose_backend(cuda, torch.bfloat16, "sdpa").name == "torch_varlen"
    assert choose_backend(cuda, torch.float16, "flash_attention_2").name == "torch_varlen"
    assert choose_backend(cuda, torch.float32, "sdpa").name == "xformers"  # varlen_attn needs half precision
    assert choose_backend(torch.device("cpu"), torch.bfloat16, "sdpa").name == "sdpa"
    # Quirks the kernel cannot apply go to the next backend that can.
    assert (
        choose_backend(cuda, torch.bfloat16, "sdpa", Needs({AttentionFeature.SOFTCAP})).name == "flex"
    )  # eager on the CPU
    assert choose_backend(cuda, torch.bfloat16, "sdpa", Needs({AttentionFeature.DROPOUT})).name == "xformers"
    assert choose_backend(cuda, torch.bfloat16, "sdpa", Needs(head_dim=320)).name == "xformers"
    monkeypatch.setitem(
        REGISTRY,
        "torch_varlen",
        REGISTRY["torch_varlen"]._replace(requires=lambda device, dtype: "compute capability 7.5 < 8.0"),
    )
    choice = choose_backend(cuda, torch.bfloat16, "sdpa")
    assert choice.name == "xformers" and "compute capability 7.5" in choice.reason


def test_forced_torch_varlen_that_cannot_run_names_the_variable(monkeypatch, stand_in_kernel):
    monkeypatch.setenv(attention.ENV_BACKEND, "torch_varlen")
    with pytest.raises(ValueError, match=f"{attention.ENV_BACKEND}=torch_varlen cannot run here: .*CUDA"):
        choose_backend(torch.device("cpu"), torch.bfloat16, "sdpa")
    stand_in_kernel("torch_varlen", None)
    with pytest.raises(ValueError, match=f"{attention.ENV_BACKEND}=torch_varlen cannot run here: .*varlen_attn"):
        choose_backend(torch.device("cuda"), torch.bfloat16, "sdpa")


# ---------------------------------------------------------------------------------------------------------------------
# Model families' quirks, module level: the real attention module of a tiny model, packed, against the same module
# run on each sample alone with transformers' own eager attention of that family
# ---------------------------------------------------------------------------------------------------------------------

_QUIRK_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=64,
    max_position_embeddings=256,
    initializer_range=0.2,  # large enough that softcapping and sinks change the output visibly
)
# model_type -> config overrides. Layer 0 and layer 1 differ where the family mixes layer kinds.
QUIRK_FAMILIES = {
    # logit softcapping, query_pre_attn_scalar scaling, sliding window on layer 0 only
    "gemma2": dict(head_dim=16, sliding_window=6, attn_logit_softcapping=1.0, query_pre_attn_scalar=24),
    # q/k norms, query_pre_attn_scalar scaling, sliding window on layer 0 only
    "gemma3_text": dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=24, sliding_window_pattern=2),
    # attention sinks (s_aux), sliding window on layer 0 only
    "gpt_oss": dict(
        head_dim=16, sliding_window=6, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=131072
    ),
    # MLA: query/key head dim 12 + 8 = 20, value head dim 12
    "deepseek_v3": dict(
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
    ),
    # GQA, layer_types: full attention on layer 0, sliding window on layer 1
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
}
QUIRK_LENGTHS = [9, 3, 14, 1, 7]
_PACKED_IMPLEMENTATION = "unpack_quirk_test"


@functools.cache
def quirk_model(model_type: str) -> torch.nn.Module:
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    AttentionInterface.register(_PACKED_IMPLEMENTATION, make_attention_function("sdpa"))
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**_QUIRK_COMMON, **QUIRK_FAMILIES[model_type]})
    model = AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if hasattr(module, "sinks"):
            with torch.no_grad():
                module.sinks.normal_(0.0, 2.0)  # visible sinks (the tiny model initialises them near 0)
    return model


def eager_mask(length: int, sliding_window: int | None) -> torch.Tensor:
    """(1, 1, L, L) additive mask of one sample from transformers' own mask functions, as its eager path uses."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    function = causal_mask_function if sliding_window is None else sliding_window_causal_mask_function(sliding_window)
    i = torch.arange(length).view(length, 1)
    j = torch.arange(length).view(1, length)
    allowed = function(0, 0, i, j)
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min).view(1, 1, length, length)


def run_quirk_layer(model_type: str, layer: int, packed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward + backward of one attention layer over the packed row (or each sample alone, eager): the output
    (1, T, hidden) and the gradients of the input and every parameter of the layer."""
    model = quirk_model(model_type)
    decoder = model.model
    attention_module = decoder.layers[layer].self_attn
    config = attention_module.config
    total = sum(QUIRK_LENGTHS)
    generator = torch.Generator().manual_seed(layer)
    hidden = torch.randn(1, total, config.hidden_size, generator=generator).requires_grad_()
    upstream = torch.randn(1, total, config.hidden_size, generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in QUIRK_LENGTHS]).unsqueeze(0)
    rotary_options = {}
    if "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters:
        rotary_options["layer_type"] = config.layer_types[layer]
    cos, sin = decoder.rotary_emb(hidden, position_ids, **rotary_options)
    original = config._attn_implementation
    attention_module.zero_grad(set_to_none=True)
    try:
        if packed:
            config._attn_implementation = _PACKED_IMPLEMENTATION
            lengths = torch.tensor(QUIRK_LENGTHS, dtype=torch.int32)
            out, _ = attention_module(hidden, (cos, sin), None, packed_seq_lengths=lengths)
        else:
            config._attn_implementation = "eager"
            outputs, start = [], 0
            window = getattr(attention_module, "sliding_window", None)
            for length in QUIRK_LENGTHS:
                span = slice(start, start + length)
                part, _ = attention_module(hidden[:, span], (cos[:, span], sin[:, span]), eager_mask(length, window))
                outputs.append(part)
                start += length
            out = torch.cat(outputs, dim=1)
    finally:
        config._attn_implementation = original
    (out * upstream).sum().backward()
    gradients = [hidden.grad] + [p.grad.clone() for p in attention_module.parameters()]
    return out.detach(), gradients


@pytest.fixture
def quirk_backend(request, monkeypatch, stand_in_kernel):
    """Sets up one backend for the packed run: ``eager`` forced, ``sdpa`` the automatic CPU choice, or a kernel
    backend (flash-attn, torch varlen, xformers) as the automatic choice with a stand-in kernel on the CPU."""
    backend = request.param
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    monkeypatch.setattr(_logging, "_logged", set())
    if backend == "eager":
        monkeypatch.setenv(attention.ENV_BACKEND, "eager")
    if backend in ("flash", "torch_varlen", "xformers"):
        flash = StandInFlash() if backend == "flash" else None
        varlen = make_stand_in_varlen([]) if backend == "torch_varlen" else None
        fmha = make_fake_xformers({}) if backend == "xformers" else None
        full = (torch.float16, torch.bfloat16, torch.float32)
        stand_in_kernel("flash", flash, cpu=True, dtypes=full)
        stand_in_kernel("torch_varlen", varlen, cpu=True, dtypes=full)
        stand_in_kernel("xformers", fmha, cpu=True)
    return backend


# What each automatic backend hands over: softcap (gemma2) to flash-attn or eager, sinks (gpt_oss) to eager.
_HANDED_OVER = {("gemma2", "sdpa"), ("gemma2", "torch_varlen"), ("gemma2", "xformers")}
_HANDED_OVER |= {("gpt_oss", backend) for backend in ("sdpa", "flash", "torch_varlen", "xformers")}


@pytest.mark.parametrize("quirk_backend", ["eager", "sdpa", "flash", "torch_varlen", "xformers"], indirect=True)
@pytest.mark.parametrize("model_type", list(QUIRK_FAMILIES))
def test_family_quirks_match_eager_per_sample(model_type, quirk_backend, monkeypatch):
    ran = spy_backends(monkeypatch)
    for layer in (0, 1):
        expected, expected_grads = run_quirk_layer(model_type, layer, packed=False)
        got, got_grads = run_quirk_layer(model_type, layer, packed=True)
        assert_close_to_reference(got, expected)
        assert len(got_grads) == len(expected_grads)
        for g, e in zip(got_grads, expected_grads):
            assert_close_to_reference(g, e)
    handed_over = (model_type, quirk_backend) in _HANDED_OVER
    assert set(ran) == {"eager" if handed_over else quirk_backend}


def test_family_quirks_change_the_output():
    """The quirks the family test covers are not no-ops on these tiny models: without softcapping or sinks the
    output moves far beyond the test's tolerance."""
    for model_type, attribute, neutral in (("gemma2", "attn_logit_softcapping", None), ("gpt_oss", "sinks", None)):
        module = quirk_model(model_type).model.layers[1].self_attn
        with_quirk, _ = run_quirk_layer(model_type, 1, packed=False)
        saved = getattr(module, attribute)
        if attribute == "sinks":
            del module.sinks
            module.sinks = torch.nn.Parameter(torch.full_like(saved, -1e4))  # exp(-1e4) == 0: no sink
        else:
            setattr(module, attribute, neutral)
        try:
            without, _ = run_quirk_layer(model_type, 1, packed=False)
        finally:
            if attribute == "sinks":
                module.sinks = saved
            else:
                setattr(module, attribute, saved)
        assert (with_quirk - without).abs().max() > 1e-2 * with_quirk.abs().max()


@pytest.mark.parametrize(("model_type", "backend"), [("gemma2", "sdpa"), ("gpt_oss", "sdpa"), ("gpt_oss", "eager")])
def test_family_quirks_on_a_forced_backend_that_cannot(model_type, backend, monkeypatch):
    if backend == "eager":  # eager can apply everything: forcing it is fine
        monkeypatch.setenv(attention.ENV_BACKEND, backend)
        run_quirk_layer(model_type, 0, packed=True)
        return
    monkeypatch.setenv(attention.ENV_BACKEND, backend)
    with pytest.raises(ValueError, match=f"{attention.ENV_BACKEND}={backend} cannot apply attention"):
        run_quirk_layer(model_type, 0, packed=True)


# ---------------------------------------------------------------------------------------------------------------------
# The real kernels (CUDA only)
# ---------------------------------------------------------------------------------------------------------------------


def _force_available_backend(backend, device, monkeypatch):
    """Skip unless ``backend``'s kernel runs on ``device``, then force it through the environment variable."""
    if backend == "flash":
        pytest.importorskip("flash_attn")
    if backend == "xformers":
        pytest.importorskip("xformers")
    reason = attention.backend_unavailable_reason(backend, torch.device(device), torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(attention.ENV_BACKEND, backend)


def _cases(cuda_backends, cpu_backends=("sdpa", "eager")):
    """``(backend, device)`` parameters: the CUDA ones marked ``gpu``, the same test body on the CPU for the
    backends that run there (so the test itself, its reference included, is exercised without a GPU)."""
    cuda = [pytest.param(b, "cuda", marks=pytest.mark.gpu, id=f"{b}-cuda") for b in cuda_backends]
    return cuda + [pytest.param(b, "cpu", id=f"{b}-cpu") for b in cpu_backends]


def _check_fwd_bwd_against_reference(backend, device, monkeypatch, lengths, *, options, **shape):
    """bf16 packed attention on ``device`` (forward and backward) against the float64 reference built on the same
    device: within a few bf16 ulps (2e-2 of the largest output, 5e-2 of the largest gradient)."""
    _force_available_backend(backend, device, monkeypatch)
    q, k, v = random_qkv(lengths, dtype=torch.bfloat16, device=device, **shape)
    out, _ = packed_attention_forward(FakeModule(), q, k, v, None, **options, **info_kwargs(lengths))
    upstream = torch.randn_like(out)
    (out.float() * upstream.float()).sum().backward()
    got = grads([q, k, v])
    for t in (q, k, v):
        t.grad = None
    reference_options = {"window" if key == "sliding_window" else key: value for key, value in options.items()}
    reference_options = {"alibi" if key == "alibi_slopes" else key: value for key, value in reference_options.items()}
    expected = reference(q, k, v, lengths, **reference_options)
    (expected.float() * upstream.float()).sum().backward()
    assert out.shape == expected.shape and out.device == expected.device
    assert_close_to_reference(out.float(), expected.float(), rel=2e-2)
    for g, e in zip(got, grads([q, k, v])):
        assert_close_to_reference(g.float(), e.float(), rel=5e-2)


REAL_LENGTHS = [40, 1, 97, 3, 64, 11]


@pytest.mark.parametrize(("backend", "device"), _cases(["flash", "torch_varlen", "xformers", "flex", "sdpa", "eager"]))
@pytest.mark.parametrize("window", [None, 16])
def test_real_kernels(backend, device, window, monkeypatch):
    _check_fwd_bwd_against_reference(
        backend,
        device,
        monkeypatch,
        REAL_LENGTHS,
        options={"scaling": 0.125, "sliding_window": window},
        heads=8,
        kv_heads=2,
        dim=64,
    )


@pytest.mark.parametrize(
    ("backend", "device"), _cases(["flash", "torch_varlen", "xformers", "flex", "sdpa"], ["sdpa"])
)
@pytest.mark.parametrize(("dim", "v_dim"), [(192, 128), (20, 12)])
def test_real_kernels_value_head_dim(backend, device, dim, v_dim, monkeypatch):
    """MLA shapes (deepseek_v3: 192 / 128) and head dims that are not a multiple of 8, on the real kernels."""
    if backend == "flex" and min(dim, v_dim) < 16:
        # A reason, not inductor's crash: the forced choice is refused and the automatic one skips flex.
        q, k, v = random_qkv(REAL_LENGTHS, heads=8, kv_heads=2, dim=dim, v_dim=v_dim, device=device)
        with pytest.raises(
            ValueError, match=f"cannot apply head_dim {min(dim, v_dim)} \\(its kernel takes at least 16\\)"
        ):
            packed_attention_forward(FakeModule(), q, k, v, None, backend="flex", **info_kwargs(REAL_LENGTHS))
        return
    _check_fwd_bwd_against_reference(
        backend,
        device,
        monkeypatch,
        REAL_LENGTHS,
        options={"scaling": dim**-0.5, "sliding_window": 16},
        heads=8,
        kv_heads=2,
        dim=dim,
        v_dim=v_dim,
    )


@pytest.mark.parametrize(("dim", "v_dim"), [(12, 12), (32, 12), (12, 32)])
def test_flex_refuses_head_dims_below_its_kernels_limit(dim, v_dim, monkeypatch):
    """Compiled flex takes query, key and value head dims of 16 or more: a smaller one is a reason (a forced choice
    is refused, naming the dim and the limit), never inductor's NYI crash inside a training step."""
    q, k, v = random_qkv(REAL_LENGTHS, heads=4, kv_heads=2, dim=dim, v_dim=v_dim)
    message = "cannot apply head_dim 12 \\(its kernel takes at least 16\\)"
    with pytest.raises(ValueError, match=message):
        packed_attention_forward(FakeModule(), q, k, v, None, backend="flex", **info_kwargs(REAL_LENGTHS))
    monkeypatch.setenv(attention.ENV_BACKEND, "flex")
    with pytest.raises(ValueError, match=message):
        attention.choose_backend(
            torch.device("cpu"), torch.float32, "sdpa", Needs(head_dim=max(dim, v_dim), min_head_dim=12)
        )
    assert not REGISTRY["flex"].cannot_apply(Needs(head_dim=32, min_head_dim=16))


@pytest.mark.parametrize(("backend", "device"), _cases(["flash", "flex", "sdpa", "eager"]))
def test_real_kernels_alibi(backend, device, monkeypatch):
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(8)], device=device)
    _check_fwd_bwd_against_reference(
        backend,
        device,
        monkeypatch,
        REAL_LENGTHS,
        options={"scaling": 0.125, "alibi_slopes": slopes},
        heads=8,
        kv_heads=8,
        dim=64,
    )


def test_reference_builds_on_the_inputs_device():
    """The float64 reference of the ``gpu`` tests never mixes a CPU tensor into inputs on another device: run on
    ``meta`` tensors (any CPU tensor mixed in raises), every option on."""
    lengths = [5, 1, 7]
    q, k, v = (torch.empty(sum(lengths), h, 8, device="meta") for h in (4, 2, 2))
    meta = torch.empty(4, device="meta")
    out = reference_tokens(q, k, v, lengths, scaling=0.3, window=3, softcap=2.0, sinks=meta, alibi=meta)
    assert out.device.type == "meta" and out.shape == (13, 4, 8)


def test_flash_accumulator_head_dim_rounding():
    assert [varlen_common.rounded_head_dim(d) for d in (8, 32, 100, 128, 160, 256)] == [32, 32, 128, 128, 192, 256]


# ---------------------------------------------------------------------------------------------------------------------
# Chunked attention (llama4): chunks counted from each sample's start, on every backend
# ---------------------------------------------------------------------------------------------------------------------


def test_chunked_cuts_each_sample_from_its_start():
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([5, 2], dtype=torch.int32), batch_size=1, seq_len=7)
    chunked = info.chunked(2)
    assert chunked.seq_lengths.tolist() == [2, 2, 1, 2] and chunked.cu_seqlens.tolist() == [0, 2, 4, 5, 7]
    assert info.chunked(2) is chunked  # cached on the batch's metadata
    assert info.chunked(5) is info  # no sample longer than a chunk
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive number of tokens, got 0"):
        info.chunked(0)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_chunked_attention_equals_attention_over_the_chunks(backend):
    lengths, chunk = [7, 3, 9, 1], 3
    q, k, v = random_qkv(lengths)
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.3, backend=backend, attention_chunk_size=chunk, **info_kwargs(lengths)
    )
    pieces = [min(chunk, n - start) for n in lengths for start in range(0, n, chunk)]
    assert pieces == [3, 3, 1, 3, 3, 3, 3, 1]
    assert_close_to_reference(out.detach(), reference(q, k, v, pieces, scaling=0.3).detach())


# ---------------------------------------------------------------------------------------------------------------------
# ALiBi (bloom, mpt): the bias counts distance within a sample
# ---------------------------------------------------------------------------------------------------------------------

ALIBI_SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flash"])
@pytest.mark.parametrize(("window", "kv_heads"), [(None, 2), (4, 4)])
def test_alibi_per_sample(backend, window, kv_heads, cpu_kernels, monkeypatch):
    """SDPA buckets, eager and flash-attn's ``alibi_slopes`` (a stand-in kernel on the CPU) == dense per-sample
    attention with ``-slope * (i - j)`` counted within each sample."""
    flash = StandInFlash()
    cpu_kernels("flash", flash)
    lengths = [7, 1, 12, 3, 9]
    q, k, v = random_qkv(lengths, kv_heads=kv_heads)
    out, _ = packed_attention_forward(
        FakeModule(),
        q,
        k,
        v,
        None,
        scaling=0.3,
        sliding_window=window,
        backend=backend,
        alibi_slopes=ALIBI_SLOPES,
        **info_kwargs(lengths),
    )
    expected = reference(q, k, v, lengths, scaling=0.3, window=window, alibi=ALIBI_SLOPES)
    assert_close_to_reference(out.detach(), expected.detach())
    assert (backend == "flash") == bool(flash.calls)
    if flash.calls:
        assert flash.calls[0]["alibi_slopes"].dtype == torch.float32
    # Without the bias the result differs: the slopes are applied.
    plain = reference(q, k, v, lengths, scaling=0.3, window=window)
    assert (plain - expected).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["xformers", "torch_varlen"])
def test_alibi_on_a_backend_that_cannot(backend, monkeypatch):
    lengths = [4, 3]
    q, k, v = random_qkv(lengths)
    with pytest.raises(ValueError, match=f"backend='{backend}' cannot apply ALiBi position biases; use 'flash'"):
        packed_attention_forward(
            FakeModule(), q, k, v, None, backend=backend, alibi_slopes=ALIBI_SLOPES, **info_kwargs(lengths)
        )
    with pytest.raises(ValueError, match="needs one slope per query head \\(4\\), got 2"):
        packed_attention_forward(FakeModule(), q, k, v, None, alibi_slopes=ALIBI_SLOPES[:2], **info_kwargs(lengths))


def test_alibi_hands_over_from_a_kernel_that_cannot(cpu_kernels, monkeypatch):
    """The automatic choice skips xformers (no ALiBi) for SDPA, and says so once."""
    cpu_kernels("flash", None)
    cpu_kernels("xformers", object())
    lengths = [5, 4]
    q, k, v = random_qkv(lengths)
    assert attention.choose_backend(torch.device("cpu"), torch.float32, "sdpa").name == "xformers"
    choice = attention.choose_backend(torch.device("cpu"), torch.float32, "sdpa", Needs({AttentionFeature.ALIBI}))
    assert choice.name == "sdpa" and "xformers cannot apply ALiBi position biases" in choice.reason


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "sdpa", "eager"])
def test_real_kernels_alibi_on_cuda(backend, monkeypatch):
    _force_available_backend(backend, "cuda", monkeypatch)
    lengths = [40, 1, 97, 3, 64, 11]
    q, k, v = random_qkv(lengths, heads=8, kv_heads=8, dim=64, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(8)], device="cuda")
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.125, alibi_slopes=slopes, **info_kwargs(lengths)
    )
    upstream = torch.randn_like(out)
    (out.float() * upstream.float()).sum().backward()
    got = grads([q, k, v])
    for t in (q, k, v):
        t.grad = None
    expected = reference(q, k, v, lengths, scaling=0.125, alibi=slopes)
    (expected.float() * upstream.float()).sum().backward()
    assert_close_to_reference(out.float(), expected.float(), rel=2e-2)
    for g, e in zip(got, grads([q, k, v])):
        assert_close_to_reference(g.float(), e.float(), rel=5e-2)
