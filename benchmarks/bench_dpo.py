"""DPO step throughput and peak memory: stock ``trl.DPOTrainer`` (padded) vs ``unpack_trainer.DPOTrainer`` packed
without prefix sharing vs packed with prefix sharing, on pairs whose prompts are 20%, 50% and 80% of their tokens.

    python benchmarks/bench_dpo.py                         # tiny Llama, 8 pairs per batch, 3 repeats
    python benchmarks/bench_dpo.py --repeats 5 --threads 1 # steadier on a busy machine
    python benchmarks/bench_dpo.py --model smollm2         # SmolLM2-135M-Instruct with LoRA (the `real` extra)
    python benchmarks/bench_dpo.py --model qwen2_5_vl      # image pairs on a small Qwen2.5-VL (below)

Each (provider, prompt share) case runs in its own process: one warm-up step, then ``--steps`` training steps
(policy forward + backward and the reference model's forward, through the trainers' own ``compute_loss``) on the same
pre-tokenized pairs. The providers are interleaved (stock, plain, shared, stock, ...) for ``--repeats`` rounds; the
table gives the median and spread (min-max) of tokens/s and of each ratio, paired within a round. Tokens/s counts the
tokens of ``[p, c]`` and ``[p, r]`` (what stock TRL runs without its padding), the same numerator for every provider.
Peak memory: the growth of the process's peak RSS over the training steps, warm-up included (ru_maxrss; CPU).

Data: pair lengths ``|p| + |c| + |r|`` lognormal (median 360 tokens, sigma 0.6, clipped to [16, 2048]), the prompt
the given share of them, the rest split between chosen and rejected at a uniform 35-65% ratio; random token ids.
Models: ``--model tiny_llama`` (default): tiny Llama (hidden 256, 4 layers, 8 heads, 4 kv heads, vocab 4096), full
fine-tuning with a separate reference model. ``--model smollm2``: SmolLM2-135M-Instruct (fp32, SDPA; the `real`
extra) with LoRA (r 16 on every linear layer) and the reference = the adapter disabled (``ref_model=None``), the
usual way to DPO a pretrained model on one device; the token ids stay below 4096 (valid SmolLM2 ids, a word-level
tokenizer over them), since throughput does not depend on what the tokens say.

Image pairs (``--model qwen2_5_vl``, one case per provider instead of the prompt shares): a small Qwen2.5-VL built from
its config (text model hidden 256, 4 layers, 8 heads of 32, 4 key/value heads; vision tower 2 layers of 32, patches
of 14 merged 2 x 2) and a separate reference model, with its processor (character tokenizer); each prompt a drawn shape
of 224 to 448 pixels a side (64 to 256 image tokens) and a question, the chosen answer its one-line caption, the
rejected one another shape's (about 40 tokens each). The providers as above: stock TRL (every image encoded twice,
once per completion, and the prompt's image tokens run twice), ours with the prompt repeated (``prefix_sharing=False``:
TRL's rows packed, images as TRL encodes them) and ours shared (each image once per pair, each prompt once). Also
reported: the images the vision towers encode per step (policy and reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    environment_line,
    format_table,
    pair_trainer,
    quiet_case,
    run_in_subprocess,
    timed_loss_steps,
    tiny_llama_config,
)

PROVIDERS = ("stock", "plain", "shared")
SHARES = (0.2, 0.5, 0.8)


MODELS = ("tiny_llama", "smollm2", "qwen2_5_vl")
VLM_TEXT = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=688,
                num_hidden_layers=4)  # fmt: skip
VLM_SIDES = (224, 448)  # image sides in pixels: 64 to 256 image tokens (patches of 14, merged 2 x 2)


def make_pairs(num_pairs: int, share: float, seed: int = 0, median: int = 360) -> list[dict[str, list[int]]]:
    """``num_pairs`` pre-tokenized pairs whose prompts hold ``share`` of the pair's tokens (see the docstring)."""
    rng = np.random.default_rng(seed)
    totals = np.clip(np.rint(rng.lognormal(np.log(median), 0.6, size=num_pairs)), 16, 2048).astype(int)
    pairs = []
    for total in totals:
        prompt = max(1, int(round(share * total)))
        rest = max(2, total - prompt)
        chosen = max(1, int(round(rest * rng.uniform(0.35, 0.65))))
        rejected = max(1, rest - chosen)
        pairs.append({name: rng.integers(3, 4096, size=n).tolist() for name, n in
                      (("prompt_ids", prompt), ("chosen_ids", chosen), ("rejected_ids", rejected))})  # fmt: skip
    return pairs


