"""Packed vision-language rows under sequence parallelism (DeepSpeed Ulysses, ``sp_size=2``): Qwen2.5-VL (multi-axis
positions) and Gemma 3 (bidirectional image blocks).

- The pieces as pure functions: the vision collator's rows cut-ready for ``N`` shards (padded to a multiple, every
  input that must not be cut carried whole as one object), which images a shard runs through the vision tower and
  which of their features it keeps (against the one-process layout), which vision-language models are exact.
- Two real processes on gloo: a patched model inside ``UlyssesSPAttentionHF``, each process running its half of a
  packed row whose second sample and one of its images cross the cut, == each sample alone (logits, every gradient,
  the vision tower's included), and neither a text token nor an image of one sample moves another's logits; one
  ``SFTTrainer`` step through accelerate and ZeRO-1 (``packing=True``) == the same step in one process.
"""

import pickle
import random
import sys

import pytest
import torch
from test_sequence_parallel import DEEPSPEED, SCRIPTS, _torchrun

from unpack_trainer.anatomy.vision import (
    ImageSelection,
    image_runs,
    sample_positions_of,
    sequence_shard,
    shard_image_selection,
)
from unpack_trainer.data.vision import WHOLE_ROW_KEY, WholeRowInputs, pack_processed
from unpack_trainer.model_zoo.tiny_vision import processed_batch, tiny_vision_model, vision_sample
from unpack_trainer.models import patch_model
from unpack_trainer.models.sequence_parallel import sequence_parallel_reason
from unpack_trainer.packed_seq_info import INFO_KEY, MULTIMODAL_POSITIONS_KEY, PackedSeqInfo

# ---------------------------------------------------------------------------------------------------- pure pieces


def test_the_vision_collator_cuts_ready_rows_for_the_shards():
    model = tiny_vision_model("qwen2_5_vl")
    items = [vision_sample("qwen2_5_vl", model.config, s, seed=i) for i, s in enumerate([[3, (28, 28), 2], [4]])]
    batch = pack_processed(
        processed_batch(items), [7, 4], positions=sample_positions_of(model), seq_info=False, sequence_shards=4
    )
    length = batch["input_ids"].shape[1]
    assert length == 12  # 11 tokens padded to a multiple of 4, the padding a pseudo-sample
    # only what DeepSpeed's adapter can cut along the row; the rest whole, in one object it copies to every process
    assert {k for k, v in batch.items() if torch.is_tensor(v)} == {"input_ids", "labels", "position_ids"}
    assert all(batch[k].shape == (1, length) for k in ("input_ids", "labels", "position_ids"))
    assert batch["labels"][0, 11:].eq(-100).all()
    info = batch[INFO_KEY]
    assert info.sequence_shards == 4 and info.seq_lengths.tolist() == [7, 4, 1]
    whole = batch[WHOLE_ROW_KEY]
    assert isinstance(whole, WholeRowInputs)
    assert set(whole.inputs) == {
        "input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw", MULTIMODAL_POSITIONS_KEY
    }  # fmt: skip
    assert torch.equal(whole.inputs["input_ids"], batch["input_ids"])
    assert whole.inputs[MULTIMODAL_POSITIONS_KEY].shape == (4, 1, length)
    assert whole.inputs["pixel_values"].shape[0] == 4  # one image of 2 x 2 patches
    copy = pickle.loads(pickle.dumps(whole))  # DeepSpeed gathers a batch's non-tensors as pickles
    assert all(torch.equal(copy.inputs[k], v) for k, v in whole.inputs.items())


def test_an_unsharded_vision_row_is_unchanged():
    model = tiny_vision_model("qwen2_5_vl")
    items = [vision_sample("qwen2_5_vl", model.config, [3, (28, 28), 2], seed=0)]
    batch = pack_processed(processed_batch(items), [7], seq_info=True)
    assert WHOLE_ROW_KEY not in batch and "pixel_values" in batch and batch[INFO_KEY].sequence_shards == 1


def test_image_runs_are_the_images_of_a_row():
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert image_runs(mask).tolist() == [[1, 3], [5, 6], [7, 10]]
    assert image_runs(torch.zeros(4, dtype=torch.bool)).shape == (0, 2)


def test_which_images_a_shard_runs_and_which_features_it_keeps():
    """The worked example of the docstring, written by hand: images of 4 and 3 tokens, shards of 5 tokens."""
    mask = torch.zeros(20, dtype=torch.bool)
    mask[2:6] = mask[8:11] = True
    rows = torch.tensor([1, 1])
    assert shard_image_selection(mask, 0, 5, rows) == ImageSelection(0, 1, 0, 1, 0, 3)
    assert shard_image_selection(mask, 5, 10, rows) == ImageSelection(0, 2, 0, 2, 3, 3)
    assert shard_image_selection(mask, 10, 15, rows) == ImageSelection(1, 2, 1, 2, 2, 1)
    # no image token in the shard: the smallest image runs (its rows), none of its features kept
    assert shard_image_selection(mask, 15, 20, torch.tensor([16, 4])) == ImageSelection(1, 2, 16, 20, 0, 0)
    # pixel values that do not split per image: every image runs, the features kept from the row's count
    assert shard_image_selection(mask, 5, 10, None) == ImageSelection(0, 2, 0, -1, 3, 3)
    assert shard_image_selection(torch.zeros(8, dtype=torch.bool), 0, 4, None) is None


