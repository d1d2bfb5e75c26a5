"""``SFTTrainer`` on vision-language models: the decision packs verified families with their processor and image data
(and says why not elsewhere), padding-free training equals stock TRL's padded training step by step, ``packing=True``
packs the examples ahead into rows with every image whole, a failed self-check falls back to TRL's padded path, an
example whose image tokens do not fit is named before training, and a step with gradient accumulation is the mean over
every trained token of the step, whatever the model class's ``accepts_loss_kwargs``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import trl
from datasets import Dataset
from random_images import random_image
from transformers import TrainerCallback

from unpack_trainer import SFTConfig, SFTTrainer
from unpack_trainer.data.vision import VISION_ROWS_KEY, DataCollatorForVisionPacking, VisionRows
from unpack_trainer.decision import decide
from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_config, tiny_vision_model
from unpack_trainer.models import is_patched, supported_model_types


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
    from unpack_trainer.selfcheck import ContaminationReport
    from unpack_trainer.trainers import contamination

    failed = ContaminationReport(False, 1.0, 1e-4, float("nan"), torch.float32, 0.0)
    monkeypatch.setattr(contamination, "check_uncontaminated", lambda model, **kwargs: failed)
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


def _with_many_images(n: int, index: int) -> Dataset:
    """``_dataset(n)`` with example ``index`` holding four 112 x 112 images (on Qwen2.5-VL its last image token is
    its 79th; the others' are within their first 21)."""
    rows = [dict(row) for row in _dataset(n)]
    rows[index]["images"] = [random_image(112, 112, k) for k in range(4)]
    return Dataset.from_list(rows)


def test_padding_free_and_evaluation_name_the_dataset_example(tmp_path):
    """Batches of dataset examples (padding-free training, flattened evaluation) name an example whose images do not
    fit by its index and its dataset (an evaluation dict's key), not by its place in the batch."""
    trainer = SFTTrainer(
        model=tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa"),
        args=_args(tmp_path, padding_free=True, max_length=70, max_steps=2),
        train_dataset=_with_many_images(6, 4),
        eval_dataset={"val": _with_many_images(3, 2)},
        processing_class=tiny_processor("qwen2_5_vl"),
    )
    assert trainer.unpack_decision.mode == "padding_free"
    with pytest.raises(ValueError, match=r"^Example 4 of the train dataset has \d+ tokens, more than max_length=70"):
        trainer.train()
    with pytest.raises(ValueError, match=r"^Example 2 of the val dataset has \d+ tokens, more than max_length=70"):
        trainer.evaluate()
    with pytest.raises(ValueError, match=r"^Example 1 of the eval dataset has \d+ tokens"):
        trainer.evaluate(eval_dataset=_with_many_images(2, 1))


def test_an_example_whose_image_placeholders_disagree_is_named(tmp_path):
    """An example with more image placeholders than images, refused by TRL when every example is processed at trainer
    start (``packing=True``), is named with its dataset and its counts."""
    rows = []
    for index in range(5):
        placeholders = [{"type": "image", "text": None}] * (2 if index == 3 else 1)
        user = {"role": "user", "content": [*placeholders, {"type": "text", "text": "describe"}]}
        reply = {"role": "assistant", "content": [{"type": "text", "text": "a shape"}]}
        rows.append({"images": [random_image(64, 64, index)], "messages": [user, reply]})
    with pytest.raises(
        ValueError,
        match=r"^Example 3 of the train dataset \(1 image\) could not be processed: Number of images provided \(1\) "
        r"does not match number of image placeholders \(2\)",
    ):
        SFTTrainer(
            model=tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa"),
            args=_args(tmp_path, packing=True),
            train_dataset=Dataset.from_list(rows),
            processing_class=tiny_processor("qwen2_5_vl"),
        )


@pytest.mark.parametrize("packing", [False, True])
def test_truncated_text_is_counted_in_unpack_stats(packing, tmp_path, caplog):
    """Text cut after the last image token: counted in ``trainer.unpack_stats["truncation"]`` and logged with the
    counts, up front where every example is processed at trainer start (``packing=True``), as the batches are read
    otherwise (the first cut when it happens, the totals at the end of training)."""
    dataset = _dataset(8)
    process = trl.trainer.sft_trainer.DataCollatorForVisionLanguageModeling(tiny_processor("qwen2_5_vl"))
    lengths = [int(process([dict(example)])["attention_mask"].sum()) for example in dataset]
    over, cut = sum(n > 60 for n in lengths), sum(max(n - 60, 0) for n in lengths)
    assert 0 < over < 8
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa"),
            args=_args(tmp_path, packing=packing, padding_free=not packing, max_length=60, max_steps=2),
            train_dataset=dataset,
            processing_class=tiny_processor("qwen2_5_vl"),
        )
        counts = trainer.unpack_stats["truncation"]
        if packing:
            assert (counts.read, counts.over, counts.cut_tokens) == (8, over, cut)
            assert f"train dataset: {over} of 8 image samples are longer than max_length=60" in caplog.text
        trainer.train()
    assert (counts.read, counts.over, counts.cut_tokens) == (8, over, cut)
    if not packing:
        assert "image samples of a batch were longer than max_length=60" in caplog.text
        assert f"train dataset: {over} of 8 image samples read were longer than max_length=60" in caplog.text


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


