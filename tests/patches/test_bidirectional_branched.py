"""Bidirectional spans (``PackedSeqInfo.bidirectional_spans``: Gemma 3's image tokens) on branched rows (shared
prompts, ``seq_parents``): a query sees what it sees on the branched row (its own sample causally, its prefix in a
branch, never a sibling) or any key of its own span. Flex, SDPA and eager apply them exactly (outputs and gradients
against a float64 reference with the dense mask) on their branch plans and on the ``[prefix; branch]`` units; flex's
block mask stays exact across its 128-token blocks; the varlen kernels, which cannot apply them, are handed over from
or refused with the reason, as on plain rows."""

from __future__ import annotations

import logging

import pytest
import torch
from flex_block_masks import effective_mask

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention import ENV_BACKEND, packed_attention_forward
from unpack_trainer.patches.attention import flex as flex_backend

HAS_FLEX = flex_backend.BACKEND.kernel.get() is not None

# Prompt 0 (150 tokens, a span across flex's 128-token block boundary) with three branches of different lengths
# (the first with a span, queried with the prompt; the second with a short span; the third with a span at its end);
# a sample without branches with a span; prompt 5 (a 2-token span) with two branches (the second with a span), the
# first without one.
CONTIGUOUS = (
    [150, 60, 25, 33, 70, 40, 30, 45],
    [-1, 0, 0, 0, -1, -1, 5, 5],
    [[20, 140], [160, 190], [212, 220], [250, 268], [273, 298], [340, 342], [420, 430]],
)
# The first branch of prompt 0 is not right after it (a sample in between): SDPA and eager run the units path.
APART = (
    [150, 70, 60, 25, 33],
    [-1, -1, 0, 0, 0],
    [[20, 140], [150, 200], [230, 260], [285, 295], [330, 338]],
)
LAYOUTS = {"contiguous": CONTIGUOUS, "first branch apart": APART}


class FakeModule(torch.nn.Module):
    is_causal = True


def make_info(layout: str) -> PackedSeqInfo:
    lengths, parents, spans = LAYOUTS[layout]
    info = PackedSeqInfo.from_seq_lengths(
        torch.tensor(lengths), batch_size=1, seq_len=sum(lengths), seq_parents=torch.tensor(parents)
    )
    return info.with_bidirectional_spans(torch.tensor(spans))


def reference_mask(info: PackedSeqInfo, window: int | None) -> torch.Tensor:
    """``(N, N)`` bool over the row, from the samples directly: a query sees the earlier keys of its own sample and,
    in a branch, every key of its prefix (never a sibling's), or any key of its own span; with a window only keys less
    than ``window`` positions back (a branch's positions continue its prefix's)."""
    lengths, total = info.seq_lengths.tolist(), info.total_tokens
    parents = info.seq_parents.tolist()
    starts = info.cu_seqlens.tolist()
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, length, parent in zip(starts, lengths, parents):
        allowed[start : start + length, start : start + length] = torch.ones(length, length, dtype=torch.bool).tril()
        if parent >= 0:
            allowed[start : start + length, starts[parent] : starts[parent] + lengths[parent]] = True
    for start, end in info.bidirectional_spans.tolist():
        allowed[start:end, start:end] = True
    if window is not None:
        positions = info.position_ids().reshape(-1)
        allowed &= positions.unsqueeze(1) - positions.unsqueeze(0) < window
    return allowed


def reference(q, k, v, info, *, scaling, window):
    """float64 dense attention with :func:`reference_mask`; (1, H, T, D) in, (1, T, H, Dv) out."""
    groups = q.shape[1] // k.shape[1]
    qs, ks, vs = q[0].double(), k[0].double().repeat_interleave(groups, 0), v[0].double().repeat_interleave(groups, 0)
    scores = (qs @ ks.transpose(1, 2)) * scaling
    scores = scores.masked_fill(~reference_mask(info, window).to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ vs).transpose(0, 1).unsqueeze(0)


def random_qkv(total, heads=4, kv_heads=2, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, total, dim, generator=generator).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    error = float((got.detach().double() - want.detach()).abs().max() / want.detach().abs().max())
    assert error <= 1e-5, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
