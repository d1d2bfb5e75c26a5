"""Coverage of every causal-LM model type of transformers: fast packed path verified, refused, or skipped, with why.

For each ``model_type`` of ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
:func:`check_model_type` builds a tiny model from its config class (2 layers, hidden size <= 64, a sliding window or
attention chunk smaller than the samples where the config has one) and returns one :class:`Outcome`:

- ``"fast"``: :func:`~unpack_trainer.models.patch_model` patches it, and on SDPA and on eager (each the model
  supports) the packed logits equal each sample run alone (fp32, relative 1e-5), the packed loss and every parameter
  gradient equal a padded batch of the same samples (a gradient past 1e-5 of its largest entry: within twice the stock
  path's own spread of it, see :func:`~unpack_trainer.models.tiny_vision.gradient_mismatch`), the packed helper runs
  in every attention layer, and transformers' mask function is never called for the packed batch (so no ``(T, T)``
  mask is built);
- ``"refused"``: ``patch_model`` refuses it with a named reason (:class:`~unpack_trainer.models.PatchRefused`);
  an encoder whose causal-LM class is causal only as a decoder (BERT, RoBERTa, ...: refused by default for its
  bidirectional self-attention) is checked built with ``is_decoder=True`` (:data:`AS_DECODER`) where its config takes
  it, and the table says so;
- ``"skipped"``: not a decoder-only text model, or it cannot be built here; the reason says which;
- ``"failed"``: a check did not hold (never expected: ``tests/models/test_coverage.py`` fails on it).

``python -m unpack_trainer.models --coverage`` prints the table (``--write-docs`` puts it into docs/models.md). What the
runs verified is kept in :mod:`unpack_trainer.models.verified` (the patch reads it without running a check); the
coverage test keeps it exact on the release installed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from unpack_trainer._compat import mask_functions, supports_sdpa
from unpack_trainer.models.tiny import (
    TINY_SIZES,
    _quiet,
    config_class,
    loss_and_grads,
    packed_batch,
    padded_batch,
    tiny_config,
    tiny_model,
)
from unpack_trainer.models.verified import NOT_VERIFIED_ON, VERIFIED_MODEL_TYPES, VERIFIED_WITH

__all__ = [
    "Outcome",
    "check_model_type",
    "check_vision_type",
    "coverage_table",
    "not_fast_here",
    "run_coverage",
    "vision_coverage_table",
]

REL = 1e-5
VOCAB = TINY_SIZES["vocab_size"]
SAMPLE_LENGTHS = (5, 2, 7)
WINDOW = TINY_SIZES["sliding_window"]  # sliding window / attention chunk, smaller than the longest sample
IMPLEMENTATIONS = ("sdpa", "eager")

# Model types that cannot be checked here, and why.
_SKIP: dict[str, str] = {
    "fuyu": "a vision-language model (image patches are fed to the decoder): not a text-only decoder",
    # Speculative-decoding drafters: every layer reads the target model's keys and values.
    **{
        drafter: (
            "a speculative-decoding assistant: its forward needs the target model's inputs_embeds and "
            "shared_kv_states (every layer attends to the target's keys and values), not a standalone decoder"
        )
        for drafter in ("gemma4_assistant", "gemma4_unified_assistant")
    },
}

_MODALITIES = ("vision", "visual", "audio", "speech", "image", "patch", "vq", "depth")
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "visual", "vision_tower", "speech_config", "vq_config")


@dataclass(frozen=True)
class Outcome:
    """The coverage result of one model type.

    Attributes:
        model_type: ``config.model_type``.
        status: ``"fast"``, ``"refused"``, ``"skipped"`` or ``"failed"``.
        reason: for refused / skipped / failed: why; for fast: what was checked.
        kind: for refused: :attr:`PatchRefused.kind`.
        source: the config that decided: ``"default"`` (the config class's defaults, built on the meta device) or
            ``"tiny"`` (:func:`tiny_config`).
        implementations: the attention implementations verified (fast).
        seconds: time the check took.
        note: how the model was built where it matters to a user (an encoder checked as a decoder); shown in the
            table's reason column.
    """

    model_type: str
    status: str
    reason: str
    kind: str = ""
    source: str = "tiny"
    implementations: tuple[str, ...] = ()
    seconds: float = 0.0
    note: str = ""


def _skip_reason(default: Any) -> str | None:
    if getattr(default, "is_encoder_decoder", False):
        return "an encoder-decoder model, not decoder-only"
    present = [key for key in _MULTIMODAL_KEYS if getattr(default, key, None) is not None]
    present += [key for key in getattr(default, "sub_configs", {}) if any(m in key for m in _MODALITIES)]
    if present:
        return f"a multimodal or composite model ({present[0]}): not a text-only decoder"
    return None


# An encoder whose causal-LM class is causal only as a decoder (BERT, RoBERTa, ...) is checked built as one, without
# the cross-attention to an encoder's outputs that a causal LM of its own does not use.
AS_DECODER: dict[str, bool] = dict(is_decoder=True, add_cross_attention=False)


def _samples(lengths: tuple[int, ...] = SAMPLE_LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator) for length in lengths]


# Absolute floor of the comparison: gradients that are zero in exact arithmetic (the bias of the key projection:
# softmax does not change when a constant is added to every score of a query) come out as rounding noise ~1e-10.
ZERO = 1e-8


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
    scale = expected.abs().max().clamp_min(1e-12)
    error = (actual - expected).abs().max()
    if not bool(error <= REL * scale + ZERO):
        return f"{what}: max abs error {float(error):.3e} > {REL} x max |expected| {float(scale):.3e}"
    return None


class _Spies:
    """Counts packed-helper backend calls and calls of transformers' own mask functions while active (with
    ``config``: only the mask calls for that config, a vision-language model's text model)."""

    def __init__(self, config: Any = None) -> None:
        self.backend_calls = 0
        self.mask_calls: list[str] = []
        self.config = config

    @contextlib.contextmanager
    def active(self):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        from unpack_trainer.patches.attention import REGISTRY

        backends = dict(REGISTRY)
        # transformers' own mask functions: the class-wide registry (a patched model's routing, in the per-instance
        # mapping, calls them when it does not skip the mask); the originals are registered back afterwards.
        masks = dict(mask_functions())

        def backend_spy(function):
            def spy(*args, **kwargs):
                self.backend_calls += 1
                return function(*args, **kwargs)

            return spy

        def mask_spy(name, function):
            def spy(*args, **kwargs):
                if self.config is None or kwargs.get("config") is self.config:
                    self.mask_calls.append(name)
                return function(*args, **kwargs)

            return spy

        try:
            for name, record in backends.items():
                REGISTRY[name] = record._replace(forward=backend_spy(record.forward))
            for name, function in masks.items():
                ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_spy(name, function))
            yield self
        finally:
            REGISTRY.update(backends)
            for name, function in masks.items():
                ALL_MASK_ATTENTION_FUNCTIONS.register(name, function)


