"""Vision-language models packed: the patch leaves every unpacked forward stock and the vision tower untouched, and
packed image+text samples give what each gives alone, family x backend, fp32 on the CPU.

- packed logits == every sample run alone (relative 1e-5): SDPA, eager, flex (forward only on the CPU), and the
  flash-attn / torch varlen kernels as CPU stand-ins installed the way the real kernels are resolved;
- packed loss and every parameter gradient (vision tower included) == a padded batch of the same samples;
- multi-axis positions (the Qwen2-VL family) from the model's own ``get_rope_index`` per sample, in the forward hook
  or ahead in the collator (:class:`unpack_trainer.anatomy.vision.RopeIndex`); every layout that would contaminate is
  refused with a reason;
- Gemma 3's bidirectional image blocks on flex / SDPA / eager, on plain rows and on a shared image prompt; a varlen
  kernel hands them over (logged), or refuses when forced.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from unpack_trainer.anatomy.vision import RopeIndex, find_vision_language, multimodal_positions, rope_index_of
from unpack_trainer.data.vision import pack_processed
from unpack_trainer.model_zoo.tiny import loss_and_grads
from unpack_trainer.model_zoo.tiny_vision import (
    VISION_FAMILIES,
    family_unavailable_reason,
    gradient_mismatch,
    processed_batch,
    tiny_vision_model,
    vision_sample,
)
from unpack_trainer.models import PatchRefused, patch_model, unpatch_model
from unpack_trainer.packed_seq_info import METADATA_KEYS, MULTIMODAL_POSITIONS_KEY
from unpack_trainer.patches import attention

REL = 1e-5
ZERO = 1e-8  # gradients that are zero in exact arithmetic come out as rounding noise
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
FAMILIES = list(VISION_FAMILIES)
BACKENDS = ["sdpa", "eager", "flex", "flash", "torch_varlen"]
# flex's kernel takes head dims of 16 or more (the tiny text models' are 8; Qwen2-VL's follow the hidden size)
HEAD_DIMS = {"flex": dict(hidden_size=64, head_dim=16)}


def _segments(model_type: str) -> list[list]:
    """Three samples: text around an image, text only, two images of other sizes (where the family's are free)."""
    if model_type == "gemma4":  # images of multiples of 48 pixels: 2, 4 and 1 tokens
        return [[3, (48, 96), 4], [5], [2, (96, 96), 6, (48, 48), 2]]
    wide = {"mistral3": (56, 112), "llava_next": (28, 56)}.get(
        model_type, (56, 84) if model_type in QWEN else (56, 56)
    )
    return [[3, (56, 56), 4], [5], [2, wide, 6, (56, 56), 2]]


def _model(model_type: str, implementation: str = "sdpa", **overrides):
    reason = family_unavailable_reason(model_type)
    if reason is not None:
        pytest.skip(reason)
    return tiny_vision_model(model_type, attn_implementation=implementation, **overrides).eval()


def _samples(model, model_type: str) -> list[dict]:
    return [
        vision_sample(model_type, model.config, segments, seed=i) for i, segments in enumerate(_segments(model_type))
    ]


def _packed(samples, positions=None) -> dict:
    processed = processed_batch(samples)
    return pack_processed(processed, [s["input_ids"].shape[1] for s in samples], positions=positions)


def _problem(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = REL) -> str | None:
    scale = expected.abs().max().clamp_min(1e-12)
    error = (actual - expected).abs().max()
    return None if error <= rel * scale + ZERO else f"{what}: max abs error {error:.3e} > {rel} x {scale:.3e}"


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = REL) -> None:
    problem = _problem(actual, expected, what, rel)
    assert problem is None, problem


def _assert_matches_alone(model, samples, batch) -> None:
    with torch.no_grad():
        alone = [model(**sample).logits[0] for sample in samples]
        packed = model(**batch).logits[0]
    start = 0
    for index, expected in enumerate(alone):
        _close(packed[start : start + len(expected)], expected, f"sample {index}")
        start += len(expected)
    assert start == packed.shape[0]


