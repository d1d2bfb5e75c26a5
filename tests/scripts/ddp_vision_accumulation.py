"""Run by tests/test_trainer_ddp.py under `accelerate launch` (2 processes, gloo): one optimizer step of packed
Qwen2.5-VL training (a class that declares `accepts_loss_kwargs = False`) with `gradient_accumulation_steps=2`, the
step's four rows of very different trained-token counts. Each rank writes OUTPUT_DIR/rank{N}.json: the logged loss,
its rows' trained-token counts, the step's token mean computed by hand over both ranks (the per-token losses of all
four rows summed / their count) and the largest gradient error against it (relative to each tensor's largest entry).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset
from ddp_train import exit_without_teardown  # this folder is the script's sys.path[0]
from PIL import Image
from transformers import TrainerCallback

from unpack_trainer import SFTConfig, SFTTrainer
from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model

MODEL_TYPE = "qwen2_5_vl"


def dataset() -> Dataset:
    """Two long examples and six short ones, one noise image each."""
    rows = []
    for index, words in enumerate((80, 2, 3, 2, 80, 3, 2, 3)):
        pixels = np.random.default_rng(index).integers(0, 255, (56 + 8 * (index % 4), 84, 3), dtype=np.uint8)
        rows.append(
            {
                "images": [Image.fromarray(pixels)],
                "messages": [
                    {"role": "user", "content": "describe"},
                    {"role": "assistant", "content": "a shape " * words},
                ],
            }
        )
    return Dataset.from_list(rows)


def trainer(output_dir: str, max_length: int, callbacks=()) -> SFTTrainer:
    args = SFTConfig(
        output_dir=output_dir, report_to="none", use_cpu=True, bf16=False, max_length=max_length, packing=True,
        per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1, max_grad_norm=0.0,
        learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="no", logging_steps=1, disable_tqdm=True,
        seed=0, data_seed=0,
    )  # fmt: skip
    return SFTTrainer(
        model=tiny_vision_model(MODEL_TYPE, attn_implementation="sdpa"),
        args=args,
        train_dataset=dataset(),
        processing_class=tiny_processor(MODEL_TYPE),
        callbacks=list(callbacks),
    )


class FirstStepGradients(TrainerCallback):
    """Every parameter's gradient at the first optimizer step (after DDP's all-reduce), before the optimizer reads it."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def token_loss_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    """The sum of every trained token's cross-entropy in ``batch`` (``labels`` ``(B, T)`` int64; fp32 scalar with its
    graph) and how many trained tokens it has."""
    inputs = {key: value for key, value in batch.items() if key != "labels"} | {"use_cache": False}
    logits = model(**inputs).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    trained = labels != -100
    loss = torch.nn.functional.cross_entropy(logits[trained], labels[trained], reduction="sum")
    return loss, int(trained.sum())


def main(output_dir: str) -> None:
    # rows of the long examples' length: each long one alone in a row, the short ones sharing the others
    lengths = trainer(os.path.join(output_dir, "lengths"), 4096).train_dataset.lengths
    gradients = FirstStepGradients()
    ours = trainer(os.path.join(output_dir, "out"), max(lengths), [gradients])
    batches = []
    training_step = ours.training_step

    def recording_step(model, inputs, *args, **kwargs):
        batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return training_step(model, inputs, *args, **kwargs)

    ours.training_step = recording_step
    model = ours.model  # unwrapped: the reference's backward below runs none of DDP's hooks
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    ours.train()
    logged = next(entry["loss"] for entry in ours.state.log_history if "loss" in entry)

    model.load_state_dict(initial)
    sums, counts = zip(*(token_loss_sum(model, batch) for batch in batches))
    local = sum(sums)
    total = torch.tensor([local.item(), float(sum(counts))], dtype=torch.float64)
    dist.all_reduce(total)
    parameters = [(name, p) for name, p in model.named_parameters() if name in gradients.grads]
    # this rank's share of the step's token mean; the mean's gradient is the sum of the ranks' shares
    grads = torch.autograd.grad(local / total[1].item(), [p for _, p in parameters], allow_unused=True)
    error = 0.0
    for (name, _), grad in zip(parameters, grads):
        grad = torch.zeros_like(gradients.grads[name]) if grad is None else grad.detach().clone()
        dist.all_reduce(grad)
        scale = max(grad.abs().max().item(), 1e-8)
        error = max(error, (gradients.grads[name] - grad).abs().max().item() / scale)
    all_counts = [None] * dist.get_world_size()
    dist.all_gather_object(all_counts, list(counts))
    rank = ours.accelerator.process_index
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(
            {
                "world_size": ours.accelerator.num_processes,
                "mode": ours.unpack_decision.mode,
                "accepts_loss_kwargs": getattr(type(model), "accepts_loss_kwargs", None),
                "logged": logged,
                "expected": total[0].item() / total[1].item(),
                "counts": [count for rank_counts in all_counts for count in rank_counts],
                "gradient_error": error,
            },
            handle,
        )
    exit_without_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
