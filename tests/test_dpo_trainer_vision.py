"""unpack_trainer.DPOTrainer == trl.DPOTrainer on image preference pairs (a vision-language model with its
processor): one step's loss, every logged metric, the per-pair chosen/rejected log-probs and every gradient, the
vision tower's included, fp32; each image encoded once per pair and each prompt (its text and image tokens) once on
the packed row, chosen and rejected as its branches. Qwen2.5-VL (multi-axis RoPE: every branch's positions read from
its full sequence's ``get_rope_index``), LLaVA and Gemma 3 (bidirectional image blocks: the prompt's image tokens
attend to each other both ways on the shared prompt) share their prompts."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import trl
from datasets import Dataset
from dpo_steps import one_dpo_step
from random_images import random_image

from unpack_trainer.configs import DPOConfig
from unpack_trainer.data.preference import pack_vision_pairs
from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model
from unpack_trainer.packed_seq_info import MULTIMODAL_POSITIONS_KEY
from unpack_trainer.trainers.dpo import DPOTrainer

REL = 1e-5
NUM_PAIRS = 3
SHARED = [-1, 0, 0, -1, 3, 3, -1, 6, 6]  # packed_seq_parents: each prompt once, its two completions as branches


def _pairs(n: int = NUM_PAIRS, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(n):
        side = (int(rng.integers(56, 84)), int(rng.integers(56, 84)))
        rows.append(
            {
                "images": [random_image(*side, seed + index)],
                "prompt": [{"role": "user", "content": "describe" + "?" * int(rng.integers(0, 5))}],
                "chosen": [{"role": "assistant", "content": "a shape " * int(rng.integers(1, 3))}],
                "rejected": [{"role": "assistant", "content": "no " * int(rng.integers(1, 4))}],
            }
        )
    return Dataset.from_list(rows)


def one_step(trainer_class, config_class, tmp_path, *, model_type="qwen2_5_vl", reference="model", **config) -> dict:
    """One step of ``trainer_class`` on the first ``NUM_PAIRS`` image pairs (one batch), and the rows of
    ``pixel_values`` each vision tower call received."""
    from peft import LoraConfig, get_peft_model

    policy = tiny_vision_model(model_type, seed=0, attn_implementation="sdpa")
    ref_model = tiny_vision_model(model_type, seed=1, attn_implementation="sdpa") if reference == "model" else None
    if reference == "peft":
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        policy = get_peft_model(policy, lora)
    args = config_class(
        output_dir=str(tmp_path),
        per_device_train_batch_size=NUM_PAIRS,
        report_to=[],
        bf16=False,
        use_cpu=True,
        **config,
    )
    trainer = trainer_class(
        model=policy,
        ref_model=ref_model,
        args=args,
        train_dataset=_pairs(),
        processing_class=tiny_processor(model_type),
    )
    images: list[int] = []
    towers = [model.get_image_features for model in _pretrained_models(trainer)]
    for model, tower in zip(_pretrained_models(trainer), towers, strict=True):
        model.get_image_features = _counting(tower, images)
    try:
        step = one_dpo_step(trainer, [trainer.train_dataset[i] for i in range(NUM_PAIRS)])
    finally:
        for model in _pretrained_models(trainer):
            del model.get_image_features
    return {**step, "images": images}


def _pretrained_models(trainer) -> list:
    models = [trainer.accelerator.unwrap_model(trainer.model)]
    if trainer.ref_model is not None:
        models.append(trainer.ref_model)
    # the multimodal model (it runs the vision tower through its get_image_features)
    return [(model.get_base_model() if hasattr(model, "get_base_model") else model).base_model for model in models]


def _counting(function, images: list[int]):
    def wrapper(pixel_values, *args, **kwargs):
        images.append(int(pixel_values.shape[0]))
        return function(pixel_values, *args, **kwargs)

    return wrapper


def _error(actual, expected, scale: float) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return float((actual - expected).abs().max() / max(scale, 1e-12))


def assert_same_step(ours: dict, stock: dict) -> float:
    """Loss, log-probs and every metric within ``REL``; every gradient within ``REL`` of its tensor's largest entry
    (a tensor whose gradient is 0 in exact arithmetic, an attention's key bias: within ``REL`` of the model's largest
    gradient). Returns the largest relative gradient difference."""
    for what in ("loss", "logps"):
        expected = stock[what]
        assert _error(ours[what], expected, float(expected.abs().max())) <= REL, what
    assert ours["metrics"].keys() == stock["metrics"].keys()
    beta = stock["trainer"].beta
    for key, value in stock["metrics"].items():
        scale = beta * float(stock["logps"].abs().max()) if key.startswith("rewards/") else max(abs(value), 1e-6)
        if key == "rewards/accuracies":
            assert ours["metrics"][key] == value, key
            continue
        assert _error(ours["metrics"][key], value, scale) <= REL, f"metric {key}: {ours['metrics'][key]} vs {value}"
    assert ours["grads"].keys() == stock["grads"].keys()
    largest = max(float(grad.abs().max()) for grad in stock["grads"].values())
    worst = 0.0
    for name, grad in stock["grads"].items():
        scale = float(grad.abs().max())
        scale = scale if scale > REL * largest else largest  # 0 in exact arithmetic: rounding against the largest
        error = _error(ours["grads"][name], grad, scale)
        worst = max(worst, error)
        assert error <= REL, f"gradient of {name}: relative error {error:.2e}"
    return worst


def compare(tmp_path, *, prefix_sharing: bool = True, **kwargs) -> dict:
    stock = one_step(trl.DPOTrainer, trl.DPOConfig, tmp_path / "stock", **kwargs)
    ours = one_step(DPOTrainer, DPOConfig, tmp_path / "ours", prefix_sharing=prefix_sharing, **kwargs)
    assert ours["trainer"].unpack_decision.packed, ours["trainer"].unpack_decision.reason
    ours["worst"] = assert_same_step(ours, stock)
    ours["stock_images"] = stock["images"]
    return ours


@pytest.mark.parametrize(
    "config",
    [
        dict(loss_type=["sigmoid"]),
        dict(loss_type=["ipo"]),
        dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    ],
    ids=["sigmoid", "ipo", "loss_list"],
)
def test_qwen2_5_vl_image_pairs_equal_stock_each_image_once(config, tmp_path):
    ours = compare(tmp_path, **config)
    batch = ours["batch"]
    assert batch["packed_seq_parents"].tolist() == SHARED
    assert batch[MULTIMODAL_POSITIONS_KEY].shape == (4, 1, batch["packed_input_ids"].shape[1])
    # each image once per pair in every forward (policy, reference): half the patches stock encodes
    assert len(ours["images"]) == len(ours["stock_images"]) and ours["images"]
    assert [2 * n for n in ours["images"]] == ours["stock_images"]


def test_llava_image_pairs_equal_stock_each_image_once(tmp_path):
    ours = compare(tmp_path, model_type="llava")
    assert ours["batch"]["packed_seq_parents"].tolist() == SHARED
    assert ours["images"] == [NUM_PAIRS] * 3 and ours["stock_images"] == [2 * NUM_PAIRS] * 3


def test_lora_with_the_adapter_disabled_reference_equals_stock(tmp_path):
    ours = compare(tmp_path, reference="peft")
    assert ours["batch"]["packed_seq_parents"].tolist() == SHARED


def test_gemma3_image_pairs_with_image_blocks_equal_stock_each_image_once(tmp_path, caplog):
    """Gemma 3's image tokens attend to each other both ways: the prompt's image blocks apply on the shared prompt
    (``bidirectional_spans`` on the branched row), so its pairs are shared like any other family's."""
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        ours = compare(tmp_path, model_type="gemma3")
    assert "prefix_sharing is off" not in caplog.text
    assert ours["batch"]["packed_seq_parents"].tolist() == SHARED
    assert "token_type_ids" in ours["batch"] and int(ours["batch"]["token_type_ids"].sum()) > 0
    assert ours["images"] == [NUM_PAIRS] * 3 and ours["stock_images"] == [2 * NUM_PAIRS] * 3