def _assert_grads_match_padded(model, samples, batch) -> None:
    """Packed loss and every gradient == the padded batch's: within ``REL`` of the tensor's largest entry, or, for a
    gradient that cancels to a small value (a gated-delta-net layer's ``A_log`` and ``dt_bias``), no further from the
    padded batch's than twice the stock path's own spread of it (its other summations: each sample alone, the padded
    rows reversed; :func:`~unpack_trainer.model_zoo.tiny_vision.gradient_mismatch`)."""
    model.train()
    padded_loss, padded_grads = loss_and_grads(model, processed_batch(samples), skip_unused=True)
    packed_loss, packed_grads = loss_and_grads(model, batch, skip_unused=True)
    _close(packed_loss, padded_loss, "loss")
    assert packed_grads.keys() == padded_grads.keys()
    assert any(name.startswith(("model.visual", "model.vision")) for name in packed_grads)
    problem = gradient_mismatch(model, samples, packed_grads, padded_grads, _problem)
    assert problem is None, problem
    model.eval()


# --------------------------------------------------------------------------------------------------------------------
# CPU stand-ins of the varlen kernels (fp32, per-sample SDPA), installed the way the real kernels are resolved
# --------------------------------------------------------------------------------------------------------------------


def _per_sample(q, k, v, cu_seqlens, scale, window):
    """(total, H, D) per-sample causal attention, the kv heads repeated for GQA; ``window`` flash's left size."""
    groups = q.shape[1] // k.shape[1]
    outputs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        i = torch.arange(end - start).unsqueeze(1)
        j = torch.arange(end - start).unsqueeze(0)
        allowed = (j <= i) & ((j >= i - window) if window >= 0 else True)
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


def _stand_in_flash(calls):
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options):
        assert torch.equal(cu_q, cu_k) and options["causal"] is True
        calls.append("flash")
        window = options.get("window_size", (-1, -1))[0]
        return _per_sample(q, k, v, cu_q, options["softmax_scale"], window)

    return flash_attn_varlen_func


def _stand_in_varlen(calls):
    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False, **_):
        assert torch.equal(cu_q, cu_k) and window_size[1] == 0
        calls.append("torch_varlen")
        return _per_sample(q, k, v, cu_q, scale, window_size[0])

    return varlen_attn


@pytest.fixture
def backend(request, monkeypatch, stand_in_kernel):
    """The packed backend under test: eager / flex forced, SDPA the automatic CPU choice, or a varlen kernel as the
    automatic choice with its stand-in; yields ``(name, calls)`` with the stand-in kernel's calls."""
    name = request.param
    calls: list[str] = []
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    if name in ("eager", "flex"):
        monkeypatch.setenv(attention.ENV_BACKEND, name)
    if name in ("flash", "torch_varlen"):
        dtypes = (torch.float16, torch.bfloat16, torch.float32)
        stand_in_kernel("flash", _stand_in_flash(calls) if name == "flash" else None, cpu=True, dtypes=dtypes)
        stand_in_kernel(
            "torch_varlen", _stand_in_varlen(calls) if name == "torch_varlen" else None, cpu=True, dtypes=dtypes
        )
    return name, calls


# --------------------------------------------------------------------------------------------------------------------
# The two defects: unpacked forwards stock, the vision tower untouched
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
def test_patch_leaves_unpacked_forwards_stock(model_type):
    """A sample alone (the model computes its own 3-row positions), a padded batch with its attention mask and a
    generation step give bit-identical outputs patched and unpatched."""
    model = _model(model_type)
    samples = _samples(model, model_type)
    padded = processed_batch(samples)
    with torch.no_grad():
        stock = [model(**samples[0]).logits, model(**padded).logits]
        stock_generated = model.generate(**samples[0], max_new_tokens=3, do_sample=False)
        patch_model(model)
        patched = [model(**samples[0]).logits, model(**padded).logits]
        generated = model.generate(**samples[0], max_new_tokens=3, do_sample=False)
    for expected, actual in zip(stock, patched):
        assert torch.equal(actual, expected)
    assert torch.equal(generated, stock_generated)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_vision_tower_never_sees_the_packing(model_type, monkeypatch):
    """On a packed batch the vision tower's attention gets none of the packing keys and runs stock: the image
    features equal the unpatched model's of the same images (its forward without the packing keys, which stock
    transformers also hands its text model: Qwen3.5's gated delta rule refuses them without flash-linear-attention)."""
    model = _model(model_type)
    samples = _samples(model, model_type)
    batch = _packed(samples)
    vision = find_vision_language(model)
    tower = [m for m in vision.module.children() if m is not vision.decoder and any(True for _ in m.parameters())]
    seen: list[set] = []

    def record(module, args, kwargs):
        seen.append(set(kwargs))

    hooks = [
        m.register_forward_pre_hook(record, with_kwargs=True)
        for child in tower
        for m in child.modules()
        if "Attention" in type(m).__name__
    ]
    features: list[torch.Tensor] = []
    capture = [child.register_forward_hook(lambda m, a, out: features.append(_first_tensor(out))) for child in tower]
    with torch.no_grad():
        model(**{key: value for key, value in batch.items() if key not in METADATA_KEYS})
        stock_calls = len(seen)
        patch_model(model)
        model(**batch)
    for hook in hooks + capture:
        hook.remove()
    patched = seen[stock_calls:]
    assert patched and all(not (keys & {*METADATA_KEYS, "packed_seq_info"}) for keys in patched)
    half = len(features) // 2
    for before, after in zip(features[:half], features[half:]):
        assert torch.equal(before, after)


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return _first_tensor(output[0])
    return output[0] if not hasattr(output, "last_hidden_state") else output.last_hidden_state


