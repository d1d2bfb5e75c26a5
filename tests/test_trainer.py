"""End-to-end trainer tests on CPU: the decision wired for real, equivalence with padded training, training set-ups."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import trl
from contaminating_model import DropsPackingMetadata
from datasets import Dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

import unpack_trainer.trainers.contamination as contamination
import unpack_trainer.trainers.packed_path as packed_path
import unpack_trainer.trainers.sequence_parallel as sequence_parallel
from unpack_trainer import PACKED_BATCH_KEYS, DataCollatorForPacking, SFTTrainer
from unpack_trainer._logging import announce_level
from unpack_trainer.selfcheck import ContaminationReport, check_uncontaminated

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _assert_same_params(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


# ------------------------------------------------------------------------------------------------ decision wiring


def test_packing_wires_collator_patch_and_selfcheck(tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama):
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    assert trainer.unpack_decision.mode == "pack"
    assert isinstance(trainer.data_collator, DataCollatorForPacking)
    assert trainer.unpack_selfcheck is None  # runs when training starts, on the model as it trains
    trainer.get_train_dataloader()
    assert trainer.unpack_selfcheck is not None and trainer.unpack_selfcheck.ok
    from unpack_trainer.models import is_patched

    assert is_patched(trainer.model)
    stats = trainer.unpack_stats
    assert stats["samples"] == 24 and stats["rows"] < 24 and 0 < stats["efficiency"] <= 1
    rows = trainer.train_dataset
    assert set(rows.column_names) >= {"input_ids", "labels", "seq_lengths"}
    assert sum(len(r["input_ids"]) for r in rows) == stats["tokens"]
    assert all(sum(r["seq_lengths"]) == len(r["input_ids"]) <= 48 for r in rows)
    # the user's config is not mutated
    assert trainer.unpack_decision.reason.startswith("packing=True")


def test_unpack_disable_is_stock_trl(tokenizer, tmp_path, monkeypatch, prompt_completion, sft_args, tiny_llama):
    monkeypatch.setenv("UNPACK_DISABLE", "1")
    args = sft_args(tmp_path, cls=trl.SFTConfig, packing=True)
    ours = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=args,
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    stock = trl.SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=args,
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    assert ours.unpack_decision.mode == "stock"
    assert type(ours.data_collator) is type(stock.data_collator) is DataCollatorForLanguageModeling
    assert ours.train_dataset[:] == stock.train_dataset[:]


def test_custom_collator_falls_back_with_a_warning(
    tokenizer, tmp_path, caplog, prompt_completion, sft_args, tiny_llama
):
    collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True),
            data_collator=collator,
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    assert trainer.unpack_decision.mode == "padded"
    assert trainer.data_collator is collator
    assert "packing=True ignored (a custom data_collator" in caplog.text
    trainer.train()


def test_explicit_padding_free_enforces_max_length_instead_of_raising(
    tokenizer, tmp_path, caplog, prompt_completion, sft_args, tiny_llama
):
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, padding_free=True, max_length=16),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    assert trainer.unpack_decision.mode == "padding_free"
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) <= 16
    assert "longer than max_length=16 and were truncated (keep_start)" in caplog.text


def test_explicit_padding_free_false_is_kept(tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama):
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, padding_free=False),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    assert trainer.unpack_decision.mode == "padded"
    assert type(trainer.data_collator) is DataCollatorForLanguageModeling
    assert trainer.unpack_selfcheck is None


@pytest.mark.parametrize("bf16", [False, True])
def test_the_selfcheck_runs_in_the_training_precision(
    tokenizer, tmp_path, monkeypatch, prompt_completion, sft_args, tiny_llama, bf16
):
    """Issue 46 item 5: float32 weights with ``bf16=True`` train under bf16 autocast, but the self-check ran in float32
    ("exactly as it will run", docs/training.md): it runs under the trainer's autocast and judges by bf16's
    tolerance."""
    seen = []

    def spy(model, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        report = check_uncontaminated(model, **kwargs)
        seen.append(report.dtype)
        return report

    monkeypatch.setattr(contamination, "check_uncontaminated", spy)
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True, bf16=bf16),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    trainer.get_train_dataloader()
    assert next(trainer.model.parameters()).dtype == torch.float32
    expected = torch.bfloat16 if bf16 else False
    assert seen == [expected, torch.bfloat16 if bf16 else torch.float32]
    assert trainer.unpack_selfcheck.ok and trainer.unpack_decision.mode == "pack"
    assert not torch.is_autocast_enabled("cpu")


def test_failed_selfcheck_falls_back_to_padded_or_raises_when_strict(
    tokenizer, tmp_path, monkeypatch, caplog, prompt_completion, sft_args, tiny_llama
):
    failing = ContaminationReport(False, 0.5, 1e-4, 0.5, torch.float32, 0.01)
    monkeypatch.setattr(contamination, "check_uncontaminated", lambda model, **kwargs: failing)
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    assert trainer.unpack_decision.mode == "pack"
    with caplog.at_level(logging.ERROR, logger="unpack_trainer"):
        trainer.train()
    assert "Contamination self-check failed (contamination measured: max |packed - one-by-one| = 0.5" in caplog.text
    assert "training padded instead" in caplog.text
    assert trainer.unpack_decision.mode == "padded"
    assert "contamination measured" in trainer.unpack_decision.reason
    assert type(trainer.data_collator) is DataCollatorForLanguageModeling
    assert "seq_lengths" not in trainer.train_dataset.column_names and len(trainer.train_dataset) == 24
    from unpack_trainer.models import is_patched

    assert not is_patched(trainer.model)
    monkeypatch.setenv("UNPACK_STRICT", "1")
    strict = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    with pytest.raises(RuntimeError, match="UNPACK_STRICT=1"):
        strict.train()


def test_selfcheck_detects_real_contamination(tiny_llama):
    model = tiny_llama()
    assert check_uncontaminated(model).ok
    report = check_uncontaminated(DropsPackingMetadata(model))
    assert not report.ok and report.max_abs_diff > 100 * report.tolerance
    assert "a contaminated row would differ by" in report.summary()


# ------------------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("mode", ["pack", "padding_free"])
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_one_step_equals_padded_training(
    tokenizer, tmp_path, mode, gradient_checkpointing, param_snapshot, sft_args, sft_train
):
    extra = {"packing": True} if mode == "pack" else {}
    common = dict(gradient_checkpointing=gradient_checkpointing)
    ours, ours_result = sft_train(tokenizer, sft_args(tmp_path, **extra, **common))
    padded, padded_result = sft_train(tokenizer, sft_args(tmp_path, padding_free=False, **common))
    assert ours.unpack_decision.mode == mode and padded.unpack_decision.mode == "padded"
    assert ours_result.training_loss == pytest.approx(padded_result.training_loss, rel=1e-5)
    _assert_same_params(param_snapshot(ours.model), param_snapshot(padded.model))


@pytest.mark.parametrize("mode", ["pack", "padding_free"])
def test_trained_model_can_be_saved_whole(tokenizer, tmp_path, mode, sft_args, sft_train):
    """Issue 20 item 3: ``torch.save(trainer.model)`` failed after a packed or padding-free run (the self-check left
    transformers' output-capturing hooks, local functions, on the model)."""
    import io

    trainer, _ = sft_train(tokenizer, sft_args(tmp_path, packing=mode == "pack"))
    assert trainer.unpack_decision.mode == mode and trainer.unpack_selfcheck.ok
    torch.save(trainer.model, io.BytesIO())


def test_gradient_accumulation_counts_boundary_tokens_once(tokenizer, tmp_path, param_snapshot, sft_args, sft_train):
    common = dict(per_device_train_batch_size=6, gradient_accumulation_steps=2, max_steps=2)
    ours, ours_result = sft_train(tokenizer, sft_args(tmp_path, **common))
    padded, padded_result = sft_train(tokenizer, sft_args(tmp_path, padding_free=False, **common))
    assert ours.unpack_decision.mode == "padding_free"
    assert ours_result.training_loss == pytest.approx(padded_result.training_loss, rel=1e-5)
    _assert_same_params(param_snapshot(ours.model), param_snapshot(padded.model))
    batch = ours.data_collator([ours.train_dataset[i] for i in range(6)])
    trained = int((batch["labels"] != -100).sum())
    expected = sum(sum(1 for label in ours.train_dataset[i]["labels"][1:] if label != -100) for i in range(6))
    assert trained == expected


def test_steps_per_epoch_follow_packed_rows(tokenizer, tmp_path, sft_args, sft_train):
    trainer, result = sft_train(
        tokenizer, sft_args(tmp_path, packing=True, per_device_train_batch_size=2, max_steps=-1, num_train_epochs=1)
    )
    rows = trainer.unpack_stats["rows"]
    assert result.global_step == -(-rows // 2)


# ------------------------------------------------------------------------------------------------ set-ups


def test_lora(tokenizer, tmp_path, sft_args, sft_train):
    from peft import LoraConfig

    trainer, result = sft_train(
        tokenizer,
        sft_args(tmp_path, packing=True, max_steps=2, learning_rate=1e-2),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    assert trainer.unpack_decision.mode == "pack" and trainer.unpack_selfcheck.ok
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_qlora_4bit(tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    )
    trainer = SFTTrainer(
        model=model,
        args=sft_args(tmp_path, packing=True, max_steps=2, learning_rate=1e-2),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    result = trainer.train()
    assert trainer.unpack_decision.mode == "pack" and trainer.unpack_selfcheck.ok, trainer.unpack_decision
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_eval_packing(tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama):
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True, eval_packing=True, per_device_eval_batch_size=4),
        train_dataset=prompt_completion(),
        eval_dataset=prompt_completion(10, seed=1),
        processing_class=tokenizer,
    )
    assert "seq_lengths" in trainer.eval_dataset.column_names and len(trainer.eval_dataset) < 10
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_conversational_and_pretokenized_data(tokenizer, tmp_path, sft_args, sft_train):
    messages = Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": "ab" * (i + 1)},
                    {"role": "assistant", "content": "c" * (i + 2)},
                ]
            }
            for i in range(8)
        ]
    )
    trainer, _ = sft_train(tokenizer, sft_args(tmp_path, packing=True, assistant_only_loss=True), dataset=messages)
    labels = trainer.train_dataset[0]["labels"]
    assert any(label == -100 for label in labels) and any(label != -100 for label in labels)
    tokenized = Dataset.from_list([{"input_ids": list(range(3, 3 + n))} for n in (5, 9, 3, 12)])
    trainer, _ = sft_train(tokenizer, sft_args(tmp_path), dataset=tokenized)
    assert trainer.unpack_decision.mode == "padding_free"


