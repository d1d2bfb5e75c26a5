"""``SFTTrainer`` on vision-language models: the decision packs verified families with their processor and image data
(and says why not elsewhere), padding-free training equals stock TRL's padded training step by step, ``packing=True``
packs the examples ahead into rows with every image whole, a failed self-check falls back to TRL's padded path, and an
example whose image tokens do not fit is named before training."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import trl
from datasets import Dataset
from random_images import random_image

from unpack_trainer import SFTConfig, SFTTrainer
from unpack_trainer.data.vision import VISION_ROWS_KEY, DataCollatorForVisionPacking, VisionRows
from unpack_trainer.decision import decide
from unpack_trainer.models import is_patched, supported_model_types
from unpack_trainer.models.tiny_vision import tiny_processor, tiny_vision_config, tiny_vision_model


def _dataset(n: int = 12, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(n):
        rows.append(
            {
                "images": [random_image(int(rng.integers(56, 112)), int(rng.integers(56, 112)), seed + index)],
                "messages": [
                    {"role": "user", "content": "describe" + "?" * int(rng.integers(0, 10))},
                    {"role": "assistant", "content": "a shape " * int(rng.integers(1, 5))},
                ],
            }
        )
    return Dataset.from_list(rows)


def _args(tmp_path, cls=SFTConfig, **overrides):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_length=256,
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        data_seed=0,
    )
    return cls(**(defaults | overrides))


# --------------------------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------------------------


def _decide(model_config, processor, sample, env=None, blocklist=None, **config):
    return decide(
        SFTConfig(output_dir="unused", use_cpu=True, bf16=False, **config),
        model_config=model_config,
        processing_class=processor,
        dataset_sample=sample,
        supported_model_types=frozenset(supported_model_types()),
        blocklist=blocklist,
        env=env or {},
        vision=None,
    )


def test_verified_families_pack_with_their_processor_and_images():
    sample = {"images": [], "messages": []}
    processor = tiny_processor("qwen2_5_vl")
    decision = _decide(tiny_vision_config("qwen2_5_vl"), processor, sample, packing=True)
    assert (decision.mode, decision.patch) == ("pack", True)
    automatic = _decide(tiny_vision_config("gemma3"), tiny_processor("gemma3"), sample)
    assert (automatic.mode, automatic.patch, automatic.automatic) == ("padding_free", True, True)
    assert _decide(tiny_vision_config("qwen2_5_vl"), processor, sample, padding_free=False).mode == "padded"
    disabled = _decide(tiny_vision_config("qwen2_5_vl"), processor, sample, env={"UNPACK_DISABLE": "1"}, packing=True)
    assert disabled.mode == "stock"
    blocked = _decide(tiny_vision_config("llava"), tiny_processor("llava"), sample, blocklist={"llava": "a reason"})
    assert blocked.mode == "padded" and "'llava' is not supported: a reason" in blocked.reason


def test_the_reason_where_images_cannot_pack():
    from transformers import LlamaConfig, PaliGemmaConfig

    sample = {"images": [], "messages": []}
    processor = tiny_processor("llava")
    text_model = _decide(LlamaConfig(), processor, sample, packing=True)
    assert text_model.mode == "padded" and "is not a vision-language model" in text_model.reason
    unverified = _decide(PaliGemmaConfig(), processor, sample, packing=True)
    assert unverified.mode == "padded" and "'paligemma' is not verified for packed image rows" in unverified.reason
    assert "qwen2_5_vl" in unverified.reason


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_padding_free_trains_as_stock_trl_padded(model_type, tmp_path):
    """Same batches (same sampler), each flattened into one packed row: the loss and gradient norm of every step
    equal stock TRL's padded training (fp32, relative 1e-4)."""
    dataset = _dataset()
    stock = trl.SFTTrainer(
        model=tiny_vision_model(model_type, attn_implementation="sdpa"),
        args=_args(tmp_path / "stock", trl.SFTConfig),
        train_dataset=dataset,
        processing_class=tiny_processor(model_type),
    )
    stock.train()
    ours = SFTTrainer(
        model=tiny_vision_model(model_type, attn_implementation="sdpa"),
        args=_args(tmp_path / "ours", padding_free=True),
        train_dataset=dataset,
        processing_class=tiny_processor(model_type),
    )
    assert ours.unpack_decision.mode == "padding_free" and isinstance(ours.data_collator, DataCollatorForVisionPacking)
    ours.train()
    assert ours.unpack_selfcheck.ok and is_patched(ours.model)
    assert np.allclose(_losses(ours), _losses(stock), rtol=1e-4), (_losses(ours), _losses(stock))
    norms = [[e["grad_norm"] for e in t.state.log_history if "grad_norm" in e] for t in (ours, stock)]
    assert np.allclose(norms[0], norms[1], rtol=1e-4)


