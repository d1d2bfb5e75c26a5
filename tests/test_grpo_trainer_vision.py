"""GRPOTrainer / RLOOTrainer on a vision-language model: one optimizer step of ours == the same step of stock
``trl.GRPOTrainer`` / ``trl.RLOOTrainer`` padded on image prompts (the same completions sampled, every logged value,
every per-token log-prob and entropy, every gradient, the vision tower's included), each group's image prompt packed
once with its completions as branches and its images encoded once per group.

A tiny Qwen2.5-VL built from its config (:mod:`unpack_trainer.models.tiny_vision`) with its processor; three image
prompts of 4 completions each per step: two with the same text and image size but different pixels (equal prompt
token ids: only the images tell the groups apart) and one with a longer text and a larger image (left padding, another
image grid). The end-of-sequence logit is raised so that completions end at different lengths. Bounds: fp32, relative
to the largest entry of what is compared (``RTOL`` of the text tests); the measured floor is in docs/vlm.md, "GRPO and
RLOO".
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
import trl
from datasets import Dataset
from PIL import Image
from test_grpo_trainer import _Recorder, assert_same_steps

from unpack_trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from unpack_trainer.models import tiny
from unpack_trainer.models.tiny_vision import tiny_processor, tiny_vision_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")
PROCESSOR = tiny_processor("qwen2_5_vl")
PROCESSOR.tokenizer.padding_side = "left"  # as TRL loads a processor itself: its prompts' per-token inputs left-padded


def _image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def image_prompts() -> Dataset:
    """Two prompts of equal text and image size (different pixels) and one longer prompt with a larger image."""
    rows = [("what is it?", 56, 56, 0), ("what is it?", 56, 56, 1), ("describe the picture, please", 84, 112, 2)]
    return Dataset.from_list(
        [{"image": _image(h, w, seed), "prompt": [{"role": "user", "content": text}]} for text, h, w, seed in rows]
    )


def count_a(completions, **kwargs):
    """How many ``a`` a completion holds, minus a length term (so a group's rewards differ)."""
    return [float(str(c).count("a")) - 0.1 * len(str(c)) for c in completions]


@pytest.fixture(scope="module")
def qwen():
    model = tiny_vision_model("qwen2_5_vl", attn_implementation="sdpa")
    return tiny.raise_token_logit(model, PROCESSOR.tokenizer.eos_token_id, 2.5)


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory, qwen):
    """The tiny Qwen2.5-VL saved as a folder: TRL builds a separate reference model (``beta > 0``) from it."""
    path = tmp_path_factory.mktemp("grpo-qwen2_5_vl")
    qwen.save_pretrained(path)
    return str(path)


def run_steps(trainer_class, config_class, tmp_path, model, processor=PROCESSOR, **config) -> dict:
    """``max_steps`` (default 1) seeded optimizer steps of ``trainer_class`` on the image prompts: what it logged,
    its gradients, every log-prob call's outputs, its completions, the images its vision tower encoded per call."""
    config = (
        dict(
            per_device_train_batch_size=12,
            num_generations=4,
            max_completion_length=8,
            max_steps=1,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=7,
            save_strategy="no",
            disable_tqdm=True,
        )
        | config
    )
    args = config_class(output_dir=str(tmp_path / trainer_class.__name__), **config)
    recorder = _Recorder()
    trainer = trainer_class(
        model=model if isinstance(model, str) else copy.deepcopy(model),
        reward_funcs=count_a,
        args=args,
        train_dataset=image_prompts(),
        processing_class=processor,
        callbacks=[recorder],
    )
    calls, completions, encoded, inputs = [], [], [], []
    logps_method, generate = trainer._get_per_token_logps_and_entropies, trainer._generate
    towers = [trainer.model.model.visual]
    if getattr(trainer, "ref_model", None) is not None:
        towers.append(trainer.ref_model.model.visual)
    images: list[int] = []

    def count_images(module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        images.append(int(grid.shape[0]))

    handles = [tower.register_forward_pre_hook(count_images, with_kwargs=True) for tower in towers]

    def recorded_logps(*args, **kwargs):
        inputs.append((args, kwargs))
        images.clear()
        logps, entropies, aux = logps_method(*args, **kwargs)
        calls.append((logps.detach().clone(), None if entropies is None else entropies.detach().clone(), aux))
        encoded.append(sum(images))
        return logps, entropies, aux

    def recorded_generate(prompts):
        out = generate(prompts)
        completions.append([list(ids) for ids in out[1]])
        return out

    trainer._get_per_token_logps_and_entropies, trainer._generate = recorded_logps, recorded_generate
    try:
        trainer.train()
    finally:
        for handle in handles:
            handle.remove()
    logs = [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in trainer.state.log_history]
    return {
        "logs": logs, "grads": recorder.grads, "calls": calls, "completions": completions, "trainer": trainer,
        "encoded": encoded, "inputs": inputs,
    }  # fmt: skip


GRPO_CASES = {
    "dapo": {},  # TRL's default loss, beta 0, old log-probs = the current ones
    "grpo, beta > 0 (separate reference model), temperature": dict(loss_type="grpo", beta=0.1, temperature=0.7),
    # the second step starts from weights that differ by rounding; at a learning rate of 1e-2 Adam's normalised
    # update turns that into 1e-5 there (stock against itself repadded: 6e-7), at 1e-4 ours stays at 3e-7
    "dr_grpo, num_iterations 2 (old policy forward), masked truncated completions": dict(
        loss_type="dr_grpo", num_iterations=2, max_steps=2, mask_truncated_completions=True, learning_rate=1e-4
    ),
    # generation every 2 steps: 12 rows generated, 6 per optimizer step (TRL shuffles them, so a step holds parts of
    # groups, each sharing its prompt and image), the old policy's forward over all 12 rows
    "bnpo, steps_per_generation 2 (partial groups, chunked forwards), sequence importance sampling": dict(
        loss_type="bnpo",
        steps_per_generation=2,
        per_device_train_batch_size=6,
        max_steps=2,
        importance_sampling_level="sequence",
        learning_rate=1e-4,
    ),  # fmt: skip
}


def _check(ours: dict, stock: dict) -> dict:
    measured = assert_same_steps(ours, stock)
    assert stock["encoded"] and len(ours["encoded"]) == len(stock["encoded"])
    for forward, (count, (logps, _, _)) in enumerate(zip(stock["encoded"], stock["calls"])):
        assert count == logps.shape[0]  # stock: one image per completion
        assert ours["encoded"][forward] <= 3 < count  # ours: each group's image once per forward (or chunk)
    return measured


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_one_grpo_step_on_image_prompts_equals_stock(case, tmp_path, qwen, qwen_path):
    config = GRPO_CASES[case]
    model = qwen_path if config.get("beta") else qwen
    stock = run_steps(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, model, **config)
    ours = run_steps(GRPOTrainer, GRPOConfig, tmp_path, model, **config)
    assert ours["trainer"].unpack_decision.packed, ours["trainer"].unpack_decision
    assert ours["trainer"].unpack_selfcheck_branched.ok
    _check(ours, stock)


def test_a_forward_packed_in_several_chunks_equals_stock(tmp_path, qwen):
    """A forward whose packed rows are split into chunks (TRL's ``batch_size`` of 1 row: a chunk holds at most one
    padded row's tokens, so a group's completions spread over chunks): each chunk carries its own rows' images and
    positions; the log-probs and entropies equal TRL's for the same inputs."""
    ours = run_steps(GRPOTrainer, GRPOConfig, tmp_path, qwen)
    trainer = ours["trainer"]
    (model, input_ids, attention_mask, logits_to_keep), kwargs = ours["inputs"][0]
    kwargs = {**kwargs, "batch_size": 1, "compute_entropy": True}
    chunks = trainer._unpack_chunks(input_ids.cpu(), attention_mask.cpu(), logits_to_keep, 1, fixed=False)
    assert len(chunks) > 3, chunks  # more chunks than groups
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention_mask, logits_to_keep, **kwargs
        )
        stock_logps, stock_entropies, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention_mask, logits_to_keep, **kwargs
        )
    assert float((logps - stock_logps).abs().max()) <= 1e-5 * float(stock_logps.abs().max())
    assert float((entropies - stock_entropies).abs().max()) <= 1e-5 * float(stock_entropies.abs().max())
    assert trainer.unpack_stats["forwards"]["padded"] == 0


