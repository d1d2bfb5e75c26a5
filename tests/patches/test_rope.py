"""RoPE: the torch reference against transformers, the fused Triton kernel against the reference, the dispatch.

Kernel tests run on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``, set per test by the
``interpret`` fixture: the kernel module wraps its kernel with ``triton.jit`` per interpreter setting at launch time,
so the variable need not be set before Triton is imported). Shapes stay small because the interpreter is slow.
Tolerances follow flash-attention's habit: the kernel's error against an fp32 reference must stay within a small
multiple of the error of transformers' own computation in the same dtype.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from unpack_trainer._compat import hub_kernel_function
from unpack_trainer.patches import rope
from unpack_trainer.patches.rope import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_torch,
    fused_apply_rotary_pos_emb,
    fused_rotary_pos_emb_from_cache,
    rope_cache,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def force_kernel(monkeypatch, interpret):
    """``UNPACK_ROPE=triton`` and a count of kernel launches made through the drop-in."""
    monkeypatch.setenv("UNPACK_ROPE", "triton")
    calls = []
    launch = rope._launch

    def counting_launch(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(rope, "_launch", counting_launch)
    return calls


def packed_position_ids(batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, seq_len) int64 positions restarting at 0 at random sample boundaries (several samples per row)."""
    rows = []
    for _ in range(batch):
        starts = torch.zeros(seq_len, dtype=torch.bool)
        starts[0] = True
        starts[torch.randint(1, max(seq_len, 2), (max(seq_len // 6, 1),), generator=generator)] = True
        sample_index = starts.cumsum(0) - 1
        first = torch.nonzero(starts).flatten()
        rows.append(torch.arange(seq_len) - first[sample_index])
    return torch.stack(rows)


def default_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def cos_sin(position_ids: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What LlamaRotaryEmbedding (default rope) returns: (B, T, D) cos/sin in ``dtype``."""
    freqs = position_ids[..., None].float() * default_inv_freq(head_dim)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_qk(batch, heads, kv_heads, seq_len, head_dim, dtype, layout, generator):
    """q (B, H, T, D), k (B, H_kv, T, D) views in the requested memory layout, values in ``dtype``.

    ``bhtd``: contiguous. ``projection``: (B, T, H, D) memory transposed, as the model's q_proj(...).view().transpose()
    gives. ``strided``: every other element of a wider tensor along D (non-unit innermost stride).
    """

    def one(h):
        if layout == "bhtd":
            return torch.randn(batch, h, seq_len, head_dim, generator=generator).to(dtype)
        if layout == "projection":
            return torch.randn(batch, seq_len, h, head_dim, generator=generator).to(dtype).transpose(1, 2)
        if layout == "strided":
            return torch.randn(batch, h, seq_len, 2 * head_dim, generator=generator).to(dtype)[..., ::2]
        raise ValueError(layout)

    return one(heads), one(kv_heads)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item()


def assert_close_to_fp32(out, torch_out, fp32_out, dtype, what):
    """The kernel's error against fp32 is at most twice transformers' same-dtype error (plus fp32 rounding slack)."""
    for name, a, b, c in zip(("q", "k"), out, torch_out, fp32_out):
        kernel_err, torch_err = max_err(a, c), max_err(b, c)
        slack = 1e-5 if dtype == torch.float32 else 0.0
        assert kernel_err <= 2 * torch_err + slack, f"{what} {name}: kernel {kernel_err:.3g} vs torch {torch_err:.3g}"


# --------------------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_reference_is_bitwise_transformers(dtype, unsqueeze_dim):
    g = torch.Generator().manual_seed(0)
    q, k = make_qk(2, 4, 2, 12, 16, dtype, "projection", g)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos_sin(packed_position_ids(2, 12, g), 16, dtype)
    ours = apply_rotary_pos_emb_torch(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    theirs = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_drop_in_accepts_transformers_calls():
    # transformers 5.25 with `kernels`: the global is a module made of the function (hub_kernel_function reads it)
    theirs = inspect.signature(hub_kernel_function(modeling_llama.apply_rotary_pos_emb)).parameters
    ours = inspect.signature(apply_rotary_pos_emb).parameters
    assert list(ours)[:4] == list(theirs)[:4] == ["q", "k", "cos", "sin"]
    assert ours["unsqueeze_dim"].default == theirs["unsqueeze_dim"].default == 1
    assert ours["position_ids"].default is None


def test_rotation_by_hand():
    """Position 0 leaves q unchanged; a quarter turn maps (x1, x2) to (-x2, x1) in every frequency pair."""
    q = torch.tensor([[[[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]]])  # (1, 1, 2, 4)
    cos = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]])
    sin = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])
    q_embed, _ = apply_rotary_pos_emb_torch(q, q, cos, sin)
    assert torch.equal(q_embed, torch.tensor([[[[1.0, 2.0, 3.0, 4.0], [-3.0, -4.0, 1.0, 2.0]]]]))


# ------------------------------------------------------------------------------------------------ kernel vs reference

SHAPES = [
    # (batch, heads, kv_heads, seq_len, head_dim)
    (1, 4, 4, 37, 64),  # multi-head, T not a multiple of the token block
    (2, 4, 2, 24, 80),  # grouped-query, non-power-of-two head_dim
    (2, 6, 2, 16, 96),  # head count not a power of two
    (1, 2, 1, 9, 256),  # multi-query, largest head_dim
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference_forward_and_backward(interpret, shape, dtype):
    batch, heads, kv_heads, seq_len, head_dim = shape
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    q, k = make_qk(batch, heads, kv_heads, seq_len, head_dim, dtype, "projection", g)
    cos, sin = cos_sin(packed_position_ids(batch, seq_len, g), head_dim, dtype)
    grads = (torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype))

    def run(fn, q, k, cos, sin):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = fn(q, k, cos, sin)
        return out, torch.autograd.grad(out, (q, k), grads)

    kernel_out, kernel_grads = run(fused_apply_rotary_pos_emb, q, k, cos, sin)
    torch_out, torch_grads = run(apply_rotary_pos_emb_torch, q, k, cos, sin)
    fp32_out, fp32_grads = run(apply_rotary_pos_emb_torch, q.float(), k.float(), cos.float(), sin.float())

    for out, ref in zip(kernel_out + kernel_grads, torch_out + torch_grads):
        assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    assert_close_to_fp32(kernel_out, torch_out, fp32_out, dtype, "forward")
    assert_close_to_fp32(kernel_grads, torch_grads, fp32_grads, dtype, "backward")
    if dtype == torch.float32:
        torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kernel_grads, torch_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tile", [64, 128])
def test_kernel_loops_over_head_blocks(interpret, monkeypatch, tile):
    """Small tiles force several head blocks per program (the last one partly masked) and one token per block."""
    monkeypatch.setenv("UNPACK_ROPE_TILE", str(tile))
    g = torch.Generator().manual_seed(10)
    q, k = make_qk(2, 6, 3, 13, 64, torch.float32, "projection", g)
    cos, sin = cos_sin(packed_position_ids(2, 13, g), 64, torch.float32)
    grads = (torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g))
    q_req, k_req = q.detach().requires_grad_(), k.detach().requires_grad_()
    out = fused_apply_rotary_pos_emb(q_req, k_req, cos, sin)
    ref = apply_rotary_pos_emb_torch(q, k, cos, sin)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    q_ref, k_ref = q.detach().requires_grad_(), k.detach().requires_grad_()
    ref_grads = torch.autograd.grad(apply_rotary_pos_emb_torch(q_ref, k_ref, cos, sin), (q_ref, k_ref), grads)
    torch.testing.assert_close(torch.autograd.grad(out, (q_req, k_req), grads), ref_grads, rtol=1e-5, atol=1e-6)


def test_bad_tile_is_an_error(interpret, monkeypatch):
    monkeypatch.setenv("UNPACK_ROPE_TILE", "100")
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="UNPACK_ROPE_TILE='100' must be a power of two"):
        fused_apply_rotary_pos_emb(q, q, torch.ones(1, 2, 4), torch.zeros(1, 2, 4))


@pytest.mark.parametrize(
    "arch, dtype, gather, backward, index",
    [(80, "bf16", False, False, "i32"), (90, "fp32", True, True, "i64")],
    ids=["sm80-bf16-fwd", "sm90-fp32-gather-bwd-int64"],
)
def test_kernel_compiles_for_cuda_without_a_gpu(arch, dtype, gather, backward, index):
    """The interpreter accepts code the compiler may reject: compile the real kernel to a cubin (no GPU needed). In a
    process of its own: the test session imports Triton's language under the interpreter on a machine without a GPU
    (tests/conftest.py, for Liger-Kernel's kernels), which some Triton releases cannot compile a kernel against."""
    pytest.importorskip("triton.compiler")
    script = f"{inspect.getsource(_compile_to_cubin)}\nprint(_compile_to_cubin({arch}, {dtype!r}, {gather}, {backward}, {index!r}))"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = proc.stdout.strip().splitlines()[-1]
    if result.startswith("skip: "):
        pytest.skip(result.removeprefix("skip: "))
    assert result == "cubin", result


def _compile_to_cubin(arch: int, dtype: str, gather: bool, backward: bool, index: str) -> str:
    """Compile the RoPE kernel ahead of time for ``sm_<arch>``: ``"cubin"``, or ``"skip: <why>"``."""
    import triton
    from triton import compiler
    from triton.backends import compiler as backends

    if not hasattr(compiler, "ASTSource") or not hasattr(backends, "GPUTarget"):
        return "skip: this Triton has no ahead-of-time compile entry point"
    from unpack_trainer.patches import rope_kernel

    kernel = rope_kernel._kernel(interpret=False)
    block_t, block_hq, block_hk, block_half = rope_kernel._block_sizes(4096, 32, 8, 64)
    constexprs = dict(
        NUM_HEADS=32,
        NUM_KV_HEADS=8,
        HALF_DIM=64,
        GATHER=gather,
        BACKWARD=backward,
        BLOCK_T=block_t,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
    )
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "pos_ptr":
            signature[name] = "*i64" if gather else f"*{dtype}"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = index
    try:
        compiled = triton.compile(
            compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
            target=backends.GPUTarget("cuda", arch, 32),
            options={"num_warps": 4, "enable_fp_fusion": True},
        )
    except RuntimeError as error:  # e.g. no ptxas for this CUDA target in the wheel
        if "ptxas" in str(error).lower():
            return f"skip: cannot assemble for sm_{arch} here: {error}"
        raise
    return "cubin" if compiled.asm["cubin"] else "no cubin"


@pytest.mark.parametrize("layout", ["bhtd", "projection", "strided"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2, -2])
def test_kernel_layouts(interpret, layout, unsqueeze_dim):
    g = torch.Generator().manual_seed(1)
    q, k = make_qk(2, 4, 2, 20, 32, torch.float32, layout, g)
    cos, sin = cos_sin(packed_position_ids(2, 20, g), 32, torch.float32)
    if unsqueeze_dim in (2, -2):  # the (B, T, H, D) convention
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q_embed, k_embed = fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    ref = apply_rotary_pos_emb_torch(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    torch.testing.assert_close((q_embed, k_embed), ref, rtol=1e-5, atol=1e-6)
    # Whatever the input layout, the result is (B, T, H, D)-dense: the projections' layout, which the attention
    # kernels read token-major without a copy.
    if unsqueeze_dim == 1:
        q_embed, k_embed = q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    assert q_embed.is_contiguous() and k_embed.is_contiguous()


def test_kernel_broadcast_cos_sin_over_batch(interpret):
    """(1, T, D) cos/sin (one shared position row) broadcast over a batch of 3, as transformers allows."""
    g = torch.Generator().manual_seed(2)
    q, k = make_qk(3, 2, 1, 16, 16, torch.float32, "bhtd", g)
    cos, sin = cos_sin(torch.arange(16)[None], 16, torch.float32)
    out = fused_apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(out, apply_rotary_pos_emb_torch(q, k, cos, sin), rtol=1e-5, atol=1e-6)


def test_kernel_zero_stride_and_missing_gradients(interpret):
    g = torch.Generator().manual_seed(3)
    q0, k0 = make_qk(2, 4, 2, 16, 32, torch.float32, "projection", g)
    cos, sin = cos_sin(packed_position_ids(2, 16, g), 32, torch.float32)

    def grads(fn, loss_of):
        q, k = q0.detach().requires_grad_(), k0.detach().requires_grad_()
        loss_of(*fn(q, k, cos, sin)).backward()
        return q.grad, k.grad

    # .sum() hands backward an expanded (all-zero-stride) gradient.
    for loss_of in (lambda qe, ke: qe.sum() + ke.sum(), lambda qe, ke: qe.sum() + 2 * ke.sum()):
        ours, ref = grads(fused_apply_rotary_pos_emb, loss_of), grads(apply_rotary_pos_emb_torch, loss_of)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)

    # Only q_embed reaches the loss: k gets no gradient, as with the reference.
    ours = grads(fused_apply_rotary_pos_emb, lambda qe, ke: (qe * qe).sum())
    ref = grads(apply_rotary_pos_emb_torch, lambda qe, ke: (qe * qe).sum())
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    assert ours[1] is None and ref[1] is None
    ours = grads(fused_apply_rotary_pos_emb, lambda qe, ke: (ke * ke).sum())
    ref = grads(apply_rotary_pos_emb_torch, lambda qe, ke: (ke * ke).sum())
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-5)
    assert ours[0] is None and ref[0] is None

    # An explicitly expanded gradient passed to autograd.grad.
    q, k = q0.detach().requires_grad_(), k0.detach().requires_grad_()
    out = fused_apply_rotary_pos_emb(q, k, cos, sin)
    expanded = (torch.full((), 0.5).expand(q.shape), torch.full((1, 1, 1, 32), -1.0).expand(k.shape))
    dq, dk = torch.autograd.grad(out, (q, k), expanded)
    ref_out = apply_rotary_pos_emb_torch(q, k, cos, sin)
    rq, rk = torch.autograd.grad(ref_out, (q, k), tuple(e.contiguous() for e in expanded))
    torch.testing.assert_close((dq, dk), (rq, rk), rtol=1e-5, atol=1e-6)


def test_kernel_promotes_like_torch(interpret):
    """Under autocast the model's cos/sin are fp32 while q/k are bf16: torch's q * cos is fp32, so is the kernel's;
    gradients come back in q's dtype."""
    g = torch.Generator().manual_seed(11)
    q, k = make_qk(2, 4, 2, 16, 32, torch.bfloat16, "projection", g)
    cos, sin = cos_sin(packed_position_ids(2, 16, g), 32, torch.float32)
    grads = (torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g))

    def run(fn, q, k):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = fn(q, k, cos, sin)
        return out, torch.autograd.grad(out, (q, k), grads)

    kernel_out, kernel_grads = run(fused_apply_rotary_pos_emb, q, k)
    torch_out, torch_grads = run(apply_rotary_pos_emb_torch, q, k)
    fp32_out, fp32_grads = run(apply_rotary_pos_emb_torch, q.float(), k.float())
    assert [t.dtype for t in kernel_out + kernel_grads] == [t.dtype for t in torch_out + torch_grads]
    assert kernel_out[0].dtype == torch.float32 and kernel_grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-6)
    assert_close_to_fp32(kernel_grads, torch_grads, fp32_grads, torch.bfloat16, "backward")


def test_autocast_mixed_dtypes_take_the_kernel_in_the_attention_dtype(force_kernel):
    """Issue 26 item 5, decided: bf16 q/k with the fp32 cos/sin of an autocast step are the kernel's common case, not
    a fallback. It computes in fp32 and writes bf16, the dtype attention computes in under that autocast (torch's
    promotion gives fp32, which attention casts back to bf16): the same values as the reference cast to bf16, half
    the bytes written. Gradients come back in bf16."""
    g = torch.Generator().manual_seed(12)
    q, k = make_qk(2, 4, 2, 16, 32, torch.bfloat16, "projection", g)
    cos, sin = cos_sin(packed_position_ids(2, 16, g), 32, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q_req, k_req = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = apply_rotary_pos_emb(q_req, k_req, cos, sin)
        reference = apply_rotary_pos_emb_torch(q, k, cos, sin)
    assert force_kernel == [1]
    assert [t.dtype for t in out] == [torch.bfloat16] * 2 and [t.dtype for t in reference] == [torch.float32] * 2
    for ours, exact in zip(out, reference):  # the fp32 reference rounded once to bf16: equal up to one bf16 ulp
        torch.testing.assert_close(ours, exact.to(torch.bfloat16), rtol=2**-7, atol=1e-6)
    dq, dk = torch.autograd.grad(out, (q_req, k_req), (torch.ones_like(out[0]), torch.ones_like(out[1])))
    assert dq.dtype == dk.dtype == torch.bfloat16
    # Outside autocast the same inputs keep torch's promotion, as transformers.
    assert apply_rotary_pos_emb(q, k, cos, sin)[0].dtype == torch.float32


def test_kernel_does_not_mutate_inputs(interpret):
    g = torch.Generator().manual_seed(4)
    q, k = make_qk(1, 2, 2, 8, 16, torch.float32, "projection", g)
    cos, sin = cos_sin(torch.arange(8)[None], 16, torch.float32)
    before = [t.clone() for t in (q, k, cos, sin)]
    fused_apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, cos, sin)))


# ----------------------------------------------------------------------------------------- gather from a cos/sin cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32], ids=str)
def test_cache_gather_matches_reference(interpret, dtype, pos_dtype):
    g = torch.Generator().manual_seed(5)
    batch, seq_len, head_dim, max_position = 2, 40, 64, 48
    q, k = make_qk(batch, 4, 2, seq_len, head_dim, dtype, "projection", g)
    position_ids = packed_position_ids(batch, seq_len, g)
    cos_cache, sin_cache = cos_sin(torch.arange(max_position)[None], head_dim, dtype)
    cos_cache, sin_cache = cos_cache[0], sin_cache[0]

    q_req, k_req = q.detach().requires_grad_(), k.detach().requires_grad_()
    out = fused_rotary_pos_emb_from_cache(q_req, k_req, cos_cache, sin_cache, position_ids.to(pos_dtype))
    ref = apply_rotary_pos_emb_torch(q, k, cos_cache[position_ids], sin_cache[position_ids])
    per_token = fused_apply_rotary_pos_emb(q, k, cos_cache[position_ids], sin_cache[position_ids])
    # Same cos/sin values, same arithmetic: the gathered path equals the per-token path exactly.
    assert torch.equal(out[0], per_token[0]) and torch.equal(out[1], per_token[1])
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1.6e-2}
    torch.testing.assert_close(out, ref, **tol)

    gq, gk = torch.ones_like(q), torch.ones_like(k)
    dq, dk = torch.autograd.grad(out, (q_req, k_req), (gq, gk))
    q_ref, k_ref = q.detach().requires_grad_(), k.detach().requires_grad_()
    ref = apply_rotary_pos_emb_torch(q_ref, k_ref, cos_cache[position_ids], sin_cache[position_ids])
    torch.testing.assert_close((dq, dk), torch.autograd.grad(ref, (q_ref, k_ref), (gq, gk)), **tol)


