"""GRPOTrainer / RLOOTrainer: one optimizer step of ours == the same step of stock ``trl.GRPOTrainer`` /
``trl.RLOOTrainer`` padded (completions generated, loss, every logged metric, per-token log-probs, every gradient),
the decision and its fallbacks, and the packed layout of TRL's batch."""

from __future__ import annotations

import logging

import pytest
import torch
import trl
from datasets import Dataset
from transformers import TrainerCallback

from unpack_trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from unpack_trainer.trainers.branched import pack_completions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# fp32 bounds, relative to the largest entry of what is compared (see the README's GRPO section for the floor)
RTOL = 1e-5

PROMPTS = ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvw", "xyz"]


def count_a(completions, **kwargs):
    """A programmatic reward: how many ``a`` the completion holds, minus a length term (distinct rewards in a group)."""
    return [float(text.count("a")) - 0.1 * len(text) for text in completions]


def _prompts(n: int = 4) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


class _Recorder(TrainerCallback):
    """The gradients right before the optimizer step (every parameter's, cloned)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _record_logps(trainer) -> list:
    """Wrap the trainer's log-prob method: every call's ``(logps, entropies)``, detached."""
    calls = []
    method = trainer._get_per_token_logps_and_entropies

    def recorded(*args, **kwargs):
        logps, entropies, aux = method(*args, **kwargs)
        calls.append((logps.detach().clone(), None if entropies is None else entropies.detach().clone()))
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = recorded
    return calls


def run_step(
    trainer_class,
    config_class,
    tmp_path,
    tokenizer,
    model,
    *,
    ref_model=None,
    peft_config=None,
    dataset=None,
    **config,
) -> dict:
    """One optimizer step of ``trainer_class`` from ``model`` (deep-copied) on the prompts, seeded: what it logged,
    its gradients, its log-prob calls, its completions, the trainer."""
    import copy

    config = dict(
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=12,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=7,
        save_strategy="no",
        temperature=1.0,
    ) | config
    args = config_class(output_dir=str(tmp_path / trainer_class.__name__), **config)
    recorder = _Recorder()
    kwargs = {} if ref_model is None else {}
    trainer = trainer_class(
        model=copy.deepcopy(model),
        reward_funcs=count_a,
        args=args,
        train_dataset=dataset if dataset is not None else _prompts(),
        processing_class=tokenizer,
        callbacks=[recorder],
        peft_config=peft_config,
        **kwargs,
    )
    calls = _record_logps(trainer)
    completions = []
    generate = trainer._generate

    def recorded_generate(prompts):
        out = generate(prompts)
        completions.append([list(ids) for ids in out[1]])
        return out

    trainer._generate = recorded_generate
    trainer.train()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k not in ("step_time",)}
    return {"logs": logs, "grads": recorder.grads, "calls": calls, "completions": completions, "trainer": trainer}


def _close(ours: torch.Tensor, stock: torch.Tensor, rtol: float = RTOL) -> float:
    """``max |ours - stock|`` relative to ``max |stock|`` (asserted below ``rtol``)."""
    scale = float(stock.abs().max()) if stock.numel() else 0.0
    diff = float((ours - stock).abs().max()) if stock.numel() else 0.0
    assert diff <= rtol * max(scale, 1e-12), (diff, scale)
    return diff / max(scale, 1e-12)


def assert_same_step(ours: dict, stock: dict, rtol: float = RTOL) -> None:
    assert ours["completions"] == stock["completions"]  # generation untouched: the same seed, the same samples
    assert set(ours["logs"]) == set(stock["logs"])
    for key, value in stock["logs"].items():
        if isinstance(value, float) and key not in ("train_runtime", "train_samples_per_second", "train_steps_per_second"):
            assert ours["logs"][key] == pytest.approx(value, rel=rtol, abs=1e-7), key
    assert len(ours["calls"]) == len(stock["calls"])
    for (logps, entropies), (stock_logps, stock_entropies) in zip(ours["calls"], stock["calls"]):
        _close(logps, stock_logps, rtol)
        assert (entropies is None) == (stock_entropies is None)
        if entropies is not None:
            _close(entropies, stock_entropies, rtol)
    assert set(ours["grads"]) == set(stock["grads"]) and stock["grads"]
    largest = max(float(g.abs().max()) for g in stock["grads"].values())
    for name, grad in stock["grads"].items():
        diff = float((ours["grads"][name] - grad).abs().max())
        assert diff <= rtol * largest, (name, diff, largest)
    forwards = ours["trainer"].unpack_stats.get("forwards", {})
    assert forwards.get("packed", 0) == len(ours["calls"]) and not forwards.get("padded"), forwards


@pytest.fixture(scope="module")
def grpo_model():
    from unpack_trainer import tiny

    return tiny.tiny_model(
        "llama",
        vocab_size=len(tiny.char_tokenizer()),
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def test_one_grpo_step_equals_stock(tmp_path, tokenizer, grpo_model):
    stock = run_step(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, tokenizer, grpo_model)
    ours = run_step(GRPOTrainer, GRPOConfig, tmp_path, tokenizer, grpo_model)
    assert ours["trainer"].unpack_decision.packed
    assert_same_step(ours, stock)


def test_pack_completions_worked_example():
    ids = torch.tensor([[5, 6, 8, 0], [5, 6, 9, 10], [0, 7, 11, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    batch, total = pack_completions(ids, mask, 2)
    assert total == 7
    assert batch["packed_input_ids"].tolist() == [[5, 6, 8, 9, 10, 7, 11]]
    assert batch["packed_seq_lengths"].tolist() == [2, 1, 2, 2]
    assert batch["packed_seq_parents"].tolist() == [-1, 0, 0, -1]
    assert batch["packed_position_ids"].tolist() == [[0, 1, 2, 2, 3, 0, 1]]
    assert batch["packed_token_index"].tolist() == [[0, 1, 2, 0], [0, 1, 3, 4], [0, 5, 6, 0]]
    assert batch["input_ids"].tolist() == [[6, 8, 0], [6, 9, 10], [7, 11, 0]]
    assert batch["labels"].tolist() == [[-100, 8, -100], [-100, 9, 10], [-100, 11, -100]]
    assert batch["packed_view_index"].tolist() == [[1, 2, 0], [1, 3, 4], [5, 6, 0]]
    unshared, total = pack_completions(ids, mask, 2, prefix_sharing=False)
    assert total == 9 and unshared["packed_seq_parents"].tolist() == [-1, -1, -1]


def _silence():
    logging.getLogger("unpack_trainer")
