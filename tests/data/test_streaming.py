import gzip
import json
import logging
import pickle
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from unpack_trainer import DataCollatorForPacking, StreamingPacker, best_fit_decreasing, streaming_dataset_reader
from unpack_trainer.data import streaming as streaming_module
from unpack_trainer.data.preparation import pack_iterable_dataset


def _samples(lengths, *, labels=False):
    """Sample ``i`` has ``lengths[i]`` tokens ``i * 10_000 + position``, so every token names its sample and place."""
    samples = []
    for i, n in enumerate(lengths):
        sample = {"input_ids": [i * 10_000 + j for j in range(n)]}
        if labels:
            sample["labels"] = [-(i * 10_000 + j) for j in range(n)]
        samples.append(sample)
    return samples


def _split_row(row):
    """The samples of a row as ``(sample id, token list)``, checking every token belongs to the piece it is in."""
    pieces, offset = [], 0
    assert sum(row["seq_lengths"]) == len(row["input_ids"])
    for length in row["seq_lengths"]:
        tokens = row["input_ids"][offset : offset + length]
        offset += length
        assert length > 0
        pieces.append((tokens[0] // 10_000, tokens))
    return pieces


def _assert_every_sample_once(rows, lengths, capacity):
    seen = {}
    for row in rows:
        assert len(row["input_ids"]) <= capacity
        for sample_id, tokens in _split_row(row):
            assert sample_id not in seen, f"sample {sample_id} emitted twice"
            seen[sample_id] = tokens
    assert sorted(seen) == list(range(len(lengths))), "samples missing"
    for sample_id, tokens in seen.items():
        assert tokens == [sample_id * 10_000 + j for j in range(lengths[sample_id])]


def _lognormal(n, seed=0, median=40, capacity=256):
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), 0.8, n)), 1, capacity).astype(int).tolist()


# ------------------------------------------------------------------------------------------------- packing behaviour


@settings(max_examples=60, deadline=None)
@given(
    data=st.integers(1, 64).flatmap(
        lambda capacity: st.tuples(st.just(capacity), st.lists(st.integers(1, capacity), max_size=120))
    ),
    buffer_size=st.integers(1, 40),
    full_row_fill=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    max_hold_rounds=st.integers(0, 3),
    seed=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
)
def test_every_sample_exactly_once_in_order(data, buffer_size, full_row_fill, max_hold_rounds, seed):
    capacity, lengths = data
    packer = StreamingPacker(
        _samples(lengths, labels=True),
        capacity,
        buffer_size=buffer_size,
        seed=seed,
        full_row_fill=full_row_fill,
        max_hold_rounds=max_hold_rounds,
    )
    rows = list(packer)
    _assert_every_sample_once(rows, lengths, capacity)
    for row in rows:
        ids = [sample_id for sample_id, _ in _split_row(row)]
        assert ids == sorted(ids), "samples inside a row keep their reading order"
        assert row["labels"] == [-token for token in row["input_ids"]]
        assert set(row) == {"input_ids", "labels", "seq_lengths"}
    assert packer.stats["samples"] == len(lengths)
    assert packer.stats["rows"] == len(rows)
    assert packer.stats["tokens"] == sum(lengths)


def test_hand_example_holds_partial_rows_back():
    # capacity 8, buffer 4. Round 0 packs [5, 2, 6, 1] into [2, 6] (full) and [5, 1] (6/8, held back). Round 1 packs
    # [5, 1, 3, 2] into [5, 3] (full) and [1, 2] (held again). Round 2 has [1, 2, 4] (the stream ended): everything
    # left is emitted: [1, 2, 4] in one row.
    lengths = [5, 2, 6, 1, 3, 2, 4]
    rows = list(StreamingPacker(_samples(lengths), 8, buffer_size=4, full_row_fill=1.0, max_hold_rounds=2))
    assert [[sample_id for sample_id, _ in _split_row(row)] for row in rows] == [[1, 2], [0, 4], [3, 5, 6]]
    assert [row["seq_lengths"] for row in rows] == [[2, 6], [5, 3], [1, 2, 4]]


