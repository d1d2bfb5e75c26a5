"""GRPOTrainer / RLOOTrainer on a vision-language model: one optimizer step of ours == the same step of stock
``trl.GRPOTrainer`` / ``trl.RLOOTrainer`` padded on image prompts (the same completions sampled, every logged value,
every per-token log-prob and entropy, every gradient, the vision tower's included), each group's image prompt packed
once with its completions as branches and its images encoded once per group.

A tiny Qwen2.5-VL built from its config (:mod:`unpack_trainer.model_zoo.tiny_vision`) with its processor; three image
prompts of 4 completions each per step: two with the same text and image size but different pixels (equal prompt
token ids: only the images tell the groups apart) and one with a longer text and a larger image (left padding, another
image grid). The end-of-sequence logit is raised so that completions end at different lengths. Bounds: fp32, relative
to the largest entry of what is compared (``RTOL`` of the text tests); the measured floor is in docs/vlm.md, "GRPO and
RLOO".
"""

from __future__ import annotations

import pytest
import torch
import trl
from datasets import Dataset
from random_images import random_image
from test_grpo_trainer import assert_same_steps
from test_grpo_trainer import run_steps as run_text_steps

from unpack_trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from unpack_trainer.model_zoo import tiny
from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model
from unpack_trainer.trainers.grpo import _prompt_ids

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

PROCESSOR = tiny_processor("qwen2_5_vl")
PROCESSOR.tokenizer.padding_side = "left"  # as TRL loads a processor itself: its prompts' per-token inputs left-padded


