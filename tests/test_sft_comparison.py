"""The packed-vs-padded comparison behind the main job: held-out loss, verdict, run summaries."""

from __future__ import annotations

import copy
import json

import pytest

from unpack_trainer import load_default_dataset, load_default_tokenizer
from unpack_trainer.cli import sft_comparison as comparison


def test_held_out_loss_is_the_same_for_packed_padded_and_one_by_one_batches(tmp_path):
    """The table's held-out loss must not depend on how a run batches: packed rows, padded batches of 5, single
    samples (trainer.evaluate()'s mean of per-batch means would differ between these)."""
    import torch
    from transformers import LlamaForCausalLM

    from unpack_trainer import SFTConfig, SFTTrainer, tiny_model_config

    tokenizer = load_default_tokenizer()
    data = load_default_dataset("eval")
    train, held_out = data.select(range(8)), data.select(range(8, 31))
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_model_config(tokenizer))
    common = dict(
        max_length=512,
        eval_packing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        **comparison.checkpointing_off(SFTConfig),
    )
    runs = {
        "packed": dict(packing=True, per_device_eval_batch_size=5),
        "padded": dict(packing=False, padding_free=False, per_device_eval_batch_size=5),
        "one_by_one": dict(packing=False, padding_free=False, per_device_eval_batch_size=1),
    }
    losses, evaluated = {}, {}
    for name, extra in runs.items():
        args = SFTConfig(output_dir=str(tmp_path / name), **common, **extra)
        trainer = SFTTrainer(
            model=copy.deepcopy(model),
            args=args,
            train_dataset=train,
            eval_dataset=held_out,
            processing_class=tokenizer,
        )
        losses[name] = comparison.held_out_loss(trainer)
        evaluated[name] = trainer.evaluate()["eval_loss"]
    assert losses["packed"] == pytest.approx(losses["one_by_one"], rel=1e-5)
    assert losses["padded"] == pytest.approx(losses["one_by_one"], rel=1e-5)
    # the per-batch mean depends on the batching: the reason the example does not report it
    assert evaluated["padded"] != pytest.approx(evaluated["one_by_one"], rel=1e-4)


def test_quality_verdict_calls_a_difference_within_two_std_seed_noise():
    """The main-job run of docs/quality.md (seed 0): packed - padded +0.057 against +0.007 ± 0.052 over seeds is 1.1 std, an
    ordinary seed-to-seed difference, not "packed is WORSE"."""
    noise = {
        "command": "python benchmarks/bench_quality.py",
        "padded_std": 0.027,
        "diff_mean": 0.007,
        "diff_std": 0.052,
    }
    verdict = comparison.quality_verdict(2.550, 2.493, noise)
    assert "WITHIN the seed noise (1.1 std" in verdict and "WORSE" not in verdict
    assert "WITHIN the seed noise (1.9 std" in comparison.quality_verdict(2.493 + 1.9 * 0.052, 2.493, noise)
    assert "WORSE by more than the seed noise (2.1 std" in comparison.quality_verdict(2.493 + 0.11, 2.493, noise)


def test_quality_verdict_compares_the_difference_with_the_benchmark_seed_noise(tmp_path):
    # one run's packed - padded is judged against the spread of that difference over seeds (diff_std), not against
    # the padded run's own spread: the difference of two seeded runs varies more than either run
    noise = {"command": "python benchmarks/bench_quality.py", "padded_std": 0.02, "diff_mean": 0.01, "diff_std": 0.05}
    assert "WITHIN the seed noise" in comparison.quality_verdict(2.50, 2.46, noise)
    assert "WITHIN the seed noise" in comparison.quality_verdict(2.42, 2.46, noise)
    assert "WITHIN the seed noise (1.8 std, within 2)" in comparison.quality_verdict(2.55, 2.46, noise)
    assert "WORSE by more than the seed noise (3.0 std, over 2)" in comparison.quality_verdict(2.61, 2.46, noise)
    assert "BETTER by more than the seed noise (3.0 std, over 2)" in comparison.quality_verdict(2.31, 2.46, noise)
    assert "packed - padded over seeds +0.010 ± 0.050" in comparison.quality_verdict(2.5, 2.5, noise)
    # without the paired figures: sqrt(2) x the padded std (two independent runs)
    padded_only = {"command": "python benchmarks/bench_quality.py", "padded_std": 0.05}
    assert "WITHIN the seed noise" in comparison.quality_verdict(2.52, 2.46, padded_only)
    assert "WORSE by more than the seed noise (3.0 std" in comparison.quality_verdict(
        2.46 + 0.15 * 2**0.5, 2.46, padded_only
    )
    results = tmp_path / "RESULTS_quality.json"
    results.write_text(json.dumps({"command": "python benchmarks/bench_quality.py --seeds 0 1", "seed_noise": noise}))
    assert comparison.load_seed_noise(results)["command"] == "python benchmarks/bench_quality.py --seeds 0 1"
    assert comparison.load_seed_noise(tmp_path / "missing.json") == comparison.BENCHMARK_SEED_NOISE
    assert comparison.BENCHMARK_SEED_NOISE["padded_std"] > 0


def test_final_loss_and_loss_at_a_time_average_the_last_tenth_of_steps():
    curve = [(float(step), step, float(step)) for step in range(1, 101)]
    result = comparison.RunResult("packed", 0.0, 1.0, 100, 1.0, 10, 10, curve, 0.0)
    assert result.final_loss == pytest.approx(sum(range(90, 101)) / 11)
    assert result.tokens_per_s == 10
    # 50.5 s in: step 50, the mean of the points of steps 45..50
    assert result.loss_at(50.5) == (50, pytest.approx(sum(range(45, 51)) / 6))
    assert result.loss_at(0.5) is None