def test_without_prefix_sharing_equals_stock(tmp_path):
    ours = compare(tmp_path, prefix_sharing=False)
    assert ours["batch"]["packed_seq_parents"].tolist() == [-1] * (2 * NUM_PAIRS)
    assert ours["images"] == ours["stock_images"]


def test_training_runs_the_branched_self_check_on_an_image_model(tmp_path):
    args = DPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=NUM_PAIRS, max_steps=1, report_to=[], bf16=False,
        use_cpu=True, save_strategy="no",
    )  # fmt: skip
    trainer = DPOTrainer(
        model=tiny_vision_model("qwen2_5_vl", seed=0),
        ref_model=tiny_vision_model("qwen2_5_vl", seed=1),
        args=args,
        train_dataset=_pairs(),
        processing_class=tiny_processor("qwen2_5_vl"),
    )
    trainer.train()
    assert trainer.unpack_decision.packed and trainer.unpack_selfcheck.ok
    assert trainer.unpack_selfcheck_branched is not None and trainer.unpack_selfcheck_branched.ok
    assert np.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_precomputed_reference_is_refused_as_stock_refuses_it(tmp_path):
    """TRL 1.16 refuses ``precompute_ref_log_probs=True`` on image data (it processes images per batch); so does
    ours, with TRL's error."""
    for trainer_class, config_class in ((trl.DPOTrainer, trl.DPOConfig), (DPOTrainer, DPOConfig)):
        args = config_class(output_dir=str(tmp_path), report_to=[], use_cpu=True, precompute_ref_log_probs=True)
        with pytest.raises(ValueError, match="precompute_ref_log_probs=True` is not supported for vision datasets"):
            trainer_class(
                model=tiny_vision_model("llava"),
                args=args,
                train_dataset=_pairs(1),
                processing_class=tiny_processor("llava"),
            )