def test_cache_gather_broadcast_positions_and_bshd(interpret):
    g = torch.Generator().manual_seed(6)
    q, k = make_qk(3, 2, 2, 12, 16, torch.float32, "bhtd", g)
    position_ids = packed_position_ids(1, 12, g)  # one row shared by the batch
    cos_cache, sin_cache = (t[0] for t in cos_sin(torch.arange(16)[None], 16, torch.float32))
    out = fused_rotary_pos_emb_from_cache(
        q.transpose(1, 2), k.transpose(1, 2), cos_cache, sin_cache, position_ids, unsqueeze_dim=2
    )
    ref = apply_rotary_pos_emb_torch(q, k, cos_cache[position_ids], sin_cache[position_ids])
    torch.testing.assert_close((out[0].transpose(1, 2), out[1].transpose(1, 2)), ref, rtol=1e-5, atol=1e-6)


def test_cache_gather_rejects_out_of_range_positions(interpret):
    q = k = torch.zeros(1, 1, 4, 8)
    cos_cache = sin_cache = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"position_ids\[0, 3\] = 7 is outside the cos/sin cache of 4 positions"):
        fused_rotary_pos_emb_from_cache(q, k, cos_cache, sin_cache, torch.tensor([[0, 1, 2, 7]]))
    with pytest.raises(ValueError, match=r"position_ids\[0, 1\] = -1"):
        fused_rotary_pos_emb_from_cache(q, k, cos_cache, sin_cache, torch.tensor([[0, -1, 2, 3]]))


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda p: p["rope_type"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_cache_reproduces_the_models_cos_sin(rope_parameters, dtype):
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=rope_parameters
    )
    rotary = LlamaRotaryEmbedding(config)
    position_ids = packed_position_ids(2, 100, torch.Generator().manual_seed(7))
    cos, sin = rotary(torch.empty(0, dtype=dtype), position_ids)
    cos_cache, sin_cache = rope_cache(rotary, 128, dtype=dtype)
    assert cos_cache.shape == (128, 16) and cos_cache.dtype == dtype
    assert torch.equal(cos_cache[position_ids], cos) and torch.equal(sin_cache[position_ids], sin)
    if rope_parameters["rope_type"] == "yarn":  # attention scaling is part of the model's cos/sin and of the cache
        assert rotary.attention_scaling != 1.0


