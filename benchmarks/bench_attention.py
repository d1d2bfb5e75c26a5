"""Packed attention: stock transformers (dense block-causal mask) vs the patched model vs the samples one by one.

    python benchmarks/bench_attention.py                   # all cases, model fwd+bwd and attention alone
    python benchmarks/bench_attention.py --threads 1       # pin torch's CPU threads (steadier on a shared machine)
    python benchmarks/bench_attention.py --cases lognormal-4096 --parts model --repeats 3
    python benchmarks/bench_attention.py --device cuda     # GPU: bf16, packed attention on flash-attn/xformers/SDPA

Model: the tiny Llama of ``common.tiny_llama_config`` (hidden 256, 4 layers, 8 heads, 4 kv heads, vocab 4096),
training mode, loaded with SDPA; fp32 on CPU, bf16 on CUDA (``--dtype``). The patched model's backend is printed. Cases, one row each: ``lognormal-4096`` / ``lognormal-16384`` (lognormal lengths around 180
tokens, the last sample cut to fill the row) and ``tiny-8192`` (about 1,000 samples of about 8 tokens).

Providers, measured in the same run, each case in its own subprocess (peak RSS belongs to that case alone):

- ``stock``: the unpatched model on the packed row with ``position_ids`` restarting per sample and ``use_cache=False``
  (transformers detects the packing and builds a dense (T, T) block-causal mask);
- ``unpack``: ``patch_model(model)`` on the collator's batch (``packed_seq_lengths``, ``cu_seq_lens_*``, ...);
- ``one_by_one``: every sample alone, forward + backward, its loss weighted by its share of the row's targets (the
  same gradient as the packed row).

``--parts attention`` times the attention call alone (random q/k/v of the model's shape, forward + backward, one
layer): ``stock`` = mask creation by ``create_causal_mask`` + transformers' SDPA function, ``unpack`` = metadata +
:func:`unpack_trainer.patches.attention.packed_attention_forward`, ``one_by_one`` = one SDPA call per sample.

Seconds are the minimum over ``--repeats`` timed steps after one warm-up step on the first 512 tokens. Peak memory is
the subprocess's peak RSS on CPU (Python, torch and the model included), ``torch.cuda.max_memory_allocated`` over the
timed steps on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import format_table, lognormal_lengths, print_header, run_in_subprocess, tiny_llama_config  # noqa: E402

CASES = ("lognormal-4096", "lognormal-16384", "tiny-8192")
PROVIDERS = ("stock", "unpack", "one_by_one")
PARTS = ("model", "attention")


def case_lengths(case: str) -> list[int]:
    """Sample lengths of the case's single row; they sum to its T."""
    kind, total = case.rsplit("-", 1)
    total = int(total)
    if kind == "lognormal":
        draws = lognormal_lengths(total // 8, median=180, seed=0).tolist()
    elif kind == "tiny":
        draws = lognormal_lengths(total, median=8, sigma=0.25, low=4, high=16, seed=0).tolist()
    else:
        raise ValueError(f"unknown case {case!r}")
    lengths, used = [], 0
    for length in draws:
        length = min(length, total - used)
        lengths.append(length)
        used += length
        if used == total:
            return lengths
    raise RuntimeError(f"not enough samples drawn for {case}")


def _peak_mb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(step, repeats: int, device: str) -> list[float]:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def model_worker(case: str, provider: str, repeats: int, device: str, dtype_name: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from unpack_trainer.collator import packed_metadata
    from unpack_trainer.models import patch_model, resolve_backend

    lengths = case_lengths(case)
    total = sum(lengths)
    torch.manual_seed(0)
    config = tiny_llama_config()
    model = LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype_name))
    model.set_attn_implementation("sdpa")
    model.train()
    input_ids = torch.randint(0, config.vocab_size, (1, total), generator=torch.Generator().manual_seed(1))
    metadata = packed_metadata(lengths)
    labels = input_ids.clone()
    labels[0, metadata["cu_seq_lens_q"][:-1].long()] = -100
    input_ids, labels = input_ids.to(device), labels.to(device)
    metadata["position_ids"] = metadata["position_ids"].to(device)
    backend = None
    if provider == "unpack":
        patch_model(model)
        backend = str(resolve_backend(model))
        batch = {"input_ids": input_ids, "labels": labels, **metadata}
    else:
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": metadata["position_ids"],
            "use_cache": False,
        }

    def packed_step(inputs):
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)

    def one_by_one_step(sample_lengths):
        starts = [0]
        for length in sample_lengths[:-1]:
            starts.append(starts[-1] + length)
        targets = sum(length - 1 for length in sample_lengths)
        for start, length in zip(starts, sample_lengths):
            if length < 2:
                continue  # no target: a sample of one token contributes no loss
            out = model(input_ids=input_ids[:, start : start + length], labels=labels[:, start : start + length])
            (out.loss * ((length - 1) / targets)).backward()
        model.zero_grad(set_to_none=True)

    if provider == "one_by_one":
        one_by_one_step([512])
        seconds = _timed(lambda: one_by_one_step(lengths), repeats, device)
    else:
        warm = {"input_ids": input_ids[:, :512], "labels": labels[:, :512], **packed_metadata([256, 256])}
        warm["position_ids"] = warm["position_ids"].to(device)
        if provider == "stock":
            warm = {"input_ids": warm["input_ids"], "labels": warm["labels"], "position_ids": warm["position_ids"]}
            warm["use_cache"] = False
        packed_step(warm)
        seconds = _timed(lambda: packed_step(batch), repeats, device)
    return {"seconds": min(seconds), "all_seconds": seconds, "peak_mb": _peak_mb(device), "backend": backend}


