"""Vision-language training: stock TRL padded vs ours (padding-free, packed), real tokens/s and peak memory; and the
held-out loss of packed vs padded training over seeds.

    python benchmarks/bench_vlm.py                        # throughput: 3 providers, 5 interleaved repeats
    python benchmarks/bench_vlm.py --quality              # quality: held-out loss, padded vs packed, 3 seeds
    python benchmarks/bench_vlm.py --quick                # smoke test (CI): 1 repeat, 2 steps, 1 seed

Model: a small Qwen2.5-VL built from its config (:mod:`unpack_trainer.model_zoo.tiny_vision`: text model hidden 256, 4
layers, 8 heads of 32, 4 key/value heads; vision tower 2 layers of 32, patches of 14, merge 2), random init, fp32, and
its processor (character tokenizer). Data: the drawn shapes with captions of
:mod:`unpack_trainer.data.default_vision_data` (images 56 to 224 pixels a side: 4 to 64 image tokens; answers of a
one-line caption plus a lognormal number of sentences, 33 to ~1,000 characters, median 110), a chat mix of mostly
short samples with a long tail, 50 to ~1,100 tokens.

Throughput providers (``--providers``), each case in its own process (peak RSS is that case's), interleaved
(a b c a b c ...) for ``--repeats`` rounds: medians and min-max of real (non-pad) tokens/s over the rounds, ratios
paired within a round (a spread across 1.0 is marked not significant); the same ratio of real tokens per second of
the process's CPU time (torch on ``--threads`` 1: the work itself, steady when other jobs share the machine):

- ``trl_padded``: ``trl.SFTTrainer``, batches of ``--batch-size`` examples padded to their longest (TRL's only option
  for image data: its ``packing=True`` and ``padding_free=True`` raise there);
- ``unpack_padding_free``: ``unpack_trainer.SFTTrainer`` (automatic padding-free): the same batches, each flattened
  into one packed row;
- ``unpack_packing``: ``packing=True``: the examples packed ahead into rows of ``--max-length`` tokens, one row a step.

Quality (``--quality``): the padded arm and the packed arm train from the same initial weights for the same number of
epochs (the padded arm's batch is the packed arm's mean samples per step), AdamW, constant learning rate; the
held-out loss is the token-mean next-token loss of the 64 held-out examples, computed the same way (TRL's padded
collator, one forward per batch of 8) for both. Reported: mean and standard deviation over seeds, and the paired
difference (packed - padded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, format_table, run_in_subprocess, spread  # noqa: E402

PROVIDERS = {
    "trl_padded": "(a) trl.SFTTrainer padded",
    "unpack_padding_free": "(b) unpack_trainer padding-free",
    "unpack_packing": "(c) unpack_trainer packing=True",
}
TEXT = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=688,
            num_hidden_layers=4)  # fmt: skip


def _model(seed: int = 0) -> Any:
    from unpack_trainer.model_zoo.tiny_vision import tiny_vision_model

    return tiny_vision_model("qwen2_5_vl", seed=seed, attn_implementation="sdpa", **TEXT)


def _data(n: int, seed: int) -> Any:
    from unpack_trainer.data.default_vision_data import load_shapes_dataset

    return load_shapes_dataset(n, seed=seed, sizes=(56, 224))


def _processor() -> Any:
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor

    processor = tiny_processor("qwen2_5_vl")
    processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}  # 4 to 64 image tokens
    return processor


def _config(provider: str, output: str, **overrides: Any) -> Any:
    import trl

    from unpack_trainer import SFTConfig

    settings = dict(
        output_dir=output,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
    )
    settings.update(overrides)
    if provider == "trl_padded":
        return trl.SFTConfig(**settings)
    return SFTConfig(**settings, **({"packing": True} if provider == "unpack_packing" else {}))


def _trainer(provider: str, model: Any, config: Any, dataset: Any, eval_dataset: Any = None) -> Any:
    import trl

    from unpack_trainer import SFTTrainer

    cls = trl.SFTTrainer if provider == "trl_padded" else SFTTrainer
    return cls(
        model=model, args=config, train_dataset=dataset, eval_dataset=eval_dataset, processing_class=_processor()
    )


def run_case(provider: str, *, steps: int, batch_size: int, max_length: int, threads: int) -> dict[str, Any]:
    """Train ``steps + 1`` steps with ``provider`` and time the last ``steps``: real tokens/s, s/step, peak RSS."""
    import resource

    import torch
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    rows = 1 if provider == "unpack_packing" else batch_size
    dataset = _data(max(64, (steps + 1) * batch_size * 3), seed=0)
    config = _config(
        provider,
        f"/tmp/bench_vlm/{provider}",
        max_length=max_length,
        max_steps=steps + 1,
        per_device_train_batch_size=rows,
        learning_rate=1e-4,
    )
    trainer = _trainer(provider, _model(), config, dataset)
    tokens: list[int] = []
    collate = trainer.data_collator

    def counting(examples: list[dict]) -> dict:
        batch = collate(examples)
        mask = batch.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting
    stamps: list[tuple[float, float]] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append((time.perf_counter(), time.process_time()))

    trainer.add_callback(Stamp())
    trainer.train()
    timed, cpu = stamps[-1][0] - stamps[0][0], stamps[-1][1] - stamps[0][1]
    real = sum(tokens[1 : len(stamps)])
    result = {
        "tokens_per_s": real / timed,
        "tokens_per_cpu_s": real / cpu,
        "seconds_per_step": timed / (len(stamps) - 1),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    decision = getattr(trainer, "unpack_decision", None)
    if decision is not None:
        result["mode"] = decision.mode
    return result


def throughput(options: argparse.Namespace) -> str:
    results: dict[str, list[dict]] = {provider: [] for provider in options.providers}
    for round_index in range(options.repeats):
        for provider in options.providers:
            command = [__file__, "--case", provider, "--steps", str(options.steps), "--batch-size",
                       str(options.batch_size), "--max-length", str(options.max_length), "--threads",
                       str(options.threads)]  # fmt: skip
            result = run_in_subprocess(command, timeout=3600)
            results[provider].append(result)
            print(
                f"[{round_index + 1}/{options.repeats}] {PROVIDERS[provider]}: {result}", file=sys.stderr, flush=True
            )
    headers = [
        "provider",
        "real tokens/s median (min-max)",
        "s/step",
        "peak RSS MB",
        "vs (a) padded",
        "vs (a), CPU time",
        "memory vs (a)",
    ]
    table = []
    base = results.get("trl_padded")

    def ratio_of(runs: list[dict], key: str) -> str:
        ratios = [r[key] / b[key] for r, b in zip(runs, base)]
        cell = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        if min(ratios) <= 1.0 <= max(ratios) and runs is not base:
            cell += ", not significant"
        return cell

    for provider, runs in results.items():
        tokens = [r["tokens_per_s"] for r in runs]
        ratio = cpu_ratio = memory = "-"
        if base:
            ratio, cpu_ratio = ratio_of(runs, "tokens_per_s"), ratio_of(runs, "tokens_per_cpu_s")
            memory = f"{statistics.median(r['peak_rss_mb'] / b['peak_rss_mb'] for r, b in zip(runs, base)):.2f}x"
        table.append(
            [
                PROVIDERS[provider],
                spread(tokens, ",.0f"),
                f"{statistics.median(r['seconds_per_step'] for r in runs):.2f}",
                f"{statistics.median(r['peak_rss_mb'] for r in runs):,.0f}",
                ratio,
                cpu_ratio,
                memory,
            ]
        )
    title = (
        f"VLM trainer throughput (Qwen2.5-VL, hidden 256, 4 layers; drawn shapes, 4-64 image tokens, answers of "
        f"lognormal length), {options.steps} timed steps, batch {options.batch_size} / rows of {options.max_length}, "
        f"{options.repeats} interleaved repeats, torch threads {options.threads}"
    )
    env = ", ".join(f"{k} {v}" for k, v in environment().items())
    return "\n".join([f"## {title}", "", env, "", format_table(headers, table)])


def held_out_loss(model: Any, dataset: Any) -> float:
    """Token-mean next-token loss of ``dataset`` under ``model``, TRL's padded vision batches of 8."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collate = DataCollatorForVisionLanguageModeling(_processor())
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(dataset), 8):
            batch = collate([dict(dataset[i]) for i in range(start, min(start + 8, len(dataset)))])
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1].float()
            labels = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="sum")
            total += float(loss)
            count += int((labels != -100).sum())
    return total / count


