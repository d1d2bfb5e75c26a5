"""The embedded default: a small instruction dataset, a local tokenizer and a tiny Llama config.

Stage 1 of the data path (read), the source that needs no file of yours; public as
``unpack_trainer.load_default_dataset`` / ``load_default_tokenizer`` / ``tiny_model_config``.

Everything needed for a first fine-tune on a laptop CPU with no download ships inside the package, under
``unpack_trainer/data/``:

- ``train.jsonl.gz`` / ``eval.jsonl.gz``: prompt/completion pairs of learnable tasks (arithmetic, running sums,
  number sequences, reversing, sorting, counting, copying and rewriting words and short stories). Lengths spread from
  10 to about 1,600 tokens with a long tail (median about 60, mean about 115, 1 % over 1,000): the spread is what
  makes padding wasteful and packing worthwhile; ``unpack-trainer analyze`` shows it.
  Every prompt ends with a newline and every completion is the bare answer (TRL appends the EOS token).
- ``tokenizer.json``: a byte-level BPE tokenizer (796 tokens) trained on that data with
  ``tokenizers``; digits are split one per token. [`load_default_tokenizer`] wraps it as a
  ``transformers.PreTrainedTokenizerFast`` with BOS/EOS/PAD tokens and a chat template (with ``{% generation %}``
  markers, so ``assistant_only_loss=True`` works).

The files are produced by [`generate_default_dataset`] and [`train_default_tokenizer`]; regenerate them
byte-identically with::

    python -m unpack_trainer.data.default_data --write

Nothing happens at import time: the files are read, and ``datasets``/``transformers`` imported, only when a loader is
called.

Example:
    >>> from unpack_trainer import load_default_dataset, load_default_tokenizer, tiny_model_config
    >>> from transformers import LlamaForCausalLM
    >>> tokenizer = load_default_tokenizer()
    >>> model = LlamaForCausalLM(tiny_model_config(tokenizer))
    >>> train_dataset = load_default_dataset("train")  # columns: prompt, completion
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "DATA_DIR",
    "DEFAULT_EVAL_SIZE",
    "DEFAULT_SEED",
    "DEFAULT_TRAIN_SIZE",
    "SPLITS",
    "generate_default_dataset",
    "load_default_dataset",
    "load_default_records",
    "load_default_tokenizer",
    "tiny_model_config",
    "train_default_tokenizer",
    "write_default_files",
]

DATA_DIR = Path(__file__).resolve().parent
"""Directory holding the shipped files."""

DEFAULT_SEED = 0
DEFAULT_TRAIN_SIZE = 4000
DEFAULT_EVAL_SIZE = 200
SPLITS = ("train", "eval")
TOKENIZER_FILE = "tokenizer.json"
VOCAB_SIZE = 2048
"""Upper bound given to the BPE trainer; training stops earlier, when every word of the corpus is one token."""

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|eos|>{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Chat template of the default tokenizer.

Renders ``[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]`` as
``"<|bos|><|user|>\\nHi\\n<|assistant|>\\nHello<|eos|>"``. The prompt rendered with ``add_generation_prompt=True``
is a prefix of the full conversation, and the assistant turn (content and EOS) is wrapped in ``{% generation %}``.
"""

# Pre-tokenization: letters with an optional leading space, one digit per token, punctuation runs, whitespace runs.
_SPLIT_PATTERN = r" ?\p{L}+| ?\p{N}|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# --------------------------------------------------------------------------------------------------------------------
# Deterministic generator
# --------------------------------------------------------------------------------------------------------------------

