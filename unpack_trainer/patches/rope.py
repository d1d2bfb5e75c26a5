"""Rotary position embedding (RoPE) for packed rows: a torch reference, a fused Triton kernel, one drop-in entry point.

In a packed row every token's rotary angle comes from its own ``position_ids`` entry (positions restart at 0 for each
sample). transformers' rotary embedding turns the batch's ``position_ids`` into per-token ``cos``/``sin`` of shape
``(B, T, D)`` once per forward, and every attention layer then calls ``apply_rotary_pos_emb(q, k, cos, sin)``, which
costs about ten elementwise kernels over Q and K. :func:`apply_rotary_pos_emb` is a drop-in for that function (same
signature, same result) that runs one fused Triton launch for Q and K instead, forward and backward, on CUDA tensors
when Triton is installed; everywhere else it runs the torch reference :func:`apply_rotary_pos_emb_torch`.

The environment variable ``UNPACK_ROPE`` chooses, read on every call:

- unset, ``""`` or ``"auto"``: the kernel for CUDA tensors it supports when Triton is importable (and not while
  ``torch.compile`` traces, which fuses the reference itself), else the reference;
- ``"torch"``: always the reference;
- ``"triton"``: always the kernel, and a clear error for inputs it cannot take instead of a fallback. On CPU tensors
  this needs ``TRITON_INTERPRET=1`` (Triton's interpreter; slow, meant for tests).

A second entry point, :func:`fused_rotary_pos_emb_from_cache`, takes ``(max_position, D)`` cos/sin caches plus
``position_ids`` and gathers each token's row inside the kernel, so no ``(B, T, D)`` cos/sin is materialised;
:func:`rope_cache` builds those caches from a model's own rotary embedding module.

Nothing happens at import time: Triton is imported on the first kernel launch only, and this module imports without
Triton installed.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = [
    "ROPE_ENV",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_torch",
    "fused_apply_rotary_pos_emb",
    "fused_rotary_pos_emb_from_cache",
    "output_dtype",
    "rope_backend",
    "rope_cache",
    "rotate_half",
    "triton_available",
]

ROPE_ENV = "UNPACK_ROPE"
_MODES = ("auto", "torch", "triton")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rope types whose angle for a position depends on the whole batch (the largest position seen): a cache built once
# cannot reproduce them.
_BATCH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension, where ``x1``/``x2`` are its first and second halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the same operations, in the same order, as transformers' ``apply_rotary_pos_emb``.

    Arguments, shapes and result as :func:`apply_rotary_pos_emb` (without its ignored ``position_ids``; for a packed
    row, positions restart per sample in ``cos``/``sin`` and nothing else changes); the dtype is torch's type
    promotion of the inputs.
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rope_backend() -> str:
    """The value of ``UNPACK_ROPE``: ``"auto"`` (unset or empty), ``"torch"`` or ``"triton"``."""
    mode = os.environ.get(ROPE_ENV, "").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ROPE_ENV}={os.environ[ROPE_ENV]!r} is not supported; use one of {', '.join(_MODES)}")
    return mode


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (checked once, on first use, not at import of this module)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _head_dim_of(unsqueeze_dim: int) -> int | None:
    """Map ``unsqueeze_dim`` (for 3-D cos/sin against 4-D q/k) to 1 or 2; None for layouts the kernel cannot read."""
    if unsqueeze_dim < 0:
        unsqueeze_dim += 4
    return unsqueeze_dim if unsqueeze_dim in (1, 2) else None


def _kernel_unsupported(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> str | None:
    """Why the fused kernel cannot give transformers' exact result for these inputs, or None when it can."""
    from unpack_trainer.patches.rope_kernel import MAX_HEAD_DIM

    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return f"needs 4-D q/k and 3-D cos/sin; got q {q.dim()}-D, k {k.dim()}-D, cos {cos.dim()}-D"
    head_axis = _head_dim_of(unsqueeze_dim)
    if head_axis is None:
        return f"unsqueeze_dim={unsqueeze_dim} does not put the head axis at 1 or 2"
    if (
        q.dtype != k.dtype
        or cos.dtype != sin.dtype
        or q.dtype not in _KERNEL_DTYPES
        or cos.dtype not in _KERNEL_DTYPES
    ):
        # The kernel returns promote_types(q, cos) like torch's q * cos; other mixes promote differently per tensor.
        return (
            "needs q and k in one dtype and cos and sin in one dtype, each float32/float16/bfloat16; got "
            f"q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}"
        )
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        return "needs q, k, cos, sin on one device"
    seq_axis = 3 - head_axis
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_axis], q.shape[3]
    if k.shape[0] != batch or k.shape[seq_axis] != seq_len or k.shape[3] != head_dim:
        return f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, sequence or head_dim"
    if cos.shape != sin.shape or cos.shape[0] not in (1, batch) or tuple(cos.shape[1:]) != (seq_len, head_dim):
        return f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} are not (B, T, D) or (1, T, D) for q {tuple(q.shape)}"
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is odd or above {MAX_HEAD_DIM}"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "cos/sin require grad and the kernel gives gradients to q and k only"
    return None


