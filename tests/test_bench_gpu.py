"""benchmarks/bench_gpu.py --dry-run: the GPU benchmark's trainer, attention and RoPE code run tiny on the CPU (no
timing is asserted; a GPU run is where its numbers come from), its results written after every case, its budget
planning."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DRY_RUN_CASES = ",".join(
    [
        "trainer:llama1b:trl_packing_sdpa:fp32-bf16",
        "trainer:llama1b:trl_packing_flex:fp32-bf16",
        "trainer:llama1b:ours_packing:fp32-bf16",
        "trainer:llama1b:ours_packing:fp32-bf16:no_checkpointing",
        "trainer:llama8b_lora:ours_packing:bf16",
        "trainer:llama8b_lora:ours_packing:bf16-bf16:no_checkpointing",
        "trainer:gpt_oss:ours_packing:bf16",
        "attention:packed_torch_varlen:8192",
        "attention:packed_sdpa:*",
        "attention:packed_flex:8192",
        "attention:torch_flex:8192",
        "attention:dense_sdpa:8192",
        "rope:all",
    ]
)


def test_dry_run_writes_every_table(tmp_path, bench):
    pytest.importorskip("triton")
    pytest.importorskip("peft")
    assert bench.main(["--dry-run", "--cases", DRY_RUN_CASES, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())["cases"]
    ours = results["trainer:llama1b:ours_packing:fp32-bf16"]
    assert ours["tokens_per_s"] > 0 and ours["mode"] == "pack" and ours["first_step_s"] > 0
    assert ours["activation_checkpointing"] is True  # TRL's default, set explicitly on both sides
    unchecked = results["trainer:llama1b:ours_packing:fp32-bf16:no_checkpointing"]
    assert unchecked["tokens_per_s"] > 0 and unchecked["activation_checkpointing"] is False
    assert results["trainer:llama1b:trl_packing_sdpa:fp32-bf16"]["tokens_per_s"] > 0
    assert "no backward on the CPU" in results["trainer:llama1b:trl_packing_flex:fp32-bf16"]["skipped"]
    lora = results["trainer:llama8b_lora:ours_packing:bf16"]
    assert lora["tokens_per_s"] > 0 and lora["flops_per_token"] > 0
    autocast_lora = results["trainer:llama8b_lora:ours_packing:bf16-bf16:no_checkpointing"]  # TRL's bf16=True
    assert autocast_lora["tokens_per_s"] > 0 and autocast_lora["activation_checkpointing"] is False
    assert results["trainer:gpt_oss:ours_packing:bf16"]["tokens_per_s"] > 0  # MoE with sinks, on eager
    assert results["attention:packed_sdpa:65536"]["ms"] > 0 and results["attention:packed_flex:8192"]["backward"] is False
    assert "CUDA" in results["attention:packed_torch_varlen:8192"]["skipped"]
    assert [row["dtype"] for row in results["rope:all"]["rows"]] == ["bfloat16", "autocast"]
    tables = (tmp_path / "bench_gpu.md").read_text()
    for heading in ("### Trainer", "### Attention alone", "### RoPE"):
        assert heading in tables
    assert "| fp32-bf16 no checkpointing | ours_packing |" in tables


def test_unknown_trainer_options_are_named(bench):
    with pytest.raises(ValueError, match="no_checkpointin"):
        bench._case("trainer:llama1b:ours_packing:bf16:no_checkpointin", dry_run=True, steps=1)


def test_gpu_idle_by_phase(bench):
    """Idle time per host phase: the phase's length minus the union of the kernels running within it (overlapping
    kernels of two streams counted once; a kernel running on from one phase into the next is the next one's busy
    time)."""
    phases = {"data": (0.0, 100.0), "forward_backward": (100.0, 1000.0), "optimizer": (1000.0, 1100.0)}
    kernels = [(90.0, 400.0), (300.0, 500.0), (600.0, 990.0), (1050.0, 1060.0)]
    idle = bench.gpu_idle_by_phase(phases, kernels)
    assert idle == pytest.approx({"data": 90e-6, "forward_backward": 110e-6, "optimizer": 90e-6})
    assert bench.gpu_idle_by_phase({"data": (0.0, 10.0)}, []) == {"data": pytest.approx(10e-6)}


def test_the_idle_profile_finds_each_phase_of_a_step(bench):
    """The profiled step of ``_profile_idle`` on the CPU (no GPU kernels: idle throughout): each host phase found
    in the profile, the step run as the loop runs it (the model's gradients cleared after the optimizer step)."""
    from unpack_trainer import SFTConfig, SFTTrainer

    model = bench._build_model("llama1b", "fp32-bf16", "sdpa", cuda=False, dry_run=True)
    args = SFTConfig(
        output_dir="/tmp/bench_gpu_idle_test", report_to="none", use_cpu=True, max_length=128, max_steps=1,
        per_device_train_batch_size=2, packing=True, save_strategy="no", logging_strategy="no",
        gradient_checkpointing=False, disable_tqdm=True,
    )  # fmt: skip
    dataset = bench._dataset(64, 128, 40, model.config.vocab_size)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=bench._tokenizer())
    trainer.train()
    result = bench._profile_idle(trainer)
    assert set(result["gpu_idle_s"]) == set(bench.PHASES)
    assert all(seconds > 0 for seconds in result["gpu_idle_s"].values())
    assert result["gpu_busy"] == pytest.approx(0.0, abs=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_recomputed_forward_flops(bench):
    """Checkpointing runs the forward once more: 2 x the parameters on top of 6 x (full) or 4 x (LoRA)."""
    assert bench.recompute_flops_per_token(6.0e9, lora=False) == pytest.approx(2.0e9)
    assert bench.recompute_flops_per_token(4.0e9, lora=True) == pytest.approx(2.0e9)


def test_each_result_is_written_as_it_comes_and_the_budget_skips_what_does_not_fit(tmp_path, bench, monkeypatch):
    """A run cut short keeps what it measured: the files hold every case finished so far; a case whose estimate
    does not fit in what is left of ``--budget`` is recorded as skipped, not started."""
    seen_on_disk = []

    def fake_run(name, *, dry_run, steps, timeout):
        if (tmp_path / "bench_gpu.json").exists():
            seen_on_disk.append(sorted(json.loads((tmp_path / "bench_gpu.json").read_text())["cases"]))
        return {"ms": 1.0, "peak_gib": None, "backward": True}

    monkeypatch.setattr(bench, "_run", fake_run)
    cases = "attention:packed_sdpa:8192,attention:packed_sdpa:65536,trainer:llama8b_lora:ours_packing:bf16"
    monkeypatch.setattr(bench, "all_cases", lambda: [
        bench.Case("attention:packed_sdpa:8192", 1),
        bench.Case("attention:packed_sdpa:65536", 1),
        bench.Case("trainer:llama8b_lora:ours_packing:bf16", 10_000),
    ])  # fmt: skip
    assert bench.main(["--dry-run", "--cases", cases, "--budget", "60", "--out", str(tmp_path)]) == 0
    assert seen_on_disk == [["attention:packed_sdpa:8192"]]
    results = json.loads((tmp_path / "bench_gpu.json").read_text())["cases"]
    assert results["trainer:llama8b_lora:ours_packing:bf16"]["skipped"].startswith("budget:")
    assert "budget:" in (tmp_path / "bench_gpu.md").read_text()


def test_cases_run_in_priority_order_and_patterns_select(bench, capsys):
    names = [case.name for case in bench.all_cases()]
    assert names[:4] == [
        "trainer:llama1b:ours_packing:fp32-bf16",
        "trainer:llama1b:trl_packing_sdpa:fp32-bf16",
        "trainer:llama1b:ours_packing:bf16",
        "trainer:llama1b:trl_packing_sdpa:bf16",
    ]
    assert len(names) == len(set(names))
    assert all(set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789_-:") for name in names)
    for family in bench.FAMILIES:
        assert f"trainer:{family}:ours_packing:bf16" in names and f"trainer:{family}:trl_packing_sdpa:fp32-bf16" in names
    assert bench.main(["--list", "--cases", "trainer:*:compile"]) == 0
    listed = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in listed if line] == [n for n in names if n.endswith(":compile")]


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_192x192_64x3_1x2_h_bz_coopB_TNT", "gemm"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::bfloat16_t>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("triton_tem_fused_flex_attention_0", "attention"),
        ("triton_tem_fused_mm_3", "gemm"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "other"),
        ("void at::native::cross_entropy_loss_kernel", "loss"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ],
)
def test_kernel_classes(bench, name, label):
    assert bench.kernel_class(name) == label