_NOUNS = (
    "cat dog bird fish horse mouse rabbit fox wolf bear lion tiger frog duck goat sheep owl bee ant apple pear "
    "plum grape lemon melon bread cheese cake soup rice tea milk honey book pen cup box hat coat shoe ball kite drum "
    "bell lamp door table chair bed clock key ring boat train car bike river lake hill tree leaf stone cloud star "
    "moon sun road bridge house garden"
).split()
_ADJECTIVES = (
    "red blue green yellow black white small big tall short old young happy quiet loud fast slow warm cold soft "
    "bright dark round sweet brave calm"
).split()
_VERBS = (
    "saw found liked chased followed carried painted opened watched helped pushed pulled visited washed kept".split()
)
_PREPOSITIONS = ("near", "under", "behind", "beside", "above", "inside")
_WORDS = _NOUNS + _ADJECTIVES


class _Draw:
    """Random draws built only on ``random.Random.random()``, the one method whose output Python guarantees to stay
    the same across versions for a given integer seed, so the shipped files can be regenerated byte-identically."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def uniform(self) -> float:
        return self._rng.random()

    def integer(self, low: int, high: int) -> int:
        """Uniform integer in ``[low, high]`` (both inclusive)."""
        return low + int(self._rng.random() * (high - low + 1))

    def choice(self, items: Sequence[Any]) -> Any:
        return items[self.integer(0, len(items) - 1)]

    def chance(self, probability: float) -> bool:
        return self._rng.random() < probability

    def size(self, median: float, sigma: float, low: int, high: int) -> int:
        """Lognormal integer around ``median`` (Box-Muller), clipped to ``[low, high]``."""
        u1 = 1.0 - self._rng.random()  # in (0, 1], so the log is finite
        u2 = self._rng.random()
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        return min(high, max(low, int(median * math.exp(sigma * z) + 0.5)))

    def number(self, max_digits: int) -> int:
        """An integer with 1 to ``max_digits`` digits, the number of digits uniform."""
        digits = self.integer(1, max_digits)
        return self.integer(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _sentence(draw: _Draw) -> str:
    words = ["the"]
    if draw.chance(0.5):
        words.append(draw.choice(_ADJECTIVES))
    words += [draw.choice(_NOUNS), draw.choice(_VERBS), "the"]
    if draw.chance(0.5):
        words.append(draw.choice(_ADJECTIVES))
    words.append(draw.choice(_NOUNS))
    if draw.chance(0.3):
        words += [draw.choice(_PREPOSITIONS), "the", draw.choice(_NOUNS)]
    return " ".join(words).capitalize() + "."


def _story(draw: _Draw, num_words: int) -> str:
    """Sentences of a tiny grammar, about ``num_words`` words in all (at least one sentence)."""
    sentences, count = [], 0
    while count < num_words:
        sentence = _sentence(draw)
        sentences.append(sentence)
        count += sentence.count(" ") + 1
    return " ".join(sentences)


def _word_list(draw: _Draw, num_words: int) -> list[str]:
    return [draw.choice(_WORDS) for _ in range(num_words)]


def _arithmetic(draw: _Draw) -> tuple[str, str]:
    op = draw.choice("+-*")
    if op == "*":
        a, b = draw.number(3), draw.number(2)
        return f"What is {a} * {b}?\n", str(a * b)
    a, b = draw.number(4), draw.number(4)
    return f"What is {a} {op} {b}?\n", str(a + b if op == "+" else a - b)


def _running_sum(draw: _Draw) -> tuple[str, str]:
    numbers = [draw.number(2) for _ in range(draw.size(10, 0.9, 2, 150))]
    totals, total = [], 0
    for value in numbers:
        total += value
        totals.append(str(total))
    prompt = "Add up these numbers, writing the running total after each one: " + ", ".join(map(str, numbers))
    return prompt + "\n", ", ".join(totals) + f". The total is {total}."


def _sequence(draw: _Draw) -> tuple[str, str]:
    start, step = draw.number(3), draw.integer(1, 25)
    shown, asked = draw.integer(3, 6), draw.size(8, 1.0, 2, 200)
    values = [start + step * i for i in range(shown + asked)]
    prompt = f"Continue the sequence with the next {asked} numbers: " + ", ".join(map(str, values[:shown]))
    return prompt + "\n", ", ".join(map(str, values[shown:]))


def _largest(draw: _Draw) -> tuple[str, str]:
    numbers = [draw.number(4) for _ in range(draw.size(10, 0.9, 2, 200))]
    return "Which number is the largest: " + ", ".join(map(str, numbers)) + "?\n", str(max(numbers))


def _reverse(draw: _Draw) -> tuple[str, str]:
    words = _word_list(draw, draw.size(24, 1.1, 2, 500))
    return "Reverse the order of these words: " + " ".join(words) + "\n", " ".join(reversed(words))


def _sort(draw: _Draw) -> tuple[str, str]:
    words = _word_list(draw, draw.size(20, 1.1, 2, 500))
    return "Sort these words alphabetically: " + " ".join(words) + "\n", " ".join(sorted(words))


def _count_words(draw: _Draw) -> tuple[str, str]:
    words = _word_list(draw, draw.size(20, 1.0, 1, 400))
    return "How many words are in this list: " + " ".join(words) + "\n", str(len(words))


def _first_letters(draw: _Draw) -> tuple[str, str]:
    words = _word_list(draw, draw.size(15, 1.0, 1, 300))
    return "Write the first letter of each word: " + " ".join(words) + "\n", " ".join(w[0] for w in words)


def _count_word(draw: _Draw) -> tuple[str, str]:
    story = _story(draw, draw.size(90, 1.1, 8, 1200))
    words = [w.strip(".").lower() for w in story.split()]
    nouns = [w for w in words if w in _NOUNS]
    target = draw.choice(nouns) if draw.chance(0.85) else draw.choice(_NOUNS)
    prompt = f'How many times does the word "{target}" appear in the text below?\n\n{story}\n'
    return prompt, str(words.count(target))


def _copy(draw: _Draw) -> tuple[str, str]:
    story = _story(draw, draw.size(60, 1.1, 4, 700))
    return f"Copy the text below exactly.\n\n{story}\n", story


def _replace(draw: _Draw) -> tuple[str, str]:
    story = _story(draw, draw.size(50, 1.1, 4, 700))
    present = [w.strip(".") for w in story.lower().split() if w.strip(".") in _NOUNS]
    old = draw.choice(present)
    new = draw.choice([noun for noun in _NOUNS if noun not in present])
    rewritten = " ".join(_swap_word(word, old, new) for word in story.split(" "))
    return f'Rewrite the text below with every "{old}" replaced by "{new}".\n\n{story}\n', rewritten


def _swap_word(word: str, old: str, new: str) -> str:
    stem, dot = (word[:-1], ".") if word.endswith(".") else (word, "")
    if stem == old:
        return new + dot
    if stem == old.capitalize():  # nouns never start a sentence in this grammar, kept for safety
        return new.capitalize() + dot
    return word


_TASKS: tuple[tuple[str, float, Callable[[_Draw], tuple[str, str]]], ...] = (
    ("arithmetic", 0.14, _arithmetic),
    ("running_sum", 0.08, _running_sum),
    ("sequence", 0.08, _sequence),
    ("largest", 0.05, _largest),
    ("reverse", 0.12, _reverse),
    ("sort", 0.11, _sort),
    ("count_words", 0.07, _count_words),
    ("first_letters", 0.07, _first_letters),
    ("count_word", 0.10, _count_word),
    ("copy", 0.10, _copy),
    ("replace", 0.08, _replace),
)
TASK_NAMES = tuple(name for name, _, _ in _TASKS)


def generate_default_dataset(seed: int = DEFAULT_SEED, n: int = DEFAULT_TRAIN_SIZE + DEFAULT_EVAL_SIZE) -> list[dict]:
    """Generate ``n`` distinct prompt/completion pairs of learnable tasks, deterministically from ``seed``.

    The same ``(seed, n)`` gives the same records on every platform and Python version (only
    ``random.Random(seed).random()`` is used, whose sequence Python guarantees), and the first ``k`` records of
    ``generate_default_dataset(seed, n)`` are those of ``generate_default_dataset(seed, k)``. Prompts are unique, so
    any split of the output is disjoint.

    Args:
        seed: integer seed.
        n: number of records, ``>= 0``.

    Returns:
        A list of ``{"task": str, "prompt": str, "completion": str}``. ``task`` is one of ``TASK_NAMES``; the prompt
        ends with ``"\\n"``; the completion is the bare answer, without EOS.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"`seed` must be an int, got {seed!r}.")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"`n` must be a non-negative int, got {n!r}.")
    draw = _Draw(seed)
    total_weight = sum(weight for _, weight, _ in _TASKS)
    records: list[dict] = []
    seen: set[str] = set()
    while len(records) < n:
        pick, cumulative = draw.uniform() * total_weight, 0.0
        for name, weight, make in _TASKS:  # noqa: B007 - the loop variables are used after the break
            cumulative += weight
            if pick < cumulative:
                break
        prompt, completion = make(draw)
        if prompt in seen:
            continue
        seen.add(prompt)
        records.append({"task": name, "prompt": prompt, "completion": completion})
    return records


