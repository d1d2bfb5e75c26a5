"""``torch_varlen``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10 or later, CUDA sm80 or
newer, float16 / bfloat16; no extra install)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention._common import AttentionBackend, AttentionFeature, CallOptions, OptionalKernel
from unpack_trainer.patches.attention._varlen import MAX_HEAD_DIM, fallback_of, varlen_forward, varlen_window

__all__ = ["BACKEND"]


def _takes_enable_gqa(kernel: Callable[..., Any]) -> bool:
    """Whether ``varlen_attn`` has the ``enable_gqa`` keyword (added after the first release); read from its
    signature, not from the torch version."""
    try:
        return "enable_gqa" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


def _cuda_flash_unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch's own flash kernel cannot run on ``device``: a torch built without it, or a GPU older than sm80."""
    if device.type != "cuda":
        return None
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch was built without its flash attention kernel"
    if not torch.cuda.is_available():
        # A CUDA build of torch on a machine without a driver or GPU: the capability query below would raise.
        return "no CUDA device is available to this process"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"torch's flash kernel needs compute capability 8.0 or newer, the GPU has {major}.{minor}"
    return None


def forward(query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions) -> Tensor:
    """PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10 or later, CUDA sm80 or newer).

    Shapes: q ``(B, num_heads, T, head_dim)``, k ``(B, num_kv_heads, T, head_dim)``, v
    ``(B, num_kv_heads, T, head_dim_v)``, float16 or bfloat16 on CUDA -> ``(B, T, num_heads, head_dim_v)``. q, k and
    v are zero-padded to one head dim, a multiple of 8 (torch's flash kernel asserts it), at most 256; the output is
    cropped. The kernel gets ``cu_seqlens`` ``(num_seqs + 1,)`` int32 and ``max_seqlen`` as they are.

    GQA: ``enable_gqa=True`` where ``varlen_attn`` has that keyword, else each kv head repeated
    ``num_heads // num_kv_heads`` times. Window ``w`` (keys ``i - w < j <= i``): ``window_size=(w - 1, 0)``; causal
    is ``(-1, 0)``. Softcap, sinks, dropout: refused (the kernel has none of them). No query row is fully masked.
    """
    varlen_attn = options.kernel
    heads_per_kv = query.shape[1] // key.shape[1]
    grouped = heads_per_kv > 1 and _takes_enable_gqa(varlen_attn)
    kernel_options: dict[str, Any] = {
        "scale": options.scaling,
        "window_size": varlen_window(info.max_seqlen, options.sliding_window) or (-1, 0),  # (-1, 0): causal
    }
    if grouped:
        kernel_options["enable_gqa"] = True

    def call(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        if heads_per_kv > 1 and not grouped:
            k, v = k.repeat_interleave(heads_per_kv, dim=1), v.repeat_interleave(heads_per_kv, dim=1)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kernel_options)

    # torch's flash kernel asserts head_dim % 8 == 0 (flash-attn's Python wrapper pads for us).
    return varlen_forward(
        call, "torch varlen_attn", query, key, value, info, head_dim_multiple=8, fallback=fallback_of(options)
    )


BACKEND = AttentionBackend(
    name="torch_varlen",
    serves=frozenset({AttentionFeature.SLIDING_WINDOW}),
    forward=forward,
    kernel=OptionalKernel(
        name="torch's varlen_attn",
        load=lambda: importlib.import_module("torch.nn.attention.varlen").varlen_attn,
        not_installed="this torch has no torch.nn.attention.varlen.varlen_attn (torch 2.10 or later)",
        dtypes=(torch.float16, torch.bfloat16),
    ),
    requires=_cuda_flash_unsupported_reason,
    max_head_dim=MAX_HEAD_DIM,
)
