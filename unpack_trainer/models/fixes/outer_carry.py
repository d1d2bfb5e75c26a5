"""Packing keywords carried past an outer model that drops them.

bloom's and mpt's ``*ForCausalLM`` forwards hand their decoder only their named arguments, so the collator's
``packed_seq_lengths`` (and ``cu_seq_lens_*``, ``max_length_*``, ``position_ids``) never reach the decoder's hook. A
pre-hook on the outer model hands them to the decoder's state (:attr:`~unpack_trainer.models.state.DecoderState.carried`),
where the decoder hook merges them into its keyword arguments; a post-hook clears what was not used. Applies where the
decoder's attention runs in its own forward (:mod:`unpack_trainer.models.fixes.alibi`) and the outer model is not the
decoder.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from unpack_trainer._compat import remove_hook
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import DecoderState
from unpack_trainer.packed_seq_info import INFO_KEY, METADATA_KEYS

__all__ = ["FIX"]

# Keys of the packed batch the outer model may not hand down: carried to the decoder hook.
CARRIED_KEYS = (INFO_KEY, *METADATA_KEYS, "position_ids")


def _carry(state: DecoderState, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    carried = {key: kwargs[key] for key in CARRIED_KEYS if kwargs.get(key) is not None}
    if carried:
        state.carried = carried


def _drop(state: DecoderState, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    state.carried = None


def _applies(site: FixSite) -> str | None:
    if site.model is site.module or "alibi" not in site.state.fixes:
        return None
    return f"{type(site.model).__name__}.forward hands its decoder only its named arguments"


def _install(site: FixSite) -> None:
    pre = site.model.register_forward_pre_hook(functools.partial(_carry, site.state), with_kwargs=True)
    post = site.model.register_forward_hook(functools.partial(_drop, site.state), with_kwargs=True, always_call=True)
    site.state.undo["outer_carry"] = [pre.id, post.id]


def _remove(site: FixSite) -> None:
    for hook_id in site.state.undo.pop("outer_carry", ()):
        remove_hook(site.model, hook_id)
    site.state.carried = None


FIX = Fix("outer_carry", _applies, _install, _remove)
