"""unpack_trainer.KTOTrainer == trl.KTOTrainer on unpaired image examples (a vision-language model with its
processor): one step's loss, every logged metric (the KL estimate included), the per-example main / KL log-probs and
every gradient, the vision tower's included, fp32 relative 1e-5. TRL's vision batch is the view; the policy's main row
and KL row each hold every example's prompt (its text and image tokens) once, and the reference row holds each prompt
once with its completion and its KL completion as branches, so each image is encoded once per prompt per row (stock:
once per sequence, four times per step with a KL term; ours: three). Qwen2.5-VL (multi-axis RoPE: every token's
positions read from its full sequence's ``get_rope_index``) and Gemma 3 (bidirectional image blocks)."""

from __future__ import annotations

import pytest
import torch
import trl
from datasets import Dataset
from random_images import random_image
from test_kto_trainer import assert_same_step

from unpack_trainer.configs import KTOConfig
from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model
from unpack_trainer.packed_seq_info import MULTIMODAL_POSITIONS_KEY
from unpack_trainer.trainers.kto import KTOTrainer

BATCH = 4

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _examples(n: int = BATCH) -> Dataset:
    rows = [
        {
            "images": [random_image(56 + 7 * i, 63, i)],
            "prompt": [{"role": "user", "content": "describe" + "?" * i}],
            "completion": [{"role": "assistant", "content": "a shape " * (i % 2 + 1) + "!" * (i % 3)}],
            "label": i % 3 != 1,
        }
        for i in range(n)
    ]
    return Dataset.from_list(rows)


def _towers(trainer) -> list:
    models = [trainer.accelerator.unwrap_model(trainer.model)]
    if trainer.ref_model is not None:
        models.append(trainer.ref_model)
    return [(m.get_base_model() if hasattr(m, "get_base_model") else m).base_model for m in models]


