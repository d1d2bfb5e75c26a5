"""GRPO training throughput and peak memory: stock ``trl.GRPOTrainer`` (padded) vs ``unpack_trainer.GRPOTrainer``
packed without prefix sharing vs packed with each group's prompt shared, for prompts holding 20%, 50% and 80% of the
tokens and for uniform lengths with short prompts.

    python benchmarks/bench_grpo.py                          # tiny Llama, 4 prompts x 8 completions, 3 repeats
    python benchmarks/bench_grpo.py --repeats 5 --threads 1  # steadier on a busy machine
    python benchmarks/bench_grpo.py --model smollm2          # SmolLM2-135M-Instruct with LoRA (the `real` extra)
    python benchmarks/bench_grpo.py --model qwen2_5_vl --threads 1  # image prompts: a small Qwen2.5-VL, 4 prompts x 8

What is timed is the training part of a GRPO step: everything after the completions exist (the reference / old
policy forwards when the set-up needs them, rewards, advantages, and the policy's forward and backward through TRL's
own ``compute_loss``) and the optimizer step. Generation is excluded: the completions come from a ``rollout_func``
(TRL's public hook for custom rollouts) that returns pre-drawn token ids at once, so every provider trains on the same
completions; generation itself (``model.generate``, the same code for every provider: ours leaves it untouched) is
timed separately, once per round in the stock process, and reported in its own column. Each (provider, scenario) case
runs in its own process: one warm-up step, then ``--steps`` steps. The providers are interleaved (stock, plain,
shared, stock, ...) for ``--repeats`` rounds; the table gives the median and spread (min-max) of tokens/s and of each
ratio, paired within a round. Tokens/s counts every prompt and completion token as TRL's padded batch holds them
without padding (the same numerator for every provider). Peak memory: the growth of the process's peak RSS over the
steps, warm-up included (ru_maxrss; CPU).

Data: per step ``--prompts`` prompts with ``--generations`` (G, default 8) completions each. ``lognormal``:
completion lengths lognormal (median ``--median-tokens``, sigma 0.8, long-tailed, clipped to [4, 2048]); each prompt
is the given share of its group's tokens as TRL counts them (``|p| / (|p| + mean |c|)``). ``uniform``: every
completion ``--median-tokens`` long, prompts 10% of the tokens. Random token ids. Models: ``--model tiny_llama``
(default): tiny Llama (hidden 256, 4 layers, vocab 4096), full fine-tuning; ``--model smollm2``:
SmolLM2-135M-Instruct (fp32, SDPA) with LoRA (r 16 on every linear layer). TRL's defaults otherwise (``beta=0``,
``loss_type="dapo"``, ``num_iterations=1``); ``--beta 0.04`` adds the reference model's forward.

Image prompts (``--model qwen2_5_vl``, scenario ``image:TOKENS``): a small Qwen2.5-VL built from its config (text
model hidden 256, 4 layers, as ``bench_vlm.py``; its vision tower 2 layers of hidden 32), its processor, one random
image per prompt of ``TOKENS`` image tokens (default 256: a 448 x 448 image, 1,024 patches, merged 2 x 2) after a short
question, completions of random text tokens (lognormal, median ``--median-tokens``, default 24 for this model). The
rollouts come from a ``rollout_func`` as above, the prompt ids being what TRL's processor call makes of each prompt, so
every provider trains on the same completions. Besides tokens/s and memory: the images the vision tower encoded per
step and the seconds per step of the log-prob forwards alone (TRL's ``_get_per_token_logps_and_entropies``; the
policy's backward excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment_line, format_table, quiet_case, run_in_subprocess, spread, tiny_llama_config  # noqa: E402

PROVIDERS = ("stock", "plain", "shared")
SCENARIOS = ("lognormal:0.2", "lognormal:0.5", "lognormal:0.8", "uniform:0.1")
MODELS = ("tiny_llama", "smollm2", "qwen2_5_vl")
VLM_SCENARIOS = ("image:256",)
VLM_TEXT = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=688,
                num_hidden_layers=4)  # fmt: skip


def make_rollouts(num_steps: int, prompts: int, generations: int, kind: str, share: float, median: int, seed: int = 0):
    """Per step, ``prompts`` groups ``(prompt_ids, [completion_ids] * generations)`` of random token ids in
    ``[3, 4096)`` (see the module docstring for the lengths)."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(num_steps):
        groups = []
        for _ in range(prompts):
            if kind == "uniform":
                lengths = np.full(generations, median)
            else:
                lengths = np.clip(np.rint(rng.lognormal(np.log(median), 0.8, size=generations)), 4, 2048).astype(int)
            prompt = max(1, int(round(share / (1 - share) * lengths.mean())))
            groups.append(
                (rng.integers(3, 4096, prompt).tolist(), [rng.integers(3, 4096, n).tolist() for n in lengths])
            )
        steps.append(groups)
    return steps