# --------------------------------------------------------------------------------------------------------------------
# Exact, family x backend
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_logits_and_gradients_match(model_type, backend):
    name, calls = backend
    model = patch_model(_model(model_type, **HEAD_DIMS.get(name, {})))
    samples = _samples(model, model_type)
    batch = _packed(samples)
    _assert_matches_alone(model, samples, batch)
    if name != "flex":  # torch has no flex backward on the CPU
        _assert_grads_match_padded(model, samples, batch)
    handed_over = model_type == "gemma3" and name in ("flash", "torch_varlen")
    assert bool(calls) == (name in ("flash", "torch_varlen") and not handed_over)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"], indirect=True)
@pytest.mark.parametrize("model_type", ["gemma3", "gemma4"])
def test_image_blocks_with_a_sliding_window(model_type, backend):
    """A sliding window shorter than the samples and the images: an image's tokens still see each other both ways
    within the window, as Gemma 3 and Gemma 4 alone do."""
    model = patch_model(_model(model_type, sliding_window=3, **HEAD_DIMS.get(backend[0], {})))
    samples = _samples(model, model_type)
    batch = _packed(samples)
    _assert_matches_alone(model, samples, batch)
    if backend[0] != "flex":
        _assert_grads_match_padded(model, samples, batch)


@pytest.mark.parametrize("window", [None, 4], ids=["causal", "window"])
@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"], indirect=True)
@pytest.mark.parametrize("model_type", ["gemma3", "gemma4"])
def test_image_blocks_on_a_shared_prompt(model_type, backend, window):
    """A prompt holding an image shared by two completions (the branched row of a preference pair): the image's
    tokens see each other both ways on the shared prompt, so every token equals its full sequence run alone (the
    branched self-check's image probe), on flex / SDPA / eager, with and without a sliding window shorter than the
    image (Gemma 4: on its sliding-window layers only)."""
    from unpack_trainer.selfcheck import check_uncontaminated

    overrides = {} if window is None else {"sliding_window": window}
    model = patch_model(_model(model_type, **overrides, **HEAD_DIMS.get(backend[0], {})))
    report = check_uncontaminated(model, branched=True, lengths=(3, 1, 4), measure_contamination=False)
    assert report.ok, report.failure()


def test_gemma4_image_blocks_follow_its_switch_and_layer_types():
    """Gemma 4's image tokens attend both ways where its text config's ``use_bidirectional_attention`` is
    ``"vision"``, on its sliding-window layers only (read from its own mask builder): the fix marks its full-attention
    layers causal; with ``None`` (its smaller models) no image-blocks fix is installed, and both pack exactly."""
    from unpack_trainer.anatomy.vision import image_block_layer_types
    from unpack_trainer.models.state import attention_state, decoder_state

    model = patch_model(_model("gemma4"))
    assert image_block_layer_types(find_vision_language(model).module) == {"sliding_attention"}
    text = model.model.language_model
    assert "image_blocks" in decoder_state(text).fixes
    marked = {layer.self_attn.layer_type: attention_state(layer.self_attn).image_blocks for layer in text.layers}
    assert marked == {"sliding_attention": True, "full_attention": False}
    unpatch_model(model)
    assert all(attention_state(layer.self_attn) is None for layer in text.layers)
    model = patch_model(_model("gemma4", use_bidirectional_attention=None))
    assert find_vision_language(model).image_blocks is None
    assert "image_blocks" not in decoder_state(model.model.language_model).fixes
    samples = _samples(model, "gemma4")
    batch = _packed(samples)
    _assert_matches_alone(model, samples, batch)
    _assert_grads_match_padded(model, samples, batch)


