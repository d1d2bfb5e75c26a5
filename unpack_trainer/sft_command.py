"""The training script of ``unpack-trainer sft`` (what ``trl/scripts/sft.py`` is to ``trl sft``).

[`unpack_trainer.cli.commands.sft`] parses the command line with [`make_parser`] (TRL's ``TrlParser`` over the
dataclasses of ``trl sft``) and launches this module, ``python -m unpack_trainer.sft_command``, through
``accelerate launch``. What differs from ``trl sft``:

- the trainer is [`unpack_trainer.SFTTrainer`] (and the config our ``SFTConfig``: ``--padding_free`` unset lets the
  trainer decide, ``--packing_buffer_size`` for streamed packing);
- ``--dataset_name`` also takes a local data file (``.jsonl``/``.json``/``.csv``/``.parquet``/``.arrow``/``.txt``,
  optionally ``.gz``) or a folder written by ``Dataset.save_to_disk``, besides what ``datasets.load_dataset`` takes;
- offline names: ``--model_name_or_path unpack_trainer:smollm2`` is SmolLM2-135M-Instruct from the ``real`` extra
  (converted once, see [`unpack_trainer.smollm2_path`]); ``--dataset_name unpack_trainer:chat`` is the embedded
  instruction data in TRL's conversational prompt-completion format (``unpack_trainer:default``: plain strings), with
  ``train`` (4,000) and ``test`` (200) splits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from unpack_trainer import data_files
from unpack_trainer.cli.commands.sft import make_parser

__all__ = ["load_sft_dataset", "main", "make_parser", "resolve_model_name"]

SMOLLM2_NAME = "unpack_trainer:smollm2"
DATASET_NAMES = {"unpack_trainer:chat": True, "unpack_trainer:default": False}  # name -> conversational


def resolve_model_name(name: str | None) -> str | None:
    """``unpack_trainer:smollm2`` -> the converted SmolLM2 folder (converted on first use); other names unchanged."""
    if name == SMOLLM2_NAME:
        from unpack_trainer.real_model import smollm2_path

        return str(smollm2_path())
    return name


def load_sft_dataset(name: str, *, config: str | None = None, streaming: bool = False):
    """The dataset behind ``--dataset_name``, as a ``DatasetDict`` (or ``IterableDatasetDict`` when streaming).

    - ``unpack_trainer:chat`` / ``unpack_trainer:default``: the embedded data, ``train`` and ``test`` splits;
    - a local file or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``:
      [`unpack_trainer.data_files.read_splits`] (a file is read with the ``datasets`` builder of its extension,
      ``.jsonl.gz`` -> ``json``, as split ``train``; a saved ``Dataset`` becomes ``train``);
    - anything else: ``datasets.load_dataset(name, name=config, streaming=streaming)``, exactly as ``trl sft``.
    """
    from datasets import DatasetDict, load_dataset

    if name in DATASET_NAMES:
        from unpack_trainer.default_data import load_default_dataset

        conversational = DATASET_NAMES[name]
        dataset = DatasetDict(
            {
                "train": load_default_dataset("train", conversational=conversational),
                "test": load_default_dataset("eval", conversational=conversational),
            }
        )
        return data_files.iterable_splits(dataset) if streaming else dataset
    path = Path(name).expanduser()
    if path.is_file() or data_files.is_saved_dataset(path):
        return data_files.read_splits(path, streaming=streaming)
    return load_dataset(name, name=config, streaming=streaming)


def main(script_args: Any, training_args: Any, model_args: Any, dataset_args: Any) -> None:
    """The body of ``trl sft`` (``trl/scripts/sft.py``'s ``main``) with our trainer and dataset loading."""
    from accelerate.logging import get_logger
    from trl import get_dataset, get_peft_config, get_quantization_config

    from unpack_trainer.trainers.sft import SFTTrainer

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


if __name__ == "__main__":  # launched by `unpack-trainer sft` through accelerate: python -m unpack_trainer.sft_command
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _parser = make_parser()
    _script_args, _training_args, _model_args, _dataset_args = _parser.parse_args_and_config(
        fail_with_unknown_args=False
    )
    main(_script_args, _training_args, _model_args, _dataset_args)
    sys.exit(0)