def test_resume_from_checkpoint_continues_with_identical_batches(
    tokenizer, tmp_path, param_snapshot, prompt_completion, sft_args, sft_train, tiny_llama
):
    common = dict(packing=True, per_device_train_batch_size=2, max_steps=4, save_strategy="steps", save_steps=2)
    full, _ = sft_train(tokenizer, sft_args(tmp_path / "full", **common))
    first = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path / "resumed", **(common | {"max_steps": 2})),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    first.train()
    resumed = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path / "resumed", **common),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "out" / "checkpoint-2"))
    assert resumed.train_dataset[:] == full.train_dataset[:]
    _assert_same_params(param_snapshot(resumed.model), param_snapshot(full.model))


def test_streaming_dataset_packs_through_the_buffer(tokenizer, tmp_path, prompt_completion, sft_args, sft_train):
    from unpack_trainer.data.streaming import StreamingPacker

    stream = prompt_completion(40).to_iterable_dataset(num_shards=2)
    trainer, result = sft_train(
        tokenizer,
        sft_args(tmp_path, packing=True, max_steps=3, per_device_train_batch_size=2, packing_buffer_size=16),
        dataset=stream,
    )
    assert trainer.unpack_decision.mode == "pack"
    assert isinstance(trainer.train_dataset, StreamingPacker)
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    rows = list(trainer.train_dataset)
    assert all(sum(row["seq_lengths"]) == len(row["input_ids"]) <= 48 for row in rows)


