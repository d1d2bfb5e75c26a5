"""What every packed attention backend shares: the protocol (the features a backend may serve,
:class:`AttentionFeature`; what a call or a model asks of one, :class:`Needs`; the backend record,
:class:`AttentionBackend`, with the optional kernel it may declare), the options of a call, the token layout helpers
and the record of a bucket backend. Below every backend: it imports no backend, and no backend imports another."""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.buckets import BucketPlan, attention_plan, branch_plan

__all__ = [
    "AttentionBackend",
    "AttentionFeature",
    "BackendFunction",
    "BranchedFunction",
    "CallOptions",
    "Needs",
    "OptionalKernel",
    "bucket_backend",
    "logger",
    "repeat_heads",
    "tokens_major",
]

# One logger for every backend module: the messages of the package keep one name.
logger = logging.getLogger("unpack_trainer.patches.attention")


class AttentionFeature(enum.StrEnum):
    """What a packed attention call may ask for beyond causal grouped-query attention with any scaling: the one list
    every layer reads (the dispatch, the choice, the model's needs, the refusals, ``unpack-trainer env``). A ``str``
    (``AttentionFeature.SOFTCAP == "softcap"``).

    A backend declares those it applies itself (:attr:`AttentionBackend.serves`); a call asking for one it does not
    goes to a backend that does, or is refused when the backend was named. Two are the dispatch's on every backend
    (:attr:`by_dispatch`): chunked attention runs as samples of one chunk each (:meth:`PackedSeqInfo.chunked`), and a
    branched row as ``[prefix; branch]`` units (:meth:`PackedSeqInfo.branch_units`) where a backend has no branched
    path of its own (:attr:`AttentionBackend.branched_forward`).
    """

    SLIDING_WINDOW = "sliding_window"
    SOFTCAP = "softcap"
    SINKS = "sinks"
    DROPOUT = "dropout"
    ALIBI = "alibi"
    BIDIRECTIONAL = "bidirectional"
    CHUNKS = "chunks"
    BRANCHES = "branches"

    @property
    def description(self) -> str:
        """What the feature is, in words (messages name features by it)."""
        return _DESCRIPTIONS[self]

    @property
    def keyword(self) -> str | None:
        """The keyword of transformers' attention call that asks for it (``None``: it travels on the
        :class:`PackedSeqInfo`: bidirectional spans, branches)."""
        return _KEYWORDS.get(self)

    @property
    def by_dispatch(self) -> bool:
        """Whether the dispatch serves it on every backend (chunks, branches), so no backend declares it."""
        return self in (AttentionFeature.CHUNKS, AttentionFeature.BRANCHES)


