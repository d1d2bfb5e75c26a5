"""Fine-tune a causal LM with sample packing, then train the same model on the same data padded, and compare.

    pip install -e . && python examples/sft_packing.py

With no arguments it fine-tunes a tiny Llama (about 0.4M parameters, built from a config, no download) on the
instruction dataset shipped with ``unpack_trainer`` (4,000 prompt/completion pairs of 10 to 1,629 tokens), on the
CPU (7.5 minutes on 2 cores shared with other jobs). It trains twice, from the same initial weights, on the same
samples, for the same number of epochs:

1. **packed**: ``unpack_trainer.SFTTrainer`` with ``packing=True``: samples share rows of ``--max-length`` tokens,
   each attending only to itself, so no compute is spent on padding;
2. **padded**: the same trainer with ``padding_free=False`` (what ``trl.SFTTrainer`` does by default): each batch is
   padded to its longest sample. Its batch size is the average number of samples in a packed row, so both runs take
   about the same number of optimizer steps of about the same number of samples, with the same learning-rate schedule.

It ends with a table (training wall-clock, real tokens per second, final training loss: the mean of the losses logged
over the last 10% of the steps, and the loss per token on held-out samples, computed the same way for both runs), one
line saying whether the packed run's held-out loss is within the seed noise that ``benchmarks/bench_quality.py``
measured in this same configuration (within two standard deviations over 15 seeds of the packed - padded difference
of the default packing, read from ``benchmarks/RESULTS_quality.json``), and a PNG plot of the training loss against
wall-clock time (which run is faster) and against samples trained on (whether the same samples teach as much). The
defaults are the benchmark's configuration: rows of 512 tokens, two per optimizer step (about 10 samples), one epoch.
With them on a 2-core CPU shared with other jobs (torch 2.13, transformers 5.23, TRL 1.16, seed 0)::

    run    | steps | samples/step | train wall-clock (s) | real tokens | padding | real tokens/s | final train loss | held-out loss/token
    -------+-------+--------------+----------------------+-------------+---------+---------------+------------------+--------------------
    packed |   383 |         10.3 |                115.1 |     388,980 |    0.0% |         3,378 |            2.585 |               2.514
    padded |   395 |         10.0 |                284.3 |     388,980 |   68.8% |         1,368 |            2.640 |               2.493

Packing computed no padding where padded batches were 69% padding, and trained on the same tokens 2.47x faster (3.51x
on a quiet machine, docs/quality.md). Over 15 seeds (``python benchmarks/bench_quality.py``, docs/quality.md) the
packed held-out loss is the padded one: 2.508 ± 0.023 against 2.510 ± 0.027, paired difference -0.003 ± 0.040; seed
0 ends +0.022 (0.5 standard deviations of that difference over seeds), and the verdict line calls it within the seed
noise (it would take more than 2). The computation of a packed row itself is exact (its loss and gradients equal those
of its samples in a padded batch).

Your own model and data (a local directory from ``save_pretrained`` and a local file or ``save_to_disk``
directory with ``prompt``/``completion``, ``messages``, ``text`` or ``input_ids`` columns)::

    python examples/sft_packing.py --model ./my-model --dataset ./train.jsonl --max-length 2048 --skip-padded

On several GPUs: see ``examples/multi_gpu/README.md``. ``--quick`` runs a few steps of each (a smoke test).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unpack_trainer.cli.sft_comparison import (
    RunResult,
    comparison_lines,
    format_table,
    train_once,
    write_plot,
)
from unpack_trainer.data.files import file_format, is_saved_dataset, read_splits

DATASET_FORMATS = ("json", "parquet")
COLUMN_LAYOUTS = ("'prompt' + 'completion'", "'messages'", "'text'", "'input_ids' (pre-tokenized)")
MAX_EVAL_SAMPLES = 200
QUICK_STEPS = 4


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/sft_packing.py",
        description="Fine-tune with unpack_trainer.SFTTrainer(packing=True), then the same model and data padded; "
        "print wall-clock, real tokens/s and loss for both and plot loss against wall-clock time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="local model directory (save_pretrained format, with its tokenizer); "
        "default: a tiny Llama built from a config, with the embedded tokenizer",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        help="local .jsonl/.json(.gz)/.parquet file or save_to_disk directory with 'prompt'+'completion', "
        "'messages', 'text' or 'input_ids' columns; default: the embedded instruction dataset",
    )
    parser.add_argument(
        "--max-length", type=int, default=512, help="tokens per packed row; longer samples are truncated"
    )
    parser.add_argument("--epochs", type=float, default=1.0, help="training epochs of each run")
    parser.add_argument("--max-steps", type=int, help="optimizer steps of each run (overrides --epochs)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=2,
        help="packed rows per device and optimizer step (two or more let each step balance rows of few long samples "
        "with rows of many short ones)",
    )
    parser.add_argument(
        "--padded-batch-size",
        type=int,
        help="samples per padded batch; default: the average number of samples in --batch-size packed rows",
    )
    parser.add_argument(
        "--learning-rate", type=float, help="default: 1e-3 for the tiny model trained from scratch, 2e-5 for --model"
    )
    parser.add_argument("--logging-steps", type=int, default=5, help="optimizer steps per logged (and plotted) loss")
    parser.add_argument("--output-dir", type=Path, default=Path("sft_packing_output"))
    parser.add_argument("--plot", type=Path, help="PNG file of the loss curves; default: OUTPUT_DIR/loss_vs_time.png")
    parser.add_argument("--skip-padded", action="store_true", help="train packed only (no comparison)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {QUICK_STEPS} optimizer steps per run on a few hundred samples",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch; default: 1 for the built-in tiny model (its matrices are too small to gain "
        "much from more threads, and extra threads slow it down several times on a busy machine), torch's default "
        "with --model",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject missing paths and out-of-range numbers with one clear line (``parser.error`` exits with code 2)."""
    if args.model is not None:
        if not args.model.exists():
            parser.error(f"--model {args.model}: no such directory")
        if not (args.model / "config.json").is_file():
            parser.error(f"--model {args.model}: no config.json there; give a directory written by save_pretrained")
    if args.dataset is not None:
        if not args.dataset.exists():
            parser.error(f"--dataset {args.dataset}: no such file or directory")
        if args.dataset.is_file() and file_format(args.dataset) not in DATASET_FORMATS:
            parser.error(
                f"--dataset {args.dataset}: unknown file type; expected .jsonl/.json/.parquet (optionally .gz) "
                "or a directory written by Dataset.save_to_disk"
            )
    for name in ("max_length", "batch_size", "logging_steps", "max_steps", "padded_batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.epochs <= 0:
        parser.error(f"--epochs must be positive, got {args.epochs}")


# --------------------------------------------------------------------------------------------------------------------
# Data and model
# --------------------------------------------------------------------------------------------------------------------


def _check_layout(columns: Sequence[str], path: Path) -> None:
    names = set(columns)
    if not ({"prompt", "completion"} <= names or names & {"messages", "text", "input_ids"}):
        raise SystemExit(
            f"error: --dataset {path}: no known column layout in columns {sorted(names)}; "
            f"expected one of {', '.join(COLUMN_LAYOUTS)}"
        )


def load_data(path: Path | None, *, seed: int) -> tuple[Any, Any, str]:
    """The training and held-out datasets and a one-line description.

    The embedded dataset has its own held-out split. A local dataset directory with a ``validation`` or ``test``
    split uses it; otherwise ``min(200, 5%)`` samples are held out with ``seed``.
    """

    if path is None:
        from unpack_trainer import load_default_dataset

        return load_default_dataset("train"), load_default_dataset("eval"), "embedded instruction dataset"
    if path.is_dir() and not is_saved_dataset(path):
        raise SystemExit(f"error: --dataset {path}: not a directory written by Dataset.save_to_disk")
    try:
        splits = read_splits(path)
    except ValueError as error:
        raise SystemExit(f"error: --dataset {path}: {error}") from None
    if "train" not in splits:
        raise SystemExit(f"error: --dataset {path}: no 'train' split (splits: {sorted(splits)})")
    loaded = splits["train"]
    held_out = next((splits[name] for name in ("validation", "test") if name in splits), None)
    _check_layout(loaded.column_names, path)
    if held_out is None:
        if len(loaded) < 2:
            raise SystemExit(f"error: --dataset {path}: {len(loaded)} sample(s); at least 2 are needed")
        size = min(MAX_EVAL_SAMPLES, max(1, len(loaded) // 20))
        split = loaded.train_test_split(test_size=size, seed=seed)
        loaded, held_out = split["train"], split["test"]
    return loaded, held_out, str(path)


def model_factory(path: Path | None, tokenizer: Any, *, seed: int, dtype: Any) -> Callable[[], Any]:
    """A function returning a fresh model with the same initial weights at every call.

    The tiny model is built in fp32 (trained with bf16 autocast on a GPU that supports it); a ``--model`` checkpoint
    is loaded in ``dtype``.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if path is None:
        from unpack_trainer import tiny_model_config

        config = tiny_model_config(tokenizer)

        def build() -> Any:
            torch.manual_seed(seed)
            return LlamaForCausalLM(config)

        return build
    return lambda: AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def load_tokenizer(path: Path | None) -> Any:
    if path is None:
        from unpack_trainer import load_default_tokenizer

        return load_default_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --model {path}: could not load its tokenizer ({error})") from None


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)

    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()
    datasets.disable_progress_bars()
    threads = args.threads if args.threads is not None else (1 if args.model is None else None)
    if threads is not None and not torch.cuda.is_available():
        torch.set_num_threads(threads)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    on_gpu = torch.cuda.is_available()
    bf16 = on_gpu and torch.cuda.is_bf16_supported()

    tokenizer = load_tokenizer(args.model)
    train_dataset, eval_dataset, data_name = load_data(args.dataset, seed=args.seed)
    if args.quick:
        train_dataset = train_dataset.select(range(min(len(train_dataset), 256)))
        eval_dataset = eval_dataset.select(range(min(len(eval_dataset), 32)))
    make_model = model_factory(args.model, tokenizer, seed=args.seed, dtype=torch.bfloat16 if bf16 else torch.float32)
    learning_rate = args.learning_rate or (1e-3 if args.model is None else 2e-5)
    max_steps = QUICK_STEPS if args.quick else args.max_steps
    output_dir = args.output_dir
    plot_path = args.plot or output_dir / "loss_vs_time.png"

    common: dict[str, Any] = dict(
        max_length=args.max_length,
        num_train_epochs=args.epochs,
        max_steps=max_steps if max_steps is not None else -1,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        weight_decay=0.0,
        logging_steps=1 if args.quick else args.logging_steps,
        eval_packing=False,
        ddp_find_unused_parameters=False,
        per_device_eval_batch_size=8,
        save_strategy="no",
        report_to="none",
        use_cpu=not on_gpu,
        bf16=bf16,
        dataloader_num_workers=0,
        seed=args.seed,
        data_seed=args.seed,
    )
    model_name = str(args.model) if args.model is not None else "tiny Llama (embedded config, random init)"
    results: list[RunResult] = []

    def describe_packing(trainer: Any) -> None:
        if not trainer.is_world_process_zero():
            return
        parameters = sum(p.numel() for p in trainer.model.parameters())
        stats = trainer.unpack_stats
        print(f"\nmodel: {model_name}, {parameters / 1e6:.2f}M parameters; data: {data_name}", flush=True)
        accelerator = trainer.accelerator
        if accelerator.num_processes > 1:
            kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
            print(
                f"{accelerator.num_processes} processes ({kind}), each on {args.batch_size} row(s) a step", flush=True
            )
        if "rows" in stats:
            print(
                f"packed {stats['samples']:,} samples ({stats['tokens']:,} tokens) into {stats['rows']:,} rows of "
                f"{args.max_length} tokens, {stats['efficiency']:.1%} full",
                flush=True,
            )
        else:
            print(f"packing is off: {trainer.unpack_decision.reason}", flush=True)

    packed, trainer = train_once(
        "packed",
        make_model=make_model,
        tokenizer=tokenizer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        config=dict(
            common,
            output_dir=str(output_dir / "packed"),
            packing=True,
            per_device_train_batch_size=args.batch_size,
        ),
        on_trainer=describe_packing,
    )
    results.append(packed)
    is_main = trainer.is_world_process_zero()
    stats = trainer.unpack_stats
    trainer.save_model(str(output_dir / "packed" / "final"))
    del trainer

    if not args.skip_padded:
        padded_batch_size = args.padded_batch_size
        if padded_batch_size is None:
            per_row = stats["samples"] / stats["rows"] if stats.get("rows") else 8.0
            padded_batch_size = max(1, round(per_row * args.batch_size))
        if is_main:
            print(f"\npadded run: batch size {padded_batch_size} samples, padded to the longest", flush=True)
        padded, trainer = train_once(
            "padded",
            make_model=make_model,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            config=dict(
                common,
                output_dir=str(output_dir / "padded"),
                packing=False,
                padding_free=False,
                per_device_train_batch_size=padded_batch_size,
            ),
        )
        results.append(padded)
        del trainer

    if not is_main:
        return results
    print("\n" + format_table(results))
    if len(results) == 2:
        print("\n" + "\n".join(comparison_lines(*results)))
    try:
        write_plot(results, plot_path, title=f"{model_name} on {data_name}, max_length {args.max_length}")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    else:
        print(f"loss against wall-clock time and samples seen: {plot_path.resolve()}")
    print(f"fine-tuned model (packed run): {(output_dir / 'packed' / 'final').resolve()}")
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
