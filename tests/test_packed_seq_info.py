"""PackedSeqInfo and the per-sample helpers of unpack_trainer/packed_seq_info.py, against small hand-written tensors."""

import copy
import pickle
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unpack_trainer.packed_seq_info import PackedSeqInfo, restart_positions, zero_prefixed_cumsum

# ---------------------------------------------------------------------------------------------------------------------
# PackedSeqInfo (moved from tests/patches/test_attention.py with the class)
# ---------------------------------------------------------------------------------------------------------------------


def test_hand_example():
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2]), batch_size=1, seq_len=5)
    assert info.seq_lengths.dtype == torch.int32 and info.seq_lengths.tolist() == [3, 2]
    assert info.cu_seqlens.dtype == torch.int32 and info.cu_seqlens.tolist() == [0, 3, 5]
    assert info.max_seqlen == 3 and isinstance(info.max_seqlen, int)
    assert info.num_seqs == 2 and info.total_tokens == 5
    same = PackedSeqInfo.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    assert same.seq_lengths.tolist() == [3, 2]
    from_cu = PackedSeqInfo.from_cu_seqlens(torch.tensor([0, 3, 5], dtype=torch.int32), batch_size=1, seq_len=5)
    assert from_cu.seq_lengths.tolist() == [3, 2]


def test_from_position_ids():
    assert PackedSeqInfo.from_position_ids(torch.tensor([[0, 1, 2, 3]])) is None  # one sample: not packed
    assert PackedSeqInfo.from_position_ids(torch.tensor([[0, 1, 2], [0, 1, 2]])) is None
    info = PackedSeqInfo.from_position_ids(torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]))
    assert info.seq_lengths.tolist() == [2, 2, 4] and (info.batch_size, info.seq_len) == (2, 4)
    # A row that does not start at 0 still starts a sample; a jump that is not +1 starts one too.
    info = PackedSeqInfo.from_position_ids(torch.tensor([[5, 6, 0, 0, 1, 7]]))
    assert info.seq_lengths.tolist() == [2, 1, 2, 1]


@pytest.mark.parametrize(
    ("lengths", "batch_size", "seq_len", "message"),
    [
        ([3, 0, 2], 1, 5, "Packed sample 1 has length 0"),
        ([3, 2], 1, 6, "sum to 5 tokens but the batch has 1 row"),
        ([3, 2, 3], 2, 4, "Packed sample 1 crosses the boundary between rows 0 and 1"),
        ([], 1, 0, "no samples"),
    ],
)
def test_bad_metadata_is_a_clear_error(lengths, batch_size, seq_len, message):
    with pytest.raises(ValueError, match=message):
        PackedSeqInfo.from_seq_lengths(
            torch.tensor(lengths, dtype=torch.int32), batch_size=batch_size, seq_len=seq_len
        )


def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match="zero-prefixed"):
        PackedSeqInfo.from_cu_seqlens(torch.tensor([1, 3, 5]), batch_size=1, seq_len=5)


# ---------------------------------------------------------------------------------------------------------------------
# restart_positions / zero_prefixed_cumsum / PackedSeqInfo.position_ids
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        ([3, 2], [0, 1, 2, 0, 1]),
        ([1, 1, 1], [0, 0, 0]),
        ([4], [0, 1, 2, 3]),
        ([2, 1, 3], [0, 1, 0, 0, 1, 2]),
    ],
)
def test_restart_positions_hand_examples(lengths, expected):
    for dtype in (torch.int32, torch.int64):
        positions = restart_positions(torch.tensor(lengths, dtype=dtype))
        assert positions.dtype == torch.int64
        assert positions.tolist() == expected


def test_restart_positions_uses_the_given_cu_seqlens():
    lengths = torch.tensor([3, 2], dtype=torch.int32)
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert restart_positions(lengths, cu_seqlens).tolist() == [0, 1, 2, 0, 1]


def test_zero_prefixed_cumsum_keeps_the_dtype():
    for dtype in (torch.int32, torch.int64):
        cu_seqlens = zero_prefixed_cumsum(torch.tensor([3, 2], dtype=dtype))
        assert cu_seqlens.dtype == dtype
        assert cu_seqlens.tolist() == [0, 3, 5]
    assert zero_prefixed_cumsum(torch.tensor([7], dtype=torch.int32)).tolist() == [0, 7]


