"""A packed row run in place of TRL's padded view of the same sequences: prompts shared by several completions
(DPO's pairs, GRPO's and RLOO's groups, reward models' pairs).

A batch of such a trainer carries TRL's padded *view* of its sequences (what TRL's loss reads, never run through the
model) and one packed row in which each prompt appears once and its completions follow as branches
(``packed_seq_parents``, see :mod:`unpack_trainer.packed_seq_info`), with the maps between the two
(:mod:`unpack_trainer.data.preference`, :func:`unpack_trainer.trainers.branched.pack_completions`). This fix hooks the
model's backbone so that such a batch runs the packed row and hands back the last hidden state in the view's layout.
Not automatic: the prompt-sharing trainers install it (:func:`unpack_trainer.models.fixes.install_fix`).
"""

from __future__ import annotations

from typing import Any

import torch

from unpack_trainer._compat import remove_hook, sequence_parallel_group
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import decoder_state
from unpack_trainer.packed_seq_info import (
    INFO_KEY,
    PACKED_INPUT_IDS_KEY,
    PACKED_POSITION_IDS_KEY,
    TOKEN_INDEX_KEY,
    VIEW_INDEX_KEY,
)

__all__ = ["FIX", "gathered_shards", "install_packed_view", "take_shard"]


class _PackedView:
    """Forward hooks on a decoder (the backbone under the LM head): a call carrying ``packed_input_ids`` runs the
    packed row instead of the padded view, and its outputs come back in the view's layout."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        self.token_index: torch.Tensor | None = None
        self.group: Any = None  # the sequence-parallel group whose shards of the row this forward's output gathers

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.index = None
        if kwargs.get(PACKED_INPUT_IDS_KEY) is None:
            return args, kwargs
        if args:
            raise ValueError("A packed batch with shared prompts must reach the decoder as keyword arguments.")
        if not any(decoder_state(inner) is not None for inner in module.modules()):
            raise ValueError(
                f"A packed batch with shared prompts reached {type(module).__name__}, which is not patched for "
                "packing (unpack_trainer.models.patch_model): its attention would not follow the packed samples."
            )
        view_ids = kwargs.pop("input_ids")
        index = kwargs.pop(VIEW_INDEX_KEY)
        self.token_index = kwargs.pop(TOKEN_INDEX_KEY)
        if index.shape != view_ids.shape:
            raise ValueError(
                f"`{VIEW_INDEX_KEY}` has shape {tuple(index.shape)} but the padded view is {tuple(view_ids.shape)}."
            )
        kwargs["input_ids"] = kwargs.pop(PACKED_INPUT_IDS_KEY).to(view_ids.device)
        kwargs["position_ids"] = kwargs.pop(PACKED_POSITION_IDS_KEY).to(view_ids.device)
        kwargs.pop("attention_mask", None)
        self.index, self.group = index, None
        info = kwargs.get(INFO_KEY)
        if info is not None and info.sequence_shards > 1 and module.training:
            # Under DeepSpeed Ulysses (a training forward: Ulysses leaves an evaluating module whole): this process
            # runs its shard of the row, and [`after`] gathers the shards' hidden states back into the whole row.
            self.group = take_shard(kwargs, info.sequence_shards)
        return args, kwargs

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        index, self.index = self.index, None
        group, self.group = self.group, None
        if index is None:
            return output
        if group is not None:
            output = _gathered(output, group)
        hidden = output.last_hidden_state
        flat = index.reshape(-1).to(hidden.device)
        output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat).view(*index.shape, -1)
        router_logits = getattr(output, "router_logits", None)
        if router_logits is not None:
            tokens = self.token_index.reshape(-1)
            output.router_logits = tuple(
                layer if layer is None else layer.reshape(-1, layer.shape[-1]).index_select(0, tokens.to(layer.device))
                for layer in router_logits
            )
        return output


def take_shard(kwargs: dict, shards: int) -> Any:
    """Cut the packed row of a forward's keyword arguments (``input_ids`` / ``position_ids`` ``(1, T)``, ``T`` a
    multiple of ``shards``) to this process's contiguous shard ``(1, T / shards)`` of DeepSpeed Ulysses' group, in
    place; returns the group (``_compat.sequence_parallel_group``).

    Raises:
        ValueError: no Ulysses group of ``shards`` processes (the row was cut for another set-up).
    """
    group = sequence_parallel_group()
    if group is None or torch.distributed.get_world_size(group) != shards:
        raise ValueError(
            f"A packed row cut for {shards} sequence-parallel processes reached a training forward outside a "
            "DeepSpeed Ulysses group of that size (accelerate's ParallelismConfig(sp_size=...) sets it up)."
        )
    rank = torch.distributed.get_rank(group)
    size = kwargs["input_ids"].shape[1] // shards
    for name in ("input_ids", "position_ids"):
        kwargs[name] = kwargs[name][:, rank * size : (rank + 1) * size]
    return group


def gathered_shards(tensor: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """The shards of one row that the processes of ``group`` hold (``tensor``: this process's, e.g. ``(1, T / N,
    H)``), concatenated along ``dim`` in rank order (the shards are contiguous). Differentiable: torch's all-gather
    hands each process the sum over the group of the gradients of its shard; every process computes the same loss
    from the whole row, so that sum is ``N`` times the loss's gradient, which the trainer divides back (``N`` equal
    losses, each back-propagated at ``1 / N``)."""
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous(), group=group), dim=dim)


def _gathered(output: Any, group: Any) -> Any:
    """``output`` of one shard of the row with its hidden states ``(1, T / N, H)`` (and router logits ``(T / N, E)``
    per layer) gathered over the sequence-parallel ``group`` into the whole row's ([`gathered_shards`])."""
    output.last_hidden_state = gathered_shards(output.last_hidden_state, group, dim=1)
    router_logits = getattr(output, "router_logits", None)
    if router_logits is not None:
        output.router_logits = tuple(
            layer if layer is None else gathered_shards(layer, group, dim=0) for layer in router_logits
        )
    return output


