"""Packed attention: stock transformers (dense block-causal mask) vs the patched model vs the samples one by one.

    python benchmarks/bench_attention.py --threads 1                      # tiny Llama, all cases, model + attention
    python benchmarks/bench_attention.py --threads 1 --arch gemma2,phi3 --cases lognormal-4096
    python benchmarks/bench_attention.py --cases lognormal-4096 --parts attention --rounds 5
    python benchmarks/bench_attention.py --device cuda                    # GPU: bf16; auto, torch_varlen and sdpa

Models (``--arch``, comma-separated): a tiny model of each ``model_type`` built from its config class with the sizes
of ``common.tiny_llama_config`` (hidden 256, 4 layers, 8 heads of 32 dims, 4 kv heads, intermediate 688, vocab 4096)
and the family's own defaults otherwise (gemma2's logit softcapping and sliding-window layers, gemma3's q/k norms,
phi3's fused projections, olmo2's q/k norms ...), in the attention implementation transformers picks for it (SDPA;
eager for gemma2, whose softcapping SDPA cannot apply); training mode, fp32 on CPU, bf16 on CUDA (``--dtype``). Cases,
one row each: ``lognormal-4096`` / ``lognormal-16384`` (lognormal lengths around 180 tokens, the last sample cut to
fill the row) and ``tiny-8192`` (about 1,000 samples of about 8 tokens).

Providers, each in its own subprocess (peak memory belongs to that run alone):

- ``stock``: the unpatched model on the packed row with ``position_ids`` restarting per sample and ``use_cache=False``
  (transformers detects the packing and builds a dense (T, T) block-causal mask);
- ``unpack``: ``patch_model(model)`` on the collator's batch (``packed_seq_lengths``, ``cu_seq_lens_*``, ...), the
  backend chosen automatically; ``unpack:<backend>`` forces one with ``UNPACK_ATTENTION_BACKEND`` (``--backends``);
- ``one_by_one``: every sample alone, forward + backward, its loss weighted by its share of the row's targets (the
  same gradient as the packed row).

``--parts attention`` times the attention of every layer alone (random q/k/v of the layer's shapes, forward +
backward), with each layer's own scaling, sliding window and softcap: ``stock`` = the decoder's mask functions
(``create_causal_mask`` / ``create_sliding_window_causal_mask``) + the model's attention function, ``unpack`` =
metadata + :func:`unpack_trainer.patches.attention.packed_attention_forward`, ``one_by_one`` = the model's attention
function on each sample alone, with the mask transformers builds for that sample.

Timing: ``--rounds`` rounds; in every round each provider runs in turn (interleaved, so that load on a shared machine
hits all of them alike) one warm-up step on 512 tokens and ``--repeats`` timed steps. Reported: the median over all
timed steps and the spread (min-max). Ratios are of medians. Peak memory: the largest over the rounds of the
subprocess's peak RSS on CPU (Python, torch and the model included), ``torch.cuda.max_memory_allocated`` on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import format_table, lognormal_lengths, print_header, run_in_subprocess  # noqa: E402
from common import tiny_config as _sized_config  # noqa: E402

CASES = ("lognormal-4096", "lognormal-16384", "tiny-8192")
PARTS = ("model", "attention")
ARCHS = ("llama", "gemma2", "gemma3_text", "phi3", "olmo2")
# Family-specific overrides that keep the tiny model consistent (gemma scales by query_pre_attn_scalar ** -0.5).
ARCH_OVERRIDES: dict[str, dict] = {
    "gemma2": dict(query_pre_attn_scalar=32),
    "gemma3_text": dict(query_pre_attn_scalar=32),
}


def tiny_config(arch: str):
    """A tiny config of ``arch`` (any ``model_type`` of transformers' causal-LM mapping) at ``common.TINY_SIZES``."""
    return _sized_config(arch, **ARCH_OVERRIDES.get(arch, {}))


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


def _build_model(arch: str, device: str, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=getattr(torch, dtype_name))
    model.train()
    return model


def model_worker(arch: str, case: str, provider: str, repeats: int, device: str, dtype_name: str) -> dict:
    import torch

    from unpack_trainer.data.collator import packed_metadata
    from unpack_trainer.models import patch_model, resolve_backend

    lengths = case_lengths(case)
    total = sum(lengths)
    model = _build_model(arch, device, dtype_name)
    implementation = model.config._attn_implementation
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab, (1, total), generator=torch.Generator().manual_seed(1))
    metadata = packed_metadata(lengths)
    labels = input_ids.clone()
    labels[0, metadata["cu_seq_lens_q"][:-1].long()] = -100
    input_ids, labels = input_ids.to(device), labels.to(device)
    metadata["position_ids"] = metadata["position_ids"].to(device)
    backend = None
    if provider.startswith("unpack"):
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
            out = model(
                input_ids=input_ids[:, start : start + length],
                labels=labels[:, start : start + length],
                use_cache=False,
            )
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
    return {"seconds": seconds, "peak_mb": _peak_mb(device), "backend": backend, "implementation": implementation}