def test_image_blocks_hand_over_from_a_varlen_kernel_or_refuse_it(monkeypatch, caplog, stand_in_kernel):
    """Gemma 3's image blocks: the automatic choice hands them from flash-attn to SDPA (logged once, with the
    reason); flash-attn forced refuses them with the reason."""
    calls: list[str] = []
    stand_in_kernel("flash", _stand_in_flash(calls), cpu=True, dtypes=(torch.float32,))
    monkeypatch.delenv(attention.ENV_BACKEND, raising=False)
    model = patch_model(_model("gemma3"))
    samples = _samples(model, "gemma3")
    with caplog.at_level(logging.WARNING, logger="unpack_trainer"):
        _assert_matches_alone(model, samples, _packed(samples))
    assert "flash cannot apply bidirectional image blocks; using sdpa" in caplog.text
    text_only = [vision_sample("gemma3", model.config, [6], seed=3), vision_sample("gemma3", model.config, [4])]
    _assert_matches_alone(model, text_only, _packed(text_only))  # no image: flash-attn runs it
    assert calls
    monkeypatch.setenv(attention.ENV_BACKEND, "flash")
    with pytest.raises(ValueError, match="flash cannot apply bidirectional image blocks"):
        with torch.no_grad():
            model(**_packed(samples))


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "idefics3"])
def test_several_rows_and_trailing_padding(model_type):
    """Two rows, each ending with a padding pseudo-sample: every sample still equals itself alone."""
    model = patch_model(_model(model_type))
    samples = _samples(model, model_type)
    batch = _packed(samples)
    lengths = [s["input_ids"].shape[1] for s in samples]
    # rows [s0, s1, pad] and [s2, pad], as a collator with pad_to_multiple_of would lay them out
    row = max(lengths[0] + lengths[1], lengths[2]) + 2
    pad = [row - lengths[0] - lengths[1], row - lengths[2]]
    ids = batch["input_ids"][0]
    split = [ids[: lengths[0] + lengths[1]], ids[lengths[0] + lengths[1] :]]
    batch = dict(batch)
    batch["input_ids"] = torch.stack(
        [torch.cat([part, torch.zeros(p, dtype=torch.int64)]) for part, p in zip(split, pad)]
    )
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in batch:
            types = batch[key][0]
            parts = [types[: lengths[0] + lengths[1]], types[lengths[0] + lengths[1] :]]
            batch[key] = torch.stack(
                [torch.cat([part, torch.zeros(p, dtype=torch.int64)]) for part, p in zip(parts, pad)]
            )
    seq_lengths = torch.tensor([lengths[0], lengths[1], pad[0], lengths[2], pad[1]], dtype=torch.int32)
    for key in ("position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        batch.pop(key)
    batch["packed_seq_lengths"] = seq_lengths
    with torch.no_grad():
        packed = model(**batch).logits
        alone = [model(**sample).logits[0] for sample in samples]
    _close(packed[0, : lengths[0]], alone[0], "sample 0")
    _close(packed[0, lengths[0] : lengths[0] + lengths[1]], alone[1], "sample 1")
    _close(packed[1, : lengths[2]], alone[2], "sample 2")


# --------------------------------------------------------------------------------------------------------------------
# Positions: from the model's own get_rope_index, or refused
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", QWEN)
def test_positions_computed_ahead_equal_the_hooks(model_type):
    """The collator's positions (the model's get_rope_index through a picklable RopeIndex, 4 rows, under their own
    key beside the restarting ``position_ids``) give the same logits as the forward hook's, and as each sample
    alone."""
    model = patch_model(_model(model_type))
    samples = _samples(model, model_type)
    rope_index = rope_index_of(model)
    assert isinstance(rope_index, RopeIndex)
    rope_index = pickle.loads(pickle.dumps(rope_index))

    def positions(ids, info, inputs):
        return multimodal_positions(rope_index, ids, info, inputs)

    ahead = _packed(samples, positions=positions)
    multimodal = ahead[MULTIMODAL_POSITIONS_KEY]
    assert multimodal.shape == (4, 1, ahead["input_ids"].shape[1])
    lengths = [s["input_ids"].shape[1] for s in samples]
    restarting = [p for length in lengths for p in range(length)]
    assert multimodal[0, 0].tolist() == ahead["position_ids"][0].tolist() == restarting
    _assert_matches_alone(model, samples, ahead)
    with torch.no_grad():
        assert torch.equal(model(**ahead).logits, model(**_packed(samples)).logits)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_positions_that_would_contaminate_are_refused(model_type):
    model = patch_model(_model(model_type))
    samples = _samples(model, model_type)
    batch = _packed(samples)
    whole_row, _ = model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"]
    )
    with pytest.raises(ValueError, match="position_ids of 3 rows; its text model takes 4"):
        model(**{**batch, "position_ids": whole_row})
    arange = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0)
    with pytest.raises(ValueError, match="2-D position_ids other than each sample's own"):
        model(**{**batch, "position_ids": arange})
    with pytest.raises(ValueError, match="needs `mm_token_type_ids`"):
        model(**{key: value for key, value in batch.items() if key != "mm_token_type_ids"})


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_use_cache_and_positions_only(model_type):
    """``use_cache=True`` on a packed batch stays exact (the cache is written, attention stays per sample); a packed
    batch given by restarting positions alone (no metadata) is found and run per sample."""
    model = patch_model(_model(model_type))
    samples = _samples(model, model_type)
    batch = _packed(samples)
    _assert_matches_alone(model, samples, {**batch, "use_cache": True})
    only_positions = {k: v for k, v in batch.items() if k not in (*METADATA_KEYS, "labels")}
    _assert_matches_alone(model, samples, only_positions)


