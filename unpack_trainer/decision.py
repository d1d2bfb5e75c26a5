"""The trainer's decision: pack, padding-free, or padded, with the real reason. A pure function, tested branch by branch.

| request                                  | not blocked                     | blocked (reason)                         |
|------------------------------------------|---------------------------------|------------------------------------------|
| ``UNPACK_DISABLE=1``                     | stock ``trl.SFTTrainer``        | stock ``trl.SFTTrainer``                 |
| ``packing=True``                         | pack (global BFD, padding-free) | padded, warning "packing=True ignored"   |
| ``packing=True, packing_strategy="wrapped"`` | stock TRL (user's choice)   | stock TRL                                |
| ``padding_free=True``                    | padding-free                    | padded, warning "padding_free=True ignored" |
| ``padding_free=None`` (not set)          | padding-free (auto, logged)     | padded (info, logged)                    |
| ``padding_free=None`` + ``UNPACK_DISABLE_AUTO_PADDING_FREE=1`` | padded    | padded                                   |
| ``padding_free=False``                   | padded (never overridden)       | padded                                   |

Blocked means: a custom ``data_collator``; a ``ProcessorMixin`` processing class; a vision-language model or a vision
dataset; an encoder-decoder model; a blocklisted model type; a model whose structure cannot be packed exactly
(:func:`unpack_trainer.models.refusal_reason`: recurrent / state-space / convolution token mixers, ALiBi). A model type that is neither registered nor blocklisted
is not blocked here: it runs without our patch if the contamination self-check passes on the user's model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from unpack_trainer.config import SFTConfig

Mode = Literal["stock", "pack", "padding_free", "padded"]

_TRUE = {"1", "true", "yes", "on"}
_logged: set[tuple[int, str]] = set()


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value (1/true/yes/on, any case)."""
    return env.get(name, "").strip().lower() in _TRUE


def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log ``message`` at ``level`` the first time it is seen in this process."""
    if (level, message) not in _logged:
        _logged.add((level, message))
        logger.log(level, message)


@dataclass(frozen=True)
class PackingDecision:
    """What the trainer does and why.

    Attributes:
        mode: ``"stock"`` (behave exactly like ``trl.SFTTrainer``), ``"pack"``, ``"padding_free"`` or ``"padded"``.
        reason: the real reason, for the log line.
        patch: apply our attention patch (the model type is registered).
        probe: run the contamination self-check on the user's model before training.
        automatic: the mode was chosen by us, not requested (auto padding-free, or an automatic disable).
        overridden_request: the user asked for packing / padding-free and it was ignored (logged as a warning).
    """

    mode: Mode
    reason: str
    patch: bool = False
    probe: bool = False
    automatic: bool = False
    overridden_request: bool = False

    @property
    def packed(self) -> bool:
        return self.mode in ("pack", "padding_free")


def _is_vision_model(model_config: Any) -> bool:
    if model_config is None:
        return False
    return any(getattr(model_config, name, None) is not None for name in ("vision_config", "visual", "vision_tower"))


def blocked_reason(
    *,
    model_config: Any,
    data_collator: Any,
    processing_class: Any,
    dataset_sample: Mapping[str, Any] | None,
    blocklist: Mapping[str, str],
) -> str | None:
    """Why packed rows cannot be used with this set-up, or ``None``."""
    from transformers import ProcessorMixin

    if data_collator is not None:
        return f"a custom data_collator ({type(data_collator).__name__}) was passed; remove it to pack"
    if isinstance(processing_class, ProcessorMixin):
        return (
            f"processing_class is a processor ({type(processing_class).__name__}); only text tokenizers are supported"
        )
    if dataset_sample is not None and ("image" in dataset_sample or "images" in dataset_sample):
        return "the dataset has images; vision datasets are not supported"
    if _is_vision_model(model_config):
        return f"model type {getattr(model_config, 'model_type', '?')!r} is a vision-language model"
    if getattr(model_config, "is_encoder_decoder", False):
        return f"model type {getattr(model_config, 'model_type', '?')!r} is an encoder-decoder model"
    model_type = getattr(model_config, "model_type", None)
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
) -> PackingDecision:
    """Decide how to batch, from the config, the model's config, the collator, the tokenizer, one dataset example and
    the environment. Pure: no logging, no model calls.

    Args:
        config: a ``trl.SFTConfig`` (``padding_free`` may be ``None`` = not set; a plain TRL config's ``False`` is its
            default and is treated as not set, since it cannot be told apart from an explicit ``False``. Use our
            ``SFTConfig(padding_free=False)`` or ``UNPACK_DISABLE_AUTO_PADDING_FREE=1`` to opt out with certainty).
        model_config: the model's ``PretrainedConfig`` (``model_type``, ``is_encoder_decoder``, vision sub-configs).
        data_collator: the collator the user passed, or ``None``.
        processing_class: the tokenizer or processor.
        dataset_sample: the first training example, or ``None``.
        supported_model_types: model types with a registered patch.
        blocklist: ``model_type -> reason`` for types that must never be packed.
        env: environment variables (defaults to ``os.environ``).
    """
    env = os.environ if env is None else env
    blocklist = {} if blocklist is None else blocklist
    if env_flag(env, "UNPACK_DISABLE"):
        return PackingDecision("stock", "UNPACK_DISABLE is set: behaving exactly like trl.SFTTrainer")

    packing = bool(getattr(config, "packing", False))
    if packing and getattr(config, "packing_strategy", "bfd") == "wrapped":
        return PackingDecision(
            "stock",
            "packing_strategy='wrapped' was chosen: rows are cut mid-sample by design, so TRL's own path is used",
        )

    padding_free = getattr(config, "padding_free", None)
    explicit_padding_free = padding_free is True
    explicit_off = padding_free is False and isinstance(config, SFTConfig)

    reason = blocked_reason(
        model_config=model_config,
        data_collator=data_collator,
        processing_class=processing_class,
        dataset_sample=dataset_sample,
        blocklist=blocklist,
    )
    model_type = getattr(model_config, "model_type", None)
    registered = model_type in supported_model_types
    probe_note = "" if registered else f" (model type {model_type!r} has no patch: the self-check decides)"

    if packing:
        if reason is not None:
            return PackingDecision(
                "padded", f"packing=True ignored ({reason})", automatic=True, overridden_request=True
            )
        return PackingDecision(
            "pack", "packing=True: global best-fit-decreasing packing" + probe_note, patch=registered, probe=True
        )
    if explicit_padding_free:
        if reason is not None:
            return PackingDecision(
                "padded", f"padding_free=True ignored ({reason})", automatic=True, overridden_request=True
            )
        return PackingDecision("padding_free", "padding_free=True" + probe_note, patch=registered, probe=True)
    if explicit_off:
        return PackingDecision("padded", "padding_free=False was set")
    if env_flag(env, "UNPACK_DISABLE_AUTO_PADDING_FREE"):
        return PackingDecision("padded", "UNPACK_DISABLE_AUTO_PADDING_FREE is set")
    if reason is not None:
        return PackingDecision("padded", f"automatic padding-free off ({reason})", automatic=True)
    return PackingDecision(
        "padding_free",
        "automatic padding-free: each batch is flattened into one row, no cross-example packing" + probe_note,
        patch=registered,
        probe=True,
        automatic=True,
    )