def image_prompts() -> Dataset:
    """Two prompts of equal text and image size (different pixels) and one longer prompt with a larger image."""
    rows = [("what is it?", 56, 56, 0), ("what is it?", 56, 56, 1), ("describe the picture, please", 84, 112, 2)]
    return Dataset.from_list(
        [
            {"image": random_image(h, w, seed), "prompt": [{"role": "user", "content": text}]}
            for text, h, w, seed in rows
        ]
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


def vision_tower(model):
    """The vision tower of a tiny vision-language model (Qwen2-VL's ``visual``, LLaVA's and Gemma 3's
    ``vision_tower``, Idefics3's ``vision_model``): each call encodes the images it is handed."""
    inner = model.model
    return next(getattr(inner, name) for name in ("visual", "vision_tower", "vision_model") if hasattr(inner, name))


class _VisionWatch:
    """Around every log-prob call: its inputs, and how many images the vision towers (the policy's and the
    reference's) encoded in it."""

    def __init__(self, trainer) -> None:
        towers = [vision_tower(trainer.model)]
        if getattr(trainer, "ref_model", None) is not None:
            towers.append(vision_tower(trainer.ref_model))
        self.images: list[int] = []
        self.results = {"encoded": [], "inputs": []}
        self.handles = [tower.register_forward_pre_hook(self._count, with_kwargs=True) for tower in towers]

    def _count(self, module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        self.images.append(int(grid.shape[0] if grid is not None else pixels.shape[0]))

    def before(self, args, kwargs):
        self.results["inputs"].append((args, kwargs))
        self.images.clear()

    def after(self):
        self.results["encoded"].append(sum(self.images))

    def close(self):
        for handle in self.handles:
            handle.remove()


def run_steps(trainer_class, config_class, tmp_path, model, processor=PROCESSOR, **config) -> dict:
    """``max_steps`` (default 1) seeded optimizer steps of ``trainer_class`` on the image prompts
    (:func:`test_grpo_trainer.run_steps`): what it logged, its gradients, every log-prob call's outputs and inputs,
    its completions, the images its vision tower encoded per call."""
    defaults = dict(per_device_train_batch_size=12, num_generations=4, max_completion_length=8)
    return run_text_steps(trainer_class, config_class, tmp_path, model, train_dataset=image_prompts(),
                          processing_class=processor, reward_funcs=count_a, defaults=defaults, watch=_VisionWatch,
                          **config)  # fmt: skip


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
    shared = ours["trainer"]._unpack_sharing()
    for forward, (count, (logps, _, _)) in enumerate(zip(stock["encoded"], stock["calls"])):
        units = count // logps.shape[0]  # what the tower encodes per image: 1, or LLaVA-NeXT's tiles
        assert count == units * logps.shape[0]  # stock: one image per completion
        if shared:  # ours: each group's image once per forward (or chunk)
            assert ours["encoded"][forward] <= 3 * units < count
        else:
            assert ours["encoded"][forward] == count
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
    ids, mask = input_ids.cpu(), attention_mask.cpu()
    prompts = _prompt_ids(ids, mask, logits_to_keep) if trainer._unpack_sharing() else None
    chunks = trainer._unpack_chunks(ids, mask, logits_to_keep, 1, fixed=False, prompts=prompts)
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


# Other families' layouts of TRL's vision inputs (``trainers.image_prompts``): one entry of ``pixel_values`` per image
# (LLaVA; LLaVA-NeXT, its images in tiles, with ``image_sizes``; Gemma 3 with ``token_type_ids`` and bidirectional
# image blocks inside the shared prompt; Gemma 4 with ``image_position_ids``, its blocks on its sliding-window layers)
# and one per row (SmolVLM, with ``pixel_attention_mask``); 1-D positions. Qwen3.5 (multi-axis positions and
# gated-delta-net layers that carry state): packed, each completion after its own copy of its prompt. The
# end-of-sequence boost that ends their completions at different lengths with seed 7.
FAMILIES = {"llava": 2.5, "llava_next": 2.5, "smolvlm": 2.5, "gemma3": 4.0, "gemma4": 4.0, "qwen3_5": 2.5}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_one_grpo_step_on_another_familys_image_prompts_equals_stock(model_type, tmp_path):
    processor = tiny_processor(model_type)
    processor.tokenizer.padding_side = "left"
    model = tiny_vision_model(model_type, attn_implementation="sdpa")
    model = tiny.raise_token_logit(model, processor.tokenizer.eos_token_id, FAMILIES[model_type])
    stock = run_steps(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, model, processor=processor)
    ours = run_steps(GRPOTrainer, GRPOConfig, tmp_path, model, processor=processor)
    assert ours["trainer"].unpack_decision.packed, ours["trainer"].unpack_decision
    assert ours["trainer"]._unpack_sharing() == (model_type != "qwen3_5")
    assert model_type == "qwen3_5" or ours["trainer"].unpack_selfcheck_branched.ok
    assert ours["trainer"].unpack_stats["forwards"]["padded"] == 0
    _check(ours, stock)


def test_row_slices_read_each_layout_trl_cuts():
    """Each row's entries in TRL's vision tensors, per layout: grids (Qwen2-VL), one entry per image (LLaVA, with
    ``image_sizes``), one per row (Idefics3, with ``pixel_attention_mask``), tiles (LFM2-VL)."""
    from unpack_trainer.trainers.image_prompts import row_slices

    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 2, 2]])
    qwen = row_slices({"pixel_values": torch.zeros(16, 5), "image_grid_thw": grid, "num_images": [2, 0, 1]}, 3)
    assert qwen.slices == {"pixel_values": [(0, 12), (12, 12), (12, 16)], "image_grid_thw": [(0, 2), (2, 2), (2, 3)]}
    llava = row_slices({"pixel_values": torch.zeros(3, 3, 4, 4), "image_sizes": torch.zeros(3, 2),
                        "num_images": [1, 2, 0]}, 3)  # fmt: skip
    assert llava.slices["pixel_values"] == llava.slices["image_sizes"] == [(0, 1), (1, 3), (3, 3)]
    idefics = row_slices({"pixel_values": torch.zeros(2, 3, 3, 4, 4), "pixel_attention_mask": torch.zeros(2, 3, 4, 4),
                          "num_images": [3, 1]}, 2)  # fmt: skip
    assert idefics.slices["pixel_values"] == idefics.slices["pixel_attention_mask"] == [(0, 1), (1, 2)]
    tiles = {"pixel_values": torch.zeros(5, 4), "pixel_attention_mask": torch.zeros(5, 4),
             "spatial_shapes": torch.zeros(5, 2), "num_images": [1, 1], "num_tiles": [2, 3]}  # fmt: skip
    assert set(row_slices(tiles, 2).slices) == {"pixel_values", "pixel_attention_mask", "spatial_shapes"}
    assert row_slices(tiles, 2).slices["spatial_shapes"] == [(0, 2), (2, 5)]
    assert row_slices({"mm_token_type_ids": torch.zeros(2, 4)}, 2).slices == {}


def test_vision_inputs_of_no_known_layout_name_the_reason_the_forward_runs_padded():
    from unpack_trainer.trainers.image_prompts import row_slices

    grid = torch.tensor([[1, 2, 2]])
    assert "without num_images" in row_slices({"pixel_values": torch.zeros(4, 5), "image_grid_thw": grid}, 1)
    assert "video_grid_thw" in row_slices({"video_grid_thw": grid}, 1)
    wrong = row_slices({"pixel_values": torch.zeros(3, 3, 4, 4), "num_images": [1, 1]}, 2)
    assert "does not hold [1, 1] entries" in wrong


def test_images_tell_groups_apart():
    """Rows with equal prompt token ids but different images are different groups; rows whose images are equal
    share one prompt segment (and one encoding of the image)."""
    from unpack_trainer.trainers.image_prompts import image_keys, row_slices

    vision = {"pixel_values": torch.randn(4 * 4, 5), "image_grid_thw": torch.tensor([[1, 2, 2]] * 4),
              "num_images": [1, 1, 1, 1]}  # fmt: skip
    vision["pixel_values"][8:12] = vision["pixel_values"][0:4]  # rows 0 and 2: the same image
    slices = row_slices(vision, 4)
    assert slices.slices["pixel_values"] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    keys = image_keys(vision, slices, [(7, 8)] * 3 + [(9,)])
    assert keys[0] == keys[2] and len({keys[0], keys[1], keys[3]}) == 3