def _model(name: str):
    """``(model, trainer kwargs)`` of ``--model``."""
    import torch
    from transformers import LlamaForCausalLM

    if name == "smollm2":
        from peft import LoraConfig

        from unpack_trainer import load_smollm2

        model, _ = load_smollm2(attn_implementation="sdpa")
        return model, {"peft_config": LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")}
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(pad_token_id=0, eos_token_id=2, bos_token_id=1)), {}


class _StepTimer:
    """Seconds of every optimizer step (``on_step_begin`` to ``on_step_end``)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.seconds.append(time.perf_counter() - timer.start)

        self.start, self.seconds, self.callback = 0.0, [], Callback()


def run_case(provider: str, scenario: str, args: argparse.Namespace) -> dict:
    """Train ``args.steps`` + 1 steps of ``provider`` in this process on ``scenario``'s rollouts."""
    quiet_case(args.threads)
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from unpack_trainer import GRPOConfig, GRPOTrainer
    from unpack_trainer.trainers import grpo

    if args.packed_token_share is not None:
        grpo.PACKED_TOKEN_SHARE = args.packed_token_share
    kind, share = scenario.split(":")
    rollouts = make_rollouts(args.steps + 1, args.prompts, args.generations, kind, float(share), args.median_tokens)
    model, extra = _model(args.model)
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(4096)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2")
    step_of_prompt = {f"prompt {s} {g}": (s, g) for s in range(len(rollouts)) for g in range(args.prompts)}
    dataset = Dataset.from_dict({"prompt": list(step_of_prompt)})

    def rollout_func(prompts, trainer):
        """The pre-drawn rollouts of these prompts (TRL repeats each prompt G times, consecutively)."""
        prompt_ids, completion_ids = [], []
        for index, prompt in enumerate(prompts):
            step, group = step_of_prompt[prompt]
            ids, completions = rollouts[step][group]
            prompt_ids.append(ids)
            completion_ids.append(completions[index % args.generations])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    rows = args.prompts * args.generations
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=rows,
        num_generations=args.generations,
        max_steps=args.steps + 1,
        max_completion_length=2048,
        beta=args.beta,
        learning_rate=1e-6,
        report_to=[],
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        shuffle_dataset=False,
    )
    if provider == "stock":
        trainer_class, config = trl.GRPOTrainer, trl.GRPOConfig(**common)
    else:
        trainer_class, config = GRPOTrainer, GRPOConfig(**common, prefix_sharing=provider == "shared")
    if args.beta and not extra:  # a separate reference model: TRL builds it from the policy's folder
        folder = tempfile.mkdtemp()
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        model = folder
    timer = _StepTimer()
    trainer = trainer_class(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                            args=config, train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout_func,
                            callbacks=[timer.callback], **extra)  # fmt: skip
    assert provider == "stock" or trainer.unpack_decision.packed, trainer.unpack_decision.reason
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.train()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = sum(timer.seconds[1:])
    tokens = sum(len(p) * len(cs) + sum(map(len, cs)) for groups in rollouts[1:] for p, cs in groups)
    result = {"tokens_per_s": tokens / seconds, "peak_mib": (rss_after - rss_before) / 1024, "seconds": seconds}
    if provider != "stock":
        result["forwards"] = trainer.unpack_stats.get("forwards")
    elif args.generation:
        result["generation_s"] = _generation_seconds(trainer, rollouts[0], args)
    return result