def test_text_data_and_model_given_as_a_path(tokenizer, tmp_path, sft_args, tiny_llama):
    text = Dataset.from_list([{"text": "abc" * n} for n in (1, 4, 9, 2, 7, 3)])
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    trainer = SFTTrainer(
        model=str(tmp_path / "model"),
        args=sft_args(tmp_path, packing=True),
        train_dataset=text,
        processing_class=tokenizer,
    )
    assert trainer.unpack_decision.mode == "pack" and trainer.unpack_decision.patch
    assert trainer.unpack_stats["samples"] == 6
    trainer.train()


def test_completion_only_loss_masks_prompts_inside_packed_rows(tokenizer, tmp_path, sft_args, tiny_llama):
    data = Dataset.from_list([{"prompt": "aaaa", "completion": "bb"}, {"prompt": "ccc", "completion": "ddd"}])
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True, completion_only_loss=True),
        train_dataset=data,
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    trained = {tokenizer.decode([i]) for i, label in zip(ids, labels) if label != -100}
    assert trained <= {"b", "d", tokenizer.eos_token} and {"b", "d"} <= trained


# ------------------------------------------------------------------------------------------------ issue 10: drop-in


def _tokenized(lengths, seed=0, **columns):
    rng = random.Random(seed)
    return Dataset.from_list(
        [
            {"input_ids": [rng.randint(7, 100) for _ in range(n)], **{k: v[i] for k, v in columns.items()}}
            for i, n in enumerate(lengths)
        ]
    )


