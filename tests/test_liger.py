"""``use_liger_kernel=True`` with packing (unpack_trainer/trainers/liger.py): Liger-Kernel's RoPE, RMSNorm and SwiGLU
with our packed attention, exact against each sample run alone, and the one line that says whose kernel runs.

Liger's kernels run on CPU tensors through Triton's interpreter (the conftest's ``liger_interpreted``), all but its
RMSNorm, whose ``rsqrt`` (CUDA's libdevice) the interpreter does not compute: the CPU tests apply RoPE and SwiGLU, a
``gpu`` test every kernel. Liger patches modeling modules globally and has no undo: the ``liger_globals`` fixture
puts back what it replaces.
"""

from __future__ import annotations

import gc
import importlib
import logging

import pytest
import torch
from packed_rows import ROWS, assert_close, assert_same_loss_and_grads, random_samples, two_rows

from unpack_trainer._compat import hub_kernel_function
from unpack_trainer.models import patch_model, unpatch_model
from unpack_trainer.patches import rope as our_rope
from unpack_trainer.trainers.liger import liger_note, rope_owner

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# What Liger-Kernel's patch functions replace in a modeling module, per model type.
_LIGER_GLOBALS = {
    "llama": ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"),
    "qwen3": ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP"),
}


@pytest.fixture
def liger_globals(monkeypatch, liger_interpreted):
    """Put back, after the test, every modeling-module global Liger-Kernel's patch functions replace."""
    for model_type, names in _LIGER_GLOBALS.items():
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        for name in names:
            monkeypatch.setattr(modeling, name, getattr(modeling, name))


# What TRL's SFT trainer asks of Liger (no fused linear cross-entropy), less what the interpreter cannot run.
_CPU_CONFIG = {"fused_linear_cross_entropy": False, "rms_norm": False}


def _apply_liger(model, **config) -> None:
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, **(config or _CPU_CONFIG))


def _alone(model, samples):
    """Each sample run by itself: its logits, and the loss / gradients of the packed batch's token mean computed
    sample by sample (each sample's first label ignored, as in the packed rows)."""
    model.zero_grad()
    logits, total, count = [], 0.0, sum(len(s) - 1 for s in samples)
    for sample in samples:
        out = model(input_ids=sample.unsqueeze(0))
        logits.append(out.logits[0].detach())
        token_losses = torch.nn.functional.cross_entropy(out.logits[0, :-1], sample[1:], reduction="sum")
        (token_losses / count).backward()
        total += float(token_losses.detach()) / count
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits, torch.tensor(total), grads


@pytest.mark.parametrize(("model_type", "order"), [("llama", "patch_first"), ("qwen3", "liger_first")])
def test_liger_kernels_with_our_patch_pack_exactly(liger_globals, tiny_model, model_type, order):
    """Liger-Kernel's patch function and our patch, in either order (the trainer patches first, Liger applies when
    training starts): Liger's RoPE runs, and packed logits, loss and every gradient equal each sample's alone."""
    model = tiny_model(model_type, vocab_size=128, max_position_embeddings=64, attn_implementation="sdpa")
    if order == "liger_first":
        _apply_liger(model)
        patch_model(model)
    else:
        patch_model(model)
        _apply_liger(model)
    assert rope_owner(model) == "Liger-Kernel"
    assert "LigerSwiGLUMLP" in {m._get_name() for m in model.modules()}
    samples = random_samples()
    expected_logits, expected_loss, expected_grads = _alone(model, samples)
    batch = two_rows(samples)
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    lengths = [length for row in ROWS for length in row]
    for index, (piece, expected) in enumerate(zip(torch.cat(list(out.logits.detach())).split(lengths), expected_logits)):
        assert_close(piece, expected, f"sample {index} logits")
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert_same_loss_and_grads(out.loss.detach(), grads, expected_loss, expected_grads)
    unpatch_model(model)
    assert rope_owner(model) == "Liger-Kernel"  # unpatching leaves Liger's RoPE where it is


