"""unpack_trainer/patches/linear_cross_entropy.py: per-token log-probabilities of the LM head through Liger-Kernel's
fused linear cross-entropy, against the full logits.

Liger's kernels run here on CPU tensors through Triton's interpreter (the conftest's ``liger_interpreted``), so
shapes stay small. Without Liger-Kernel the kernel tests skip; on a machine with a GPU they skip too (the interpreter
would also take the CUDA tensors of the ``gpu`` tests in this process).
"""

from __future__ import annotations

import sys

import pytest
import torch

from unpack_trainer import _compat
from unpack_trainer.patches import linear_cross_entropy as lce
from unpack_trainer.patches.linear_cross_entropy import liger_unavailable_reason, linear_log_probs


@pytest.fixture
def liger(liger_interpreted):
    """Liger-Kernel's kernels on CPU tensors (the conftest's ``liger_interpreted``)."""


def _inputs(n=48, hidden=16, vocab=80, *, bias=True, ignored=(), seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=generator).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=generator) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=generator)
    t[list(ignored)] = -100
    return x, w, b, t


def _reference(x, w, b, t, dtype=torch.float32):
    logits = (x.to(dtype) @ w.to(dtype).t()).float()
    if b is not None:
        logits = logits + b.float()
    log_probs = torch.log_softmax(logits, -1).gather(1, t.clamp(min=0)[:, None])[:, 0]
    valid = t != -100
    return log_probs.masked_fill(~valid, 0), (logits.argmax(-1) == t) & valid


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [p for p in tensors if p is not None])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ignored", [(), (0, 5, 6, 47)])
def test_log_probs_and_gradients_equal_the_full_logits(liger, bias, ignored):
    """fp32: the log-probabilities, top-1 flags and every gradient of a token-mean loss equal those of the full
    logits within 1e-5 relative; ignored labels (-100) score 0 and take no gradient."""
    x, w, b, t = _inputs(bias=bias, ignored=ignored)
    log_probs, top1 = linear_log_probs(x, w, b, t)
    expected, expected_top1 = _reference(x, w, b, t)
    assert log_probs.dtype == torch.float32 and top1.dtype == torch.bool
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(top1, expected_top1)
    count = (t != -100).sum()
    ours = _grads(-log_probs.sum() / count, (x, w, b))
    stock = _grads(-expected.sum() / count, (x, w, b))
    for a, e in zip(ours, stock):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
    if ignored:
        assert not ours[0][list(ignored)].any()


def test_a_loss_that_weighs_tokens_differently_is_refused_in_the_backward(liger):
    """The head's weight gradient was summed over the tokens in the forward: a loss whose gradient differs per token
    (DFT, a per-sample mean) cannot be honoured and raises instead of training wrong."""
    x, w, b, t = _inputs()
    log_probs, _ = linear_log_probs(x, w, b, t)
    with pytest.raises(RuntimeError, match="same gradient for every token"):
        (log_probs * torch.linspace(0.5, 1.5, len(t))).sum().backward()
    # the hidden states alone are scaled per token: exact for any weighting
    x, w, b, t = _inputs(bias=False)
    w.requires_grad_(False)
    weights = torch.linspace(0.5, 1.5, len(t))
    log_probs, _ = linear_log_probs(x, w, None, t)
    (ours,) = _grads((log_probs * weights).sum(), (x,))
    (stock,) = _grads((_reference(x, w, None, t)[0] * weights).sum(), (x,))
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-7)


def _relative(actual, expected):
    return float((actual - expected).abs().max() / expected.abs().max())


def _bf16_floor_check(log_probs, grads, x, w, b, t, device_type):
    """Our bf16 error against fp32 full logits within 3x stock autocast's own (``F.linear`` under autocast, fp32
    log-softmax): log-probabilities and every gradient. Measured on the CPU (interpreter): log-probs 1.2e-3 (stock
    1.2e-3), hidden grads 5.9e-3 (6.9e-3), weight grads 7.8e-3 (3.4e-3; ours rounds the head's gradient to bf16 once,
    as the kernel's chunks are bf16) of the largest value."""
    exact, _ = _reference(x, w, b, t)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(x, w, b)
    stock = torch.log_softmax(logits.float(), -1).gather(1, t[:, None])[:, 0]
    exact_grads = _grads(-exact.mean(), (x, w, b))
    stock_grads = _grads(-stock.mean(), (x, w, b))
    assert _relative(log_probs, exact) <= 3 * _relative(stock, exact) + 1e-6
    for ours, want, theirs in zip(grads, exact_grads, stock_grads):
        assert _relative(ours, want) <= 3 * _relative(theirs, want) + 1e-6