def test_neftune_keeps_automatic_padding_free_off_and_explains_packed_scale(
    tokenizer, tmp_path, caplog, prompt_completion, sft_args, tiny_llama
):
    auto = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, neftune_noise_alpha=5.0),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    assert auto.unpack_decision.mode == "padded" and "neftune_noise_alpha is set" in auto.unpack_decision.reason
    assert type(auto.data_collator) is DataCollatorForLanguageModeling
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        packed = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, neftune_noise_alpha=5.0),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    assert packed.unpack_decision.mode == "pack"
    assert "NEFTune (neftune_noise_alpha=5.0) scales its noise by alpha/sqrt(tokens per row" in caplog.text


@pytest.mark.parametrize("packing", [False, True])
def test_metrics_see_one_row_per_example_as_stock(
    tokenizer, tmp_path, packing, prompt_completion, sft_args, tiny_llama
):
    def evaluate(**extra):
        seen = {}

        def compute_metrics(prediction):
            seen["predictions"] = prediction.predictions.shape
            seen["labels"] = prediction.label_ids.shape
            return {"n": float(prediction.label_ids.shape[0])}

        def preprocess(logits, labels):
            seen.setdefault("preprocess", []).append(tuple(labels.shape))
            return logits.argmax(-1)

        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, per_device_eval_batch_size=4, **extra),
            train_dataset=prompt_completion(),
            eval_dataset=prompt_completion(10, seed=1),
            processing_class=tokenizer,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess,
        )
        metrics = trainer.evaluate()
        return trainer, metrics, seen

    ours, ours_metrics, ours_seen = evaluate(**({"packing": True} if packing else {}))
    stock, stock_metrics, stock_seen = evaluate(padding_free=False)
    assert ours.unpack_decision.mode == ("pack" if packing else "padding_free")
    assert ours_seen == stock_seen and ours_seen["labels"][0] == 10
    assert ours_metrics["eval_n"] == 10.0
    assert ours_metrics["eval_loss"] == pytest.approx(stock_metrics["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("kind", ["iterable", "dict", "iterable_dict"])
def test_iterable_eval_datasets_with_default_settings(
    tokenizer, tmp_path, packing, kind, prompt_completion, sft_args, tiny_llama
):
    """accelerate dispatches batches of iterable data by default, slicing the 1-D packing metadata."""
    from datasets import IterableDatasetDict

    def eval_data():
        stream = prompt_completion(10, seed=1).to_iterable_dataset()
        if kind == "iterable":
            return stream
        if kind == "dict":
            return {"a": stream, "b": prompt_completion(6, seed=2).to_iterable_dataset()}
        return IterableDatasetDict({"a": stream})

    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(
            tmp_path,
            per_device_eval_batch_size=5,
            eval_strategy="steps",
            eval_steps=1,
            **({"packing": True} if packing else {}),
        ),
        train_dataset=prompt_completion(),
        eval_dataset=eval_data(),
        processing_class=tokenizer,
    )
    assert trainer.unpack_decision.packed
    trainer.train()
    metrics = trainer.evaluate()
    losses = [value for key, value in metrics.items() if key.endswith("_loss")]
    assert losses and all(torch.isfinite(torch.tensor(loss)) for loss in losses)
    if kind == "iterable" and not packing:  # the same examples map-style: the same batches (no partial last one)
        mapped = trainer.evaluate(prompt_completion(10, seed=1))
        assert metrics["eval_loss"] == pytest.approx(mapped["eval_loss"], rel=1e-6)


PACKED_AHEAD = [[12, 4], [9, 7], [5, 3, 6]]


def _packed_ahead_rows():
    rng = random.Random(0)
    rows = []
    for lengths in PACKED_AHEAD:
        ids = [rng.randint(7, 100) for _ in range(sum(lengths))]
        rows.append({"input_ids": ids, "seq_lengths": lengths})
    return Dataset.from_list(rows)


@pytest.mark.parametrize("mode", ["pack", "padding_free", "padded"])
def test_rows_packed_ahead_keep_their_boundaries(tokenizer, tmp_path, mode, sft_args, tiny_llama):
    extra = {"pack": {"packing": True}, "padding_free": {}, "padded": {"padding_free": False}}[mode]
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, max_length=16, per_device_train_batch_size=2, **extra),
        train_dataset=_packed_ahead_rows(),
        processing_class=tokenizer,
    )
    assert trainer.unpack_decision.mode == mode
    data = trainer.train_dataset
    samples = sorted(n for lengths in PACKED_AHEAD for n in lengths)
    if mode == "padded":  # one padded row per sample
        assert sorted(len(ids) for ids in data["input_ids"]) == samples
    else:
        assert sorted(n for lengths in data["seq_lengths"] for n in lengths) == samples
        batch = trainer.data_collator([data[i] for i in range(len(data))])
        assert sorted(batch["packed_seq_lengths"].tolist()) == samples
    assert trainer.unpack_stats.get("samples", len(samples)) == len(samples)
    trainer.train()


