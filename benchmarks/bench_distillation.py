"""On-policy distillation: the student's and the teacher's forwards of a training step, stock ``trl.DistillationTrainer``
(padded) vs ``unpack_trainer.DistillationTrainer`` (one packed row per micro-batch, built once for both models), and
peak memory.

    python benchmarks/bench_distillation.py                          # tiny Llama student and teacher, 3 repeats
    python benchmarks/bench_distillation.py --repeats 5 --threads 1  # steadier on a busy machine
    python benchmarks/bench_distillation.py --model smollm2          # SmolLM2-135M-Instruct: LoRA student, full teacher

What is timed is the training part of a distillation step: TRL's own ``compute_loss`` on a micro-batch whose
completions exist (the student's forward with gradients, the teacher's without, the chunked generalized JSD through
both LM heads) and the backward; the optimizer step and generation are excluded. The micro-batches are TRL's
``(prompts, prompt + completion)`` inputs, built from pre-drawn token ids (left-padded prompts, right-padded
completions, ``num_items_in_batch``), so both providers train on the same completions; generation itself
(``model.generate`` of the student, the same code for both: ours leaves it untouched) is timed once per round in the
stock process and reported in its own column. Also reported: the seconds of the two backbone forwards alone (TRL's
``_get_last_hidden_state``, student and teacher; their backward excluded). Each (provider, scenario) case runs in its
own process: one warm-up micro-batch, then ``--steps`` timed ones. The providers are interleaved (stock, ours, ours,
stock, ...) for ``--repeats`` rounds; the table gives the median and spread (min-max) of each rate and ratio, paired
within a round. Tokens/s counts every prompt and completion token without padding (the same numerator for both).
Peak memory: the growth of the process's peak RSS over the micro-batches, warm-up included (ru_maxrss; CPU).

Data: per micro-batch ``--prompts`` prompts, one completion each (TRL's distillation generates one per prompt).
``lognormal:SHARE``: completion lengths lognormal (median ``--median-tokens``, sigma 0.8, clipped to [4, 2048]),
prompt lengths lognormal too (sigma 0.8, clipped to [1, 2048]) with the median that makes prompts ``SHARE`` of the
tokens; ``uniform:SHARE``: every completion ``--median-tokens`` long, every prompt the share's length. Random token
ids. Models: ``--model tiny_llama`` (default): a tiny Llama student (hidden 256, 4 layers, vocab 4096, full
fine-tuning) and a wider tiny Llama teacher (hidden 384, 6 layers); ``--model smollm2``: SmolLM2-135M-Instruct (fp32,
SDPA) as the student with LoRA (r 16 on every linear layer) and as the teacher (the `real` extra). fp32, activation
checkpointing off, TRL's ``beta=1.0`` and ``temperature=1.0`` unless given.
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

PROVIDERS = ("stock", "ours")
SCENARIOS = ("lognormal:0.5",)
MODELS = ("tiny_llama", "smollm2")
VOCAB = 4096


def make_batches(count: int, prompts: int, kind: str, share: float, median: int, vocab: int, seed: int = 0):
    """``count`` micro-batches of ``prompts`` ``(prompt_ids, completion_ids)`` pairs of random token ids in
    ``[3, vocab)`` (see the module docstring for the lengths)."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        if kind == "uniform":
            completion = np.full(prompts, median)
            prompt = np.full(prompts, max(1, int(round(share / (1 - share) * median))))
        else:
            completion = np.clip(np.rint(rng.lognormal(np.log(median), 0.8, prompts)), 4, 2048).astype(int)
            prompt_median = share / (1 - share) * median
            prompt = np.clip(np.rint(rng.lognormal(np.log(prompt_median), 0.8, prompts)), 1, 2048).astype(int)
        batches.append([(rng.integers(3, vocab, p).tolist(), rng.integers(3, vocab, c).tolist())
                        for p, c in zip(prompt, completion)])  # fmt: skip
    return batches


