"""The flex_attention backend: its block mask (exact, built without any (N, N) tensor), its forward against the eager
backend on the CPU with every feature, the CPU backward refusal, the shape classes that let one compiled kernel serve
many batches; fwd + bwd of the compiled kernel on CUDA in the ``gpu`` tests."""

from __future__ import annotations

import pytest
import torch
from flex_block_masks import effective_mask

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention import (
    ENV_BACKEND,
    REGISTRY,
    AttentionFeature,
    Needs,
    choose_backend,
    packed_attention_forward,
)
from unpack_trainer.patches.attention import flex as flex_backend

pytestmark = pytest.mark.skipif(flex_backend.BACKEND.kernel.get() is None, reason="this torch has no flex_attention")


class FakeModule(torch.nn.Module):
    is_causal = True


def make_info(lengths, parents=None, rows=1):
    total = sum(lengths)
    return PackedSeqInfo.from_seq_lengths(
        torch.tensor(lengths), batch_size=rows, seq_len=total // rows, seq_parents=parents
    )


def reference_mask(info: PackedSeqInfo, window: int | None) -> torch.Tensor:
    """``(N, N)`` bool over the real tokens, from the samples directly: a query sees the earlier keys of its own
    sample and, in a branch, its prefix; with a window, only keys less than ``window`` positions back."""
    lengths, total = info.seq_lengths.tolist(), info.total_tokens
    parents = info.seq_parents.tolist() if info.is_branched else [-1] * len(lengths)
    starts = info.cu_seqlens.tolist()
    positions = info.position_ids().reshape(-1)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, length, parent in zip(starts, lengths, parents):
        for q in range(start, start + length):
            allowed[q, start : q + 1] = True
            if parent >= 0:
                allowed[q, starts[parent] : starts[parent] + lengths[parent]] = True
    if window is not None:
        allowed &= positions.unsqueeze(1) - positions.unsqueeze(0) < window
    return allowed


def lognormal_lengths(total: int, median: float, seed: int = 0) -> list[int]:
    """Lognormal sample lengths around ``median`` (at most 4 x it), the last one cut to make ``total`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(total, generator=generator) * 0.8).mul(median).round().clamp(1, 4 * median)
    lengths = draws.to(torch.int64)[: int(torch.searchsorted(draws.cumsum(0), float(total))) + 1].tolist()
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


LAYOUTS = {
    "plain": ([300, 1, 129, 40, 500, 54], None),
    "block aligned": ([128, 256, 128, 512], None),  # whole blocks: full blocks appear
    "branched": ([200, 150, 170, 37, 300, 10, 250], [-1, 0, 0, -1, -1, 4, 4]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", [None, 1, 100, 300])
def test_block_mask_is_exact(layout, window):
    """Full blocks are wholly allowed, partial blocks cover every allowed pair: the mask flex applies equals the
    samples' (causal, own sample plus prefix, window by position); every padding query sees a padding key."""
    lengths, parents = LAYOUTS[layout]
    info = make_info(lengths, parents)
    effective = effective_mask(info, window)
    total = info.total_tokens
    assert torch.equal(effective[:total, :total], reference_mask(info, window))
    assert not effective[:total, total:].any() and not effective[total:, :total].any()
    assert effective[total:, total:].any(dim=1).all()
    if layout == "block aligned" and window is None:
        assert int(flex_backend.block_mask(info, 1024, None, torch.device("cpu")).full_kv_num_blocks.sum()) > 0


