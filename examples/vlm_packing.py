"""Fine-tune a vision-language model with sample packing, then the same model on the same data padded, and compare.

    pip install -e ".[vision]" && python examples/vlm_packing.py

With no arguments it builds a small Qwen2.5-VL from its config (no download: text model hidden 256, 4 layers; a
2-layer vision tower; a character tokenizer with Qwen's image tokens, unpack_trainer.model_zoo.tiny_vision) and fine-tunes
it on images drawn locally: shapes of colours with captions (unpack_trainer.data.default_vision_data: 128 examples,
images 56 to 224 pixels a side, 4 to 64 image tokens, answers of a caption plus a lognormal number of sentences, 50 to
~1,100 tokens, median ~170: mostly short with a long tail, where padding wastes most). It trains twice, from the same
initial weights, on the same examples for the same 2 epochs (rows of 1,024 tokens, 4 rows per step: ~14 steps of ~19
examples), fp32 on the CPU with torch on one thread (``--threads``), activation checkpointing off (as
``examples/sft_packing.py``; a small model needs no recomputation). On 2 cores shared with other jobs (load average
1 to 2 at the time) the whole command took 1 minute 43 s, packing at 3.47x the padded run's real tokens/s (3.48x less
CPU time; seed 0, 14 steps each; ``--quick``: about a minute). Over 6 seeds (``python benchmarks/bench_vlm_quality.py
--seeds 0 1 2 3 4 5 --jobs 2``, docs/vlm.md) the speed-up was 2.34x to 3.91x (mean 2.91x; 2.75x in CPU time) and the
held-out loss of the packed run the padded run's: 0.728 ± 0.103 against 0.737 ± 0.087, paired difference -0.008 ±
0.043 (standard error 0.018), within the seed noise (seed 0: +0.031):

1. **packed**: ``unpack_trainer.SFTTrainer`` with ``packing=True``: examples share rows of ``--max-length`` tokens,
   each with its own images, its own multimodal positions (the model's ``get_rope_index`` per sample) and attention
   only to itself;
2. **padded**: ``padding_free=False`` (what ``trl.SFTTrainer`` does with images): each batch padded to its longest
   example, its batch size the packed run's mean examples per step (so both take about the same number of steps;
   the table shows them). Both losses are the mean over the step's trained tokens; AdamW at a constant learning rate.

It ends with a table: wall-clock, real tokens per second, padding, the CPU time of training, the final training loss
(the mean of the losses logged over the last 10% of the steps, as ``examples/sft_packing.py`` prints it, not TRL's
average over the whole run) and the loss per token on 64 held-out examples (computed the same way for both runs), the
packed run's speed-up, and where this seed's held-out difference sits against its spread over seeds (read from
``benchmarks/RESULTS_vlm_quality.json`` when the settings are the ones stored there).

Other families (``--model-type``): gemma3 and gemma4 (image tokens attend both ways within each image), idefics3,
smolvlm, llava, llava_next (images in tiles), qwen2_vl, qwen3_vl, qwen3_5 (gated-delta-net layers). ``--quick`` runs two steps of each on 16 small images with the tiny text model (a smoke
test); ``--skip-padded`` only the packed run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

IMAGE_SIDES = (56, 224)  # pixels a side, drawn per image: 4 to 64 image tokens
ANSWER_SENTENCES = (1.0, 1.0)  # the lognormal (median, sigma) of the sentences an answer adds to its caption
FAMILIES = (
    "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "gemma3", "gemma4", "idefics3", "smolvlm", "llava", "llava_next",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/vlm_packing.py",
        description="Fine-tune a vision-language model with unpack_trainer.SFTTrainer(packing=True), then padded; "
        "compare wall-clock, real tokens/s and held-out loss.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model-type", default="qwen2_5_vl", choices=FAMILIES, help="the family of the small model")
    parser.add_argument("--train", type=int, default=128, help="training examples (drawn shapes with captions)")
    parser.add_argument("--held-out", type=int, default=64, help="held-out examples")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--rows-per-step", type=int, default=4, help="packed rows per optimizer step")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: steady timings on a machine shared with other jobs)",
    )
    parser.add_argument("--output-dir", default="vlm_packing_out")
    parser.add_argument("--skip-padded", action="store_true", help="only the packed run")
    parser.add_argument("--quick", action="store_true", help="a few steps of each run (a smoke test)")
    return parser


def small_model(model_type: str, seed: int, quick: bool = False) -> Any:
    """The small model of ``model_type``: the tiny family's vision tower, a text model of hidden 256 and 4 layers
    (Qwen2-VL / Qwen3-VL families; the others, and every family with ``quick``, keep the tiny text model so that their
    vision projectors and layer types fit)."""
    from unpack_trainer.model_zoo.tiny_vision import tiny_vision_model

    text = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=688,
                num_hidden_layers=4) if model_type in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl") and not quick else {}  # fmt: skip
    return tiny_vision_model(model_type, seed=seed, attn_implementation="sdpa", **text)


def processor_for(model_type: str) -> Any:
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor

    processor = tiny_processor(model_type)
    if model_type.startswith("qwen"):
        processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
    return processor


def held_out_loss(model: Any, processor: Any, dataset: Any) -> float:
    """Token-mean next-token loss of ``dataset``: TRL's padded vision batches of 8, the same for every run."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collate = DataCollatorForVisionLanguageModeling(processor)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(dataset), 8):
            batch = collate([dict(dataset[i]) for i in range(start, min(start + 8, len(dataset)))])
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1].float()
            labels = batch["labels"][:, 1:]
            total += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


