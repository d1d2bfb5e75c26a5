"""Embeddings that number a sample's tokens themselves (the RoBERTa family), given each sample's own positions on
packed rows.

RoBERTa-style embeddings (``RobertaEmbeddings``, ``XLMRobertaEmbeddings``, ``XmodEmbeddings``, ...) compute their
positions from the tokens when no ``position_ids`` are given, which is how a sample alone or a padded batch runs:
fairseq's ``make_positions``, where a padding token gets ``padding_idx`` and every other token ``padding_idx`` plus
its count of non-padding tokens so far, so positions start at ``padding_idx + 1``. A packed row carries
``position_ids`` restarting at 0 per sample, which such embeddings would look up as given: every token
``padding_idx + 1`` positions early. For a packed forward the patch gives these embeddings, in place of the restarting
``position_ids``, what their own ``create_position_ids_from_input_ids`` (``create_position_ids_from_inputs_embeds``
without ``input_ids``) makes of each sample alone. Nothing else sees these positions (attention reads the packing
metadata), and an unpacked forward or generation runs exactly as stock.

Worked example, ``padding_idx`` 1, one row of the samples ``[5, 6, 7]`` and ``[8, 1, 9]`` (a padding token inside)::

    position_ids (packed row)   [[0, 1, 2, 0, 1, 2]]
    each sample alone           [2, 3, 4] and [2, 1, 3]
    given to the embeddings     [[2, 3, 4, 2, 1, 3]]

Found from the structure (:func:`own_position_embeddings`): a module of the decoder with an integer ``padding_idx``, a
``create_position_ids_from_input_ids`` method and a ``forward`` that takes ``position_ids``. A forward pre-hook on each
computes, inside a packed forward of its decoder (the one running on the decoder's state), the positions of its own
``input_ids`` (or ``inputs_embeds``) and puts them in place of the ``position_ids`` it is given.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

from unpack_trainer._compat import remove_hook
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import DecoderState
from unpack_trainer.packed_seq_info import PackedSeqInfo, restart_positions

__all__ = ["FIX", "own_position_embeddings", "sample_positions"]


class _SamplePositions(NamedTuple):
    """The plan of a batch's per-sample position layout on ``device``."""

    device: str


def own_position_embeddings(decoder: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name under decoder, module)`` of every module of ``decoder`` that numbers tokens itself (see the
    module docstring), in module order."""
    found = []
    for name, module in decoder.named_modules():
        if not isinstance(getattr(module, "padding_idx", None), int):
            continue
        if not callable(getattr(module, "create_position_ids_from_input_ids", None)):
            continue
        try:
            takes_positions = "position_ids" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            takes_positions = False
        if takes_positions:
            found.append((name, module))
    return found


def _layout(units: PackedSeqInfo, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)``, each ``(num_slots,)`` int64 on ``device``: the sample of every slot and its index in it."""
    lengths = units.seq_lengths.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64), lengths)
    cols = restart_positions(units.seq_lengths, units.cu_seqlens)
    return rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)


def sample_positions(
    embeddings: torch.nn.Module,
    info: PackedSeqInfo,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """The positions ``embeddings`` gives every token of a packed batch when its sample runs alone.

    The samples (for branched batches, every branch with its prefix in front: :meth:`PackedSeqInfo.branch_units`) are
    laid out as a right-padded ``(num_samples, max_seqlen)`` batch, numbered by the module's own function in one call
    (its numbering of a token depends on the tokens before it only, so the right padding changes nothing), and read
    back into the packed layout: no loop over samples.

    Args:
        embeddings: a module of :func:`own_position_embeddings`.
        info: the packing metadata of the batch.
        input_ids: ``(B, T)`` int64, the packed token ids; or
        inputs_embeds: ``(B, T, hidden)`` (only its shape and device are read) when there are no ``input_ids``.

    Returns:
        ``(B, T)`` int64 on the batch's device.
    """
    reference = input_ids if input_ids is not None else inputs_embeds
    device = reference.device
    if info.is_branched:
        units, gather, owner = info.branch_units()
        gather, owner = gather.to(device, non_blocking=True), owner.to(device, non_blocking=True)
    else:
        units, gather, owner = info, None, None
    rows, cols = info.plans.get(_SamplePositions(str(device)), lambda: _layout(units, device))
    shape = (units.num_seqs, units.max_seqlen)
    padding_idx = embeddings.padding_idx
    if input_ids is not None:
        tokens = input_ids.reshape(-1)
        if gather is not None:
            tokens = tokens[gather]
        grid = tokens.new_full(shape, padding_idx)
        grid[rows, cols] = tokens
        numbered = embeddings.create_position_ids_from_input_ids(grid, padding_idx)
    else:
        numbered = embeddings.create_position_ids_from_inputs_embeds(reference.new_empty(*shape, 0), padding_idx)
    slots = numbered[rows, cols]
    if owner is not None:
        slots = slots[owner]
    return slots.view(info.batch_size, info.seq_len)


# embeddings class -> the names of its forward's parameters.
_parameters: dict[type, list[str]] = {}


def _positions_pre_hook(state: DecoderState, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """On an embeddings module that numbers tokens itself: inside a packed forward of its decoder, the positions each
    sample gets alone replace the restarting ``position_ids``; otherwise nothing."""
    info = state.running
    if info is None:
        return None
    names = _parameters.get(type(module))
    if names is None:
        names = _parameters[type(module)] = list(inspect.signature(module.forward).parameters)
    bound = {**dict(zip(names, args)), **kwargs}
    positions = sample_positions(
        module, info, input_ids=bound.get("input_ids"), inputs_embeds=bound.get("inputs_embeds")
    )
    index = names.index("position_ids")
    if len(args) > index:
        return (*args[:index], positions, *args[index + 1 :]), kwargs
    return args, {**kwargs, "position_ids": positions}


def _applies(site: FixSite) -> str | None:
    found = own_position_embeddings(site.module)
    if not found:
        return None
    return f"its embeddings ({type(found[0][1]).__name__}) number tokens from padding_idx + 1 themselves"


def _install(site: FixSite) -> None:
    hooks = []
    for name, embeddings in own_position_embeddings(site.module):
        hook = embeddings.register_forward_pre_hook(
            functools.partial(_positions_pre_hook, site.state), with_kwargs=True
        )
        hooks.append((name, hook.id))
    site.state.undo["positions"] = hooks


def _remove(site: FixSite) -> None:
    for name, hook_id in site.state.undo.pop("positions", ()):
        remove_hook(site.module.get_submodule(name), hook_id)


FIX = Fix("positions", _applies, _install, _remove)