class LargestTensor:
    """Records the largest tensor any torch operation creates while active (a dispatch mode)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for tensor in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(tensor, torch.Tensor):
                        recorder.largest = max(recorder.largest, tensor.numel())
                return out

        self.largest = 0
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def test_torch_create_block_mask_builds_a_dense_mask():
    """Why flex peaked at 44.8 GiB at 64k tokens with torch's ``create_block_mask`` (uncompiled): it evaluates the
    mask function on all N x N pairs, here at 4,096 tokens; the backend's block tables stay at (N / 128)**2."""
    from torch.nn.attention.flex_attention import create_block_mask

    info = make_info(lognormal_lengths(4096, median=250))
    doc = torch.repeat_interleave(torch.arange(info.num_seqs), info.seq_lengths.to(torch.int64))

    def documents(b, h, q, k):
        return (doc[q] == doc[k]) & (k <= q)

    with LargestTensor() as dense:
        create_block_mask(documents, None, None, 4096, 4096, device="cpu")
    with LargestTensor() as ours:
        flex_backend.block_mask(info, 4096, None, torch.device("cpu"))
    assert dense.largest >= 4096**2 and ours.largest <= 4 * (4096 // flex_backend.BLOCK_SIZE) ** 2 + 4096


def test_block_mask_of_64k_tokens_creates_no_quadratic_tensor():
    """Issue 26 item 3: the block tables of 65,536 tokens need (N / 128)**2 entries. Every tensor created while
    building the mask is recorded: none has more than 4 (N / 128)**2 elements (a dense mask: N**2 = 4.3e9)."""
    info = make_info(lognormal_lengths(65536, median=250))
    with LargestTensor() as spy:
        mask = flex_backend.block_mask(info, 65536, 4096, torch.device("cpu"))
    blocks = 65536 // flex_backend.BLOCK_SIZE
    assert mask.shape[-2:] == (65536, 65536)
    assert 65536 <= spy.largest <= 4 * blocks**2


def random_qkv(total, *, heads=4, kv_heads=2, dim=16, v_dim=None, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, h, total, d, generator=generator).to(device=device, dtype=dtype)
        for h, d in ((heads, dim), (kv_heads, dim), (kv_heads, v_dim or dim))
    ]


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SINKS = torch.tensor([0.3, -1.0, 2.0, 0.0])
FEATURES = {
    "causal": {},
    "window": {"sliding_window": 70},
    "softcap": {"softcap": 2.5},
    "sinks": {"s_aux": SINKS},
    "alibi": {"alibi_slopes": SLOPES},
    "chunked": {"attention_chunk_size": 96},
    "everything": {"sliding_window": 50, "softcap": 3.0, "s_aux": SINKS},
    "alibi window softcap": {"sliding_window": 50, "softcap": 3.0, "alibi_slopes": SLOPES},
}


