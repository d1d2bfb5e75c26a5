"""QLoRA with packing: a 4-bit quantized base model (bitsandbytes) with LoRA adapters (PEFT), trained on packed rows.

    pip install -e ".[qlora]" && python examples/qlora_packing.py
    python examples/qlora_packing.py --model ./Llama-3.2-1B --dataset ./train.jsonl --max-length 2048 --max-steps 500

The model is loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` (NF4 weights, double quantization; bf16 compute on
a GPU that supports it, fp32 on the CPU), and ``peft_config=LoraConfig(...)`` makes TRL prepare it for k-bit training
and add adapters to every linear layer. Nothing else changes: ``unpack_trainer.SFTTrainer(packing=True)`` packs the
samples into rows of ``--max-length`` tokens, patches the attention of the (wrapped) model so that no sample attends
to another, and checks it before training.

Without ``--model`` a tiny Llama is built from a config and saved to ``OUTPUT_DIR/base``, so that it can be loaded
quantized like a real checkpoint (and the adapter reloaded on it); 4-bit bitsandbytes layers also run on the CPU, so this runs without a GPU. (A tiny
model with random weights learns little through adapters alone; the point here is the mechanics and the speed of
packed QLoRA steps.) On several GPUs, launch it like ``examples/sft_packing.py`` (see ``examples/multi_gpu/``):
each process loads its quantized copy on its own GPU.

The trained adapter is saved to ``OUTPUT_DIR/adapter`` (load it with ``peft.PeftModel.from_pretrained``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sft_packing import check_args, load_data, load_tokenizer  # noqa: E402  (shared with the main example)

QUICK_STEPS = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/qlora_packing.py",
        description="QLoRA (bitsandbytes 4-bit base model + PEFT LoRA adapters) with "
        "unpack_trainer.SFTTrainer(packing=True).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="local model directory (save_pretrained format, with its tokenizer); default: a tiny Llama built from "
        "a config and saved to OUTPUT_DIR/base",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        help="local .jsonl/.json(.gz)/.parquet file or save_to_disk directory with 'prompt'+'completion', "
        "'messages', 'text' or 'input_ids' columns; default: the embedded instruction dataset",
    )
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--max-steps", type=int, default=120, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=1, help="packed rows per device and optimizer step")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--lora-alpha", type=int, default=32, help="LoRA scaling numerator (scale = alpha / r)")
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--output-dir", type=Path, default=Path("qlora_packing_output"))
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK_STEPS} steps on a few samples")
    parser.add_argument("--seed", type=int, default=0)
    # check_args (shared with sft_packing.py) validates these too; they are fixed here.
    parser.set_defaults(epochs=1.0, padded_batch_size=None, threads=None)
    return parser


def quantization_config(compute_dtype: Any) -> Any:
    """NF4 4-bit weights with double quantization; matmuls in ``compute_dtype``."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def save_tiny_model(directory: Path, tokenizer: Any, *, seed: int) -> Path:
    """Build the tiny Llama of ``unpack_trainer.data.default_data`` and save it with its tokenizer, as a checkpoint."""
    import torch
    from transformers import LlamaForCausalLM

    from unpack_trainer import tiny_model_config

    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_model_config(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    for name in ("lora_r", "lora_alpha"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise SystemExit('error: QLoRA needs bitsandbytes: pip install bitsandbytes (or pip install -e ".[qlora]")')

    import datasets
    import torch
    from accelerate import PartialState
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from unpack_trainer import SFTConfig, SFTTrainer

    hf_logging.set_verbosity_warning()
    datasets.disable_progress_bars()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    on_gpu = torch.cuda.is_available()
    bf16 = on_gpu and torch.cuda.is_bf16_supported()
    compute_dtype = torch.bfloat16 if bf16 else (torch.float16 if on_gpu else torch.float32)

    tokenizer = load_tokenizer(args.model)
    train_dataset, _, data_name = load_data(args.dataset, seed=args.seed)
    if args.quick:
        train_dataset = train_dataset.select(range(min(len(train_dataset), 128)))

    state = PartialState()
    model_path = args.model
    if model_path is None:
        model_path = args.output_dir / "base"
        with state.main_process_first():  # one process writes, the others wait and read
            if state.is_main_process:
                save_tiny_model(model_path, tokenizer, seed=args.seed)
    # Each process (one per GPU under `accelerate launch`) loads its own quantized copy on its own device.
    device_map = {"": state.local_process_index} if on_gpu else {"": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), quantization_config=quantization_config(compute_dtype), device_map=device_map
    )
    names = {field.name for field in dataclasses.fields(SFTConfig)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    config = SFTConfig(
        output_dir=str(args.output_dir),
        packing=True,
        max_length=args.max_length,
        max_steps=QUICK_STEPS if args.quick else args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        logging_steps=1 if args.quick else args.logging_steps,
        save_strategy="no",
        report_to="none",
        use_cpu=not on_gpu,
        bf16=bf16,
        fp16=on_gpu and not bf16,
        dataloader_num_workers=0,
        seed=args.seed,
        # On a GPU, recompute activations to save memory (the usual QLoRA setting); the tiny CPU model needs none.
        **{checkpointing: on_gpu},
    )
    peft_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.05,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=train_dataset, processing_class=tokenizer, peft_config=peft_config
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    start = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - start

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    summary = {
        "steps": output.global_step,
        "seconds": seconds,
        "first_loss": losses[0] if losses else float("nan"),
        "last_loss": losses[-1] if losses else float("nan"),
        "trainable_parameters": trainable,
        "mode": trainer.unpack_decision.mode,
        "stats": dict(trainer.unpack_stats),
    }
    if trainer.is_world_process_zero():
        stats = trainer.unpack_stats
        print(f"\nmodel: {args.model or 'tiny Llama (random init)'} in 4-bit, data: {data_name}")
        print(f"trainable (LoRA) parameters: {trainable:,} of {total:,} ({trainable / total:.2%})")
        print(f"packing: {trainer.unpack_decision.mode} ({trainer.unpack_decision.reason})")
        if "rows" in stats:
            print(f"{stats['samples']:,} samples in {stats['rows']:,} rows, {stats['efficiency']:.1%} full")
        print(
            f"{output.global_step} steps in {seconds:.1f} s; training loss {summary['first_loss']:.3f} -> "
            f"{summary['last_loss']:.3f}"
        )
        trainer.save_model(str(args.output_dir / "adapter"))
        print(f"adapter: {(args.output_dir / 'adapter').resolve()}")
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
