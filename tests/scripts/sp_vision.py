"""Run by tests/test_sequence_parallel_vision.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): packed image rows
of tiny vision-language models under DeepSpeed Ulysses (``sp_size=2``).

Usage: ``sp_vision.py OUTPUT_DIR MODEL_TYPE [CHECKED ...]``.

- One ``SFTTrainer`` step of ``MODEL_TYPE`` (``packing=True``, ZeRO-1, SGD) at ``sp_size=2`` as a user sets it up;
  rank 0 writes OUTPUT_DIR/result.pt (the row it trained on and the parameters after the step: the test computes the
  step in one process) and OUTPUT_DIR/result.json (the logged loss and the trainer's decision).
- Then, inside the Ulysses group accelerate set up (one launch for both), each model type of ``CHECKED`` patched,
  each process running its half of one packed row (a sample and one of its images across the cut) as the collator
  builds it for sequence parallelism, against each sample alone in one process (computed before accelerate registers
  Ulysses): the logits, every gradient (the vision tower's included) and the contamination probes (a text token, then
  an image, of the first sample changed); their largest differences under ``models`` in OUTPUT_DIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

SP = 2
LEARNING_RATE = 0.5
# The length every trained row is padded to (gloo gathers equal shapes only), chosen so that the cut at its half falls
# inside an image of the second sample of rank 0's first row (the test checks it).
ROW = {"qwen2_5_vl": 104, "gemma3": 108}


def segments(model_type: str) -> list[list]:
    """The samples of the probed row, as :func:`vision_sample` segments: three samples, the second across the cut at
    half the row, its first image cut by it (the row's length is checked in :func:`row`)."""
    from unpack_trainer.model_zoo.tiny_vision import image_size, tiny_vision_config

    side = image_size(model_type, tiny_vision_config(model_type))[0]
    if model_type == "gemma3":  # 4 image tokens per image, between two markers
        return [[5, (side, side), 3], [4, (side, side), 2, (side, side), 3], [6]]
    # qwen: a (2 side) x (2 side) image is 4 merged tokens, 2 side x 3 side 6
    return [[5, (2 * side, 2 * side), 3], [4, (2 * side, 3 * side), 2, (2 * side, 2 * side), 3], [6]]


def samples(model, model_type: str) -> list[dict]:
    from unpack_trainer.model_zoo.tiny_vision import vision_sample

    return [vision_sample(model_type, model.config, s, seed=index) for index, s in enumerate(segments(model_type))]


def row(model, model_type: str, items: list[dict]) -> dict:
    """The packed row of ``items`` for ``SP`` processes, as the vision collator builds it under sequence parallelism;
    checked: a sample and one of its images cross the cut."""
    from unpack_trainer.anatomy.vision import sample_positions_of
    from unpack_trainer.data.vision import pack_processed
    from unpack_trainer.model_zoo.tiny_vision import processed_batch

    batch = pack_processed(
        processed_batch(items),
        [item["input_ids"].shape[1] for item in items],
        positions=sample_positions_of(model),
        sequence_shards=SP,
    )
    ids = torch.cat([item["input_ids"][0] for item in items])
    cut = batch["input_ids"].shape[1] // SP
    lengths = [item["input_ids"].shape[1] for item in items]
    assert lengths[0] < cut < lengths[0] + lengths[1], (lengths, cut)
    image = model.config.image_token_id
    assert ids[cut - 1] == image and ids[cut] == image, "an image across the cut"
    return batch


def _shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    size = tensor.shape[1] // SP
    return tensor[:, rank * size : (rank + 1) * size]


def sharded_logits(model, batch: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard through the model (what DeepSpeed's adapter hands it: the cut tensors, the rest whole); every
    rank's logits gathered ``(T, V)``, and this rank's in the graph ``(1, T / SP, V)``."""
    from unpack_trainer.data.vision import WHOLE_ROW_KEY
    from unpack_trainer.packed_seq_info import INFO_KEY

    local = model(
        input_ids=_shard(batch["input_ids"], rank),
        position_ids=_shard(batch["position_ids"], rank),
        use_cache=False,
        **{INFO_KEY: batch[INFO_KEY], WHOLE_ROW_KEY: batch[WHOLE_ROW_KEY]},
    ).logits
    gathered = [torch.empty_like(local) for _ in range(SP)]
    dist.all_gather(gathered, local.detach().contiguous())
    return torch.cat(gathered, dim=1)[0], local


VISION_PARAMETERS = ("visual", "vision", "multi_modal_projector")


def build(model_type: str):
    """The tiny model of ``model_type`` on ``sdpa``, its all-zero parameters drawn at random (Gemma 3's projector
    starts at zero, which would make every image feature zero and the vision tower's gradients vanish)."""
    from unpack_trainer.model_zoo.tiny_vision import tiny_vision_model

    model = tiny_vision_model(model_type, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in model.parameters():
            if not bool(parameter.any()):
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model


def _weights(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def references(model, items: list[dict]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each sample's logits alone and the gradients of their weighted sum, in one process, before any Ulysses wrapper
    is registered (in evaluation mode DeepSpeed's wrapper leaves attention whole but drops its mask: a stock Gemma 3
    then loses its image blocks)."""
    model.zero_grad()
    alone = [model(**item, use_cache=False).logits[0] for item in items]
    total = sum(a.shape[0] for a in alone)
    (torch.cat(alone) * _weights((total, alone[0].shape[-1]))).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return [a.detach() for a in alone], grads


def probe(model, model_type: str, items: list[dict], rank: int, logits: torch.Tensor, what: str) -> list[float]:
    """The largest change of samples 1 and 2's logits when sample 0 changes (a text token, or its image), and of
    sample 0's own (which must move)."""
    changed = [dict(item) for item in items]
    first = changed[0]
    if what == "token":
        ids = first["input_ids"].clone()
        ids[0, 1] = ids[0, 1] + 1
        first["input_ids"] = ids
    else:
        pixels = first["pixel_values"].clone()
        pixels[0] += 1.0
        first["pixel_values"] = pixels
    with torch.no_grad():
        moved, _ = sharded_logits(model, row(model, model_type, changed), rank)
    start = items[0]["input_ids"].shape[1]
    end = start + items[1]["input_ids"].shape[1] + items[2]["input_ids"].shape[1]
    return [
        float((moved[start:end] - logits[start:end]).abs().max()),
        float((moved[:start] - logits[:start]).abs().max()),
    ]


def check_model(model, model_type: str, rank: int, expected) -> dict:
    items = samples(model, model_type)
    alone, grads = expected
    batch = row(model, model_type, items)
    model.zero_grad()
    logits, local = sharded_logits(model, batch, rank)
    total = sum(a.shape[0] for a in alone)
    logit_diff = float((logits[:total] - torch.cat(alone)).abs().max())
    bounds = torch.tensor([0] + [a.shape[0] for a in alone]).cumsum(0).tolist()
    per_sample = [float((logits[a:b] - r).abs().max()) for a, b, r in zip(bounds, bounds[1:], alone)]
    weights = _weights((batch["input_ids"].shape[1], logits.shape[-1]))
    weights[total:] = 0  # the padding sample
    size = batch["input_ids"].shape[1] // SP
    (local[0] * weights[rank * size : (rank + 1) * size]).sum().backward()
    grad_diff, vision_diff, missing = 0.0, 0.0, []
    for name, parameter in model.named_parameters():
        grad = parameter.grad.clone() if parameter.grad is not None else torch.zeros_like(parameter)
        dist.all_reduce(grad)  # DeepSpeed sums the gradients of the sequence-parallel group
        reference = grads.get(name, torch.zeros_like(parameter))
        diff = float((grad - reference).abs().max())
        grad_diff = max(grad_diff, diff)
        if any(part in name for part in VISION_PARAMETERS):
            vision_diff = max(vision_diff, diff)
            if name in grads and float(reference.abs().max()) > 0 and float(grad.abs().max()) == 0:
                missing.append(name)
    return {
        "logits": logit_diff,
        "per_sample": per_sample,
        "gradients": grad_diff,
        "vision_gradients": vision_diff,
        "vision_missing": missing,
        "gradient_scale": max(float(g.abs().max()) for g in grads.values()),
        "vision_gradient_scale": max(
            float(g.abs().max()) for n, g in grads.items() if any(part in n for part in VISION_PARAMETERS)
        ),
        "contamination_token": probe(model, model_type, items, rank, logits.detach(), "token"),
        "contamination_image": probe(model, model_type, items, rank, logits.detach(), "image"),
        "row": batch["input_ids"].shape[1],
        "seq_lengths": batch["packed_seq_info"].seq_lengths.tolist(),
    }


# ---------------------------------------------------------------------------------------------------- one SFT step


def dataset(model_type: str):
    """Image + text examples as a user has them (``images`` and ``messages``), for TRL's vision collator."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = []
    for index in range(4):
        image = Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))
        rows.append(
            {
                "images": [image],
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "ab" * (index + 1)}, {"type": "image"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "cd" * (3 + index)}]},
                ],
            }
        )
    return Dataset.from_list(rows)


def config(output_dir: str, **overrides):
    from sp_train import SGD_STEP, ulysses  # this folder is the script's sys.path[0]

    from unpack_trainer import SFTConfig

    arguments = dict(
        output_dir=output_dir,
        max_length=256,
        # DeepSpeed's adapter gathers every rank's batch with one all_gather, which gloo only runs on equal shapes
        pad_to_multiple_of=256,
        packing=True,
        per_device_train_batch_size=1,
        data_seed=0,
        **(SGD_STEP | {"learning_rate": LEARNING_RATE}),
        **ulysses(sp_size=SP),
    )
    return SFTConfig(**(arguments | overrides))


def main_train(output_dir: str, model_type: str, checked: list[str]) -> None:
    import deepspeed
    from sp_train import recorded_batches

    from unpack_trainer import SFTTrainer
    from unpack_trainer.data.vision import WHOLE_ROW_KEY
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor

    deepspeed.init_distributed(dist_backend="gloo")
    models = {t: build(t) for t in checked}
    expected = {t: references(m, samples(m, t)) for t, m in models.items()}  # before accelerate registers Ulysses
    model = build(model_type)
    trainer = SFTTrainer(
        model=model,
        args=config(os.path.join(output_dir, "out"), pad_to_multiple_of=ROW[model_type]),
        train_dataset=dataset(model_type),
        processing_class=tiny_processor(model_type),
    )
    batches = recorded_batches(trainer)
    trainer.train()
    first = batches[0]  # the adapter's first micro-batch: rank 0's first batch, cut in two
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    parameters = {n: p.detach().clone() for n, p in unwrapped.named_parameters()}
    checks = {}
    if checked:  # inside the Ulysses group accelerate set up, its wrapper around "sdpa" (the tiny models share heads)
        from unpack_trainer.models import patch_model, unpatch_model

        for m in models.values():
            patch_model(m)
        checks = {t: check_model(m, t, dist.get_rank(), expected[t]) for t, m in models.items()}
        for m in models.values():
            unpatch_model(m)
    if trainer.accelerator.process_index == 0:
        torch.save(
            {
                "batch": {
                    "input_ids": first["input_ids"],
                    "labels": first["labels"],
                    "info": first["packed_seq_info"],
                    "whole": first[WHOLE_ROW_KEY].inputs,
                },
                "parameters": parameters,
            },
            os.path.join(output_dir, "result.pt"),
        )
        record = {
            "logged": next(entry for entry in trainer.state.log_history if "loss" in entry),
            "mode": trainer.unpack_decision.mode,
            "reason": trainer.unpack_decision.reason,
            "models": checks,
        }
        with open(os.path.join(output_dir, "result.json"), "w") as handle:
            json.dump(record, handle, indent=1)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main_train(sys.argv[1], sys.argv[2], sys.argv[3:])