def test_output_attentions_on_packed_image_rows():
    """``output_attentions=True``: Qwen2.5-VL's text model builds its own masks, so its packed batch takes
    transformers' dense path exactly (each sample's positions still its own) and returns the weights; Gemma 3 builds
    its text masks in its multimodal model, before that path can be taken: refused with the reason. The batch carries
    its ``packed_seq_info``, as the trainer's collator hands it over."""
    model = patch_model(_model("qwen2_5_vl", "eager"))  # (SDPA returns no weights, packed or not)
    samples = _samples(model, "qwen2_5_vl")
    batch = pack_processed(processed_batch(samples), [s["input_ids"].shape[1] for s in samples], seq_info=True)
    with torch.no_grad():
        outputs = model(**batch, output_attentions=True)
    assert len(outputs.attentions) == model.config.text_config.num_hidden_layers
    _assert_matches_alone(model, samples, batch)
    with torch.no_grad():
        alone = torch.cat([model(**sample).logits[0] for sample in samples])
    _close(outputs.logits[0], alone, "dense path")
    model = patch_model(_model("gemma3", "eager"))
    samples = _samples(model, "gemma3")
    with pytest.raises(ValueError, match="Gemma3Model: it builds its text model's attention masks itself"):
        with torch.no_grad():
            model(**_packed(samples), output_attentions=True)


def test_unpatch_removes_the_vision_hooks():
    """The vision fixes of a model (here: the vision tower kept out of the packing and the multi-axis positions) are
    one pre-hook each on its multimodal model, and a post-hook clearing what the first handed over; unpatching takes
    them all off and leaves nothing on the decoder."""
    from unpack_trainer.models.state import PATCH_ATTRIBUTE, decoder_state

    model = _model("qwen2_5_vl")
    samples = _samples(model, "qwen2_5_vl")
    stock_pre, stock_post = dict(model.model._forward_pre_hooks), dict(model.model._forward_hooks)
    patch_model(model)
    assert decoder_state(model.model.language_model).fixes[:2] == ["vision_language", "multimodal_rope"]
    assert len(model.model._forward_pre_hooks) == len(stock_pre) + 2
    assert len(model.model._forward_hooks) == len(stock_post) + 1
    unpatch_model(model)
    assert dict(model.model._forward_pre_hooks) == stock_pre and dict(model.model._forward_hooks) == stock_post
    assert all(PATCH_ATTRIBUTE not in module.__dict__ for module in model.modules())
    with torch.no_grad():
        model(**samples[0])


def test_multi_axis_rope_without_get_rope_index_is_refused(monkeypatch):
    model = _model("qwen2_5_vl")
    monkeypatch.delattr(type(model.model), "get_rope_index")
    with pytest.raises(PatchRefused, match="has no get_rope_index"):
        patch_model(model)


def test_an_unknown_bidirectional_rule_is_refused(monkeypatch):
    """Image tokens attending both ways by a rule the package does not read (here: Gemma 3 with its block function
    hidden) are refused before any forward."""
    from unpack_trainer.anatomy import vision

    model = _model("gemma3")
    monkeypatch.setattr(vision, "_image_block_function", lambda module: None)
    with pytest.raises(PatchRefused, match="attend both ways by a rule this package does not read"):
        patch_model(model)