_DESCRIPTIONS = {
    AttentionFeature.SLIDING_WINDOW: "sliding-window attention",
    AttentionFeature.SOFTCAP: "attention logit softcapping",
    AttentionFeature.SINKS: "attention sinks (s_aux)",
    AttentionFeature.DROPOUT: "attention dropout",
    AttentionFeature.ALIBI: "ALiBi position biases",
    AttentionFeature.BIDIRECTIONAL: "bidirectional image blocks",  # PackedSeqInfo.bidirectional_spans (Gemma 3)
    AttentionFeature.CHUNKS: "chunked attention",
    AttentionFeature.BRANCHES: "branched samples (shared prefixes)",
}
_KEYWORDS = {
    AttentionFeature.SLIDING_WINDOW: "sliding_window",
    AttentionFeature.SOFTCAP: "softcap",
    AttentionFeature.SINKS: "s_aux",
    AttentionFeature.DROPOUT: "dropout",
    AttentionFeature.ALIBI: "alibi_slopes",
    AttentionFeature.CHUNKS: "attention_chunk_size",
}


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a packed attention call, or a model's attention, asks of a backend.

    Attributes:
        features: the :class:`AttentionFeature` it applies.
        head_dim: the larger of the query and value head dims (flash kernels take at most 256); ``None``: unknown.
        min_head_dim: the smaller one (compiled flex takes 16 or more); ``None``: the same as ``head_dim``.
    """

    features: frozenset[AttentionFeature] = frozenset()
    head_dim: int | None = None
    min_head_dim: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", frozenset(AttentionFeature(name) for name in self.features))


class CallOptions(NamedTuple):
    """What one packed attention call asks for besides q, k, v and the samples (checked by packed_attention_forward).

    ``sliding_window``: ``None`` (causal) or ``w``: query ``i`` sees keys ``j`` with ``i - w < j <= i`` (transformers'
    convention). ``softcap``: ``None`` or ``c``: scores become ``tanh(scores / c) * c``. ``sinks``: ``None`` or
    ``(num_heads,)`` one logit per query head added to every softmax denominator (gpt_oss ``s_aux``). ``dropout``: a
    probability (transformers passes 0.0 outside training). ``module``: the attention module (``training``).
    ``alibi_slopes``: ALiBi (bloom, mpt), ``None`` or ``(num_heads,)`` float slopes: query ``i`` adds
    ``-slopes[h] * (i - j)`` to its score of key ``j``, ``i`` and ``j`` counted within the sample. ``fallback``: the
    forward of a backend that runs on any device and applies this call's features, for what a kernel cannot take (a
    sample past its 32-bit offsets), and ``kernel``: the record's optional kernel, loaded (:meth:`OptionalKernel.get`);
    both set by the dispatch, so no backend imports another or loads its own.
    """

    scaling: float
    dropout: float
    sliding_window: int | None
    softcap: float | None
    sinks: Tensor | None
    module: torch.nn.Module
    alibi_slopes: Tensor | None = None
    fallback: AttentionBackend | None = None
    kernel: Any = None


class BackendFunction(Protocol):
    """One backend: the contract of :func:`packed_attention_forward` on its inputs.

    ``query`` ``(B, num_heads, T, head_dim)``, ``key`` ``(B, num_kv_heads, T, head_dim)``, ``value``
    ``(B, num_kv_heads, T, head_dim_v)``, one float dtype, ``num_kv_heads`` dividing ``num_heads`` (query head ``h``
    reads kv head ``h // (num_heads // num_kv_heads)``); ``info``: the samples, tiling the ``B * T`` tokens. Returns
    ``(B, T, num_heads, head_dim_v)`` in query's dtype, causal attention within each sample. Every query sees at
    least itself, so no row is ever fully masked. An option the backend cannot apply (beyond its record's
    ``serves``) is refused before dispatch, so it arrives as ``None`` / 0.0.
    """

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
    ) -> Tensor: ...


class BranchedFunction(Protocol):
    """A backend's own path for a branched batch (shared prefixes, :meth:`PackedSeqInfo.branch_spans`): the contract of
    :class:`BackendFunction`, or ``None`` where it cannot take this batch (the caller then runs the ``[prefix; branch]``
    units, :meth:`PackedSeqInfo.branch_units`, through the backend's plain forward)."""

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
    ) -> Tensor | None: ...


class AttentionBackend(NamedTuple):
    """One packed attention backend: what it is called, what it serves, whether it can run here and why not, and its
    packed function. The built-in ones are declared by their modules and listed in
    :data:`unpack_trainer.patches.attention.registry.REGISTRY`; :func:`~unpack_trainer.register_backend` adds one from
    outside the package.

    Attributes:
        name: what ``UNPACK_ATTENTION_BACKEND``, ``backend=`` and ``unpack-trainer env`` call it.
        serves: the :class:`AttentionFeature` it applies itself (none of those the dispatch serves,
            :attr:`AttentionFeature.by_dispatch`); a call asking for another goes to a backend that serves it, or is
            refused.
        forward: the packed forward (:class:`BackendFunction`).
        branched_forward: its own path for branched batches (:class:`BranchedFunction`), or ``None``: always the
            ``[prefix; branch]`` units.
        kernel: the optional kernel it runs (:class:`OptionalKernel`), or ``None`` for a backend of torch's own ops
            that runs wherever torch does.
        requires: ``(device, compute dtype) -> str | None``, why it cannot run there beyond what ``kernel`` says (a
            GPU too old for it, ...); ``None``: nothing more.
        max_head_dim: the largest query / value head dim its kernel takes; ``None``: any.
        automatic: whether the automatic choice considers it (in the registry's order).
        prepare: ``(info, device) -> None``: plan on the host what its forward reads of a batch (kept in
            ``info.plans``), before compiled layers run it: its forward then only reads the plans, with no graph
            break, shaped so that a compiled layer recompiles only when a batch's shapes change class; ``None``:
            nothing to plan.
        min_head_dim: the smallest query / value head dim its kernel takes; ``None``: any.
        automatic_device_types: the device types where the automatic choice considers it (``None``: every device
            it runs on).
        keeps_implementation: the transformers attention implementation it reproduces exactly, so that a model
            loaded with it keeps this backend (transformers' eager attention, for the eager backend); ``None``: none.
    """

    name: str
    serves: frozenset[AttentionFeature]
    forward: BackendFunction
    branched_forward: BranchedFunction | None = None
    kernel: OptionalKernel | None = None
    requires: Callable[[torch.device, torch.dtype], str | None] | None = None
    max_head_dim: int | None = None
    automatic: bool = True
    prepare: Callable[[PackedSeqInfo, torch.device], None] | None = None
    min_head_dim: int | None = None
    automatic_device_types: tuple[str, ...] | None = None
    keeps_implementation: str | None = None

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why it cannot run on ``device`` computing in ``dtype`` (its kernel's reason first); ``None`` when it can."""
        reason = None if self.kernel is None else self.kernel.unavailable_reason(device, dtype)
        if reason is None and self.requires is not None:
            reason = self.requires(device, dtype)
        return reason

    def cannot_apply(self, needs: Needs) -> list[str]:
        """What it cannot apply of ``needs``, described: the features it does not serve (by name), then a head dim
        outside its ``min_head_dim`` .. ``max_head_dim``; empty when it applies all of it."""
        missing = [
            feature.description
            for feature in sorted(needs.features)
            if not feature.by_dispatch and feature not in self.serves
        ]
        head_dim = needs.head_dim
        if self.max_head_dim is not None and head_dim is not None and head_dim > self.max_head_dim:
            missing.append(f"head_dim {head_dim} (its kernel takes at most {self.max_head_dim})")
        smallest = head_dim if needs.min_head_dim is None else needs.min_head_dim
        if self.min_head_dim is not None and smallest is not None and smallest < self.min_head_dim:
            missing.append(f"head_dim {smallest} (its kernel takes at least {self.min_head_dim})")
        return missing

    @property
    def runs_anywhere(self) -> bool:
        """Whether it runs wherever torch does: no optional kernel, no requirement."""
        return self.kernel is None and self.requires is None


def bucket_backend(
    name: str,
    serves: frozenset[AttentionFeature],
    forward: BackendFunction,
    buckets_forward: Callable[..., Tensor],
    *,
    automatic: bool = True,
    keeps_implementation: str | None = None,
) -> AttentionBackend:
    """The record of a backend that runs the samples in buckets of similar lengths (SDPA, eager), whose
    ``buckets_forward(q, k, v, info, options, plan)`` runs a bucket plan (:mod:`unpack_trainer.patches.buckets`):
    ``forward`` on the batch's plan; a branched batch with every query computed once on its branch plan, bidirectional
    spans included (``None`` for ALiBi or spans that are not contiguous: the caller runs the ``[prefix; branch]``
    units); both plans made before compiled layers run (``prepare``)."""

    def branched_forward(
        query: Tensor, key: Tensor, value: Tensor, info: PackedSeqInfo, options: CallOptions
    ) -> Tensor | None:
        if options.alibi_slopes is not None:
            return None
        plan: BucketPlan | None = branch_plan(info, query.device)
        return None if plan is None else buckets_forward(query, key, value, info, options, plan)

    def prepare(info: PackedSeqInfo, device: torch.device) -> None:
        if info.is_branched:
            branch_plan(info, device, compiled=True)
        attention_plan(info, device, compiled=True)

    return AttentionBackend(
        name,
        serves,
        forward,
        branched_forward=branched_forward,
        automatic=automatic,
        prepare=prepare,
        keeps_implementation=keeps_implementation,
    )


def tokens_major(x: Tensor) -> Tensor:
    """(B, num_heads, T, head_dim) -> (total_tokens, num_heads, head_dim), total_tokens = B * T; a view when B == 1."""
    batch_size, num_heads, seq_len, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch_size * seq_len, num_heads, head_dim)


def repeat_heads(x: Tensor, heads_per_kv: int) -> Tensor:
    """(n, num_kv_heads, L, head_dim) -> (n, num_kv_heads * heads_per_kv, L, head_dim), each kv head repeated
    ``heads_per_kv`` times (transformers' repeat_kv)."""
    if heads_per_kv == 1:
        return x
    n, num_kv_heads, length, head_dim = x.shape
    expanded = x[:, :, None].expand(n, num_kv_heads, heads_per_kv, length, head_dim)
    return expanded.reshape(n, num_kv_heads * heads_per_kv, length, head_dim)


class OptionalKernel(NamedTuple):
    """A kernel that may be missing or broken in this environment, declared by the backend that runs it (its record's
    ``kernel``): how to load it and what it runs on. Loaded on first use (never at import), once per process.

    Attributes:
        name: how messages name it (``"flash-attn"``).
        load: ``() -> kernel``; anything it raises (not installed, an install without its CUDA libraries) means "not
            available", logged once at DEBUG.
        not_installed: the reason given when ``load`` fails, with the fix (``"flash-attn is not installed (pip
            install flash-attn)"``).
        dtypes: the compute dtypes it takes.
        dtype_problem: the reason for another dtype, formatted with ``name`` and ``dtype``.
        device_types: the device types it runs on.
        distributions: the names its package is installed under (``pip``'s), tried in order for its version
            (``unpack-trainer env``); empty for a kernel that comes with torch.
    """

    name: str
    load: Callable[[], Any]
    not_installed: str
    dtypes: tuple[torch.dtype, ...]
    dtype_problem: str = "{name} needs float16 or bfloat16, the model computes in {dtype}"
    device_types: tuple[str, ...] = ("cuda",)
    distributions: tuple[str, ...] = ()

    def get(self) -> Any:
        """The loaded kernel, or ``None`` when it cannot be loaded here."""
        return _loaded(self.name, self.load)

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why the kernel cannot run on ``device`` computing in ``dtype``: not loadable, another device type, another
        dtype; ``None`` when it can."""
        if self.get() is None:
            return self.not_installed
        if device.type not in self.device_types:
            if self.device_types == ("cuda",):
                return f"{self.name} needs a CUDA device, the model is on {device.type}"
            return f"{self.name} runs on {' and '.join(self.device_types)} here, the model is on {device.type}"
        if dtype not in self.dtypes:
            return self.dtype_problem.format(name=self.name, dtype=dtype)
        return None


@functools.cache
def _loaded(name: str, load: Callable[[], Any]) -> Any:
    try:
        return load()
    except Exception as error:  # noqa: BLE001
        log_once(logger, logging.DEBUG, f"{name} is not usable: {error!r}")
        return None
