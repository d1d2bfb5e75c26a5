"""``unpack-trainer env``: versions, kernels and devices for a bug report, and what the patch does with a model (a
model type built tiny, or a local folder): patched or refused with its reason, the packed attention backend per
precision, the path of each token mixer."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from unpack_trainer.cli.main import main
from unpack_trainer.model_zoo.tiny import tiny_config


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["env", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_versions_kernels_and_devices(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    assert f"- transformers: {metadata.version('transformers')}" in out
    assert f"- TRL: {metadata.version('trl')}" in out and f"- torch: {metadata.version('torch')}" in out
    for package in ("flash-attn", "flash-linear-attention", "causal-conv1d", "mamba-ssm", "xformers", "triton"):
        assert f"- {package}: " in out
    assert "- cpu: threads" in out
    assert "sdpa: available" in out and "flash: " in out


def test_a_model_type_is_built_tiny_and_its_backends_shown(capsys):
    code, out, _ = run(capsys, "--model", "llama", "--json")
    assert code == 0
    report = json.loads(out)["model"]
    assert report["patched"] is True and report["class"] == "LlamaForCausalLM"
    assert set(report["attention"]) == {"float32", "bfloat16", "float32 weights, bfloat16 autocast"}
    assert report["attention"]["float32 weights, bfloat16 autocast"]["compute_dtype"] == "bfloat16"
    assert report["attention"]["float32"]["backend"] == "sdpa"  # no kernel backend on the CPU
    assert report["mixers"] == []


def test_a_refused_model_type_shows_its_reason(capsys):
    code, out, _ = run(capsys, "--model", "inkling_text")
    assert code == 0
    assert "- patch: REFUSED (positions): its attention (InklingAttention.forward) computes" in out
    assert "- trainer: trains padded (refused before any forward)" in out
    assert "Packed attention backend on" not in out


def test_token_mixers_show_their_path(capsys):
    code, out, _ = run(capsys, "--model", "qwen3_next", "--json")
    [mixer] = json.loads(out)["model"]["mixers"]
    assert "GatedDeltaNet" in mixer["mixer"] and mixer["path"] in ("per sample, padded buckets", "varlen kernels")
    assert mixer["why"]


def test_a_local_folder(capsys, tmp_path):
    tiny_config("qwen3").save_pretrained(tmp_path)
    code, out, _ = run(capsys, "--model", str(tmp_path))
    assert code == 0 and f"- built from: the folder {tmp_path}" in out and "- patch: patched" in out


def test_a_forced_backend_that_cannot_run_is_reported(capsys, monkeypatch):
    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", "flash")
    code, out, _ = run(capsys, "--model", "llama")
    assert code == 0 and "- float32: error (UNPACK_ATTENTION_BACKEND=flash cannot run here" in out


@pytest.mark.parametrize(
    ("model", "message"),
    [("no_such_type", "neither a folder nor a transformers model_type"), (".", "a folder without config.json")],
)
def test_bad_models_are_one_line_errors(capsys, model, message):
    code, out, err = run(capsys, "--model", model)
    assert code == 2 and out == "" and err.startswith("unpack-trainer env: error: --model") and message in err


def test_a_vision_language_model_shows_its_path(capsys):
    """A vision-language model type is built tiny (unpack_trainer.model_zoo.tiny_vision) and its packed path shown:
    which module keeps the packing from the vision tower, the model-family fixes the patch installs, its positions per
    sample (and where they are computed), its image tokens' attention."""
    assert main(["env", "--model", "qwen2_5_vl"]) == 0
    out = capsys.readouterr().out
    assert "Vision-language path:" in out and "- module: Qwen2_5_VLModel" in out
    assert "- model-family fixes: vision_language, multimodal_rope" in out
    assert "get_rope_index (computed in the collator, on the CPU)" in out and "- image tokens: causal" in out
    assert "- trainer: packs through the patch" in out
    assert main(["env", "--model", "gemma3"]) == 0
    out = capsys.readouterr().out
    assert "- image tokens: bidirectional within each image" in out
    assert "- model-family fixes: vision_language, image_blocks" in out


def test_an_unverified_vision_language_model_trains_padded(capsys):
    """A vision-language model type the coverage check has not verified patches, but the trainer keeps it padded
    (the decision blocks it): the report says so, not that it packs after the self-check."""
    assert main(["env", "--model", "llava_onevision"]) == 0
    out = capsys.readouterr().out
    assert "- verified by the coverage check" in out and ": no (it trains padded)" in out
    assert "- trainer: trains padded: its vision-language model type is not verified" in out
    assert "- module: LlavaOnevisionModel" in out and "- model-family fixes: vision_language" in out


def test_a_text_model_lists_its_fixes(capsys):
    assert main(["env", "--model", "bloom"]) == 0
    assert "- model-family fixes: alibi, outer_carry" in capsys.readouterr().out


def test_a_transformers_newer_than_the_coverage_table_is_a_warning(capsys, monkeypatch):
    """Issue 46 item 1: ``env --model`` says when the installed transformers is newer than every release the coverage
    table was verified on (the fused RoPE went off on 5.25 without a word)."""
    from unpack_trainer.cli.commands import env
    from unpack_trainer.models import verified

    installed = metadata.version("transformers")
    assert env._newer_than_verified((installed,)) is None
    warning = env._newer_than_verified(("5.0.0",))
    assert f"transformers {installed} is newer than" in warning and "(newest 5.0.0)" in warning
    monkeypatch.setattr(verified, "VERIFIED_WITH", ("5.0.0",))
    code, out, _ = run(capsys, "--model", "llama")
    assert code == 0 and f"- WARNING: transformers {installed} is newer than" in out


def test_the_sequence_parallel_path_is_named(capsys):
    """Where SFT's packed rows stay exact under DeepSpeed Ulysses, and why not elsewhere (the model is left unpatched)."""
    code, out, _ = run(capsys, "--model", "llama")
    assert code == 0
    assert (
        "- sequence parallelism (DeepSpeed Ulysses): SFT, DPO, reward, GRPO and RLOO pack exactly at sp_size 2, 4; refused at 8: its 4 "
        "attention heads do not divide by sp_size=8" in out
    )
    _, out, _ = run(capsys, "--model", "qwen3_next")
    assert "- sequence parallelism (DeepSpeed Ulysses): refused (token mixers (Qwen3NextGatedDeltaNet)" in out
    # A vision-language model's image rows are cut with the whole row's vision inputs by SFT's collator only
    _, out, _ = run(capsys, "--model", "qwen2_5_vl")
    assert "- sequence parallelism (DeepSpeed Ulysses): SFT (image rows) packs exactly at sp_size 2, 4;" in out
    assert "- deepspeed: " in run(capsys)[1]