def run_vlm_case(provider: str, scenario: str, args: argparse.Namespace) -> dict:
    """Train ``args.steps`` + 1 steps of ``provider`` in this process on image prompts (see the module docstring)."""
    quiet_case(args.threads)
    import trl
    from datasets import Dataset
    from PIL import Image
    from trl.data_utils import apply_chat_template

    from unpack_trainer import GRPOConfig, GRPOTrainer
    from unpack_trainer.model_zoo.tiny_vision import FIRST_TEXT_ID, VOCAB, tiny_processor, tiny_vision_model

    image_tokens = int(scenario.split(":")[1])
    side = int(round((image_tokens * 4) ** 0.5)) * 14  # merged 2 x 2 patches of 14 pixels
    processor = tiny_processor("qwen2_5_vl")
    processor.tokenizer.padding_side = "left"
    processor.image_processor.size = {"shortest_edge": side * side, "longest_edge": side * side}
    model = tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa", **VLM_TEXT)
    rng = np.random.default_rng(0)
    steps = args.steps + 1
    rows = []
    for step in range(steps):
        for group in range(args.prompts):
            pixels = rng.integers(0, 255, (side, side, 3), dtype=np.uint8)
            text = f"prompt {step} {group}: what is in the picture?"
            rows.append({"image": Image.fromarray(pixels), "prompt": [{"role": "user", "content": text}]})
    completions = {
        (step, group): [
            rng.integers(FIRST_TEXT_ID, VOCAB, int(n)).tolist()
            for n in np.clip(np.rint(rng.lognormal(np.log(args.median_tokens), 0.8, args.generations)), 4, 512)
        ]
        for step in range(steps)
        for group in range(args.prompts)
    }
    prompt_ids: dict[str, list[int]] = {}

    def rollout_func(prompts, trainer):
        """The pre-drawn completions of these prompts, after the prompt ids TRL's processor call makes of them."""
        ids, completion_ids = [], []
        for index, prompt in enumerate(prompts):
            parts = prompt[-1]["content"]
            text = next(part["text"] for part in parts if part.get("type") == "text")
            image = next(part["image"] for part in parts if part.get("type") == "image")
            if text not in prompt_ids:
                templated = apply_chat_template({"prompt": prompt}, processor)["prompt"]
                prompt_ids[text] = list(processor(images=[image], text=[templated])["input_ids"][0])
            step, group = (int(x) for x in text.split(":")[0].split()[1:])
            ids.append(prompt_ids[text])
            completion_ids.append(completions[(step, group)][index % args.generations])
        return {"prompt_ids": ids, "completion_ids": completion_ids, "logprobs": None}

    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_steps=steps, max_completion_length=512, beta=args.beta,
        learning_rate=1e-6, report_to=[], bf16=False, use_cpu=True, save_strategy="no", logging_steps=1000,
        disable_tqdm=True, shuffle_dataset=False,
    )  # fmt: skip
    if provider == "stock":
        trainer_class, config = trl.GRPOTrainer, trl.GRPOConfig(**common)
    else:
        trainer_class, config = GRPOTrainer, GRPOConfig(**common, prefix_sharing=provider == "shared")
    timer = _StepTimer()
    trainer = trainer_class(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                            args=config, train_dataset=Dataset.from_list(rows), processing_class=processor,
                            rollout_func=rollout_func, callbacks=[timer.callback])  # fmt: skip
    assert provider == "stock" or trainer.unpack_decision.packed, trainer.unpack_decision.reason
    encoded, forward_seconds = [], []
    logps_method = trainer._get_per_token_logps_and_entropies

    def count_images(module, args, kwargs):
        if forward_seconds and forward_seconds[-1] is None:  # inside a log-prob forward (not the self-check)
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            encoded.append(int(grid.shape[0]))

    def timed_logps(*args, **kwargs):
        start = time.perf_counter()
        forward_seconds.append(None)
        out = logps_method(*args, **kwargs)
        forward_seconds[-1] = time.perf_counter() - start
        return out

    trainer._get_per_token_logps_and_entropies = timed_logps
    model.model.visual.register_forward_pre_hook(count_images, with_kwargs=True)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.train()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = sum(timer.seconds[1:])
    per_step = len(forward_seconds) // steps
    tokens = sum(len(prompt_ids[r["prompt"][0]["content"]]) * args.generations for r in rows[args.prompts :])
    tokens += sum(len(c) for (step, _), cs in completions.items() if step > 0 for c in cs)
    result = {
        "tokens_per_s": tokens / seconds,
        "forward_tokens_per_s": tokens * per_step / sum(forward_seconds[per_step:]),
        "peak_mib": (rss_after - rss_before) / 1024,
        "seconds": seconds,
        "images_per_step": sum(encoded) / steps,
        "forwards_per_step": per_step,
        "prompt_tokens": float(np.mean(list(map(len, prompt_ids.values())))),
    }
    if provider != "stock":
        result["forwards"] = trainer.unpack_stats.get("forwards")
    return result