class _CountingRounds(StreamingPacker):
    """Counts, per sample, how many rounds it was in the buffer (1 = emitted in the round it was read)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds_seen = {}

    def select_samples_to_pack(self, samples):
        for sample in samples:
            sample_id = sample["input_ids"][0] // 10_000
            self.rounds_seen[sample_id] = self.rounds_seen.get(sample_id, 0) + 1
        return super().select_samples_to_pack(samples)


@pytest.mark.parametrize("max_hold_rounds", [0, 1, 2, 3])
def test_max_hold_rounds_bounds_the_delay(max_hold_rounds):
    # The 7 never finds a partner (every other sample is a 4, and 4 + 4 rows are full): without the bound it would be
    # held back until the end of the stream.
    lengths = [7] + [4] * 30
    packer = _CountingRounds(_samples(lengths), 8, buffer_size=6, full_row_fill=1.0, max_hold_rounds=max_hold_rounds)
    rows = list(packer)
    _assert_every_sample_once(rows, lengths, 8)
    assert max(packer.rounds_seen.values()) == packer.rounds_seen[0] == max_hold_rounds + 1


def test_held_back_samples_never_fill_more_than_half_the_buffer():
    class Recording(StreamingPacker):
        def select_samples_to_pack(self, samples):
            buffers.append(len(samples))
            return super().select_samples_to_pack(samples)

    buffers = []
    lengths = [5] * 40  # every row is 5/8: all of them would be held back
    packer = Recording(_samples(lengths), 8, buffer_size=10, full_row_fill=1.0, max_hold_rounds=100)
    _assert_every_sample_once(list(packer), lengths, 8)
    # each round reads at least half a buffer of new samples: 40 samples take at most 40 / 5 + 1 rounds
    assert len(buffers) <= 9


def test_holding_back_packs_tighter_than_packing_each_buffer_alone():
    lengths = _lognormal(6000, seed=1)
    capacity = 256

    def efficiency(**options):
        rows = list(StreamingPacker(_samples(lengths), capacity, buffer_size=200, **options))
        return sum(lengths) / (len(rows) * capacity)

    per_buffer = efficiency(full_row_fill=0.0)
    carried = efficiency()
    whole = sum(lengths) / (len(best_fit_decreasing(lengths, capacity)) * capacity)
    assert carried > per_buffer
    assert carried >= whole - 0.01


def test_deterministic_for_a_seed_and_shuffled_per_round():
    lengths = _lognormal(500, seed=2)
    run = lambda seed, epoch=0: _rows(StreamingPacker(_samples(lengths), 256, buffer_size=100, seed=seed), epoch)  # noqa: E731
    assert run(3) == run(3)
    assert run(3) != run(4)
    assert run(3, epoch=1) != run(3, epoch=0)
    assert sorted(map(_key, run(3))) == sorted(map(_key, run(None)))


def _rows(packer, epoch=0):
    packer.set_epoch(epoch)
    return list(packer)


def _key(row):
    return tuple(row["input_ids"])


# ------------------------------------------------------------------------------------------------- rows and hooks


def test_rows_feed_the_packed_collators():
    samples = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "text": "a"},
        {"input_ids": [4, 5], "text": "b"},  # no labels: trained on every token, as the collators read it
        {"input_ids": [6, 7, 8], "completion_mask": [1, 0, 1], "text": "c"},
    ]
    (row,) = list(StreamingPacker(samples, 8, buffer_size=3))
    assert row == {
        "input_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "seq_lengths": [3, 2, 3],
        "labels": [-100, 2, 3, 4, 5, 6, 7, 8],
        "completion_mask": [1, 1, 1, 1, 1, 1, 0, 1],
    }
    batch = DataCollatorForPacking(pad_token_id=0)([row])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, 8]]
    assert batch["packed_seq_lengths"].tolist() == [3, 2, 3]

    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    trl_batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([row])
    assert trl_batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert trl_batch["input_ids"].tolist() == [row["input_ids"]]


def test_custom_hooks_are_honoured_as_methods_and_callables():
    lengths = [3, 3, 3, 3, 3, 3, 3]

    def pairs_in_order(samples):
        return [samples[i : i + 2] for i in range(0, len(samples), 2)]

    def tagged(samples):
        return {"input_ids": [t for s in samples for t in s["input_ids"]], "n": len(samples)}

    class Pairs(StreamingPacker):
        def select_samples_to_pack(self, samples):
            return pairs_in_order(samples)

        def pack_selected_samples(self, samples):
            return tagged(samples)

    for packer in (
        Pairs(_samples(lengths), 8, buffer_size=4, full_row_fill=0.0),
        StreamingPacker(
            _samples(lengths),
            8,
            buffer_size=4,
            full_row_fill=0.0,
            select_samples_to_pack=pairs_in_order,
            pack_selected_samples=tagged,
        ),
    ):
        rows = list(packer)
        assert [row["n"] for row in rows] == [2, 2, 2, 1]
        assert [row["input_ids"][0] // 10_000 for row in rows] == [0, 2, 4, 6]


@pytest.mark.parametrize(
    "select, message",
    [
        (lambda samples: [samples[:1]], "left 3 of the 4 samples"),
        (lambda samples: [samples[:2], samples[:1]], "already returned"),
        (lambda samples: [[dict(s)] for s in samples], "not in the buffer"),
        (lambda samples: [samples[:3], samples[3:]], "put 9 tokens in row 0, more than max_length=8"),
        (lambda samples: [[], samples], "empty row"),
    ],
)
def test_bad_select_hook_is_a_clear_error(select, message):
    with pytest.raises(ValueError, match=message):
        list(StreamingPacker(_samples([3, 3, 3, 3]), 8, buffer_size=4, select_samples_to_pack=select))


def test_duplicate_sample_objects_are_each_packed():
    sample = {"input_ids": [1, 2]}
    rows = list(StreamingPacker([sample, sample, sample], 4, buffer_size=3))
    assert sum(len(row["seq_lengths"]) for row in rows) == 3


# ------------------------------------------------------------------------------------------------- bad input


def test_sample_longer_than_max_length_names_sample_and_limit():
    with pytest.raises(ValueError, match=r"Sample 2 of the stream has 9 tokens, more than max_length=8"):
        list(StreamingPacker(_samples([3, 4, 9, 1]), 8))


def test_truncate_and_split_are_counted_and_logged(caplog):
    lengths = [3, 20, 5]
    with caplog.at_level(logging.WARNING, logger="unpack_trainer.data.streaming"):
        packer = StreamingPacker(_samples(lengths, labels=True), 8, overflow="truncate")
        rows = list(packer)
    assert packer.stats["truncated"] == 1 and packer.stats["truncated_tokens"] == 12
    assert sorted(len(tokens) for row in rows for _, tokens in _split_row(row)) == [3, 5, 8]
    assert "1 sample(s) longer than max_length=8 were truncated, dropping 12 token(s)" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unpack_trainer.data.streaming"):
        packer = StreamingPacker(_samples(lengths, labels=True), 8, overflow="split")
        rows = list(packer)
    assert packer.stats["split"] == 1 and packer.stats["split_chunks"] == 3
    chunks = sorted(tokens for row in rows for sample_id, tokens in _split_row(row) if sample_id == 1)
    assert [t for chunk in chunks for t in chunk] == [10_000 + j for j in range(20)]
    assert all(row["labels"] == [-t for t in row["input_ids"]] for row in rows)
    assert "split into 3 chunks" in caplog.text


@pytest.mark.parametrize(
    "sample, message",
    [
        ({"input_ids": []}, "Sample 1 of the stream is empty"),
        ({"text": "hi"}, "Sample 1 of the stream has no `input_ids`"),
        ([1, 2], "Sample 1 of the stream is a list"),
        ({"input_ids": [1, 2], "labels": [1]}, "has 2 input_ids but 1 `labels`"),
        ({"input_ids": [1, 2], "attention_mask": [1, 0]}, "has padding"),
        ({"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}, "has 3 tokens but `seq_lengths` \\[1, 1\\]"),
    ],
)
def test_bad_samples_are_named(sample, message):
    with pytest.raises(ValueError, match=message):
        list(StreamingPacker([{"input_ids": [1]}, sample], 8))


def test_prepacked_samples_keep_their_boundaries_and_arrays_are_accepted():
    samples = [
        {"input_ids": np.array([1, 2, 3, 4]), "seq_lengths": [1, 3]},
        {"input_ids": torch.tensor([5, 6]), "labels": torch.tensor([-100, 6])},
    ]
    (row,) = list(StreamingPacker(samples, 8))
    assert row == {"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [1, 3, 2], "labels": [1, 2, 3, 4, -100, 6]}
    split = list(StreamingPacker([{"input_ids": list(range(6)), "seq_lengths": [2, 4]}], 4, overflow="split"))
    assert sorted(row["seq_lengths"] for row in split) == [[2], [2, 2]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_length": 0}, "max_length"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"overflow": "drop"}, "Unknown overflow policy"),
        ({"full_row_fill": 1.5}, "full_row_fill"),
        ({"max_hold_rounds": -1}, "max_hold_rounds"),
        ({"seed": -1}, "seed"),
        ({"rank": 0}, "both `rank` and `world_size`"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"token_fields": ["labels"]}, "token_fields"),
    ],
)
def test_bad_arguments(kwargs, message):
    options = {"max_length": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        StreamingPacker([], **options)


# ------------------------------------------------------------------------------------------------- exact resume


def _resume_at_every_cut(make_packer, cuts, *, roundtrip=pickle):
    expected = list(make_packer())
    for cut in cuts:
        packer = make_packer()
        iterator = iter(packer)
        head = [next(iterator) for _ in range(cut)]
        state = roundtrip.loads(roundtrip.dumps(packer.state_dict()))
        del iterator
        resumed = make_packer()
        resumed.load_state_dict(state)
        tail = list(resumed)
        assert head + tail == expected, f"resume after {cut} rows differs"
    return expected


def test_exact_resume_at_several_cut_points():
    lengths = _lognormal(1500, seed=3)
    samples = _samples(lengths, labels=True)
    make = lambda: StreamingPacker(samples, 256, buffer_size=300, seed=7, overflow="split")  # noqa: E731
    expected = list(make())
    num_rows = len(expected)
    # the start, inside the first round, later rounds, inside the final flush, the very end
    cuts = sorted({0, 1, 17, num_rows // 3, num_rows // 2 + 1, num_rows - 2, num_rows - 1, num_rows})
    _resume_at_every_cut(make, cuts)
    _assert_every_sample_once(expected, lengths, 256)


def test_resume_rejects_other_configuration_and_other_shard(monkeypatch):
    packer = StreamingPacker(_samples([3] * 20), 8, buffer_size=4)
    iterator = iter(packer)
    next(iterator)
    state = packer.state_dict()
    with pytest.raises(ValueError, match="buffer_size: saved 4, now 5"):
        StreamingPacker(_samples([3] * 20), 8, buffer_size=5).load_state_dict(state)
    with pytest.raises(ValueError, match="Not a StreamingPacker state"):
        packer.load_state_dict({"epoch": 0})
    other = StreamingPacker(_samples([3] * 20), 8, buffer_size=4)
    other.load_state_dict(state)
    monkeypatch.setattr(streaming_module, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))
    with pytest.raises(ValueError, match="saved by shard 0 of 1 but is loaded by shard 1 of 2"):
        list(other)


def test_per_worker_states_resume_each_shard_exactly(monkeypatch):
    lengths = _lognormal(600, seed=4)
    samples = _samples(lengths)
    rows = []
    for worker in (0, 1):
        monkeypatch.setattr(streaming_module, "get_worker_info", lambda w=worker: SimpleNamespace(id=w, num_workers=2))
        make = lambda: StreamingPacker(samples, 256, buffer_size=64, seed=1)  # noqa: E731
        rows += _resume_at_every_cut(make, [5, 30])
    _assert_every_sample_once(rows, lengths, 256)


def test_state_dict_before_iteration_and_after_the_end():
    samples = _samples([3, 4, 5])
    packer = StreamingPacker(samples, 8)
    fresh = packer.state_dict()
    rows = list(packer)
    done = packer.state_dict()
    again = StreamingPacker(samples, 8)
    again.load_state_dict(fresh)
    assert list(again) == rows
    again.load_state_dict(done)
    assert list(again) == []
    assert list(again) == rows  # a new pass starts over


class _ListSource:
    """A re-iterable source over ``items``; with ``stateful`` it has ``state_dict`` / ``load_state_dict`` (the
    position, like a streaming ``datasets.IterableDataset``). ``fail_at``: raise ``OSError`` when item ``fail_at`` is
    read, once (a disk or network error inside the source)."""

    def __init__(self, items, *, stateful=False, fail_at=None):
        self.items, self.fail_at, self.position, self._start = items, fail_at, 0, 0
        if stateful:
            self.state_dict = lambda: {"position": self.position}
            self.load_state_dict = lambda state: setattr(self, "_start", state["position"])

    def __iter__(self):
        self.position, self._start = self._start, 0
        while self.position < len(self.items):
            if self.position == self.fail_at:
                self.fail_at = None
                raise OSError("connection reset")
            self.position += 1
            yield self.items[self.position - 1]


class _FlakyPacker(StreamingPacker):
    """Raises from the ``hook`` hook on its ``fail_at``-th call."""

    def __init__(self, *args, hook=None, fail_at=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hook, self.fail_at, self.calls = hook, fail_at, 0

    def _maybe_fail(self, hook):
        if hook == self.hook:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError(f"{hook} failed")

    def select_samples_to_pack(self, samples):
        self._maybe_fail("select")
        return super().select_samples_to_pack(samples)

    def pack_selected_samples(self, samples):
        self._maybe_fail("pack")
        return super().pack_selected_samples(samples)


def _rows_until_error(packer, error, match):
    rows = []
    with pytest.raises(error, match=match):
        for row in packer:
            rows.append(row)
    return rows


@pytest.mark.parametrize("stateful", [False, True])
def test_state_after_a_rejected_sample_resumes_with_the_corrected_sample(stateful):
    """Issue 10 item 15: a sample rejected by overflow="error" was counted as read, so resuming skipped it."""
    lengths = _lognormal(120, seed=11, capacity=64)
    fixed = _samples(lengths)
    bad = list(fixed)
    bad[50] = {"input_ids": list(range(65))}
    make = lambda items: StreamingPacker(_ListSource(items, stateful=stateful), 64, buffer_size=16)  # noqa: E731
    expected = list(make(fixed))
    packer = make(bad)
    head = _rows_until_error(packer, ValueError, "Sample 50 of the stream has 65 tokens, more than max_length=64")
    state = pickle.loads(pickle.dumps(packer.state_dict()))
    resumed = make(fixed)
    resumed.load_state_dict(state)
    assert head + list(resumed) == expected
    _assert_every_sample_once(expected, lengths, 64)


@pytest.mark.parametrize("stateful", [False, True])
def test_state_after_a_source_error_resumes_exactly(stateful):
    lengths = _lognormal(120, seed=12, capacity=64)
    samples = _samples(lengths)
    expected = list(StreamingPacker(_ListSource(samples, stateful=stateful), 64, buffer_size=16))
    packer = StreamingPacker(_ListSource(samples, stateful=stateful, fail_at=37), 64, buffer_size=16)
    head = _rows_until_error(packer, OSError, "connection reset")
    resumed = StreamingPacker(_ListSource(samples, stateful=stateful), 64, buffer_size=16)
    resumed.load_state_dict(packer.state_dict())
    assert head + list(resumed) == expected


def test_rejected_sample_after_a_resume_from_a_datasets_source():
    """The source's position is remembered before each read; in a pass that has not read from a `datasets` source
    yet, its `state_dict()` is still the previous one, so the pass's starting point is used instead."""
    from datasets import Dataset

    lengths = _lognormal(90, seed=15, capacity=64)
    fixed = _samples(lengths)
    bad = list(fixed)
    bad[60] = {"input_ids": list(range(65))}
    fixed_source, bad_source = Dataset.from_list(fixed), Dataset.from_list(bad)
    make = lambda data: StreamingPacker(data.to_iterable_dataset(), 64, buffer_size=16)  # noqa: E731
    expected = list(make(fixed_source))
    failures = 0
    for cut in range(1, len(expected)):
        packer = make(bad_source)
        iterator = iter(packer)
        try:
            head = [next(iterator) for _ in range(cut)]
        except ValueError:
            break
        middle_packer = make(bad_source)
        middle_packer.load_state_dict(packer.state_dict())
        middle = _rows_until_error(middle_packer, ValueError, "Sample 60 of the stream has 65 tokens")
        failures += 1
        resumed = make(fixed_source)
        resumed.load_state_dict(middle_packer.state_dict())
        assert head + middle + list(resumed) == expected, f"cut {cut}"
    assert failures >= 2


