"""On the GPU, where users train: our trainer against stock TRL in both precision set-ups, attention alone per
backend, RoPE against Liger-Kernel. One command; every number of issue 26's table.

    python benchmarks/bench_gpu.py --out results/            # on a CUDA GPU (minutes); JSON + markdown in --out
    python benchmarks/bench_gpu.py --dry-run                 # everything tiny on the CPU: checks the code, no timings

1. Trainer (Llama-3.2-1B shapes: hidden 2048, 16 layers, 32 / 8 heads of 64, intermediate 8192, vocab 128,256;
   random init), pre-tokenized samples with lognormal lengths (median 400, at most 4,096), rows of 4,096, one
   warm-up step then ``--steps`` timed steps, each case in its own process. Providers: ``trl_padded`` (batch 16),
   ``trl_packing_sdpa`` and ``trl_packing_flex`` (``packing=True``, ``attn_implementation`` sdpa / flex_attention),
   ``ours_packing`` (``packing=True``), ``ours_padding_free`` (automatic, batch 16); precision set-ups ``fp32+bf16``
   (fp32 weights, ``bf16=True``: autocast, TRL's default on a GPU) and ``bf16`` (bf16 weights). Columns: real
   (non-pad) tokens/s, s/step, host time per step (process CPU time) and GPU time per step (the kernels' time in a
   profiled step), peak GPU memory, and the ratios against TRL in the same set-up.
2. Attention alone (fwd + bwd, 32 / 8 heads of 128, bf16, one packed row of lognormal samples, median 400): every
   packed backend that runs here, torch's flex_attention with ``create_block_mask`` (what a user of flex writes), and
   SDPA with the dense ``(T, T)`` mask (8k only), at 8,192 and 65,536 tokens: median ms and peak memory.
3. RoPE (``benchmarks/bench_rope.py``'s cases at 2k / 8k / 32k tokens, bf16 and autocast): ours, transformers' torch
   path, Liger-Kernel's ``liger_rotary_pos_emb`` when installed.

Ratios within one run on one device; the device and versions are printed with the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import environment_line, format_table, lognormal_lengths, run_in_subprocess  # noqa: E402

PROVIDERS = ("trl_padded", "trl_packing_sdpa", "trl_packing_flex", "ours_packing", "ours_padding_free")
PRECISIONS = ("fp32+bf16", "bf16")
LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=512,
)


# --------------------------------------------------------------------------------------------------------- trainer


def _dataset(num_samples: int, max_length: int, median: int, vocab_size: int):
    import numpy as np
    from datasets import Dataset

    lengths = lognormal_lengths(num_samples, median=median, sigma=0.8, low=16, high=max_length)
    rng = np.random.default_rng(0)
    return Dataset.from_dict({"input_ids": [rng.integers(3, vocab_size, size=int(n)).tolist() for n in lengths]})


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"t0": 0, "t1": 1, "t2": 2}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2")


def train_case(provider: str, precision: str, *, dry_run: bool, steps: int) -> dict[str, Any]:
    """One trainer case in this process: ``steps`` timed optimizer steps after one warm-up."""
    import trl
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = torch.cuda.is_available() and not dry_run
    if provider == "trl_packing_flex" and not cuda:
        return {"skipped": "flex_attention has no backward on the CPU"}
    sizes = TINY if dry_run else LLAMA_1B
    max_length, batch_size, median = (128, 4, 40) if dry_run else (4096, 16, 400)
    implementation = "flex_attention" if provider == "trl_packing_flex" else "sdpa"
    torch.manual_seed(0)
    config = LlamaConfig(**sizes, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=implementation)
    with torch.device("cuda" if cuda else "cpu"):  # random init on the GPU: seconds, not a minute, for 1.2B weights
        model = LlamaForCausalLM(config)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    packed = provider in ("trl_packing_sdpa", "trl_packing_flex", "ours_packing")
    rows_per_step = 4 if packed else batch_size  # ours / TRL packing: rows of max_length; padded: samples
    num_samples = (steps + 2) * max(batch_size, 4 * max_length // median) * 2
    dataset = _dataset(num_samples, max_length, median, sizes["vocab_size"])
    arguments = dict(
        output_dir=f"/tmp/bench_gpu/{provider}",
        report_to="none",
        bf16=precision == "fp32+bf16",  # autocast on the GPU (on the CPU too in the dry run)
        use_cpu=not cuda,
        max_length=max_length,
        max_steps=steps + 1,
        per_device_train_batch_size=rows_per_step,
        packing=packed,
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    if provider.startswith("trl"):
        trainer_cls, config_cls = trl.SFTTrainer, trl.SFTConfig
    else:
        from unpack_trainer import SFTConfig, SFTTrainer

        trainer_cls, config_cls = SFTTrainer, SFTConfig
    trainer = trainer_cls(
        model=model, args=config_cls(**arguments), train_dataset=dataset, processing_class=_tokenizer()
    )

    tokens: list[int] = []
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        tokens.append(int((batch["input_ids"] != 0).sum()))  # real tokens: the data never draws the pad id 0
        return batch

    trainer.data_collator = counting_collator
    wall: list[float] = []
    host: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            wall.append(time.perf_counter())
            host.append(time.process_time())
            if cuda and len(wall) == 1:
                torch.cuda.reset_peak_memory_stats()

    trainer.add_callback(Stamp())
    trainer.train()
    timed = wall[-1] - wall[0]
    result: dict[str, Any] = {
        "tokens_per_s": sum(tokens[1 : len(wall)]) / timed,
        "s_per_step": timed / (len(wall) - 1),
        "host_s_per_step": (host[-1] - host[0]) / (len(host) - 1),
        "peak_gib": (
            torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        / 2**30,
        "gpu_s_per_step": _gpu_time_of_one_step(trainer) if cuda else None,
    }
    decision = getattr(trainer, "unpack_decision", None)
    if decision is not None:
        result["mode"] = decision.mode
    return result


def _gpu_time_of_one_step(trainer: Any) -> float:
    """Seconds the GPU spent in kernels during one more training step (torch.profiler, device self time)."""
    from torch.profiler import ProfilerActivity, profile

    batch = next(iter(trainer.get_train_dataloader()))
    batch = trainer._prepare_inputs(batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.training_step(trainer.model, batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    total_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    trainer.optimizer.zero_grad(set_to_none=True)
    return total_us / 1e6


def trainer_table(results: dict[str, dict[str, Any]]) -> str:
    headers = (
        "precision",
        "provider",
        "tokens/s",
        "s/step",
        "host s/step",
        "GPU s/step",
        "peak GiB",
        "vs TRL padded",
        "vs TRL packing (SDPA)",
        "vs TRL packing (flex)",
    )
    rows = []
    for precision in PRECISIONS:
        base = {p: results.get(f"{p}:{precision}", {}) for p in PROVIDERS}

        def ratio(result: dict[str, Any], provider: str, base: dict[str, dict[str, Any]] = base) -> str:
            other = base[provider].get("tokens_per_s")
            return f"{result['tokens_per_s'] / other:.2f}x" if other and "tokens_per_s" in result else "-"

        for provider in PROVIDERS:
            result = base[provider]
            if "tokens_per_s" not in result:
                rows.append((precision, provider, result.get("skipped", result.get("error", "-")), *["-"] * 7))
                continue
            gpu = result.get("gpu_s_per_step")
            rows.append(
                (
                    precision,
                    provider,
                    result["tokens_per_s"],
                    result["s_per_step"],
                    result["host_s_per_step"],
                    "n/a (CPU)" if gpu is None else gpu,
                    result["peak_gib"],
                    ratio(result, "trl_padded"),
                    ratio(result, "trl_packing_sdpa"),
                    ratio(result, "trl_packing_flex"),
                )
            )
    return format_table(headers, rows)


# ------------------------------------------------------------------------------------------------ attention alone


def _row_lengths(total: int, median: int) -> list[int]:
    lengths, used = [], 0
    for n in lognormal_lengths(total // 16 + 16, median=median, sigma=0.8, low=1, high=8 * median).tolist():
        n = min(int(n), total - used)
        lengths.append(n)
        used += n
        if used == total:
            return lengths
    lengths.append(total - used)
    return lengths


def _time_ms(fn: Callable[[], Any], *, device: str, warmup: int, rep: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rep):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def attention_case(provider: str, total: int, *, dry_run: bool) -> dict[str, Any]:
    """One attention provider at ``total`` tokens: median ms of fwd (+ bwd where the device has it) and peak GiB."""
    from unpack_trainer.packed_seq_info import PackedSeqInfo
    from unpack_trainer.patches.attention import backend_unavailable_reason, packed_attention_forward

    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    heads, kv_heads, dim = (4, 2, 16) if dry_run else (32, 8, 128)
    dtype = torch.bfloat16
    lengths = _row_lengths(total, 40 if dry_run else 400)
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=total)
    backward = device == "cuda" or provider not in ("packed_flex", "torch_flex")  # flex: no backward on the CPU
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, total, dim, generator=generator).to(device, dtype).requires_grad_(backward)
        for h in (heads, kv_heads, kv_heads)
    )

    class Module(torch.nn.Module):
        is_causal = True

    if provider.startswith("packed_"):
        backend = provider.removeprefix("packed_")
        reason = backend_unavailable_reason(backend, torch.device(device), dtype)
        if reason is not None:
            return {"skipped": reason}

        def forward():
            return packed_attention_forward(Module(), q, k, v, None, backend=backend, packed_seq_info=info)[0]

    elif provider == "torch_flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)

        def documents(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

        compiled = torch.compile(flex_attention, dynamic=False) if device == "cuda" else flex_attention

        def forward():
            mask = create_block_mask(documents, None, None, total, total, device=device)  # per batch, as a user would
            return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    elif provider == "dense_sdpa":
        if total > 16384:
            return {"skipped": "the dense (T, T) mask at this length: O(T^2) memory"}
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        position = torch.arange(total, device=device)
        mask = (doc[:, None] == doc[None, :]) & (position[None, :] <= position[:, None])

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    else:
        raise ValueError(provider)

    def step():
        out = forward()
        if backward:
            out.float().sum().backward()

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        ms = _time_ms(step, device=device, warmup=1 if dry_run else 3, rep=1 if dry_run else 10)
    except torch.cuda.OutOfMemoryError as error:
        return {"error": f"out of memory: {str(error)[:80]}"}
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"ms": ms, "peak_gib": peak, "backward": backward}


ATTENTION_PROVIDERS = (
    "packed_flash",
    "packed_torch_varlen",
    "packed_xformers",
    "packed_flex",
    "packed_sdpa",
    "torch_flex",
    "dense_sdpa",
)


def attention_table(results: dict[str, dict[str, Any]], lengths: Sequence[int]) -> str:
    headers = ("tokens", "provider", "ms (fwd+bwd)", "peak GiB", "vs torch flex")
    rows = []
    for total in lengths:
        flex = results.get(f"torch_flex:{total}", {}).get("ms")
        for provider in ATTENTION_PROVIDERS:
            result = results.get(f"{provider}:{total}", {})
            if "ms" not in result:
                rows.append((total, provider, result.get("skipped", result.get("error", "-")), "-", "-"))
                continue
            rows.append(
                (
                    total,
                    provider,
                    f"{result['ms']:.3f}" + ("" if result["backward"] else " (fwd)"),
                    "n/a (CPU)" if result["peak_gib"] is None else result["peak_gib"],
                    f"{flex / result['ms']:.2f}x" if flex else "-",
                )
            )
    return format_table(headers, rows)


# ------------------------------------------------------------------------------------------------------------ main


def _run(case: str, *, dry_run: bool, steps: int, timeout: float) -> dict[str, Any]:
    """One case: in its own process on the GPU (its peak memory its own), in this one for the dry run (fast)."""
    try:
        if dry_run:
            return _case(case, dry_run=True, steps=steps)
        command = [os.path.abspath(__file__), "--case", case, "--steps", str(steps)]
        return run_in_subprocess(command, timeout=timeout)
    except Exception as error:  # noqa: BLE001 - one failed case is a cell of the table, not the end of the run
        return {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:160]}"}


def _case(case: str, *, dry_run: bool, steps: int) -> dict[str, Any]:
    kind, *rest = case.split(":")
    if kind == "trainer":
        return train_case(rest[0], rest[1], dry_run=dry_run, steps=steps)
    return attention_case(rest[0], int(rest[1]), dry_run=dry_run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="everything tiny on the CPU (checks the code only)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per trainer case (default 5)")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--attention-tokens", default="8192,65536")
    parser.add_argument("--attention-providers", default=",".join(ATTENTION_PROVIDERS))
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: trainer, attention, rope")
    parser.add_argument("--out", default=None, help="folder for results.json and tables.md")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: one case in this process
    args = parser.parse_args(argv)

    if args.case is not None:
        print(json.dumps(_case(args.case, dry_run=args.dry_run, steps=args.steps)))
        return 0

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "bench_gpu measures a CUDA GPU and none is available; pass --dry-run to check the code.", file=sys.stderr
        )
        return 2
    skip = set(filter(None, args.skip.split(",")))
    steps = 1 if args.dry_run else args.steps
    run = {"dry_run": args.dry_run, "steps": steps}
    timeout = 600 if args.dry_run else 1800
    device = "cpu (dry run: not timings)" if args.dry_run else torch.cuda.get_device_name()
    sections = [f"## bench_gpu on {device}\n\n{environment_line()}\n"]
    results: dict[str, Any] = {"device": device, "environment": environment_line()}

    if "trainer" not in skip:
        trainer_results = {}
        for precision in args.precisions.split(","):
            for provider in args.providers.split(","):
                case = f"trainer:{provider}:{precision}"
                trainer_results[f"{provider}:{precision}"] = _run(case, timeout=timeout, **run)
        results["trainer"] = trainer_results
        sections.append("### Trainer (Llama-3.2-1B shapes)\n\n" + trainer_table(trainer_results))

    if "attention" not in skip:
        lengths = [256, 1024] if args.dry_run else [int(n) for n in args.attention_tokens.split(",")]
        attention_results = {
            f"{provider}:{total}": _run(f"attention:{provider}:{total}", timeout=timeout, **run)
            for total in lengths
            for provider in args.attention_providers.split(",")
        }
        results["attention"] = attention_results
        sections.append("### Attention alone\n\n" + attention_table(attention_results, lengths))

    if "rope" not in skip:
        import bench_rope

        with contextlib.ExitStack() as stack:
            if args.dry_run:
                stack.enter_context(_environ("TRITON_INTERPRET", "1"))
                rows = bench_rope.run_cases(
                    [24], ["packed"], ["bfloat16", "autocast"], device="cpu", heads=4, kv_heads=2, head_dim=16,
                    warmup=1, rep=1,
                )  # fmt: skip
            else:
                rows = bench_rope.run_cases([2048, 8192, 32768], ["packed"], ["bfloat16", "autocast"], device="cuda")
        results["rope"] = rows
        sections.append("### RoPE (fwd+bwd against transformers and Liger-Kernel)\n\n" + bench_rope.format_rows(rows))

    text = "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_gpu.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "bench_gpu.md").write_text(text)
    return 0


@contextlib.contextmanager
def _environ(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


if __name__ == "__main__":
    raise SystemExit(main())
