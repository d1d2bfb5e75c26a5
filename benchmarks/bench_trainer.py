"""Trainer throughput: (a) trl.SFTTrainer padded, (b) trl.SFTTrainer packing=True, (c) unpack_trainer packing=True,
(d) unpack_trainer automatic padding-free. Real (non-pad) tokens per second, each case in its own process, the
providers interleaved (a b c d a b c d ...) for ``--repeats`` rounds (default 3): the table gives the median and the
spread (min-max) of tokens/s and of every ratio (paired within a round); a ratio whose spread crosses 1.0 is marked
"not significant".

    python benchmarks/bench_trainer.py                              # max_length 2048 and 8192, lognormal lengths
    python benchmarks/bench_trainer.py --max-lengths 2048 --steps 4 --repeats 5 --threads 1   # steadier on a busy machine
    unpack-trainer bench                                            # the same on the embedded default data

Tiny Llama (hidden 256, 4 layers, 8 heads, 4 kv heads, vocab 4096), pre-tokenized data with lognormal lengths
(median 180, clipped to [8, max_length]); same ``SFTConfig`` otherwise. The code lives in
``unpack_trainer/cli/trainer_comparison.py`` so that the ``unpack-trainer bench`` command can run it too.
"""

from unpack_trainer.cli.trainer_comparison import main

if __name__ == "__main__":
    main()