def test_rope_cache_refuses_batch_dependent_rope():
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    )
    with pytest.raises(ValueError, match="'dynamic' chooses its frequencies"):
        rope_cache(LlamaRotaryEmbedding(config), 32)


# ------------------------------------------------------------------------------------------------------------ dispatch


def test_auto_uses_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("UNPACK_ROPE", raising=False)
    monkeypatch.setattr(rope, "_launch", lambda *a, **k: pytest.fail("kernel launched for CPU tensors"))
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    cos, sin = cos_sin(torch.arange(4)[None], 8, torch.float32)
    out = apply_rotary_pos_emb(q, k, cos, sin)
    ref = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_forced_torch_never_launches(monkeypatch, interpret):
    monkeypatch.setenv("UNPACK_ROPE", "torch")
    monkeypatch.setattr(rope, "_launch", lambda *a, **k: pytest.fail("kernel launched under UNPACK_ROPE=torch"))
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    cos, sin = cos_sin(torch.arange(4)[None], 8, torch.float32)
    apply_rotary_pos_emb(q, k, cos, sin)


def test_forced_triton_runs_the_kernel_and_rejects_what_it_cannot_do(force_kernel):
    g = torch.Generator().manual_seed(8)
    q, k = make_qk(1, 2, 1, 8, 16, torch.float32, "projection", g)
    cos, sin = cos_sin(torch.arange(8)[None], 16, torch.float32)
    out = apply_rotary_pos_emb(q, k, cos, sin, None, 1)
    assert len(force_kernel) == 1
    torch.testing.assert_close(out, apply_rotary_pos_emb_torch(q, k, cos, sin), rtol=1e-5, atol=1e-6)

    with pytest.raises(ValueError, match="UNPACK_ROPE=triton.*q and k in one dtype"):
        apply_rotary_pos_emb(q.bfloat16(), k, cos, sin)
    with pytest.raises(ValueError, match="require grad"):
        apply_rotary_pos_emb(q, k, cos.requires_grad_(), sin)
    with pytest.raises(ValueError, match="odd"):
        apply_rotary_pos_emb(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])


