"""How far sequence parallelism reaches on the CPU: activation memory and step time per process for the same packed row
at sp = 1 and sp = 2 (DeepSpeed Ulysses, two processes on gloo), ours against stock Ulysses on the same row.

    python benchmarks/bench_sp.py                      # row of 4,096 tokens, 7 repeats; writes RESULTS_sp.json
    python benchmarks/bench_sp.py --tokens 8192 --repeats 5
    python benchmarks/bench_sp.py --device cuda --dtype bfloat16 --sp 1 2 4 --tokens 32768   # N GPUs (NCCL)
    python benchmarks/bench_sp.py --paper              # Llama-3.1-8B: activation memory against row length and N
    python benchmarks/bench_sp.py --group 8 --prompt 1024 --completion 256 --repeats 5 \
        --out benchmarks/RESULTS_sp_group.json
                                                       # GRPO's row: one prompt, 8 completions, shared or not

One forward and backward of the tiny Llama of ``benchmarks/common.py`` (hidden 256, 4 layers, 8 heads, 4 key/value
heads, fp32) on one packed row of samples drawn from a log-normal length distribution. Activation memory is what
autograd keeps for the backward (every tensor saved for it, counted once per storage: ``saved_tensors_hooks``), the
memory sequence parallelism divides; time is the median of interleaved repeats with one thread per process. Stock
Ulysses runs the same row unpatched: DeepSpeed's wrapper around transformers' SDPA, which drops the packing and runs the
row as one causal document (its logits are wrong: the comparison is of cost only, at equal shapes). At sp = 1 stock is
the unpatched model on the row with its restarting ``position_ids`` (transformers' SDPA path: one causal document too).

With ``--group G``: the row of a GRPO / RLOO group instead (one prompt of ``--prompt`` tokens, ``G`` completions of
``--completion``), as our trainers pack it under Ulysses, the prompt once with the completions as its branches
("shared"), against the same completions each after its own copy of the prompt ("unshared": what TRL's padded rows
hold, and ours with ``prefix_sharing=False``); both ours, exact. Stock TRL refuses sequence parallelism in GRPO.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _row(tokens: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """One row of ``tokens`` token ids (int64, (1, tokens)) and its sample lengths (log-normal, median 200, each
    between 8 and 1,024 tokens; the last one cut to fill the row)."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        drawn = torch.empty(1).log_normal_(5.3, 0.8, generator=generator).item()
        lengths.append(min(1024, max(8, int(drawn))))
    lengths[-1] -= sum(lengths) - tokens
    return torch.randint(3, vocab, (1, tokens), generator=generator), lengths


def _saved_bytes(run, model: torch.nn.Module | None = None) -> int:
    """Bytes autograd saves for the backward while ``run()`` runs its forward, each storage once, the parameters of
    ``model`` (saved by every linear layer, but not activations) left out."""
    storages: dict[int, int] = {}
    weights = set() if model is None else {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    loss.backward()
    return sum(storages.values())


def _measure(model, batch: dict, repeats: int, rank: int, shards: int) -> tuple[int, list[float]]:
    device = next(model.parameters()).device

    def run() -> torch.Tensor:
        size = batch["input_ids"].shape[1] // shards
        local = {
            key: (
                value[:, rank * size : (rank + 1) * size].to(device)
                if torch.is_tensor(value) and value.dim() == 2
                else value
            )
            for key, value in batch.items()
            if key not in ("labels", "use_cache")
        }
        return model(**local, use_cache=False).logits.float().square().mean()

    memory = _saved_bytes(run, model)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return memory, times


def _group_rows(group: tuple[int, int, int], vocab: int, shards: int) -> tuple[dict, dict]:
    """A GRPO group's row, ``group = (G, prompt, completion)`` tokens: shared (the prompt once, the ``G`` completions
    its branches) and unshared (each completion after its own copy of the prompt), each padded to a multiple of
    ``shards`` with its whole-row metadata marked for the cut: ``input_ids`` / ``position_ids`` ``(1, T)`` and
    ``packed_seq_info``."""
    from unpack_trainer.data.sequence_shards import padded_for_shards
    from unpack_trainer.packed_seq_info import (
        INFO_KEY,
        PACKED_INPUT_IDS_KEY,
        PACKED_POSITION_IDS_KEY,
        branched_row,
    )

    count, prompt, completion = group
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (prompt,), generator=generator).tolist()
    completions = [torch.randint(3, vocab, (completion,), generator=generator).tolist() for _ in range(count)]
    shared = branched_row(prompt_ids + sum(completions, []), [prompt] + [completion] * count, [-1] + [0] * count)
    unshared = branched_row(
        sum((prompt_ids + ids for ids in completions), []), [prompt + completion] * count, [-1] * count
    )
    rows = []
    for row in (shared, unshared):
        whole = padded_for_shards(row, shards)
        rows.append(
            {
                "input_ids": whole[PACKED_INPUT_IDS_KEY],
                "position_ids": whole[PACKED_POSITION_IDS_KEY],
                INFO_KEY: whole[INFO_KEY],
            }
        )
    return rows[0], rows[1]


