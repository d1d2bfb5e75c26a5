"""Hybrid / state-space models on one packed row: the patched model vs stock padded batches vs the samples one by one.

    python benchmarks/bench_hybrid.py                       # qwen3_5_text, lfm2, granitemoehybrid, falcon_h1; T=4096
    python benchmarks/bench_hybrid.py --arch lfm2 --rounds 5 --tokens 8192
    python benchmarks/bench_hybrid.py --device cuda         # GPU: bf16 (the installed kernels where the model has them)

Models (``--arch``, comma-separated): a tiny model of each ``model_type`` at hidden 256, 4 layers, 8 heads of 32
dims (4 key/value heads), intermediate 688, vocabulary 4096, with the family's own layer pattern: Qwen3.5 three gated
delta-net layers and one attention layer, LFM2 three short-convolution layers and one attention layer, Granite 4
(granitemoehybrid) three Mamba2 layers and one attention layer, Falcon-H1 attention and Mamba2 in parallel in every
layer. Training mode, fp32 on CPU (``--threads``, default 1), bf16 on CUDA. The row: lognormal lengths around 180
tokens (sigma 0.8, 8 to 2,048), the last sample cut to fill ``--tokens``.

Providers, each one forward + backward of the same samples:

- ``unpack``: ``patch_model(model)`` on the collator's packed row (``packed_seq_lengths``, ``cu_seq_lens_*``, ...):
  attention per sample, every token mixer per sample (right-padded buckets of similar lengths);
- ``stock_padded``: the unpatched model on the samples as one right-padded batch with ``attention_mask`` (what TRL does
  with them without packing: every sample padded to the longest);
- ``one_by_one``: the unpatched model on every sample alone, its loss weighted by its share of the row's targets (the
  same gradient as the packed row).

Timing: ``--rounds`` rounds; in every round each provider runs in turn (interleaved, so that load on a shared machine
hits all of them alike) one warm-up step and ``--repeats`` timed steps. Reported: the median over all timed steps and
the spread (min-max); ratios of medians, with the spread of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import TINY_SIZES, format_table, lognormal_lengths, print_header, tiny_config  # noqa: E402

ARCHS = ("qwen3_5_text", "lfm2", "granitemoehybrid", "falcon_h1")
PROVIDERS = ("unpack", "stock_padded", "one_by_one")
# Each family's layer pattern and mixer sizes at this width.
ARCH_OVERRIDES: dict[str, dict] = {
    "qwen3_5_text": dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
    "lfm2": dict(layer_types=["conv"] * 3 + ["full_attention"], block_ff_dim=688, block_auto_adjust_ff_dim=False),
    "granitemoehybrid": dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_chunk_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=64, mamba_d_ssm=512, mamba_d_state=64, mamba_chunk_size=64),
}


def build_model(arch: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **ARCH_OVERRIDES.get(arch, {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).train()


def row_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Lognormal lengths around 180 tokens filling ``tokens`` exactly (the last one cut)."""
    lengths = lognormal_lengths(4 * tokens // 180 + 8, seed=seed).tolist()
    row, total = [], 0
    for length in lengths:
        take = min(int(length), tokens - total)
        row.append(take)
        total += take
        if total == tokens:
            return row
    raise ValueError("not enough lengths drawn")


def _step_unpack(model, samples, device):
    from unpack_trainer.model_zoo.tiny import packed_batch

    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed_batch(samples).items()}
    loss = model(**batch, use_cache=False).loss
    loss.backward()


def _step_padded(model, samples, device):
    from unpack_trainer.model_zoo.tiny import padded_batch

    batch = {k: v.to(device) for k, v in padded_batch(samples).items()}
    loss = model(**batch, use_cache=False).loss
    loss.backward()


def _step_one_by_one(model, samples, device):
    targets = sum(len(s) - 1 for s in samples)
    for sample in samples:
        ids = sample.unsqueeze(0).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        (loss * ((len(sample) - 1) / targets)).backward()


STEPS = {"unpack": _step_unpack, "stock_padded": _step_padded, "one_by_one": _step_one_by_one}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_arch(arch: str, args, device, dtype) -> dict[str, list[float]]:
    from unpack_trainer.models import patch_model, unpatch_model

    model = build_model(arch, device, dtype)
    lengths = row_lengths(args.tokens, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    samples = [torch.randint(3, TINY_SIZES["vocab_size"], (n,), generator=generator) for n in lengths]
    warm = samples[: max(2, len(samples) // 8)]
    times: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for _ in range(args.rounds):
        for provider in PROVIDERS:
            if provider == "unpack":
                patch_model(model)
            try:
                STEPS[provider](model, warm, device)
                model.zero_grad(set_to_none=True)
                for _ in range(args.repeats):
                    _sync(device)
                    start = time.perf_counter()
                    STEPS[provider](model, samples, device)
                    _sync(device)
                    times[provider].append(time.perf_counter() - start)
                    model.zero_grad(set_to_none=True)
            finally:
                unpatch_model(model)
    times["_samples"] = [float(len(lengths)), float(max(lengths))]
    return times


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _ratio(numerator: list[float], denominator: list[float]) -> str:
    ratios = [a / b for a, b in zip(numerator, denominator)]
    median = statistics.median(numerator) / statistics.median(denominator)
    return f"{median:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=",".join(ARCHS))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_num_threads(args.threads)
    print_header(
        f"Hybrid models, one packed row of {args.tokens} tokens, forward + backward ({dtype}, {args.threads} thread(s))"
    )
    rows = []
    for arch in args.arch.split(","):
        times = time_arch(arch, args, device, dtype)
        count, longest = times.pop("_samples")
        rows.append(
            [
                arch,
                f"{int(count)} (longest {int(longest)})",
                _cell(times["unpack"]),
                _cell(times["stock_padded"]),
                _cell(times["one_by_one"]),
                _ratio(times["stock_padded"], times["unpack"]),
                _ratio(times["unpack"], times["one_by_one"]),
            ]
        )
        print(f"{arch}: done", file=sys.stderr, flush=True)
    headers = [
        "model_type",
        "samples",
        "unpack s",
        "stock padded s",
        "one by one s",
        "stock padded / unpack",
        "unpack / one by one",
    ]
    print(format_table(headers, rows))
    print(f"\nmedian (min-max) over {args.rounds} rounds x {args.repeats} repeats, providers interleaved")


if __name__ == "__main__":
    main()
