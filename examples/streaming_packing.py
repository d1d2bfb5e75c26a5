"""Streaming packing: fine-tune on local JSONL or Parquet files read lazily, packed on the fly through a buffer.

    python examples/streaming_packing.py                                  # shards of the embedded dataset
    python examples/streaming_packing.py --data "data/train-*.parquet" --max-length 2048 --max-steps 1000

When a dataset is too large to tokenize and pack ahead of time, load it with ``streaming=True``: ``datasets`` then
gives an ``IterableDataset`` that reads the files as training goes. ``unpack_trainer.SFTTrainer`` with
``packing=True`` tokenizes it on the fly and packs it through a buffer of ``SFTConfig.packing_buffer_size`` samples
(best-fit decreasing over the buffer; rows that are not full yet wait for the next samples). An iterable dataset has
no length, so ``max_steps`` sets how long to train.

Without ``--data`` the embedded instruction dataset is written as a few shards into a temporary directory first, in
the format given by ``--format``. ``--data`` takes a file, a directory (every ``.jsonl``/``.json``/``.parquet`` file
under it) or a glob pattern; the files need ``prompt`` + ``completion``, ``messages`` or ``text`` columns (or
``input_ids``). To read the files without ``datasets`` (and resume mid-file), see
``unpack_trainer.streaming_dataset_reader``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unpack_trainer.data.files import file_format, resolve_files

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/streaming_packing.py",
        description="Fine-tune a tiny model with unpack_trainer.SFTTrainer(packing=True) on local JSONL or Parquet "
        "files loaded with datasets' streaming=True: tokenized and packed on the fly through a buffer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data",
        help="a .jsonl/.json(.gz)/.parquet file, a directory of them, or a glob pattern (quote it); "
        "default: the embedded dataset written as shards into a temporary directory",
    )
    parser.add_argument(
        "--format", choices=("jsonl", "parquet"), default="parquet", help="shard format without --data"
    )
    parser.add_argument("--num-shards", type=int, default=4, help="shards written without --data")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps (a stream has no length)")
    parser.add_argument("--batch-size", type=int, default=1, help="packed rows per device and optimizer step")
    parser.add_argument("--buffer-size", type=int, default=1000, help="samples buffered and packed together")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--output-dir", type=Path, default=Path("streaming_packing_output"))
    parser.add_argument("--seed", type=int, default=0)
    return parser


def resolve_data_files(data: str) -> tuple[list[str], str]:
    """The files named by ``data`` (a file, a directory searched recursively, or a glob) and their ``datasets``
    builder (``"json"`` or ``"parquet"``), through the package's one reader (``unpack_trainer.data.files``). Raises
    ``SystemExit`` with one clear line when there are none, or when they mix formats."""
    try:
        files = resolve_files(data, suffixes=SUFFIXES)
    except FileNotFoundError:
        raise SystemExit(
            f"error: --data {data}: no such file or directory, and no file matches it as a pattern"
        ) from None
    except ValueError as error:
        raise SystemExit(f"error: --data {data}: {error}") from None
    builders = {file_format(name) for name in files}
    if len(builders) > 1:
        raise SystemExit(f"error: --data {data}: mixes JSON and Parquet files; stream one format at a time")
    return files, builders.pop()


def write_default_shards(directory: Path, *, file_format: str, num_shards: int) -> list[str]:
    """Write the embedded training set as ``num_shards`` JSONL or Parquet files; return their paths."""
    from unpack_trainer import load_default_dataset

    dataset = load_default_dataset("train")
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(num_shards):
        shard = dataset.shard(num_shards, index, contiguous=True)
        path = directory / f"train-{index:05d}-of-{num_shards:05d}.{file_format}"
        if file_format == "jsonl":
            shard.to_json(str(path), lines=True)
        else:
            shard.to_parquet(str(path))
        paths.append(str(path))
    return paths


def _checkpointing_off(config_cls: type) -> dict[str, bool]:
    """Activation checkpointing off, under the name this transformers version uses (TRL defaults it to on)."""
    names = {field.name for field in dataclasses.fields(config_cls)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {key: False}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("num_shards", "max_length", "max_steps", "batch_size", "buffer_size", "logging_steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")

    import datasets
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from unpack_trainer import SFTConfig, SFTTrainer, load_default_tokenizer, tiny_model_config

    hf_logging.set_verbosity_warning()
    datasets.disable_progress_bars()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="unpack_streaming_") as scratch:
        if args.data is None:
            files = write_default_shards(Path(scratch), file_format=args.format, num_shards=args.num_shards)
            builder = "json" if args.format == "jsonl" else "parquet"
        else:
            files, builder = resolve_data_files(args.data)
        print(f"streaming {len(files)} {builder} file(s): {files[0]}{' ...' if len(files) > 1 else ''}")
        stream = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)

        tokenizer = load_default_tokenizer()
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(tiny_model_config(tokenizer))
        on_gpu = torch.cuda.is_available()
        config = SFTConfig(
            output_dir=str(args.output_dir),
            packing=True,
            max_length=args.max_length,
            packing_buffer_size=args.buffer_size,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            logging_steps=args.logging_steps,
            save_strategy="no",
            report_to="none",
            use_cpu=not on_gpu,
            bf16=on_gpu and torch.cuda.is_bf16_supported(),
            dataloader_num_workers=0,
            seed=args.seed,
            **_checkpointing_off(SFTConfig),
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=stream, processing_class=tokenizer)
        start = time.perf_counter()
        output = trainer.train()
        seconds = time.perf_counter() - start

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    packer = trainer.train_dataset
    stats = dict(getattr(packer, "stats", {}))
    summary = {
        "steps": output.global_step,
        "seconds": seconds,
        "first_loss": losses[0] if losses else float("nan"),
        "last_loss": losses[-1] if losses else float("nan"),
        "packer": type(packer).__name__,
        "stats": stats,
    }
    if trainer.is_world_process_zero():
        print(
            f"\n{output.global_step} steps in {seconds:.1f} s; training loss {summary['first_loss']:.3f} -> "
            f"{summary['last_loss']:.3f}; rows built by {summary['packer']}"
        )
        if stats.get("rows"):
            fill = stats["tokens"] / (stats["rows"] * args.max_length)
            print(
                f"packer (rows built so far, including rows read ahead of training): {stats['rows']:,} rows, "
                f"{stats['tokens']:,} tokens, {fill:.1%} full; "
                + ", ".join(f"{key}={value:,}" for key, value in stats.items() if key not in ("rows", "tokens"))
            )
        trainer.save_model(str(args.output_dir / "final"))
        print(f"model: {(args.output_dir / 'final').resolve()}")
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
