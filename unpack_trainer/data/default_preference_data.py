"""The embedded preference set: (prompt, chosen, rejected) triples made from the shipped instruction data.

Stage 1 of the data path (read), beside [`unpack_trainer.data.default_data`]: the source that needs no file of yours;
public as ``unpack_trainer.load_default_preference_dataset``.

Every record of [`unpack_trainer.data.default_data`] (learnable tasks with one right answer: arithmetic, sorting,
reversing, rewriting short stories, ...) gives one pair, with no download:

- ``prompt``: the record's prompt; ``chosen``: its right answer (the record's completion);
- ``rejected``: a near miss, the right answer with one seeded edit, so that a model must read the prompt to tell them
  apart: two different words swapped (answers of two or more words); else one digit changed (``d -> (d + 1) % 10``,
  the last digit); else the answer's characters reversed; else (a one-character answer with no digit) the character
  repeated. The rejected answer is never equal to the chosen one. Pairs therefore often share the start of their
  completions, as real preference data does.

Example:
    >>> from unpack_trainer import load_default_preference_dataset
    >>> pairs = load_default_preference_dataset("train")  # columns: prompt, chosen, rejected (4,000 pairs)
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from unpack_trainer.data.default_data import DEFAULT_SEED, load_default_records

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset

__all__ = ["load_default_preference_dataset", "near_miss"]


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer of the same form as ``answer`` (see the module docstring); never equal to ``answer``.

    Example::

        >>> near_miss("ant bee cat", random.Random(0)) != "ant bee cat"
        True
        >>> near_miss("841", random.Random(0))
        '842'
    """
    words = answer.split(" ")
    distinct = sorted({word for word in words})
    if len(distinct) >= 2:
        first, second = rng.sample(range(len(words)), 2)
        while words[first] == words[second]:
            first, second = rng.sample(range(len(words)), 2)
        words[first], words[second] = words[second], words[first]
        return " ".join(words)
    digits = [i for i, char in enumerate(answer) if char.isdigit()]
    if digits:
        i = digits[-1]
        return answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1 :]
    if answer[::-1] != answer:
        return answer[::-1]
    return answer + answer[-1:] if answer else "?"


def load_default_preference_dataset(
    split: str = "train", *, conversational: bool = False, seed: int = DEFAULT_SEED
) -> Dataset:
    """The embedded preference set of ``split`` (``"train"``: 4,000 pairs, ``"eval"``: 200 held-out pairs).

    Args:
        split: ``"train"`` or ``"eval"`` (the instruction data's splits; no prompt appears in both).
        conversational: ``False``: TRL's standard preference format, ``prompt`` / ``chosen`` / ``rejected`` strings.
            ``True``: TRL's conversational format, ``prompt`` ``[{"role": "user", ...}]`` (trailing newline removed)
            and ``chosen`` / ``rejected`` ``[{"role": "assistant", ...}]``.
        seed: seeds the edits that make the rejected answers (the same seed gives the same set).

    Returns:
        A ``Dataset`` with the columns ``prompt``, ``chosen`` and ``rejected``.
    """
    from datasets import Dataset

    rng = random.Random(f"{seed}-{split}")
    records = load_default_records(split)
    prompts = [r["prompt"] for r in records]
    chosen = [r["completion"] for r in records]
    rejected = [near_miss(answer, rng) for answer in chosen]
    if conversational:
        prompts = [[{"role": "user", "content": p.rstrip("\n")}] for p in prompts]
        chosen = [[{"role": "assistant", "content": c}] for c in chosen]
        rejected = [[{"role": "assistant", "content": r}] for r in rejected]
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
