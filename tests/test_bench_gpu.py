"""benchmarks/bench_gpu.py --dry-run: the GPU benchmark's trainer, attention and RoPE code run tiny on the CPU (no
timing is asserted; a GPU run is where its numbers come from)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_dry_run_writes_every_table(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    bench = load_bench()
    code = bench.main(
        [
            "--dry-run",
            "--providers",
            "trl_packing_sdpa,trl_packing_flex,ours_packing",
            "--precisions",
            "fp32+bf16",
            "--attention-providers",
            "packed_torch_varlen,packed_sdpa,packed_flex,torch_flex,dense_sdpa",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    trainer = results["trainer"]
    assert trainer["ours_packing:fp32+bf16"]["tokens_per_s"] > 0 and trainer["ours_packing:fp32+bf16"]["mode"]
    assert trainer["trl_packing_sdpa:fp32+bf16"]["tokens_per_s"] > 0
    assert "no backward on the CPU" in trainer["trl_packing_flex:fp32+bf16"]["skipped"]
    attention = results["attention"]
    assert attention["packed_sdpa:1024"]["ms"] > 0 and attention["packed_flex:1024"]["backward"] is False
    assert "CUDA" in attention["packed_torch_varlen:256"]["skipped"]
    assert [row["dtype"] for row in results["rope"]] == ["bfloat16", "autocast"]
    tables = (tmp_path / "bench_gpu.md").read_text()
    for heading in ("### Trainer", "### Attention alone", "### RoPE"):
        assert heading in tables