def attention_worker(arch: str, case: str, provider: str, repeats: int, device: str, dtype_name: str) -> dict:
    import sys as _sys

    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from unpack_trainer.data.collator import packed_metadata
    from unpack_trainer.packed_seq_info import PackedSeqInfo
    from unpack_trainer.patches.attention import packed_attention_forward

    lengths = case_lengths(case)
    total = sum(lengths)
    model = _build_model(arch, device, dtype_name)
    config = model.config
    implementation = config._attn_implementation
    dtype = getattr(torch, dtype_name)
    modules = [layer.self_attn for layer in model.model.layers]
    if implementation == "eager":
        function = _sys.modules[type(modules[0]).__module__].eager_attention_forward
    else:
        function = ALL_ATTENTION_FUNCTIONS[implementation]
    generator = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    layers = []
    for module in modules:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = module.head_dim
        # (B, H, T, D) views of (B, T, H, D) projections, as the model hands them over.
        q = make(1, total, heads, dim).transpose(1, 2).requires_grad_()
        k = make(1, total, kv_heads, dim).transpose(1, 2).requires_grad_()
        v = make(1, total, kv_heads, dim).transpose(1, 2).requires_grad_()
        upstream = make(1, total, heads, dim)
        options = {"scaling": module.scaling, "dropout": 0.0}
        if getattr(module, "sliding_window", None) is not None:
            options["sliding_window"] = module.sliding_window
        if getattr(module, "attn_logit_softcapping", None) is not None:
            options["softcap"] = module.attn_logit_softcapping
        layers.append((module, q, k, v, upstream, options))

    def masks(length: int, position_ids) -> dict:
        embeds = torch.empty(1, length, 1, device=device, dtype=dtype)
        return {
            None: create_causal_mask(config, embeds, None, None, position_ids=position_ids),
            "sliding": create_sliding_window_causal_mask(config, embeds, None, None, position_ids=position_ids)
            if getattr(config, "sliding_window", None) is not None
            else None,
        }

    def stock():
        built = masks(total, packed_metadata(lengths)["position_ids"].to(device))
        for module, q, k, v, upstream, options in layers:
            mask = built["sliding" if "sliding_window" in options else None]
            out, _ = function(module, q, k, v, mask, **options)
            out.backward(upstream)

    def unpack():
        info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=total)
        for module, q, k, v, upstream, options in layers:
            out, _ = packed_attention_forward(
                module, q, k, v, None, packed_seq_info=info, original_implementation=implementation, **options
            )
            out.backward(upstream)

    def one_by_one():
        start = 0
        for length in lengths:
            span = slice(start, start + length)
            built = masks(length, torch.arange(length, device=device).unsqueeze(0))
            for module, q, k, v, upstream, options in layers:
                mask = built["sliding" if "sliding_window" in options else None]
                out, _ = function(module, q[:, :, span], k[:, :, span], v[:, :, span], mask, **options)
                out.backward(upstream[:, span])
            start += length

    step = {"stock": stock, "one_by_one": one_by_one}.get(provider, unpack)
    step()
    seconds = _timed(step, repeats, device)
    backend = None
    if provider.startswith("unpack"):
        from unpack_trainer.patches.attention import AttentionFeature, Needs, choose_backend

        _, q, _, v, _, options = layers[0]
        head_dim = max(q.shape[-1], v.shape[-1])
        wanted = {AttentionFeature.SOFTCAP} if "softcap" in options else set()
        choice = choose_backend(q.device, dtype, implementation, Needs(wanted, head_dim))
        backend = str(choice)
    return {"seconds": seconds, "peak_mb": _peak_mb(device), "backend": backend, "implementation": implementation}