def test_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("UNPACK_ROPE", "cuda")
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="UNPACK_ROPE='cuda' is not supported; use one of auto, torch, triton"):
        apply_rotary_pos_emb(q, q, torch.ones(1, 2, 4), torch.zeros(1, 2, 4))


def test_cpu_kernel_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_apply_rotary_pos_emb(q, q, torch.ones(1, 2, 4), torch.zeros(1, 2, 4))


def test_import_needs_no_triton():
    """Importing needs no Triton and never imports it; the CPU path works; the kernel says why it cannot run."""
    code = (
        "import sys\n"
        "import torch\n"
        "from unpack_trainer.patches import rope\n"
        "assert 'triton' not in sys.modules, 'importing rope imported triton'\n"
        "sys.modules['triton'] = None  # from here on, `import triton` fails as if it were not installed\n"
        "from unpack_trainer.patches import rope_kernel\n"
        "q = torch.randn(1, 2, 3, 4); cos = torch.ones(1, 3, 4); sin = torch.zeros(1, 3, 4)\n"
        "assert torch.equal(rope.apply_rotary_pos_emb(q, q, cos, sin)[0], q)\n"
        "assert not rope.triton_available()\n"
        "try:\n"
        "    rope_kernel.rotary_qk(q, q, cos, sin)\n"
        "except RuntimeError as e:\n"
        "    assert 'needs Triton' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("UNPACK_ROPE", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------------------ whole model


def test_llama_logits_and_grads_with_kernel_equal_reference(monkeypatch, force_kernel):
    """A packed row through a tiny Llama whose ``apply_rotary_pos_emb`` is ours, forced onto the kernel, vs the
    reference: same logits, same loss gradients."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    lengths = [7, 12, 5, 8]
    input_ids = torch.randint(0, 128, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]

    def run():
        model.zero_grad()
        out = model(input_ids=input_ids, position_ids=position_ids, labels=input_ids)
        out.loss.backward()
        return out.logits.detach(), [p.grad.clone() for p in model.parameters()]

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    kernel_logits, kernel_grads = run()
    assert len(force_kernel) == 2  # one launch per layer: the kernel really ran
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", apply_rotary_pos_emb_torch)
    ref_logits, ref_grads = run()
    torch.testing.assert_close(kernel_logits, ref_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(kernel_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------- benchmark


def test_benchmark_dry_run(interpret):
    """The benchmark's timing and table code on CPU tensors through the interpreter, at one tiny size."""
    spec = importlib.util.spec_from_file_location("bench_rope", REPO / "benchmarks" / "bench_rope.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run_cases(
        seqlens=[24],
        layouts=["packed", "unpacked"],
        dtypes=["float32"],
        device="cpu",
        heads=4,
        kv_heads=2,
        head_dim=16,
        warmup=1,
        rep=2,
    )
    assert [row["layout"] for row in rows] == ["packed", "unpacked"]
    for row in rows:
        assert row["torch_fwd_us"] > 0 and row["kernel_fwd_us"] > 0 and row["max_abs_diff"] < 1e-5
    assert bench.format_rows(rows).count("\n") == 3


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(4, 32, 8, 1000, 128)], ids=str)
def test_cuda_kernel_matches_reference(monkeypatch, shape, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("UNPACK_ROPE", raising=False)
    batch, heads, kv_heads, seq_len, head_dim = shape
    g = torch.Generator().manual_seed(9)
    q, k = (t.cuda() for t in make_qk(batch, heads, kv_heads, seq_len, head_dim, dtype, "projection", g))
    cos, sin = (t.cuda() for t in cos_sin(packed_position_ids(batch, seq_len, g), head_dim, dtype))
    grads = (torch.randn_like(q), torch.randn_like(k))

    def run(fn, q, k, cos, sin):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = fn(q, k, cos, sin)
        return out, torch.autograd.grad(out, (q, k), tuple(gr.to(q.dtype) for gr in grads))

    launches = []
    launch = rope._launch
    monkeypatch.setattr(rope, "_launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    kernel = run(apply_rotary_pos_emb, q, k, cos, sin)  # auto: the kernel on CUDA
    assert launches == [1]
    reference = run(apply_rotary_pos_emb_torch, q, k, cos, sin)
    fp32 = run(apply_rotary_pos_emb_torch, q.float(), k.float(), cos.float(), sin.float())
    assert_close_to_fp32(kernel[0], reference[0], fp32[0], dtype, "forward")
    assert_close_to_fp32(kernel[1], reference[1], fp32[1], dtype, "backward")


@pytest.mark.gpu
def test_cuda_autocast_mixed_dtypes_run_the_kernel_in_bf16(monkeypatch):
    """The decision of issue 26 item 5 on the GPU: bf16 q/k with fp32 cos/sin (every autocast step) launch the kernel,
    which writes bf16 (the dtype attention computes in there); without autocast, torch's fp32 promotion."""
    monkeypatch.delenv("UNPACK_ROPE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launches = []
    launch = rope._launch
    monkeypatch.setattr(rope, "_launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    q = torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.bfloat16)
    cos, sin = (t.cuda() for t in cos_sin(torch.arange(8)[None], 16, torch.float32))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = apply_rotary_pos_emb(q, q, cos, sin)
    reference = apply_rotary_pos_emb_torch(q, q, cos, sin)
    assert launches == [1] and out[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], reference[0].to(torch.bfloat16), rtol=2**-7, atol=1e-6)
    assert apply_rotary_pos_emb(q, q, cos, sin)[0].dtype == torch.float32 and launches == [1, 1]


@pytest.mark.gpu
def test_cuda_int64_offsets():
    """More than 2**31 elements in q: offsets past int32 must not wrap."""
    free, _ = torch.cuda.mem_get_info()
    batch, heads, seq_len, head_dim = 1, 64, 2**18 + 64, 128  # 2**31 + 2**19 elements
    if free < 3 * batch * heads * seq_len * head_dim * 2:
        pytest.skip("not enough GPU memory")
    q = torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(batch, seq_len, 1, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    position_ids = torch.arange(seq_len, device="cuda")[None] % 4096
    cos_cache, sin_cache = (t[0].cuda() for t in cos_sin(torch.arange(4096)[None], head_dim, torch.bfloat16))
    q_embed, _ = fused_rotary_pos_emb_from_cache(q, k, cos_cache, sin_cache, position_ids)
    tail = slice(seq_len - 64, seq_len)
    q_ref, _ = apply_rotary_pos_emb_torch(
        q[:, :, tail], k[:, :, tail], cos_cache[position_ids[:, tail]], sin_cache[position_ids[:, tail]]
    )
    assert q.numel() > 2**31
    torch.testing.assert_close(q_embed[:, :, tail], q_ref, rtol=1.6e-2, atol=1.6e-2)