def test_state_taken_right_after_a_resume_from_a_datasets_source():
    """A state taken while a resumed pass still yields rows it had pending (before reading from the source) must
    not record the `datasets` source's stale position."""
    from datasets import Dataset

    lengths = _lognormal(90, seed=16, capacity=64)
    source = Dataset.from_list(_samples(lengths))
    make = lambda: StreamingPacker(source.to_iterable_dataset(), 64, buffer_size=16)  # noqa: E731
    expected = list(make())
    for cut in range(1, len(expected) - 1):
        first = make()
        iterator = iter(first)
        head = [next(iterator) for _ in range(cut)]
        second = make()
        second.load_state_dict(first.state_dict())
        middle = [next(iter(second))]
        third = make()
        third.load_state_dict(second.state_dict())
        assert head + middle + list(third) == expected, f"cut {cut}"


@pytest.mark.parametrize("hook, fail_at", [("pack", 1), ("pack", 9), ("select", 2)])
def test_state_after_a_hook_error_resumes_exactly(hook, fail_at):
    """Issue 10 item 15: an exception inside a custom `pack_selected_samples` lost the row being built."""
    lengths = _lognormal(200, seed=13, capacity=64)
    samples = _samples(lengths, labels=True)
    make = lambda **kw: _FlakyPacker(samples, 64, buffer_size=32, seed=5, **kw)  # noqa: E731
    expected = list(make())
    packer = make(hook=hook, fail_at=fail_at)
    head = _rows_until_error(packer, RuntimeError, f"{hook} failed")
    resumed = make()
    resumed.load_state_dict(packer.state_dict())
    assert head + list(resumed) == expected
    _assert_every_sample_once(expected, lengths, 64)


