"""Every branch of the packing decision, as a table. No trainer, no model: configs and stand-ins only."""

from types import SimpleNamespace

import pytest
import trl
from transformers import LlamaConfig, ProcessorMixin, T5Config

from unpack_trainer import SFTConfig
from unpack_trainer._logging import log_once, reset_log_once
from unpack_trainer.decision import decide, env_flag, eval_batches, neftune_note

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


def _prompt_tuning():
    from peft import PromptTuningConfig

    return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


def _prefix_model_configs():
    from peft import LoraConfig, PrefixTuningConfig

    return {"default": LoraConfig(), "prefix": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)}


CASES = [
    # id, config kwargs, config class, decide kwargs, env,
    # expected (mode, patch, self-check runs (decision.packed), automatic, overridden, reason fragment)
    (
        "disabled",
        {"packing": True},
        SFTConfig,
        {},
        {"UNPACK_DISABLE": "1"},
        ("stock", False, False, False, False, "UNPACK_DISABLE"),
    ),
    ("pack", {"packing": True}, SFTConfig, {}, {}, ("pack", True, True, False, False, "windowed best fit")),
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
        "pack prompt tuning",
        {"packing": True},
        SFTConfig,
        {"peft_config": _prompt_tuning()},
        {},
        ("padded", False, False, True, True, "PEFT prompt learning (PROMPT_TUNING)"),
    ),
    (
        "auto prefix tuning model",
        {},
        SFTConfig,
        {"peft_config": _prefix_model_configs()},
        {},
        ("padded", False, False, True, False, "PEFT prompt learning (PREFIX_TUNING)"),
    ),
    (
        "auto lora is fine",
        {},
        SFTConfig,
        {"peft_config": {"default": __import__("peft").LoraConfig()}},
        {},
        ("padding_free", True, True, True, False, "automatic padding-free"),
    ),
    (
        "auto neftune",
        {"neftune_noise_alpha": 5.0},
        SFTConfig,
        {},
        {},
        ("padded", False, False, True, False, "neftune_noise_alpha is set"),
    ),
    (
        "explicit padding-free neftune",
        {"padding_free": True, "neftune_noise_alpha": 5.0},
        SFTConfig,
        {},
        {},
        ("padding_free", True, True, False, False, "padding_free=True"),
    ),
    (
        "pack neftune",
        {"packing": True, "neftune_noise_alpha": 5.0},
        SFTConfig,
        {},
        {},
        ("pack", True, True, False, False, "windowed best fit"),
    ),
    (
        "pack skip prepare",
        {"packing": True, "dataset_kwargs": {"skip_prepare_dataset": True}},
        SFTConfig,
        {},
        {},
        ("padding_free", True, True, True, True, "packing=True ignored (dataset_kwargs={'skip_prepare_dataset'"),
    ),
    (
        "auto skip prepare",
        {"dataset_kwargs": {"skip_prepare_dataset": True}},
        SFTConfig,
        {},
        {},
        ("padding_free", True, True, True, False, "automatic padding-free"),
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
    assert (decision.mode, decision.patch, decision.packed, decision.automatic, decision.overridden_request) == (
        mode,
        patch,
        probe,
        automatic,
        overridden,
    ), decision
    assert fragment in decision.reason
    assert decision.packed == (mode in ("pack", "padding_free"))


@pytest.mark.parametrize(
    "columns",
    [("pixel_values",), ("pixel_values", "pixel_attention_mask"), ("pixel_values", "image_grid_thw"), ("image_sizes",)],
)
@pytest.mark.parametrize("request_kwargs", [{"packing": True}, {}])
def test_image_columns_under_other_names_block_with_the_reason(columns, request_kwargs):
    """Issue 20 item 8: a text config whose dataset has processed image columns (``pixel_values``, ...) was packed
    (only ``image`` / ``images`` were looked for)."""
    sample = dict(TEXT) | {name: [[0.0]] for name in columns}
    decision = decide(
        _config(**request_kwargs),
        model_config=LlamaConfig(),
        dataset_sample=sample,
        supported_model_types=SUPPORTED,
        blocklist=BLOCKLIST,
        env={},
    )
    assert decision.mode == "padded"
    assert f"the dataset has images ({', '.join(columns)})" in decision.reason


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


def test_neftune_note_only_for_packed_rows():
    pack = decide(_config(packing=True, neftune_noise_alpha=5.0), model_config=LlamaConfig(), env={})
    assert "alpha/sqrt(tokens per row" in neftune_note(_config(neftune_noise_alpha=5.0), pack)
    assert neftune_note(_config(), pack) is None
    padded = decide(_config(neftune_noise_alpha=5.0), model_config=LlamaConfig(), env={})
    assert neftune_note(_config(neftune_noise_alpha=5.0), padded) is None


@pytest.mark.parametrize(
    "config_kwargs, has_metrics, flattened, note",
    [
        ({}, False, True, None),
        ({}, True, False, "evaluation stays padded"),
        ({"packing": True}, True, False, "evaluation stays padded"),
        ({"packing": True, "eval_packing": True}, True, True, "eval_packing=True: evaluation batches are flattened"),
        ({"padding_free": True}, True, True, "padding_free=True: evaluation batches are flattened"),
        ({"padding_free": False}, True, False, None),
    ],
)
def test_eval_batches_stay_padded_with_metrics(config_kwargs, has_metrics, flattened, note):
    config = _config(**config_kwargs)
    decision = decide(config, model_config=LlamaConfig(), supported_model_types=SUPPORTED, env={})
    got_flattened, got_note = eval_batches(config, decision, has_metrics=has_metrics)
    assert got_flattened is flattened
    assert (got_note is None) if note is None else (note in got_note)


def test_log_once_logs_once_and_only_on_the_main_process(monkeypatch, caplog):
    import logging

    logger = logging.getLogger("unpack_trainer.test")
    reset_log_once()
    with caplog.at_level(logging.INFO, logger="unpack_trainer.test"):
        log_once(logger, logging.INFO, "hello")
        log_once(logger, logging.INFO, "hello")
        monkeypatch.setenv("RANK", "1")
        log_once(logger, logging.INFO, "from rank 1")
        log_once(logger, logging.INFO, "everywhere", main_process_only=False)
    assert [r.message for r in caplog.records] == ["hello", "everywhere"]
    reset_log_once()


@pytest.mark.parametrize(
    "order, packer",
    [("windowed", "windowed best fit"), ("shuffled", "shuffled best fit"), ("decreasing", "best-fit decreasing")],
)
def test_pack_reason_names_the_packer_that_packing_order_chooses(order, packer):
    """The start line names the packer that runs: the default, windowed, is not a global best fit."""
    decision = decide(
        _config(packing=True, packing_order=order),
        model_config=LlamaConfig(),
        dataset_sample=TEXT,
        supported_model_types=SUPPORTED,
        blocklist=BLOCKLIST,
        env={},
    )
    assert decision.mode == "pack" and packer in decision.reason
    assert ("global" in decision.reason) == (order != "windowed")


def test_packing_decision_has_no_unread_self_check_flag():
    """The self-check runs exactly when rows are packed or flattened (``decision.packed``): no second flag for it."""
    from dataclasses import fields

    from unpack_trainer.decision import PackingDecision

    assert "probe" not in {field.name for field in fields(PackingDecision)}


# ------------------------------------------------------------------------------- what any config says, by its fields


def _any_config(padding_free_default):
    """A trainer config class that is none of ours: ``padding_free`` with ``padding_free_default``, or no such field
    (``padding_free_default`` is ``...``)."""
    import dataclasses

    from transformers import TrainingArguments

    fields = [] if padding_free_default is ... else [("padding_free", bool | None, padding_free_default)]
    return dataclasses.make_dataclass("OtherConfig", fields, bases=(TrainingArguments,))


@pytest.mark.parametrize(
    ("default", "given", "mode", "reason"),
    [
        (None, False, "padded", "padding_free=False was set"),  # failed before: isinstance(config, (SFT, DPO)) only
        (None, True, "padding_free", "padding_free=True"),
        (None, None, "padding_free", "automatic padding-free"),
        (False, False, "padding_free", "automatic padding-free"),  # False is that class's default: not a request
        (..., None, "padding_free", "automatic padding-free"),  # no such field (GRPOConfig): nothing said
    ],
)
def test_the_decision_reads_padding_free_from_any_config(default, given, mode, reason):
    """An explicit ``padding_free=False`` is honoured on any config whose field can tell it from the default (not
    only on our ``SFTConfig`` / ``DPOConfig``); a config whose default is ``False`` or that has no such field says
    nothing, and the trainer decides."""
    from unpack_trainer.decision import explicit_padding_free

    cls = _any_config(default)
    kwargs = {} if given is None else {"padding_free": given}
    config = cls(output_dir="/tmp/unpack-decision", report_to="none", use_cpu=True, **kwargs)
    decision = decide(config, model_config=_model(), supported_model_types=SUPPORTED, env={})
    assert (decision.mode, reason in decision.reason) == (mode, True), decision
    assert explicit_padding_free(config) == (None if default in (False, ...) and given is not True else given)


def test_a_plain_trl_grpo_config_decides_automatic_padding_free():
    decision = decide(_config(trl.GRPOConfig), model_config=_model(), supported_model_types=SUPPORTED, env={})
    assert decision.mode == "padding_free" and decision.automatic


# ------------------------------------------------------------------------------------------------ parallelism


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ({"cp_size": 2}, "context parallelism (cp_size=2)"),
        ({"sp_size": 4}, "sequence parallelism (sp_size=4, DeepSpeed Ulysses)"),
        ({}, None),
        ({"tp_size": 1, "dp_shard_size": 1}, None),
    ],
)
def test_parallelism_reason_from_the_config_or_the_launch_environment(sizes, words):
    from accelerate.parallelism_config import ParallelismConfig

    from unpack_trainer.decision import parallelism_reason

    reason = parallelism_reason(ParallelismConfig(**sizes), env={})
    assert (reason is None) if words is None else reason.startswith(words)
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"} | {
        f"PARALLELISM_CONFIG_{name.upper()}": str(value) for name, value in sizes.items()
    }
    from_env = parallelism_reason(None, env=env)
    assert from_env == reason
    # without the launcher's switch, its variables are not a parallelism config
    assert parallelism_reason(None, env={key: value for key, value in env.items() if "USE" not in key}) is None