def run_worker(args: argparse.Namespace) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if ":" in args.provider:
        os.environ["UNPACK_ATTENTION_BACKEND"] = args.provider.split(":", 1)[1]
    worker = model_worker if args.worker == "model" else attention_worker
    result = worker(args.arch, args.case, args.provider, args.repeats, args.device, args.dtype)
    print(json.dumps(result))


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def seconds_cell(seconds: list[float]) -> str:
    """``median [min-max]`` of the timed steps."""
    return f"{statistics.median(seconds):.3f} [{min(seconds):.3f}-{max(seconds):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama", help="comma-separated model types, e.g. " + ",".join(ARCHS))
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--parts", default=",".join(PARTS), help="model, attention, or both")
    parser.add_argument(
        "--backends",
        default=None,
        help="packed providers: 'auto' (the automatic choice) and/or forced backends, comma-separated "
        "(default: auto on CPU; auto,torch_varlen,sdpa on CUDA)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each provider once per round)")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per provider and round")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--worker", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--provider", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    threads = args.threads or torch.get_num_threads()
    backends = (args.backends or ("auto,torch_varlen,sdpa" if device == "cuda" else "auto")).split(",")
    packed = ["unpack" if backend == "auto" else f"unpack:{backend}" for backend in backends]
    providers = ["stock", *packed, "one_by_one"]
    print_header("Packed attention: stock transformers vs unpack_trainer vs one by one")
    memory = "torch.cuda.max_memory_allocated" if device == "cuda" else "subprocess peak RSS"
    print(
        f"device {device}, {dtype}, torch threads {threads}; seconds = median [min-max] of {args.rounds} interleaved "
        f"rounds x {args.repeats} timed step(s); peak = {memory}\n"
    )
    script = os.path.abspath(__file__)
    reasons: set[str] = set()
    for part in args.parts.split(","):
        rows = []
        for arch in args.arch.split(","):
            for case in args.cases.split(","):
                lengths = case_lengths(case)
                results: dict[str, dict] = {name: {"seconds": [], "peak_mb": 0.0} for name in providers}
                for _ in range(args.rounds):
                    for provider in providers:
                        command = [script, "--worker", part, "--arch", arch, "--case", case, "--provider", provider]
                        command += ["--repeats", str(args.repeats), "--threads", str(threads)]
                        command += ["--device", device, "--dtype", dtype]
                        result = run_in_subprocess(command, timeout=3600)
                        print(f"  {part} {arch} {case} {provider}: {result}", file=sys.stderr, flush=True)
                        merged = results[provider]
                        merged["seconds"] += result["seconds"]
                        merged["peak_mb"] = max(merged["peak_mb"], result["peak_mb"])
                        merged["backend"] = result.get("backend")
                        merged["implementation"] = result.get("implementation")
                        if result.get("backend"):
                            reasons.add(f"{arch} {provider}: {result['backend']}")
                stock, alone = results["stock"], results["one_by_one"]
                for name in packed:
                    unpack = results[name]
                    rows.append(
                        [
                            arch,
                            stock["implementation"],
                            case,
                            len(lengths),
                            (unpack["backend"] or "?").split(" (", 1)[0],
                            seconds_cell(stock["seconds"]),
                            seconds_cell(unpack["seconds"]),
                            seconds_cell(alone["seconds"]),
                            ratio(statistics.median(stock["seconds"]), statistics.median(unpack["seconds"])),
                            ratio(statistics.median(unpack["seconds"]), statistics.median(alone["seconds"])),
                            round(stock["peak_mb"]),
                            round(unpack["peak_mb"]),
                            round(alone["peak_mb"]),
                        ]
                    )
        title = "Model forward + backward" if part == "model" else "Attention alone (every layer, forward + backward)"
        print(f"### {title}\n")
        headers = [
            "arch",
            "stock attn",
            "case",
            "samples",
            "unpack backend",
            "stock s",
            "unpack s",
            "one-by-one s",
            "speedup vs stock",
            "time vs one-by-one",
            "stock peak MB",
            "unpack peak MB",
            "one-by-one peak MB",
        ]
        print(format_table(headers, rows) + "\n")
    print("unpack backends, as chosen:\n" + "\n".join(f"- {reason}" for reason in sorted(reasons)) + "\n")


if __name__ == "__main__":
    main()