def worker(tokens: int, repeats: int, out: str, device_type: str, dtype: str, group: tuple[int, int, int]) -> None:
    """One process of a run: sp = WORLD_SIZE (1 without torchrun), on the CPU (gloo, one thread) or its GPU (NCCL);
    ``group``: ``(G, prompt, completion)`` for a GRPO group's row (``G = 0``: a packed row of ``tokens``)."""
    if device_type == "cpu":
        torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from benchmarks.common import tiny_llama_config
    from unpack_trainer.data.collator import DataCollatorForPacking
    from unpack_trainer.models import patch_model

    shards = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0"))) if device_type == "cuda" else None
    config = tiny_llama_config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(config).to(device=device, dtype=getattr(torch, dtype))
    stock = AutoModelForCausalLM.from_config(config).to(device=device, dtype=getattr(torch, dtype))
    stock.load_state_dict(ours.state_dict())
    patch_model(ours)
    ids, lengths = _row(tokens, config.vocab_size)
    start = 0
    examples = []
    for length in lengths:
        examples.append({"input_ids": ids[0, start : start + length].tolist()})
        start += length
    packed = DataCollatorForPacking(pad_token_id=0, sequence_shards=shards)(examples)
    stock_batch = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    if shards > 1:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed(dist_backend="gloo" if device_type == "cpu" else "nccl")
        UlyssesSPAttentionHF.register_with_transformers(
            ours, core_attn_implementation="sdpa", sequence_parallel_size=shards, micro_batch_size=1
        )
    paths = (("ours", ours, packed), ("stock", stock, stock_batch))
    if group[0]:
        shared, unshared = _group_rows(group, config.vocab_size, shards)
        paths = (("shared", ours, shared), ("unshared", ours, unshared))
        tokens = shared["input_ids"].shape[1]
    results = {name: ([], []) for name, _, _ in paths}
    for _ in range(repeats):  # interleaved: one repeat of each, in turn
        for name, model, batch in paths:
            memory, times = _measure(model, batch, 1, rank, shards)
            results[name][0].append(memory)
            results[name][1].extend(times)
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    name: {"activation_bytes": max(memory), "seconds": times}
                    for name, (memory, times) in results.items()
                }
                | {"samples": len(lengths), "tokens": tokens, "sp": shards, "device": device_type, "dtype": dtype}
            )
        )
    if shards > 1:
        torch.distributed.barrier()
    os._exit(0)


def _launch(sp: int, args: argparse.Namespace, out: Path) -> dict:
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    arguments = [
        str(Path(__file__).resolve()),
        "--worker",
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
    ]
    arguments += ["--out", str(out), "--device", args.device, "--dtype", args.dtype]
    arguments += ["--group", str(args.group), "--prompt", str(args.prompt), "--completion", str(args.completion)]
    if sp == 1:
        command = [sys.executable, *arguments]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(sp)]
        command += ["--master_addr", "127.0.0.1", "--master_port", "29671", *arguments]
    subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


# Llama-3.1-8B: hidden 4096, 32 layers, 32 query / 8 key-value heads of 128, MLP 14,336, vocabulary 128,256.
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=32,
    vocab_size=128256,
)


