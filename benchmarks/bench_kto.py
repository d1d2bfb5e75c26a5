"""KTO step throughput and peak memory: stock ``trl.KTOTrainer`` (padded) vs ``unpack_trainer.KTOTrainer`` packed
without prefix sharing vs packed with prefix sharing, on unpaired examples whose prompts are a given share of their
tokens.

    python benchmarks/bench_kto.py                                # tiny Llama, 8 examples per batch, prompts 50%
    python benchmarks/bench_kto.py --repeats 5 --threads 1        # steadier on a busy machine
    python benchmarks/bench_kto.py --shares 0.2 0.5 0.8           # several prompt shares
    python benchmarks/bench_kto.py --completions-per-prompt 2     # each prompt twice in a row (a paired set unpaired)
    python benchmarks/bench_kto.py --loss-type apo_zero_unpaired  # no KL rows

Each (provider, prompt share) case runs in its own process: one warm-up step, then ``--steps`` training steps through
the trainers' own ``compute_loss`` (the policy's forward with gradient and, for ``loss_type="kto"``, its KL forward
without; the reference model's forwards) and ``backward``, on the same examples. The providers are interleaved (stock,
plain, shared, stock, ...) for ``--repeats`` rounds, their order rotated each round; the table gives the median and
spread (min-max) of tokens/s and of each ratio, paired within a round. Tokens/s counts the tokens of every sequence
stock TRL runs, without its padding (``[p_i, c_i]`` and, with the KL term, ``[p_i, c_{i-1}]``), the same numerator for
every provider; one table divides by the process's CPU time (torch on one thread with ``--threads 1``: what the step
costs, steadier than wall time on a machine other jobs share), one by wall time. Peak memory: the growth of the
process's peak RSS over the training steps, warm-up included (ru_maxrss; CPU).

Data: examples ``|p| + |c|`` lognormal (median ``--median-tokens``, sigma 0.6, clipped to [16, 2048]), the prompt the
given share of them, random token ids, labels desirable or not at random (half each); with
``--completions-per-prompt k`` the examples come in runs of ``k`` with the same prompt (as a paired preference set
unpaired pair by pair, or several rated answers per prompt), each completion its own length. TRL pairs each prompt with
the previous example's completion for the KL term (``train_sampling_strategy="sequential"``). Model: the benchmarks'
tiny Llama (hidden 256, 4 layers, 8 heads, 4 kv heads, vocab 4096), full fine-tuning with a separate reference model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dpo import _models, _spread, word_tokenizer  # noqa: E402
from common import (  # noqa: E402
    environment_line,
    format_table,
    quiet_case,
    run_in_subprocess,
    timed_loss_steps,
)

PROVIDERS = ("stock", "plain", "shared")


def make_examples(
    num_examples: int, share: float, *, per_prompt: int = 1, seed: int = 0, median: int = 240
) -> list[dict]:
    """``num_examples`` unpaired examples of token ids (``prompt_ids``, ``completion_ids``, ``label``) whose prompts
    hold ``share`` of their tokens, in runs of ``per_prompt`` examples with one prompt (see the module docstring)."""
    rng = np.random.default_rng(seed)
    examples = []
    while len(examples) < num_examples:
        total = int(np.clip(np.rint(rng.lognormal(np.log(median), 0.6)), 16, 2048))
        prompt = rng.integers(3, 4096, size=max(1, int(round(share * total)))).tolist()
        for _ in range(per_prompt):
            length = int(np.clip(np.rint(rng.lognormal(np.log(median), 0.6)), 16, 2048))
            completion = max(1, length - int(round(share * length)))
            examples.append({"prompt_ids": prompt, "completion_ids": rng.integers(3, 4096, size=completion).tolist(),
                             "label": bool(rng.integers(0, 2))})  # fmt: skip
    return examples[:num_examples]


def run_case(provider: str, share: float, args: argparse.Namespace) -> dict:
    """Train ``args.steps`` + 1 steps of ``provider`` in this process; tokens/s and the growth of peak RSS (MiB)."""
    quiet_case(args.threads)
    import trl
    from datasets import Dataset

    from unpack_trainer import KTOConfig, KTOTrainer

    model, ref_model, _ = _models("tiny_llama")
    examples = make_examples(args.batch_size * (args.steps + 1), share, per_prompt=args.completions_per_prompt,
                             median=args.median_tokens)  # fmt: skip
    # The word-level tokenizer's text of the ids; completions start with a space (TRL tokenizes prompt + completion
    # as one text). TRL appends EOS to each completion.
    rows = [{"prompt": " ".join(f"t{i}" for i in e["prompt_ids"]),
             "completion": " " + " ".join(f"t{i}" for i in e["completion_ids"]), "label": e["label"]}
            for e in examples]  # fmt: skip
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch_size, report_to=[],
                  bf16=False, use_cpu=True, gradient_checkpointing=False, max_length=None,
                  loss_type=args.loss_type)  # fmt: skip
    if provider == "stock":
        trainer_class, config = trl.KTOTrainer, trl.KTOConfig(**common)
    else:
        trainer_class, config = KTOTrainer, KTOConfig(**common, prefix_sharing=provider == "shared")
    trainer = trainer_class(model=model, ref_model=ref_model, args=config, train_dataset=Dataset.from_list(rows),
                            processing_class=word_tokenizer())  # fmt: skip
    assert provider == "stock" or trainer.unpack_decision.packed, trainer.unpack_decision.reason
    prepared = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    timed = timed_loss_steps(trainer, args.batch_size, prepared, args.steps)
    tokens = 0
    for example in prepared[args.batch_size :]:
        tokens += len(example["prompt_ids"]) + len(example["completion_ids"])
        if "KL_completion_ids" in example:
            tokens += len(example["prompt_ids"]) + len(example["KL_completion_ids"])
    return {"tokens_per_s": tokens / timed["seconds"], "tokens_per_cpu_s": tokens / timed["cpu_seconds"],
            "peak_mib": timed["peak_mib"], "seconds": timed["seconds"]}  # fmt: skip


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="examples per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5])
    parser.add_argument("--median-tokens", type=int, default=240, help="median |p| + |c| of an example")
    parser.add_argument("--completions-per-prompt", type=int, default=1)
    parser.add_argument("--loss-type", choices=["kto", "apo_zero_unpaired"], default="kto")
    return parser.parse_args(argv)


def _case_command(args: argparse.Namespace, provider: str, share: float) -> list[str]:
    command = [os.path.abspath(__file__), "--case", f"{provider}:{share}", "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--median-tokens", str(args.median_tokens),
               "--completions-per-prompt", str(args.completions_per_prompt),
               "--loss-type", args.loss_type]  # fmt: skip
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    return command


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    if args.case:
        provider, share = args.case.split(":")
        print(json.dumps(run_case(provider, float(share), args)))
        return
    print(environment_line())
    results: dict[tuple[str, float], list[dict]] = {}
    for repeat in range(args.repeats):
        for share in args.shares:
            for provider in PROVIDERS[repeat % 3 :] + PROVIDERS[: repeat % 3]:
                result = run_in_subprocess(_case_command(args, provider, share), timeout=3600)
                results.setdefault((provider, share), []).append(result)
                print(f"  round {repeat + 1}, prompt {share:.0%}, {provider}: {result['tokens_per_s']:,.0f} tokens/s, "
                      f"{result['tokens_per_cpu_s']:,.0f} per CPU second", flush=True)  # fmt: skip
    for key, clock in (("tokens_per_cpu_s", "the process's CPU time"), ("tokens_per_s", "wall time")):
        print(f"\nKTO step (loss_type={args.loss_type!r}), tiny Llama, full fine-tuning + reference model, "
              f"{args.batch_size} examples per batch (median example {args.median_tokens} tokens, "
              f"{args.completions_per_prompt} completion(s) per prompt), {args.steps} steps x {args.repeats} rounds, "
              f"by {clock} (median (min-max)):")  # fmt: skip
        print(_table(results, args.shares, key))


def _table(results: dict[tuple[str, float], list[dict]], shares: list[float], key: str) -> str:
    """Tokens per second (``key``: per wall or CPU second) of each provider, their ratios paired within a round, and
    the median peak memory."""
    rows = []
    for share in shares:
        tps = {p: [r[key] for r in results[(p, share)]] for p in PROVIDERS}
        peak = {p: [r["peak_mib"] for r in results[(p, share)]] for p in PROVIDERS}
        rows.append([
            f"{share:.0%}",
            *(_spread(tps[p], ",.0f") for p in PROVIDERS),
            _spread([b / a for a, b in zip(tps["stock"], tps["plain"])], ".2f"),
            _spread([b / a for a, b in zip(tps["stock"], tps["shared"])], ".2f"),
            _spread([b / a for a, b in zip(tps["plain"], tps["shared"])], ".2f"),
            " / ".join(f"{np.median(peak[p]):.0f}" for p in PROVIDERS),
        ])  # fmt: skip
    return format_table(
        ["prompt share", "stock tokens/s", "packed tokens/s", "shared tokens/s", "packed / stock",
         "shared / stock", "shared / packed", "peak MiB stock / packed / shared"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
