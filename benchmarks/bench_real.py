"""A real model: SmolLM2-135M-Instruct (the `real` extra) fine-tuned on the embedded chat data, on the CPU.

Two parts, every case in its own process (so that peak RSS is that case's), repeats interleaved (repeat 1 of every
case, then repeat 2, ...), median and spread (min-max) over the repeats:

1. ``SFTTrainer`` throughput in real (non-pad) tokens/s and peak RSS, for stock TRL padded, stock TRL
   ``packing=True``, unpack_trainer ``packing=True`` and unpack_trainer automatic padding-free, at each
   ``--max-lengths``. The data is the embedded default data in TRL's conversational prompt-completion format, rendered
   by SmolLM2's chat template. Same model, data, seed and ``SFTConfig`` otherwise (float32, AdamW, no gradient
   checkpointing); packed providers take one row of ``max_length`` per step, the others ``--batch-size`` samples. The
   first optimizer step is a warm-up and is not timed.
2. One forward + backward of one packed row of about ``--row-tokens`` tokens of the same chat samples: stock
   transformers (packed ``position_ids``, so it builds the dense T x T block-causal mask; ``use_cache=False``, without
   which stock transformers ignores the packing), the patched model, and the same samples one by one (gradients
   accumulated). Seconds for the timed fwd+bwd (after a short warm-up) and peak RSS.

    python benchmarks/bench_real.py                                   # both parts, 3 repeats
    python benchmarks/bench_real.py --part trainer --repeats 2 --steps 2
    python benchmarks/bench_real.py --report results.jsonl             # print the tables of a (partial) run again

Each finished case is appended to ``--results`` (JSON lines) as it completes, so an interrupted run still has a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, format_table, quiet_case, run_in_subprocess  # noqa: E402

TRAINER_PROVIDERS = {
    "trl_padded": "(a) trl.SFTTrainer, padded",
    "trl_packing": "(b) trl.SFTTrainer, packing=True",
    "unpack_packing": "(c) unpack_trainer, packing=True",
    "unpack_auto": "(d) unpack_trainer, automatic padding-free",
}
ROW_PROVIDERS = {
    "stock": "stock transformers, dense block-causal mask",
    "unpack": "unpack_trainer patched",
    "one_by_one": "each sample alone (gradients accumulated)",
}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def chat_dataset(num_samples: int):
    """The first ``num_samples`` records of the embedded train split, conversational prompt-completion."""
    from unpack_trainer import load_default_dataset

    return load_default_dataset("train", conversational=True).select(range(num_samples))


def run_trainer_case(provider: str, max_length: int, steps: int, batch_size: int) -> dict[str, Any]:
    """Train ``steps`` + 1 optimizer steps in this process; throughput over the last ``steps``."""
    import torch

    from unpack_trainer import load_smollm2
    from unpack_trainer.cli.trainer_comparison import time_training

    quiet_case()
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    # Enough samples for every step of every provider (about 150 tokens each with the chat template).
    dataset = chat_dataset((steps + 1) * max(batch_size, max_length // 100) * 3)
    return time_training(
        provider, model, tokenizer, dataset, max_length=max_length, steps=steps, batch_size=batch_size
    )


def row_samples(row_tokens: int) -> list[list[int]]:
    """Chat samples (SmolLM2 template) in dataset order, as many as fit in ``row_tokens`` tokens."""
    from transformers import AutoTokenizer

    from unpack_trainer.model_zoo.smollm2 import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    samples, total = [], 0
    for record in chat_dataset(400):
        ids = tokenizer.apply_chat_template(record["prompt"] + record["completion"], tokenize=True, return_dict=True)
        ids = ids["input_ids"]
        if total + len(ids) > row_tokens:
            if total:
                break
            continue
        samples.append(ids)
        total += len(ids)
    return samples


def run_row_case(provider: str, row_tokens: int) -> dict[str, Any]:
    """One timed forward + backward of one packed row (or its samples one by one), after a 64-token warm-up."""
    import torch

    from unpack_trainer import load_smollm2, patch_model
    from unpack_trainer.data.collator import packed_metadata

    quiet_case()
    samples = row_samples(row_tokens)
    model, _ = load_smollm2()
    model.train()
    if provider == "unpack":
        patch_model(model)

    def packed_inputs(seqs: list[list[int]]) -> dict[str, Any]:
        ids = torch.tensor([token for seq in seqs for token in seq], dtype=torch.long)[None]
        labels = ids.clone()
        start = 0
        for seq in seqs:
            labels[0, start] = -100
            start += len(seq)
        metadata = packed_metadata([len(seq) for seq in seqs])
        if provider == "stock":  # what transformers detects by itself: restarting position_ids, no cache
            return {
                "input_ids": ids,
                "labels": labels,
                "position_ids": metadata["position_ids"],
                "use_cache": False,
            }
        return {"input_ids": ids, "labels": labels, **metadata}

    def fwd_bwd(seqs: list[list[int]]) -> None:
        if provider == "one_by_one":
            total = sum(len(seq) - 1 for seq in seqs)
            for seq in seqs:
                ids = torch.tensor(seq, dtype=torch.long)[None]
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                (loss * (len(seq) - 1) / total).backward()
        else:
            model(**packed_inputs(seqs)).loss.backward()
        model.zero_grad(set_to_none=True)

    fwd_bwd([samples[0][:32], samples[1][:32]])
    start = time.perf_counter()
    fwd_bwd(samples)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_rss_mb": _peak_rss_mb(),
        "tokens": sum(map(len, samples)),
        "samples": len(samples),
        "tokens_per_s": sum(map(len, samples)) / seconds,
    }


# --------------------------------------------------------------------------------------------------------------------
# Driver: interleaved repeats, each case in a fresh process, results appended as JSON lines
# --------------------------------------------------------------------------------------------------------------------


def _case_command(case: dict[str, Any], args: argparse.Namespace) -> list[str]:
    command = [str(Path(__file__).resolve()), "--case", json.dumps(case)]
    return command + ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]


def _cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    if args.part in ("trainer", "all"):
        cases += [
            {"part": "trainer", "provider": provider, "max_length": max_length}
            for max_length in args.max_lengths
            for provider in args.providers
        ]
    if args.part in ("row", "all"):
        cases += [{"part": "row", "provider": provider, "row_tokens": args.row_tokens} for provider in ROW_PROVIDERS]
    return cases


def _spread(values: list[float], fmt: str) -> str:
    median = statistics.median(values)
    if len(values) == 1:
        return format(median, fmt)
    return f"{format(median, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def report(records: list[dict[str, Any]]) -> str:
    """Markdown tables (median, min-max over repeats) of the finished cases."""
    lines: list[str] = []
    trainer = [r for r in records if r["case"]["part"] == "trainer"]
    if trainer:
        steps = {r["steps"] for r in trainer}
        batches = {r["batch_size"] for r in trainer}
        lines += [
            f"### SmolLM2-135M-Instruct SFTTrainer throughput, real (non-pad) tokens/s, embedded chat data, "
            f"{'/'.join(map(str, sorted(steps)))} timed steps, batch {'/'.join(map(str, sorted(batches)))}",
            "",
        ]
        rows = []
        for max_length in sorted({r["case"]["max_length"] for r in trainer}):
            by_provider: dict[str, list[dict[str, Any]]] = {}
            by_repeat: dict[str, dict[int, float]] = {}  # provider -> repeat -> tokens/s
            for r in trainer:
                if r["case"]["max_length"] == max_length:
                    by_provider.setdefault(r["case"]["provider"], []).append(r["result"])
                    by_repeat.setdefault(r["case"]["provider"], {})[r["repeat"]] = r["result"]["tokens_per_s"]
            for provider in TRAINER_PROVIDERS:
                if provider not in by_provider:
                    continue
                results = by_provider[provider]
                # The load of a shared machine drifts between repeats: compare providers within each repeat (they ran
                # minutes apart), then take the median of those ratios.
                ratios = []
                for base in ("trl_padded", "trl_packing"):
                    common = sorted(set(by_repeat[provider]) & set(by_repeat.get(base, {})))
                    values = [by_repeat[provider][k] / by_repeat[base][k] for k in common]
                    ratios.append(_spread(values, ".2f") + "x" if values else "-")
                selfcheck = [x["selfcheck_s"] * 1000 for x in results if "selfcheck_s" in x]
                rows.append(
                    [
                        max_length,
                        TRAINER_PROVIDERS[provider],
                        len(results),
                        _spread([x["tokens_per_s"] for x in results], ",.0f"),
                        _spread([x["seconds_per_step"] for x in results], ".1f"),
                        _spread([x["peak_rss_mb"] for x in results], ",.0f"),
                        *ratios,
                        _spread(selfcheck, ",.0f") if selfcheck else "-",
                    ]
                )
        headers = [
            "max_length",
            "provider",
            "repeats",
            "tokens/s",
            "s/step",
            "peak RSS MB",
            "vs (a)",
            "vs (b)",
            "self-check ms",
        ]
        lines += [format_table(headers, rows), ""]
    row = [r for r in records if r["case"]["part"] == "row"]
    if row:
        by_provider = {}
        for r in row:
            by_provider.setdefault(r["case"]["provider"], []).append(r["result"])
        first = row[0]["result"]
        lines += [
            f"### One forward + backward of one packed row of {first['tokens']:,} tokens ({first['samples']} chat "
            "samples), SmolLM2-135M-Instruct, float32",
            "",
        ]
        stock = statistics.median(x["seconds"] for x in by_provider.get("stock", [{"seconds": float("nan")}]))
        rows = []
        for provider, name in ROW_PROVIDERS.items():
            if provider not in by_provider:
                continue
            results = by_provider[provider]
            median = statistics.median(x["seconds"] for x in results)
            rows.append(
                [
                    name,
                    len(results),
                    _spread([x["seconds"] for x in results], ".1f"),
                    _spread([x["peak_rss_mb"] for x in results], ",.0f"),
                    f"{stock / median:.2f}x",
                ]
            )
        lines += [format_table(["provider", "repeats", "seconds", "peak RSS MB", "speedup vs stock"], rows), ""]
    return "\n".join(lines)


def _environment_line() -> str:
    env = environment()
    return ", ".join(f"{k} {v}" for k, v in env.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["trainer", "row", "all"], default="all")
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--providers", nargs="+", default=list(TRAINER_PROVIDERS), choices=list(TRAINER_PROVIDERS))
    parser.add_argument(
        "--steps", type=int, default=2, help="timed optimizer steps per trainer case (after a warm-up)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="samples per padded or padding-free batch")
    parser.add_argument("--row-tokens", type=int, default=4096, help="tokens of the packed row of part 2")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every case")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads per case (0: torch's default)")
    parser.add_argument("--results", type=Path, default=Path("/tmp/bench_real.jsonl"), help="JSON lines, appended")
    parser.add_argument("--report", type=Path, help="only print the tables of an earlier --results file")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        case = json.loads(args.case)
        if case["part"] == "trainer":
            result = run_trainer_case(case["provider"], case["max_length"], args.steps, args.batch_size)
        else:
            result = run_row_case(case["provider"], case["row_tokens"])
        print(json.dumps(result))
        return
    if args.report:
        records = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
        print(report(records))
        return

    from unpack_trainer import smollm2_path

    smollm2_path()  # convert once, before any timed case
    print(_environment_line() + "\n", flush=True)
    records = []
    for repeat in range(args.repeats):
        for case in _cases(args):
            try:
                result = run_in_subprocess(_case_command(case, args), timeout=3600)
            except (RuntimeError, subprocess.TimeoutExpired) as error:  # keep the other cases' numbers
                print(f"repeat {repeat}: {case} FAILED: {error}", file=sys.stderr, flush=True)
                continue
            record = {"case": case, "repeat": repeat, "steps": args.steps, "batch_size": args.batch_size}
            record["threads"] = args.threads
            record["result"] = result
            records.append(record)
            with args.results.open("a") as stream:
                stream.write(json.dumps(record) + "\n")
            print(f"repeat {repeat}: {case} -> {result}", file=sys.stderr, flush=True)
    print(report(records))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
