"""Triton kernel that applies rotary position embedding to Q and K in one launch, forward and backward.

Use it through :mod:`unpack_trainer.patches.rope`, which gives it transformers' ``apply_rotary_pos_emb`` signature and
falls back to the torch reference where it cannot run. This module imports torch and, if installed, Triton; it never
compiles or launches anything at import: the kernel is wrapped with ``triton.jit`` on its first launch (once per
``TRITON_INTERPRET`` setting, so one process can run the interpreter on CPU tensors and compiled code on CUDA).

Where the speed comes from. transformers computes ``q * cos + rotate_half(q) * sin`` and the same for ``k``: five
elementwise kernels per tensor (multiply, negate half, concatenate, multiply, add), together about ten passes over Q
and K through GPU memory in the forward and more in the backward, each a separate launch. This kernel reads Q, K and
the per-token cos/sin once and writes both results once, in a single launch for Q and K (backward: the same for the
two incoming gradients). One program owns ``BLOCK_T`` tokens of one batch row: it loads their cos/sin rows once and
rotates all query heads, then all key heads, of those tokens in head blocks, so the cos/sin read is shared by the
``H + H_kv`` heads and the transposed ``(B, T, H, D)`` projection output is read in order. The arithmetic is in fp32
with a single rounding, so fp16/bf16 results are at least as close to the exact value as transformers' (which rounds
after each of its three operations).

Taken from Liger-Kernel's ``liger_rotary_pos_emb`` (one program per token row, all heads of the token in one tile,
cos/sin loaded once per token), which measured faster at 2k-8k tokens on an H200 (benchmarks/bench_rope.py): the head counts and
the half head dim are compile-time constants (head loops unrolled, a third fewer launch arguments, less host time
per launch), and the outputs are written ``(B, T, H, D)``-dense without output strides. Unlike Liger's, the kernel
writes new tensors (the inputs are left alone), reads both halves of cos/sin (any cos/sin, not only
``cat(freqs, freqs)``) and its output dtype is chosen by the caller: :mod:`unpack_trainer.patches.rope` passes the
dtype attention will compute in (under autocast: bf16 q/k with fp32 cos/sin give bf16, computed in fp32 and rounded
once, half the bytes written of transformers' fp32 result).

Conventions: ``q`` is ``(B, H, T, D)`` and ``k`` is ``(B, H_kv, T, D)``, arbitrary strided views (zero strides
included), never copied; ``D`` is even and at most :data:`MAX_HEAD_DIM` (non-powers of two such as 80 or 96 are
masked); rotation pairs element ``i`` with ``i + D/2`` (the "rotate_half" convention of Llama, Mistral, Qwen2/3, not
the interleaved GPT-J one). Offsets are computed in int64, so tensors above 2**31 elements are safe.
``UNPACK_ROPE_TILE`` (power of two, default 1024) sets the elements per half-tile of a program, for tuning on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

try:  # Triton is optional: without it this module still imports, and launching raises a clear error.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised in a subprocess test
    triton = None
    tl = None

__all__ = ["MAX_HEAD_DIM", "TILE_ENV", "RotaryQKFunction", "rotary_qk"]

MAX_HEAD_DIM = 256
"""Largest head dimension the kernel accepts (one program holds a ``BLOCK_T x BLOCK_H x D/2`` tile per half)."""

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE_ENV = "UNPACK_ROPE_TILE"
"""Tuning knob read at each launch: elements per half-tile of one program (power of two, default 1024)."""


def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    seq_len,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_cb,
    stride_ct,
    stride_cd,
    stride_pb,
    stride_pt,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    GATHER: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program: tokens ``[pid_t * BLOCK_T, +BLOCK_T)`` of batch row ``pid_b``, all Q heads, then all K heads.

    Inputs are read through their strides; outputs are written ``(B, T, H, D)``-dense (each token's heads one after
    another, the layout of the projections and of the attention kernels' token-major view). cos and sin share one set
    of strides. ``GATHER``: cos/sin are ``(max_position, D)`` caches indexed by ``position_ids[b, t]``
    (``stride_cb`` unused); otherwise per-token ``(B, T, D)`` tensors (``stride_cb`` 0 broadcasts one row over the
    batch). ``BACKWARD``: apply the transposed rotation (``x`` is the incoming gradient, the result the input
    gradient). Head counts and the half head dim are compile-time constants (one compile per model shape), so the
    head loops unroll and no stride of the outputs is passed.
    """
    pid_t = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)

    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF).to(tl.int64)
    mask_t = offs_t < seq_len
    mask_d = offs_d < HALF_DIM
    mask_td = mask_t[:, None] & mask_d[None, :]

    if GATHER:
        pos = tl.load(pos_ptr + pid_b * stride_pb + offs_t * stride_pt, mask=mask_t, other=0).to(tl.int64)
        row = pos * stride_ct
    else:
        row = pid_b * stride_cb + offs_t * stride_ct
    first = row[:, None] + offs_d[None, :] * stride_cd
    # cos/sin rows loaded once per token, shared by the H + H_kv heads; both halves (any cos/sin, not only the
    # cat(freqs, freqs) of the usual rotary embeddings), math in fp32.
    cos1 = tl.load(cos_ptr + first, mask=mask_td, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + first + HALF_DIM * stride_cd, mask=mask_td, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + first, mask=mask_td, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + first + HALF_DIM * stride_cd, mask=mask_td, other=0.0).to(tl.float32)
    # Forward:  out1 = x1 * cos1 - x2 * sin1,  out2 = x2 * cos2 + x1 * sin2   (transformers' formula, cos/sin in full).
    # Backward: the transpose of that linear map: dx1 = g1 * cos1 + g2 * sin2,  dx2 = g2 * cos2 - g1 * sin1.
    if BACKWARD:
        mix1 = sin2
        mix2 = -sin1
    else:
        mix1 = -sin1
        mix2 = sin2
    cos1 = cos1[:, None, :]
    cos2 = cos2[:, None, :]
    mix1 = mix1[:, None, :]
    mix2 = mix2[:, None, :]

    t3 = offs_t[:, None, None]
    d3 = offs_d[None, None, :]
    mask_td3 = mask_t[:, None, None] & mask_d[None, None, :]
    token = pid_b * seq_len + t3  # row of the (B * T, H, D) outputs

    # All query heads, then all key heads (fewer of them under grouped-query attention): same tokens, same cos/sin.
    _rotate_heads(
        q_ptr, q_out_ptr, pid_b * stride_qb, stride_qh, stride_qt, stride_qd, token, t3, d3, mask_td3,
        cos1, cos2, mix1, mix2, NUM_HEADS, HALF_DIM, BLOCK_HQ,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, pid_b * stride_kb, stride_kh, stride_kt, stride_kd, token, t3, d3, mask_td3,
        cos1, cos2, mix1, mix2, NUM_KV_HEADS, HALF_DIM, BLOCK_HK,
    )  # fmt: skip


