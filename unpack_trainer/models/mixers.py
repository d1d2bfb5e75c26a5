"""The seam where token mixers other than attention plug into the patch: which mixers are packed exactly, and how.

:func:`~unpack_trainer.anatomy.structure.find_token_mixers` finds a model's token mixers (recurrent / state-space
scans, causal convolutions). Each one is offered to the handlers in :data:`MIXER_HANDLERS`, in order; the first whose
``handles(mixer)`` is true owns it. A model with a mixer no handler owns is refused before any forward
(:class:`~unpack_trainer.models.refusals.RefusalKind` ``STATE``, with the mixer named); a model whose mixers are all
owned is patched: :func:`~unpack_trainer.models.patch_model` calls ``handler.patch(module, decoder)`` on each mixer
(``decoder``: the :class:`~unpack_trainer.models.state.DecoderState` of its decoder) and
:func:`~unpack_trainer.models.unpatch_model` ``handler.unpatch(module)``.

A handler makes the mixer's state restart at every sample's first token on a packed row. The one installed,
:class:`unpack_trainer.patches.mixers.PerSampleMixers`, owns every mixer whose :attr:`TokenMixer.problem` is ``None``
(a right-padded batch per bucket of similar lengths; once on the packed row through the installed kernels' own
``seq_idx`` / ``cu_seqlens`` support where the mixer's code hands them on, see
:mod:`unpack_trainer.patches.mixer_kernels`; or masked taps for a bare depthwise causal convolution). Inside a
packed forward a handler finds the row's samples in the ``packed_seq_info`` keyword where its layer hands it down,
else as ``decoder.running``, which the decoder hook sets before the decoder runs; ``None`` there means the batch is
not packed and the mixer must run exactly as stock (padded batches, generation with a cache). Adding a handler is one
class and one entry in :data:`MIXER_HANDLERS`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from unpack_trainer.anatomy.structure import TokenMixer
from unpack_trainer.patches.mixers import PerSampleMixers

__all__ = ["MIXER_HANDLERS", "MixerHandler", "handler_for", "handler_named"]


class MixerHandler(Protocol):
    """Packs one family of token mixers exactly.

    Attributes:
        name: a unique name (stored on a patched decoder, so a pickled or deep-copied model finds its handler again).
    """

    name: str

    def handles(self, mixer: TokenMixer) -> bool:
        """Whether this handler makes ``mixer`` exact on packed rows (it then owns it)."""

    def patch(self, module: torch.nn.Module, decoder: Any) -> None:
        """Make the mixer ``module`` restart its state per sample in packed forwards; calling it twice is a no-op.
        ``decoder``: the state of the mixer's decoder, whose ``running`` is the packed forward now running (or
        ``None``)."""

    def unpatch(self, module: torch.nn.Module) -> None:
        """Undo :meth:`patch` on ``module`` (a no-op when it is not patched)."""


# The handlers, tried in order: every causal mixer runs per sample (its kernels' varlen entry points, padded buckets,
# or masked convolution taps).
MIXER_HANDLERS: list[MixerHandler] = [PerSampleMixers()]


def handler_for(mixer: TokenMixer) -> MixerHandler | None:
    """The first handler of :data:`MIXER_HANDLERS` that owns ``mixer``, or ``None``."""
    return next((handler for handler in MIXER_HANDLERS if handler.handles(mixer)), None)


def handler_named(name: str) -> MixerHandler | None:
    """The handler of :data:`MIXER_HANDLERS` called ``name``, or ``None``."""
    return next((handler for handler in MIXER_HANDLERS if handler.name == name), None)
