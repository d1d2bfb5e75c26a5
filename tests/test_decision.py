"""Every branch of the packing decision, as a table. No trainer, no model: configs and stand-ins only."""

from types import SimpleNamespace

import pytest
import trl
from transformers import LlamaConfig, ProcessorMixin, T5Config

from unpack_trainer import SFTConfig
from unpack_trainer.decision import decide, env_flag

BLOCKLIST = {"gemma2": "attention logit softcapping", "gpt_oss": "attention sinks"}
SUPPORTED = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def _config(cls=SFTConfig, **kwargs):
    return cls(output_dir="/tmp/unpack-decision", report_to="none", bf16=False, use_cpu=True, **kwargs)


def _model(model_type="llama", **kwargs):
    return SimpleNamespace(model_type=model_type, is_encoder_decoder=False, **kwargs)


class _Processor(ProcessorMixin):
    attributes = []

    def __init__(self):
        pass


def _collator(examples):
    return examples


TEXT = {"text": "hello"}

CASES = [
    # id, config kwargs, config class, decide kwargs, env, expected (mode, patch, probe, automatic, overridden, reason fragment)
    (
        "disabled",
        {"packing": True},
        SFTConfig,
        {},
        {"UNPACK_DISABLE": "1"},
        ("stock", False, False, False, False, "UNPACK_DISABLE"),
    ),
    ("pack", {"packing": True}, SFTConfig, {}, {}, ("pack", True, True, False, False, "global best-fit")),
    (
        "pack unregistered",
        {"packing": True},
        SFTConfig,
        {"model_config": _model("phi3")},
        {},
        ("pack", False, True, False, False, "self-check decides"),
    ),
    (
        "pack wrapped",
        {"packing": True, "packing_strategy": "wrapped"},
        SFTConfig,
        {},
        {},
        ("stock", False, False, False, False, "wrapped"),
    ),
    (
        "pack custom collator",
        {"packing": True},
        SFTConfig,
        {"data_collator": _collator},
        {},
        ("padded", False, False, True, True, "packing=True ignored (a custom data_collator"),
    ),
    (
        "pack processor",
        {"packing": True},
        SFTConfig,
        {"processing_class": _Processor()},
        {},
        ("padded", False, False, True, True, "processor"),
    ),
    (
        "pack vision data",
        {"packing": True},
        SFTConfig,
        {"dataset_sample": {"images": [], "messages": []}},
        {},
        ("padded", False, False, True, True, "images"),
    ),
    (
        "pack vlm",
        {"packing": True},
        SFTConfig,
        {"model_config": _model("llava", vision_config={})},
        {},
        ("padded", False, False, True, True, "vision-language"),
    ),
    (
        "pack enc-dec",
        {"packing": True},
        SFTConfig,
        {"model_config": T5Config()},
        {},
        ("padded", False, False, True, True, "encoder-decoder"),
    ),
    (
        "pack gemma2",
        {"packing": True},
        SFTConfig,
        {"model_config": _model("gemma2")},
        {},
        ("padded", False, False, True, True, "softcapping"),
    ),
    (
        "pack gpt_oss",
        {"packing": True},
        SFTConfig,
        {"model_config": _model("gpt_oss")},
        {},
        ("padded", False, False, True, True, "sinks"),
    ),
    (
        "pack ignores auto env",
        {"packing": True},
        SFTConfig,
        {},
        {"UNPACK_DISABLE_AUTO_PADDING_FREE": "1"},
        ("pack", True, True, False, False, "packing=True"),
    ),
    (
        "explicit padding-free",
        {"padding_free": True},
        SFTConfig,
        {},
        {},
        ("padding_free", True, True, False, False, "padding_free=True"),
    ),
    (
        "explicit padding-free trl config",
        {"padding_free": True},
        trl.SFTConfig,
        {},
        {},
        ("padding_free", True, True, False, False, "padding_free=True"),
    ),
    (
        "explicit padding-free blocked",
        {"padding_free": True},
        SFTConfig,
        {"data_collator": _collator},
        {},
        ("padded", False, False, True, True, "padding_free=True ignored"),
    ),
    ("auto", {}, SFTConfig, {}, {}, ("padding_free", True, True, True, False, "automatic padding-free")),
    (
        "auto trl config",
        {},
        trl.SFTConfig,
        {},
        {},
        ("padding_free", True, True, True, False, "automatic padding-free"),
    ),
    (
        "auto unregistered",
        {},
        SFTConfig,
        {"model_config": _model("phi3")},
        {},
        ("padding_free", False, True, True, False, "self-check decides"),
    ),
    (
        "auto env off",
        {},
        SFTConfig,
        {},
        {"UNPACK_DISABLE_AUTO_PADDING_FREE": "true"},
        ("padded", False, False, False, False, "UNPACK_DISABLE_AUTO_PADDING_FREE"),
    ),
    (
        "auto blocked",
        {},
        SFTConfig,
        {"data_collator": _collator},
        {},
        ("padded", False, False, True, False, "automatic padding-free off (a custom data_collator"),
    ),
    (
        "auto blocked gemma2",
        {},
        SFTConfig,
        {"model_config": _model("gemma2")},
        {},
        ("padded", False, False, True, False, "gemma2"),
    ),
    (
        "explicit off",
        {"padding_free": False},
        SFTConfig,
        {},
        {},
        ("padded", False, False, False, False, "padding_free=False was set"),
    ),
    (
        "explicit packing off",
        {"packing": False, "padding_free": False},
        SFTConfig,
        {},
        {},
        ("padded", False, False, False, False, "padding_free=False"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_decision_table(case):
    _, config_kwargs, config_cls, decide_kwargs, env, expected = case
    kwargs = {
        "model_config": LlamaConfig(),
        "processing_class": None,
        "dataset_sample": TEXT,
        "supported_model_types": SUPPORTED,
        "blocklist": BLOCKLIST,
        "env": env,
    } | decide_kwargs
    decision = decide(_config(config_cls, **config_kwargs), **kwargs)
    mode, patch, probe, automatic, overridden, fragment = expected
    assert (decision.mode, decision.patch, decision.probe, decision.automatic, decision.overridden_request) == (
        mode,
        patch,
        probe,
        automatic,
        overridden,
    ), decision
    assert fragment in decision.reason
    assert decision.packed == (mode in ("pack", "padding_free"))


def test_decision_is_pure():
    config = _config(packing=True)
    before = (config.packing, config.padding_free, config.max_length)
    first = decide(config, model_config=LlamaConfig(), supported_model_types=SUPPORTED, env={})
    assert decide(config, model_config=LlamaConfig(), supported_model_types=SUPPORTED, env={}) == first
    assert (config.packing, config.padding_free, config.max_length) == before


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("on", True), ("0", False), ("", False)])
def test_env_flag(value, expected):
    assert env_flag({"X": value}, "X") is expected
    assert env_flag({}, "X") is False
