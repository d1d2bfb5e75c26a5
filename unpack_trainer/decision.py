"""The trainer's decision: pack, padding-free, or padded, with the real reason. A pure function, tested branch by branch.

| request                                  | not blocked                     | blocked (reason)                         |
|------------------------------------------|---------------------------------|------------------------------------------|
| ``UNPACK_DISABLE=1``                     | stock TRL trainer               | stock TRL trainer                        |
| ``packing=True``                         | pack (windowed*, padding-free)  | padded, warning "packing=True ignored"   |
| ``packing=True, packing_strategy="wrapped"`` | stock TRL (user's choice)   | stock TRL                                |
| ``padding_free=True``                    | padding-free                    | padded, warning "padding_free=True ignored" |
| ``padding_free=None`` (not set)          | padding-free (auto, logged)     | padded (info, logged)                    |
| ``padding_free=None`` + ``UNPACK_DISABLE_AUTO_PADDING_FREE=1`` | padded    | padded                                   |
| ``padding_free=False``                   | padded (never overridden)       | padded                                   |
| ``packing=True`` / ``padding_free=True`` with ``cp_size > 1`` (or ``sp_size > 1`` but in SFT / DPO) | ``ValueError`` at start (the reason) | |
| ``padding_free=None`` with ``cp_size > 1`` (or ``sp_size > 1`` but in SFT / DPO) | padded (info, the reason) |                       |

(*) The packer is ``packing_order``'s ([`PACKERS`]): windowed best fit by default, global best fit with
``"shuffled"`` or ``"decreasing"``.

Blocked means: a custom ``data_collator``; a ``ProcessorMixin`` processing class or a vision dataset with a text-only
model; a vision-language model whose type is not verified for packed image rows (verified ones pack: their images,
positions and image blocks per sample, :mod:`unpack_trainer.anatomy.vision`); an encoder-decoder model; a model whose structure cannot be packed exactly
(:func:`unpack_trainer.models.refusal_reason`: token mixers the per-sample path cannot take, an encoder's
bidirectional self-attention, row-wide position biases); PEFT prompt learning (prompt tuning, p-tuning, prefix
tuning: virtual tokens or prefix keys are prepended to every row). A model type that is not verified is not blocked
here: it runs without our patch if the contamination self-check passes on the user's model.

Refused: context parallelism (accelerate's ``ParallelismConfig`` with ``cp_size > 1``, [`parallelism_reason`]): torch's
context parallel drops the mask and runs SDPA with ``is_causal=True``, one causal document across the row, so a request
for packed or padding-free rows is an error at start. Sequence parallelism (``sp_size > 1``, DeepSpeed Ulysses) packs
in SFT, DPO, reward, GRPO and RLOO: the whole row's boundaries are built before the row is cut (by the collator,
or by GRPO's and RLOO's step), and every shard's attention reads them (``unpack_trainer/models/sequence_parallel.py``
says which models are exact there); the other trainers refuse it like context parallelism.

Also decided here, without overriding an explicit request:

- ``neftune_noise_alpha`` set: automatic padding-free stays off (NEFTune scales its noise by 1/sqrt(tokens per row),
  so flattening a batch would change the noise); with explicit packing the trainer logs what the scale means.
- ``dataset_kwargs={"skip_prepare_dataset": True}`` with ``packing=True``: the data is used as prepared (nothing to
  pack, no truncation), so packing is declined with that reason and batches are flattened as TRL does.
- evaluation with ``compute_metrics`` / ``preprocess_logits_for_metrics`` stays padded (one row per example, as stock)
  unless ``eval_packing=True`` or ``padding_free=True`` asked for flattened evaluation ([`eval_batches`]).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Mode = Literal["stock", "pack", "padding_free", "padded"]

_TRUE = {"1", "true", "yes", "on"}

PACKERS = {
    "windowed": "windowed best fit (a seeded random order, each sample into the best-fitting of the last open rows)",
    "shuffled": "shuffled best fit (global, a seeded random order)",
    "decreasing": "global best-fit decreasing",
}
"""``SFTConfig.packing_order`` -> the packer it chooses (``unpack_trainer.data.packing``), as the start line names it."""


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value (1/true/yes/on, any case)."""
    return env.get(name, "").strip().lower() in _TRUE