def test_rows_packed_ahead_longer_than_max_length_are_an_error(tokenizer, tmp_path, sft_args, tiny_llama):
    trainer_kwargs = dict(train_dataset=_packed_ahead_rows(), processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"row 0 is a row packed ahead .* of 16 tokens, longer than max_length=15"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)), args=sft_args(tmp_path, max_length=15), **trainer_kwargs
        )


@pytest.mark.parametrize(
    ("seq_lengths", "message"),
    [([4, 4], r"Train dataset row 1 has 16 tokens but `seq_lengths` \[4, 4\]"), ([8, 8.0], "non-integer")],
)
def test_rows_packed_ahead_with_bad_seq_lengths_are_an_error(
    tokenizer, tmp_path, seq_lengths, message, sft_args, tiny_llama
):
    rows = _packed_ahead_rows().to_list()
    rows[1] = {"input_ids": rows[1]["input_ids"][:16], "seq_lengths": seq_lengths}
    with pytest.raises(ValueError, match=message):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, max_length=16, packing=True),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning"])
def test_peft_prompt_learning_is_blocked_up_front(tokenizer, tmp_path, kind, caplog, sft_args, sft_train):
    from peft import PrefixTuningConfig, PromptTuningConfig

    config_cls = PromptTuningConfig if kind == "prompt_tuning" else PrefixTuningConfig
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        trainer, result = sft_train(
            tokenizer,
            sft_args(tmp_path, packing=True),
            peft_config=config_cls(task_type="CAUSAL_LM", num_virtual_tokens=4),
        )
    assert trainer.unpack_decision.mode == "padded"
    assert f"PEFT prompt learning ({kind.upper()})" in trainer.unpack_decision.reason
    assert "self-check failed" not in caplog.text
    assert torch.isfinite(torch.tensor(result.training_loss))


def _strip_packing(module, args, kwargs):
    for key in set(PACKED_BATCH_KEYS) - {"input_ids", "labels"}:
        kwargs.pop(key, None)
    return args, kwargs


def test_selfcheck_runs_on_the_model_as_patched_at_train(
    tokenizer, tmp_path, monkeypatch, caplog, prompt_completion, sft_args, tiny_llama
):
    """A patch applied by ``train()`` itself (as liger's is) that breaks packing is measured and trained padded."""
    import transformers.trainer

    applied = []

    def fake_liger(model, config):
        applied.append(True)
        model.register_forward_pre_hook(_strip_packing, with_kwargs=True, prepend=True)

    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", fake_liger)
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True, use_liger_kernel=True),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    assert trainer.unpack_decision.mode == "pack" and not applied
    with caplog.at_level(logging.ERROR, logger="unpack_trainer"):
        trainer.train()
    assert applied
    assert "Contamination self-check failed (contamination measured: max |packed - one-by-one|" in caplog.text
    assert trainer.unpack_decision.mode == "padded"
    assert type(trainer.data_collator) is DataCollatorForLanguageModeling
    assert "seq_lengths" not in trainer.train_dataset.column_names


