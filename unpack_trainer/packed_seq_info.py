"""The carrier of sample boundaries: the names they travel under, and the per-sample lengths of a packed batch with
what is derived from them, computed once on the CPU (:class:`PackedSeqInfo`).

The one piece shared by the data path (the collator writes the metadata into a batch), the model hook (which builds
one :class:`PackedSeqInfo` per forward from it) and the kernels (which read it back). It depends on torch only, so
the collator never imports the attention backends; every module names a key through the constants below, none
retypes it.

One set of per-sample lengths, named for the place it is in (a column, a batch key, an object, a kernel argument)::

    stage                          name                                       what
    dataset row packed ahead       ``seq_lengths``         SEQ_LENGTHS_COLUMN  list[int] column (TRL's ``pack_dataset``
                                                                               writes the same column)
    batch / forward keyword        ``packed_seq_lengths``  SEQ_LENGTHS_KEY     (num_seqs,) int32; prefixed ``packed_`` as
                                                                               every key a model does not know, so it
                                                                               never meets a model's own argument
                                   ``packed_seq_parents``  SEQ_PARENTS_KEY     (num_seqs,) int64, branched batches
                                   ``cu_seq_lens_q/k``,    FLASH_ATTENTION_KEYS transformers' own names, the keywords
                                   ``max_length_q/k``                          its flash-attention path takes; the
                                                                               collator adds them for unpatched models
    decoder hook -> layers         ``packed_seq_info``     INFO_KEY            :class:`PackedSeqInfo`, built once per
                                                                               forward from the keys above (the
                                                                               collator's ``cu_seq_lens_q`` and
                                                                               ``max_length_q`` adopted, not rebuilt)
    inside PackedSeqInfo           ``seq_lengths``, ``cu_seqlens``,            the attributes, named as flash-attn
                                   ``max_seqlen``, ``seq_parents``              names its arguments
    kernel call                    ``cu_seqlens``, ``max_seqlen``              flash-attn's / torch varlen's own
                                                                               argument names

The metadata reaches a layer by one keyword, ``packed_seq_info`` (it survives gradient checkpointing: a recomputed
layer gets the keywords of its forward). Where a keyword cannot reach (transformers calls mask functions with fixed
arguments, a few decoders do not hand their keyword arguments down to attention (bloom, mpt), and token mixers'
forwards take none), the same object is read from the patched decoder's state while its forward runs
(:mod:`unpack_trainer.models.state`).

Worked example, one row of two samples of lengths 3 and 2::

    seq_lengths    [3, 2]              (num_seqs,)      int32
    cu_seqlens     [0, 3, 5]           (num_seqs + 1,)  int32, zero-prefixed cumsum
    max_seqlen     3                   Python int
    position_ids   [[0, 1, 2, 0, 1]]   (B, T)           int64, restarting at 0 per sample

Branched segments (a shared prefix, preference pairs): a sample may continue an earlier sample of its row, its
*parent*, instead of starting fresh. ``seq_parents[i]`` is ``-1`` for a sample that starts at position 0, else the
index of the sample it continues. A prompt ``p`` (3 tokens) with chosen ``c`` (2) and rejected ``r`` (1)::

    seq_lengths    [3, 2, 1]           samples p, c, r
    seq_parents    [-1, 0, 0]          c and r both continue p
    position_ids   [[0, 1, 2, 3, 4, 3]]
    attention      p: causal in p; c: p and causal in c; r: p and causal in r (never c)

Attention runs over *units* that compute every query once (:meth:`PackedSeqInfo.branch_spans`): ``[p; c]`` as an
ordinary causal sample, then ``r``'s queries against the keys ``[p; r]``, aligned to the end of its keys. Backends
that cannot align queries that way run ``[p; c]`` and ``[p; r]`` as two ordinary causal samples, the prefix's keys
gathered in front of each branch (:meth:`PackedSeqInfo.branch_units`).

A batch whose prompts are shared carries TRL's padded *view* of its sequences (what TRL's loss reads, never run) and
the packed row that is run, under the view keys (``packed_input_ids``, ``packed_position_ids``, ``packed_token_index``,
``packed_view_index``, ``packed_score_order``; :mod:`unpack_trainer.data.preference`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

__all__ = [
    "BOUNDARY_KEYS",
    "CU_SEQ_LENS_K_KEY",
    "CU_SEQ_LENS_Q_KEY",
    "FLASH_ATTENTION_KEYS",
    "FORWARD_KEYS",
    "INFO_KEY",
    "MAX_LENGTH_K_KEY",
    "MAX_LENGTH_Q_KEY",
    "METADATA_KEYS",
    "MULTIMODAL_POSITIONS_KEY",
    "OWN_KEYS",
    "PACKED_BATCH_KEYS",
    "PACKED_INPUT_IDS_KEY",
    "PACKED_POSITION_IDS_KEY",
    "SCORE_ORDER_KEY",
    "SEQ_LENGTHS_COLUMN",
    "SEQ_LENGTHS_KEY",
    "SEQ_PARENTS_KEY",
    "SHARDED_BATCH_KEY",
    "TOKEN_INDEX_KEY",
    "VIEW_INDEX_KEY",
    "BranchSpans",
    "PackedSeqInfo",
    "PlanCache",
    "branched_row",
    "carried_info",
    "detect_packed",
    "hides_nothing",
    "id_runs",
    "restart_positions",
    "text_positions",
    "zero_prefixed_cumsum",
]

_T = TypeVar("_T")

# --------------------------------------------------------------------------------------------------------------------
# The names of the boundaries (see the module docstring for which is used where, and why)
# --------------------------------------------------------------------------------------------------------------------

# The dataset column of a row packed ahead of time: the lengths of its samples, list[int].
SEQ_LENGTHS_COLUMN = "seq_lengths"
# The batch key (and decoder forward keyword) of the per-sample lengths: (num_seqs,) int32, row-major over the batch.
SEQ_LENGTHS_KEY = "packed_seq_lengths"
# The branch structure of shared prefixes: (num_seqs,) int, -1 or the earlier sample of the row each one continues.
SEQ_PARENTS_KEY = "packed_seq_parents"
# transformers' flash-attention keywords for the same boundaries (``_flash_attention_forward``): the zero-prefixed
# cumsum (num_seqs + 1,) int32 of queries and keys, and the longest sample (Python int).
CU_SEQ_LENS_Q_KEY = "cu_seq_lens_q"
CU_SEQ_LENS_K_KEY = "cu_seq_lens_k"
MAX_LENGTH_Q_KEY = "max_length_q"
MAX_LENGTH_K_KEY = "max_length_k"
# The keyword the decoder hook hands every layer: the forward's PackedSeqInfo, or None for a forward not packed.
INFO_KEY = "packed_seq_info"

# The packed row of a batch that also carries a padded view (shared prompts): its tokens (1, T) int64 and positions
# (1, T) int64; for each token of TRL's batch (rows, L) and of the view (rows, L') the packed token it reads (int64);
# and, for a sequence classifier, the order of the scores TRL's batch expects (n,) int64.
PACKED_INPUT_IDS_KEY = "packed_input_ids"
PACKED_POSITION_IDS_KEY = "packed_position_ids"
TOKEN_INDEX_KEY = "packed_token_index"
VIEW_INDEX_KEY = "packed_view_index"
SCORE_ORDER_KEY = "packed_score_order"
# Under sequence parallelism, a batch with a packed row and a padded view as DeepSpeed's data loader adapter takes it:
# the row's tokens and positions under ``input_ids`` / ``position_ids`` (cut along the row by the adapter) and the whole
# batch under this key (a dict the adapter copies whole to every process).
SHARDED_BATCH_KEY = "packed_sequence_parallel_batch"

# A vision-language batch's multi-axis positions computed ahead by the collator, each sample's own (Qwen2-VL family:
# (4, B, T) int64 [text; t; h; w]); ``position_ids`` stays (B, T), restarting per sample, as in every packed batch.
MULTIMODAL_POSITIONS_KEY = "packed_multimodal_position_ids"

FLASH_ATTENTION_KEYS: tuple[str, ...] = (CU_SEQ_LENS_Q_KEY, CU_SEQ_LENS_K_KEY, MAX_LENGTH_Q_KEY, MAX_LENGTH_K_KEY)
# The keys a batch's samples are read from, the first one present winning.
BOUNDARY_KEYS: tuple[str, ...] = (SEQ_LENGTHS_KEY, CU_SEQ_LENS_Q_KEY)
# Every key of a batch that describes its packing (what an outer model that drops keywords must carry to its decoder).
METADATA_KEYS: tuple[str, ...] = (SEQ_LENGTHS_KEY, SEQ_PARENTS_KEY, *FLASH_ATTENTION_KEYS)
# Every keyword of a layer's call that describes the packing: what a layer run per sample (padded) drops.
FORWARD_KEYS: tuple[str, ...] = (INFO_KEY, *METADATA_KEYS)
# The keywords only this package knows: taken off before a call goes to one of transformers' own functions.
OWN_KEYS: tuple[str, ...] = (INFO_KEY, SEQ_LENGTHS_KEY, SEQ_PARENTS_KEY)
# The keys of every batch DataCollatorForPacking returns, in order (``use_cache`` follows unless ``use_cache=None``):
# the tokens (``input_ids``, ``labels``), then the packing metadata an unpatched model must be spared.
PACKED_BATCH_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", SEQ_LENGTHS_KEY, *FLASH_ATTENTION_KEYS)


class BranchSpans(NamedTuple):
    """The attention units of a branched batch, each query computed once (:meth:`PackedSeqInfo.branch_spans`).

    Units are in token order; unit ``u`` queries the ``query_lengths[u]`` tokens from ``query_starts[u]`` (row-major
    over ``B * T``) and attends to ``key_lengths[u] >= query_lengths[u]`` keys, its slice of ``key_gather``; its
    queries are aligned to the end of its keys: query ``i`` sees keys ``j <= key_lengths[u] - query_lengths[u] + i``.
    """

    query_lengths: torch.Tensor  # (num_units,) int64 CPU
    query_starts: torch.Tensor  # (num_units,) int64 CPU
    key_lengths: torch.Tensor  # (num_units,) int64 CPU
    key_gather: torch.Tensor  # (sum(key_lengths),) int64 CPU: the token each key slot reads, unit after unit


def zero_prefixed_cumsum(seq_lengths: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` of ``seq_lengths``: ``(num_seqs,)`` integer lengths -> ``(num_seqs + 1,)`` of the same dtype,
    ``[0, l0, l0 + l1, ...]``.

    Example::

        >>> zero_prefixed_cumsum(torch.tensor([3, 2], dtype=torch.int32)).tolist()
        [0, 3, 5]
    """
    cu_seqlens = torch.zeros(seq_lengths.numel() + 1, dtype=seq_lengths.dtype)
    torch.cumsum(seq_lengths, dim=0, out=cu_seqlens[1:])
    return cu_seqlens


