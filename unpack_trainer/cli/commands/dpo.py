"""``unpack-trainer dpo``: ``trl dpo`` with unpack_trainer's ``DPOTrainer``.

The same command line as ``trl dpo``: TRL's ``TrlParser`` over TRL's ``ScriptArguments``, ``ModelConfig`` and
``DatasetMixtureConfig`` and (a subclass of) TRL's ``DPOConfig``, so every ``trl dpo`` flag and YAML recipe works
unchanged; the training script [`unpack_trainer.dpo_command`] is launched through ``accelerate launch`` as ``trl dpo``
launches ``trl/scripts/dpo.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from unpack_trainer.cli.commands.sft import launch_script

__all__ = ["add_dpo_command", "make_parser", "run_dpo"]

PROG = "unpack-trainer dpo"
SCRIPT = "unpack_trainer.dpo_command"  # the module `accelerate launch` runs

DESCRIPTION = """\
Preference training (DPO) on packed pairs: `trl dpo` with unpack_trainer's DPOTrainer.

Same command line as `trl dpo` (TRL's own parser and dataclasses: every flag below and every YAML recipe given with
`--config recipe.yaml` works unchanged; `accelerate launch` options are passed on, as `trl dpo` does). What differs:
  * the trainer: unpack_trainer.DPOTrainer. The pairs of each batch run as one packed row, each prompt once for its
    chosen and rejected completions (--prefix_sharing false: [prompt, chosen] and [prompt, rejected] as two samples;
    --packing false: TRL's padded batches); the loss and every metric are TRL's;
  * --dataset_name also takes a local data file or a folder written by Dataset.save_to_disk;
  * offline names: --model_name_or_path unpack_trainer:smollm2 (SmolLM2-135M-Instruct from the `real` extra) and
    --dataset_name unpack_trainer:preference_chat (the embedded preference set, conversational;
    unpack_trainer:preference: plain strings).
"""

EPILOG = """\
examples:
  unpack-trainer dpo --config examples/smollm2_dpo.yaml
  unpack-trainer dpo --model_name_or_path unpack_trainer:smollm2 --dataset_name unpack_trainer:preference_chat \\
      --use_peft --lora_r 16 --max_length 512 --max_steps 10 --use_cpu --output_dir out/smollm2-dpo
"""


def make_parser(prog: str = PROG):
    """TRL's ``TrlParser`` over the dataclasses of ``trl dpo``, with our ``DPOConfig`` in place of TRL's."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from unpack_trainer.dpo_config import DPOConfig

    return TrlParser(
        (ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def run_dpo(argv: Sequence[str]) -> int:
    """``unpack-trainer dpo ARGS``: parse as ``trl dpo`` does (``--help`` exits here), then ``accelerate launch`` the
    training script with the script's arguments."""
    return launch_script(argv, make_parser(), SCRIPT)


def add_dpo_command(subparsers: argparse._SubParsersAction) -> None:
    """List ``dpo`` in ``unpack-trainer --help``; ``cli.main`` hands its arguments to [`run_dpo`] unparsed."""
    subparsers.add_parser("dpo", help="`trl dpo` with unpack_trainer's DPOTrainer (same flags and YAML recipes)")