def test_one_shot_iterator_cannot_be_read_twice():
    """Issue 10 item 15: a generator read for a second epoch silently yielded 0 rows."""
    packer = StreamingPacker((sample for sample in _samples([3, 4, 5])), 8)
    assert len(list(packer)) == 2
    with pytest.raises(ValueError, match="one-shot iterator.*already read.*re-iterable source"):
        list(packer)
    # a fresh generator resumes from a state (it is read from its start, skipping what was read)
    lengths = _lognormal(100, seed=14, capacity=64)
    expected = list(StreamingPacker(_samples(lengths), 64, buffer_size=16))
    packer = StreamingPacker(iter(_samples(lengths)), 64, buffer_size=16)
    iterator = iter(packer)
    head = [next(iterator) for _ in range(5)]
    resumed = StreamingPacker(iter(_samples(lengths)), 64, buffer_size=16)
    resumed.load_state_dict(packer.state_dict())
    assert head + list(resumed) == expected
    packer.load_state_dict(packer.state_dict())
    with pytest.raises(ValueError, match="one-shot iterator"):
        list(packer)


def test_load_state_dict_names_missing_keys():
    packer = StreamingPacker(_samples([3]), 8)
    state = packer.state_dict()
    del state["samples"], state["pending"]
    with pytest.raises(ValueError, match=r"lacks the keys \['pending', 'samples'\].*state_dict\(\)"):
        packer.load_state_dict(state)