@pytest.mark.parametrize("seed", range(20))
def test_the_shards_features_tile_the_rows_features_in_order(seed):
    """Against the one-process layout: each image's features are numbered by the row's image tokens; the features
    each shard keeps of the images it runs are exactly its own image tokens', and the shards' together every image
    token once, in order."""
    rng = random.Random(seed)
    mask, sizes = [], []
    while len(mask) < 60:
        mask += [False] * rng.randint(1, 5)
        size = rng.randint(1, 9)
        mask += [True] * size
        sizes.append(size)
    mask = torch.tensor(mask[:60] + [False] * 4)
    runs = image_runs(mask)
    sizes = (runs[:, 1] - runs[:, 0]).tolist()
    rows = torch.tensor([rng.randint(1, 3) for _ in sizes])
    features = torch.arange(int(mask.sum()))  # one per image token, in the row's order
    per_image = list(torch.split(features, sizes))
    shards = rng.choice([2, 4, 8])
    kept = []
    for shard in range(shards):
        start, end = shard * 64 // shards, (shard + 1) * 64 // shards
        for pixel_rows in (rows, None):
            selection = shard_image_selection(mask, start, end, pixel_rows)
            run = torch.cat(per_image[selection.first : selection.stop])
            keep = run[selection.feature_offset : selection.feature_offset + selection.feature_count]
            assert keep.tolist() == torch.cumsum(mask.long(), 0)[start:end][mask[start:end]].sub(1).tolist()
            if pixel_rows is not None:
                bounds = torch.cat([torch.zeros(1, dtype=torch.long), rows.cumsum(0)])
                expected = (int(bounds[selection.first]), int(bounds[selection.stop]))
                assert (selection.pixel_start, selection.pixel_stop) == expected
        kept.append(keep)
    assert torch.equal(torch.cat(kept), features)


def test_a_shard_outside_a_sequence_parallel_group_is_refused():
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([5, 3]), batch_size=1, seq_len=8).for_sequence_shards(2)
    assert sequence_shard(info, 8) is None  # the whole row (evaluation)
    with pytest.raises(ValueError, match="outside a DeepSpeed Ulysses group"):
        sequence_shard(info, 4)


def test_which_vision_language_models_are_exact_under_ulysses():
    for model_type in ("qwen2_5_vl", "gemma3"):
        assert sequence_parallel_reason(patch_model(tiny_vision_model(model_type)), 2) is None, model_type
    reason = sequence_parallel_reason(patch_model(tiny_vision_model("llava")), 2)
    assert "'vision_language'" in reason and "not supported for this model type" in reason
    # a trainer whose rows do not carry the whole row's vision inputs (only SFT's vision collator does)
    reason = sequence_parallel_reason(patch_model(tiny_vision_model("qwen2_5_vl")), 2, vision_rows=False)
    assert "by SFT's packing only, not in this trainer" in reason


def _row_of(model_type: str, shards: int):
    model = tiny_vision_model(model_type, attn_implementation="sdpa")
    side = 28 if model_type == "qwen2_5_vl" else 56
    items = [vision_sample(model_type, model.config, s, seed=i) for i, s in enumerate([[3, (side, side), 2], [5]])]
    lengths = [item["input_ids"].shape[1] for item in items]
    positions = sample_positions_of(model)
    batch = pack_processed(processed_batch(items), lengths, positions=positions, seq_info=True, sequence_shards=shards)
    return patch_model(model), batch


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_a_whole_row_cut_for_shards_runs_as_the_unsharded_row(model_type):
    """Evaluation under Ulysses (Trainer does not cut evaluation batches, the model runs them whole): the row the
    collator made ready for two shards, given whole with its carried inputs, == the same row packed without shards."""
    model, sharded = _row_of(model_type, 2)
    _, plain = _row_of(model_type, 1)
    sharded.pop("labels")
    plain = {k: v for k, v in plain.items() if k != "labels"}
    length = plain["input_ids"].shape[1]
    with torch.no_grad():
        expected = model(**plain).logits
        logits = model(**sharded).logits[:, :length]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_a_shard_without_the_whole_rows_inputs_is_refused():
    """A trainer that cuts a vision-language row without the whole row's inputs (not SFT's vision collator): the
    shard's forward stops with the reason instead of laying the images over the wrong tokens."""
    model, batch = _row_of("qwen2_5_vl", 2)
    whole = batch.pop(WHOLE_ROW_KEY).inputs
    half = batch["input_ids"].shape[1] // 2
    with pytest.raises(ValueError, match="came without the whole row's inputs"):
        model(
            input_ids=batch["input_ids"][:, :half],
            position_ids=batch["position_ids"][:, :half],
            pixel_values=whole["pixel_values"],
            image_grid_thw=whole["image_grid_thw"],
            **{INFO_KEY: batch[INFO_KEY]},
        )