def _verify(model_type: str, config: Any, implementation: str, attention_layers: int) -> str | None:
    """Run the fast-path checks on one implementation; the first failure, or ``None``. A gradient past 1e-5 of its
    largest entry is held to the stock path's own spread of it
    (:func:`~unpack_trainer.models.tiny_vision.gradient_mismatch`: a tiny CTRL's feed-forward has a ReLU input within
    float32 rounding of zero)."""

    from unpack_trainer.models import patch_model, unpatch_model
    from unpack_trainer.models.tiny_vision import gradient_mismatch

    model = tiny_model(model_type, config=config, attn_implementation=implementation).eval()
    samples = _samples()
    try:
        with torch.no_grad():
            alone = [model(input_ids=sample.unsqueeze(0), use_cache=False).logits[0] for sample in samples]
        padded_loss, padded_grads = loss_and_grads(model, padded_batch(samples), skip_unused=True, use_cache=False)
    except Exception as error:  # noqa: BLE001 - reported: the tiny config, not the patch, needs fixing
        return (
            f"{implementation}: the stock model (not patched) fails on its tiny config, so unpack_trainer.models.tiny's sizes "
            f"do not fit this type: {type(error).__name__}: {error}"
        )[:300]
    patch_model(model)
    try:
        packed = packed_batch(samples)
        spies = _Spies()
        with spies.active(), torch.no_grad():
            logits = model(**{k: v for k, v in packed.items() if k != "labels"}).logits[0]
        if spies.mask_calls:
            return f"{implementation}: transformers' mask function {spies.mask_calls[0]!r} ran for a packed batch"
        if spies.backend_calls < attention_layers:
            return (
                f"{implementation}: the packed helper ran {spies.backend_calls} times for {attention_layers} attention "
                "layers"
            )
        start = 0
        for index, (sample, expected) in enumerate(zip(samples, alone)):
            problem = _close(logits[start : start + len(sample)], expected, f"{implementation}: sample {index} logits")
            if problem:
                return problem
            start += len(sample)
        packed_loss, packed_grads = loss_and_grads(model, packed, skip_unused=True, use_cache=False)
        problem = _close(packed_loss, padded_loss, f"{implementation}: loss")
        if problem:
            return problem
        if packed_grads.keys() != padded_grads.keys():
            return f"{implementation}: packed and padded batches give gradients to different parameters"
        return gradient_mismatch(
            model,
            [{"input_ids": sample.unsqueeze(0)} for sample in samples],
            packed_grads,
            padded_grads,
            lambda actual, expected, what: _close(actual, expected, f"{implementation}: {what}"),
            use_cache=False,
        )
    finally:
        unpatch_model(model)