# ------------------------------------------------------------------------------------------------- sharding


def test_dataloader_with_two_workers_packs_distinct_shards():
    lengths = _lognormal(800, seed=5)
    packer = StreamingPacker(_samples(lengths), 256, buffer_size=100, seed=0)
    loader = DataLoader(packer, batch_size=None, num_workers=2, collate_fn=lambda row: row)
    rows = list(loader)
    _assert_every_sample_once(rows, lengths, 256)
    # both workers did work: rows from samples of both parities
    parities = {sample_id % 2 for row in rows for sample_id, _ in _split_row(row)}
    assert parities == {0, 1}


def test_ranks_and_workers_together_cover_the_stream_once():
    lengths = _lognormal(500, seed=6)
    rows = []
    for rank in (0, 1):
        packer = StreamingPacker(_samples(lengths), 256, buffer_size=50, rank=rank, world_size=2)
        rows += list(DataLoader(packer, batch_size=None, num_workers=2, collate_fn=lambda row: row))
    _assert_every_sample_once(rows, lengths, 256)


def test_set_epoch_reaches_persistent_workers():
    lengths = _lognormal(300, seed=9)
    packer = StreamingPacker(_samples(lengths), 256, buffer_size=50, seed=0)
    loader = DataLoader(packer, batch_size=None, num_workers=1, persistent_workers=True, collate_fn=lambda row: row)
    for epoch in (0, 1, 0):
        packer.set_epoch(epoch)
        in_process = StreamingPacker(_samples(lengths), 256, buffer_size=50, seed=0)
        assert list(loader) == _rows(in_process, epoch)
    assert _rows(in_process, 0) != _rows(in_process, 1)