def layer_bytes_per_token() -> tuple[float, float]:
    """What one Llama-3.1-8B decoder layer saves for its backward per token, in bf16 (bytes), measured on the CPU on a
    packed row of 128 and of 256 tokens (both printed: equal when nothing grows with the square of the row, as in our
    packed attention)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**(LLAMA_8B | {"num_hidden_layers": 1}))
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
    rotary = LlamaRotaryEmbedding(config)
    per_token = []
    for tokens in (128, 256):
        hidden = torch.randn(1, tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(tokens)[None]
        cos, sin = rotary(hidden, positions)

        def run(hidden=hidden, cos=cos, sin=sin, positions=positions) -> torch.Tensor:
            out = layer(hidden, position_embeddings=(cos, sin), position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
            return out.float().square().mean()

        per_token.append(_saved_bytes(run, layer) / tokens)
    return per_token[0], per_token[1]


def paper(per_token: float) -> None:
    """Activation memory per GPU of Llama-3.1-8B against row length and sp_size, from the measured bytes per token."""
    layers, hidden, vocab = LLAMA_8B["num_hidden_layers"], LLAMA_8B["hidden_size"], LLAMA_8B["vocab_size"]
    gib = 2**30
    print(
        f"\nLlama-3.1-8B, bf16 activations: one decoder layer saves {per_token / 2**10:,.1f} KiB per token (measured)"
    )
    print(
        "| row (tokens) | sp_size | no checkpointing (GiB / GPU) | checkpointing (GiB / GPU) | + full logits without a fused loss (GiB / GPU) |"
    )
    print("|---|---|---|---|---|")
    for row in (32_768, 131_072, 262_144):
        for sp in (1, 2, 4, 8):
            local = row / sp
            plain = layers * per_token * local
            checkpointed = (layers * 2 * hidden + per_token) * local  # each layer's bf16 input, one layer recomputed
            logits = vocab * (2 + 4) * local  # bf16 logits and their float32 copy in the loss
            print(f"| {row:,} | {sp} | {plain / gib:,.1f} | {checkpointed / gib:,.1f} | {logits / gib:,.1f} |")
    # all-to-all per layer: q, k, v out and the attention output back, each rank's shard, bf16
    q, kv = LLAMA_8B["num_attention_heads"], LLAMA_8B["num_key_value_heads"]
    per_token_exchanged = (2 * q + 2 * kv) * LLAMA_8B["head_dim"] * 2
    print(
        f"\nAll-to-all per layer and token of the row (forward; the backward the same again): q, k, v and the attention"
        f" output, {per_token_exchanged / 2**10:,.0f} KiB, of which (sp_size - 1) / sp_size leaves the GPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--paper", action="store_true", help="only the Llama-3.1-8B table (no processes launched)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help="a GRPO group's row of this many completions")
    parser.add_argument("--prompt", type=int, default=2048, help="with --group: the prompt's tokens")
    parser.add_argument("--completion", type=int, default=256, help="with --group: each completion's tokens")
    parser.add_argument("--out", default=str(HERE / "RESULTS_sp.json"))
    args = parser.parse_args()
    if args.worker:
        worker(
            args.tokens, args.repeats, args.out, args.device, args.dtype, (args.group, args.prompt, args.completion)
        )
        return
    if args.paper:
        short, long = layer_bytes_per_token()
        print(f"bytes saved per token by one Llama-3.1-8B layer: {short:,.0f} at 128 tokens, {long:,.0f} at 256")
        paper(long)
        return
    runs = {}
    for sp in args.sp:
        runs[sp] = _launch(sp, args, Path(args.out).with_suffix(f".sp{sp}.tmp"))
        Path(args.out).with_suffix(f".sp{sp}.tmp").unlink()
    names = ("shared", "unshared") if args.group else ("ours", "stock")
    base = runs[args.sp[0]][names[0]]
    if args.group:
        print(
            f"a GRPO group's row: a prompt of {args.prompt:,} tokens and {args.group} completions of "
            f"{args.completion:,}, tiny Llama, {args.dtype}, {args.device}"
        )
    else:
        print(
            f"one packed row of {args.tokens:,} tokens ({runs[args.sp[0]]['samples']} samples), tiny Llama, "
            f"{args.dtype}, {args.device}"
        )
    print(
        f"| sp | path | activation memory / process (MB) | vs {names[0]} at sp=1 | step time / process (ms): median "
        "[min-max] |"
    )
    print("|---|---|---|---|---|")
    labels = {"stock": "stock (one causal document)", "shared": "shared prompt", "unshared": "prompt per completion"}
    for sp, run in runs.items():
        for name in names:
            entry = run[name]
            seconds = entry["seconds"]
            print(
                f"| {sp} | {labels.get(name, name)} | "
                f"{entry['activation_bytes'] / 2**20:,.1f} | {entry['activation_bytes'] / base['activation_bytes']:.2f}x | "
                f"{statistics.median(seconds) * 1e3:,.0f} [{min(seconds) * 1e3:,.0f}-{max(seconds) * 1e3:,.0f}] |"
            )
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