def _prompt_learning(peft_config: Any) -> str | None:
    """The PEFT type when ``peft_config`` (a ``PeftConfig``, or a ``PeftModel``'s ``{name: PeftConfig}``) is prompt
    learning (prompt tuning, p-tuning, prefix tuning), else ``None``."""
    configs = peft_config.values() if isinstance(peft_config, Mapping) else [peft_config]
    for config in configs:
        if getattr(config, "is_prompt_learning", False):
            peft_type = getattr(config, "peft_type", None)
            return str(getattr(peft_type, "value", peft_type) or type(config).__name__)
    return None


@dataclass(frozen=True)
class PackingDecision:
    """What the trainer does and why.

    Attributes:
        mode: ``"stock"`` (behave exactly like the TRL trainer), ``"pack"``, ``"padding_free"`` or ``"padded"``.
        reason: the real reason, for the log line.
        patch: apply our attention patch (the model type is verified: in
            [`unpack_trainer.models.supported_model_types`]). Whenever rows are packed or flattened (``packed``), the
            contamination self-check runs on the user's model before training, patched or not.
        automatic: the mode was chosen by us, not requested (auto padding-free, or an automatic disable).
        overridden_request: the user asked for packing / padding-free and it was ignored (logged as a warning).
    """

    mode: Mode
    reason: str
    patch: bool = False
    automatic: bool = False
    overridden_request: bool = False

    @property
    def packed(self) -> bool:
        return self.mode in ("pack", "padding_free")


# Columns that hold images or what an image processor made of them (TRL's own check knows only the first two).
IMAGE_COLUMNS = (
    "image",
    "images",
    "pixel_values",
    "pixel_attention_mask",
    "image_grid_thw",
    "image_sizes",
    "image_flags",
    "video",
    "videos",
    "pixel_values_videos",
    "video_grid_thw",
)


def _is_vision_model(model_config: Any) -> bool:
    if model_config is None:
        return False
    return any(getattr(model_config, name, None) is not None for name in ("vision_config", "visual", "vision_tower"))


def _size(config: Any, name: str, env: Mapping[str, str]) -> int:
    """``config.<name>`` (accelerate's ``ParallelismConfig``), or without a config the ``PARALLELISM_CONFIG_<NAME>``
    environment variable accelerate's launcher writes (``ACCELERATE_USE_PARALLELISM_CONFIG=true``); 1 when unset."""
    if config is not None:
        value = getattr(config, name, None)
    elif env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").strip().lower() == "true":
        value = env.get(f"PARALLELISM_CONFIG_{name.upper()}")
    else:
        value = None
    try:
        return int(value) if value not in (None, "") else 1
    except (TypeError, ValueError):
        return 1


def sequence_parallel_size(parallelism_config: Any, env: Mapping[str, str] | None = None) -> int:
    """``sp_size`` of a run under DeepSpeed Ulysses (accelerate's ``ParallelismConfig(sp_size=N,
    sp_backend="deepspeed")``, or the environment an accelerate launch with one writes; see [`parallelism_reason`]), or
    1 without sequence parallelism."""
    env = os.environ if env is None else env
    return _size(parallelism_config, "sp_size", env)