def test_rope_owner_and_the_note_without_liger(tiny_model):
    gc.collect()  # patched Llamas of earlier tests, unreachable now, give transformers' RoPE back when collected
    model = tiny_model("llama", vocab_size=64, attn_implementation="sdpa")
    assert rope_owner(model) == "transformers"
    patch_model(model)
    assert rope_owner(model) == "unpack_trainer"
    note = liger_note(model, attention="sdpa", loss_kernel="trl")
    assert "RoPE: unpack_trainer's" in note and "no Liger-Kernel module" in note and "TRL's chunked" in note
    unpatch_model(model)
    modeling = importlib.import_module(type(model).__module__)
    assert hub_kernel_function(modeling.apply_rotary_pos_emb) is not our_rope.apply_rotary_pos_emb


def test_packed_training_with_use_liger_kernel_equals_padded(
    liger_globals, tokenizer, tmp_path, caplog, param_snapshot, sft_args, tiny_llama
):
    """``use_liger_kernel=True`` (Liger applied when training starts, after our patch): one packed step == one padded
    step with the same kernels (fp32), the self-check passes on the model with Liger's kernels, and one line says
    whose RoPE, kernels, attention and loss run. (Small: Triton's interpreter runs every program in Python.)"""
    from datasets import Dataset

    from unpack_trainer import SFTTrainer

    short = Dataset.from_list([{"prompt": p, "completion": c} for p, c in [("abc", "defg"), ("hi", "jab"), ("ce", "fgh")]])

    def train(**kwargs):
        args = sft_args(
            tmp_path, use_liger_kernel=True, liger_kernel_config={"rms_norm": False}, max_length=32, **kwargs
        )
        model = tiny_llama(vocab_size=len(tokenizer), num_hidden_layers=1)
        trainer = SFTTrainer(model=model, args=args, train_dataset=short, processing_class=tokenizer)
        return trainer, trainer.train()

    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        ours, ours_result = train(packing=True)
    padded, padded_result = train(padding_free=False)
    assert ours.unpack_decision.mode == "pack" and ours.unpack_selfcheck.ok
    assert ours.unpack_stats["rows"] < ours.unpack_stats["samples"]  # samples share rows
    assert rope_owner(ours.model) == "Liger-Kernel"
    assert ours_result.training_loss == pytest.approx(padded_result.training_loss, rel=1e-5)
    a, b = param_snapshot(ours.model), param_snapshot(padded.model)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    notes = [r.getMessage() for r in caplog.records if "use_liger_kernel=True with packed rows" in r.getMessage()]
    assert len(notes) == 1
    assert "RoPE: Liger-Kernel's (it reads cos/sin per token" in notes[0]
    assert "Liger-Kernel's LigerSwiGLUMLP (per token" in notes[0]
    assert "attention: unpack_trainer's packed sdpa" in notes[0] and "loss: TRL's chunked fused LM head" in notes[0]

@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_every_liger_kernel_with_our_patch_packs_exactly_on_the_gpu(monkeypatch, tiny_model, model_type):
    """On CUDA, every kernel TRL's SFT trainer has Liger apply (RoPE, RMSNorm, SwiGLU) after our patch: packed
    logits equal each sample's alone in fp32 (compiled kernels; the CPU tests leave out RMSNorm)."""
    pytest.importorskip("liger_kernel")
    for names_model, names in _LIGER_GLOBALS.items():
        modeling = importlib.import_module(f"transformers.models.{names_model}.modeling_{names_model}")
        for name in names:
            monkeypatch.setattr(modeling, name, getattr(modeling, name))
    model = tiny_model(model_type, vocab_size=128, max_position_embeddings=64, attn_implementation="sdpa").cuda()
    patch_model(model)
    _apply_liger(model, fused_linear_cross_entropy=False)
    assert rope_owner(model) == "Liger-Kernel"
    assert {"LigerRMSNorm", "LigerSwiGLUMLP"} <= {m._get_name() for m in model.modules()}
    samples = [s.cuda() for s in random_samples()]
    with torch.no_grad():
        expected = [model(input_ids=s.unsqueeze(0)).logits[0] for s in samples]
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in two_rows(samples).items()}
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    lengths = [length for row in ROWS for length in row]
    for index, (piece, want) in enumerate(zip(torch.cat(list(logits)).split(lengths), expected)):
        torch.testing.assert_close(piece, want, rtol=1e-4, atol=1e-5, msg=f"sample {index}")