def restart_positions(seq_lengths: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids restarting at 0 for every sample.

    Args:
        seq_lengths: ``(num_seqs,)`` integer lengths (CPU), in order.
        cu_seqlens: ``(num_seqs + 1,)`` zero-prefixed cumsum of ``seq_lengths`` when the caller has it already.

    Returns:
        ``(total_tokens,)`` int64 on the CPU, ``total_tokens = seq_lengths.sum()``.

    Example::

        >>> restart_positions(torch.tensor([3, 2])).tolist()
        [0, 1, 2, 0, 1]
    """
    lengths = seq_lengths.to(torch.int64)
    if cu_seqlens is None:
        cu_seqlens = zero_prefixed_cumsum(lengths)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lengths)
    return torch.arange(starts.numel(), dtype=torch.int64) - starts


def branched_row(tokens: list[int], seq_lengths: list[int], seq_parents: list[int]) -> dict[str, Any]:
    """One packed row of samples that may continue an earlier one (shared prompts), under its batch keys.

    Args:
        tokens: the row's token ids, ``sum(seq_lengths)`` of them.
        seq_lengths: each sample's length, in row order.
        seq_parents: for each sample, ``-1`` or the index of the earlier sample it continues.

    Returns:
        ``packed_input_ids`` ``(1, T)`` int64, ``packed_position_ids`` ``(1, T)`` int64 (restarting at 0 per sample,
        continuing the parent's positions in a branch), ``packed_seq_lengths`` ``(num_seqs,)`` int32 and
        ``packed_seq_parents`` ``(num_seqs,)`` int64, on the CPU; and ``packed_seq_info``, the row's
        :class:`PackedSeqInfo`, which the patched model's hook adopts (no metadata read back from the device).

    Example::

        >>> row = branched_row([5, 6, 7, 8, 9], [2, 1, 2], [-1, 0, 0])
        >>> row[PACKED_POSITION_IDS_KEY].tolist()
        [[0, 1, 2, 2, 3]]
    """
    lengths = torch.tensor(seq_lengths, dtype=torch.int32)
    parents = torch.tensor(seq_parents, dtype=torch.int64)
    info = PackedSeqInfo(lengths, batch_size=1, seq_len=len(tokens), seq_parents=parents)
    return {
        PACKED_INPUT_IDS_KEY: torch.tensor(tokens, dtype=torch.int64).unsqueeze(0),
        PACKED_POSITION_IDS_KEY: info.position_ids(),
        SEQ_LENGTHS_KEY: lengths,
        SEQ_PARENTS_KEY: parents,
        INFO_KEY: info,
    }


def id_runs(ids: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """``(num_spans, 2)`` int64 ``[start, end)`` runs of one id ``>= 0`` in ``ids`` (``(N,)`` int64, ``-1`` outside
    every span), cut at the indices ``cuts`` (``(k,)`` int64: each sample's or unit's first token): the
    ``bidirectional_spans`` of per-token span ids. ``ids [-1, 0, 0, 0, 1]`` cut at ``[0, 2]`` ->
    ``[[1, 2], [2, 4], [4, 5]]``."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    starts[cuts] = True
    begin = torch.nonzero(starts).reshape(-1)
    end = torch.cat([begin[1:], torch.tensor([ids.numel()], dtype=torch.int64)])
    keep = ids[begin] >= 0
    return torch.stack([begin[keep], end[keep]], dim=1)


def _adopted_cu_seqlens(cu_seqlens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` given with the batch (the collator's ``cu_seq_lens_q``) as a CPU tensor, after checking that it
    is the zero-prefixed cumsum of ``lengths`` ``(num_seqs,)`` int64; ``ValueError`` naming the key otherwise."""
    cu = torch.as_tensor(cu_seqlens).detach().to(device="cpu").reshape(-1)
    if (
        cu.numel() != lengths.numel() + 1
        or int(cu[0]) != 0
        or not torch.equal((cu[1:] - cu[:-1]).to(torch.int64), lengths)
    ):
        expected = zero_prefixed_cumsum(lengths)
        raise ValueError(
            f"`{CU_SEQ_LENS_Q_KEY}` does not match the packed sample lengths: expected the zero-prefixed cumsum "
            f"{expected.tolist()[:8]}..., got {cu.tolist()[:8]}..."
        )
    return cu


def _checked_parents(seq_parents: torch.Tensor, cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``seq_parents`` as ``(num_seqs,)`` int64 CPU after checking that every parent is an earlier sample of the same
    row that continues nothing itself (one level of branching)."""
    parents = torch.as_tensor(seq_parents).detach().to(device="cpu", dtype=torch.int64).reshape(-1)
    num_seqs = cu_seqlens.numel() - 1
    if parents.numel() != num_seqs:
        raise ValueError(f"`{SEQ_PARENTS_KEY}` has {parents.numel()} entries for {num_seqs} packed samples.")
    index = torch.arange(num_seqs, dtype=torch.int64)
    rows = torch.div(cu_seqlens[:-1], seq_len, rounding_mode="floor")
    safe = parents.clamp(min=0)
    bad = (parents < -1) | ((parents >= 0) & ((parents >= index) | (parents[safe] >= 0) | (rows[safe] != rows)))
    if bool(bad.any()):
        sample = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"Packed sample {sample} has parent {int(parents[sample])}: a parent must be -1 or an earlier sample of the "
            "same row that continues no other sample."
        )
    return parents


class PlanCache:
    """What consumers derive from one :class:`PackedSeqInfo`'s samples, built once on first use and kept as long as
    the metadata lives: a forward's layers, their recompute under gradient checkpointing, and every other forward
    given the same metadata (a reference model's) share one plan.

    A plan is found by its key: an instance of a ``NamedTuple`` class that the module building the plan declares,
    whose type names the plan and whose fields are what it depends on besides the samples (a device, a dtype, a
    window, ...): ``BucketPlanKey(device="cuda:0")``. Two kinds of plan never meet, even with equal fields. Held by
    the metadata (:attr:`PackedSeqInfo.plans`), which keeps there only its own views of the samples (chunks, branch
    units and spans, the samples without their bidirectional spans): no consumer's plan is its business. A copy of the
    cache (pickle, ``copy``, ``deepcopy``) is empty, so a copied :class:`PackedSeqInfo` rebuilds what it needs.

    Example::

        >>> class Doubled(NamedTuple):
        ...     device: str
        >>> plans = PlanCache()
        >>> plans.get(Doubled("cpu"), lambda: 2 * 21), plans.get(Doubled("cpu"), lambda: 0)
        (42, 42)
    """

    def __init__(self) -> None:
        self._plans: dict[type, dict[tuple, Any]] = {}

    def get(self, key: tuple, build: Callable[[], _T]) -> _T:
        """The plan of ``key`` (a ``NamedTuple`` instance), made by ``build()`` on first use."""
        plans = self._plans.setdefault(type(key), {})
        if key not in plans:
            plans[key] = build()
        return plans[key]

    def __len__(self) -> int:
        """How many plans it holds, of every kind."""
        return sum(len(plans) for plans in self._plans.values())

    def __reduce__(self) -> tuple[type, tuple]:
        return PlanCache, ()


# The plans PackedSeqInfo derives from its own samples, one key type each (see PlanCache).
class _WithoutSpans(NamedTuple):
    pass


class _BidirectionalIds(NamedTuple):
    pass


class _BranchUnits(NamedTuple):
    pass


class _BranchSpans(NamedTuple):
    pass


class _Chunked(NamedTuple):
    chunk_size: int


class PackedSeqInfo:
    """Packing metadata of one batch, computed once per forward on the CPU and shared by every layer.

    A packed batch is ``B`` rows of ``T`` tokens; the samples of all rows, in row-major order, have the lengths
    ``seq_lengths`` (every sample inside one row; trailing row padding is a sample of its own).

    Attributes:
        seq_lengths: ``(num_seqs,)`` int32 CPU, every length >= 1, summing to ``B * T``.
        cu_seqlens: ``(num_seqs + 1,)`` int32 CPU, zero-prefixed cumsum of ``seq_lengths``.
        max_seqlen: the longest sample, a Python int.
        batch_size, seq_len: ``B`` and ``T``.
        seq_parents: ``None`` (no sample continues another), or ``(num_seqs,)`` int64 CPU: ``-1`` for a sample that
            starts at position 0, else the index of the earlier sample of the same row it continues (a shared
            prefix, see the module docstring). Positions, attention and the first prediction of a branch follow it.
        is_branched: whether some sample continues another.
        bidirectional_spans: ``None``, or ``(num_spans, 2)`` int64 CPU ``[start, end)`` token ranges (row-major over
            ``B * T``, ascending, disjoint, each inside one sample): the tokens of a span attend to each other both
            ways (an image's tokens in Gemma 3), every other pair causally as usual. With a sliding window ``w`` a key
            ``j`` of query ``i`` is still within ``i - w < j``. See :meth:`with_bidirectional_spans`.
        sequence_shards: ``N`` when these are the metadata of whole rows a forward sees one of ``N`` equal contiguous
            shards of (sequence parallelism, :meth:`for_sequence_shards`), else 1.
        plans: what consumers derive from these samples (device copies, the SDPA buckets, masks, flash-attn chunks,
            xformers biases, block masks, the backend choice), built on first use and kept beside them in a
            :class:`PlanCache` keyed by what each plan is of (the object reads only its own views there), every layer
            of a forward (and its recompute under gradient checkpointing: the same object) finds the plans there, and
            a copy (a pickle through a process group's object gather, as DeepSpeed's sequence-parallel data loader
            sends a batch's non-tensors) starts with an empty one.

    Example::

        >>> info = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2]), batch_size=1, seq_len=5)
        >>> info.cu_seqlens.tolist(), info.max_seqlen
        ([0, 3, 5], 3)
    """

    def __init__(
        self,
        seq_lengths: torch.Tensor,
        *,
        batch_size: int,
        seq_len: int,
        seq_parents: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> None:
        lengths = torch.as_tensor(seq_lengths).detach().to(device="cpu", dtype=torch.int64).reshape(-1)
        if lengths.numel() == 0:
            raise ValueError(f"Packed attention got no samples: `{SEQ_LENGTHS_KEY}` is empty.")
        bad = torch.nonzero(lengths <= 0)
        if bad.numel():
            index = int(bad[0, 0])
            raise ValueError(
                f"Packed sample {index} has length {int(lengths[index])}; every sample needs at least one token."
            )
        cu = zero_prefixed_cumsum(lengths) if cu_seqlens is None else _adopted_cu_seqlens(cu_seqlens, lengths)
        total_tokens = int(cu[-1])
        if total_tokens != batch_size * seq_len:
            raise ValueError(
                f"The packed sample lengths sum to {total_tokens} tokens but the batch has {batch_size} row(s) of "
                f"{seq_len} tokens ({batch_size * seq_len}); trailing row padding must be a sample of its own."
            )
        if batch_size > 1:
            boundaries = torch.arange(1, batch_size, dtype=torch.int64) * seq_len
            crossing = ~torch.isin(boundaries, cu.to(torch.int64))
            if bool(crossing.any()):
                row = int(torch.nonzero(crossing)[0, 0])
                sample = int(torch.searchsorted(cu.to(torch.int64), boundaries[row], right=True)) - 1
                raise ValueError(
                    f"Packed sample {sample} crosses the boundary between rows {row} and {row + 1} (row length "
                    f"{seq_len}); samples must not span rows."
                )
        longest = int(lengths.max())
        if max_seqlen is not None and int(max_seqlen) != longest:
            raise ValueError(
                f"`{MAX_LENGTH_Q_KEY}`={int(max_seqlen)} but the longest packed sample has {longest} tokens."
            )
        self.seq_parents = None if seq_parents is None else _checked_parents(seq_parents, cu, seq_len)
        # Whether some sample continues another (a shared prefix; see branch_units): a plain bool, read per layer.
        self.is_branched = self.seq_parents is not None and bool((self.seq_parents >= 0).any())
        self.seq_lengths = lengths.to(torch.int32)
        self.cu_seqlens = cu.to(torch.int32)
        self.max_seqlen = longest
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.bidirectional_spans: torch.Tensor | None = None
        self.sequence_shards = 1
        # What consumers derive from these samples, beside them (never read by this object; a copy starts empty).
        self.plans = PlanCache()

    def __repr__(self) -> str:
        shards = f", sequence_shards={self.sequence_shards}" if self.sequence_shards > 1 else ""
        return (
            f"PackedSeqInfo(num_seqs={self.num_seqs}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"max_seqlen={self.max_seqlen}{shards})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # A copy (copy, deepcopy, a pickle through a process group's object gather, as DeepSpeed's sequence-parallel
        # data loader sends a batch's non-tensors) carries the samples and rebuilds what it derives on first use.
        return {**self.__dict__, "plans": PlanCache()}

    def for_sequence_shards(self, shards: int) -> PackedSeqInfo:
        """These samples as the metadata of whole rows that each forward sees one of ``shards`` equal contiguous
        pieces of (DeepSpeed Ulysses: every rank embeds its piece, and its attention gets the whole row for its
        share of the heads): a new object with ``sequence_shards = shards``, or ``self`` for ``shards`` 1.

        Raises:
            ValueError: ``seq_len`` not divisible by ``shards`` (the collator pads a row to a multiple first).

        Example::

            >>> info = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 5]), batch_size=1, seq_len=8)
            >>> info.for_sequence_shards(2)
            PackedSeqInfo(num_seqs=2, batch_size=1, seq_len=8, max_seqlen=5, sequence_shards=2)
        """
        if shards == 1:
            return self
        if shards < 1 or self.seq_len % shards:
            raise ValueError(
                f"Rows of {self.seq_len} tokens cannot be cut into {shards} equal sequence-parallel shards; pad each "
                f"row to a multiple of {shards}."
            )
        info = self._same_samples()
        info.bidirectional_spans = self.bidirectional_spans
        info.sequence_shards = int(shards)
        return info

    def with_bidirectional_spans(self, spans: torch.Tensor | None) -> PackedSeqInfo:
        """These samples with the token ranges ``spans`` attending both ways (``bidirectional_spans``): a new object
        with the same samples and parents (nothing derived is shared), or ``self`` when ``spans`` is ``None`` or empty.

        On a branched row (``seq_parents``) a span lies in a prompt (a sample that others continue) or in one of its
        branches, like any other sample's: a query still sees what the branched row lets it see (its own sample
        causally, its prefix in a branch, never a sibling), or any key of its own span. A prompt's span is therefore
        seen both ways by the prompt's own tokens; every branch sees the whole prompt anyway.

        Args:
            spans: ``(num_spans, 2)`` integer ``[start, end)`` ranges, row-major over ``B * T``, ascending and disjoint,
                each of at least one token and inside one sample (never across a prompt and its branch).

        Raises:
            ValueError: a span that is empty, overlaps another, or crosses a sample boundary.

        Example::

            >>> info = PackedSeqInfo.from_seq_lengths(torch.tensor([5, 4]), batch_size=1, seq_len=9)
            >>> info.with_bidirectional_spans(torch.tensor([[1, 3], [6, 8]])).bidirectional_spans.tolist()
            [[1, 3], [6, 8]]
        """
        if spans is None:
            return self
        spans = torch.as_tensor(spans).detach().to(device="cpu", dtype=torch.int64).reshape(-1, 2)
        if spans.numel() == 0:
            return self
        starts, ends = spans[:, 0].contiguous(), spans[:, 1].contiguous()
        cu = self.cu_seqlens.to(torch.int64)
        sample_end = cu[(torch.searchsorted(cu, starts, right=True) - 1).clamp(0, cu.numel() - 2) + 1]
        bad = (starts < 0) | (ends <= starts) | (ends > sample_end)
        bad[1:] |= starts[1:] < ends[:-1]
        if bool(bad.any()):
            index = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"Bidirectional span {index} [{int(starts[index])}, {int(ends[index])}) is empty, overlaps the span "
                "before it, or crosses a sample boundary; every span must lie inside one sample."
            )
        info = self._same_samples()
        info.bidirectional_spans = spans
        if self.bidirectional_spans is None:  # what the layers without the spans run: these samples, as they came
            info.plans.get(_WithoutSpans(), lambda: self)
        return info

    def without_bidirectional_spans(self) -> PackedSeqInfo:
        """These samples and parents without ``bidirectional_spans``, for the layers that do not apply them (Gemma 4's
        full-attention layers): ``self`` when it has none; else the metadata the spans were added to
        (:meth:`with_bidirectional_spans`), or a copy made once. Cached, so a compiled layer only reads it."""
        if self.bidirectional_spans is None:
            return self
        return self.plans.get(_WithoutSpans(), self._same_samples)

    def _same_samples(self) -> PackedSeqInfo:
        """A new object of these samples and parents, nothing derived shared, no spans; rows cut into as many
        sequence-parallel shards (the rows' own property, kept by what is derived from them)."""
        info = PackedSeqInfo(
            self.seq_lengths,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            seq_parents=self.seq_parents,
            cu_seqlens=self.cu_seqlens,
        )
        info.sequence_shards = self.sequence_shards
        return info

    def bidirectional_ids(self) -> torch.Tensor:
        """``(B * T,)`` int64 CPU: for each token the index of its bidirectional span, ``-1`` outside every span
        (all ``-1`` without spans). Cached."""

        def build() -> torch.Tensor:
            ids = torch.full((self.total_tokens,), -1, dtype=torch.int64)
            spans = self.bidirectional_spans
            if spans is not None:
                lengths = spans[:, 1] - spans[:, 0]
                index = torch.repeat_interleave(torch.arange(spans.shape[0], dtype=torch.int64), lengths)
                offsets = torch.arange(int(lengths.sum()), dtype=torch.int64) - torch.repeat_interleave(
                    zero_prefixed_cumsum(lengths)[:-1], lengths
                )
                ids[torch.repeat_interleave(spans[:, 0], lengths) + offsets] = index
            return ids

        return self.plans.get(_BidirectionalIds(), build)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lengths.numel())

    @property
    def total_tokens(self) -> int:
        return self.batch_size * self.seq_len

    # -- constructors ------------------------------------------------------------------------------------------------

    @classmethod
    def from_seq_lengths(cls, seq_lengths: torch.Tensor, **keywords: Any) -> PackedSeqInfo:
        """From ``packed_seq_lengths``: ``(num_seqs,)`` integer lengths, row-major over the batch (any device); the
        keywords are the constructor's: ``batch_size``, ``seq_len``, and optionally ``seq_parents``
        (``packed_seq_parents``: ``(num_seqs,)`` integer, ``-1`` or the sample each one continues), ``cu_seqlens``
        (``(num_seqs + 1,)`` int, the collator's ``cu_seq_lens_q``) and ``max_seqlen`` (its ``max_length_q``). The
        last two, when the batch carries them, are adopted instead of derived again, after checking that they describe
        ``seq_lengths`` (``ValueError`` naming the key otherwise)."""
        return cls(seq_lengths, **keywords)

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor, *, batch_size: int, seq_len: int, max_seqlen: int | None = None
    ) -> PackedSeqInfo:
        """From ``cu_seq_lens_q``: ``(num_seqs + 1,)`` zero-prefixed cumulative lengths (any device), adopted as
        ``cu_seqlens``; ``max_seqlen`` (``max_length_q``) adopted after a check, when given."""
        cu = torch.as_tensor(cu_seqlens).detach().to(device="cpu").reshape(-1)
        if cu.numel() < 2 or int(cu[0]) != 0:
            raise ValueError(
                f"`{CU_SEQ_LENS_Q_KEY}` must be zero-prefixed cumulative lengths, got {cu.tolist()[:8]}..."
            )
        return cls(cu[1:] - cu[:-1], batch_size=batch_size, seq_len=seq_len, cu_seqlens=cu, max_seqlen=max_seqlen)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedSeqInfo | None:
        """From ``position_ids`` ``(B, T)``: a sample starts at each row start and wherever a position is not the
        previous one plus 1. Returns ``None`` when every row holds a single sample (nothing is packed)."""
        pos = position_ids.detach().to(device="cpu", dtype=torch.int64)
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        batch_size, seq_len = pos.shape
        if seq_len == 0:
            return None
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        if int(starts.sum()) == batch_size:
            return None
        start_index = torch.nonzero(starts.reshape(-1)).reshape(-1)
        ends = torch.cat([start_index[1:], torch.tensor([batch_size * seq_len])])
        return cls(ends - start_index, batch_size=batch_size, seq_len=seq_len)

    def check_key_side(self, cu_seqlens_k: torch.Tensor | None, max_seqlen_k: Any = None) -> None:
        """``cu_seq_lens_k`` ``(num_seqs + 1,)`` int and ``max_length_k`` (the keys of packed self-attention: the
        queries' own samples), when a batch carries them apart from the query side, checked against these samples;
        ``ValueError`` naming the key otherwise."""
        if cu_seqlens_k is not None and not torch.equal(cu_seqlens_k.detach().cpu().to(torch.int32), self.cu_seqlens):
            raise ValueError(
                f"`{CU_SEQ_LENS_K_KEY}` does not match the packed sample lengths: expected the zero-prefixed cumsum "
                f"{self.cu_seqlens.tolist()[:8]}..., got {cu_seqlens_k.tolist()[:8]}..."
            )
        if max_seqlen_k is not None and int(max_seqlen_k) != self.max_seqlen:
            raise ValueError(
                f"`{MAX_LENGTH_K_KEY}`={int(max_seqlen_k)} but the longest packed sample has {self.max_seqlen} tokens."
            )

    # -- derived values ----------------------------------------------------------------------------------------------

    def position_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(B, T)`` int64 positions restarting at 0 for every sample, on ``device`` (the CPU when ``None``)."""
        positions = restart_positions(self.seq_lengths, self.cu_seqlens)
        if self.is_branched:
            parents = self.seq_parents
            offsets = torch.where(parents >= 0, self.seq_lengths.to(torch.int64)[parents.clamp(min=0)], 0)
            positions = positions + torch.repeat_interleave(offsets, self.seq_lengths.to(torch.int64))
        positions = positions.view(self.batch_size, self.seq_len)
        return positions if device is None else positions.to(device, non_blocking=True)

    def branch_units(self) -> tuple[PackedSeqInfo, torch.Tensor, torch.Tensor]:
        """The attention units of a branched batch: every branch with its prefix gathered in front, as plain samples.

        A sample without branches is a unit of its own. A prefix with branches ``b1, ..., bk`` gives the units
        ``[prefix; b1], ..., [prefix; bk]``: each is ordinary causal attention, so every backend runs it unchanged
        (the same kernel call, no alignment question, no ``(T, T)`` mask). The prefix's outputs are taken from its
        first unit; its queries in the other units are computed and dropped (attention only, the projections and
        MLPs of the prefix still run once).

        Returns:
            ``(unit_info, gather, owner)``: ``unit_info`` a plain :class:`PackedSeqInfo` of one row over the
            ``num_slots`` gathered tokens, with ``bidirectional_spans`` over the slots when these samples have spans
            (a prefix's span in every unit holding the prefix, a branch's in its own unit); ``gather``
            ``(num_slots,)`` int64, the token (row-major over ``B * T``) each slot reads; ``owner`` ``(B * T,)``
            int64, the slot whose output is each token's output. CPU, built once per batch.

        Example (p, c, r of lengths 3, 2, 1 as in the module docstring; a span ``[1, 3)`` in p)::

            unit lengths [5, 4]; gather [0, 1, 2, 3, 4, 0, 1, 2, 5]; owner [0, 1, 2, 3, 4, 8]
            unit spans [[1, 3], [6, 8]]
        """
        return self.plans.get(_BranchUnits(), self._build_branch_units)

    def _build_branch_units(self) -> tuple[PackedSeqInfo, torch.Tensor, torch.Tensor]:
        starts = self.cu_seqlens[:-1].tolist()
        lengths = self.seq_lengths.tolist()
        parents = self.seq_parents.tolist() if self.seq_parents is not None else [-1] * len(lengths)
        children: dict[int, list[int]] = {}
        for index, parent in enumerate(parents):
            if parent >= 0:
                children.setdefault(parent, []).append(index)
        pieces: list[torch.Tensor] = []
        unit_lengths: list[int] = []
        owner = torch.empty(self.total_tokens, dtype=torch.int64)
        slot = 0

        def span(index: int) -> torch.Tensor:
            return torch.arange(starts[index], starts[index] + lengths[index], dtype=torch.int64)

        for index, parent in enumerate(parents):
            if parent >= 0:
                continue
            branches = children.get(index, [])
            prefix = span(index)
            owner[prefix] = torch.arange(slot, slot + lengths[index], dtype=torch.int64)
            for branch in branches or [None]:
                tokens = prefix if branch is None else torch.cat([prefix, span(branch)])
                if branch is not None:
                    owner[span(branch)] = torch.arange(slot + lengths[index], slot + len(tokens), dtype=torch.int64)
                pieces.append(tokens)
                unit_lengths.append(len(tokens))
                slot += len(tokens)
        gather = torch.cat(pieces)
        unit_info = PackedSeqInfo(torch.tensor(unit_lengths, dtype=torch.int64), batch_size=1, seq_len=slot)
        if self.bidirectional_spans is not None:  # each span where its tokens sit: a prefix's in each of its units
            unit_info = unit_info.with_bidirectional_spans(
                id_runs(self.bidirectional_ids()[gather], unit_info.cu_seqlens[:-1].to(torch.int64))
            )
        return unit_info, gather, owner

    def branch_spans(self) -> BranchSpans | None:
        """The attention units of a branched batch with every query computed once: ``None`` when some prefix's
        first branch does not start right after it (then :meth:`branch_units` serves).

        A sample without branches is a unit of its own (queries = keys = its tokens). A prefix with branches
        ``b1, ..., bk`` gives the unit ``[prefix; b1]`` (queries = keys, contiguous in the row) and, for each later
        branch, a unit whose queries are the branch's own tokens and whose keys are ``[prefix; branch]``: its queries
        are aligned to the end of its keys (bottom-right causal), so the prefix's queries run once, not once per
        branch. Every token is the query of exactly one unit, in token order.

        Example (p, c, r of lengths 3, 2, 1 as in the module docstring)::

            query lengths [5, 1]; query starts [0, 5]; key lengths [5, 4]; key gather [0, 1, 2, 3, 4, 0, 1, 2, 5]
        """
        return self.plans.get(_BranchSpans(), self._build_branch_spans)

    def _build_branch_spans(self) -> BranchSpans | None:
        starts = self.cu_seqlens[:-1].tolist()
        lengths = self.seq_lengths.tolist()
        parents = self.seq_parents.tolist() if self.seq_parents is not None else [-1] * len(lengths)
        first_branch: dict[int, int] = {}  # prefix -> its first branch, which is queried with it
        for index, parent in enumerate(parents):
            if parent >= 0 and parent not in first_branch:
                if starts[index] != starts[parent] + lengths[parent]:
                    return None
                first_branch[parent] = index
        queried_with_prefix = set(first_branch.values())

        def span(start: int, length: int) -> torch.Tensor:
            return torch.arange(start, start + length, dtype=torch.int64)

        query_lengths, query_starts, key_lengths, keys = [], [], [], []
        for index, parent in enumerate(parents):  # samples, hence units, in token order
            if index in queried_with_prefix:
                continue
            start, length = starts[index], lengths[index]
            if parent < 0:
                length += lengths[first_branch[index]] if index in first_branch else 0
                keys.append(span(start, length))
            else:
                keys.append(torch.cat([span(starts[parent], lengths[parent]), span(start, length)]))
            query_starts.append(start)
            query_lengths.append(length)
            key_lengths.append(len(keys[-1]))
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
        return BranchSpans(as_tensor(query_lengths), as_tensor(query_starts), as_tensor(key_lengths), torch.cat(keys))

    def chunked(self, chunk_size: int) -> PackedSeqInfo:
        """These samples cut into chunks of ``chunk_size`` tokens counted from each sample's start (the last chunk of
        a sample may be shorter), cached on this object.

        Chunked attention (llama4: a query sees the keys of its own chunk only, causally) over packed samples is
        packed attention over their chunks, so every backend runs it unchanged. Lengths ``[5, 2]``, ``chunk_size`` 2
        -> ``[2, 2, 1, 2]``. In a branched batch chunks are counted by position, and a branch continues its prefix's
        positions: a prefix is cut from its start; a branch's first piece, up to the next multiple of ``chunk_size``
        of its positions, is a branch of the prefix's last chunk when that chunk is not full (so it sees the prefix
        tokens of its own chunk); the rest of the branch is cut into whole chunks that start fresh. Example,
        ``chunk_size`` 3, p, c, r of lengths 4, 3, 2 (positions 0-3, 4-6, 4-5): p -> ``[3, 1]``, c -> ``[2, 1]``, r ->
        ``[2]``; parents ``[-1, -1, 1, -1, 1]``.

        Raises:
            ValueError: ``chunk_size`` is not a positive number of tokens.
        """
        chunk_size = int(chunk_size)
        if chunk_size <= 0:
            raise ValueError(f"attention_chunk_size must be a positive number of tokens, got {chunk_size}.")
        if self.max_seqlen <= chunk_size and not self.is_branched:  # a branch's positions continue its prefix's
            return self
        build = self._chunked_branches if self.is_branched else self._chunked_samples
        return self.plans.get(_Chunked(chunk_size), lambda: build(chunk_size))

    def _chunked_samples(self, chunk_size: int) -> PackedSeqInfo:
        lengths = self.seq_lengths.to(torch.int64)
        chunks = (lengths + chunk_size - 1) // chunk_size  # (num_seqs,) chunks per sample
        sizes = torch.full((int(chunks.sum()),), chunk_size, dtype=torch.int64)
        sizes[torch.cumsum(chunks, 0) - 1] = lengths - (chunks - 1) * chunk_size  # each sample's last chunk
        return PackedSeqInfo(sizes.to(torch.int32), batch_size=self.batch_size, seq_len=self.seq_len)

    def _chunked_branches(self, chunk_size: int) -> PackedSeqInfo:
        sizes: list[int] = []
        parents: list[int] = []
        last_chunk: dict[int, tuple[int, int]] = {}  # prefix sample -> (index of its last chunk, tokens in it)
        for index, (length, parent) in enumerate(zip(self.seq_lengths.tolist(), self.seq_parents.tolist())):
            if parent >= 0:
                chunk, filled = last_chunk[parent]
                if filled < chunk_size:
                    first = min(length, chunk_size - filled)
                    sizes.append(first)
                    parents.append(chunk)
                    length -= first
            whole, rest = divmod(length, chunk_size)
            pieces = [chunk_size] * whole + ([rest] if rest else [])
            sizes += pieces
            parents += [-1] * len(pieces)
            if parent < 0:
                last_chunk[index] = (len(sizes) - 1, pieces[-1])
        return PackedSeqInfo(
            torch.tensor(sizes, dtype=torch.int32),
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            seq_parents=torch.tensor(parents, dtype=torch.int64),
        )


def _is_2d_mask(attention_mask: Any) -> bool:
    """Whether ``attention_mask`` is a ``(B, T)`` padding mask (not a prepared 4D mask, nor a dict of masks by layer
    type as ``generate`` passes with a static cache)."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2


def hides_nothing(attention_mask: Any) -> bool:
    """Whether ``attention_mask`` is absent, a 2D mask of ones (a padding-free batch that carries one anyway), or a
    mapping of masks by layer type that are all absent (what an outer multimodal model built through the mask
    functions inside a packed forward, which return ``None``: Gemma 3 builds its text model's masks itself)."""
    if attention_mask is None:
        return True
    if isinstance(attention_mask, dict):
        return all(mask is None for mask in attention_mask.values())
    return _is_2d_mask(attention_mask) and bool(attention_mask.bool().all())


def text_positions(position_ids: Any) -> Any:
    """The row of ``position_ids`` that numbers the tokens of each sample as text: ``position_ids`` itself when it is
    ``(B, T)`` (or ``(T,)``); for multi-axis positions ``(rows, B, T)`` (Qwen2-VL's multimodal RoPE), the text row
    ``position_ids[0]`` of the 4-row layout ``[text; t; h; w]`` its text models take, and ``None`` for 3 rows
    ``[t; h; w]`` (no text row: transformers' models do not find packed samples in them either)."""
    if position_ids is None or position_ids.dim() < 3:
        return position_ids
    return position_ids[0] if position_ids.shape[0] == 4 else None


def detect_packed(
    batch_size: int,
    seq_len: int,
    *,
    packed_seq_lengths: torch.Tensor | None = None,
    packed_seq_parents: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: Any = None,
    cached: int = 0,
    packed_seq_info: PackedSeqInfo | None = None,
) -> PackedSeqInfo | None:
    """The one detector of a packed batch: its metadata, or ``None`` when the batch is not packed.

    The keyword arguments are the batch's keys of the same names. A batch of ``batch_size`` rows of ``seq_len`` tokens
    is packed when it carries packing metadata (``packed_seq_lengths`` ``(num_seqs,)`` int, else ``cu_seq_lens_q``
    ``(num_seqs + 1,)`` int32, zero-prefixed), or when ``position_ids`` ``(B, T)`` or ``(1, T)`` int restart inside a
    row and the batch has more than one token, no ``cached`` tokens before it and no ``attention_mask`` (or a
    ``(B, T)`` one of all ones; a 4D mask counts as one that hides tokens). With metadata the mask is not looked at
    (the caller checks it); the collator's ``cu_seq_lens_q`` and ``max_length_q`` are adopted, not derived again
    (:meth:`PackedSeqInfo.from_seq_lengths`). Multi-axis ``position_ids`` ``(rows, B, T)`` are read by their text row
    (:func:`text_positions`). ``packed_seq_parents`` ``(num_seqs,)`` int (with ``packed_seq_lengths``
    only): for each sample, -1 or the index of the earlier sample whose prefix it continues (branched segments, e.g.
    a DPO prompt with its chosen and rejected completions).

    ``packed_seq_info``: the batch's :class:`PackedSeqInfo`, built with the batch on the host (the collator's
    ``packed_seq_info`` key, see :func:`carried_info`): adopted as it is after checking its shape against the batch,
    and the other metadata keys are not read (on a GPU they are device copies: reading them would wait for the
    device).

    The decoder hook (:mod:`unpack_trainer.models.packed_forward`, once per forward) and a direct call of the packed
    attention helper (:func:`unpack_trainer.patches.attention.packed_attention_forward` without the hook) both decide
    with it.
    """
    if packed_seq_info is not None:
        return carried_info(packed_seq_info, batch_size, seq_len)
    if packed_seq_lengths is not None:
        return PackedSeqInfo.from_seq_lengths(
            packed_seq_lengths,
            batch_size=batch_size,
            seq_len=seq_len,
            seq_parents=packed_seq_parents,
            cu_seqlens=cu_seq_lens_q,
            max_seqlen=max_length_q,
        )
    if cu_seq_lens_q is not None:
        return PackedSeqInfo.from_cu_seqlens(
            cu_seq_lens_q, batch_size=batch_size, seq_len=seq_len, max_seqlen=max_length_q
        )
    position_ids = text_positions(position_ids)
    if position_ids is None or seq_len <= 1 or cached or not hides_nothing(attention_mask):
        return None
    if position_ids.shape[0] != batch_size:
        position_ids = position_ids.expand(batch_size, -1)
    return PackedSeqInfo.from_position_ids(position_ids)


def carried_info(info: Any, batch_size: int, seq_len: int) -> PackedSeqInfo:
    """``info``, a batch's own :class:`PackedSeqInfo` (its ``packed_seq_info`` key: built with the batch on the host
    by the collator, so that no forward reads the metadata back from the device), checked against the batch's shape
    ``(batch_size, seq_len)``: the same rows, or, for metadata of whole rows cut into ``info.sequence_shards`` pieces
    (sequence parallelism), rows of ``seq_len * sequence_shards`` tokens (the forward embeds one piece; its attention
    gets the whole rows); ``ValueError`` naming the key otherwise."""
    if not isinstance(info, PackedSeqInfo):
        raise ValueError(f"`{INFO_KEY}` must be a PackedSeqInfo or None, got {type(info).__name__}.")
    if info.sequence_shards > 1 and (info.batch_size, info.seq_len) == (batch_size, seq_len * info.sequence_shards):
        return info  # one shard of these rows (sequence parallelism): attention gets the whole rows
    if (info.batch_size, info.seq_len) != (batch_size, seq_len):
        raise ValueError(
            f"`{INFO_KEY}` describes {info.batch_size} row(s) of {info.seq_len} tokens but the batch has {batch_size} "
            f"row(s) of {seq_len}."
        )
    return info