def test_packing_packs_examples_ahead_with_every_image_whole(tmp_path, caplog):
    dataset = _dataset(16)
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa"),
            args=_args(tmp_path, packing=True, max_length=160, per_device_train_batch_size=2),
            train_dataset=dataset,
            processing_class=tiny_processor("qwen2_5_vl"),
        )
    rows = trainer.train_dataset
    assert isinstance(rows, VisionRows) and sorted(i for row in rows.rows for i in row) == list(range(16))
    assert all(sum(rows.lengths[i] for i in row) <= 160 for row in rows.rows)
    assert trainer.unpack_stats["samples"] == 16 and trainer.unpack_stats["rows"] == len(rows)
    assert "samples=16" in caplog.text and f"rows={len(rows)}" in caplog.text
    trainer._set_signature_columns_if_needed()
    assert VISION_ROWS_KEY in trainer._signature_columns
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "packed_multimodal_position_ids" in batch
    assert int(batch["packed_seq_lengths"].sum()) == batch["input_ids"].shape[1]
    result = trainer.train()
    assert np.isfinite(result.training_loss) and trainer.unpack_selfcheck.ok


def test_a_failed_selfcheck_falls_back_to_trls_padded_path(tmp_path, monkeypatch):
    from unpack_trainer.models.selfcheck import ContaminationReport
    from unpack_trainer.trainers import _packed

    failed = ContaminationReport(False, 1.0, 1e-4, float("nan"), torch.float32, 0.0)
    monkeypatch.setattr(_packed, "check_uncontaminated", lambda model, **kwargs: failed)
    dataset = _dataset(8)
    trainer = SFTTrainer(
        model=tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa"),
        args=_args(tmp_path, packing=True, max_steps=1),
        train_dataset=dataset,
        processing_class=tiny_processor("qwen2_5_vl"),
    )
    assert isinstance(trainer.train_dataset, VisionRows)
    trainer.train()
    assert trainer.unpack_decision.mode == "padded" and not is_patched(trainer.model)
    assert trainer.train_dataset is dataset
    assert type(trainer.data_collator).__name__ == "DataCollatorForVisionLanguageModeling"


def test_an_example_whose_image_does_not_fit_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"Example \d+ of the train dataset has \d+ tokens, more than max_length=12"):
        SFTTrainer(
            model=tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa"),
            args=_args(tmp_path, packing=True, max_length=12),
            train_dataset=_dataset(4),
            processing_class=tiny_processor("qwen2_5_vl"),
        )


def test_evaluation_on_images_matches_stock(tmp_path):
    """Flattened evaluation batches give stock TRL's padded eval_loss (same samples, same weights)."""
    dataset = _dataset(8)
    model = tiny_vision_model("idefics3", attn_implementation="sdpa")
    stock = trl.SFTTrainer(
        model=model,
        args=_args(tmp_path / "stock", trl.SFTConfig),
        train_dataset=dataset,
        eval_dataset=dataset,
        processing_class=tiny_processor("idefics3"),
    )
    expected = stock.evaluate()["eval_loss"]
    ours = SFTTrainer(
        model=model, args=_args(tmp_path / "ours"), train_dataset=dataset, eval_dataset=dataset,
        processing_class=tiny_processor("idefics3"),
    )  # fmt: skip
    assert ours.unpack_decision.mode == "padding_free"
    assert ours.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_streamed_image_dataset_is_flattened_per_batch(tmp_path, caplog):
    """``packing=True`` on an ``IterableDataset`` of images: no lengths ahead, so each batch becomes one packed row
    (logged once with the reason); training runs."""
    stream = _dataset(8).to_iterable_dataset()
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_vision_model("llava", attn_implementation="sdpa"),
            args=_args(tmp_path, packing=True, max_steps=2),
            train_dataset=stream,
            processing_class=tiny_processor("llava"),
        )
    assert trainer.unpack_decision.mode == "pack" and "streamed image dataset" in caplog.text
    assert isinstance(trainer.data_collator, DataCollatorForVisionPacking)
    trainer.train()
    assert trainer.unpack_selfcheck.ok
