"""Patch a transformers model so that packed batches attend per sample: ``patch_model`` / ``unpatch_model``.

The patch is generic: what it touches is found from the model itself (:mod:`unpack_trainer.anatomy`: its decoder,
layers, attention modules, token mixers, what its attention asks of a backend, a vision-language model's parts), not
from a list of architectures. One module per responsibility:

- :mod:`~unpack_trainer.models.refusals`: whether it can be packed exactly, an ordered list of checks each with a
  :class:`RefusalKind` (:func:`refusal_reason` asks before any forward, on the ``meta`` device);
- :mod:`~unpack_trainer.models.mixers`: the seam where a handler makes a token mixer (convolution, recurrent scan)
  exact on packed rows;
- :mod:`~unpack_trainer.models.fixes`: the model-family fixes, one module and one record each in one table
  (``FIXES``): a window applied through the mask only, llama4's chunks and temperature, bloom's and mpt's ALiBi,
  RoBERTa-style positions, the fused RoPE, a sequence classifier's score per packed sequence, the prompt-sharing view,
  a vision-language model's vision tower kept out of the packing, its multimodal positions and image blocks per
  sample;
- :mod:`~unpack_trainer.models.state`: what the patch keeps on the modules it changes (one attribute), and the one
  route of the packed metadata where no keyword reaches;
- :mod:`~unpack_trainer.models.routing`: the registration in transformers' attention and mask interfaces;
- :mod:`~unpack_trainer.models.packed_forward`: the decoder hook, which decides once per forward whether a batch is
  packed and hands every layer its metadata;
- :mod:`~unpack_trainer.models.patch`: the patch itself, orchestrating the above, and its undo;
- :mod:`~unpack_trainer.models.sequence_parallel`: which patched models stay exact under DeepSpeed Ulysses;
- :mod:`~unpack_trainer.models.preview`: what the patch does with a model (refused or which fixes it installs, whose
  RoPE runs, whether sequence parallelism stays exact), asked of the patch itself (``unpack-trainer env --model``);
- :mod:`~unpack_trainer.models.verified`: which model types are verified (:func:`supported_model_types`), kept as
  data: the coverage check (``python tools/model_coverage.py``, a developer's tool outside the package) writes it.

This room holds the patch only: what a model is made of is read in ``anatomy/``, the models the package builds are in
``model_zoo/``, the self-check that probes a patched model is :mod:`unpack_trainer.selfcheck`. It stands above
``anatomy/``, ``patches/`` (the kernels and attention backends it installs) and ``data/`` (the key names and views of
a packed batch), below ``trainers/``. Importing it imports neither torch nor transformers; the names below are resolved
on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unpack_trainer._lazy import lazy_exports

_EXPORTS = {
    "install_fix": "unpack_trainer.models.patch",
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
    "install_fix",
    "is_patched",
    "patch_model",
    "refusal_reason",
    "resolve_backend",
    "supported_model_types",
    "unpatch_model",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # pragma: no cover
    from unpack_trainer.models.patch import (
        install_fix,
        is_patched,
        patch_model,
        resolve_backend,
        supported_model_types,
        unpatch_model,
    )
    from unpack_trainer.models.refusals import BLOCKLIST, PatchRefused, RefusalKind, refusal_reason