def output_dtype(q: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    """The dtype the kernel writes: the one attention will compute in. torch's ``q * cos`` promotes bf16 q/k with the
    fp32 cos/sin of an autocast step to fp32, which attention then casts back to bf16
    (:func:`unpack_trainer.patches.attention.compute_dtype`); the kernel computes in fp32 and rounds once, straight to
    that dtype. Without autocast: torch's promotion, as transformers."""
    from unpack_trainer.patches.attention.registry import compute_dtype

    return compute_dtype(q.device, torch.promote_types(q.dtype, cos.dtype))


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    head_axis: int,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    from unpack_trainer.patches.rope_kernel import RotaryQKFunction

    out_dtype = output_dtype(q, cos)
    if head_axis == 2:  # (B, T, H, D): the kernel reads the (B, H, T, D) view in place; no copy either way
        q_embed, k_embed = RotaryQKFunction.apply(
            q.transpose(1, 2), k.transpose(1, 2), cos, sin, position_ids, out_dtype, validate
        )
        return q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    return RotaryQKFunction.apply(q, k, cos, sin, position_ids, out_dtype, validate)


def fused_apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` as one Triton launch for Q and K (autograd included); no fallback.

    Args:
        q: ``(B, H, T, D)`` (``(B, T, H, D)`` with ``unsqueeze_dim=2``), float32/float16/bfloat16, any strides:
            the transposed projection output is read in place. ``D`` even, at most 256 (80, 96, ... are fine).
        k: ``(B, H_kv, T, D)`` in the same layout; ``H_kv`` may be smaller than ``H`` (grouped-query attention).
        cos, sin: ``(B, T, D)`` or ``(1, T, D)``, the model's per-token cos/sin (float32/float16/bfloat16, may
            differ from q's dtype, e.g. fp32 under autocast), not requiring grad.
        unsqueeze_dim: 1 or 2 (or -3 / -2), as in transformers.

    Returns:
        ``(q_embed, k_embed)``: new tensors shaped like ``q``/``k``, laid out ``(B, T, H, D)``-dense (the
        projections' layout), in the dtype attention will compute in (:func:`output_dtype`: under autocast bf16
        q/k with fp32 cos/sin give bf16; otherwise ``torch.promote_types(q.dtype, cos.dtype)`` as torch's
        ``q * cos``); gradients in q's dtype. Values equal the reference's (cast to that dtype) up to rounding: the
        kernel computes in fp32 and rounds once, so in fp16/bf16 it is at least as close to the exact result as the
        reference is.

    Raises:
        ValueError: inputs the kernel cannot take (the message says which); RuntimeError: Triton missing, or CPU
        tensors without ``TRITON_INTERPRET=1``.
    """
    reason = _kernel_unsupported(q, k, cos, sin, unsqueeze_dim)
    if reason is not None:
        raise ValueError(f"the fused RoPE kernel cannot take these inputs: {reason}")
    return _launch(q, k, cos, sin, None, _head_dim_of(unsqueeze_dim), validate=False)


def fused_rotary_pos_emb_from_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    unsqueeze_dim: int = 1,
    check_positions: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate Q and K in one Triton launch, gathering each token's cos/sin row by its position id inside the kernel.

    Equivalent to ``apply_rotary_pos_emb_torch(q, k, cos_cache[position_ids], sin_cache[position_ids])`` without
    materialising the ``(B, T, D)`` gathered tensors. Use :func:`rope_cache` to build caches that give the model's own
    numbers. Where the gain is: the fusion of the rotation (see :mod:`unpack_trainer.patches.rope_kernel`) is the same
    as :func:`fused_apply_rotary_pos_emb`'s; the gather additionally saves computing and storing per-token cos/sin.
    A transformers model computes those once per forward and shares them across layers, so for patched models the
    drop-in :func:`apply_rotary_pos_emb` is the path that matters; this one serves attention code that holds a cache
    (and lets ``bench_rope.py`` show the cost of the gather).

    Args:
        q: ``(B, H, T, D)`` (``(B, T, H, D)`` with ``unsqueeze_dim=2``), float32/float16/bfloat16, any strides.
        k: ``(B, H_kv, T, D)`` in the same layout and dtype.
        cos_cache, sin_cache: ``(max_position, D)`` float32/float16/bfloat16 (the math is in fp32), no grad.
        position_ids: ``(B, T)`` or ``(1, T)`` int32/int64; for a packed row they restart at 0 for each sample.
        unsqueeze_dim: 1 or 2 (or -3 / -2): where the head axis of ``q``/``k`` is.
        check_positions: verify ``0 <= position_ids < max_position`` first. This reads two scalars back to the host
            (one synchronisation); pass False on a hot path whose positions are known to be in range (out-of-range
            ids then read outside the cache).

    Returns:
        ``(q_embed, k_embed)`` shaped like ``q`` and ``k``, in :func:`output_dtype` (``torch.promote_types(q.dtype,
        cos_cache.dtype)`` outside autocast).
    """
    head_axis = _head_dim_of(unsqueeze_dim)
    if head_axis is None or q.dim() != 4:
        raise ValueError(
            f"q must be 4-D with the head axis at 1 or 2; got q {tuple(q.shape)} and unsqueeze_dim={unsqueeze_dim}"
        )
    if torch.is_grad_enabled() and (cos_cache.requires_grad or sin_cache.requires_grad):
        raise ValueError("cos/sin caches must not require grad: the kernel gives gradients to q and k only")
    if check_positions and position_ids.numel():
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= cos_cache.shape[0]:
            bad = low if low < 0 else high
            row, col = (position_ids == bad).nonzero()[0].tolist()
            raise ValueError(
                f"position_ids[{row}, {col}] = {bad} is outside the cos/sin cache of {cos_cache.shape[0]} positions; "
                f"build the cache with max_position > {high}"
            )
    return _launch(q, k, cos_cache, sin_cache, position_ids, head_axis)


def rope_cache(
    rotary_emb: torch.nn.Module,
    max_position: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_cache, sin_cache)``, each ``(max_position, D)`` in ``dtype``, from a model's rotary embedding module.

    Row ``p`` is exactly what ``rotary_emb(x, position_ids)`` returns for a token at position ``p`` (the module's
    ``attention_scaling`` included), so :func:`fused_rotary_pos_emb_from_cache` gives the model's numbers. That holds
    for rope types whose angle depends on the position alone: ``default``, ``linear``, ``llama3``, ``yarn``
    (and other static types). ``dynamic`` and ``longrope`` pick their frequencies from the largest position in the
    batch, so a cache cannot reproduce them: they raise ``ValueError``, as do modules with per-layer-type rope.

    Args:
        rotary_emb: e.g. ``model.model.rotary_emb`` of a Llama/Mistral/Qwen2/Qwen3 model.
        max_position: number of rows; every position id used with the cache must be below it.
        device: where to build the cache (default: the module's ``inv_freq`` device).
        dtype: the cache dtype; pass the model's compute dtype to reproduce its (rounded) cos/sin.
    """
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if not isinstance(rope_type, str):
        raise ValueError(f"rotary embedding with per-layer rope types {rope_type!r} is not supported by rope_cache")
    if rope_type in _BATCH_DEPENDENT_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} chooses its frequencies from the largest position in each batch; a cos/sin "
            "cache cannot reproduce it. Use apply_rotary_pos_emb with the model's own cos/sin instead."
        )
    if max_position <= 0:
        raise ValueError(f"max_position must be positive; got {max_position}")
    if device is None:
        inv_freq = getattr(rotary_emb, "inv_freq", None)
        device = inv_freq.device if isinstance(inv_freq, torch.Tensor) else "cpu"
    probe = torch.empty(0, dtype=dtype, device=device)  # the module reads only x.device and x.dtype
    position_ids = torch.arange(max_position, device=device, dtype=torch.long)[None]
    with torch.no_grad():
        cos, sin = rotary_emb(probe, position_ids)
    return cos[0], sin[0]


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``: same arguments, same result.

    Args:
        q: ``(B, H, T, D)`` queries (``(B, T, H, D)`` with ``unsqueeze_dim=2``).
        k: ``(B, H_kv, T, D)`` keys in the same layout (``H_kv`` may be smaller than ``H``).
        cos, sin: ``(B, T, D)`` or ``(1, T, D)`` from the model's rotary embedding for the batch's ``position_ids``
            (packed or not: restarting positions are already in cos/sin).
        position_ids: ignored, as in transformers (kept for the pre-4.48 signature).
        unsqueeze_dim: the head axis of ``q``/``k``.

    Returns:
        ``(q_embed, k_embed)`` like transformers' (dtype ``torch.promote_types(q.dtype, cos.dtype)``). On the kernel
        path (see the module docstring for when) the values are computed in fp32 and rounded once, so in fp16/bf16
        they differ from the reference by the rounding of its three intermediate steps (the kernel has the smaller
        error against exact arithmetic); gradients flow to ``q`` and ``k`` as before. Mixed dtypes, bf16 q/k with
        the fp32 cos/sin of every autocast step, are the kernel's common case: it writes the dtype attention will
        compute in (:func:`output_dtype`, bf16 there, where transformers' promotion gives fp32 that attention casts
        back). Inputs the kernel does not cover (q and k, or cos and sin, in different dtypes; cos/sin requiring
        grad; other shapes) take the reference unless ``UNPACK_ROPE=triton``, which makes them an error.
    """
    mode = rope_backend()
    if mode == "torch":
        return apply_rotary_pos_emb_torch(q, k, cos, sin, unsqueeze_dim)
    if mode == "auto" and (not q.is_cuda or torch.compiler.is_compiling() or not triton_available()):
        return apply_rotary_pos_emb_torch(q, k, cos, sin, unsqueeze_dim)
    reason = _kernel_unsupported(q, k, cos, sin, unsqueeze_dim)
    if reason is None:
        return _launch(q, k, cos, sin, None, _head_dim_of(unsqueeze_dim), validate=False)
    if mode == "triton":
        raise ValueError(
            f"{ROPE_ENV}=triton forces the fused RoPE kernel, which cannot take these inputs: {reason}. "
            f"Unset {ROPE_ENV} to fall back to the torch reference for them."
        )
    return apply_rotary_pos_emb_torch(q, k, cos, sin, unsqueeze_dim)