def _generation_seconds(trainer, groups, args: argparse.Namespace) -> float:
    """Seconds of ``model.generate`` sampling the first step's completions (each group's prompt, G samples, the mean
    completion length of the step as the number of new tokens): the generation a real step would run, the same code
    for every provider."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model)
    new_tokens = int(np.mean([len(c) for _, cs in groups for c in cs]))
    width = max(len(p) for p, _ in groups)
    ids = torch.zeros(len(groups), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(groups):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, num_return_sequences=args.generations, pad_token_id=0)  # fmt: skip
    return time.perf_counter() - start


def _case_arguments(argv: list[str]) -> list[str]:
    """``argv`` without ``--json`` and its value (only the parent writes the results)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), help="lognormal:SHARE or uniform:SHARE")
    parser.add_argument("--model", choices=MODELS, default="tiny_llama")
    parser.add_argument(
        "--median-tokens", type=int, default=None, help="median completion length (160; 24 for qwen2_5_vl)"
    )
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--no-generation", dest="generation", action="store_false", help="skip timing generation")
    parser.add_argument(
        "--packed-token-share",
        type=float,
        default=None,
        help="ours: override unpack_trainer.trainers.grpo.PACKED_TOKEN_SHARE (above 1: always pack)",
    )
    parser.add_argument("--json", help="also write every round's results to this file")
    args = parser.parse_args(argv)
    if args.median_tokens is None:
        args.median_tokens = 24 if args.model == "qwen2_5_vl" else 160
    if args.case:
        provider, scenario = args.case.split("@")
        case = run_vlm_case if args.model == "qwen2_5_vl" else run_case
        print(json.dumps(case(provider, scenario, args)))
        return
    if args.model == "qwen2_5_vl":
        vlm_table(args, argv if argv is not None else sys.argv[1:])
        return

    print(environment_line())
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for scenario in args.scenarios:
            order = PROVIDERS[repeat % 3 :] + PROVIDERS[: repeat % 3]
            for provider in order:
                command = [os.path.abspath(__file__), "--case", f"{provider}@{scenario}"]
                command += _case_arguments(argv if argv is not None else sys.argv[1:])
                results.setdefault((provider, scenario), []).append(run_in_subprocess(command, timeout=3600))
                print(f"  round {repeat + 1}, {scenario}, {provider}: "
                      f"{results[(provider, scenario)][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)  # fmt: skip
    rows = []
    for scenario in args.scenarios:
        stock, plain, shared = (results[(p, scenario)] for p in PROVIDERS)
        tps = {p: [r["tokens_per_s"] for r in results[(p, scenario)]] for p in PROVIDERS}
        kind, share = scenario.split(":")
        generation = [r["generation_s"] for r in stock if "generation_s" in r]
        forwards = shared[-1].get("forwards") or {}
        rows.append([
            f"{kind}, prompt {float(share):.0%}",
            spread(tps["stock"], ",.0f"),
            spread(tps["plain"], ",.0f"),
            spread(tps["shared"], ",.0f"),
            spread([b / a for a, b in zip(tps["stock"], tps["plain"])], ".2f"),
            spread([b / a for a, b in zip(tps["stock"], tps["shared"])], ".2f"),
            spread([b / a for a, b in zip(tps["plain"], tps["shared"])], ".2f"),
            " / ".join(f"{np.median([r['peak_mib'] for r in rs]):.0f}" for rs in (stock, plain, shared)),
            f"{np.median([s['peak_mib'] / max(a['peak_mib'], 1) for a, s in zip(stock, shared)]):.2f}",
            f"{forwards.get('packed', 0)} / {forwards.get('padded', 0)}",
            spread(generation, ".1f") if generation else "-",
            f"{np.median([r['seconds'] for r in stock]) / args.steps:.2f}",
        ])  # fmt: skip
    print()
    what = {"tiny_llama": "tiny Llama, full", "smollm2": "SmolLM2-135M-Instruct, LoRA r 16"}[args.model]
    print(f"GRPO training step (generation excluded), {what}, {args.prompts} prompts x {args.generations} completions "
          f"(median completion {args.median_tokens} tokens), beta {args.beta}, {args.steps} steps x {args.repeats} "
          "rounds (median (min-max)):")  # fmt: skip
    print(format_table(
        ["scenario", "stock tokens/s", "packed tokens/s", "shared tokens/s", "packed / stock", "shared / stock",
         "shared / packed", "peak MiB stock / packed / shared", "peak shared / stock", "shared forwards packed / TRL's",
         "generation s/step", "stock s/step (training)"],
        rows,
    ))  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({f"{p}@{s}": r for (p, s), r in results.items()}, handle, indent=1)


def vlm_table(args: argparse.Namespace, argv: list[str]) -> None:
    """The image-prompt benchmark (``--model qwen2_5_vl``): interleaved rounds, then one table."""
    print(environment_line())
    scenarios = args.scenarios if args.scenarios != list(SCENARIOS) else list(VLM_SCENARIOS)
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for scenario in scenarios:
            for provider in PROVIDERS[repeat % 3 :] + PROVIDERS[: repeat % 3]:
                command = [os.path.abspath(__file__), "--case", f"{provider}@{scenario}", *_case_arguments(argv)]
                results.setdefault((provider, scenario), []).append(run_in_subprocess(command, timeout=3600))
                print(f"  round {repeat + 1}, {scenario}, {provider}: "
                      f"{results[(provider, scenario)][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)  # fmt: skip
    names = {"stock": "trl.GRPOTrainer padded", "plain": "ours, packed (prompt repeated)",
             "shared": "ours, image prompt shared"}  # fmt: skip
    rows = []
    for scenario in scenarios:
        stock = results[("stock", scenario)]
        for provider in PROVIDERS:
            runs = results[(provider, scenario)]
            forwards = runs[-1].get("forwards") or {}
            rows.append([
                f"{scenario.split(':')[1]} image tokens", names[provider],
                spread([r["tokens_per_s"] for r in runs], ",.0f"),
                spread([r["tokens_per_s"] / s["tokens_per_s"] for r, s in zip(runs, stock)], ".2f"),
                spread([r["forward_tokens_per_s"] for r in runs], ",.0f"),
                spread([r["forward_tokens_per_s"] / s["forward_tokens_per_s"] for r, s in zip(runs, stock)], ".2f"),
                f"{np.median([r['images_per_step'] for r in runs]):.0f}",
                f"{np.median([r['peak_mib'] for r in runs]):,.0f}",
                f"{np.median([r['peak_mib'] / max(s['peak_mib'], 1) for r, s in zip(runs, stock)]):.2f}",
                f"{forwards.get('packed', 0)} / {forwards.get('padded', 0)}" if provider != "stock" else "-",
            ])  # fmt: skip
    prompt_tokens = np.median([r["prompt_tokens"] for r in results[("stock", scenarios[0])]])
    print()
    print(f"GRPO training step on image prompts (generation excluded), small Qwen2.5-VL, {args.prompts} prompts x "
          f"{args.generations} completions (prompt {prompt_tokens:.0f} tokens, median completion {args.median_tokens}), "
          f"beta {args.beta}, {args.steps} steps x {args.repeats} rounds (median (min-max)):")  # fmt: skip
    print(format_table(
        ["scenario", "provider", "step tokens/s", "vs stock", "log-prob forward tokens/s", "vs stock",
         "images encoded / step", "peak MiB", "memory vs stock", "forwards packed / TRL's"],
        rows,
    ))  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({f"{p}@{s}": r for (p, s), r in results.items()}, handle, indent=1)


if __name__ == "__main__":
    main()