def _split_records(records: list[dict], eval_size: int) -> dict[str, list[dict]]:
    return {"train": records[: len(records) - eval_size], "eval": records[len(records) - eval_size :]}


def _tokenizer_corpus(records: Iterable[dict]) -> Iterable[str]:
    for record in records:
        yield record["prompt"] + record["completion"]


def train_default_tokenizer(records: Iterable[dict], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the default byte-level BPE tokenizer on ``records`` (dicts with ``prompt`` and ``completion``).

    Special tokens, ids 0-5: ``<|pad|> <|bos|> <|eos|> <|system|> <|user|> <|assistant|>``. Encoding adds
    ``<|bos|>`` in front (``add_special_tokens=True``); decoding gives back the exact text. Digits are split one per
    token; words keep their leading space (GPT-2 style).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(records), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def _jsonl_gz_bytes(records: Iterable[dict]) -> bytes:
    """Records as gzip-compressed JSON lines, with a zero timestamp and no file name so the bytes are reproducible."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as stream:
        for record in records:
            line = json.dumps({"prompt": record["prompt"], "completion": record["completion"]}, ensure_ascii=False)
            stream.write(line.encode("utf-8") + b"\n")
    return buffer.getvalue()


def _default_file_contents(
    seed: int = DEFAULT_SEED, train_size: int = DEFAULT_TRAIN_SIZE, eval_size: int = DEFAULT_EVAL_SIZE
) -> dict[str, bytes]:
    """The bytes of every shipped file, keyed by file name."""
    records = generate_default_dataset(seed, train_size + eval_size)
    contents = {
        f"{split}.jsonl.gz": _jsonl_gz_bytes(part) for split, part in _split_records(records, eval_size).items()
    }
    contents[TOKENIZER_FILE] = train_default_tokenizer(records).to_str(pretty=True).encode("utf-8") + b"\n"
    return contents


def write_default_files(directory: str | Path = DATA_DIR, *, seed: int = DEFAULT_SEED) -> list[Path]:
    """(Re)generate the shipped files into ``directory``; returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in _default_file_contents(seed).items():
        path = directory / name
        path.write_bytes(content)
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------------------------------


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r} for the default dataset; use one of {SPLITS}.")
    return split