def install_packed_view(decoder: torch.nn.Module) -> list[int]:
    """Let ``decoder`` (the model's backbone, e.g. ``LlamaModel``) run packed batches with shared prompts; the ids of
    the hooks installed (:data:`FIX` records them, and its ``remove`` takes them off).

    A forward with ``packed_input_ids`` ``(1, T)`` (and ``packed_position_ids`` ``(1, T)``, ``packed_seq_lengths``,
    ``packed_seq_parents``, ``packed_token_index`` ``(rows, L)`` and ``packed_view_index`` ``(rows, L')``, all int)
    runs the packed row; its ``last_hidden_state`` ``(1, T, H)`` comes back as ``(rows, L', H)``, each view token's
    hidden state read from its packed token (a shared prompt token feeds every row of its group), and
    ``router_logits`` (one ``(T, num_experts)`` per layer) as ``(rows * L, num_experts)`` through
    ``packed_token_index``, so the LM head, the loss and the MoE auxiliary loss (with TRL's ``attention_mask``
    ``(rows, L)``) see the padded batch's values. The hook runs before the packing patch's own hook, which then finds
    the packing metadata. A forward without ``packed_input_ids`` is untouched. Under sequence parallelism (a row whose
    ``packed_seq_info`` is cut into ``N`` shards, in a training forward) each process runs its shard and the hidden
    states of the ``N`` shards are gathered before the view reads them ([`_gathered`]).
    """
    view = _PackedView()
    return [
        decoder.register_forward_pre_hook(view.before, with_kwargs=True, prepend=True).id,
        decoder.register_forward_hook(view.after, with_kwargs=True).id,
    ]


def _backbone(site: FixSite) -> torch.nn.Module:
    return site.model.base_model


def _applies(site: FixSite) -> str | None:
    return "its prompts are shared by several completions, packed once with their completions as branches"


def _install(site: FixSite) -> None:
    site.state.undo["packed_view"] = install_packed_view(_backbone(site))


def _remove(site: FixSite) -> None:
    for hook_id in site.state.undo.pop("packed_view", ()):
        remove_hook(_backbone(site), hook_id)


FIX = Fix("packed_view", _applies, _install, _remove, automatic=False, per_model=True)