def test_selfcheck_reports_a_raising_forward_as_such(
    tokenizer, tmp_path, caplog, prompt_completion, sft_args, tiny_llama
):
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )

    def explode(module, args, kwargs):
        if "packed_seq_lengths" in kwargs:
            raise RuntimeError("kernel exploded")
        return args, kwargs

    trainer.model.model.register_forward_pre_hook(explode, with_kwargs=True)
    with caplog.at_level(logging.ERROR, logger="unpack_trainer"):
        trainer.train()
    assert "Contamination self-check failed (the packed forward raised RuntimeError: kernel exploded)" in caplog.text
    assert "contamination measured" not in caplog.text
    assert trainer.unpack_decision.mode == "padded"


def test_impossible_forced_backend_raises_at_trainer_start(
    tokenizer, tmp_path, monkeypatch, prompt_completion, sft_args, tiny_llama
):
    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="UNPACK_ATTENTION_BACKEND=flash"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("extra", [{}, {"packing": True}, {"padding_free": False}])
def test_every_sample_dropped_or_empty_data_is_a_clear_error(tokenizer, tmp_path, extra, sft_args, tiny_llama):
    long_prompts = Dataset.from_list([{"prompt": "a" * 30, "completion": "b"} for _ in range(4)])
    match = "every sample was dropped|all 4 examples were dropped"
    with pytest.raises(ValueError, match=match):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, max_length=16, completion_only_loss=True, **extra),
            train_dataset=long_prompts,
            processing_class=tokenizer,
        )
    masked = _tokenized([5, 6, 7], labels=[[-100] * 5, [-100] * 6, [-100] * 7])
    with pytest.raises(ValueError, match=r"every sample was dropped \(3 samples: 3 with every label masked|all 3"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, max_length=16, **extra),
            train_dataset=masked,
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match=r"`train_dataset` is empty \(0 examples\)"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, **extra),
            train_dataset=Dataset.from_dict({"prompt": [], "completion": []}),
            processing_class=tokenizer,
        )


def test_skip_prepare_dataset_declines_packing_with_the_reason(tokenizer, tmp_path, caplog, sft_args, tiny_llama):
    data = _tokenized([60, 5, 9])
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, max_length=16, dataset_kwargs={"skip_prepare_dataset": True}),
            train_dataset=data,
            processing_class=tokenizer,
        )
    assert trainer.unpack_decision.mode == "padding_free" and trainer.unpack_decision.overridden_request
    assert "packing=True ignored (dataset_kwargs={'skip_prepare_dataset': True}" in caplog.text
    assert "neither packed nor truncated" in caplog.text and "mode=padding_free" in caplog.text


def test_eval_split_named_train_does_not_overwrite_training_stats(
    tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama
):
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True),
        train_dataset=prompt_completion(24),
        eval_dataset={"train": prompt_completion(5, seed=3), "other": prompt_completion(7, seed=4)},
        processing_class=tokenizer,
    )
    assert trainer.unpack_stats["samples"] == 24 and len(trainer.train_dataset) == trainer.unpack_stats["rows"]


@pytest.mark.parametrize("packing", [False, True])
def test_streamed_truncation_is_counted_and_logged(tokenizer, tmp_path, packing, caplog, sft_args, sft_train):
    lengths = [5] * 27 + [30] * 5
    stream = _tokenized(lengths).to_iterable_dataset()
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        trainer, _ = sft_train(
            tokenizer,
            sft_args(
                tmp_path,
                max_length=16,
                max_steps=1,
                num_train_epochs=1,
                per_device_train_batch_size=64,
                packing=packing,
                packing_buffer_size=64,
            ),
            dataset=stream,
        )
    counts = trainer.unpack_stats["truncation"]
    assert (counts.read, counts.over, counts.cut_tokens) == (32, 5, 5 * 14)
    assert "samples longer than max_length=16 are truncated (keep_start) as they are read" in caplog.text
    assert "train dataset (streamed): 5 of 32 samples read were longer than max_length=16" in caplog.text