# --------------------------------------------------------------------------------------------------------------------
# Gradient accumulation
# --------------------------------------------------------------------------------------------------------------------


def _accumulation_dataset() -> Dataset:
    """One long example and three short ones, one image each: packed into rows of the long one's length, the long one
    fills a row alone and the short ones share the other, so the two rows differ about 2 to 4x in trained tokens."""
    rows = []
    for index, words in enumerate((80, 2, 3, 2)):
        rows.append(
            {
                "images": [random_image(56 + 8 * index, 84, index)],
                "messages": [
                    {"role": "user", "content": "describe"},
                    {"role": "assistant", "content": "a shape " * words},
                ],
            }
        )
    return Dataset.from_list(rows)


def _accumulation_trainer(model_type: str, tmp_path, max_length: int, model=None, callbacks=()) -> SFTTrainer:
    """``packing=True``, one row per micro-batch, two micro-batches per optimizer step, one step, no clipping; ``model``
    (default: a new tiny one) of the family ``model_type``."""
    args = _args(
        tmp_path, packing=True, max_length=max_length, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=1, max_grad_norm=0.0,
    )  # fmt: skip
    return SFTTrainer(
        model=model if model is not None else tiny_vision_model(model_type, attn_implementation="sdpa"),
        args=args,
        train_dataset=_accumulation_dataset(),
        processing_class=tiny_processor(model_type),
        callbacks=list(callbacks),
    )