def train(run: str, options: argparse.Namespace, train_set: Any, held_out: Any, batch_size: int) -> dict[str, Any]:
    """One run (``"packed"`` or ``"padded"``): train, then the held-out loss; the figures of the table."""
    from unpack_trainer import SFTConfig, SFTTrainer
    from unpack_trainer.cli.sft_comparison import checkpointing_off

    processor = processor_for(options.model_type)
    config = SFTConfig(
        output_dir=f"{options.output_dir}/{run}",
        packing=run == "packed",
        padding_free=None if run == "packed" else False,
        max_length=options.max_length,
        per_device_train_batch_size=batch_size,
        num_train_epochs=options.epochs,
        max_steps=2 if options.quick else -1,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,  # every step: the final train loss is the last 10% of the steps of either run
        disable_tqdm=True,
        seed=options.seed,
        data_seed=options.seed,
        **checkpointing_off(SFTConfig),  # as examples/sft_packing.py: a small model needs no recomputation
    )
    trainer = SFTTrainer(
        model=small_model(options.model_type, options.seed, options.quick),
        args=config,
        train_dataset=train_set,
        processing_class=processor,
    )
    real, slots = [], []
    collate = trainer.data_collator

    def counting(examples: list[dict]) -> dict:
        batch = collate(examples)
        mask = batch.get("attention_mask")
        real.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        slots.append(int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    stats = trainer.unpack_stats
    samples_per_step = batch_size * stats["samples"] / stats["rows"] if run == "packed" else batch_size
    return {
        "run": run,
        "steps": trainer.state.global_step,
        "samples/step": samples_per_step,
        "wall-clock (s)": seconds,
        "real tokens": sum(real),
        "padding": 1 - sum(real) / max(sum(slots), 1),
        "real tokens/s": sum(real) / seconds,
        "CPU time (s)": cpu_seconds,
        "final train loss": final_train_loss(trainer.state.log_history),
        "held-out loss": held_out_loss(trainer.model, processor, held_out),
        "mode": trainer.unpack_decision.mode,
    }


def final_train_loss(log_history: list[dict[str, Any]]) -> float:
    """The training loss averaged over the points logged in the last 10% of the steps (at least the last point), the
    "final train loss" of ``examples/sft_packing.py``; TRL's ``training_loss`` is the average over the whole run, its
    first, random-init steps included."""
    logged = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    if not logged:
        return float("nan")
    tail = [loss for step, loss in logged if step >= 0.9 * logged[-1][0]]
    return sum(tail) / len(tail)


def table(results: list[dict[str, Any]]) -> str:
    columns = ["run", "steps", "samples/step", "wall-clock (s)", "real tokens", "padding", "real tokens/s",
               "CPU time (s)", "final train loss", "held-out loss"]  # fmt: skip

    def cell(column: str, value: Any) -> str:
        if column == "padding":
            return f"{value:.1%}"
        if isinstance(value, float):
            return f"{value:,.3f}" if column.endswith("loss") else f"{value:,.1f}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    lines = [" | ".join(columns)]
    lines += [" | ".join(cell(c, r[c]) for c in columns) for r in results]
    return "\n".join(lines)


def compare(options: argparse.Namespace) -> list[dict[str, Any]]:
    """The packed run, then (unless ``--skip-padded``) the padded run, on the same examples for the same epochs: the
    rows of the table. ``benchmarks/bench_vlm_quality.py`` calls this once per seed."""
    import torch

    from unpack_trainer.data.default_vision_data import load_shapes_dataset

    if options.threads:
        torch.set_num_threads(options.threads)
    count = 16 if options.quick else options.train
    data = dict(sizes=(56, 112) if options.quick else IMAGE_SIDES, sentences=ANSWER_SENTENCES)
    train_set = load_shapes_dataset(count, seed=options.seed, **data)
    held_out = load_shapes_dataset(8 if options.quick else options.held_out, seed=10_000 + options.seed, **data)
    packed = train("packed", options, train_set, held_out, options.rows_per_step)
    results = [packed]
    if not options.skip_padded:
        results.append(train("padded", options, train_set, held_out, max(1, round(packed["samples/step"]))))
    return results


SEED_NOISE = Path(__file__).resolve().parent.parent / "benchmarks" / "RESULTS_vlm_quality.json"
SETTINGS = ("model_type", "train", "held_out", "epochs", "max_length", "rows_per_step", "learning_rate")


def seed_noise_line(options: argparse.Namespace, difference: float) -> str:
    """Where this seed's held-out difference (packed - padded) sits against its spread over seeds, as
    ``benchmarks/bench_vlm_quality.py`` stored it for the same settings; a pointer to it otherwise."""
    import json
    import statistics

    stored = json.loads(SEED_NOISE.read_text()) if SEED_NOISE.exists() else {}
    if options.quick or any(stored.get("options", {}).get(name) != getattr(options, name) for name in SETTINGS):
        return "one seed: python benchmarks/bench_vlm_quality.py compares over seeds"
    differences = [run["held_out_difference"] for run in stored["seeds"]]
    mean, std = statistics.fmean(differences), statistics.stdev(differences)
    within = abs(difference) <= 2 * std
    return (
        f"over {len(differences)} seeds (benchmarks/bench_vlm_quality.py) packed - padded was {mean:+.3f} ± {std:.3f}: "
        f"this seed's {difference:+.3f} is {'WITHIN' if within else 'OUTSIDE'} the seed noise "
        f"({abs(difference) / std:.1f} std{', within 2' if within else ''})"
    )


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("unpack_trainer").setLevel(logging.INFO)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    results = compare(options)
    print()
    print(table(results))
    if len(results) == 2:
        packed, padded = results
        speedup = packed["real tokens/s"] / padded["real tokens/s"]
        cpu = padded["CPU time (s)"] / packed["CPU time (s)"]
        difference = packed["held-out loss"] - padded["held-out loss"]
        print(
            f"\npacked: {speedup:.2f}x the padded run's real tokens/s; held-out loss "
            f"{packed['held-out loss']:.3f} vs {padded['held-out loss']:.3f} ({seed_noise_line(options, difference)}); "
            f"{cpu:.2f}x less CPU time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