def quality_case(arm: str, seed: int, *, train: int, epochs: int, max_length: int, threads: int) -> dict[str, Any]:
    """One arm of one seed: train, then the held-out loss."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    dataset, held_out = _data(train, seed=seed), _data(64, seed=10_000 + seed)
    rows_per_step = 2
    provider = "unpack_packing" if arm == "packed" else "trl_padded"
    common = dict(num_train_epochs=epochs, learning_rate=1e-3, lr_scheduler_type="constant", max_length=max_length,
                  seed=seed, data_seed=seed)  # fmt: skip
    if arm == "packed":
        config = _config(provider, f"/tmp/bench_vlm/q{seed}", per_device_train_batch_size=rows_per_step, **common)
        trainer = _trainer(provider, _model(seed), config, dataset)
        batch = rows_per_step * trainer.unpack_stats["samples"] / trainer.unpack_stats["rows"]
    else:
        batch = json.loads(Path(f"/tmp/bench_vlm/q{seed}.batch").read_text())
        config = _config(provider, f"/tmp/bench_vlm/q{seed}", per_device_train_batch_size=round(batch), **common)
        trainer = _trainer(provider, _model(seed), config, dataset)
    start = time.perf_counter()
    trainer.train()
    result = {"arm": arm, "seed": seed, "held_out_loss": held_out_loss(trainer.model, held_out),
              "steps": trainer.state.global_step, "samples_per_step": batch, "seconds": time.perf_counter() - start}  # fmt: skip
    if arm == "packed":
        Path(f"/tmp/bench_vlm/q{seed}.batch").write_text(json.dumps(batch))
    return result


def quality(options: argparse.Namespace) -> str:
    Path("/tmp/bench_vlm").mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"packed": [], "padded": []}
    for seed in options.seeds:
        for arm in ("packed", "padded"):  # the packed arm first: the padded arm takes its samples per step
            command = [__file__, "--quality-case", f"{arm}:{seed}", "--train", str(options.train), "--epochs",
                       str(options.epochs), "--max-length", str(options.max_length), "--threads", str(options.threads)]  # fmt: skip
            result = run_in_subprocess(command, timeout=7200)
            runs[arm].append(result)
            print(f"seed {seed} {arm}: {result}", file=sys.stderr, flush=True)
    rows = []
    for arm, results in runs.items():
        losses = [r["held_out_loss"] for r in results]
        std = statistics.stdev(losses) if len(losses) > 1 else 0.0
        rows.append([arm, f"{statistics.mean(losses):.4f} ± {std:.4f}", ", ".join(f"{v:.4f}" for v in losses),
                     f"{statistics.mean(r['steps'] for r in results):.0f}",
                     f"{statistics.mean(r['samples_per_step'] for r in results):.2f}"])  # fmt: skip
    differences = [p["held_out_loss"] - q["held_out_loss"] for p, q in zip(runs["packed"], runs["padded"])]
    spread_text = f" ± {statistics.stdev(differences):.4f}" if len(differences) > 1 else ""
    title = (
        f"VLM held-out loss, packed vs padded (Qwen2.5-VL as above, {options.train} training examples, "
        f"{options.epochs} epochs, rows of {options.max_length}, seeds {' '.join(map(str, options.seeds))})"
    )
    env = ", ".join(f"{k} {v}" for k, v in environment().items())
    table = format_table(["arm", "held-out loss mean ± std", "per seed", "steps", "samples/step"], rows)
    summary = f"paired difference packed - padded: {statistics.mean(differences):+.4f}{spread_text}"
    return "\n".join([f"## {title}", "", env, "", table, "", summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quality", action="store_true", help="held-out loss, packed vs padded, over --seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train", type=int, default=256, help="training examples of the quality run")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 2 steps, 1 seed, small")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--quality-case", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.case:
        print(json.dumps(run_case(options.case, steps=options.steps, batch_size=options.batch_size,
                                  max_length=options.max_length, threads=options.threads)))  # fmt: skip
        return 0
    if options.quality_case:
        arm, seed = options.quality_case.split(":")
        print(json.dumps(quality_case(arm, int(seed), train=options.train, epochs=options.epochs,
                                      max_length=options.max_length, threads=options.threads)))  # fmt: skip
        return 0
    if options.quick:
        options.repeats, options.steps, options.batch_size, options.seeds = 1, 2, 4, [0]
        options.train, options.epochs, options.max_length = 32, 1, 1024
    print(quality(options) if options.quality else throughput(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