def test_position_ids_of_two_rows():
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([2, 2, 4]), batch_size=2, seq_len=4)
    positions = info.position_ids()
    assert positions.dtype == torch.int64 and positions.device.type == "cpu"
    assert positions.tolist() == [[0, 1, 0, 1], [0, 1, 2, 3]]
    assert info.position_ids("cpu").tolist() == [[0, 1, 0, 1], [0, 1, 2, 3]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_restart_positions_round_trip_through_from_position_ids(lengths):
    """Positions restart exactly at the sample starts: reading the samples back from them gives the lengths."""
    positions = restart_positions(torch.tensor(lengths)).unsqueeze(0)
    info = PackedSeqInfo.from_position_ids(positions)
    if len(lengths) == 1:
        assert info is None
    else:
        assert info.seq_lengths.tolist() == lengths


# ---------------------------------------------------------------------------------------------------------------------
# PackedSeqInfo.plan: one cache per owner
# ---------------------------------------------------------------------------------------------------------------------


class Buckets(NamedTuple):
    device: str


class Masks(NamedTuple):
    device: str


def test_a_plan_is_built_once_per_key_and_kind():
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2]), batch_size=1, seq_len=5)
    builds = []

    def build(value):
        def make():
            builds.append(value)
            return value

        return make

    assert info.plans.get(Buckets("cpu"), build("a")) == "a"
    assert info.plans.get(Buckets("cpu"), build("b")) == "a"  # cached: not built again
    assert info.plans.get(Buckets("cuda"), build("c")) == "c"  # another key
    assert info.plans.get(Masks("cpu"), build("d")) == "d"  # another kind of plan, equal fields: its own entry
    assert builds == ["a", "c", "d"] and len(info.plans) == 3


def test_plans_are_per_batch_and_never_copied():
    first = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2]), batch_size=1, seq_len=5)
    second = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2]), batch_size=1, seq_len=5)
    assert first.plans.get(Buckets("cpu"), lambda: 1) == 1
    assert second.plans.get(Buckets("cpu"), lambda: 2) == 2
    for copied in (copy.copy(first), copy.deepcopy(first), pickle.loads(pickle.dumps(first))):
        assert len(copied.plans) == 0 and copied.plans.get(Buckets("cpu"), lambda: 3) == 3
    assert first.plans.get(Buckets("cpu"), lambda: 4) == 1


def test_bidirectional_spans_lie_inside_samples():
    """Spans (tokens attending both ways) are kept on a new object with their per-token ids; a span that is empty,
    overlaps another or crosses a sample boundary is an error naming it; branched samples keep their parents."""
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([5, 4]), batch_size=1, seq_len=9)
    assert info.with_bidirectional_spans(None) is info and info.bidirectional_spans is None
    spans = info.with_bidirectional_spans(torch.tensor([[1, 3], [5, 9]]))
    assert spans is not info and spans.cu_seqlens.tolist() == [0, 5, 9]
    assert spans.bidirectional_ids().tolist() == [-1, 0, 0, -1, -1, 1, 1, 1, 1]
    for bad, index in (([[3, 6]], 0), ([[1, 3], [2, 4]], 1), ([[2, 2]], 0)):
        with pytest.raises(ValueError, match=f"Bidirectional span {index} "):
            info.with_bidirectional_spans(torch.tensor(bad))
    branched = PackedSeqInfo(torch.tensor([2, 1]), batch_size=1, seq_len=3, seq_parents=torch.tensor([-1, 0]))
    spanned = branched.with_bidirectional_spans(torch.tensor([[0, 2]]))
    assert spanned.is_branched and spanned.seq_parents.tolist() == [-1, 0]
    with pytest.raises(ValueError, match="Bidirectional span 0 "):
        branched.with_bidirectional_spans(torch.tensor([[1, 3]]))  # across the prompt and its branch


def test_the_samples_without_their_spans_keep_their_branches():
    """The layers that do not apply image blocks (Gemma 4's full attention) run the samples without their
    bidirectional spans: on a branched row still branched (each completion continuing its prompt), whether the spans
    were added to this metadata or it came with them."""
    branched = PackedSeqInfo.from_seq_lengths(torch.tensor([4, 2, 3]), batch_size=1, seq_len=9)
    branched = PackedSeqInfo(branched.seq_lengths, batch_size=1, seq_len=9, seq_parents=torch.tensor([-1, 0, 0]))
    spanned = branched.with_bidirectional_spans(torch.tensor([[1, 3]]))
    assert spanned.without_bidirectional_spans() is branched  # the samples the spans were added to
    carried = spanned.with_bidirectional_spans(torch.tensor([[5, 6]]))  # spans on metadata that had some
    for causal in (spanned.without_bidirectional_spans(), carried.without_bidirectional_spans()):
        assert causal.bidirectional_spans is None
        assert causal.is_branched and torch.equal(causal.seq_parents, branched.seq_parents)
        assert torch.equal(causal.seq_lengths, branched.seq_lengths)


def test_metadata_derived_from_rows_cut_for_sequence_parallelism_keeps_the_cut():
    """Spans added to (or dropped from) the metadata of rows cut into shards describe the same rows: still cut."""
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([5, 3]), batch_size=1, seq_len=8).for_sequence_shards(2)
    spanned = info.with_bidirectional_spans(torch.tensor([[1, 3]]))
    assert spanned.sequence_shards == 2
    assert spanned.without_bidirectional_spans().sequence_shards == 2