def _rotate_heads_of(
    x_ptr,
    out_ptr,
    row_offset,
    stride_h,
    stride_t,
    stride_d,
    token,
    t3,
    d3,
    mask_td3,
    cos1,
    cos2,
    mix1,
    mix2,
    NUM: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Heads ``[0, NUM)`` of one program's tokens, ``BLOCK_H`` at a time: ``x`` read through its strides (``row_offset``
    the batch row's), the rotation ``out1 = x1 * cos1 + x2 * mix1``, ``out2 = x2 * cos2 + x1 * mix2`` in fp32 (``mix``
    carries the sines' signs of the forward or the backward), ``out`` written ``(B, T, NUM, D)``-dense. The kernel's
    helper for its query heads and its key heads alike (``triton.jit``-wrapped with it: :func:`_kernel`)."""
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    for h_start in tl.static_range(0, NUM, BLOCK_H):
        h3 = (h_start + offs_h)[None, :, None]
        mask = mask_td3 & (h3 < NUM)
        src = x_ptr + row_offset + h3 * stride_h + t3 * stride_t + d3 * stride_d
        dst = out_ptr + (token * NUM + h3) * (2 * HALF_DIM) + d3
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF_DIM * stride_d, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, (x1 * cos1 + x2 * mix1).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF_DIM, (x2 * cos2 + x1 * mix2).to(out_ptr.dtype.element_ty), mask=mask)


# ``triton.jit`` reads TRITON_INTERPRET when it wraps a function (not when it launches it), so the kernel and its
# helper are wrapped on first use and kept per interpreter setting: the same process can run the interpreter on CPU
# tensors and the compiled kernel on CUDA tensors. The kernel calls the helper by the global name ``_rotate_heads``,
# read at each interpreted launch and at each compile: :func:`_kernel` points it at the wrapper of the setting asked.
_JITTED: dict[bool, tuple[Any, Any]] = {}
_rotate_heads: Any = None


def _interpreter_enabled() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _kernel(interpret: bool) -> Any:
    global _rotate_heads
    jitted = _JITTED.get(interpret)
    if jitted is None:
        jitted = _JITTED[interpret] = (triton.jit(_rope_qk_kernel), triton.jit(_rotate_heads_of))
    kernel, _rotate_heads = jitted
    return kernel


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tile() -> int:
    return _tile_of(os.environ.get(TILE_ENV, "1024"))


@functools.lru_cache(maxsize=8)
def _tile_of(value: str) -> int:
    tile = int(value) if value.isdigit() else 0
    if tile < 64 or tile & (tile - 1):
        raise ValueError(f"{TILE_ENV}={value!r} must be a power of two of at least 64")
    return tile


@functools.lru_cache(maxsize=256)
def _block_sizes(
    seq_len: int, num_heads: int, num_kv_heads: int, half_dim: int, tile: int = 1024
) -> tuple[int, int, int, int]:
    """Tile sizes ``(BLOCK_T, BLOCK_HQ, BLOCK_HK, BLOCK_HALF)``: ``BLOCK_HALF`` covers ``D/2``; a head block holds at
    most ``tile`` elements per half; ``BLOCK_T`` grows (up to 16 tokens) while a query tile stays within ``tile``, so
    few, small heads still give each program enough work. At 1024 (4 warps) the Llama-8B shape (32/8 heads, D 128)
    compiles to 63 registers per thread for sm_90 and no spills; 2048 needs about 110."""
    block_half = _next_power_of_2(half_dim)
    max_heads = max(1, tile // block_half)
    block_hq = min(_next_power_of_2(num_heads), max_heads)
    block_hk = min(_next_power_of_2(num_kv_heads), max_heads)
    block_t = max(1, tile // (block_hq * block_half))
    block_t = min(_next_power_of_2(block_t), 16, _next_power_of_2(seq_len))
    return block_t, block_hq, block_hk, block_half


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (B, H, T, D); got q {tuple(q.shape)} and k {tuple(k.shape)}")
    batch, num_heads, seq_len, head_dim = q.shape
    kb, num_kv_heads, kt, kd = k.shape
    if (kb, kt, kd) != (batch, seq_len, head_dim):
        raise ValueError(
            f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, sequence length and head_dim (B, H_kv, T, D)"
        )
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and at most {MAX_HEAD_DIM}; got {head_dim}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share one dtype among float32/float16/bfloat16; got {q.dtype} and {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"q and k must be on one device; got {q.device} and {k.device}")
    return batch, num_heads, num_kv_heads, seq_len, head_dim


def _check_cos_sin(
    q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None, dims: tuple[int, ...]
) -> None:
    batch, _, _, seq_len, head_dim = dims
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.dtype not in _SUPPORTED_DTYPES or sin.dtype != cos.dtype:
        raise ValueError(f"cos and sin must share one float dtype; got {cos.dtype} and {sin.dtype}")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"cos/sin must be on q's device {q.device}; got {cos.device} and {sin.device}")
    if position_ids is None:
        if cos.dim() != 3 or cos.shape[0] not in (1, batch) or tuple(cos.shape[1:]) != (seq_len, head_dim):
            raise ValueError(
                f"per-token cos/sin must be (B, T, D) = ({batch}, {seq_len}, {head_dim}) or (1, T, D); "
                f"got {tuple(cos.shape)}"
            )
    else:
        if cos.dim() != 2 or cos.shape[1] != head_dim:
            raise ValueError(f"cos/sin caches must be (max_position, D) with D = {head_dim}; got {tuple(cos.shape)}")
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len:
            raise ValueError(
                f"position_ids must be (B, T) = ({batch}, {seq_len}) or (1, T); got {tuple(position_ids.shape)}"
            )
        if position_ids.dtype not in (torch.int32, torch.int64) or position_ids.device != q.device:
            raise ValueError(
                f"position_ids must be int32/int64 on {q.device}; got {position_ids.dtype} on {position_ids.device}"
            )


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    backward: bool = False,
    out_dtype: torch.dtype | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel once for ``q`` and ``k`` (no autograd; see :class:`RotaryQKFunction`).

    Args:
        q: ``(B, H, T, D)`` float32/float16/bfloat16, any strides (zero strides included).
        k: ``(B, H_kv, T, D)``, same dtype and device as ``q``.
        cos, sin: per-token ``(B, T, D)`` or ``(1, T, D)`` when ``position_ids`` is None; otherwise caches
            ``(max_position, D)`` read at row ``position_ids[b, t]``. Any float dtype; the math is in fp32.
        position_ids: ``(B, T)`` or ``(1, T)`` int32/int64, each in ``[0, max_position)`` (not checked here).
        backward: apply the transposed rotation (maps output gradients to input gradients).
        out_dtype: dtype of the results; default ``torch.promote_types(q.dtype, cos.dtype)``, torch's promotion for
            ``q * cos``. :mod:`unpack_trainer.patches.rope` passes the dtype attention will compute in instead.
        validate: check shapes, dtypes and devices (callers that checked them already pass False).

    Returns:
        New tensors shaped like ``q`` and ``k`` in ``out_dtype``, laid out ``(B, T, H, D)``-dense (a transposed
        view): the projections' layout, which the attention kernels read token-major without a copy.
    """
    if triton is None:
        raise RuntimeError("the fused RoPE kernel needs Triton (`pip install triton`); use apply_rotary_pos_emb_torch")
    batch, num_heads, seq_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if validate:
        _check_cos_sin(q, cos, sin, position_ids, _check_qk(q, k))
    if out_dtype is None:
        out_dtype = torch.promote_types(q.dtype, cos.dtype)
    if out_dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be float32/float16/bfloat16; got {out_dtype}")
    q_out = torch.empty(batch, seq_len, num_heads, head_dim, dtype=out_dtype, device=q.device).transpose(1, 2)
    k_out = torch.empty(batch, seq_len, num_kv_heads, head_dim, dtype=out_dtype, device=q.device).transpose(1, 2)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out

    interpret = _interpreter_enabled()
    if q.device.type == "cpu" and not interpret:
        raise RuntimeError(
            "the fused RoPE kernel got CPU tensors; Triton runs kernels on the CPU only in its interpreter: set "
            "TRITON_INTERPRET=1 (slow, for tests) or use apply_rotary_pos_emb_torch"
        )
    if batch > 65535:
        raise ValueError(f"batch size {batch} exceeds the kernel's grid limit of 65535 rows")
    if sin.stride() != cos.stride():  # the kernel reads both through one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    half_dim = head_dim // 2
    block_t, block_hq, block_hk, block_half = _block_sizes(seq_len, num_heads, num_kv_heads, half_dim, _tile())
    gather = position_ids is not None
    if gather:
        pos_strides = (position_ids.stride(0) if position_ids.shape[0] > 1 else 0, position_ids.stride(1))
        cos_strides = (0, cos.stride(0), cos.stride(1))
        pos = position_ids
    else:
        pos_strides = (0, 0)
        cos_strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2))
        pos = cos  # unused by the kernel when GATHER is false; any pointer will do
    grid = (-(-seq_len // block_t), batch)
    # Triton launches on the current CUDA device; switch only when the tensors live elsewhere (cheap common case).
    on_other_gpu = q.device.type == "cuda" and q.device.index != torch.cuda.current_device()
    with torch.cuda.device(q.device) if on_other_gpu else contextlib.nullcontext():
        _kernel(interpret)[grid](
            q,
            k,
            q_out,
            k_out,
            cos,
            sin,
            pos,
            seq_len,
            *q.stride(),
            *k.stride(),
            *cos_strides,
            *pos_strides,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HALF_DIM=half_dim,
            GATHER=gather,
            BACKWARD=backward,
            BLOCK_T=block_t,
            BLOCK_HQ=block_hq,
            BLOCK_HK=block_hk,
            BLOCK_HALF=block_half,
            num_warps=4,
            enable_fp_fusion=True,  # out = fma(x1, cos, x2 * sin): one rounding fewer; also Triton's default
        )
    return q_out, k_out


class RotaryQKFunction(torch.autograd.Function):
    """Autograd wrapper: ``(q_embed, k_embed) = RotaryQKFunction.apply(q, k, cos, sin, position_ids, out_dtype,
    validate)`` (the last two optional).

    Arguments as in :func:`rotary_qk`; the outputs have ``out_dtype`` (default: the promoted dtype of ``q`` and
    ``cos``), the gradients the dtype of ``q``/``k``. Gradients flow to ``q`` and ``k`` only: ``cos``, ``sin`` (built from
    ``position_ids`` under ``no_grad`` by every transformers rotary embedding) and ``position_ids`` get none, and
    the caller must not pass cos/sin that require grad. Incoming gradients may have any strides, including the zero
    strides of an expanded tensor; a missing one (an output that does not reach the loss) is read as zeros.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
        validate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_out, k_out = rotary_qk(q, k, cos, sin, position_ids, out_dtype=out_dtype, validate=validate)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.set_materialize_grads(False)
        ctx.qk_meta = (q.shape, k.shape, q.dtype)
        return q_out, k_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None) -> tuple[Any, ...]:
        cos, sin, position_ids = ctx.saved_tensors
        q_shape, k_shape, input_dtype = ctx.qk_meta
        if grad_q is None and grad_k is None:
            return None, None, None, None, None, None, None
        # An output that did not reach the loss has no gradient, and its input gets none (as with the reference).
        # The kernel still needs a tensor there: an expanded zero scalar costs no memory (read through stride 0).
        want_q = ctx.needs_input_grad[0] and grad_q is not None
        want_k = ctx.needs_input_grad[1] and grad_k is not None
        if grad_q is None:
            grad_q = torch.zeros((), dtype=grad_k.dtype, device=grad_k.device).expand(q_shape)
        if grad_k is None:
            grad_k = torch.zeros((), dtype=grad_q.dtype, device=grad_q.device).expand(k_shape)
        # Gradients arrive in the outputs' (possibly promoted) dtype and leave in the inputs' dtype, rounded once.
        dq, dk = rotary_qk(
            grad_q, grad_k, cos, sin, position_ids, backward=True, out_dtype=input_dtype, validate=False
        )
        return dq if want_q else None, dk if want_k else None, None, None, None, None, None