def test_pack_vision_pairs_shares_each_prompt_and_keeps_each_image_once():
    # one pair: prompt [5, 3, 6] (3 an image token), chosen [7], rejected [8, 9]; the image's tensors listed twice
    view = {
        "input_ids": torch.tensor([[5, 3, 6, 7, 0], [5, 3, 6, 8, 9]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        "completion_mask": torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]),
        "mm_token_type_ids": torch.tensor([[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]),
        "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]]),
        "pixel_values": torch.arange(8.0).view(4, 2).repeat(2, 1),
    }

    def positions(input_ids, attention_mask, inputs):  # a stand-in numbering: text row, then 3 rows offset by 10
        text = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return torch.stack([text, text + 10, text + 20, text + 30])

    packed = pack_vision_pairs(view, positions=positions)
    assert packed["packed_input_ids"].tolist() == [[5, 3, 6, 7, 8, 9]]
    assert packed["packed_seq_lengths"].tolist() == [3, 1, 2] and packed["packed_seq_parents"].tolist() == [-1, 0, 0]
    assert packed["packed_position_ids"].tolist() == [[0, 1, 2, 3, 3, 4]]
    assert packed["packed_token_index"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 4, 5]]
    assert packed["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0, 0]]
    assert packed["image_grid_thw"].tolist() == [[1, 2, 2]] and packed["pixel_values"].shape == (4, 2)
    assert packed[MULTIMODAL_POSITIONS_KEY][:, 0].tolist() == [
        [p + 10 * k for p in (0, 1, 2, 3, 3, 4)] for k in range(4)
    ]
    unshared = pack_vision_pairs(view, prefix_sharing=False)
    assert unshared["packed_input_ids"].tolist() == [[5, 3, 6, 7, 5, 3, 6, 8, 9]]
    assert unshared["pixel_values"].shape == (8, 2) and MULTIMODAL_POSITIONS_KEY not in unshared
    view["pixel_values"] = torch.arange(16.0).view(8, 2)  # not listed twice: cannot be halved
    with pytest.raises(ValueError, match="does not list every pair's images twice"):
        pack_vision_pairs(view)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava", "gemma3"])
def test_the_branched_self_check_probes_a_shared_image_prompt(model_type):
    """``check_uncontaminated(branched=True)`` on a vision-language model also runs a prompt holding an image shared
    by two completions against each full sequence alone; it fails (the pairs then pack unshared) where the branched
    row cannot be run exactly (image positions the collator did not compute: below). Gemma 3's image blocks apply on
    the shared prompt."""
    from unpack_trainer.models import patch_model
    from unpack_trainer.selfcheck import check_uncontaminated

    model = tiny_vision_model(model_type, attn_implementation="sdpa")
    patch_model(model)
    report = check_uncontaminated(model, branched=True, lengths=(3, 1, 4), measure_contamination=False)
    assert report.ok, report.failure()


def test_the_branched_self_check_fails_without_each_sequences_image_positions(monkeypatch):
    from unpack_trainer.anatomy import vision
    from unpack_trainer.models import patch_model
    from unpack_trainer.selfcheck import check_uncontaminated

    monkeypatch.setattr(vision, "sequence_positions_of", lambda model: None)
    model = tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa")
    patch_model(model)
    report = check_uncontaminated(model, branched=True, lengths=(3, 1, 4), measure_contamination=False)
    assert not report.ok and "needs each full sequence's positions" in report.failure()