def _models(name: str) -> tuple[object, object, dict]:
    """``(model, ref_model, trainer kwargs)`` of the benchmark's ``--model``: the two tiny Llamas, or SmolLM2 with a
    LoRA config and no reference model."""
    import torch
    from transformers import LlamaForCausalLM

    if name == "smollm2":
        from peft import LoraConfig

        from unpack_trainer import load_smollm2

        model, _ = load_smollm2(attn_implementation="sdpa")
        return model, None, {"peft_config": LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")}
    config = tiny_llama_config(pad_token_id=0, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    torch.manual_seed(1)
    return model, LlamaForCausalLM(config), {}


def run_case(
    provider: str, share: float, steps: int, batch_size: int, threads: int | None, model_name: str, median: int
) -> dict:
    """Train ``steps`` + 1 steps of ``provider`` in this process; tokens/s and the growth of peak RSS (MiB)."""
    if model_name == "qwen2_5_vl":
        return run_vlm_case(provider, steps, batch_size, threads)
    quiet_case(threads)
    import trl
    from datasets import Dataset

    from unpack_trainer import DPOConfig, DPOTrainer

    model, ref_model, extra = _models(model_name)
    tokenizer = word_tokenizer()
    texts = [
        # completions start with a space: TRL tokenizes prompt + completion as one text, and the word-level
        # tokenizer would merge the prompt's last word with the completion's first
        {
            name.removesuffix("_ids"): ("" if name == "prompt_ids" else " ") + " ".join(f"t{i}" for i in ids)
            for name, ids in pair.items()
        }  # fmt: skip
        for pair in make_pairs(batch_size * (steps + 1), share, median=median)
    ]
    dataset = Dataset.from_list(texts)
    trainer = pair_trainer(provider, (trl.DPOTrainer, trl.DPOConfig), (DPOTrainer, DPOConfig), batch_size,
                           model=model, ref_model=ref_model, train_dataset=dataset, processing_class=tokenizer,
                           **extra)  # fmt: skip
    pairs = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    timed = timed_loss_steps(trainer, batch_size, pairs, steps)
    seconds = timed["seconds"]
    tokens = sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs[batch_size:])
    return {"tokens_per_s": tokens / seconds, "peak_mib": timed["peak_mib"], "seconds": seconds}


def image_pairs(num_pairs: int, seed: int = 0) -> object:
    """``num_pairs`` image preference pairs: a drawn shape (sides of :data:`VLM_SIDES` pixels) and a question as the
    prompt, its one-line caption as ``chosen`` and the caption of another drawn shape as ``rejected`` (short answers,
    about 40 tokens of the character tokenizer, against 64 to 256 image tokens and about 60 of chat template and
    question in the prompt)."""
    from datasets import Dataset

    from unpack_trainer.data.default_vision_data import load_shapes_dataset

    rows = load_shapes_dataset(2 * num_pairs, seed=seed, sizes=VLM_SIDES, sentences=(0, 0), prompt_completion=True)
    pairs = []
    for index in range(num_pairs):
        row, other = rows[2 * index], rows[2 * index + 1]
        pairs.append({"images": row["images"], "prompt": row["prompt"], "chosen": row["completion"],
                      "rejected": other["completion"]})  # fmt: skip
    return Dataset.from_list(pairs)


def run_vlm_case(provider: str, steps: int, batch_size: int, threads: int | None) -> dict:
    """The image case of ``provider`` (``--model qwen2_5_vl``): a small Qwen2.5-VL (text model hidden 256, 4 layers;
    vision tower 2 layers of 32) and a separate reference model, full fine-tuning, fp32, SDPA, with its processor;
    ``steps`` + 1 steps on :func:`image_pairs`. Real tokens/s (the tokens of ``[p, c]`` and ``[p, r]``, padding left
    out: the same numerator for every provider), images the vision towers encode per step (policy and reference),
    the growth of peak RSS (MiB)."""
    quiet_case(threads)
    import trl

    from unpack_trainer import DPOConfig, DPOTrainer
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model

    processor = tiny_processor("qwen2_5_vl")
    side = {"shortest_edge": VLM_SIDES[0] ** 2, "longest_edge": VLM_SIDES[1] ** 2}
    processor.image_processor.size = side
    model = tiny_vision_model("qwen2_5_vl", seed=0, attn_implementation="sdpa", **VLM_TEXT)
    ref_model = tiny_vision_model("qwen2_5_vl", seed=1, attn_implementation="sdpa", **VLM_TEXT)
    dataset = image_pairs(batch_size * (steps + 1))
    trainer = pair_trainer(provider, (trl.DPOTrainer, trl.DPOConfig), (DPOTrainer, DPOConfig), batch_size,
                           model=model, ref_model=ref_model, train_dataset=dataset, processing_class=processor)  # fmt: skip
    images: list[int] = []
    for pretrained in (model, ref_model):  # the multimodal model runs its vision tower through get_image_features
        inner = pretrained.base_model
        encode = inner.get_image_features

        def counting(pixel_values, image_grid_thw=None, *rest, _encode=encode, **kwargs):
            images.append(0 if image_grid_thw is None else int(image_grid_thw.shape[0]))
            return _encode(pixel_values, image_grid_thw, *rest, **kwargs)

        inner.get_image_features = counting
    examples = [dataset[i] for i in range(len(dataset))]
    timed = timed_loss_steps(trainer, batch_size, examples, steps, on_warm_up=images.clear)
    batches, seconds, cpu_seconds = timed["batches"], timed["seconds"], timed["cpu_seconds"]
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches[1:])  # TRL's [p, c] and [p, r] rows
    return {"tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu_seconds,
            "peak_mib": timed["peak_mib"], "seconds": seconds, "images_per_step": sum(images) / steps,
            "tokens_per_step": tokens / steps}  # fmt: skip