def parallelism_reason(
    parallelism_config: Any, env: Mapping[str, str] | None = None, *, sequence_parallel: bool = False
) -> str | None:
    """Why packed or padding-free rows cannot run under this parallelism, or ``None``.

    Args:
        parallelism_config: accelerate's ``ParallelismConfig`` (``TrainingArguments.parallelism_config``, or the
            accelerator's), or ``None``; then the environment an accelerate launch with a parallelism config writes is
            read (``ACCELERATE_USE_PARALLELISM_CONFIG=true``, ``PARALLELISM_CONFIG_CP_SIZE`` / ``_SP_SIZE``).
        env: environment variables (defaults to ``os.environ``).
        sequence_parallel: the trainer packs under sequence parallelism (SFT, DPO, reward, GRPO, RLOO: each row cut into ``sp_size``
            shards with the whole row's boundaries carried to every shard's attention); then ``sp_size > 1`` is no
            reason.

    ``cp_size > 1`` (torch context parallel) splits every row along the sequence and runs SDPA with no mask: refused
    always. ``sp_size > 1`` (DeepSpeed Ulysses) splits every row too; it is refused for a trainer that does not carry
    the row's boundaries past the cut.

    Example:
        ``ParallelismConfig(cp_size=2)`` -> ``"context parallelism (cp_size=2): it splits every row ..."``; ``ParallelismConfig()`` or
        ``None`` (no environment) -> ``None``.
    """
    env = os.environ if env is None else env
    cp_size, sp_size = _size(parallelism_config, "cp_size", env), _size(parallelism_config, "sp_size", env)
    if cp_size > 1:
        return (
            f"context parallelism (cp_size={cp_size}): it splits every row across processes and runs SDPA with "
            "is_causal=True and no mask (accelerate's hooks drop it), so the samples of a packed row would attend to "
            "each other as one causal document; sequence parallelism (sp_size, DeepSpeed Ulysses) packs with SFT"
        )
    if sp_size > 1 and not sequence_parallel:
        return (
            f"sequence parallelism (sp_size={sp_size}, DeepSpeed Ulysses) in this trainer: its packed rows (built "
            "inside the training step, or scored per sample) are not cut into shards with their boundaries carried "
            "to every shard's attention (those of every trainer this package ships are)"
        )
    return None


def parallelism_refusal(asked: str, reason: str) -> ValueError:
    """The error for a request for packed rows (``asked``: ``"packing=True"`` / ``"padding_free=True"``) that a
    [`parallelism_reason`] rules out."""
    return ValueError(
        f"`{asked}` is not supported with {reason}. Set `packing=False` and `padding_free=False` to train on padded "
        "batches, or turn off context / sequence parallelism (`cp_size=1`, `sp_size=1`) to pack."
    )


def blocked_reason(
    *,
    model_config: Any,
    data_collator: Any,
    processing_class: Any,
    dataset_sample: Mapping[str, Any] | None,
    blocklist: Mapping[str, str],
    peft_config: Any = None,
    supported_model_types: frozenset[str] | set[str] = frozenset(),
    vision: str | None = None,
) -> str | None:
    """Why packed rows cannot be used with this set-up, or ``None``.

    A vision-language model (a ``vision_config``) with its processor and an image dataset packs when the trainer packs
    vision-language data (``vision``: ``None``, or why it does not) and its model type is verified
    (``supported_model_types``: its packed image rows equal each sample alone, see
    :mod:`unpack_trainer.anatomy.vision`); a processor or images with a text-only model, and an unverified
    vision-language model, are blocked with the reason.
    """
    from transformers import ProcessorMixin

    prompt_learning = _prompt_learning(peft_config)
    if prompt_learning is not None:
        return (
            f"PEFT prompt learning ({prompt_learning}) prepends virtual tokens or prefix keys/values to every row, "
            "which cannot be split between packed samples"
        )
    if data_collator is not None:
        return f"a custom data_collator ({type(data_collator).__name__}) was passed; remove it to pack"
    vision_model = _is_vision_model(model_config)
    model_type = getattr(model_config, "model_type", None)
    if isinstance(processing_class, ProcessorMixin) and not vision_model:
        return (
            f"processing_class is a processor ({type(processing_class).__name__}) but model type {model_type!r} is "
            "not a vision-language model; only text tokenizers are supported for it"
        )
    image_columns = [name for name in IMAGE_COLUMNS if dataset_sample is not None and name in dataset_sample]
    if image_columns and not vision_model:
        return (
            f"the dataset has images ({', '.join(image_columns)}) but model type {model_type!r} is not a "
            "vision-language model"
        )
    if (vision_model or image_columns or isinstance(processing_class, ProcessorMixin)) and vision is not None:
        return vision
    if vision_model and model_type not in supported_model_types:
        from unpack_trainer.models.verified import VERIFIED_VISION_MODEL_TYPES

        verified = sorted(VERIFIED_VISION_MODEL_TYPES)
        return (
            f"vision-language model type {model_type!r} is not verified for packed image rows (verified: "
            f"{', '.join(verified) or 'none'})"
        )
    if getattr(model_config, "is_encoder_decoder", False):
        return f"model type {getattr(model_config, 'model_type', '?')!r} is an encoder-decoder model"
    if model_type in blocklist:
        return f"model type {model_type!r} is not supported: {blocklist[model_type]}"
    from unpack_trainer.models import refusal_reason  # found from the model's structure (meta device), no forward

    refusal = refusal_reason(model_config)
    if refusal is not None:
        return f"model type {model_type!r} cannot be packed: {refusal}"
    return None