# ------------------------------------------------------------------------------------------------- `datasets` source


@pytest.fixture
def jsonl_shards(tmp_path):
    lengths = _lognormal(400, seed=7)
    samples = _samples(lengths)
    paths = []
    for shard in range(2):
        path = tmp_path / f"train-{shard}.jsonl"
        with open(path, "w") as handle:
            for i in range(shard * 200, (shard + 1) * 200):
                handle.write(json.dumps({"text": f"sample {i}", "n": lengths[i], "first": samples[i]["input_ids"][0]}))
                handle.write("\n")
        paths.append(str(path))
    return paths, lengths


def _tokenized_stream(paths):
    from datasets import load_dataset

    dataset = load_dataset("json", data_files=paths, split="train", streaming=True)
    # stand-in for tokenization: rebuild each sample's ids from the row
    return dataset.map(lambda row: {"input_ids": [row["first"] + j for j in range(row["n"])]})


def test_streaming_datasets_source_packs_and_resumes_exactly(jsonl_shards):
    paths, lengths = jsonl_shards
    make = lambda: pack_iterable_dataset(_tokenized_stream(paths), 256, buffer_size=64, seed=3)  # noqa: E731
    expected = _resume_at_every_cut(make, [1, 23, 60])
    _assert_every_sample_once(expected, lengths, 256)
    assert set(expected[0]) == {"input_ids", "seq_lengths"}