class _FirstStepGradients(TrainerCallback):
    """Keeps every parameter's gradient at the first optimizer step, before the optimizer reads it (``grads``: name ->
    a clone, fp32)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _token_losses(trainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Every trained token's cross-entropy in ``batch`` (a collated micro-batch, ``labels`` ``(B, T)`` int64): the
    logits ``(B, T, V)`` of ``trainer.model`` at position ``j - 1`` against label ``j != -100``, ``(trained tokens,)``
    fp32; and the batch's weighted router loss (a mixture of experts where TRL adds it: ``router_aux_loss_coef *
    aux_loss``, a scalar; else 0)."""
    inputs = {key: value for key, value in batch.items() if key != "labels"} | {"use_cache": False}
    if trainer.aux_loss_enabled:
        inputs["output_router_logits"] = True
    outputs = trainer.model(**inputs)
    logits = outputs.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    trained = labels != -100
    losses = torch.nn.functional.cross_entropy(logits[trained], labels[trained], reduction="none")
    aux = trainer.router_aux_loss_coef * outputs.aux_loss if trainer.aux_loss_enabled else torch.zeros(())
    return losses, aux


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "gemma4"])
def test_accumulated_step_is_the_mean_over_every_trained_token(model_type, tmp_path):
    """Issue 46 item 2: with ``gradient_accumulation_steps=2`` the step's logged loss and every gradient are the mean
    over every trained token of the step (the sum of the per-token losses of both micro-batches / their count, plus a
    mixture of experts' router loss as TRL adds it), computed by hand from the micro-batches the trainer ran (fp32:
    loss relative 1e-5, each gradient within 1e-5 of its tensor's largest entry), for the model classes that declare
    ``accepts_loss_kwargs = False`` (Qwen2.5-VL, Qwen3-VL and its MoE, Qwen3.5, Gemma 4: transformers' Trainer then
    counts no tokens, and the step was the two rows' own means averaged, the short row's tokens weighing 2-4x as much
    as the long row's) as for those that do not (Qwen2-VL); the class's flag is left as it was."""
    model = tiny_vision_model(model_type, attn_implementation="sdpa")
    class_flag = getattr(type(model), "accepts_loss_kwargs", None)
    # rows of the long example's length: it alone in one row, the three short ones in the other
    lengths = _accumulation_trainer(model_type, tmp_path / "lengths", 4096).train_dataset.lengths
    gradients = _FirstStepGradients()
    trainer = _accumulation_trainer(model_type, tmp_path, max(lengths), model, [gradients])
    assert trainer.unpack_decision.mode == "pack"
    assert sorted(map(len, trainer.train_dataset.rows)) == [1, 3]
    assert getattr(type(model), "accepts_loss_kwargs", None) == class_flag and "accepts_loss_kwargs" not in vars(model)
    batches = []
    training_step = trainer.training_step

    def recording_step(model, inputs, *args, **kwargs):
        batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return training_step(model, inputs, *args, **kwargs)

    trainer.training_step = recording_step
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    trainer.train()
    logged = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)

    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)
    per_row, aux = zip(*(_token_losses(trainer, batch) for batch in batches))
    counts = [row.numel() for row in per_row]
    assert len(per_row) == 2 and max(counts) >= 1.8 * min(counts), counts
    router = sum(aux) / 2  # a mixture of experts: TRL's router loss, each micro-batch's own, averaged over the step
    expected = torch.cat(per_row).sum() / sum(counts) + router
    expected.backward()
    row_means = sum(row.mean().item() for row in per_row) / 2 + router.item()  # each row's own mean, as before
    assert abs(row_means - expected.item()) > 1e-3, "the rows' mean losses are too close to tell the two apart"
    assert logged == pytest.approx(expected.item(), rel=1e-5), (logged, expected.item(), row_means)
    assert gradients.grads is not None
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        scale = parameter.grad.abs().max().item()
        error = (gradients.grads[name] - parameter.grad).abs().max().item()
        assert error <= 1e-5 * max(scale, 1e-8), f"{name}: {error} (largest entry {scale})"


def test_the_step_token_count_is_left_as_stock_where_asked(tmp_path, monkeypatch):
    """The count of a step's trained tokens (see the test above) is this trainer's own: padded batches take it too
    (``padding_free=False``, for a class that declares ``accepts_loss_kwargs = False``), but ``UNPACK_DISABLE=1``
    trains as stock TRL (no count: each micro-batch's own mean) and ``loss_normalization="sample"`` counts samples."""

    def built(**config):
        return SFTTrainer(
            model=tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa"),
            args=_args(tmp_path, gradient_accumulation_steps=2, **config),
            train_dataset=_dataset(4),
            processing_class=tiny_processor("qwen2_5_vl"),
        )

    padded = built(padding_free=False)
    assert padded.unpack_decision.mode == "padded" and padded.model_accepts_loss_kwargs
    sample = built(loss_normalization="sample")
    assert sample.unpack_run.sample_loss and not sample.model_accepts_loss_kwargs
    monkeypatch.setenv("UNPACK_DISABLE", "1")
    stock = built()
    assert stock.unpack_decision.mode == "stock" and not stock.model_accepts_loss_kwargs