def decide(
    config: Any,
    *,
    model_config: Any,
    data_collator: Any = None,
    processing_class: Any = None,
    dataset_sample: Mapping[str, Any] | None = None,
    supported_model_types: frozenset[str] | set[str] = frozenset(),
    blocklist: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    peft_config: Any = None,
    vision: str | None = None,
    parallelism: str | None = None,
) -> PackingDecision:
    """Decide how to batch, from the config, the model's config, the collator, the tokenizer, one dataset example and
    the environment. Pure: no logging, no model calls.

    Args:
        config: any trainer config (``TrainingArguments``); what it says is read from its fields, those it lacks
            count as not set ([`explicit_padding_free`]): ``packing``, ``packing_strategy``, ``packing_order``,
            ``padding_free``, ``dataset_kwargs``, ``neftune_noise_alpha``.
        model_config: the model's ``PretrainedConfig`` (``model_type``, ``is_encoder_decoder``, vision sub-configs).
        data_collator: the collator the user passed, or ``None``.
        processing_class: the tokenizer or processor.
        dataset_sample: the first training example, or ``None``.
        supported_model_types: the verified model types (``unpack_trainer.models.supported_model_types()``).
        blocklist: ``model_type -> reason`` for types that must never be packed.
        env: environment variables (defaults to ``os.environ``).
        peft_config: the ``peft_config`` passed to the trainer, or the model's (``PeftModel.peft_config``), or
            ``None``; prompt learning blocks packing.
        vision: ``None`` when the trainer packs vision-language data (SFT, DPO), else why it does not: a vision-language
            model, a processor or image data then block packing with it.
        parallelism: [`parallelism_reason`] of the run's parallelism config, or ``None``.

    Raises:
        ValueError: ``packing=True`` or ``padding_free=True`` (not otherwise blocked) with a ``parallelism`` reason
            (the rows cannot be kept apart: refused at start, never trained as one causal document).
    """
    env = os.environ if env is None else env
    blocklist = {} if blocklist is None else blocklist
    if env_flag(env, "UNPACK_DISABLE"):
        return PackingDecision("stock", "UNPACK_DISABLE is set: behaving exactly like the stock TRL trainer")

    packing = bool(getattr(config, "packing", False))
    if packing and getattr(config, "packing_strategy", "bfd") == "wrapped":
        return PackingDecision(
            "stock",
            "packing_strategy='wrapped' was chosen: rows are cut mid-sample by design, so TRL's own path is used",
        )

    padding_free = explicit_padding_free(config)
    explicit_on = padding_free is True
    explicit_off = padding_free is False

    reason = blocked_reason(
        model_config=model_config,
        data_collator=data_collator,
        processing_class=processing_class,
        dataset_sample=dataset_sample,
        blocklist=blocklist,
        peft_config=peft_config,
        supported_model_types=supported_model_types,
        vision=vision,
    )
    if parallelism is not None and (packing or explicit_on) and reason is None:
        raise parallelism_refusal("packing=True" if packing else "padding_free=True", parallelism)
    model_type = getattr(model_config, "model_type", None)
    verified = model_type in supported_model_types
    probe_note = "" if verified else f" (model type {model_type!r} is not verified: the self-check decides)"

    dataset_kwargs = getattr(config, "dataset_kwargs", None) or {}
    skip_prepare = bool(dataset_kwargs.get("skip_prepare_dataset", False))
    if packing:
        if reason is not None:
            return PackingDecision(
                "padded", f"packing=True ignored ({reason})", automatic=True, overridden_request=True
            )
        if skip_prepare:
            return PackingDecision(
                "padding_free",
                "packing=True ignored (dataset_kwargs={'skip_prepare_dataset': True}: the dataset is used as "
                "prepared, so it is neither packed nor truncated to max_length); each batch is flattened into one "
                "row, as TRL does" + probe_note,
                patch=verified,
                automatic=True,
                overridden_request=True,
            )
        packing_order = getattr(config, "packing_order", "decreasing")
        return PackingDecision(
            "pack",
            f"packing=True, packing_order={packing_order!r}: {PACKERS.get(packing_order, 'best fit')}" + probe_note,
            patch=verified,
        )
    if explicit_on:
        if reason is not None:
            return PackingDecision(
                "padded", f"padding_free=True ignored ({reason})", automatic=True, overridden_request=True
            )
        return PackingDecision("padding_free", "padding_free=True" + probe_note, patch=verified)
    if explicit_off:
        return PackingDecision("padded", "padding_free=False was set")
    if env_flag(env, "UNPACK_DISABLE_AUTO_PADDING_FREE"):
        return PackingDecision("padded", "UNPACK_DISABLE_AUTO_PADDING_FREE is set")
    if parallelism is not None:
        return PackingDecision("padded", f"automatic padding-free off ({parallelism})", automatic=True)
    if reason is not None:
        return PackingDecision("padded", f"automatic padding-free off ({reason})", automatic=True)
    if getattr(config, "neftune_noise_alpha", None) is not None:
        return PackingDecision(
            "padded",
            "automatic padding-free off (neftune_noise_alpha is set: NEFTune scales its noise by 1/sqrt(tokens per "
            "row), so flattening a batch into one row would change the noise; set padding_free=True to flatten anyway)",
            automatic=True,
        )
    return PackingDecision(
        "padding_free",
        "automatic padding-free: each batch is flattened into one row, no cross-example packing" + probe_note,
        patch=verified,
        automatic=True,
    )


