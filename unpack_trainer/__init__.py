"""unpack_trainer: sample packing for Hugging Face TRL without cross-sample contamination.

Swap one import::

    from unpack_trainer import SFTConfig, SFTTrainer

The public API is exactly the names in ``__all__``, and users import them from here
(``from unpack_trainer import pack_dataset, load_default_dataset``): the modules behind them (``data/`` the data path,
``models/`` and ``patches/`` the model side, ``trainers/``, ``cli/``) are the package's rooms, not its API. The names
are resolved lazily, so ``import unpack_trainer`` imports neither torch nor transformers and patches nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unpack_trainer._lazy import lazy_exports
from unpack_trainer.trainers import CONFIG_MODULE, TRAINERS

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # packing core
    "best_fit_decreasing": "unpack_trainer.data.packing",
    "first_fit": "unpack_trainer.data.packing",
    "shuffle_rows": "unpack_trainer.data.packing",
    "shuffled_best_fit": "unpack_trainer.data.packing",
    "windowed_best_fit": "unpack_trainer.data.packing",
    "windowed_packing": "unpack_trainer.data.packing",
    "balanced_step_order": "unpack_trainer.data.sampler",
    "balanced_rank_order": "unpack_trainer.data.sampler",
    "packing_efficiency": "unpack_trainer.data.packing",
    "pack_sequences": "unpack_trainer.data.tensor_packing",
    "concatenate_and_pack": "unpack_trainer.data.tensor_packing",
    "position_ids_from_sample_index": "unpack_trainer.data.tensor_packing",
    "DataCollatorForPacking": "unpack_trainer.data.collator",
    "PACKED_BATCH_KEYS": "unpack_trainer.packed_seq_info",
    # attention / model patches
    "patch_model": "unpack_trainer.models",
    "unpatch_model": "unpack_trainer.models",
    "supported_model_types": "unpack_trainer.models",
    "register_backend": "unpack_trainer.patches.attention.registry",
    "AttentionFeature": "unpack_trainer.patches.attention._common",
    # trainers: every entry of unpack_trainer.trainers.TRAINERS (its trainer and config classes), added below
    "check_uncontaminated": "unpack_trainer.selfcheck",
    # preference training (DPO)
    "DataCollatorForPackedPreference": "unpack_trainer.data.preference",
    "load_default_preference_dataset": "unpack_trainer.data.default_preference_data",
    # dataset preparation (what the trainer calls)
    "pack_dataset": "unpack_trainer.data.preparation",
    "truncate_dataset": "unpack_trainer.data.preparation",
    "pack_iterable_dataset": "unpack_trainer.data.preparation",
    # streaming
    "StreamingPacker": "unpack_trainer.data.streaming",
    "streaming_dataset_reader": "unpack_trainer.data.files",
    # the shipped demo data: a dataset, its tokenizer and a tiny Llama config (no download)
    "load_default_dataset": "unpack_trainer.data.default_data",
    "load_default_tokenizer": "unpack_trainer.data.default_data",
    "tiny_model_config": "unpack_trainer.data.default_data",
    # a real pretrained model (the `real` extra)
    "load_smollm2": "unpack_trainer.model_zoo.smollm2",
    "smollm2_path": "unpack_trainer.model_zoo.smollm2",
}
for _spec in TRAINERS:
    _EXPORTS[_spec.trainer] = _spec.trainer_module
    _EXPORTS[_spec.config] = CONFIG_MODULE

__all__ = [
    *sorted(name for spec in TRAINERS for name in (spec.trainer, spec.config)),
    "AttentionFeature",
    "DataCollatorForPackedPreference",
    "DataCollatorForPacking",
    "PACKED_BATCH_KEYS",
    "StreamingPacker",
    "balanced_rank_order",
    "balanced_step_order",
    "best_fit_decreasing",
    "check_uncontaminated",
    "concatenate_and_pack",
    "first_fit",
    "load_default_dataset",
    "load_default_preference_dataset",
    "load_default_tokenizer",
    "load_smollm2",
    "pack_dataset",
    "pack_iterable_dataset",
    "pack_sequences",
    "packing_efficiency",
    "patch_model",
    "position_ids_from_sample_index",
    "register_backend",
    "shuffle_rows",
    "shuffled_best_fit",
    "smollm2_path",
    "streaming_dataset_reader",
    "supported_model_types",
    "tiny_model_config",
    "truncate_dataset",
    "unpatch_model",
    "windowed_best_fit",
    "windowed_packing",
    "__version__",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from unpack_trainer.data.collator import DataCollatorForPacking
    from unpack_trainer.data.default_data import load_default_dataset, load_default_tokenizer, tiny_model_config
    from unpack_trainer.data.files import streaming_dataset_reader
    from unpack_trainer.data.packing import (
        best_fit_decreasing,
        first_fit,
        packing_efficiency,
        shuffle_rows,
        shuffled_best_fit,
        windowed_best_fit,
        windowed_packing,
    )
    from unpack_trainer.data.preparation import pack_dataset, pack_iterable_dataset, truncate_dataset
    from unpack_trainer.data.sampler import balanced_rank_order, balanced_step_order
    from unpack_trainer.data.streaming import StreamingPacker
    from unpack_trainer.data.tensor_packing import concatenate_and_pack, pack_sequences, position_ids_from_sample_index
    from unpack_trainer.model_zoo.smollm2 import load_smollm2, smollm2_path
    from unpack_trainer.models import patch_model, supported_model_types, unpatch_model
    from unpack_trainer.packed_seq_info import PACKED_BATCH_KEYS
    from unpack_trainer.patches.attention._common import AttentionFeature
    from unpack_trainer.patches.attention.registry import register_backend
    from unpack_trainer.selfcheck import check_uncontaminated
