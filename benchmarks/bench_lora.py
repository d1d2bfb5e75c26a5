"""LoRA under autocast: PEFT's own path (each LoRA layer's input cast to its float32 adapters, then back by autocast)
against ours (the cast skipped where it is an exact round trip: ``unpack_trainer/trainers/lora_casts.py``), in one
process, interleaved repeats.

    python benchmarks/bench_lora.py                     # CPU: the copies and bit-identity (timings: see below)
    python benchmarks/bench_lora.py --device cuda --hidden 4096 --intermediate 14336 --layers 8 --tokens 4096

A bf16 model with LoRA r 16 on every linear layer (PEFT's default float32 adapters), one packed row of ``--tokens``
tokens, forward + backward under ``torch.autocast`` (what ``bf16=True`` runs), with and without activation
checkpointing. Columns: seconds per forward + backward (median, min-max over the repeats), the ratio, dtype copies
(``aten::_to_copy``) per step, and whether the loss and every gradient are bit-identical.

The saving is memory traffic (activation-sized copies), which a GPU step feels; on a CPU without fast bf16 matrix
multiplies (this machine: 97% of the step in ``aten::mm``) the ratio stays about 1.00x.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import format_table, print_header, spread  # noqa: E402

from unpack_trainer._compat import enable_checkpointing  # noqa: E402
from unpack_trainer.trainers.lora_casts import lora_input_casts_skipped, plain_lora_layers  # noqa: E402


def build(args: argparse.Namespace) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
        max_position_embeddings=max(8192, args.tokens), attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(model, lora)
    if args.checkpointing:
        enable_checkpointing(model, {"use_reentrant": False})
        model.enable_input_require_grads()
    return model.train()


def step(model: torch.nn.Module, ids: torch.Tensor, context: contextlib.AbstractContextManager) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with context, torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print_header("LoRA under autocast: PEFT's casts vs skipped")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = []
    for checkpointing in (False, True):
        args.checkpointing = checkpointing
        model = build(args)
        layers = plain_lora_layers(model)
        arms = {
            "PEFT's casts": contextlib.nullcontext,
            "casts skipped (ours)": lambda layers=layers: lora_input_casts_skipped(layers),
        }
        results = {}
        for name, context in arms.items():  # one warm-up each, the reference loss and gradients, the copies
            with torch.profiler.profile() as prof:
                loss = step(model, ids, context())
            copies = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            results[name] = {"loss": loss, "grads": grads, "copies": copies, "seconds": []}
        for _ in range(args.repeats):  # interleaved
            for name, context in arms.items():
                sync()
                start = time.perf_counter()
                step(model, ids, context())
                sync()
                results[name]["seconds"].append(time.perf_counter() - start)
        stock, ours = results.values()
        identical = torch.equal(stock["loss"], ours["loss"]) and all(
            torch.equal(a, b) for a, b in zip(stock["grads"], ours["grads"])
        )
        for name, result in results.items():
            ratio = statistics.median(stock["seconds"]) / statistics.median(result["seconds"])
            rows.append((
                "on" if checkpointing else "off", name, spread(result["seconds"], ".3f"),
                f"{args.tokens / statistics.median(result['seconds']):,.0f}", f"{ratio:.2f}x", result["copies"],
                "-" if result is stock else ("yes" if identical else "NO"),
            ))  # fmt: skip
        del model
    print(f"{args.device}, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab "
          f"{args.vocab}, {args.tokens} tokens, LoRA r 16 on every linear layer, {args.repeats} interleaved repeats\n")  # fmt: skip
    headers = ("checkpointing", "LoRA path", "s / fwd+bwd", "tokens/s", "vs PEFT", "dtype copies", "bit-identical")
    print(format_table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