@pytest.mark.parametrize("layout", ["plain", "branched"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_flex_forward_equals_eager_on_cpu(layout, feature):
    """Every feature our models use, on plain and branched (shared-prompt) batches: flex's output == eager's (the
    reference backend, itself checked against per-sample float64 attention in test_attention.py)."""
    lengths, parents = LAYOUTS[layout]
    info = make_info(lengths, parents)
    q, k, v = random_qkv(info.total_tokens, v_dim=32 if feature == "causal" else None)
    options = dict(scaling=0.3, packed_seq_info=info, **FEATURES[feature])
    with torch.no_grad():
        out, _ = packed_attention_forward(FakeModule(), q, k, v, None, backend="flex", **options)
        expected, _ = packed_attention_forward(FakeModule(), q, k, v, None, backend="eager", **options)
    assert out.shape == expected.shape
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()


def _softcap_runs(softcaps, call=lambda forward, *args, **kwargs: forward(*args, **kwargs)):
    """``packed_attention_forward`` on flex with each softcap in turn (through ``call``), each output against eager's."""
    info = make_info([70, 58])
    q, k, v = random_qkv(info.total_tokens)
    for softcap in softcaps:
        options = dict(scaling=0.3, packed_seq_info=info, softcap=softcap)
        with torch.no_grad():
            out, _ = call(packed_attention_forward, FakeModule(), q, k, v, None, backend="flex", **options)
            expected, _ = packed_attention_forward(FakeModule(), q, k, v, None, backend="eager", **options)
        assert (out - expected).abs().max() <= 1e-5 * expected.abs().max(), softcap


def test_flex_takes_one_softcap_after_another():
    """Two models with different softcaps in one process (Gemma 2's 50.0, a test's 2.5): torch 2.15's dynamo turns a
    float the score function captures into a symbolic float once it changes between calls, and flex's operator
    refuses it ("can only be of (Tensor, int, SymInt)") -- in the unfused forward (which compiles the operator) and
    in a user's ``torch.compile``. The softcap reaches the score function as a tensor."""
    _softcap_runs([2.5, 3.0, 4.0])


def test_flex_under_a_user_compile_takes_one_softcap_after_another():
    compiled = torch.compile(lambda forward, *args, **kwargs: forward(*args, **kwargs), backend="eager")
    _softcap_runs([2.5, 3.0, 4.0], call=compiled)


def test_flex_on_two_rows():
    """``B`` rows run as one row of ``B * T`` tokens: samples never cross rows, so the result is the same."""
    info = make_info([100, 60, 40, 120, 80], rows=2)
    q, k, v = (x.view(2, x.shape[1], 200, -1) for x in random_qkv(400))
    with torch.no_grad():
        out, _ = packed_attention_forward(FakeModule(), q, k, v, None, backend="flex", packed_seq_info=info)
        expected, _ = packed_attention_forward(FakeModule(), q, k, v, None, backend="eager", packed_seq_info=info)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_flex_refuses_backward_on_the_cpu_and_dropout():
    info = make_info([30, 20])
    q, k, v = (x.requires_grad_() for x in random_qkv(50))
    with pytest.raises(NotImplementedError, match="no backward on the CPU.*sdpa or eager"):
        packed_attention_forward(FakeModule(), q, k, v, None, backend="flex", packed_seq_info=info)
    with pytest.raises(ValueError, match="backend='flex' cannot apply attention dropout"):
        packed_attention_forward(FakeModule(), q, k, v, None, backend="flex", dropout=0.1, packed_seq_info=info)


def test_flex_is_chosen_on_cuda_for_what_varlen_kernels_cannot_apply(monkeypatch):
    """On CUDA, flex follows the varlen kernels and precedes SDPA's buckets (it ran 0.90x torch varlen in a training
    step on an H200, and it is the one kernel that applies softcap, sinks and ALiBi in one call); never automatic on
    the CPU (no flex backward there) nor for head dims its compiled kernel does not take;
    UNPACK_ATTENTION_BACKEND=flex runs it anywhere."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    varlen = REGISTRY["torch_varlen"]
    monkeypatch.setitem(REGISTRY, "torch_varlen", varlen._replace(kernel=None, requires=None))
    cuda = torch.device("cuda")
    softcap, sinks, alibi = AttentionFeature.SOFTCAP, AttentionFeature.SINKS, AttentionFeature.ALIBI
    for quirks in (set(), {softcap}, {sinks}, {alibi}):
        assert choose_backend(torch.device("cpu"), torch.bfloat16, "sdpa", Needs(quirks)).name != "flex"
    assert choose_backend(cuda, torch.bfloat16, "sdpa").name == "torch_varlen"
    for quirks in ({softcap}, {sinks}, {alibi}):
        choice = choose_backend(cuda, torch.bfloat16, "sdpa", Needs(quirks))
        assert choice.name == "flex", choice
    assert choose_backend(cuda, torch.bfloat16, "sdpa", Needs({softcap}, head_dim=8)).name == "eager"
    monkeypatch.setenv(ENV_BACKEND, "flex")
    assert choose_backend(torch.device("cpu"), torch.float32, "sdpa", Needs({softcap, sinks})).name == "flex"


def test_one_compiled_kernel_per_shape_class(monkeypatch):
    """Batches of 900 and 1,000 tokens share the shape class 1,024: the same block mask shapes, one compiled kernel
    (torch.compile stands in here, returning the eager kernel: compiling on a CPU takes a minute)."""
    assert flex_backend.padded_length(900) == flex_backend.padded_length(1000) == 1024
    compiled = []
    real_compile = torch.compile

    def stand_in_compile(function, **options):
        if function is not flex_backend.BACKEND.kernel.get():
            return real_compile(function, **options)  # flex's unfused path compiles its own pieces
        compiled.append(options)
        return function

    monkeypatch.setattr(flex_backend, "COMPILE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "compile", stand_in_compile)
    flex_backend._compiled.cache_clear()
    try:
        masks = []
        for lengths in ([500, 400], [300, 300, 400]):
            info = make_info(lengths)
            q, k, v = random_qkv(info.total_tokens)
            with torch.no_grad():
                packed_attention_forward(FakeModule(), q, k, v, None, backend="flex", packed_seq_info=info)
            masks.append(flex_backend.block_mask(info, 1024, None, torch.device("cpu")))
    finally:
        flex_backend._compiled.cache_clear()
    assert compiled == [{"dynamic": False}]
    assert masks[0].kv_indices.shape == masks[1].kv_indices.shape and masks[0].shape == masks[1].shape


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "branched"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_flex_forward_and_backward_on_cuda(layout, feature):
    """The compiled kernel on CUDA, bf16: output and q / k / v (and sinks) gradients within bf16's error of the eager
    backend run in float32 on the same inputs."""
    lengths, parents = LAYOUTS[layout]
    info = make_info(lengths, parents)
    inputs = [x.requires_grad_() for x in random_qkv(info.total_tokens, dim=64, dtype=torch.bfloat16, device="cuda")]
    options = {
        key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in FEATURES[feature].items()
    }
    results = {}
    for backend, dtype in (("flex", torch.bfloat16), ("eager", torch.float32)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        out, _ = packed_attention_forward(
            FakeModule(), *leaves, None, backend=backend, scaling=0.125, packed_seq_info=info, **options
        )
        weight = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
        (out.float() * weight).sum().backward()
        results[backend] = [out.float()] + [x.grad.float() for x in leaves]
    for name, got, want in zip(["out", "dq", "dk", "dv"], results["flex"], results["eager"]):
        error = (got - want).abs().max() / want.abs().max()
        assert error <= 3e-2, f"{layout} {feature} {name}: relative error {float(error):.2e}"


@pytest.mark.gpu
def test_flex_compiles_once_per_shape_class_on_cuda():
    """Three batches of one shape class: the compiled kernel is traced for the first only."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    frames = []
    for lengths in ([500, 400], [300, 300, 400], [1000]):
        info = make_info(lengths)
        inputs = [
            x.requires_grad_() for x in random_qkv(info.total_tokens, dim=64, dtype=torch.bfloat16, device="cuda")
        ]
        out, _ = packed_attention_forward(FakeModule(), *inputs, None, backend="flex", packed_seq_info=info)
        out.float().sum().backward()
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[0] >= 1 and frames[1] == frames[2] == frames[0]


@pytest.mark.gpu
def test_flex_memory_at_64k_tokens_stays_bounded():
    """Issue 26 item 3: fwd + bwd at 65,536 tokens (32 / 8 heads of 128, bf16) peaks far below the 44.8 GiB measured
    with a dense-built block mask: q, k, v, their gradients and the output are ~1.3 GiB."""
    info = make_info(lognormal_lengths(65536, median=400))
    inputs = [
        x.requires_grad_()
        for x in random_qkv(65536, heads=32, kv_heads=8, dim=128, dtype=torch.bfloat16, device="cuda")
    ]
    torch.cuda.reset_peak_memory_stats()
    out, _ = packed_attention_forward(FakeModule(), *inputs, None, backend="flex", packed_seq_info=info)
    out.float().sum().backward()
    assert torch.cuda.max_memory_allocated() < 8 * 2**30