def test_streaming_datasets_source_with_two_workers(jsonl_shards):
    paths, lengths = jsonl_shards
    packer = StreamingPacker(_tokenized_stream(paths), 256, buffer_size=64)
    rows = list(DataLoader(packer, batch_size=None, num_workers=2, collate_fn=lambda row: row))
    _assert_every_sample_once(rows, lengths, 256)


def test_set_epoch_is_forwarded_and_reseeds_the_order(jsonl_shards):
    paths, _ = jsonl_shards
    dataset = _tokenized_stream(paths)
    packer = StreamingPacker(dataset, 256, buffer_size=64, seed=0)
    packer.set_epoch(3)
    assert dataset.epoch == 3


# ------------------------------------------------------------------------------------------------- file reader


@pytest.fixture
def data_files(tmp_path):
    rows = [{"text": f"row {i}", "n": i} for i in range(23)]
    (tmp_path / "a").mkdir()
    with open(tmp_path / "a" / "part-0.jsonl", "w") as handle:
        handle.writelines(json.dumps(row) + "\n" + ("\n" if i == 3 else "") for i, row in enumerate(rows[:10]))
    table = pa.Table.from_pylist(rows[10:17])
    pq.write_table(table, tmp_path / "a" / "part-1.parquet", row_group_size=3)
    # Arrow IPC stream format (what `datasets` caches) and IPC file format (Feather v2)
    with pa.OSFile(str(tmp_path / "part-2.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(pa.Table.from_pylist(rows[17:20]), max_chunksize=2)
    with pa.OSFile(str(tmp_path / "part-3.feather"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(pa.Table.from_pylist(rows[20:]), max_chunksize=2)
    return tmp_path, rows


def test_reader_reads_jsonl_parquet_and_arrow_in_batches(data_files):
    root, rows = data_files
    reader = streaming_dataset_reader(root, batch_size=4)
    names = [p.rsplit("/", 1)[-1] for p in reader.files]
    assert names == ["part-0.jsonl", "part-1.parquet", "part-2.arrow", "part-3.feather"]
    batches = list(reader)
    assert all(1 <= len(batch) <= 4 for batch in batches)
    assert [row for batch in batches for row in batch] == rows
    assert list(reader.rows()) == rows  # re-iterable
    assert [row for batch in streaming_dataset_reader(str(root / "**" / "*.parquet"), 100) for row in batch] == rows[
        10:17
    ]
    assert list(streaming_dataset_reader(root, 5, columns=["n"]).rows()) == [{"n": r["n"]} for r in rows]
    with gzip.open(root / "more.jsonl.gz", "wt") as handle:
        handle.write(json.dumps(rows[0]) + "\n")
    assert list(streaming_dataset_reader(root / "more.jsonl.gz").rows()) == rows[:1]


def test_reader_is_lazy_and_names_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)) + "{broken\n")
    batches = iter(streaming_dataset_reader(path, batch_size=4))
    assert next(batches) == [{"i": i} for i in range(4)]  # the broken line, further on, is not parsed yet
    with pytest.raises(ValueError, match=r"data.jsonl, line 11: not valid JSON"):
        list(batches)
    with pytest.raises(FileNotFoundError):
        streaming_dataset_reader(tmp_path / "missing-*.parquet")



@pytest.mark.parametrize("path", ["", "   ", [], ["data.jsonl", ""]])
def test_reader_rejects_an_empty_path(path):
    """An empty path (or an empty list of paths) is a bad argument, not a missing file."""
    with pytest.raises(ValueError, match=r"empty") as error:
        streaming_dataset_reader(path)
    assert not isinstance(error.value, FileNotFoundError)

def test_reader_resumes_at_a_row_and_at_a_batch(data_files):
    root, rows = data_files
    for cut in (0, 3, 10, 12, 20, 23):
        view = streaming_dataset_reader(root, batch_size=4).rows()
        iterator = iter(view)
        head = [next(iterator) for _ in range(cut)]
        resumed = streaming_dataset_reader(root, batch_size=4).rows()
        resumed.load_state_dict(view.state_dict())
        assert head + list(resumed) == rows
    reader = streaming_dataset_reader(root, batch_size=4)
    iterator = iter(reader)
    head = [next(iterator) for _ in range(4)]
    resumed = streaming_dataset_reader(root, batch_size=4)
    resumed.load_state_dict(reader.state_dict())
    assert [r for b in head for r in b] + [r for b in resumed for r in b] == rows


def test_packer_over_reader_rows_resumes_through_the_reader_state(tmp_path):
    lengths = _lognormal(300, seed=8)
    pq.write_table(pa.Table.from_pylist(_samples(lengths)), tmp_path / "train.parquet", row_group_size=50)
    make = lambda: StreamingPacker(streaming_dataset_reader(tmp_path, 32).rows(), 256, buffer_size=40)  # noqa: E731
    expected = _resume_at_every_cut(make, [2, 25])
    _assert_every_sample_once(expected, lengths, 256)
    packer = make()
    iterator = iter(packer)
    next(iterator)
    assert packer.state_dict()["source"]["row"] == 40  # repositioned by the reader, not by re-reading