def test_one_rloo_step_on_image_prompts_equals_stock(tmp_path, qwen_path):
    """RLOO's default ``beta=0.05``: the policy and a separate reference model, both packed."""
    stock = run_steps(trl.RLOOTrainer, trl.RLOOConfig, tmp_path, qwen_path)
    ours = run_steps(RLOOTrainer, RLOOConfig, tmp_path, qwen_path)
    assert ours["trainer"].unpack_decision.packed
    _check(ours, stock)


def test_a_vision_language_model_without_image_grids_trains_stock_with_its_reason(tmp_path, caplog):
    """GRPO shares image prompts for the Qwen2-VL family (images laid out by ``image_grid_thw``, positions from its
    ``get_rope_index``); another vision-language model keeps TRL's padded path, logged once with the reason."""
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to=[],
                      use_cpu=True, bf16=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = GRPOTrainer(model=tiny_vision_model("llava"), reward_funcs=count_a, args=args,
                              train_dataset=image_prompts(), processing_class=tiny_processor("llava"))  # fmt: skip
    assert trainer.unpack_decision.mode == "padded"
    assert "image_grid_thw" in trainer.unpack_decision.reason
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GRPOTrainer: mode=padded")]
    assert len(lines) == 1


def test_images_tell_groups_apart():
    """Rows with equal prompt token ids but different images are different groups; rows whose images are equal
    share one prompt segment (and one encoding of the image)."""
    from unpack_trainer.trainers.image_prompts import image_keys, row_images

    pixel_values = torch.randn(4 * 4, 5)
    pixel_values[8:12] = pixel_values[0:4]  # rows 0 and 2: the same image
    rows = row_images(torch.tensor([[1, 2, 2]] * 4), [1, 1, 1, 1])
    assert rows.pixels == [(0, 4), (4, 8), (8, 12), (12, 16)]
    keys = image_keys(pixel_values, rows, [(7, 8)] * 3 + [(9,)])
    assert keys[0] == keys[2] and len({keys[0], keys[1], keys[3]}) == 3


def test_another_familys_vision_inputs_name_the_reason_the_forward_runs_padded():
    from unpack_trainer.trainers.image_prompts import image_inputs_problem

    pixels, grid = torch.zeros(4, 5), torch.tensor([[1, 2, 2]])
    assert image_inputs_problem({"pixel_values": pixels, "image_grid_thw": grid, "num_images": [1]}) is None
    assert "pixel_attention_mask" in image_inputs_problem({"pixel_values": pixels, "pixel_attention_mask": pixels})
    assert "token_type_ids" in image_inputs_problem({"token_type_ids": torch.zeros(1, 3, dtype=torch.int64)})
    assert "without image_grid_thw" in image_inputs_problem({"pixel_values": pixels, "num_images": [1]})