def load_default_records(split: str = "train") -> list[dict[str, str]]:
    """The shipped records of ``split`` (``"train"``, 4,000 records, or ``"eval"``, 200 held-out records) as a list of
    ``{"prompt": str, "completion": str}``, read with the standard library only."""
    path = DATA_DIR / f"{_check_split(split)}.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as stream:
        return [json.loads(line) for line in stream if line.strip()]


def load_default_dataset(split: str = "train", *, conversational: bool = False) -> Dataset:
    """The embedded default dataset as an in-memory ``datasets.Dataset`` (no cache files are written).

    Args:
        split: ``"train"`` (4,000 records) or ``"eval"`` (200 held-out records; no prompt appears in both).
        conversational: ``False`` gives TRL's standard prompt-completion format, ``prompt`` and ``completion``
            strings. ``True`` gives TRL's conversational prompt-completion format: ``prompt`` is
            ``[{"role": "user", "content": ...}]`` and ``completion`` is ``[{"role": "assistant", "content": ...}]``
            (the prompt's trailing newline removed), to be rendered by the tokenizer's chat template.

    Returns:
        A ``Dataset`` with the columns ``prompt`` and ``completion``.
    """
    from datasets import Dataset

    records = load_default_records(split)
    if conversational:
        prompts = [[{"role": "user", "content": r["prompt"].rstrip("\n")}] for r in records]
        completions = [[{"role": "assistant", "content": r["completion"]}] for r in records]
    else:
        prompts = [r["prompt"] for r in records]
        completions = [r["completion"] for r in records]
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def load_default_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded tokenizer as a ``PreTrainedTokenizerFast``.

    ``bos_token`` ``<|bos|>`` (added in front by ``tokenizer(text)``), ``eos_token`` ``<|eos|>``, ``pad_token``
    ``<|pad|>`` (id 0), right padding, ``model_max_length`` 4096 and [`CHAT_TEMPLATE`]. Works with TRL's
    ``SFTTrainer`` for prompt-completion, language-modeling and conversational (``messages``) data.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(DATA_DIR / TOKENIZER_FILE),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        padding_side="right",
    )


