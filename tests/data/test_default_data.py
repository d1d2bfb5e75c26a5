"""The embedded default dataset, tokenizer and tiny model config."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from unpack_trainer.data import default_data
from unpack_trainer.data.default_data import (
    CHAT_TEMPLATE,
    DATA_DIR,
    DEFAULT_EVAL_SIZE,
    DEFAULT_TRAIN_SIZE,
    TASK_NAMES,
    generate_default_dataset,
    load_default_dataset,
    load_default_records,
    load_default_tokenizer,
    tiny_model_config,
    write_default_files,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def train_records():
    return load_default_records("train")


# --------------------------------------------------------------------------------------------------------------------
# Reproducibility of the shipped files
# --------------------------------------------------------------------------------------------------------------------


def test_write_reproduces_the_shipped_files(tmp_path):
    written = write_default_files(tmp_path)
    assert sorted(path.name for path in written) == ["eval.jsonl.gz", "tokenizer.json", "train.jsonl.gz"]
    for path in written:
        shipped = (DATA_DIR / path.name).read_bytes()
        regenerated = path.read_bytes()
        if path.name.endswith(".gz"):
            # zero mtime in the gzip header: the same data always gives the same bytes with the same zlib
            assert regenerated[4:8] == b"\0\0\0\0"
            assert gzip.decompress(regenerated) == gzip.decompress(shipped), path.name
        else:
            assert regenerated == shipped, path.name


def test_check_command_passes_on_the_shipped_files(capsys):
    assert default_data._main(["--check"]) == 0
    assert "match a regeneration" in capsys.readouterr().out


def test_generator_is_deterministic_and_prefix_stable():
    first = generate_default_dataset(seed=3, n=60)
    assert first == generate_default_dataset(seed=3, n=60)
    assert generate_default_dataset(seed=3, n=25) == first[:25]
    assert first != generate_default_dataset(seed=4, n=60)
    assert len({record["prompt"] for record in first}) == 60
    assert generate_default_dataset(seed=0, n=0) == []


@pytest.mark.parametrize(("seed", "n"), [(0, -1), (0, 2.5), ("0", 3), (True, 3)])
def test_generator_rejects_bad_arguments(seed, n):
    with pytest.raises(ValueError):
        generate_default_dataset(seed=seed, n=n)


def test_shipped_files_are_small():
    total = sum(path.stat().st_size for path in DATA_DIR.iterdir() if path.is_file())
    assert total < 2_000_000


# --------------------------------------------------------------------------------------------------------------------
# The tasks are correct (so they are learnable)
# --------------------------------------------------------------------------------------------------------------------


def _after_colon(prompt: str) -> str:
    return prompt.split(": ", 1)[1].rstrip("\n")


def _story(prompt: str) -> str:
    return prompt.split("\n\n", 1)[1].rstrip("\n")


def _check_record(task: str, prompt: str, completion: str) -> None:
    if task == "arithmetic":
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?\n", prompt).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert completion == str(expected)
    elif task == "running_sum":
        numbers = [int(x) for x in _after_colon(prompt).split(", ")]
        totals = np.cumsum(numbers).tolist()
        assert completion == ", ".join(map(str, totals)) + f". The total is {totals[-1]}."
    elif task == "sequence":
        count = int(re.match(r"Continue the sequence with the next (\d+) numbers", prompt).group(1))
        shown = [int(x) for x in _after_colon(prompt).split(", ")]
        step = shown[1] - shown[0]
        assert all(b - a == step for a, b in zip(shown, shown[1:]))
        assert completion == ", ".join(str(shown[-1] + step * (i + 1)) for i in range(count))
    elif task == "largest":
        assert completion == str(max(int(x) for x in _after_colon(prompt).rstrip("?").split(", ")))
    elif task == "reverse":
        assert completion.split(" ") == _after_colon(prompt).split(" ")[::-1]
    elif task == "sort":
        assert completion.split(" ") == sorted(_after_colon(prompt).split(" "))
    elif task == "count_words":
        assert completion == str(len(_after_colon(prompt).split(" ")))
    elif task == "first_letters":
        assert completion == " ".join(word[0] for word in _after_colon(prompt).split(" "))
    elif task == "count_word":
        target = re.search(r'the word "(\w+)" appear', prompt).group(1)
        words = [word.strip(".").lower() for word in _story(prompt).split()]
        assert completion == str(words.count(target))
    elif task == "copy":
        assert completion == _story(prompt)
    elif task == "replace":
        old, new = re.search(r'every "(\w+)" replaced by "(\w+)"', prompt).groups()
        story = _story(prompt)
        assert re.search(rf"\b{old}\b", story) and not re.search(rf"\b{new}\b", story)
        assert completion == re.sub(rf"\b{old}\b", new, story)
    else:
        raise AssertionError(f"unknown task {task!r}")


def test_every_task_answer_is_correct():
    records = generate_default_dataset(seed=0, n=600)
    assert {record["task"] for record in records} == set(TASK_NAMES)
    for record in records:
        assert record["prompt"].endswith("\n") and not record["completion"].startswith((" ", "\n"))
        _check_record(record["task"], record["prompt"], record["completion"])


def test_shipped_records_are_the_generated_ones(train_records):
    generated = generate_default_dataset(seed=0, n=20)
    assert train_records[:20] == [{"prompt": r["prompt"], "completion": r["completion"]} for r in generated]


# --------------------------------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------------------------------


def test_splits_have_the_documented_sizes_and_are_disjoint(train_records):
    train = load_default_dataset("train")
    evaluation = load_default_dataset("eval")
    assert train.column_names == ["prompt", "completion"]
    assert (len(train), len(evaluation)) == (DEFAULT_TRAIN_SIZE, DEFAULT_EVAL_SIZE)
    assert train[0] == train_records[0]
    assert not set(train["prompt"]) & set(evaluation["prompt"])
    with pytest.raises(ValueError, match="Unknown split 'test'"):
        load_default_dataset("test")


def test_conversational_dataset(train_records):
    dataset = load_default_dataset("eval", conversational=True)
    record, source = dataset[0], load_default_records("eval")[0]
    assert record["prompt"] == [{"role": "user", "content": source["prompt"].rstrip("\n")}]
    assert record["completion"] == [{"role": "assistant", "content": source["completion"]}]


def test_lengths_spread_widely(tokenizer, train_records):
    texts = [r["prompt"] + r["completion"] + tokenizer.eos_token for r in train_records]
    lengths = np.array([len(ids) for ids in tokenizer(texts)["input_ids"]])
    assert lengths.min() <= 16
    assert 40 <= np.median(lengths) <= 150
    assert lengths.max() >= 1024, "some samples must be long: packing's gain comes from the spread"
    assert lengths.max() <= 2048
    assert (lengths > 512).sum() >= 40


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------------


def test_tokenizer_special_tokens(tokenizer):
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert 256 < len(tokenizer) <= 4096
    assert tokenizer.padding_side == "right"
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_tokenizer_round_trips_and_splits_digits(tokenizer, train_records):
    ids = tokenizer("What is 348 + 97?\n")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids)[1:] == ["What", "Ġis", "Ġ3", "4", "8", "Ġ+", "Ġ9", "7", "?", "Ċ"]
    for record in train_records[:50] + [{"prompt": "Unseen wörds: ünïcode ✓ 12345\n", "completion": "ok"}]:
        text = record["prompt"] + record["completion"]
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    # a known word is a single token, with or without its leading space
    assert len(tokenizer(" rabbit", add_special_tokens=False)["input_ids"]) == 1


def test_prompt_is_a_token_prefix_of_prompt_plus_completion(tokenizer, train_records):
    for record in train_records[:200]:
        prompt_ids = tokenizer(record["prompt"])["input_ids"]
        full_ids = tokenizer(record["prompt"] + record["completion"])["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|bos|><|system|>\nBe brief.\n<|user|>\nWhat is 2 + 2?\n<|assistant|>\n4<|eos|>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|assistant|>\n")

    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "4<|eos|>"
    # role markers are single special tokens
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["<|bos|>", "<|system|>"]


# --------------------------------------------------------------------------------------------------------------------
# With TRL and a tiny model
# --------------------------------------------------------------------------------------------------------------------


def test_tiny_model_config(tokenizer):
    from transformers import LlamaForCausalLM

    config = tiny_model_config(tokenizer)
    assert config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.num_key_value_heads < config.num_attention_heads  # GQA is exercised
    smaller = tiny_model_config(tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    assert (smaller.hidden_size, smaller.num_hidden_layers, smaller.vocab_size) == (32, 1, len(tokenizer))

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert 200_000 < sum(p.numel() for p in model.parameters()) < 2_000_000
    input_ids = torch.tensor([tokenizer("What is 1 + 1?\n2")["input_ids"]])
    logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], len(tokenizer))


def _tiny_trainer(tokenizer, dataset, tmp_path, **config):
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    overrides = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(tiny_model_config(tokenizer, num_key_value_heads=1, **overrides))
    args = SFTConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=4,
        **config,
    )
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize("conversational", [False, True])
def test_trl_trains_on_the_completion_only(tokenizer, tmp_path, conversational):
    dataset = load_default_dataset("eval", conversational=conversational).select(range(8))
    trainer = _tiny_trainer(tokenizer, dataset, tmp_path, max_length=None)
    records = load_default_records("eval")[:8]
    for row, record in zip(trainer.train_dataset, records):
        trained = [token for token, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert tokenizer.decode(trained) == record["completion"] + tokenizer.eos_token


def test_trl_trains_with_packing_and_assistant_only_loss(tokenizer, tmp_path):
    records = load_default_records("eval")[:16]
    from datasets import Dataset

    messages = [
        [{"role": "user", "content": r["prompt"].rstrip("\n")}, {"role": "assistant", "content": r["completion"]}]
        for r in records
    ]
    dataset = Dataset.from_dict({"messages": messages})
    trainer = _tiny_trainer(
        tokenizer, dataset, tmp_path, max_length=512, packing=True, assistant_only_loss=True, max_steps=1
    )
    result = trainer.train()
    assert np.isfinite(result.training_loss)


# --------------------------------------------------------------------------------------------------------------------
# Nothing at import time
# --------------------------------------------------------------------------------------------------------------------


def test_import_is_free_of_side_effects():
    code = (
        "import sys, unpack_trainer.data.default_data;"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'tokenizers') if m in sys.modules];"
        "print(json.dumps(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []
