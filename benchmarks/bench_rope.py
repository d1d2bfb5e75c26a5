"""Fused Q/K RoPE kernel vs transformers' torch path, forward and forward+backward (GPU).

    python benchmarks/bench_rope.py                       # seqlen 256..8192 x packed/unpacked x bf16/fp32
    python benchmarks/bench_rope.py --dtypes bfloat16 --seqlens 2048,4096,8192
    python benchmarks/bench_rope.py --dry-run             # no GPU: one tiny case on CPU through Triton's interpreter

Shapes follow a Llama-3-8B attention layer: 32 query heads, 8 key/value heads, head_dim 128, one row of ``seqlen``
tokens. q/k are the transposed ``(B, T, H, D)`` projection views the model hands to ``apply_rotary_pos_emb``, and
cos/sin come from ``LlamaRotaryEmbedding`` for the row's ``position_ids``: ``packed`` restarts them at every sample
boundary (lognormal sample lengths around 180 tokens), ``unpacked`` is one sample ``0..T-1``.

Providers, measured in the same run: ``torch`` = transformers' ``apply_rotary_pos_emb`` (our bitwise-identical
reference), ``kernel`` = ``fused_apply_rotary_pos_emb`` (what the patched model calls on CUDA), ``cache`` =
``fused_rotary_pos_emb_from_cache`` (cos/sin gathered by position id inside the kernel; forward only), ``liger`` =
Liger-Kernel's ``liger_rotary_pos_emb`` (fwd+bwd; when ``pip install liger-kernel`` is there, else the column says
so; it rotates q/k in place). Times are the median over ``--rep`` timed calls after ``--warmup`` calls, with the L2
cache flushed before each call on CUDA. Differences are kernel vs torch outputs (q and k together) in the output
dtype. Precisions: ``bfloat16`` / ``float32`` (q, k, cos, sin all in it) and ``autocast`` (bf16 q/k with fp32
cos/sin under ``torch.autocast``, what every step of fp32 weights with ``bf16=True`` hands RoPE; the kernel writes
bf16 there). Goals (issue 26): kernel >= 2.3x torch at 2k-8k tokens, >= 1.0x Liger at 2k-32k.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import format_table, lognormal_lengths, print_header, tiny_llama_config  # noqa: E402

from unpack_trainer.patches.rope import (  # noqa: E402
    apply_rotary_pos_emb_torch,
    fused_apply_rotary_pos_emb,
    fused_rotary_pos_emb_from_cache,
    rope_cache,
)

DEFAULT_SEQLENS = (256, 512, 1024, 2048, 4096, 8192, 32768)
PRECISIONS = ("bfloat16", "float32", "autocast")
HEADERS = (
    "dtype",
    "seqlen",
    "layout",
    "torch fwd µs",
    "kernel fwd µs",
    "fwd speedup",
    "torch fwd+bwd µs",
    "kernel fwd+bwd µs",
    "fwd+bwd speedup",
    "liger fwd+bwd µs",
    "kernel vs liger",
    "cache fwd µs",
    "max abs diff",
    "mean abs diff",
)


def packed_position_ids(seqlen: int, *, seed: int = 0) -> torch.Tensor:
    """(1, seqlen) int64 positions restarting at 0 per sample, lengths lognormal around 180 (last one cut)."""
    lengths = lognormal_lengths(seqlen // 8 + 1, seed=seed)
    pieces, total = [], 0
    for n in lengths.tolist():
        n = min(n, seqlen - total)
        pieces.append(torch.arange(n, dtype=torch.int64))
        total += n
        if total == seqlen:
            break
    return torch.cat(pieces)[None]


def time_us(fn: Callable[[], object], *, device: str, warmup: int, rep: int) -> float:
    """Median microseconds per call of ``fn`` over ``rep`` calls (CUDA events, L2 flushed; CPU: wall clock)."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        samples = []
        for _ in range(rep):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def _liger_rope() -> Callable | None:
    """Liger-Kernel's ``liger_rotary_pos_emb`` when installed, else ``None``."""
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def run_case(
    seqlen: int,
    layout: str,
    precision: str,
    *,
    device: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    warmup: int,
    rep: int,
) -> dict:
    """One row of the table: times (µs) of the three providers and the kernel-vs-torch differences."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_llama_config(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(seqlen, 2),
    )
    rotary = LlamaRotaryEmbedding(config).to(device)
    if layout == "packed":
        position_ids = packed_position_ids(seqlen).to(device)
    elif layout == "unpacked":
        position_ids = torch.arange(seqlen, device=device)[None]
    else:
        raise ValueError(f"layout must be 'packed' or 'unpacked'; got {layout!r}")

    autocast = precision == "autocast"
    dtype = torch.bfloat16 if autocast else getattr(torch, precision)
    generator = torch.Generator(device=device).manual_seed(0)
    q_proj = torch.randn(1, seqlen, heads * head_dim, device=device, generator=generator).to(dtype)
    k_proj = torch.randn(1, seqlen, kv_heads * head_dim, device=device, generator=generator).to(dtype)
    q_proj.requires_grad_()
    k_proj.requires_grad_()
    q = q_proj.view(1, seqlen, heads, head_dim).transpose(1, 2)
    k = k_proj.view(1, seqlen, kv_heads, head_dim).transpose(1, 2)
    cos, sin = rotary(q_proj.float() if autocast else q_proj, position_ids)  # autocast: fp32 cos/sin
    cos_cache, sin_cache = rope_cache(rotary, max(seqlen, 2), device=device, dtype=cos.dtype)
    context = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    grad_q = torch.randn(q.shape, device=device, generator=generator).to(dtype)
    grad_k = torch.randn(k.shape, device=device, generator=generator).to(dtype)

    def in_context(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with context():
                return fn()

        return call

    def fwd_bwd(fn: Callable) -> Callable[[], object]:
        def call() -> object:
            q = q_proj.view(1, seqlen, heads, head_dim).transpose(1, 2)
            k = k_proj.view(1, seqlen, kv_heads, head_dim).transpose(1, 2)
            out = fn(q, k, cos, sin)
            return torch.autograd.grad(
                out, (q_proj, k_proj), tuple(g.to(o.dtype) for g, o in zip((grad_q, grad_k), out))
            )

        return in_context(call)

    timing = {"device": device, "warmup": warmup, "rep": rep}
    row = {"dtype": precision, "seqlen": seqlen, "layout": layout}
    row["torch_fwd_us"] = time_us(in_context(lambda: apply_rotary_pos_emb_torch(q, k, cos, sin)), **timing)
    row["kernel_fwd_us"] = time_us(in_context(lambda: fused_apply_rotary_pos_emb(q, k, cos, sin)), **timing)
    row["torch_fwd_bwd_us"] = time_us(fwd_bwd(apply_rotary_pos_emb_torch), **timing)
    row["kernel_fwd_bwd_us"] = time_us(fwd_bwd(fused_apply_rotary_pos_emb), **timing)
    liger = _liger_rope()
    row["liger_fwd_bwd_us"] = None
    if liger is not None and device == "cuda":
        # Liger rotates the projections in place: the values drift from rep to rep, which timing does not mind.
        row["liger_fwd_bwd_us"] = time_us(fwd_bwd(liger), **timing)
    row["cache_fwd_us"] = time_us(
        in_context(
            lambda: fused_rotary_pos_emb_from_cache(q, k, cos_cache, sin_cache, position_ids, check_positions=False)
        ),
        **timing,
    )
    with torch.no_grad(), context():
        ref = torch.cat([t.flatten().float() for t in apply_rotary_pos_emb_torch(q, k, cos, sin)])
        out = fused_apply_rotary_pos_emb(q, k, cos, sin)
        row["out_dtype"] = str(out[0].dtype).removeprefix("torch.")
        out = torch.cat([t.flatten().float() for t in out])
        diff = (out - ref).abs()
    row["max_abs_diff"] = diff.max().item()
    row["mean_abs_diff"] = diff.mean().item()
    return row


def run_cases(
    seqlens: Sequence[int],
    layouts: Sequence[str],
    dtypes: Sequence[str],
    *,
    device: str,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    warmup: int = 10,
    rep: int = 100,
) -> list[dict]:
    """Every (precision, seqlen, layout) case, in that order; ``dtypes`` are names of :data:`PRECISIONS`."""
    return [
        run_case(
            seqlen,
            layout,
            dtype,
            device=device,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            warmup=warmup,
            rep=rep,
        )
        for dtype in dtypes
        for seqlen in seqlens
        for layout in layouts
    ]


def format_rows(rows: Sequence[dict]) -> str:
    table = []
    for r in rows:
        table.append(
            (
                r["dtype"],
                r["seqlen"],
                r["layout"],
                r["torch_fwd_us"],
                r["kernel_fwd_us"],
                f"{r['torch_fwd_us'] / r['kernel_fwd_us']:.2f}x",
                r["torch_fwd_bwd_us"],
                r["kernel_fwd_bwd_us"],
                f"{r['torch_fwd_bwd_us'] / r['kernel_fwd_bwd_us']:.2f}x",
                "not installed" if r["liger_fwd_bwd_us"] is None else r["liger_fwd_bwd_us"],
                "-" if r["liger_fwd_bwd_us"] is None else f"{r['liger_fwd_bwd_us'] / r['kernel_fwd_bwd_us']:.2f}x",
                r["cache_fwd_us"],
                f"{r['max_abs_diff']:.2e}",
                f"{r['mean_abs_diff']:.2e}",
            )
        )
    return format_table(HEADERS, table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)))
    parser.add_argument("--layouts", default="packed,unpacked")
    parser.add_argument("--dtypes", default=",".join(PRECISIONS), help=f"any of {', '.join(PRECISIONS)}")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rep", type=int, default=100)
    parser.add_argument("--tile", type=int, default=None, help="UNPACK_ROPE_TILE for the kernel (default 1024)")
    parser.add_argument(
        "--dry-run", action="store_true", help="one tiny case on CPU through TRITON_INTERPRET=1 (checks the code only)"
    )
    args = parser.parse_args(argv)

    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_rope needs Triton: pip install triton", file=sys.stderr)
        return 2
    if args.tile is not None:
        os.environ["UNPACK_ROPE_TILE"] = str(args.tile)  # read at every launch
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(PRECISIONS))
    if unknown:
        parser.error(f"--dtypes: {', '.join(unknown)} not among {', '.join(PRECISIONS)}")
    layouts = args.layouts.split(",")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read at the first kernel launch
        rows = run_cases(
            [24], layouts, ["float32", "autocast"], device="cpu", heads=4, kv_heads=2, head_dim=16, warmup=1, rep=2
        )
        print_header("RoPE: fused Q/K kernel vs torch (DRY RUN on CPU through the Triton interpreter: not timings)")
        print(format_rows(rows))
        return 0
    if not torch.cuda.is_available():
        print(
            "bench_rope measures the Triton kernel on a CUDA GPU and none is available here. Run it on a machine "
            "with a GPU, or pass --dry-run to check the benchmark code on CPU.",
            file=sys.stderr,
        )
        return 2
    rows = run_cases(
        [int(s) for s in args.seqlens.split(",")],
        layouts,
        dtypes,
        device="cuda",
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        warmup=args.warmup,
        rep=args.rep,
    )
    print_header(
        f"RoPE: fused Q/K kernel vs torch path; {args.heads} q heads, {args.kv_heads} kv heads, "
        f"head_dim {args.head_dim}, batch 1, tile {os.environ.get('UNPACK_ROPE_TILE', '1024')}"
    )
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