def tiny_model_config(tokenizer: Any, **overrides: Any) -> LlamaConfig:
    """A tiny Llama for CPU fine-tuning on the default data: about 0.4M parameters with the default tokenizer.

    Hidden size 128, 2 layers, 4 attention heads and 2 key/value heads (grouped-query attention, head_dim 32), MLP
    256, 4,096 positions, tied embeddings; vocabulary size and special token ids taken from ``tokenizer``. Small
    enough that a few hundred training steps of a couple of thousand tokens each take minutes on a laptop CPU, large
    enough (two layers can form induction heads) to learn the copying and reversing tasks.

    Args:
        tokenizer: a tokenizer with ``len()``, ``pad_token_id``, ``bos_token_id`` and ``eos_token_id``.
        **overrides: any ``LlamaConfig`` argument, replacing the defaults above (e.g. ``num_hidden_layers=4``).

    Returns:
        A ``transformers.LlamaConfig``; build the model with ``LlamaForCausalLM(config)``.
    """
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unpack_trainer.data.default_data",
        description="Regenerate (--write) or verify (--check) the embedded default dataset and tokenizer.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="write the files (default: into the package)")
    action.add_argument("--check", action="store_true", help="exit 1 if the shipped files differ from a regeneration")
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="directory for --write (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.write:
        for path in write_default_files(args.out):
            print(f"wrote {path} ({path.stat().st_size:,} bytes)")
        return 0
    stale = [
        name
        for name, content in _default_file_contents().items()
        if not _same_content(name, _read_content(DATA_DIR / name), content)
    ]
    for name in stale:
        print(f"{DATA_DIR / name} differs from a regeneration; run with --write", file=sys.stderr)
    if not stale:
        print(f"the files in {DATA_DIR} match a regeneration")
    return 1 if stale else 0


def _read_content(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def _same_content(name: str, shipped: bytes | None, regenerated: bytes) -> bool:
    """Compare gzip files by their decompressed bytes: another zlib build may compress the same data differently."""
    if shipped is None:
        return False
    if name.endswith(".gz"):
        return gzip.decompress(shipped) == gzip.decompress(regenerated)
    return shipped == regenerated


if __name__ == "__main__":
    sys.exit(_main())