def explicit_padding_free(config: Any) -> bool | None:
    """What ``config`` says about ``padding_free``: ``True`` / ``False`` when set, ``None`` when not set.

    Read from the config alone, whatever its class: a config without the field says nothing (``None``); a field whose
    default is ``None`` (our configs: the trainer decides) holds the user's choice as is; a field whose default is
    ``False`` (TRL's own configs) cannot tell an explicit ``False`` from its default, so ``False`` there counts as not
    set (``None``) and only ``True`` is a request.

    Example:
        ``SFTConfig(padding_free=False)`` -> ``False``; ``trl.SFTConfig(padding_free=False)`` -> ``None``;
        ``trl.GRPOConfig()`` (no such field) -> ``None``.
    """
    value = getattr(config, "padding_free", None)
    if value is None or value is True:
        return value
    fields = getattr(type(config), "__dataclass_fields__", {})
    declared = fields.get("padding_free")
    default = getattr(declared, "default", None) if declared is not None else None
    return None if default is False else bool(value)


def neftune_note(config: Any, decision: PackingDecision) -> str | None:
    """What NEFTune's noise scale means for packed rows, when NEFTune is on and rows are packed or flattened."""
    alpha = getattr(config, "neftune_noise_alpha", None)
    if alpha is None or not decision.packed:
        return None
    return (
        f"NEFTune (neftune_noise_alpha={alpha}) scales its noise by alpha/sqrt(tokens per row x hidden size); a "
        f"{'packed' if decision.mode == 'pack' else 'flattened'} row holds several samples, so each token gets less "
        "noise than in a padded batch (by sqrt(row tokens / padded batch length)). Raise neftune_noise_alpha to match."
    )


def eval_batches(config: Any, decision: PackingDecision, *, has_metrics: bool) -> tuple[bool, str | None]:
    """Whether evaluation batches are flattened / packed like training's, and a note to log (or ``None``).

    With ``compute_metrics`` or ``preprocess_logits_for_metrics`` set (``has_metrics``), flattened rows would hand
    the metric ``(1, tokens)`` arrays instead of one row per example, so evaluation stays padded, unless the user
    asked for flattened evaluation (``eval_packing=True`` or ``padding_free=True``): then the metric sees the rows.
    """
    if not decision.packed:
        return False, None
    if not has_metrics:
        return True, None
    if getattr(config, "eval_packing", None) is True or getattr(config, "padding_free", None) is True:
        asked = "eval_packing=True" if getattr(config, "eval_packing", None) is True else "padding_free=True"
        return True, (
            f"{asked}: evaluation batches are flattened, so compute_metrics / preprocess_logits_for_metrics receive "
            "rows holding several examples, not one row per example"
        )
    return False, (
        "evaluation stays padded because compute_metrics / preprocess_logits_for_metrics is set: metrics get one row "
        "per example, as with stock TRL (set eval_packing=True to flatten evaluation batches too)"
    )