# ------------------------------------------------------------------------------------------- two processes on gloo


def _one_process_step(model_type: str, saved: dict) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The step of the trained row in one process, without sequence parallelism: the patched model on the whole row,
    TRL's loss (the token mean over the row's trained tokens), the parameters after plain SGD, and before."""
    sys.path.insert(0, SCRIPTS)
    try:
        from sp_vision import LEARNING_RATE, build
    finally:
        sys.path.remove(SCRIPTS)
    model = patch_model(build(model_type))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = saved["batch"]
    info = PackedSeqInfo(batch["info"].seq_lengths, batch_size=1, seq_len=batch["info"].seq_len)
    inputs = dict(batch["whole"])
    logits = model(
        position_ids=info.position_ids(), use_cache=False, **{INFO_KEY: info}, **inputs
    ).logits  # fmt: skip
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    loss.backward()
    updated = {
        n: (p - LEARNING_RATE * p.grad if p.grad is not None else p).detach() for n, p in model.named_parameters()
    }
    return float(loss.detach()), updated, initial


def _check_models(result: dict) -> None:
    for model_type, measured in result.items():
        assert measured["logits"] < 1e-5, (model_type, measured)
        assert measured["gradients"] < 1e-5 * measured["gradient_scale"], (model_type, measured)
        assert measured["vision_gradient_scale"] > 0 and not measured["vision_missing"], (model_type, measured)
        assert measured["vision_gradients"] < 1e-5 * measured["vision_gradient_scale"], (model_type, measured)
        for probe in ("contamination_token", "contamination_image"):
            others, own = measured[probe]
            assert others == 0.0 and own > 1e-3, (model_type, probe, measured)


@DEEPSPEED
@pytest.mark.timeout(420)
@pytest.mark.parametrize("model_type, checked", [("qwen2_5_vl", ("qwen2_5_vl", "gemma3")), ("gemma3", ())])
def test_one_sft_step_of_image_rows_at_sp_2_equals_one_process(tmp_path, model_type, checked):
    """One ``SFTTrainer`` step (``packing=True``) at ``sp_size=2``, ZeRO-1, SGD: the logged loss and every parameter
    update (the vision tower's included) == the step in one process; the row's cut falls inside an image of its
    second sample. After the step, inside the same Ulysses group: each model on a packed row cut inside a sample and
    an image == each sample alone, and no probe moves another sample."""
    result = _torchrun("sp_vision.py", tmp_path, model_type, *checked)
    _check_models(result["models"])
    assert result["mode"] == "pack" and "sequence parallelism (sp_size=2" in result["reason"]
    saved = torch.load(tmp_path / "result.pt", weights_only=False)
    batch = saved["batch"]
    info, ids = batch["info"], batch["whole"]["input_ids"][0]
    cut = info.seq_len // 2
    ends = info.cu_seqlens.tolist()
    assert info.sequence_shards == 2 and any(a < cut < b for a, b in zip(ends[:-2], ends[1:-1]))  # a sample across
    image = tiny_vision_model(model_type).config.image_token_id
    assert ids[cut - 1] == image and ids[cut] == image  # and one of its images
    loss, expected, initial = _one_process_step(model_type, saved)
    assert result["logged"]["loss"] == pytest.approx(loss, rel=1e-5)
    lr = result["logged"]["learning_rate"]
    tower = [name for name in expected if "vision" in name or "visual" in name]
    assert any(not torch.equal(saved["parameters"][name], initial[name]) for name in tower)  # the tower trained
    for name, value in expected.items():
        trained = saved["parameters"][name]
        torch.testing.assert_close(trained / lr, value / lr, rtol=0, atol=2e-5, msg=name)


def test_image_rows_of_a_trainer_that_does_not_carry_them_whole_are_refused(tmp_path, monkeypatch):
    """DPO's image pairs are not cut with the whole row's vision inputs (SFT's vision collator only): under Ulysses
    the trainer refuses a vision-language model with the reason, though the model type is verified for SFT's rows."""
    from test_dpo_trainer_vision import _pairs
    from test_sequence_parallel import _ulysses

    from unpack_trainer import DPOConfig, DPOTrainer
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor
    from unpack_trainer.trainers import sequence_parallel

    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], bf16=False, use_cpu=True)
    trainer = DPOTrainer(
        model=tiny_vision_model("qwen2_5_vl", seed=0, attn_implementation="sdpa"),
        ref_model=tiny_vision_model("qwen2_5_vl", seed=1, attn_implementation="sdpa"),
        args=args,
        train_dataset=_pairs(),
        processing_class=tiny_processor("qwen2_5_vl"),
    )
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(), raising=False)
    trainer.unpack_run.sequence_shards = 2
    with pytest.raises(ValueError, match="cannot train padded under sequence parallelism.*not in this trainer"):
        sequence_parallel.refuse_model(trainer)