def test_projection_runs_in_the_autocast_dtype(liger, monkeypatch):
    """Under bf16 autocast with fp32 weights (TRL's GPU default), the head projects in bf16 (no fp32 upcast), the
    log-probabilities stay fp32, the gradients come back in the parameters' dtype, and the error against fp32 full
    logits stays within a small multiple of stock autocast's own."""
    seen = []
    kernel = _compat.liger_linear_cross_entropy()

    def spy(hidden, weight, *args, **kwargs):
        seen.append((hidden.dtype, weight.dtype, torch.is_autocast_enabled("cpu")))
        return kernel(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(_compat, "liger_linear_cross_entropy", lambda: spy)
    x, w, b, t = _inputs(n=64, hidden=32, vocab=200)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs, _ = linear_log_probs(x, w, b, t)
    assert seen == [(torch.bfloat16, torch.bfloat16, False)]
    assert log_probs.dtype == torch.float32
    grads = _grads(-log_probs.mean(), (x, w, b))
    assert [g.dtype for g in grads] == [torch.float32] * 3
    _bf16_floor_check(log_probs, grads, x, w, b, t, "cpu")


def test_no_scored_position_gives_a_connected_empty_output(liger):
    x, w, b, t = _inputs()
    log_probs, top1 = linear_log_probs(x[:0], w, b, t[:0])
    assert log_probs.shape == top1.shape == (0,) and log_probs.requires_grad
    log_probs.sum().backward()
    assert x.grad is not None and not x.grad.any()


def test_unavailable_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_compat, "liger_linear_cross_entropy", lambda: object())
    assert liger_unavailable_reason("cuda") is None
    assert "CUDA only" in liger_unavailable_reason("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert liger_unavailable_reason("cpu") is None
    monkeypatch.setattr(_compat, "liger_linear_cross_entropy", lambda: None)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails
    assert "not installed" in liger_unavailable_reason("cuda")
    with pytest.raises(RuntimeError, match="linear_log_probs: Liger-Kernel is not installed"):
        linear_log_probs(*_inputs())
    assert lce.__all__ == ["linear_log_probs", "liger_unavailable_reason"]


@pytest.mark.gpu
def test_on_the_gpu_within_the_bf16_floor():
    """bf16 autocast with fp32 parameters on CUDA, compiled kernels: the error against fp32 full logits within a small
    multiple of stock autocast's own, log-probabilities and every gradient."""
    if liger_unavailable_reason("cuda") is not None:
        pytest.skip(liger_unavailable_reason("cuda"))
    x, w, b, t = (v.cuda() for v in _inputs(n=300, hidden=64, vocab=1000))
    x, w, b = (v.detach().requires_grad_() for v in (x, w, b))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        log_probs, _ = linear_log_probs(x, w, b, t)
    _bf16_floor_check(log_probs, _grads(-log_probs.mean(), (x, w, b)), x, w, b, t, "cuda")


@pytest.mark.gpu
def test_softcap_on_the_gpu():
    """fp32 on CUDA with a final-logit softcap (Liger's softcap needs CUDA's libdevice ``tanh``, which Triton's
    interpreter does not have): the log-probabilities and gradients of the softcapped full logits."""
    if liger_unavailable_reason("cuda") is not None:
        pytest.skip(liger_unavailable_reason("cuda"))
    x, w, b, t = (v.cuda() for v in _inputs(n=300, hidden=64, vocab=1000))
    x, w, b = (v.detach().requires_grad_() for v in (x, w, b))
    log_probs, _ = linear_log_probs(x, w, b, t, softcap=3.0)
    logits = 3.0 * torch.tanh((x @ w.t() + b) / 3.0)
    expected = torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
    for ours, want in zip(_grads(-log_probs.mean(), (x, w, b)), _grads(-expected.mean(), (x, w, b))):
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-6)
