"""Token mixers on packed rows (unpack_trainer.patches.mixers): every output and gradient == each sample alone.

Hand-built mixers (a depthwise causal convolution, a decaying recurrent scan returning a tuple) against the same
module run on each sample alone, fp32; discovery of the mixer units on tiny hybrids; the cache refusal; unpatching,
deep copies and pickles; gradient checkpointing.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unpack_trainer.anatomy.structure import find_token_mixers
from unpack_trainer.model_zoo.tiny import loss_and_grads, packed_batch, padded_batch, tiny_model
from unpack_trainer.models import PatchRefused, RefusalKind, is_patched, patch_model, unpatch_model
from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.mixers import (
    PerSampleMixers,
    is_mixer_patched,
    mixer_kind,
    packed_conv1d,
    run_padded,
)

LENGTHS = [3, 1, 5, 2]
REL = 1e-5


def _close(actual, expected):
    scale = expected.detach().abs().max().clamp_min(1e-12)
    assert float((actual - expected).detach().abs().max()) <= REL * float(scale) + 1e-8


class _Scan(torch.nn.Module):
    """h_t = a * h_{t-1} + W x_t, returns (h, h.sum(-1)): a causal recurrence carrying state along the sequence."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.decay = torch.nn.Parameter(torch.full((dim,), 0.9))

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        x = self.proj(hidden_states)
        state = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            state = self.decay * state + x[:, t]
            out.append(state)
        h = torch.stack(out, dim=1)
        return h, h.sum(-1)


def _info(lengths=LENGTHS, batch_size=1):
    total = sum(lengths)
    return PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=batch_size, seq_len=total // batch_size)


def test_packed_conv1d_equals_each_sample_alone_with_gradients():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3)
    info = _info()
    x = torch.randn(1, 6, sum(LENGTHS), requires_grad=True)
    out = packed_conv1d(conv, x, info)
    assert out.shape == (1, 6, sum(LENGTHS) + 3)
    assert torch.equal(out[..., sum(LENGTHS) :], torch.zeros(1, 6, 3))
    expected = torch.cat([conv(part)[..., : part.shape[-1]] for part in x.split(LENGTHS, dim=-1)], dim=-1)
    _close(out[..., : sum(LENGTHS)], expected)
    weights = torch.randn_like(expected)
    (grad_packed,) = torch.autograd.grad((out[..., : sum(LENGTHS)] * weights).sum(), x)
    (grad_alone,) = torch.autograd.grad((expected * weights).sum(), x)
    _close(grad_packed, grad_alone)


def test_packed_conv1d_two_rows():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(4, 4, kernel_size=3, groups=4, padding=2, bias=False)
    info = _info([2, 4, 5, 1], batch_size=2)
    x = torch.randn(2, 4, 6)
    out = packed_conv1d(conv, x, info)[..., :6]
    flat = x.transpose(0, 1).reshape(4, 12)
    parts = flat.split([2, 4, 5, 1], dim=-1)
    expected = torch.cat([conv(p.unsqueeze(0))[0, :, : p.shape[-1]] for p in parts], dim=-1)
    _close(out.transpose(0, 1).reshape(4, 12), expected)


def test_run_padded_equals_each_sample_alone_with_gradients():
    torch.manual_seed(0)
    scan = _Scan()
    info = _info()
    x = torch.randn(1, sum(LENGTHS), 6, requires_grad=True)
    h, total = run_padded(scan.forward, "scan", info, (x,), {"attention_mask": None, "packed_seq_info": info})
    alone = [scan(part) for part in x.split(LENGTHS, dim=1)]
    _close(h, torch.cat([a[0] for a in alone], dim=1))
    _close(total, torch.cat([a[1] for a in alone], dim=1))
    weights = torch.randn_like(h)
    grads = torch.autograd.grad((h * weights).sum() + total.sum(), [x, scan.decay, scan.proj.weight])
    expected = torch.autograd.grad(
        (torch.cat([a[0] for a in alone], dim=1) * weights).sum() + torch.cat([a[1] for a in alone], dim=1).sum(),
        [x, scan.decay, scan.proj.weight],
    )
    for actual, reference in zip(grads, expected):
        _close(actual, reference)