def attention_worker(case: str, provider: str, repeats: int, device: str, dtype_name: str) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask

    from unpack_trainer.collator import packed_metadata
    from unpack_trainer.patches.attention import PackedSeqInfo, choose_backend, packed_attention_forward

    lengths = case_lengths(case)
    total = sum(lengths)
    config = tiny_llama_config()
    config._attn_implementation = "sdpa"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    # (B, H, T, D) views of (B, T, H, D) projections, as the model hands them over.
    q = make(1, total, heads, dim).transpose(1, 2).requires_grad_()
    k = make(1, total, kv_heads, dim).transpose(1, 2).requires_grad_()
    v = make(1, total, kv_heads, dim).transpose(1, 2).requires_grad_()
    upstream = make(1, total, heads, dim)
    backend = choose_backend(torch.device(device), dtype, "sdpa")

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = heads // kv_heads

    module = Module()
    scaling = dim**-0.5

    def stock():
        position_ids = packed_metadata(lengths)["position_ids"].to(device)
        embeds = torch.empty(1, total, 1, device=device, dtype=dtype)
        mask = create_causal_mask(config, embeds, None, None, position_ids=position_ids)
        out, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)
        out.backward(upstream)

    def unpack():
        info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=total)
        out, _ = packed_attention_forward(
            module, q, k, v, None, scaling=scaling, packed_seq_info=info, backend=backend.name
        )
        out.backward(upstream)

    def one_by_one():
        start = 0
        for length in lengths:
            span = slice(start, start + length)
            out = F.scaled_dot_product_attention(
                q[:, :, span], k[:, :, span], v[:, :, span], is_causal=True, scale=scaling, enable_gqa=True
            )
            out.backward(upstream[:, span].transpose(1, 2))
            start += length

    step = {"stock": stock, "unpack": unpack, "one_by_one": one_by_one}[provider]
    step()
    seconds = _timed(step, repeats, device)
    backend = str(backend) if provider == "unpack" else None
    return {"seconds": min(seconds), "all_seconds": seconds, "peak_mb": _peak_mb(device), "backend": backend}


def run_worker(args: argparse.Namespace) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    worker = model_worker if args.worker == "model" else attention_worker
    result = worker(args.case, args.provider, args.repeats, args.device, args.dtype)
    print(json.dumps(result))


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--parts", default=",".join(PARTS), help="model, attention, or both")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per provider (the minimum is reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--worker", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--provider", choices=PROVIDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    threads = args.threads or torch.get_num_threads()
    print_header("Packed attention: stock transformers vs unpack_trainer vs one by one")
    memory = "torch.cuda.max_memory_allocated" if device == "cuda" else "subprocess peak RSS"
    print(
        f"device {device}, {dtype}, torch threads {threads}; seconds = min of {args.repeats} timed steps; "
        f"peak = {memory}\n"
    )
    backends = set()
    script = os.path.abspath(__file__)
    for part in args.parts.split(","):
        rows = []
        for case in args.cases.split(","):
            lengths = case_lengths(case)
            results = {}
            for provider in PROVIDERS:
                command = [script, "--worker", part, "--case", case, "--provider", provider]
                command += ["--repeats", str(args.repeats), "--threads", str(threads)]
                command += ["--device", device, "--dtype", dtype]
                results[provider] = run_in_subprocess(command, timeout=3600)
                if results[provider].get("backend"):
                    backends.add(results[provider]["backend"])
                print(f"  {part} {case} {provider}: {results[provider]}", file=sys.stderr, flush=True)
            unpack, stock, alone = results["unpack"], results["stock"], results["one_by_one"]
            rows.append(
                [
                    case,
                    len(lengths),
                    stock["seconds"],
                    unpack["seconds"],
                    alone["seconds"],
                    ratio(stock["seconds"], unpack["seconds"]),
                    ratio(unpack["seconds"], alone["seconds"]),
                    round(stock["peak_mb"]),
                    round(unpack["peak_mb"]),
                    round(alone["peak_mb"]),
                    ratio(unpack["peak_mb"], alone["peak_mb"]),
                ]
            )
        title = "Model forward + backward" if part == "model" else "Attention alone (one layer, forward + backward)"
        print(f"### {title}\n")
        headers = [
            "case",
            "samples",
            "stock s",
            "unpack s",
            "one-by-one s",
            "speedup vs stock",
            "time vs one-by-one",
            "stock peak MB",
            "unpack peak MB",
            "one-by-one peak MB",
            "memory vs one-by-one",
        ]
        print(format_table(headers, rows) + "\n")
    print("unpack backend: " + "; ".join(sorted(backends)) + "\n")


if __name__ == "__main__":
    main()