def test_start_line_is_logged_once_with_the_shared_speedup_estimate(
    tokenizer, tmp_path, caplog, prompt_completion, sft_args, tiny_llama
):
    from unpack_trainer.data.estimate import estimated_speedup

    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, per_device_train_batch_size=2),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
        trainer.train()
    start = [r for r in caplog.records if "mode=pack" in r.getMessage()]
    assert len(start) == 1 and start[0].levelno == announce_level()  # seen at transformers' verbosity
    assert not start[0].getMessage().startswith("unpack_trainer")
    stats = trainer.unpack_stats
    batch = 2 * stats["samples"] / stats["rows"]  # a padded step holds the samples of 2 packed rows
    assert stats["padded_batch_size"] == pytest.approx(batch) and batch > 2
    unpacked = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    lengths = [len(ids) for ids in unpacked.train_dataset["input_ids"]]  # the same samples, in dataset order
    assert stats["estimated_speedup"] == pytest.approx(estimated_speedup(lengths, batch, seed=0))
    assert any(
        r.levelno == logging.INFO and "Contamination self-check passed" in r.getMessage() for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True),
            data_collator=DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    overridden = [r for r in caplog.records if "mode=padded" in r.getMessage()]
    assert len(overridden) == 1 and overridden[0].levelno == logging.WARNING


# ------------------------------------------------------------------------------------------------ parallelism


@pytest.mark.parametrize("request_kwargs", [{"packing": True}, {"padding_free": True}])
def test_context_parallelism_refuses_packed_rows_at_start(
    tokenizer, tmp_path, request_kwargs, prompt_completion, sft_args, tiny_llama
):
    """accelerate's context parallelism runs SDPA with ``is_causal=True`` and no mask on a split row: packed rows
    are refused before TRL's ``__init__`` (which would build the device mesh), with the reason and the fix."""
    from accelerate.parallelism_config import ParallelismConfig

    args = sft_args(tmp_path, parallelism_config=ParallelismConfig(cp_size=2), **request_kwargs)
    with pytest.raises(ValueError, match=r"not supported with context parallelism \(cp_size=2\): .*is_causal=True"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=args,
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("explicit", [False, True])
def test_parallelism_of_the_accelerator_is_checked_again_after_trl_init(
    tokenizer, tmp_path, explicit, monkeypatch, caplog, prompt_completion, sft_args, tiny_llama
):
    """A parallelism config that reaches only the accelerator (an accelerate config file): automatic padding-free
    falls back to padded batches with the reason, an explicit request is refused."""
    reason = "context parallelism (cp_size=2): it splits every row"
    answers = iter([None, reason])  # the config's (before TRL's __init__), then the accelerator's
    for module in (packed_path, sequence_parallel):  # before TRL's __init__, then the accelerator's check
        monkeypatch.setattr(module, "parallelism_reason", lambda *args, **kwargs: next(answers))
    args = sft_args(tmp_path, **({"padding_free": True} if explicit else {}))
    build = dict(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=args,
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    if explicit:
        with pytest.raises(ValueError, match=r"`padding_free=True` is not supported with context parallelism"):
            SFTTrainer(**build)
        return
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = SFTTrainer(**build)
    assert trainer.unpack_decision.mode == "padded" and reason in trainer.unpack_decision.reason
    assert not isinstance(trainer.data_collator, DataCollatorForPacking)
    assert "seq_lengths" not in trainer.train_dataset.column_names
    assert any(reason in record.getMessage() for record in caplog.records)


# ------------------------------------------------------------------------------------------------ host syncs


@pytest.mark.parametrize("mode", ["pack", "padding_free"])
def test_a_training_step_reads_no_packing_metadata_back_from_the_device(
    tokenizer, tmp_path, mode, monkeypatch, sft_args, sft_train
):
    """The collator hands the patched model its ``packed_seq_info`` (built on the host): with every metadata tensor
    of the batch made unreadable from the host (on the meta device, as a GPU copy is to the host), a training step
    runs and trains exactly as with readable ones."""
    metadata = ("packed_seq_lengths", "cu_seq_lens_q", "cu_seq_lens_k")
    args = dict(packing=mode == "pack", max_steps=2, per_device_train_batch_size=8)
    reference, reference_result = sft_train(tokenizer, sft_args(tmp_path, **args))
    original = SFTTrainer._prepare_inputs

    def unreadable(self, inputs):
        inputs = original(self, inputs)
        assert "packed_seq_info" in inputs
        return {key: value.to("meta") if key in metadata else value for key, value in inputs.items()}

    monkeypatch.setattr(SFTTrainer, "_prepare_inputs", unreadable)
    trainer, result = sft_train(tokenizer, sft_args(tmp_path, **args))
    assert trainer.unpack_decision.mode == mode and trainer.unpack_decision.patch
    assert result.training_loss == reference_result.training_loss
