"""The kernel of the packed rows' loss (unpack_trainer/trainers/loss.py: ``loss_kernel``): TRL's chunked fused LM head
runs its projection in bf16 for our packed batches, and Liger-Kernel's fused linear cross-entropy trains exactly as it.

Liger's kernels run on CPU tensors through Triton's interpreter (the conftest's ``liger_interpreted``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unpack_trainer.patches import linear_cross_entropy
from unpack_trainer.trainers import loss as loss_module
from unpack_trainer.trainers.loss import choose_loss_kernel, head_unsupported_reason

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

_MATMULS = {"mm", "addmm", "addmm_", "matmul", "linear", "bmm"}


class _HeadMatmuls(TorchDispatchMode):
    """Records the input dtypes of every matrix multiply with a vocabulary-sized dimension (the LM head's)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in _MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(self.vocab_size in a.shape for a in tensors):
                self.seen.append((func.__name__, tuple(a.dtype for a in tensors)))
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------ the choice


def test_choose_loss_kernel_table(monkeypatch):
    monkeypatch.setattr(linear_cross_entropy, "liger_unavailable_reason", lambda device: None)
    assert choose_loss_kernel(None, device="cpu", env={}) == ("trl", "automatic on cpu")
    assert choose_loss_kernel(None, device="cuda", env={}) == ("trl", "automatic on cuda")
    assert choose_loss_kernel("trl", device="cuda", env={"UNPACK_LOSS_KERNEL": "liger"})[0] == "trl"  # config wins
    assert choose_loss_kernel(None, device="cuda", env={"UNPACK_LOSS_KERNEL": "liger"}) == (
        "liger",
        "UNPACK_LOSS_KERNEL='liger'",
    )
    assert choose_loss_kernel("liger", device="cuda", env={}) == ("liger", "loss_kernel='liger'")
    with pytest.raises(ValueError, match="`UNPACK_LOSS_KERNEL`='cce' is not supported; use one of trl, liger"):
        choose_loss_kernel(None, device="cuda", env={"UNPACK_LOSS_KERNEL": "cce"})
    monkeypatch.setattr(linear_cross_entropy, "liger_unavailable_reason", lambda device: "no Liger here")
    with pytest.raises(ValueError, match="`loss_kernel='liger'` cannot run: no Liger here. Set `loss_kernel` to 'trl'"):
        choose_loss_kernel("liger", device="cuda", env={})
    monkeypatch.setitem(loss_module.AUTOMATIC_LOSS_KERNEL, "cuda", "liger")  # once measured faster there
    assert choose_loss_kernel(None, device="cuda", env={})[0] == "liger"


def test_heads_liger_cannot_compute_as_trl_does():
    from transformers import LlamaConfig

    assert head_unsupported_reason(LlamaConfig()) is None
    scaled = LlamaConfig()
    scaled.logit_scale = 0.5
    assert head_unsupported_reason(scaled) == "the model scales its logits (logit_scale=0.5)"
    moe = LlamaConfig()
    moe.output_router_logits = True
    assert "router loss" in head_unsupported_reason(moe)


# ------------------------------------------------------------------------------------------------ TRL's kernel in bf16


def test_trl_chunked_loss_projects_packed_rows_in_bf16(tokenizer, tmp_path, sft_args, sft_train):
    """fp32 weights with ``bf16=True`` (TRL's GPU default): in a training step on packed rows, TRL's chunked LM head
    projects in bf16, forward and backward recomputation alike; no fp32 copy of the head's matmul. (Its gradient
    GEMMs accumulate in fp32: from bf16 inputs on CUDA, ``addmm(out_dtype=float32)``, from fp32 copies on the CPU.)"""
    recorder = _HeadMatmuls(len(tokenizer))
    with recorder:
        trainer, _ = sft_train(tokenizer, sft_args(tmp_path, packing=True, bf16=True, per_device_train_batch_size=8))
    assert trainer.unpack_decision.mode == "pack" and trainer.unpack_loss_kernel == "trl"
    projections = [dtypes for name, dtypes in recorder.seen if name == "mm.out"]  # TRL's tiles (the self-check: mm)
    assert len(projections) == 2 and all(dtypes == (torch.bfloat16, torch.bfloat16) for dtypes in projections)


# ------------------------------------------------------------------------------------------------ Liger's kernel


def _metrics(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def test_liger_loss_trains_as_trl(liger_interpreted, tokenizer, tmp_path, param_snapshot, sft_args, sft_train):
    """fp32: two optimizer steps of two accumulated micro-batches of packed rows (``num_items_in_batch`` across them,
    labels -100 at every sample start) with Liger's kernel == with TRL's: loss, every parameter, token accuracy; the
    entropy metric, which Liger's kernel does not compute, is not logged. (Padding-free rows take the same path.)"""
    mode = "pack"
    common = dict(packing=True, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    stock, stock_result = sft_train(tokenizer, sft_args(tmp_path, loss_kernel="trl", **common))
    ours, ours_result = sft_train(tokenizer, sft_args(tmp_path, loss_kernel="liger", **common))
    assert ours.unpack_decision.mode == mode and (ours.unpack_loss_kernel, stock.unpack_loss_kernel) == ("liger", "trl")
    assert ours_result.training_loss == pytest.approx(stock_result.training_loss, rel=1e-5)
    a, b = param_snapshot(ours.model), param_snapshot(stock.model)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert _metrics(ours, "mean_token_accuracy") == pytest.approx(_metrics(stock, "mean_token_accuracy"))
    assert _metrics(stock, "entropy") and not _metrics(ours, "entropy")


def test_liger_loss_runs_in_the_autocast_dtype_and_is_undone_by_the_fallback(
    liger_interpreted, tokenizer, tmp_path, monkeypatch, prompt_completion, sft_args, sft_train
):
    """``bf16=True`` with fp32 weights: Liger's kernel gets bf16 hidden states and head weight (no fp32 upcast); the
    environment switch chooses it; unpatching the model restores TRL's fused head."""
    from unpack_trainer import _compat
    from unpack_trainer.models import unpatch_model

    kernel = _compat.liger_linear_cross_entropy()
    seen = []

    def spy(hidden, weight, *args, **kwargs):
        seen.append((hidden.dtype, weight.dtype))
        return kernel(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(_compat, "liger_linear_cross_entropy", lambda: spy)
    monkeypatch.setenv("UNPACK_LOSS_KERNEL", "liger")
    args = sft_args(tmp_path, packing=True, bf16=True, per_device_train_batch_size=8)
    trainer, result = sft_train(tokenizer, args, prompt_completion(n=8))
    assert trainer.unpack_loss_kernel == "liger" and torch.isfinite(torch.tensor(result.training_loss))
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    liger_forward = trainer.model.forward
    unpatch_model(trainer.model)
    assert trainer.model.forward != liger_forward  # TRL's fused head again


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"loss_type": "dft"}, "needs TRL's token loss"),
        ({"loss_normalization": "sample"}, "needs TRL's token loss"),
    ],
)
def test_liger_loss_where_it_cannot_compute_the_loss_is_refused_at_start(
    liger_interpreted, tokenizer, tmp_path, extra, words, prompt_completion, sft_args, tiny_llama
):
    from unpack_trainer import SFTTrainer

    with pytest.raises(ValueError, match=f"Liger-Kernel's fused linear cross-entropy .*{words}"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, loss_kernel="liger", **extra),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )


def test_liger_loss_without_its_kernel_is_refused_at_start(
    tokenizer, tmp_path, monkeypatch, caplog, prompt_completion, sft_args, tiny_llama
):
    from unpack_trainer import SFTTrainer

    monkeypatch.setattr(linear_cross_entropy, "liger_unavailable_reason", lambda device: "Liger is missing")
    with caplog.at_level(logging.INFO, logger="unpack_trainer"), pytest.raises(ValueError, match="Liger is missing"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, loss_kernel="liger"),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