def test_run_padded_buckets_by_length():
    """Many samples of very different lengths run in more than one padded call (linear cost per padded token)."""
    calls = []
    scan = _Scan()

    def forward(hidden_states):
        calls.append(tuple(hidden_states.shape[:2]))
        return scan(hidden_states)[0]

    lengths = [1] * 40 + [700]
    info = _info(lengths)
    x = torch.randn(1, sum(lengths), 6)
    with torch.no_grad():
        out = run_padded(forward, "scan", info, (x,), {})
        _close(out[:, 40:], scan(x[:, 40:])[0])
    assert len(calls) == 2 and sum(n * length for n, length in calls) < 2 * sum(lengths)


class _Decoder:
    """Stands in for the decoder state a mixer is patched with: no packed forward running."""

    running = None


def test_packed_mixer_with_a_cache_is_refused():
    scan = _Scan()
    handler = PerSampleMixers()
    handler.patch(scan, _Decoder())
    handler.patch(scan, _Decoder())  # idempotent
    try:
        with pytest.raises(ValueError, match=r"cache \(`cache_params`\).*use_cache=False"):
            scan(torch.randn(1, 11, 6), cache_params=object(), packed_seq_info=_info())
        scan(torch.randn(1, 11, 6), cache_params=object())  # unpacked: the module's own forward
    finally:
        handler.unpatch(scan)
    assert not is_mixer_patched(scan) and "forward" not in scan.__dict__


def test_a_branched_packed_batch_is_refused_by_a_mixer():
    """A branch (a DPO completion continuing its prompt) would restart the mixer's state at the branch instead of
    carrying the prompt's: refused with the reason, never computed wrong."""
    scan = _Scan()
    handler = PerSampleMixers()
    handler.patch(scan, _Decoder())
    branched = PackedSeqInfo.from_seq_lengths(
        torch.tensor([3, 2, 2]), batch_size=1, seq_len=7, seq_parents=torch.tensor([-1, 0, 0])
    )
    try:
        with pytest.raises(ValueError, match=r"_Scan.*branched.*prefix_sharing=False"):
            scan(torch.randn(1, 7, 6), packed_seq_info=branched)
    finally:
        handler.unpatch(scan)


@pytest.mark.parametrize("model_type", ["lfm2"])
def test_a_branched_batch_on_a_hybrid_model_is_refused(model_type):
    model = tiny_model(model_type).eval()
    patch_model(model)
    try:
        with pytest.raises(ValueError, match="branched"), torch.no_grad():
            model(
                input_ids=torch.randint(3, 50, (1, 7)),
                packed_seq_lengths=torch.tensor([3, 2, 2]),
                packed_seq_parents=torch.tensor([-1, 0, 0]),
            )
    finally:
        unpatch_model(model)


def test_mixer_kind_from_the_structure():
    assert mixer_kind(torch.nn.Conv1d(2, 2, 3)) == "convolution"
    assert mixer_kind(torch.nn.Linear(2, 2)) is None
    from transformers.pytorch_utils import Conv1D

    assert mixer_kind(Conv1D(2, 2)) is None  # GPT-2's linear layer


def test_a_conv_in_attention_that_is_not_depthwise_causal_is_not_handled():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, kernel_size=3, padding=1)  # centred: reads the next token

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()

    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([Layer()])
    (mixer,) = find_token_mixers(decoder, list(decoder.layers), [Attention])
    assert mixer.name == "layers.0.self_attn.conv" and not PerSampleMixers().handles(mixer)
    assert "inside the attention module Attention, it is not a depthwise causal convolution" in mixer.problem


