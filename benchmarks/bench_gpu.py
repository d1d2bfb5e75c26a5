"""On the GPU, where users train: our trainer against stock TRL in both precision set-ups and across model families,
attention alone per backend, RoPE against Liger-Kernel. One command; each case's result is written the moment it
exists, so a GPU loan that ends early keeps everything measured so far.

    python benchmarks/bench_gpu.py --out results/ --budget 300   # on a CUDA GPU: cases in priority order, 300 s
    python benchmarks/bench_gpu.py --list                        # the cases, in priority order, with their estimate
    python benchmarks/bench_gpu.py --cases 'trainer:llama1b:*'   # only the cases matching these patterns
    python benchmarks/bench_gpu.py --dry-run                     # everything tiny on the CPU: checks the code only

Cases (``--list`` prints them in the order they run):

1. ``trainer:<model>:<provider>:<precision>[:compile][:no_checkpointing]`` -- pre-tokenized samples with lognormal lengths (median 400,
   at most 4,096), rows of 4,096, one warm-up step then ``--steps`` timed steps, each case in its own process.
   Models: ``llama1b`` (Llama-3.2-1B shapes: hidden 2048, 16 layers, 32 / 8 heads of 64, vocab 128,256),
   ``llama8b_lora`` (Llama-3.1-8B shapes, LoRA r 16 on every linear layer, bf16 weights, one row per step), and one
   model per family at about 1B parameters: ``qwen3``, ``mistral`` (sliding window 1,024), ``gemma3`` (logit softcap,
   local / global layers), ``gpt_oss`` (attention sinks, MoE), ``qwen3_moe``, ``qwen3_5`` (hybrid: gated delta net
   through flash-linear-attention). Providers: ``trl_padded`` (batch 16), ``trl_packing_sdpa`` /
   ``trl_packing_flex`` (``packing=True``, ``attn_implementation`` sdpa / flex_attention), ``ours_packing``
   (``packing=True``), ``ours_packing_flex`` (the same with ``UNPACK_ATTENTION_BACKEND=flex``),
   ``ours_packing_liger_loss`` (the same with ``loss_kernel="liger"``: Liger-Kernel's fused linear cross-entropy),
   ``ours_packing_liger`` / ``trl_packing_liger`` (``use_liger_kernel=True``: Liger's RoPE, RMSNorm, SwiGLU, and in
   TRL its loss), ``ours_padding_free`` (automatic, batch 16). Precisions: ``fp32-bf16`` (fp32 weights, ``bf16=True``: autocast,
   TRL's default on a GPU), ``bf16`` (bf16 weights, no autocast) and, for the LoRA case, ``bf16-bf16`` (bf16 weights
   with ``bf16=True``: TRL's default for a model loaded in bf16). ``:compile``: ``torch_compile=True``. Activation
   checkpointing is on, as TRL's ``SFTConfig`` sets it by default (``gradient_checkpointing=True``: every layer's
   forward runs twice), in every case but ``:no_checkpointing`` (``gradient_checkpointing=False``).
   Columns: real (non-pad) tokens/s, s/step, the first step's seconds (compilation included: flex, ``--compile``),
   host (process CPU) and GPU (kernels in a profiled step) seconds per step, the profiled step's GPU time by kernel
   class (GEMM, attention, loss, optimizer, elementwise and the rest), the GPU's busy share of one more step run as
   transformers' loop runs it and its idle milliseconds by host phase (fetching and collating the batch; forward and
   backward; the optimizer), model FLOP utilisation (6 x parameters per
   token, 4 x with LoRA's frozen base; MoE: the active parameters), hardware FLOP utilisation (the same with the
   forward recomputed under checkpointing: 2 x parameters more), peak GPU memory, ratios against TRL in the same
   model, precision and set-up.
2. ``attention:<provider>:<tokens>`` -- attention alone (fwd + bwd, 32 / 8 heads of 128, bf16, one packed row of
   lognormal samples, median 400) on every packed backend that runs here, torch's flex_attention with
   ``create_block_mask`` per call (what a user of flex writes), SDPA with the dense ``(T, T)`` mask (8k only).
3. ``rope:all`` -- ``benchmarks/bench_rope.py``'s cases at 2k / 8k / 32k tokens, bf16 and autocast: ours,
   transformers' torch path, Liger-Kernel's ``liger_rotary_pos_emb`` when installed.

``--out`` gets ``bench_gpu.json`` (every case's result as it comes) and ``bench_gpu.md`` (the tables), both rewritten
after each case. File names hold only letters, digits, ``.``, ``_`` and ``-`` (what a GPU machine hands back).
Ratios within one run on one device; the device and versions are written with the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import environment_line, format_table, lognormal_lengths  # noqa: E402

PROVIDERS = (
    "trl_padded",
    "trl_packing_sdpa",
    "trl_packing_flex",
    "ours_packing",
    "ours_packing_flex",
    "ours_packing_liger_loss",
    "ours_packing_liger",
    "trl_packing_liger",
    "ours_padding_free",
)
PRECISIONS = ("fp32-bf16", "bf16")
# Precisions that train under autocast (``bf16=True``); ``bf16-bf16``: bf16 weights with ``bf16=True``, what a model
# loaded in bf16 gets from TRL's default config (its LoRA adapters stay float32, PEFT's default, computed in bf16).
AUTOCAST_PRECISIONS = ("fp32-bf16", "bf16-bf16")
# A trainer case's options after its precision, with their label in the tables.
OPTIONS = {"compile": "compile", "no_checkpointing": "no checkpointing"}
# Dense bf16 tensor-core peak (FLOP/s) per device name fragment, for the model FLOP utilisation column.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}

# --------------------------------------------------------------------------------------------------------- models

LLAMA_1B = dict(
    model_type="llama",
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
# One model per family at about 1B parameters (the families' own features switched on), for the family rows.
MODELS: dict[str, dict[str, Any]] = {
    "llama1b": LLAMA_1B,
    "llama8b_lora": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=32768,
        max_position_embeddings=8192,
        sliding_window=1024,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        hidden_size=1152,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=6912,
        vocab_size=262144,
        max_position_embeddings=8192,
        sliding_window=512,
        attn_logit_softcapping=50.0,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        num_local_experts=16,
        num_experts_per_tok=4,
        vocab_size=201088,
        max_position_embeddings=8192,
        sliding_window=128,
        attn_implementation="eager",  # transformers has no SDPA path for gpt_oss (its sinks)
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=3072,
        moe_intermediate_size=512,
        num_experts=32,
        num_experts_per_tok=4,
        vocab_size=151936,
        max_position_embeddings=8192,
    ),
    "qwen3_5": dict(
        model_type="qwen3_5_text",
        hidden_size=1536,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=6144,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 4,
        vocab_size=151936,
        max_position_embeddings=8192,
    ),
}
FAMILIES = ("qwen3", "mistral", "gemma3", "gpt_oss", "qwen3_moe", "qwen3_5")
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


def model_config(model: str, *, dry_run: bool) -> Any:
    """The transformers config of ``model`` (a key of :data:`MODELS`); tiny in the dry run, the family's fields
    kept (a MoE stays a MoE, a hybrid keeps one linear and one full attention layer)."""
    from transformers import AutoConfig

    fields = dict(MODELS[model])
    model_type = fields.pop("model_type")
    fields.pop("attn_implementation", None)
    if dry_run:
        fields.update(TINY)
        for name in ("moe_intermediate_size", "linear_key_head_dim", "linear_value_head_dim"):
            if name in fields:
                fields[name] = 16
        if "num_experts" in fields:
            fields.update(num_experts=4, num_experts_per_tok=2)
        if "num_local_experts" in fields:
            fields.update(num_local_experts=4, num_experts_per_tok=2)
        if "linear_num_key_heads" in fields:
            fields.update(linear_num_key_heads=2, linear_num_value_heads=4)
        if "layer_types" in fields:
            fields["layer_types"] = ["linear_attention", "full_attention"]
        if "sliding_window" in fields:
            fields["sliding_window"] = 32
    return AutoConfig.for_model(model_type, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)


def flops_per_token(model: torch.nn.Module, *, lora: bool) -> float:
    """Model FLOPs per trained token: 6 x the parameters a token passes through (4 x where the base is frozen and
    only activations' gradients flow: LoRA), the tied embedding counted once, a MoE's experts scaled to the ones a
    token is routed to. Attention's own FLOPs are left out, as the usual model FLOP utilisation does."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    routed = getattr(config, "num_experts_per_tok", None)
    total = 0.0
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            continue
        count = parameter.numel()
        if experts and routed and re.search(r"\.experts\.", name):
            count *= routed / experts
        total += count
    return (4.0 if lora else 6.0) * total


def recompute_flops_per_token(flops: float, *, lora: bool) -> float:
    """The FLOPs activation checkpointing adds per token to :func:`flops_per_token`'s ``flops``: one more forward
    (2 x the parameters, a third of 6 x, half of LoRA's 4 x)."""
    return flops / (2.0 if lora else 3.0)


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


def _build_model(model: str, precision: str, implementation: str, *, cuda: bool, dry_run: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = model_config(model, dry_run=dry_run)
    config._attn_implementation = implementation
    dtype = torch.float32 if precision == "fp32-bf16" else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: an 8B model never exists in fp32 first
    try:
        with torch.device("cuda" if cuda else "cpu"):  # random init on the GPU: seconds, not minutes
            built = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    finally:
        torch.set_default_dtype(previous)
    return built


def train_case(
    model: str,
    provider: str,
    precision: str,
    *,
    compile: bool,
    dry_run: bool,
    steps: int,
    checkpointing: bool = True,
) -> dict[str, Any]:
    """One trainer case in this process: ``steps`` timed optimizer steps after one warm-up step. ``checkpointing``:
    ``gradient_checkpointing`` (TRL's default, on), set explicitly on both sides."""
    import trl
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = torch.cuda.is_available() and not dry_run
    flex = provider.endswith("_flex")
    if flex and not cuda:
        return {"skipped": "flex_attention has no backward on the CPU"}
    if "liger" in provider and not cuda:
        return {"skipped": "Liger-Kernel's Triton kernels run on CUDA (on the CPU only under Triton's interpreter)"}
    lora = model.endswith("_lora")
    if lora and precision not in ("bf16", "bf16-bf16"):
        return {"skipped": "the LoRA case runs bf16 weights only"}
    if provider == "ours_packing_flex":
        os.environ["UNPACK_ATTENTION_BACKEND"] = "flex"
    liger = provider.endswith("_liger")  # use_liger_kernel=True: Liger's RoPE, RMSNorm, SwiGLU (and, in TRL, loss)
    implementation = MODELS[model].get("attn_implementation", "sdpa")
    if provider == "trl_packing_flex":
        implementation = "flex_attention"
    torch.manual_seed(0)
    built = _build_model(model, precision, implementation, cuda=cuda, dry_run=dry_run)
    vocab_size = built.config.get_text_config().vocab_size
    max_length, batch_size, median = (128, 4, 40) if dry_run else (4096, 16, 400)
    packed = "packing" in provider
    rows_per_step = 1 if lora else 4
    per_step = rows_per_step if packed else batch_size  # packed: rows of max_length; padded: samples
    num_samples = (steps + 3) * max(batch_size, rows_per_step * max_length // median) * 2
    dataset = _dataset(num_samples, max_length, median, vocab_size)
    arguments = dict(
        output_dir=f"/tmp/bench_gpu/{model}-{provider}",
        report_to="none",
        bf16=precision in AUTOCAST_PRECISIONS,  # autocast on the GPU (on the CPU too in the dry run)
        use_cpu=not cuda,
        max_length=max_length,
        max_steps=steps + 1,
        per_device_train_batch_size=per_step,
        packing=packed,
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        torch_compile=compile,
        use_liger_kernel=liger,
        gradient_checkpointing=checkpointing,
    )
    if provider == "ours_packing_liger_loss":
        arguments["loss_kernel"] = "liger"
    if provider.startswith("trl"):
        trainer_cls, config_cls = trl.SFTTrainer, trl.SFTConfig
    else:
        from unpack_trainer import SFTConfig, SFTTrainer

        trainer_cls, config_cls = SFTTrainer, SFTConfig
    extra = {}
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trainer_cls(
        model=built, args=config_cls(**arguments), train_dataset=dataset, processing_class=_tokenizer(), **extra
    )
    flops = flops_per_token(trainer.model, lora=lora)

    # Real tokens per step, counted where each batch is trained on (whatever collator the trainer settled on: a
    # fallback to padded batches at the start of training replaces it); the data never draws the pad id 0.
    tokens: list[Any] = []
    training_step = trainer.training_step

    def counting_step(model, inputs, *args, **kwargs):
        if len(tokens) < len(wall):  # one count per optimizer step (one micro-batch per step here)
            tokens.append((inputs["input_ids"] != 0).sum())
        return training_step(model, inputs, *args, **kwargs)

    trainer.training_step = counting_step
    wall: list[float] = []
    host: list[float] = []

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            wall.append(time.perf_counter())
            host.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            wall.append(time.perf_counter())
            host.append(time.process_time())
            if cuda and len(wall) == 2:
                torch.cuda.reset_peak_memory_stats()

    trainer.add_callback(Stamp())
    trainer.train()
    timed = wall[-1] - wall[1]
    tokens_per_s = sum(int(count) for count in tokens[1 : len(wall) - 1]) / timed
    result: dict[str, Any] = {
        "tokens_per_s": tokens_per_s,
        "s_per_step": timed / (len(wall) - 2),
        "first_step_s": wall[1] - wall[0],
        "host_s_per_step": (host[-1] - host[1]) / (len(host) - 2),
        "peak_gib": (
            torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        / 2**30,
        "flops_per_token": flops,
        "activation_checkpointing": bool(trainer.args.gradient_checkpointing),
    }
    if cuda:
        result.update(_profile_one_step(trainer))
        result.update(_profile_idle(trainer))
        peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
        if peak is not None:
            result["mfu"] = flops * tokens_per_s / peak
            hardware = flops + (recompute_flops_per_token(flops, lora=lora) if checkpointing else 0.0)
            result["hfu"] = hardware * tokens_per_s / peak
    decision = getattr(trainer, "unpack_decision", None)
    if decision is not None:
        result["mode"] = decision.mode
        result["reason"] = decision.reason
    return result


# Kernel names by class, matched in this order (attention kernels of every backend first: flash-attention's and
# SDPA's memory-efficient kernels carry CUTLASS in their names; then a cuBLAS / CUTLASS / inductor GEMM, the loss, the
# optimizer); the rest is elementwise work, copies and reductions.
KERNEL_CLASSES = (
    ("attention", re.compile(r"flash|fmha|attn|attention|flex|varlen|triton_tem_fused_(?!(addmm|mm|bmm)_)", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|wgmma|splitk|triton_tem_fused_(addmm|mm|bmm)", re.I)),
    ("loss", re.compile(r"cross_entropy|nll_loss|log_softmax|logsumexp|liger.*(ce|cross)", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|fused_sgd|_amp_", re.I)),
)


def kernel_class(name: str) -> str:
    """The class of a GPU kernel by its name (:data:`KERNEL_CLASSES`; ``other``: elementwise, copies, norms)."""
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


def _profile_one_step(trainer: Any) -> dict[str, Any]:
    """One more training step under torch.profiler: the GPU's kernel seconds, in all and by :func:`kernel_class`."""
    from torch.profiler import ProfilerActivity, profile

    batch = next(iter(trainer.get_train_dataloader()))
    batch = trainer._prepare_inputs(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.training_step(trainer.model, batch)
        if trainer.optimizer is not None:
            trainer.optimizer.step()
        torch.cuda.synchronize()
    trainer.optimizer.zero_grad(set_to_none=True)
    split: dict[str, float] = {}
    kernels: list[tuple[float, str]] = []
    for event in prof.key_averages():
        if "cuda" not in str(getattr(event, "device_type", "")).lower():
            continue  # a CPU-side op: its kernels are events of their own
        seconds = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)) / 1e6
        label = kernel_class(event.key)
        split[label] = split.get(label, 0.0) + seconds
        kernels.append((seconds, f"{label}: {event.key[:120]}"))
    top = [{"s": seconds, "kernel": name} for seconds, name in sorted(kernels, reverse=True)[:25]]
    return {"gpu_s_per_step": sum(split.values()), "gpu_split_s": split, "gpu_top_kernels": top}


# The host phases of one training step, in the order transformers' loop runs them.
PHASES = ("data", "forward_backward", "optimizer")


def gpu_idle_by_phase(
    phases: dict[str, tuple[float, float]], kernels: Sequence[tuple[float, float]]
) -> dict[str, float]:
    """Seconds of each host phase during which the GPU ran nothing.

    Args:
        phases: ``{name: (start, end)}`` host intervals in microseconds, one clock with ``kernels``.
        kernels: ``(start, end)`` of every GPU kernel / copy in microseconds (overlapping ones allowed: streams).

    Returns:
        ``{name: idle seconds}``: the phase's length minus the time at least one kernel ran within it (a kernel
        launched in one phase and running into the next counts as busy time of the next).
    """
    merged: list[list[float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    idle = {}
    for name, (start, end) in phases.items():
        busy = sum(max(0.0, min(end, k_end) - max(start, k_start)) for k_start, k_end in merged)
        idle[name] = max(0.0, end - start - busy) / 1e6
    return idle


def _profile_idle(trainer: Any) -> dict[str, Any]:
    """One more training step, the way transformers' loop runs it (the next batch fetched and collated, moved to
    the device; forward and backward with the loop's nan / inf check of the loss, a host sync; gradient clipping,
    optimizer and scheduler step, zero_grad), under torch.profiler with the host recorded: the seconds the GPU sat
    idle in each host phase (:func:`gpu_idle_by_phase`) and its busy share of the step. The host's recording makes
    its phases slightly longer than unprofiled; a diagnostic of where the GPU waits, not a timing."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model, args = trainer.model, trainer.args
    cuda = next(model.parameters()).is_cuda
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    iterator = iter(trainer.get_train_dataloader())
    next(iterator)  # the iterator's start-up is not a step's
    synchronize()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        with record_function("bench_gpu:data"):
            batch = trainer._prepare_inputs(next(iterator))
        with record_function("bench_gpu:forward_backward"):
            loss = trainer.training_step(model, batch)
            bool(torch.isnan(loss) or torch.isinf(loss))  # transformers' logging_nan_inf_filter (default on)
        with record_function("bench_gpu:optimizer"):
            if args.max_grad_norm and args.max_grad_norm > 0:
                trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            trainer.optimizer.step()
            if trainer.lr_scheduler is not None:
                trainer.lr_scheduler.step()
            model.zero_grad()
        synchronize()
    phases: dict[str, tuple[float, float]] = {}
    kernels: list[tuple[float, float]] = []
    for event in prof.events():
        on_device = "cuda" in str(getattr(event, "device_type", "")).lower()
        span = (float(event.time_range.start), float(event.time_range.end))
        if event.name.startswith("bench_gpu:"):
            if not on_device:
                phases[event.name.split(":", 1)[1]] = span
        elif on_device:
            kernels.append(span)
    idle = gpu_idle_by_phase(phases, kernels)
    total = sum(end - start for start, end in phases.values()) / 1e6
    return {"gpu_idle_s": idle, "gpu_busy": 1.0 - sum(idle.values()) / total if total > 0 else None}


def _ratio(result: dict[str, Any], other: dict[str, Any] | None) -> str:
    if not other or "tokens_per_s" not in other or "tokens_per_s" not in result:
        return "-"
    return f"{result['tokens_per_s'] / other['tokens_per_s']:.2f}x"


def trainer_table(results: dict[str, dict[str, Any]]) -> str:
    """Every trainer case measured so far, by model, precision and compile set-up, with its ratios against TRL's
    padded and packing runs of the same set-up."""
    headers = (
        "model",
        "precision",
        "provider",
        "tokens/s",
        "s/step",
        "first step s",
        "host s/step",
        "GPU s/step",
        "GPU split gemm/attn/loss/optim/other",
        "GPU busy (idle ms data/fwd-bwd/optim)",
        "MFU",
        "HFU",
        "peak GiB",
        "vs TRL padded",
        "vs TRL packing (SDPA)",
        "vs TRL packing (flex)",
    )
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for case, result in results.items():
        _, model, provider, precision, *options = case.split(":")
        groups.setdefault((model, precision, ":".join(options)), {})[provider] = result
    rows = []
    for (model, precision, options), by_provider in groups.items():
        label = " ".join([precision, *(OPTIONS[option] for option in options.split(":") if option)])
        for provider in PROVIDERS:
            if provider not in by_provider:
                continue
            result = by_provider[provider]
            if "tokens_per_s" not in result:
                why = result.get("skipped", result.get("error", "-"))
                rows.append((model, label, provider, why, *["-"] * 12))
                continue
            split = result.get("gpu_split_s")
            split_text = "-"
            if split:
                split_text = " / ".join(
                    f"{split.get(k, 0.0):.3f}" for k in ("gemm", "attention", "loss", "optimizer", "other")
                )
            gpu = result.get("gpu_s_per_step")
            mfu, hfu = result.get("mfu"), result.get("hfu")
            busy, idle = result.get("gpu_busy"), result.get("gpu_idle_s")
            busy_text = "-"
            if busy is not None and idle:
                busy_text = f"{100 * busy:.1f}% (" + " / ".join(f"{1e3 * idle.get(p, 0.0):.1f}" for p in PHASES) + ")"
            ran = provider
            if provider.startswith("ours") and result.get("mode") not in (None, "pack", "padding_free"):
                ran = f"{provider} (ran {result['mode']}: {result.get('reason', 'reason not recorded')})"
            rows.append(
                (
                    model,
                    label,
                    ran,
                    result["tokens_per_s"],
                    result["s_per_step"],
                    result["first_step_s"],
                    result["host_s_per_step"],
                    "n/a (CPU)" if gpu is None else gpu,
                    split_text,
                    busy_text,
                    "-" if mfu is None else f"{100 * mfu:.1f}%",
                    "-" if hfu is None else f"{100 * hfu:.1f}%",
                    result["peak_gib"],
                    _ratio(result, by_provider.get("trl_padded")),
                    _ratio(result, by_provider.get("trl_packing_sdpa")),
                    _ratio(result, by_provider.get("trl_packing_flex")),
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
    if dry_run:
        total //= 32  # the code, not the size
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


def attention_table(results: dict[str, dict[str, Any]]) -> str:
    headers = ("tokens", "provider", "ms (fwd+bwd)", "peak GiB", "vs torch flex")
    rows = []
    lengths = sorted({int(case.rsplit(":", 1)[1]) for case in results})
    for total in lengths:
        flex = results.get(f"attention:torch_flex:{total}", {}).get("ms")
        for provider in ATTENTION_PROVIDERS:
            result = results.get(f"attention:{provider}:{total}")
            if result is None:
                continue
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


# ------------------------------------------------------------------------------------------------------------ RoPE


def rope_case(*, dry_run: bool) -> dict[str, Any]:
    import bench_rope

    with contextlib.ExitStack() as stack:
        if dry_run:
            stack.enter_context(_environ("TRITON_INTERPRET", "1"))
            rows = bench_rope.run_cases(
                [24], ["packed"], ["bfloat16", "autocast"], device="cpu", heads=4, kv_heads=2, head_dim=16,
                warmup=1, rep=1,
            )  # fmt: skip
        else:
            rows = bench_rope.run_cases([2048, 8192, 32768], ["packed"], ["bfloat16", "autocast"], device="cuda")
    return {"rows": rows}


# ----------------------------------------------------------------------------------------------------------- cases


class Case(NamedTuple):
    """One measured case: its name (``section:...``, see the module docstring) and the seconds it is expected to
    take on an H100 / H200 (process start, model build, warm-up and timed steps), which ``--budget`` plans with."""

    name: str
    estimate_s: float

    @property
    def section(self) -> str:
        return self.name.split(":", 1)[0]


def all_cases() -> list[Case]:
    """Every case, in priority order: the headline comparison first (ours vs TRL packing on Llama-3.2-1B shapes, both
    precisions), the goals' candidates without activation checkpointing, then the 8B LoRA case, padding-free, flex in training, attention alone, the families, compile,
    TRL's flex packing (minutes of compilation), RoPE."""
    cases: list[Case] = []

    def trainer(
        model: str, provider: str, precision: str, compile: bool = False, estimate: float = 45, ckpt: bool = True
    ) -> None:
        options = (":compile" if compile else "") + ("" if ckpt else ":no_checkpointing")
        cases.append(Case(f"trainer:{model}:{provider}:{precision}{options}", estimate))

    for precision in PRECISIONS:
        trainer("llama1b", "ours_packing", precision)
        trainer("llama1b", "trl_packing_sdpa", precision)
    # The goals' candidates without TRL's default activation checkpointing (the forward is not run twice): the
    # fastest Llama-1B set-up (model FLOP utilisation) and the 8B LoRA case (tokens/s), each against TRL's.
    trainer("llama1b", "ours_packing_liger", "bf16", ckpt=False)
    trainer("llama8b_lora", "ours_packing_liger", "bf16-bf16", estimate=75, ckpt=False)
    trainer("llama8b_lora", "trl_packing_sdpa", "bf16-bf16", estimate=75, ckpt=False)
    trainer("llama8b_lora", "ours_packing_liger", "bf16-bf16", estimate=75)
    trainer("llama8b_lora", "ours_packing", "bf16-bf16", estimate=75, ckpt=False)
    for precision in PRECISIONS:
        trainer("llama1b", "ours_packing", precision, ckpt=False)
        trainer("llama1b", "trl_packing_sdpa", precision, ckpt=False)
    for provider in ("ours_packing_liger_loss", "ours_packing_liger", "trl_packing_liger"):
        trainer("llama1b", provider, "fp32-bf16")
    trainer("llama8b_lora", "ours_packing", "bf16", estimate=75)
    trainer("llama8b_lora", "trl_packing_sdpa", "bf16", estimate=75)
    for provider in ("ours_packing_liger", "trl_packing_liger"):
        trainer("llama1b", provider, "bf16")
    trainer("llama8b_lora", "ours_packing_liger", "bf16", estimate=75)
    for precision in PRECISIONS:
        trainer("llama1b", "ours_padding_free", precision)
        trainer("llama1b", "trl_padded", precision)
    for precision in PRECISIONS:
        trainer("llama1b", "ours_packing_flex", precision, estimate=90)
    for provider in ("packed_torch_varlen", "packed_flex", "packed_flash", "packed_sdpa", "torch_flex", "dense_sdpa"):
        for total in (8192, 65536):
            cases.append(Case(f"attention:{provider}:{total}", 20))
    for precision in ("bf16", "fp32-bf16"):
        for family in FAMILIES:
            trainer(family, "ours_packing", precision, estimate=50)
            trainer(family, "trl_packing_sdpa", precision, estimate=50)
    for precision in PRECISIONS:
        trainer("llama1b", "ours_packing", precision, compile=True, estimate=150)
        trainer("llama1b", "trl_packing_sdpa", precision, compile=True, estimate=150)
    for precision in PRECISIONS:
        trainer("llama1b", "trl_packing_flex", precision, estimate=180)
    for provider in ("packed_xformers",):
        for total in (8192, 65536):
            cases.append(Case(f"attention:{provider}:{total}", 15))
    cases.append(Case("rope:all", 60))
    return cases


def select_cases(cases: Sequence[Case], patterns: Sequence[str]) -> list[Case]:
    """The cases whose name matches any of the shell-style ``patterns`` (all of them without any), in order."""
    if not patterns:
        return list(cases)
    return [case for case in cases if any(fnmatch.fnmatchcase(case.name, p) for p in patterns)]


def _case(name: str, *, dry_run: bool, steps: int) -> dict[str, Any]:
    section, *rest = name.split(":")
    if section == "trainer":
        model, provider, precision, *options = rest
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} in case {name!r}; known: {sorted(OPTIONS)}")
        return train_case(
            model,
            provider,
            precision,
            compile="compile" in options,
            checkpointing="no_checkpointing" not in options,
            dry_run=dry_run,
            steps=steps,
        )
    if section == "attention":
        return attention_case(rest[0], int(rest[1]), dry_run=dry_run)
    if section == "rope":
        return rope_case(dry_run=dry_run)
    raise ValueError(f"unknown case {name!r}")


def _run(name: str, *, dry_run: bool, steps: int, timeout: float) -> dict[str, Any]:
    """One case: in its own process on the GPU (its peak memory its own, at most ``timeout`` seconds), in this one
    for the dry run (fast). A failure or a timeout is the case's result, not the end of the run."""
    start = time.perf_counter()
    try:
        if dry_run:
            result = _case(name, dry_run=True, steps=steps)
        else:
            command = [sys.executable, os.path.abspath(__file__), "--case", name, "--steps", str(steps)]
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
            if proc.returncode != 0:
                lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
                raise RuntimeError(lines[-1][:200] if lines else f"exit status {proc.returncode}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        result = {"error": f"not finished within {timeout:.0f} s (the budget left for it)"}
    except Exception as error:  # noqa: BLE001 - one failed case is a cell of the table
        result = {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"}
    result["case_s"] = time.perf_counter() - start
    return result


class Recorder:
    """Every result so far, written to ``out/bench_gpu.json`` and ``out/bench_gpu.md`` after each case (``out``
    ``None``: printed only)."""

    def __init__(self, out: str | None, header: dict[str, Any]):
        self.out = Path(out) if out else None
        self.header = header
        self.results: dict[str, dict[str, Any]] = {}
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, result: dict[str, Any]) -> None:
        self.results[name] = result
        self.write()

    def tables(self) -> str:
        sections = [f"## bench_gpu on {self.header['device']}\n\n{self.header['environment']}\n"]
        by_section: dict[str, dict[str, dict[str, Any]]] = {}
        for name, result in self.results.items():
            by_section.setdefault(name.split(":", 1)[0], {})[name] = result
        if "trainer" in by_section:
            sections.append("### Trainer\n\n" + trainer_table(by_section["trainer"]))
        if "attention" in by_section:
            sections.append("### Attention alone\n\n" + attention_table(by_section["attention"]))
        rope = self.results.get("rope:all")
        if rope is not None:
            import bench_rope

            body = bench_rope.format_rows(rope["rows"]) if "rows" in rope else rope.get("error", rope.get("skipped"))
            sections.append("### RoPE (fwd+bwd against transformers and Liger-Kernel)\n\n" + str(body))
        return "\n\n".join(sections) + "\n"

    def write(self) -> None:
        if self.out is None:
            return
        document = {**self.header, "cases": self.results}
        (self.out / "bench_gpu.json").write_text(json.dumps(document, indent=1, default=str))
        (self.out / "bench_gpu.md").write_text(self.tables())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="everything tiny on the CPU (checks the code only)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per trainer case (default 5)")
    parser.add_argument("--cases", default="", help="comma-separated shell patterns of case names (default: all)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run; a case is started "
                        "only where its estimate fits in what is left, and stopped when the budget ends")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="print the selected cases in order and exit")
    parser.add_argument("--out", default=None, help="folder for bench_gpu.json and bench_gpu.md")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: one case in this process
    args = parser.parse_args(argv)

    if args.case is not None:
        print(json.dumps(_case(args.case, dry_run=args.dry_run, steps=args.steps)))
        return 0
    cases = select_cases(all_cases(), [p for p in args.cases.split(",") if p])
    if args.list:
        for case in cases:
            print(f"{case.name}  (~{case.estimate_s:.0f} s)")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "bench_gpu measures a CUDA GPU and none is available; pass --dry-run to check the code.", file=sys.stderr
        )
        return 2
    steps = 1 if args.dry_run else args.steps
    device = "cpu (dry run: not timings)" if args.dry_run else torch.cuda.get_device_name()
    recorder = Recorder(args.out, {"device": device, "environment": environment_line(), "steps": steps})
    deadline = None if args.budget is None else time.perf_counter() + args.budget
    for case in cases:
        timeout = 1800.0
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left < case.estimate_s:
                recorder.add(case.name, {"skipped": f"budget: {max(left, 0):.0f} s left, ~{case.estimate_s:.0f} s"})
                continue
            timeout = left
        result = _run(case.name, dry_run=args.dry_run, steps=steps, timeout=timeout)
        recorder.add(case.name, result)
        print(f"{case.name}: {json.dumps(result, default=str)[:300]}", flush=True)
    print(recorder.tables())
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