def _supports(config: Any, implementation: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if implementation == "sdpa":
        return supports_sdpa(cls)
    return True


def check_model_type(model_type: str) -> Outcome:
    """Build a tiny ``model_type`` model and decide its :class:`Outcome` (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from unpack_trainer.models.refusals import PatchRefused, RefusalKind, check_model

    started = time.perf_counter()

    def outcome(status: str, reason: str, **extra: Any) -> Outcome:
        return Outcome(model_type, status, reason, seconds=time.perf_counter() - started, **extra)

    if model_type in _SKIP:
        return outcome("skipped", _SKIP[model_type])
    try:
        cls = config_class(model_type)
        with _quiet():
            default = cls()
    except Exception as error:  # noqa: BLE001 - reported in the table
        return outcome("skipped", f"its config cannot be built here: {type(error).__name__}: {error}"[:200])
    reason = _skip_reason(default)
    if reason is not None:
        return outcome("skipped", reason)
    overrides: dict[str, Any] = {}
    note = ""

    def structural_check(config: Any) -> None:
        # On the meta device (no memory), as the trainer's decision sees it; raises PatchRefused.
        try:
            with torch.device("meta"), _quiet():
                check_model(AutoModelForCausalLM.from_config(config))
        except PatchRefused:
            raise
        except Exception:  # noqa: BLE001 - some default configs are incomplete: the tiny model below decides
            return

    try:
        # The structure at full size first: a tiny config could drop the layers that refuse (e.g. the convolution
        # layers of a hybrid pattern).
        structural_check(default)
    except PatchRefused as refused:
        if refused.kind is not RefusalKind.BIDIRECTIONAL:
            return outcome("refused", refused.reason, kind=refused.kind, source="default")
        try:  # an encoder: the causal LM it makes as a decoder, if its config can say so
            with _quiet():
                structural_check(cls(**AS_DECODER))
        except Exception:  # noqa: BLE001 - PatchRefused, or a config that does not take is_decoder
            return outcome("refused", refused.reason, kind=refused.kind, source="default")
        overrides = AS_DECODER
        note = (
            "built with is_decoder=True (loaded as an encoder, is_decoder=False, it is refused for its bidirectional "
            "self-attention and trained padded)"
        )
    try:
        config = tiny_config(model_type, **overrides)
        model = tiny_model(model_type, config=config)
    except Exception as error:  # noqa: BLE001
        return outcome("skipped", f"a tiny model cannot be built: {type(error).__name__}: {error}"[:200])
    try:
        decoders = check_model(model).decoders
    except PatchRefused as refused:
        return outcome("refused", refused.reason, kind=refused.kind)
    attention_layers = sum(len(decoder.attention) for decoder in decoders)
    del model
    verified = []
    for implementation in IMPLEMENTATIONS:
        if not _supports(config, implementation):
            continue
        try:
            problem = _verify(model_type, config, implementation, attention_layers)
        except Exception as error:  # noqa: BLE001
            problem = f"{implementation}: {type(error).__name__}: {error}"[:300]
        if problem is not None:
            return outcome("failed", problem)
        verified.append(implementation)
    checked = "packed logits == each sample alone, loss and gradients == padded, no (T, T) mask"
    return outcome("fast", checked, implementations=tuple(verified), note=note)


def model_types() -> list[str]:
    """Every model type of transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_coverage(types: list[str] | None = None) -> list[Outcome]:
    """:func:`check_model_type` for ``types`` (default: every causal-LM model type), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [check_model_type(model_type) for model_type in (types or model_types())]
    finally:
        torch.set_num_threads(threads)


def _trainer_action(outcome: Outcome) -> str:
    if outcome.status == "fast":
        return "packed, patched"
    if outcome.status == "refused" and outcome.kind in ("unreachable", "unsupported"):
        return "self-check decides (transformers' dense mask)"
    if outcome.status == "refused":
        return "padded (refused before any forward)"
    return "—"


def not_fast_here(outcomes: list[Outcome]) -> dict[str, str]:
    """Of :data:`VERIFIED_MODEL_TYPES`, the types not fast in ``outcomes`` (this release), and what they were: the
    entry of :data:`NOT_VERIFIED_ON` for this release."""
    found = {o.model_type: o for o in outcomes}
    not_fast = {}
    for model_type in sorted(VERIFIED_MODEL_TYPES):
        outcome = found.get(model_type)
        if outcome is None:
            not_fast[model_type] = "absent"
        elif outcome.status != "fast":
            not_fast[model_type] = f"{outcome.status} ({outcome.kind})" if outcome.kind else outcome.status
    return not_fast


def coverage_table(outcomes: list[Outcome]) -> str:
    """A markdown table of ``outcomes`` with a count line, the release it ran on and what differed on the other
    releases of :data:`VERIFIED_WITH`."""
    import transformers

    counts = {status: sum(o.status == status for o in outcomes) for status in ("fast", "refused", "skipped", "failed")}
    lines = [
        f"transformers {transformers.__version__}: {len(outcomes)} model types of the causal-LM auto mapping: "
        + ", ".join(f"{count} {status}" for status, count in counts.items() if count),
        "",
        f"Measured with transformers {' and '.join(VERIFIED_WITH)} (the same command on each; this table is "
        f"{transformers.__version__}'s run).",
    ]
    for version, differences in NOT_VERIFIED_ON.items():
        if version != transformers.__version__ and differences:
            named = ", ".join(f"`{model_type}` ({what})" for model_type, what in differences.items())
            lines.append(f"On {version}, of the fast types here: {named}; the others the same.")
    lines += [
        "",
        "| `model_type` | outcome | implementations | trainer | reason |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        reason = (o.note if o.status == "fast" else o.reason).replace("|", "\\|")
        lines.append(
            f"| `{o.model_type}` | {o.status} | {', '.join(o.implementations)} | {_trainer_action(o)} | {reason} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Vision-language models
# --------------------------------------------------------------------------------------------------------------------

VISION_SEGMENTS = ([3, "image", 4], [5], [2, "image", 6, "image", 2])  # text around images, text only, two images


def _verify_vision(model_type: str, implementation: str) -> str | None:
    """The fast-path checks of a tiny vision-language model on one implementation (image+text samples, see
    :func:`check_vision_type`); the first failure, or ``None``."""
    from unpack_trainer.data.vision import pack_processed
    from unpack_trainer.models import patch_model, unpatch_model
    from unpack_trainer.models.tiny_vision import (
        gradient_mismatch,
        image_size,
        processed_batch,
        tiny_vision_model,
        vision_sample,
    )
    from unpack_trainer.models.vision import find_vision_language

    model = tiny_vision_model(model_type, attn_implementation=implementation).eval()
    height, width = image_size(model_type, model.config)
    sizes = iter([(height, width), (height, 2 * width), (2 * height, width)])  # sizes a family with fixed ones ignores
    samples = [
        vision_sample(model_type, model.config, [next(sizes) if s == "image" else s for s in segments], seed=index)
        for index, segments in enumerate(VISION_SEGMENTS)
    ]
    with torch.no_grad():
        alone = [model(**sample).logits[0] for sample in samples]
    padded = processed_batch(samples)
    padded_loss, padded_grads = loss_and_grads(model, padded, skip_unused=True)
    patch_model(model)
    text_config = find_vision_language(model).decoder.config
    try:
        packed = pack_processed(padded, [s["input_ids"].shape[1] for s in samples])
        spies = _Spies(config=text_config)
        with spies.active(), torch.no_grad():
            logits = model(**{k: v for k, v in packed.items() if k != "labels"}).logits[0]
        if spies.mask_calls:
            return f"{implementation}: transformers' mask function {spies.mask_calls[0]!r} ran for a packed batch"
        start = 0
        for index, expected in enumerate(alone):
            problem = _close(
                logits[start : start + len(expected)], expected, f"{implementation}: sample {index} logits"
            )
            if problem:
                return problem
            start += len(expected)
        packed_loss, packed_grads = loss_and_grads(model, packed, skip_unused=True)
        problem = _close(packed_loss, padded_loss, f"{implementation}: loss")
        if problem:
            return problem
        if packed_grads.keys() != padded_grads.keys():
            return f"{implementation}: packed and padded batches give gradients to different parameters"
        problem = gradient_mismatch(
            model, samples, packed_grads, padded_grads, lambda a, e, what: _close(a, e, f"{implementation}: {what}")
        )
        if problem:
            return problem
    finally:
        unpatch_model(model)
    return None


def check_vision_type(model_type: str) -> Outcome:
    """The :class:`Outcome` of the vision-language family ``model_type`` (a key of
    :data:`unpack_trainer.models.tiny_vision.VISION_FAMILIES`): its tiny model (:func:`tiny_vision_model`) patched,
    on SDPA and eager, three samples (text around an image, text only, two images of different sizes where the
    family takes them) packed in one row: logits == each sample alone, loss and every gradient (the vision tower's
    included) == the padded batch of the same samples (within 1e-5 of each tensor's largest entry, or, for a gradient
    that cancels to a small value, within :data:`~unpack_trainer.models.tiny_vision.STOCK_SPREAD` times the stock
    path's own spread of it: each sample alone, the padded rows reversed), and no mask function of the text model
    called for the packed batch. ``"skipped"`` where this transformers lacks the family."""
    from unpack_trainer.models.tiny_vision import family_unavailable_reason

    started = time.perf_counter()
    reason = family_unavailable_reason(model_type)
    if reason is not None:
        return Outcome(model_type, "skipped", reason, seconds=time.perf_counter() - started)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _quiet():
            for implementation in IMPLEMENTATIONS:
                problem = _verify_vision(model_type, implementation)
                if problem is not None:
                    return Outcome(model_type, "failed", problem, seconds=time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return Outcome(
        model_type,
        "fast",
        "packed image rows == each sample alone; loss and gradients == padded",
        implementations=IMPLEMENTATIONS,
        seconds=time.perf_counter() - started,
    )


# How the image tokens of a family attend, where not causally (the table's last column).
_IMAGE_TOKENS = {
    "gemma3": "bidirectional per image",
    "gemma4": 'bidirectional per image on sliding-window layers (use_bidirectional_attention="vision")',
}


def vision_coverage_table(outcomes: list[Outcome]) -> str:
    """A markdown table of the vision-language families' ``outcomes`` (:func:`check_vision_type`)."""
    import transformers

    from unpack_trainer.models.tiny_vision import VISION_FAMILIES

    fast = sum(o.status == "fast" for o in outcomes)
    lines = [
        f"transformers {transformers.__version__}: {fast} of {len(outcomes)} vision-language families verified on "
        "packed image rows (tiny models, fp32, SDPA and eager).",
        "",
        "| `model_type` | text model | outcome | implementations | positions | image tokens |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        positions = "multimodal RoPE per sample (get_rope_index)" if o.model_type.startswith("qwen") else "1-D"
        blocks = _IMAGE_TOKENS.get(o.model_type, "causal")
        text = VISION_FAMILIES.get(o.model_type, "")
        detail = o.reason if o.status != "fast" else ", ".join(o.implementations)
        lines.append(f"| `{o.model_type}` | `{text}` | {o.status} | {detail} | {positions} | {blocks} |")
    return "\n".join(lines)
