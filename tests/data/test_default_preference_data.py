"""The embedded preference set: one pair per shipped record, chosen = the record's answer, rejected a near miss."""

from __future__ import annotations

import random

import pytest

from unpack_trainer.data.default_data import load_default_records
from unpack_trainer.data.default_preference_data import load_default_preference_dataset, near_miss


@pytest.mark.parametrize(
    "answer, expected",
    [("841", "842"), ("19", "10"), ("abc", "cba"), ("x", "xx"), ("aa", "aaa")],
)
def test_near_miss_of_single_words(answer, expected):
    assert near_miss(answer, random.Random(0)) == expected


def test_near_miss_swaps_two_different_words():
    answer = "ant ant bee ant"
    missed = near_miss(answer, random.Random(3))
    assert missed != answer and sorted(missed.split()) == sorted(answer.split())


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_record_gives_one_pair(split):
    records = load_default_records(split)
    pairs = load_default_preference_dataset(split)
    assert pairs.column_names == ["prompt", "chosen", "rejected"]
    assert pairs["prompt"] == [r["prompt"] for r in records]
    assert pairs["chosen"] == [r["completion"] for r in records]
    assert all(c != r for c, r in zip(pairs["chosen"], pairs["rejected"]))
    assert load_default_preference_dataset(split)["rejected"] == pairs["rejected"]  # seeded


def test_conversational_pairs():
    plain = load_default_preference_dataset("eval")
    pairs = load_default_preference_dataset("eval", conversational=True)
    assert pairs[0]["prompt"] == [{"role": "user", "content": plain[0]["prompt"].rstrip("\n")}]
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": plain[0]["chosen"]}]
    assert pairs[0]["rejected"] == [{"role": "assistant", "content": plain[0]["rejected"]}]