def one_step(trainer_class, config_class, tmp_path, *, model_type="qwen2_5_vl", reference="model", **config) -> dict:
    """One step of ``trainer_class`` on ``BATCH`` image examples (one batch), and the rows of ``pixel_values`` each
    vision tower call of the step received."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    policy = tiny_vision_model(model_type, seed=0, attn_implementation="sdpa")
    ref_model = tiny_vision_model(model_type, seed=1, attn_implementation="sdpa") if reference == "model" else None
    if reference == "peft":
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        policy = get_peft_model(policy, lora)
    args = config_class(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, report_to=[], bf16=False, use_cpu=True, **config
    )
    trainer = trainer_class(
        model=policy,
        ref_model=ref_model,
        args=args,
        train_dataset=_examples(),
        processing_class=tiny_processor(model_type),
    )
    if reference == "peft":  # as after some training: the policy's adapter is not the reference's "ref" adapter
        generator = torch.Generator().manual_seed(7)
        for name, parameter in trainer.model.named_parameters():
            if ".default." in name:
                parameter.data += 0.2 * torch.randn(parameter.shape, generator=generator)
    images: list[int] = []
    for model in _towers(trainer):
        tower = model.get_image_features

        def counting(pixel_values, *a, _tower=tower, **k):
            images.append(int(pixel_values.shape[0]))
            return _tower(pixel_values, *a, **k)

        model.get_image_features = counting
    examples = [dict(trainer.train_dataset[i]) for i in range(BATCH)]
    try:
        batch = trainer._prepare_inputs(trainer.data_collator([dict(e) for e in examples]))
        model = trainer.model.train()
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        step_images = list(images)
    finally:
        for m in _towers(trainer):
            del m.get_image_features
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    # the per-example log-probs: the reference's main / KL ones, then the policy's KL ones
    with torch.no_grad():
        logps = torch.stack([part for part in _reference_logps(trainer, examples) if part is not None])
        if trainer.calculate_KL:  # the policy's KL log-probs (the ``kl`` metric is clamped at 0: compared here)
            run = getattr(trainer, "unpack_run", None)  # ours: the KL row, as its _compute_loss hands it on
            if run is not None:
                run.kl_row = batch.get("packed_kl_row")
            try:
                logps = torch.cat([logps, trainer._compute_kl_logps(model, batch)[None]])
            finally:
                if run is not None:
                    run.kl_row = None
    return {"loss": loss.detach(), "grads": grads, "metrics": metrics, "logps": logps, "trainer": trainer,
            "batch": batch, "images": step_images}  # fmt: skip


def _reference_logps(trainer, examples):
    """The reference's ``(main (B,), KL (B,) or None)`` log-probs in TRL's reference context (a ``ref_model``, or the
    PEFT policy's ``"ref"`` adapter): TRL's padded forwards as its ``_compute_loss`` runs them (stock) or the packed
    reference row (ours), each from the trainer's own collator."""
    from unpack_trainer._trl_compat import reference_forward_context

    batch = trainer._prepare_inputs(trainer.data_collator([dict(e) for e in examples]))
    reference = trainer.ref_model if trainer.ref_model is not None else trainer.model
    if "packed_input_ids" in batch:
        return trainer._packed_reference_logps(
            reference, batch, batch.get("packed_kl_row"), batch.get("packed_ref_row")
        )
    with reference_forward_context(trainer):
        kwargs = {k: v for k, v in batch.items() if not k.startswith("KL_") and k not in ("completion_mask", "label")}
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        main = reference(**kwargs, labels=labels, use_cache=False, fused_lm_head=True).log_probs.sum(-1)
        return main, trl.KTOTrainer._compute_kl_logps(trainer, reference, batch)


def compare(tmp_path, *, prefix_sharing: bool = True, **kwargs) -> dict:
    stock = one_step(trl.KTOTrainer, trl.KTOConfig, tmp_path / "stock", **kwargs)
    ours = one_step(KTOTrainer, KTOConfig, tmp_path / "ours", prefix_sharing=prefix_sharing, **kwargs)
    trainer = ours["trainer"]
    assert trainer.unpack_decision.packed, trainer.unpack_decision.reason
    assert "packed_input_ids" in ours["batch"]
    assert_same_step(ours, stock)
    ours["stock_images"] = stock["images"]
    ours["stock"] = stock
    return ours


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_qwen2_5_vl_image_examples_equal_stock_each_image_once_per_row(loss_type, tmp_path):
    ours = compare(tmp_path, loss_type=loss_type)
    batch = ours["batch"]
    rows = batch["packed_input_ids"].shape[1]
    assert batch[MULTIMODAL_POSITIONS_KEY].shape == (4, 1, rows)
    per_forward = ours["stock_images"][0]
    assert all(n == per_forward for n in ours["stock_images"] + ours["images"])  # every image once per forward
    if loss_type == "kto":  # stock: main, KL (policy), KL, main (reference); ours: main, KL, reference row
        assert len(ours["stock_images"]) == 4 and len(ours["images"]) == 3
        ref_row = batch["packed_ref_row"]
        assert ref_row["packed_seq_parents"].tolist() == [-1, 0, 0, -1, 3, 3, -1, 6, 6, -1, 9, 9]
    else:  # no KL sequences: stock's main forward twice (policy, reference), ours too
        assert len(ours["stock_images"]) == 2 and len(ours["images"]) == 2


def test_gemma3_image_examples_equal_stock_each_image_once_per_row(tmp_path):
    ours = compare(tmp_path, model_type="gemma3")
    assert "token_type_ids" in ours["batch"] and int(ours["batch"]["token_type_ids"].sum()) > 0
    assert len(ours["stock_images"]) == 4 and len(ours["images"]) == 3
    assert ours["batch"]["packed_ref_row"]["packed_seq_parents"].tolist() == [-1, 0, 0, -1, 3, 3, -1, 6, 6, -1, 9, 9]


def test_without_prefix_sharing_equals_stock(tmp_path):
    ours = compare(tmp_path, prefix_sharing=False)
    assert ours["batch"]["packed_ref_row"]["packed_seq_parents"].tolist() == [-1] * (2 * BATCH)
    assert sum(ours["images"]) == sum(ours["stock_images"])  # every sequence's image, as stock encodes them


def test_lora_with_the_ref_adapter_reference_equals_stock(tmp_path):
    ours = compare(tmp_path, reference="peft")
    assert ours["batch"]["packed_ref_row"]["packed_seq_parents"].tolist() == [-1, 0, 0, -1, 3, 3, -1, 6, 6, -1, 9, 9]
    assert len(ours["stock_images"]) == 4 and len(ours["images"]) == 3


def test_training_runs_the_branched_self_check_on_an_image_model(tmp_path):
    args = KTOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=1, report_to=[], bf16=False,
        use_cpu=True, save_strategy="no",
    )  # fmt: skip
    trainer = KTOTrainer(
        model=tiny_vision_model("qwen2_5_vl", seed=0),
        ref_model=tiny_vision_model("qwen2_5_vl", seed=1),
        args=args,
        train_dataset=_examples(),
        processing_class=tiny_processor("qwen2_5_vl"),
    )
    trainer.train()
    assert trainer.unpack_decision.packed and trainer.unpack_selfcheck.ok
    assert trainer.unpack_selfcheck_branched is not None and trainer.unpack_selfcheck_branched.ok
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
