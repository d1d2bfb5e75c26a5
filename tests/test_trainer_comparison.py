"""The trainer benchmark's bookkeeping: providers interleaved, medians and spreads, ratios paired within a round."""

from __future__ import annotations

import unpack_trainer.cli.trainer_comparison as bench


def test_providers_run_interleaved_and_ratios_crossing_one_are_flagged(monkeypatch):
    calls = []
    speeds = {"trl_padded": [100.0, 100.0, 100.0], "trl_packing": [200.0, 90.0, 150.0], "unpack_packing": [400.0] * 3}

    def fake_run(provider, max_length, steps, batch_size, data, threads=None):
        calls.append(provider)
        speed = speeds[provider][sum(1 for c in calls if c == provider) - 1]
        return {"tokens_per_s": speed, "seconds_per_step": 1.0, "first_step_s": 2.0, "peak_rss_mb": 10.0}

    monkeypatch.setattr(bench, "_run_in_subprocess", fake_run)
    report = bench.compare(max_lengths=[64], providers=list(speeds), repeats=3, progress=False)
    assert calls == list(speeds) * 3
    lines = {line.split(" | ")[1]: line for line in report.splitlines() if line.startswith("| 64 |")}
    packing = lines[bench.PROVIDERS["trl_packing"]]
    assert "150 (90-200)" in packing
    assert "1.50x (0.90-2.00), not significant" in packing  # vs padded: 2.0, 0.9, 1.5
    unpack = lines[bench.PROVIDERS["unpack_packing"]]
    assert "4.00x (4.00-4.00) |" in unpack and "2.67x (2.00-4.44) |" in unpack  # paired per round
    assert "| 1.00x | 0.67x (0.50-1.11), not significant |" in lines[bench.PROVIDERS["trl_padded"]]
    assert "3 interleaved repeats" in report