def trl_inputs(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """TRL's distillation micro-batch of ``pairs``: ``prompt_ids`` / ``prompt_mask`` ``(B, P)`` left-padded,
    ``completion_ids`` / ``completion_mask`` ``(B, C)`` right-padded (int64, pad id 0), ``num_items_in_batch`` (the
    completion tokens), as ``_generate_and_score_completions`` returns it."""
    import torch

    width_p, width_c = max(len(p) for p, _ in pairs), max(len(c) for _, c in pairs)
    prompt_ids = torch.zeros(len(pairs), width_p, dtype=torch.int64)
    completion_ids = torch.zeros(len(pairs), width_c, dtype=torch.int64)
    prompt_mask, completion_mask = torch.zeros_like(prompt_ids), torch.zeros_like(completion_ids)
    for row, (prompt, completion) in enumerate(pairs):
        prompt_ids[row, width_p - len(prompt) :], prompt_mask[row, width_p - len(prompt) :] = torch.tensor(prompt), 1
        completion_ids[row, : len(completion)], completion_mask[row, : len(completion)] = torch.tensor(completion), 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "num_items_in_batch": completion_mask.sum()}  # fmt: skip


def _models(name: str):
    """``(student, teacher, vocab, trainer kwargs)`` of ``--model``."""
    import torch
    from transformers import LlamaForCausalLM

    if name == "smollm2":
        from peft import LoraConfig

        from unpack_trainer import load_smollm2

        student, _ = load_smollm2(attn_implementation="sdpa")
        teacher, _ = load_smollm2(attn_implementation="sdpa")
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
        return student, teacher, student.config.vocab_size, {"peft_config": lora}
    torch.manual_seed(0)
    student = LlamaForCausalLM(tiny_llama_config(pad_token_id=0, eos_token_id=2, bos_token_id=1))
    torch.manual_seed(1)
    teacher_config = tiny_llama_config(pad_token_id=0, eos_token_id=2, bos_token_id=1, hidden_size=384,
                                       intermediate_size=1024, num_hidden_layers=6, num_attention_heads=12,
                                       num_key_value_heads=4)  # fmt: skip
    return student, LlamaForCausalLM(teacher_config), VOCAB, {}


def run_case(provider: str, scenario: str, args: argparse.Namespace) -> dict:
    """Time ``args.steps`` micro-batches (after one warm-up) of ``provider`` in this process on ``scenario``."""
    quiet_case(args.threads)
    import torch
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from unpack_trainer import DistillationConfig, DistillationTrainer

    student, teacher, vocab, extra = _models(args.model)
    kind, share = scenario.split(":")
    batches = make_batches(args.steps + 1, args.prompts, kind, float(share), args.median_tokens, vocab)
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2")
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.prompts, beta=args.beta,
                  temperature=args.temperature, report_to=[], bf16=False, use_cpu=True, save_strategy="no",
                  gradient_checkpointing=False, disable_tqdm=True)  # fmt: skip
    if provider == "stock":
        trainer_class, config = trl.DistillationTrainer, trl.DistillationConfig(**common)
    else:
        trainer_class, config = DistillationTrainer, DistillationConfig(**common)
    trainer = trainer_class(model=student, teacher_model=teacher, args=config,
                            train_dataset=Dataset.from_dict({"prompt": ["t5"] * args.prompts}),
                            processing_class=tokenizer, **extra)  # fmt: skip
    assert provider == "stock" or trainer.unpack_decision.packed, trainer.unpack_decision.reason
    trainer.get_train_dataloader()  # ours: the self-checks run here, before anything is timed
    generation = _generation_seconds(trainer, batches[0]) if provider == "stock" and args.generation else None
    forward_seconds: list[float] = []
    hidden_method = trainer._get_last_hidden_state

    def timed_hidden(*call_args, **kwargs):
        start = time.perf_counter()
        out = hidden_method(*call_args, **kwargs)
        forward_seconds.append(time.perf_counter() - start)
        return out

    trainer._get_last_hidden_state = timed_hidden
    model = trainer.model
    model.train()
    inputs = [trl_inputs(pairs) for pairs in batches]

    def step(batch: dict) -> None:
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(inputs[0])  # warm-up
    forward_seconds.clear()
    start = time.perf_counter()
    for batch in inputs[1:]:
        step(batch)
    seconds = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tokens = sum(len(p) + len(c) for pairs in batches[1:] for p, c in pairs)
    padded = sum(max(map(len, (p for p, _ in pairs))) + max(map(len, (c for _, c in pairs)))
                 for pairs in batches[1:]) * args.prompts  # fmt: skip
    result = {
        "tokens_per_s": tokens / seconds,
        "forward_tokens_per_s": tokens / sum(forward_seconds),
        "peak_mib": (rss_after - rss_before) / 1024,
        "seconds": seconds,
        "padding": 1 - tokens / padded,
    }
    if provider != "stock":
        result["forwards"] = trainer.unpack_stats.get("forwards")
    if generation is not None:
        result["generation_s"] = generation
    del torch
    return result


