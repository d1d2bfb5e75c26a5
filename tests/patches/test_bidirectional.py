"""Bidirectional spans (``PackedSeqInfo.bidirectional_spans``: Gemma 3's image tokens attend to each other both ways)
on every packed attention backend: flex, SDPA and eager apply them exactly (outputs and gradients against a float64
reference with the dense mask), flex's block mask stays exact across its 128-token blocks, and the varlen kernels,
which cannot apply them, are handed over from or refused with the reason."""

from __future__ import annotations

import pytest
import torch
from flex_block_masks import effective_mask

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention import (
    ENV_BACKEND,
    AttentionFeature,
    Needs,
    choose_backend,
    packed_attention_forward,
)
from unpack_trainer.patches.attention import flex as flex_backend

HAS_FLEX = flex_backend.BACKEND.kernel.get() is not None

# Samples of 300, 7, 140 and 60 tokens; spans inside them, one across flex's 128-token block boundary, one a
# whole short sample, one at a sample's end.
LENGTHS = [300, 7, 140, 60]
SPANS = [[10, 14], [100, 230], [300, 307], [400, 447]]


class FakeModule(torch.nn.Module):
    is_causal = True


def make_info(lengths=LENGTHS, spans=SPANS) -> PackedSeqInfo:
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=sum(lengths))
    return info.with_bidirectional_spans(torch.tensor(spans))


def reference_mask(info: PackedSeqInfo, window: int | None) -> torch.Tensor:
    """``(N, N)`` bool: a query sees the earlier keys of its sample and every key of its own span; with a window only
    keys ``j > i - window``."""
    total = info.total_tokens
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, end in zip(info.cu_seqlens[:-1].tolist(), info.cu_seqlens[1:].tolist()):
        block = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        allowed[start:end, start:end] = block
    for start, end in info.bidirectional_spans.tolist():
        allowed[start:end, start:end] = True
    if window is not None:
        i = torch.arange(total).unsqueeze(1)
        j = torch.arange(total).unsqueeze(0)
        allowed &= j > i - window
    return allowed


def reference(q, k, v, info, *, scaling, window):
    """float64 dense attention with :func:`reference_mask`; (1, H, T, D) in, (1, T, H, Dv) out."""
    groups = q.shape[1] // k.shape[1]
    qs, ks, vs = q[0].double(), k[0].double().repeat_interleave(groups, 0), v[0].double().repeat_interleave(groups, 0)
    scores = (qs @ ks.transpose(1, 2)) * scaling
    scores = scores.masked_fill(~reference_mask(info, window), float("-inf"))
    return (scores.softmax(-1) @ vs).transpose(0, 1).unsqueeze(0)


def random_qkv(total, heads=4, kv_heads=2, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, total, dim, generator=generator).requires_grad_() for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
def test_spans_on_each_backend_match_the_dense_reference(backend, window):
    if backend == "flex" and not HAS_FLEX:
        pytest.skip("this torch has no flex_attention")
    info = make_info()
    q, k, v = random_qkv(info.total_tokens)
    expected = reference(q, k, v, info, scaling=0.3, window=window)
    if backend == "flex":  # forward only on the CPU
        with torch.no_grad():
            out, _ = packed_attention_forward(
                FakeModule(), q, k, v, None, scaling=0.3, sliding_window=window, backend=backend, packed_seq_info=info
            )
        assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
        return
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.3, sliding_window=window, backend=backend, packed_seq_info=info
    )
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    want = torch.autograd.grad((expected * upstream.double()).sum(), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert (g.double() - w).abs().max() <= 1e-5 * w.abs().max(), f"d{name}"


@pytest.mark.skipif(not HAS_FLEX, reason="this torch has no flex_attention")
@pytest.mark.parametrize("window", [None, 1, 100])
def test_flex_block_mask_with_spans_is_exact(window):
    """Full blocks are wholly allowed and partial blocks cover every allowed pair (a span's later keys included)."""
    info = make_info()
    effective = effective_mask(info, window)
    total = info.total_tokens
    assert torch.equal(effective[:total, :total], reference_mask(info, window))


def test_buckets_without_a_span_stay_causal():
    """SDPA builds a mask only for the buckets that hold a span; the others run ``is_causal``."""
    from unpack_trainer.patches.attention.bucket_masks import bidirectional_mask
    from unpack_trainer.patches.buckets import attention_plan

    info = make_info([5, 300, 6], [[1, 3]])
    plan = attention_plan(info, torch.device("cpu"))
    masks = [
        bidirectional_mask(info, index, bucket, None, torch.device("cpu")) for index, bucket in enumerate(plan.buckets)
    ]
    holding = [index for index, bucket in enumerate(plan.buckets) if 0 in bucket.samples.tolist()]
    assert [m is not None for m in masks] == [index in holding for index in range(len(plan.buckets))]


def test_varlen_kernels_cannot_apply_spans(monkeypatch, stand_in_kernel):
    """The automatic choice takes a backend that can; a forced varlen kernel is refused with the reason."""
    stand_in_kernel("flash", object(), cpu=True, dtypes=(torch.float32,))
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    cpu = torch.device("cpu")
    assert choose_backend(cpu, torch.float32, "sdpa").name == "flash"
    spans = Needs({AttentionFeature.BIDIRECTIONAL})
    assert choose_backend(cpu, torch.float32, "sdpa", spans).name == "sdpa"
    for forced in ("flash", "torch_varlen", "xformers"):
        monkeypatch.setenv(ENV_BACKEND, forced)
        with pytest.raises(ValueError, match=f"{forced}.* cannot apply bidirectional image blocks"):
            choose_backend(cpu, torch.float32, "sdpa", spans)
    info = make_info()
    q, k, v = random_qkv(info.total_tokens)
    monkeypatch.delenv(ENV_BACKEND)
    with pytest.raises(ValueError, match="cannot apply bidirectional image blocks"):
        packed_attention_forward(FakeModule(), q, k, v, None, scaling=0.3, backend="flash", packed_seq_info=info)
