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
- :mod:`~unpack_trainer.models.coverage`: which model types are verified, one by one (:func:`supported_model_types`;
  ``python -m unpack_trainer.models --coverage`` prints the table).

There are no per-architecture modules: a model type that needs something the extension points do not reach gets it
from the model's structure in the patch (e.g. a sliding window applied through the mask only).
"""

from unpack_trainer.models.patch import is_patched, patch_model, resolve_backend, supported_model_types, unpatch_model
from unpack_trainer.models.refusals import BLOCKLIST, PatchRefused, RefusalKind, refusal_reason

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