@pytest.mark.parametrize("request_kwargs", [{"packing": True}, {"padding_free": True}])
def test_sequence_splitting_parallelism_refuses_packed_rows_at_start(request_kwargs):
    reason = "context parallelism (cp_size=2) splits every row"
    with pytest.raises(ValueError, match=r"is not supported with context parallelism \(cp_size=2\).*packing=False"):
        decide(
            _config(**request_kwargs),
            model_config=LlamaConfig(),
            dataset_sample=TEXT,
            supported_model_types=SUPPORTED,
            env={},
            parallelism=reason,
        )


def test_sequence_splitting_parallelism_turns_automatic_padding_free_off_with_the_reason():
    reason = "sequence parallelism (sp_size=2, DeepSpeed Ulysses) splits every row"
    common = dict(model_config=LlamaConfig(), dataset_sample=TEXT, supported_model_types=SUPPORTED, env={})
    decision = decide(_config(), **common, parallelism=reason)
    assert (decision.mode, decision.automatic, decision.overridden_request) == ("padded", True, False)
    assert reason in decision.reason
    # an explicit padded choice, a request blocked anyway and UNPACK_DISABLE are not refused
    assert decide(_config(padding_free=False), **common, parallelism=reason).mode == "padded"
    blocked = decide(_config(packing=True), **common | {"data_collator": object()}, parallelism=reason)
    assert blocked.mode == "padded" and blocked.overridden_request
    stock = decide(_config(packing=True), **common | {"env": {"UNPACK_DISABLE": "1"}}, parallelism=reason)
    assert stock.mode == "stock"