# --------------------------------------------------------------------------------------------------------------------
# The self-check covers image rows
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "gemma4"])
def test_selfcheck_probes_image_rows(model_type, monkeypatch):
    """Unpatched, Qwen2.5-VL's packed image rows are contaminated (its multimodal RoPE runs over the row) and the
    self-check says so; patched it passes; Gemma 3 and Gemma 4 patched with their image blocks dropped fail it.
    Read-only throughout. (Unpatched Gemma 3 may pass: transformers' own dense packed mask can express its image
    blocks.)"""
    from unpack_trainer.models.fixes import image_blocks
    from unpack_trainer.selfcheck import check_uncontaminated

    model = _model(model_type)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    deltas = model.model.rope_deltas if hasattr(model.model, "rope_deltas") else None
    if model_type == "qwen2_5_vl":
        assert not check_uncontaminated(model).ok
    patch_model(model)
    report = check_uncontaminated(model)
    assert report.ok, report.summary()
    if model_type in ("gemma3", "gemma4"):
        monkeypatch.setattr(image_blocks, "image_block_spans", lambda *args: None)
        assert not check_uncontaminated(model).ok
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert getattr(model.model, "rope_deltas", None) is deltas


# --------------------------------------------------------------------------------------------------------------------
# The coverage table of the families
# --------------------------------------------------------------------------------------------------------------------


def test_vision_coverage_is_verified_and_documented():
    """Every family is fast on the installed transformers (and verified where measured); docs/vlm.md's table is the
    generated one on the release it was generated with."""
    from pathlib import Path

    import transformers
    from model_coverage import VISION_END, VISION_START, check_vision_type, vision_coverage_table

    from unpack_trainer.models.verified import VERIFIED_VISION_MODEL_TYPES, VERIFIED_VISION_WITH

    outcomes = [check_vision_type(model_type) for model_type in VISION_FAMILIES]
    for outcome in outcomes:
        assert outcome.status in ("fast", "skipped"), f"{outcome.model_type}: {outcome.reason}"
    if transformers.__version__ in VERIFIED_VISION_WITH:
        assert {o.model_type for o in outcomes if o.status == "fast"} == set(VERIFIED_VISION_MODEL_TYPES)
    if transformers.__version__ == VERIFIED_VISION_WITH[-1]:
        docs = (Path(__file__).parents[2] / "docs" / "vlm.md").read_text()
        table = docs.split(VISION_START, 1)[1].split(VISION_END, 1)[0].strip()
        assert table == vision_coverage_table(outcomes), (
            "docs/vlm.md's table is stale: run python tools/model_coverage.py --vision --write-docs"
        )


# --------------------------------------------------------------------------------------------------------------------
# The real kernels on a GPU
# --------------------------------------------------------------------------------------------------------------------

GPU_REL = 3e-2  # bf16 (autocast): the packed kernel and the stock path round differently


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch_varlen", "flash", "flex", "sdpa"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_on_the_gpu_kernels_matches_alone(model_type, name, monkeypatch):
    """On CUDA, under bf16 autocast (TRL's default), each backend's real kernel: packed image+text logits == every
    sample alone through the stock path, the packed loss == the padded batch's, and the backward runs with finite
    gradients for the vision tower and the decoder."""
    device = torch.device("cuda")
    reason = attention.backend_unavailable_reason(name, device, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    if model_type == "gemma3" and name in ("flash", "torch_varlen"):
        pytest.skip("image blocks: a varlen kernel hands them over or refuses them (the CPU tests)")
    monkeypatch.setenv(attention.ENV_BACKEND, name)
    model = patch_model(_model(model_type, hidden_size=64, head_dim=16).to(device))
    samples = [_on(sample, device) for sample in _samples(model, model_type)]
    batch, padded = _on(_packed(samples), device), _on(processed_batch(samples), device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        alone = [model(**sample).logits[0].float() for sample in samples]
        packed = model(**batch).logits[0].float()
    start = 0
    for index, expected in enumerate(alone):
        _close(packed[start : start + len(expected)], expected, f"sample {index}", rel=GPU_REL)
        start += len(expected)
    model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        padded_loss = model(**padded).loss
        packed_loss = model(**batch).loss
    packed_loss.backward()
    _close(packed_loss.float(), padded_loss.float(), "loss", rel=GPU_REL)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith(("model.visual", "model.vision")) for n in grads)
    assert all(torch.isfinite(g).all() for g in grads.values())


def _on(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