def _generation_seconds(trainer, pairs: list[tuple[list[int], list[int]]]) -> float:
    """Seconds of ``model.generate`` sampling one micro-batch's completions (its prompts, the mean completion length
    as the number of new tokens): the generation a real step runs, the same code for both providers."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model)
    new_tokens = int(np.mean([len(c) for _, c in pairs]))
    width = max(len(p) for p, _ in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(pairs):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=0)  # fmt: skip
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
    parser.add_argument("--steps", type=int, default=3, help="timed micro-batches per case")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (one completion each) per micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), help="lognormal:SHARE or uniform:SHARE")
    parser.add_argument("--model", choices=MODELS, default="tiny_llama")
    parser.add_argument("--median-tokens", type=int, default=None, help="median completion length (160; 48 smollm2)")
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-generation", dest="generation", action="store_false", help="skip timing generation")
    parser.add_argument("--json", help="also write every round's results to this file")
    args = parser.parse_args(argv)
    if args.median_tokens is None:
        args.median_tokens = 48 if args.model == "smollm2" else 160
    if args.case:
        provider, scenario = args.case.split("@")
        print(json.dumps(run_case(provider, scenario, args)))
        return

    print(environment_line())
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for scenario in args.scenarios:
            for provider in PROVIDERS if repeat % 2 == 0 else PROVIDERS[::-1]:
                command = [os.path.abspath(__file__), "--case", f"{provider}@{scenario}"]
                command += _case_arguments(argv if argv is not None else sys.argv[1:])
                results.setdefault((provider, scenario), []).append(run_in_subprocess(command, timeout=3600))
                print(f"  round {repeat + 1}, {scenario}, {provider}: "
                      f"{results[(provider, scenario)][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)  # fmt: skip
    rows = []
    for scenario in args.scenarios:
        stock, ours = (results[(p, scenario)] for p in PROVIDERS)
        kind, share = scenario.split(":")
        generation = [r["generation_s"] for r in stock if "generation_s" in r]
        forwards = ours[-1].get("forwards") or {}
        rows.append([
            f"{kind}, prompt {float(share):.0%} (padding {np.median([r['padding'] for r in stock]):.0%})",
            spread([r["forward_tokens_per_s"] for r in stock], ",.0f"),
            spread([r["forward_tokens_per_s"] for r in ours], ",.0f"),
            spread([o["forward_tokens_per_s"] / s["forward_tokens_per_s"] for s, o in zip(stock, ours)], ".2f"),
            spread([r["tokens_per_s"] for r in stock], ",.0f"),
            spread([r["tokens_per_s"] for r in ours], ",.0f"),
            spread([o["tokens_per_s"] / s["tokens_per_s"] for s, o in zip(stock, ours)], ".2f"),
            " / ".join(f"{np.median([r['peak_mib'] for r in rs]):.0f}" for rs in (stock, ours)),
            f"{np.median([o['peak_mib'] / max(s['peak_mib'], 1) for s, o in zip(stock, ours)]):.2f}",
            f"{forwards.get('packed', 0)} / {forwards.get('padded', 0)}",
            spread(generation, ".2f") if generation else "-",
            f"{np.median([r['seconds'] for r in stock]) / args.steps:.2f}",
        ])  # fmt: skip
    print()
    what = {"tiny_llama": "tiny Llama student (full) and wider tiny Llama teacher",
            "smollm2": "SmolLM2-135M-Instruct student (LoRA r 16) and teacher"}[args.model]  # fmt: skip
    print(f"Distillation training step (generation and optimizer excluded), {what}, {args.prompts} prompts x 1 "
          f"completion (median completion {args.median_tokens} tokens), beta {args.beta}, {args.steps} micro-batches "
          f"x {args.repeats} rounds (median (min-max)):")  # fmt: skip
    print(format_table(
        ["scenario", "stock forwards tokens/s", "ours forwards tokens/s", "forwards ours / stock",
         "stock step tokens/s", "ours step tokens/s", "step ours / stock", "peak MiB stock / ours",
         "peak ours / stock", "ours forwards packed / TRL's", "generation s / micro-batch",
         "stock s / micro-batch (training)"],
        rows,
    ))  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({f"{p}@{s}": r for (p, s), r in results.items()}, handle, indent=1)


if __name__ == "__main__":
    main()
