"""The training script of ``unpack-trainer dpo`` (what ``trl/scripts/dpo.py`` is to ``trl dpo``).

[`unpack_trainer.cli.commands.dpo`] parses the command line with its ``make_parser`` (TRL's ``TrlParser`` over the
dataclasses of ``trl dpo``) and launches this module, ``python -m unpack_trainer.dpo_command``, through
``accelerate launch``. What differs from ``trl dpo``: the trainer is [`unpack_trainer.DPOTrainer`] (and the config our
``DPOConfig``: ``--packing``, ``--prefix_sharing``); ``--dataset_name`` also takes a local data file or a saved
dataset folder; ``--model_name_or_path unpack_trainer:smollm2`` and ``--dataset_name unpack_trainer:preference_chat``
(``unpack_trainer:preference``: plain strings) work offline, the embedded preference set with ``train`` (4,000 pairs)
and ``test`` (200) splits.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from unpack_trainer.cli.commands.dpo import make_parser
from unpack_trainer.sft_command import (
    embedded_splits,
    load_sft_dataset,
    resolve_model_name,
    set_model_init_kwargs,
    train_and_save,
)

__all__ = ["load_dpo_dataset", "main", "make_parser"]

DATASET_NAMES = {"unpack_trainer:preference_chat": True, "unpack_trainer:preference": False}  # -> conversational


def load_dpo_dataset(name: str, *, config: str | None = None, streaming: bool = False):
    """The dataset behind ``--dataset_name``: the embedded preference set for ``unpack_trainer:preference`` /
    ``unpack_trainer:preference_chat`` (``train`` and ``test`` splits), else as ``unpack-trainer sft`` loads it
    ([`unpack_trainer.sft_command.load_sft_dataset`]: a local file or saved folder, or ``datasets.load_dataset``)."""
    if name in DATASET_NAMES:
        from unpack_trainer.preference_data import load_default_preference_dataset

        return embedded_splits(
            load_default_preference_dataset, conversational=DATASET_NAMES[name], streaming=streaming
        )
    return load_sft_dataset(name, config=config, streaming=streaming)


def main(script_args: Any, training_args: Any, model_args: Any, dataset_args: Any) -> None:
    """The body of ``trl dpo`` (``trl/scripts/dpo.py``'s ``main``) with our trainer and dataset loading."""
    from accelerate.logging import get_logger
    from trl import get_dataset, get_peft_config, get_quantization_config

    from unpack_trainer.trainers.dpo import DPOTrainer

    logger = get_logger(__name__)
    set_model_init_kwargs(training_args, model_args)

    if dataset_args.datasets:
        if script_args.dataset_name:
            logger.warning(
                "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
                "dataset and `dataset_name` will be ignored."
            )
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dpo_dataset(
            script_args.dataset_name, config=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")

    trainer = DPOTrainer(
        model=resolve_model_name(model_args.model_name_or_path),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    if script_args.ignore_bias_buffers:
        import torch

        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]
    train_and_save(trainer, training_args, dataset_name=script_args.dataset_name)


if __name__ == "__main__":  # launched by `unpack-trainer dpo` through accelerate: python -m unpack_trainer.dpo_command
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _parser = make_parser()
    _script_args, _training_args, _model_args, _dataset_args = _parser.parse_args_and_config(
        fail_with_unknown_args=False
    )
    main(_script_args, _training_args, _model_args, _dataset_args)
    sys.exit(0)