def test_a_mixer_outside_the_layers_is_refused_with_its_reason():
    """An attention-free model whose layers hold no mixer while one sits outside them: refused, naming it."""
    from unpack_trainer.models.refusals import check_model

    model = tiny_model("mamba")
    model.backbone.extra = torch.nn.Conv1d(4, 4, 2)
    model.backbone.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(PatchRefused, match=r"Conv1d \(backbone\.extra\).*outside the decoder layers") as refused:
        check_model(model)
    assert refused.value.kind is RefusalKind.STATE


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("qwen3_5_text", [("model.layers.0.linear_attn", "padded")]),
        ("lfm2", [("model.layers.0.conv", "padded")]),
        ("falcon_h1", [("model.layers.0.mamba", "padded"), ("model.layers.1.mamba", "padded")]),
    ],
)
def test_mixer_units_found_from_the_structure(model_type, expected):
    model = tiny_model(model_type)
    patch_model(model)
    try:
        found = [
            (name, module.__dict__["forward"].path)
            for name, module in model.named_modules()
            if is_mixer_patched(module)
        ]
        assert found == expected
    finally:
        unpatch_model(model)
    assert not any(is_mixer_patched(module) or "forward" in module.__dict__ for module in model.modules())


def _samples(lengths=(5, 2, 7), seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (length,), generator=generator) for length in lengths]


def _packed_logits(model, samples):
    batch = packed_batch(samples)
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2"])
def test_deep_copy_and_pickle_of_a_patched_hybrid_stay_exact(model_type):
    model = tiny_model(model_type).eval()
    samples = _samples()
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in samples])
    patch_model(model)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert is_patched(other)
        _close(_packed_logits(other, samples), alone)
        unpatch_model(other)
        assert not any(is_mixer_patched(module) for module in other.modules())
    unpatch_model(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_on_a_packed_hybrid(reentrant):
    """Checkpointed layers recompute their mixers in the backward, after the forward's packed state is gone: the
    layer hook hands the packing metadata to the recomputation too."""
    model = tiny_model("qwen3_5_text")
    samples = _samples()
    padded_loss, padded_grads = loss_and_grads(model, padded_batch(samples), skip_unused=True, use_cache=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    patch_model(model)
    try:
        loss, grads = loss_and_grads(model, packed_batch(samples), skip_unused=True, use_cache=False)
    finally:
        unpatch_model(model)
    _close(loss, padded_loss)
    for name, grad in padded_grads.items():
        _close(grads[name], grad)


def test_output_attentions_on_a_packed_hybrid_keeps_the_mixers_per_sample():
    """With output_attentions the attention takes transformers' dense-mask path; the mixers still run per sample."""
    model = tiny_model("lfm2", attn_implementation="eager").eval()
    samples = _samples()
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in samples])
    patch_model(model)
    try:
        batch = packed_batch(samples)
        with torch.no_grad():
            out = model(**{k: v for k, v in batch.items() if k != "labels"}, output_attentions=True)
    finally:
        unpatch_model(model)
    assert out.attentions is not None
    _close(out.logits[0], alone)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 3).flatmap(
        lambda batch: st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=batch, max_size=batch)
    )
)
def test_every_token_of_every_sample_once_in_order(rows):
    """Any samples in any rows: the re-batched mixer sees each sample alone, and every token comes back in place."""
    seq_len = max(sum(row) for row in rows)
    lengths = []
    for row in rows:  # trailing row padding is a sample of its own
        lengths += row + ([seq_len - sum(row)] if sum(row) < seq_len else [])
    info = _info(lengths, batch_size=len(rows))
    x = torch.arange(info.total_tokens, dtype=torch.float32).view(len(rows), seq_len, 1)

    def forward(hidden_states):
        return torch.cumsum(hidden_states, dim=1), hidden_states + 0.5  # a running state, and a per-token output

    with torch.no_grad():
        running, same = run_padded(forward, "cumsum", info, (x,), {})
    assert torch.equal(same, x + 0.5)
    expected = torch.cat([torch.cumsum(part, 0) for part in x.reshape(-1).split(lengths)]).view_as(x)
    assert torch.equal(running, expected)