def _spread(values, fmt: str) -> str:
    return f"{format(float(np.median(values)), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def parse_arguments(description: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line of this benchmark and of ``bench_reward.py``: steps, pairs per batch, rounds, threads, prompt
    shares, model, median pair length (and the hidden ``--case provider:share`` of one measured process)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES))
    parser.add_argument("--model", choices=MODELS, default="tiny_llama")
    parser.add_argument("--median-tokens", type=int, default=360, help="median |p| + |c| + |r| of a pair")
    args = parser.parse_args(argv)
    if args.model == "qwen2_5_vl":  # one case: the prompt's share is what its image and question make it
        args.shares = [0.0]
    return args


def run_cases(script: str, args: argparse.Namespace) -> dict[tuple[str, float], list[dict]]:
    """``script --case provider:share`` for every provider of [`PROVIDERS`] and share, each in its own process, the
    providers interleaved (their order rotated each round) for ``args.repeats`` rounds: the results by case."""
    print(environment_line())
    results: dict[tuple[str, float], list[dict]] = {}
    for repeat in range(args.repeats):
        for share in args.shares:
            order = PROVIDERS[repeat % 3 :] + PROVIDERS[: repeat % 3]
            for provider in order:
                command = [os.path.abspath(script), "--case", f"{provider}:{share}", "--steps", str(args.steps)]
                command += ["--batch-size", str(args.batch_size), "--model", args.model]
                command += ["--median-tokens", str(args.median_tokens)]
                if args.threads is not None:
                    command += ["--threads", str(args.threads)]
                results.setdefault((provider, share), []).append(run_in_subprocess(command, timeout=3600))
                print(f"  round {repeat + 1}, prompt {share:.0%}, {provider}: "
                      f"{results[(provider, share)][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)  # fmt: skip
    return results


def measure(script: str, description: str, argv: list[str] | None, run_case) -> tuple[argparse.Namespace, dict | None]:
    """The body of this benchmark and of ``bench_reward.py``: with ``--case``, ``run_case(provider, share, steps,
    batch_size, threads, model, median_tokens)`` in this process, its result printed as JSON (no results returned);
    otherwise every case of ``script`` ([`run_cases`]). Returns the arguments and the results."""
    args = parse_arguments(description, argv)
    if args.case:
        provider, share = args.case.split(":")
        result = run_case(
            provider, float(share), args.steps, args.batch_size, args.threads, args.model, args.median_tokens
        )
        print(json.dumps(result))
        return args, None
    return args, run_cases(script, args)


def word_tokenizer():
    """A word-level tokenizer over ``t0`` .. ``t4095`` (token id ``i`` is the word ``t{i}``; pad ``t0``, BOS ``t1``,
    EOS ``t2``): the benchmarks' pairs are token ids, and the trainers need a tokenizer for their special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(4096)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2")


def main(argv: list[str] | None = None) -> None:
    args, results = measure(__file__, __doc__, argv, run_case)
    if results is None:
        return
    if args.model == "qwen2_5_vl":
        print_vlm_table(args, results)
        return
    rows = []
    for share in args.shares:
        stock, plain, shared = (results[(p, share)] for p in PROVIDERS)
        tps = {p: [r["tokens_per_s"] for r in results[(p, share)]] for p in PROVIDERS}
        rows.append([
            f"{share:.0%}",
            _spread(tps["stock"], ",.0f"),
            _spread(tps["plain"], ",.0f"),
            _spread(tps["shared"], ",.0f"),
            _spread([b / a for a, b in zip(tps["stock"], tps["plain"])], ".2f"),
            _spread([b / a for a, b in zip(tps["stock"], tps["shared"])], ".2f"),
            _spread([b / a for a, b in zip(tps["plain"], tps["shared"])], ".2f"),
            " / ".join(f"{np.median([r['peak_mib'] for r in rs]):.0f}" for rs in (stock, plain, shared)),
        ])  # fmt: skip
    print()
    what = {"tiny_llama": "tiny Llama, full", "smollm2": "SmolLM2-135M-Instruct, LoRA r 16"}[args.model]
    print(f"DPO step, {what}, {args.batch_size} pairs per batch (median pair {args.median_tokens} tokens), "
          f"{args.steps} steps x {args.repeats} rounds (median (min-max)):")  # fmt: skip
    print(format_table(
        ["prompt share", "stock tokens/s", "packed tokens/s", "shared tokens/s", "packed / stock",
         "shared / stock", "shared / packed", "peak MiB stock / packed / shared"],
        rows,
    ))  # fmt: skip


def print_vlm_table(args: argparse.Namespace, results: dict[tuple[str, float], list[dict]]) -> None:
    """The table of the image case: per provider, real tokens/s, its ratio to stock (paired within a round) and the
    same ratio per second of the process's CPU time (steadier on a shared machine), seconds per step, images encoded
    per step (policy and reference) and the growth of peak RSS (medians over the rounds)."""
    runs = {provider: results[(provider, args.shares[0])] for provider in PROVIDERS}
    names = {"stock": "trl.DPOTrainer padded", "plain": "ours, packed, prompt repeated (prefix_sharing=False)",
             "shared": "ours, packed, prompt shared (default)"}  # fmt: skip
    stock = [r["tokens_per_s"] for r in runs["stock"]]
    stock_cpu = [r["tokens_per_cpu_s"] for r in runs["stock"]]
    rows = []
    for provider in PROVIDERS:
        tps = [r["tokens_per_s"] for r in runs[provider]]
        cpu = [r["tokens_per_cpu_s"] for r in runs[provider]]
        rows.append([
            names[provider],
            _spread(tps, ",.0f"),
            _spread([b / a for a, b in zip(stock, tps)], ".2f"),
            _spread([b / a for a, b in zip(stock_cpu, cpu)], ".2f"),
            f"{np.median([r['seconds'] for r in runs[provider]]) / args.steps:.2f}",
            f"{np.median([r['images_per_step'] for r in runs[provider]]):.0f}",
            f"{np.median([r['peak_mib'] for r in runs[provider]]):,.0f}",
        ])  # fmt: skip
    tokens = np.median([r["tokens_per_step"] for r in runs["stock"]])
    print()
    print(f"DPO step on image pairs, small Qwen2.5-VL (text hidden 256, 4 layers), full fine-tuning + reference model, "
          f"{args.batch_size} pairs per batch ({tokens:,.0f} real tokens per step), images {VLM_SIDES[0]}-"
          f"{VLM_SIDES[1]} px (64-256 image tokens), {args.steps} steps x {args.repeats} rounds (median (min-max)):")  # fmt: skip
    print(format_table(
        ["provider", "real tokens/s", "vs stock", "vs stock, CPU time", "s/step", "images encoded/step",
         "peak RSS growth MiB"],
        rows,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
