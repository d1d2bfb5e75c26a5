"""Trainer throughput: stock TRL (padded, packing=True) vs unpack_trainer (packing=True, automatic padding-free).

    python benchmarks/bench_trainer.py                       # max_length 2048 and 8192
    python benchmarks/bench_trainer.py --max-lengths 2048 --steps 4

Same tiny Llama (hidden 256, 4 layers, 8 heads, 4 kv heads, vocab 4096), same ``SFTConfig`` otherwise, same
pre-tokenized data (lognormal lengths, median 180, clipped to [8, max_length]). Every case runs in its own process.
Throughput is real (non-pad) tokens per second over the timed steps (the first step is a warm-up and not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import format_table, lognormal_lengths, print_header, run_in_subprocess, tiny_llama_config  # noqa: E402

PROVIDERS = {
    "trl_padded": "(a) trl.SFTTrainer, padded",
    "trl_packing": "(b) trl.SFTTrainer, packing=True",
    "unpack_packing": "(c) unpack_trainer, packing=True",
    "unpack_auto": "(d) unpack_trainer, automatic padding-free",
}


def _dataset(max_length: int, num_samples: int, seed: int = 0):
    import numpy as np
    from datasets import Dataset

    lengths = lognormal_lengths(num_samples, high=max_length, seed=seed)
    rng = np.random.default_rng(seed)
    return Dataset.from_dict({"input_ids": [rng.integers(3, 4096, size=n).tolist() for n in lengths]})


def run_case(provider: str, max_length: int, steps: int, batch_size: int) -> dict:
    """Train ``steps`` optimizer steps in this process and return throughput figures as a dict."""
    import torch
    import trl
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(pad_token_id=0, eos_token_id=2, bos_token_id=1))
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(4096)}, unk_token="t3"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2")

    packed = provider in ("trl_packing", "unpack_packing")
    config = dict(
        output_dir=f"/tmp/bench_trainer/{provider}",
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_length=max_length,
        max_steps=steps + 1,
        per_device_train_batch_size=1 if packed else batch_size,
        packing=packed,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    num_samples = (steps + 1) * max(batch_size, max_length // 90) * 4
    dataset = _dataset(max_length, num_samples)
    if provider.startswith("trl"):
        trainer_cls, config_cls = trl.SFTTrainer, trl.SFTConfig
    else:
        from unpack_trainer import SFTConfig, SFTTrainer

        trainer_cls, config_cls = SFTTrainer, SFTConfig
    trainer = trainer_cls(model=model, args=config_cls(**config), train_dataset=dataset, processing_class=tokenizer)

    tokens: list[int] = []
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        mask = batch.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting_collator
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    trainer.add_callback(Stamp())
    start = time.perf_counter()
    trainer.train()
    first_step = stamps[0] - start
    timed = stamps[-1] - stamps[0]
    real_tokens = sum(tokens[1 : len(stamps)])
    import resource

    result = {
        "tokens_per_s": real_tokens / timed,
        "seconds_per_step": timed / (len(stamps) - 1),
        "first_step_s": first_step,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    selfcheck = getattr(trainer, "unpack_selfcheck", None)
    if selfcheck is not None:
        result["selfcheck_s"] = selfcheck.seconds
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per case (after one warm-up)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per padded / padding-free batch")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.case:
        provider, max_length = args.case.split(":")
        print(json.dumps(run_case(provider, int(max_length), args.steps, args.batch_size)))
        return

    print_header("Trainer throughput: real (non-pad) tokens per second, tiny Llama, CPU")
    headers = ["max_length", "provider", "tokens/s", "s/step", "peak RSS MB", "vs (a) padded", "vs (b) trl packing"]
    table, notes = [], []
    for max_length in args.max_lengths:
        results = {}
        for provider in args.providers:
            results[provider] = run_in_subprocess(
                [
                    os.path.abspath(__file__),
                    "--case",
                    f"{provider}:{max_length}",
                    "--steps",
                    str(args.steps),
                    "--batch-size",
                    str(args.batch_size),
                ],
                timeout=3600,
            )
            print(f"{PROVIDERS[provider]} @ {max_length}: {results[provider]}", file=sys.stderr, flush=True)
        for provider, result in results.items():
            ratios = []
            for base in ("trl_padded", "trl_packing"):
                ratios.append(
                    f"{result['tokens_per_s'] / results[base]['tokens_per_s']:.2f}x" if base in results else "-"
                )
            table.append(
                [
                    max_length,
                    PROVIDERS[provider],
                    f"{result['tokens_per_s']:,.0f}",
                    result["seconds_per_step"],
                    f"{result['peak_rss_mb']:,.0f}",
                    *ratios,
                ]
            )
            if "selfcheck_s" in result:
                notes.append(
                    f"{PROVIDERS[provider]} @ {max_length}: self-check {result['selfcheck_s'] * 1000:.0f} ms = "
                    f"{100 * result['selfcheck_s'] / result['first_step_s']:.2f}% of the first step "
                    f"({result['first_step_s']:.2f} s)"
                )
    print(format_table(headers, table))
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
