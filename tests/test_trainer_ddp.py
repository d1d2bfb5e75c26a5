"""Two processes with `accelerate launch`: SFT trains every packed row exactly once per epoch, ranks balanced, no
hang, and an accumulated step of a vision-language model is the mean over every trained token of both ranks; DPO,
GRPO, RLOO and reward models log what stock TRL logs, step by step.

accelerate's `--cpu` launcher starts several processes only through MPI; torchrun (`--multi_gpu`) starts them on a
machine without GPUs too, and the processes then use the gloo backend on the CPU.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def _free_port() -> int:
    """A TCP port nothing listens on now: each launch's rendezvous gets its own (two launches on torch's default 29500,
    as pytest-xdist runs them side by side, fail with EADDRINUSE)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_two_processes(script: str, tmp_path) -> list[dict]:
    """``accelerate launch`` ``tests/scripts/<script>`` on 2 CPU processes (gloo); the two ranks' ``rank{N}.json``."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(_free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        os.path.join(SCRIPTS, script),
        str(tmp_path),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=380, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(400)
def test_two_processes_train_every_sample_exactly_once_with_balanced_ranks(tmp_path):
    ranks = launch_two_processes("ddp_train.py", tmp_path)
    assert all(r["world_size"] == 2 for r in ranks)
    num_rows = ranks[0]["num_rows"]
    assert ranks[1]["num_rows"] == num_rows
    assert ranks[0]["global_step"] == ranks[1]["global_step"]
    rows0 = [tuple(r) for r in ranks[0]["rows"]]
    rows1 = [tuple(r) for r in ranks[1]["rows"]]
    # issue 20 item 4: every row (so every sample) exactly once per epoch across the ranks, none repeated to even out
    # the last batches (45 samples packed into an odd number of rows: a row is split so that they divide by 2 x 2)
    assert num_rows % 4 == 0
    assert len(rows0) + len(rows1) == num_rows and len(set(rows0) | set(rows1)) == num_rows
    assert sum(ranks[0]["samples"]) + sum(ranks[1]["samples"]) == ranks[0]["num_samples"] == 45
    # ... and the ranks balanced by samples and tokens (before: rank 0 always got the rows with the fewest samples)
    samples = [sum(r["samples"]) for r in ranks]
    tokens = [sum(r["tokens"]) for r in ranks]
    assert abs(samples[0] - samples[1]) <= 0.15 * sum(samples), samples
    assert abs(tokens[0] - tokens[1]) <= 0.15 * sum(tokens), tokens


@pytest.mark.timeout(400)
def test_two_processes_accumulate_the_mean_over_every_trained_token_of_the_step(tmp_path):
    """Issue 46 item 2 on 2 processes: packed Qwen2.5-VL (a class that declares ``accepts_loss_kwargs = False``), two
    micro-batches per rank, rows of 2-4x different trained-token counts: the logged loss and every gradient (after
    DDP's all-reduce) are the mean over every trained token of the step on both ranks, computed by hand (fp32: loss
    relative 1e-5, each gradient within 1e-5 of its tensor's largest entry); before, each row's own mean weighed the
    same (5.2292 against 5.2925, gradients off by 76%)."""
    ranks = launch_two_processes("ddp_vision_accumulation.py", tmp_path)
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["mode"] == "pack" and rank["accepts_loss_kwargs"] is False
        counts = rank["counts"]
        assert len(counts) == 4 and max(counts) >= 1.8 * min(counts), counts
        assert rank["logged"] == pytest.approx(rank["expected"], rel=1e-5), rank
        assert rank["gradient_error"] <= 1e-5, rank


def assert_two_processes_equal_stock(ranks: list[dict]) -> None:
    """Per data kind (map-style, iterable): our trainer ran padding-free on both ranks after passing the self-check,
    trained every pair once, got the same pairs as stock per rank, and logged the same values (fp32 rel 1e-5)."""
    for kind in ("map", "iterable"):
        ours, stock = [r[f"ours-{kind}"] for r in ranks], [r[f"stock-{kind}"] for r in ranks]
        assert [r["world_size"] for r in ours] == [2, 2]
        assert all(r["mode"] == "padding_free" and r["self_check"] for r in ours), [
            (r["mode"], r["self_check"]) for r in ours
        ]
        training = sorted(json.dumps(pair) for pair in ours[0]["train_pairs"])
        seen = sorted(json.dumps(pair) for r in ours for batch in r["seen"] for pair in batch)
        assert [pair for pair in seen if pair in training] == training  # 4 steps x 2 ranks x 2 pairs: each pair once
        for rank in range(2):
            assert ours[rank]["seen"] == stock[rank]["seen"], f"{kind} rank {rank}: other batches than stock's"
            assert len(ours[rank]["log"]) == len(stock[rank]["log"])
            for ours_entry, stock_entry in zip(ours[rank]["log"], stock[rank]["log"]):
                assert ours_entry.keys() == stock_entry.keys()
                for key, expected in stock_entry.items():
                    if key.endswith(("runtime", "per_second", "total_flos")):  # timings; FLOPs count the padding
                        continue
                    actual = ours_entry[key]
                    what = f"{kind} rank {rank} step {stock_entry.get('step')} {key}: {actual} vs stock {expected}"
                    assert abs(actual - expected) <= 1e-5 * max(1.0, abs(expected)), what


@pytest.mark.timeout(400)
def test_grpo_and_rloo_on_two_processes_equal_stock(tmp_path):
    """GRPO and RLOO with 2 processes (each step's two groups split across the ranks, rewards gathered): every rank
    generates the completions stock generates, runs its log-prob forwards packed, and logs the same losses and metrics
    (fp32 rel 1e-5) at both steps (the second one from the same generation, num_iterations 2)."""
    ranks = launch_two_processes("ddp_grpo.py", tmp_path)
    for trainer in ("grpo", "rloo"):
        ours, stock = [r[f"{trainer}-ours"] for r in ranks], [r[f"{trainer}-stock"] for r in ranks]
        assert [r["world_size"] for r in ours] == [2, 2]
        for rank in range(2):
            assert ours[rank]["mode"] == "padding_free" and ours[rank]["forwards"]["packed"] >= 2, ours[rank]
            assert not ours[rank]["forwards"]["padded"]
            assert ours[rank]["completions"] == stock[rank]["completions"], f"{trainer} rank {rank}"
            assert len(ours[rank]["log"]) == len(stock[rank]["log"])
            for ours_entry, stock_entry in zip(ours[rank]["log"], stock[rank]["log"]):
                assert ours_entry.keys() == stock_entry.keys()
                for key, expected in stock_entry.items():
                    if key.endswith(("runtime", "per_second", "total_flos", "step_time")):  # timings
                        continue
                    actual = ours_entry[key]
                    what = f"{trainer} rank {rank} step {stock_entry.get('step')} {key}: {actual} vs stock {expected}"
                    assert abs(actual - expected) <= 1e-5 * max(1.0, abs(expected)), what


@pytest.mark.timeout(400)
def test_dpo_on_two_processes_equals_stock(tmp_path):
    """DPO with 2 processes, map-style and iterable pairs (train and eval): every rank's trainer gets the same pairs as
    stock `trl.DPOTrainer`'s, trains padding-free with prompts shared after passing the self-check, and logs the same
    losses, metrics and evaluations (fp32 rel 1e-5) at every step."""
    assert_two_processes_equal_stock(launch_two_processes("ddp_dpo.py", tmp_path))


@pytest.mark.timeout(400)
def test_reward_on_two_processes_equals_stock(tmp_path):
    """RewardTrainer with 2 processes, map-style and iterable pairs with a margin (train and eval): the same pairs
    per rank as stock `trl.RewardTrainer`, packed with prompts shared after the self-check, and the same losses,
    accuracies, margins, rewards and evaluations at every step."""
    assert_two_processes_equal_stock(launch_two_processes("ddp_reward.py", tmp_path))


@pytest.mark.timeout(400)
def test_kto_on_two_processes_equals_stock(tmp_path):
    """KTO with 2 processes, map-style and iterable unpaired examples (train and eval, prompts repeating): the same
    examples per rank as stock `trl.KTOTrainer`, packed with prompts shared after the self-check, and the same losses,
    KL estimates (gathered over both ranks), rewards, log-probs and evaluations at every step."""
    assert_two_processes_equal_stock(launch_two_processes("ddp_kto.py", tmp_path))


@pytest.mark.timeout(400)
def test_distillation_on_two_processes_equals_stock(tmp_path):
    """DistillationTrainer with 2 processes and gradient accumulation 2 (each rank's micro-batches, the completion
    tokens counted over both ranks): every rank generates the completions stock generates, runs the student's and the
    teacher's forwards packed, and logs the same loss, grad_norm, entropy and completion metrics (fp32 rel 1e-5) at
    both steps."""
    ranks = launch_two_processes("ddp_distillation.py", tmp_path)
    ours, stock = [r["ours"] for r in ranks], [r["stock"] for r in ranks]
    assert [r["world_size"] for r in ours] == [2, 2]
    for rank in range(2):
        forwards = ours[rank]["forwards"]  # 2 steps x 2 micro-batches x (student, teacher); a micro-batch packing
        # would barely shrink runs TRL's padded forwards
        assert ours[rank]["mode"] == "padding_free" and sum(forwards.values()) == 8 and forwards["packed"] >= 4, forwards
        assert ours[rank]["completions"] == stock[rank]["completions"], f"rank {rank}"
        assert len(ours[rank]["log"]) == len(stock[rank]["log"])
        for ours_entry, stock_entry in zip(ours[rank]["log"], stock[rank]["log"]):
            assert ours_entry.keys() == stock_entry.keys()
            for key, expected in stock_entry.items():
                if key.endswith(("runtime", "per_second", "total_flos", "step_time")):  # timings
                    continue
                actual = ours_entry[key]
                what = f"rank {rank} step {stock_entry.get('step')} {key}: {actual} vs stock {expected}"
                assert abs(actual - expected) <= 1e-5 * max(1.0, abs(expected)), what