def test_spans_on_branched_rows_match_the_dense_reference(backend, layout, window):
    if backend == "flex" and not HAS_FLEX:
        pytest.skip("this torch has no flex_attention")
    info = make_info(layout)
    q, k, v = random_qkv(info.total_tokens)
    expected = reference(q, k, v, info, scaling=0.3, window=window)
    options = dict(scaling=0.3, sliding_window=window, backend=backend, packed_seq_info=info)
    if backend == "flex":  # forward only on the CPU
        with torch.no_grad():
            out, _ = packed_attention_forward(FakeModule(), q, k, v, None, **options)
        assert_close(out, expected, "out")
        return
    out, _ = packed_attention_forward(FakeModule(), q, k, v, None, **options)
    assert_close(out, expected, "out")
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    want = torch.autograd.grad((expected * upstream.double()).sum(), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert_close(g, w, f"d{name}")


def test_the_layouts_take_the_paths_they_test():
    """The contiguous layout runs SDPA and eager on their branch plan, with masks on a causal unit and on a later
    branch's bucket; the other one has no branch plan (the ``[prefix; branch]`` units run)."""
    from unpack_trainer.patches.attention.bucket_masks import bidirectional_mask, branch_mask
    from unpack_trainer.patches.buckets import branch_plan

    cpu = torch.device("cpu")
    assert branch_plan(make_info("first branch apart"), cpu) is None
    info = make_info("contiguous")
    plan = branch_plan(info, cpu)
    causal = [(i, b) for i, b in enumerate(plan.buckets) if not b.key_length]
    branches = [(i, b) for i, b in enumerate(plan.buckets) if b.key_length]
    assert causal and branches
    assert any(bidirectional_mask(info, i, b, None, cpu) is not None for i, b in causal)
    # a later branch's keys: the relaxation reaches a key after the query (bottom-right causal would not)
    for index, bucket in branches:
        allowed = branch_mask(info, index, bucket, None, cpu)
        position = (bucket.key_lengths - bucket.query_lengths).view(-1, 1, 1, 1) + torch.arange(bucket.length).view(
            1, 1, -1, 1
        )
        later = allowed & (torch.arange(bucket.key_length).view(1, 1, 1, -1) > position)
        later &= torch.arange(bucket.length).view(1, 1, -1, 1) < bucket.query_lengths.view(-1, 1, 1, 1)
        assert later.any()


def test_branch_units_carry_the_spans_of_each_unit():
    """On the units path a prefix's span is in every unit holding the prefix, a branch's in its own unit only."""
    lengths, parents = [4, 2, 3, 1, 3], [-1, 0, 0, -1, 0]
    info = PackedSeqInfo.from_seq_lengths(
        torch.tensor(lengths), batch_size=1, seq_len=sum(lengths), seq_parents=torch.tensor(parents)
    ).with_bidirectional_spans(torch.tensor([[1, 3], [7, 9], [10, 13]]))
    unit_info, gather, owner = info.branch_units()
    # units [p c] [p r] [p b] [x]: slots 0-5, 6-12, 13-19, 20
    assert unit_info.seq_lengths.tolist() == [6, 7, 7, 1]
    assert gather.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 6, 7, 8, 0, 1, 2, 3, 10, 11, 12, 9]
    assert unit_info.bidirectional_spans.tolist() == [[1, 3], [7, 9], [11, 13], [14, 16], [17, 20]]
    assert not unit_info.is_branched


def test_with_bidirectional_spans_keeps_the_branches():
    """Branched samples take spans inside one sample (a prompt's or a branch's), keep their parents and positions;
    a span across a prompt and its branch, empty, or overlapping another is an error naming it."""
    info = PackedSeqInfo(torch.tensor([3, 2, 2]), batch_size=1, seq_len=7, seq_parents=torch.tensor([-1, 0, 0]))
    spanned = info.with_bidirectional_spans(torch.tensor([[0, 2], [3, 5], [6, 7]]))
    assert spanned is not info and spanned.is_branched
    assert spanned.seq_parents.tolist() == [-1, 0, 0]
    assert torch.equal(spanned.position_ids(), info.position_ids())
    assert spanned.bidirectional_ids().tolist() == [0, 0, -1, 1, 1, -1, 2]
    for bad, index in (([[2, 4]], 0), ([[0, 2], [1, 3]], 1), ([[4, 4]], 0), ([[1, 2], [4, 6]], 1)):
        with pytest.raises(ValueError, match=f"Bidirectional span {index} "):
            info.with_bidirectional_spans(torch.tensor(bad))


def test_varlen_kernels_hand_over_or_refuse_spans_on_branched_rows(monkeypatch, caplog, stand_in_kernel):
    """A branched row with spans: the automatic choice hands flash-attn's layers to SDPA, exactly; a forced varlen
    kernel is refused with the reason, as on plain rows."""
    stand_in_kernel("flash", object(), cpu=True, dtypes=(torch.float32,))
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    info = make_info("contiguous")
    q, k, v = random_qkv(info.total_tokens)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        out, _ = packed_attention_forward(
            FakeModule(), q, k, v, None, scaling=0.3, original_implementation="sdpa", packed_seq_info=info
        )
    assert "flash cannot apply bidirectional image blocks; using sdpa" in caplog.text
    assert_close(out, reference(q, k, v, info, scaling=0.3, window=None), "out")
    for forced in ("flash", "torch_varlen", "xformers"):
        with pytest.raises(ValueError, match=f"{forced}.* cannot apply bidirectional image blocks"):
            packed_attention_forward(FakeModule(), q, k, v, None, scaling=0.3, backend=forced, packed_seq_info=info)


@pytest.mark.skipif(not HAS_FLEX, reason="this torch has no flex_attention")
@pytest.mark.parametrize("window", [None, 1, 5, 100])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flex_block_mask_with_spans_on_branched_rows_is_exact(layout, window):
    """Full blocks are wholly allowed and partial blocks cover every allowed pair (a span's later keys, a prefix's
    keys) on a branched row; padding is seen by no real token."""
    info = make_info(layout)
    effective = effective_mask(info, window)
    total = info.total_tokens
    assert torch.equal(effective[:total, :total], reference_mask(info, window))
    assert not effective[:total, total:].any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLEX, reason="this torch has no flex_attention")
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flex_forward_and_backward_with_spans_on_branched_rows_on_cuda(layout, window):
    """The compiled kernel on CUDA, float32: output and q / k / v gradients against the float64 dense reference."""
    info = make_info(layout)
    q, k, v = (x.detach().cuda().requires_grad_() for x in random_qkv(info.total_tokens))
    out, _ = packed_attention_forward(
        FakeModule(), q, k, v, None, scaling=0.3, sliding_window=window, backend="flex", packed_seq_info=info
    )
    expected = reference(q, k, v, info, scaling=0.3, window=window)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).cuda()
    got = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    want = torch.autograd.grad((expected * upstream.double()).sum(), (q, k, v))
    for name, g, w in [("out", out, expected), *zip(("dq", "dk", "dv"), got, want)]:
        error = float((g.detach().double() - w.detach()).abs().max() / w.detach().abs().max())
        assert error <= 1e-3, f"{name}: relative error {error:.2e}"  # TF32 allowed on CUDA
