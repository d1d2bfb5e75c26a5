"""The bucket planner's GPU planning (few large buckets, lengths on a fixed grid) and the SDPA buckets' kernels on
CUDA (never cuDNN attention), checked on the CPU through the device-type seams.

The planner's placement of every token and its CPU cost model: tests/patches/test_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches import buckets
from unpack_trainer.patches.attention import REGISTRY, packed_attention_forward
from unpack_trainer.patches.attention import sdpa as sdpa_backend


class FakeModule(torch.nn.Module):
    is_causal = True


def llama_like_lengths(generator: torch.Generator, count: int = 16) -> torch.Tensor:
    """Lognormal sample lengths around 400 tokens, at most 4,096 (the issue's GPU run)."""
    return torch.exp(torch.randn(count, generator=generator) * 0.8 + 6).round().clamp(1, 4096).to(torch.int64)


def grid_values(longest: int) -> set[int]:
    return {buckets.grid_length(n) for n in range(1, longest + 1)}


def test_grid_length_by_hand():
    assert [buckets.grid_length(n) for n in (1, 16, 17, 128, 129, 160, 161, 300, 512, 513, 4097)] == [
        16,
        16,
        32,
        128,
        160,
        160,
        192,
        320,
        512,
        640,
        5120,
    ]
    assert len(grid_values(4096)) == 8 + 5 * 4  # 16..128 by 16, then four per octave: (128, 256], ..., (2048, 4096]


def test_gpu_planning_bounds_the_bucket_shapes(monkeypatch):
    """Issue 26 item 2: on a GPU the SDPA buckets of a step are few, and their lengths come from a small fixed set,
    so the shapes of a run repeat. Twenty steps of 16 Llama-like samples: at most 5 buckets a step (CPU planning:
    up to 16), 15 distinct lengths over all steps (CPU planning: 256)."""
    monkeypatch.setattr(buckets, "GPU_DEVICE_TYPES", ("cuda", "cpu"))
    generator = torch.Generator().manual_seed(0)
    gpu_lengths, cpu_lengths = set(), set()
    for _ in range(20):
        lengths = llama_like_lengths(generator)
        info = PackedSeqInfo.from_seq_lengths(lengths, batch_size=1, seq_len=int(lengths.sum()))
        gpu = buckets.attention_plan(info, torch.device("cpu")).buckets
        cpu = buckets.build_plan(info, torch.device("cpu")).buckets
        assert len(gpu) <= 5 and len(gpu) <= len(cpu)
        assert all(bucket.length == buckets.grid_length(bucket.length) for bucket in gpu)
        gpu_lengths |= {bucket.length for bucket in gpu}
        cpu_lengths |= {bucket.length for bucket in cpu}
    assert gpu_lengths <= grid_values(4096) and len(gpu_lengths) <= 15 < len(cpu_lengths)


def random_qkv(total: int, *, heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, total, dim, generator=generator).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def output_and_grads(backend: str, info: PackedSeqInfo, inputs, **options) -> list[torch.Tensor]:
    for x in inputs:
        x.grad = None
    out, _ = packed_attention_forward(FakeModule(), *inputs, None, backend=backend, packed_seq_info=info, **options)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    (out * weight).sum().backward()
    return [out.detach()] + [x.grad.clone() for x in inputs]


LAYOUTS = {
    "plain": ([37, 1, 150, 9, 64, 130], None),
    # a prompt with two completions (a later branch sees the prompt and itself), then a plain sample
    "branched": ([40, 17, 29, 33], [-1, 0, 0, -1]),
}


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "options", [{}, {"sliding_window": 24}, {"alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])}]
)
def test_gpu_planned_buckets_compute_the_same_attention(monkeypatch, backend, layout, options):
    """Bucket lengths rounded up to the grid only add padding after each sample (and key slots no query sees):
    output and gradients equal the CPU plan's, windows, ALiBi and shared prompts included."""
    lengths, parents = LAYOUTS[layout]
    if parents is not None and "alibi_slopes" in options:
        pytest.skip("ALiBi on a branched batch runs the [prefix; branch] units, planned as a plain batch")
    info = PackedSeqInfo.from_seq_lengths(
        torch.tensor(lengths), batch_size=1, seq_len=sum(lengths), seq_parents=parents
    )
    inputs = random_qkv(sum(lengths))
    expected = output_and_grads(backend, info, inputs, scaling=0.3, **options)
    monkeypatch.setattr(buckets, "GPU_DEVICE_TYPES", ("cuda", "cpu"))
    info = PackedSeqInfo.from_seq_lengths(
        torch.tensor(lengths), batch_size=1, seq_len=sum(lengths), seq_parents=parents
    )  # a fresh batch: plans are cached per batch
    plan = (buckets.branch_plan if parents else buckets.attention_plan)(info, torch.device("cpu"))
    assert all(bucket.length == buckets.grid_length(bucket.length) for bucket in plan.buckets)
    assert any(bucket.length not in lengths for bucket in plan.buckets)  # rounded up: more padding than the CPU plan
    for got, want in zip(output_and_grads(backend, info, inputs, scaling=0.3, **options), expected):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_sdpa_buckets_run_without_cudnn_attention(monkeypatch):
    """On CUDA every bucket call runs with cuDNN attention off (it plans on the host for every new shape) and the
    backends that were on still on; a user's own restriction (here math and cuDNN only) is kept, less cuDNN. The CPU
    stands in through the device-type seam."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(sdpa_backend, "NO_CUDNN_DEVICE_TYPES", ("cuda", "cpu"))
    original = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def spy(*args, **kwargs):
        backends = torch.backends.cuda
        seen.append((backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.math_sdp_enabled()))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    lengths = [37, 1, 150, 9, 64]
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=sum(lengths))
    inputs = random_qkv(sum(lengths))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    packed_attention_forward(FakeModule(), *inputs, None, backend="sdpa", packed_seq_info=info)
    assert seen and set(seen) == {(False, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the buckets
    seen.clear()
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
        packed_attention_forward(FakeModule(), *inputs, None, backend="sdpa", packed_seq_info=info)
    assert seen and set(seen) == {(False, False, True)}


def test_cuda_device_types_are_seams_of_the_planner_and_the_kernels():
    """Without the seams the CPU keeps its cost model and SDPA's own choice (what the CPU tests above change)."""
    assert buckets.planning_for(torch.device("cpu")) == buckets.Planning()
    assert buckets.planning_for(torch.device("cuda")) == buckets.Planning(buckets.GPU_CALL_COST_PAIRS, grid=True)
    assert sdpa_backend.NO_CUDNN_DEVICE_TYPES == ("cuda",)
    assert {record.kernel.device_types for record in REGISTRY.values() if record.kernel is not None} >= {("cuda",)}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "eager", "torch_varlen", "flex"])
def test_no_device_to_host_sync_per_layer(backend):
    """Issue 26 item 2: once a batch's plans exist (built by its first layer), a layer's forward and backward never
    wait for the GPU: torch's sync debug mode raises on any synchronising call."""
    from unpack_trainer.patches.attention import backend_unavailable_reason

    reason = backend_unavailable_reason(backend, torch.device("cuda"), torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    lengths = [37, 1, 150, 9, 640, 130]
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=sum(lengths))
    inputs = [x.detach().to("cuda", torch.bfloat16).requires_grad_() for x in random_qkv(sum(lengths), dim=64)]
    output_and_grads(backend, info, inputs, scaling=0.125, sliding_window=128)  # the first layer builds the plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = packed_attention_forward(
            FakeModule(), *inputs, None, backend=backend, packed_seq_info=info, scaling=0.125, sliding_window=128
        )
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
