"""The packed-trainer core (``unpack_trainer/trainers/_packed.py``): config conversion, the TRL compatibility checks,
and the hooks a trainer built on the core implements."""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import trl
from datasets import Dataset, Features, IterableDataset, Value

from unpack_trainer import SFTConfig, SFTTrainer, _trl_compat
from unpack_trainer.configs import convert_config
from unpack_trainer.data.sampler import BalancedStepSampler
from unpack_trainer.trainers import TRAINERS, PackedTrainerMixin
from unpack_trainer.trainers.hooks import TrainerHooks
from unpack_trainer.trainers.packed_path import _first_example

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


# ------------------------------------------------------------------------------------------------ config conversion


def test_convert_config_copies_every_trl_field_and_keeps_our_defaults(tmp_path, sft_args):
    plain = sft_args(
        tmp_path, cls=trl.SFTConfig, packing=True, hub_token="secret", eos_token="<e>", learning_rate=3e-3
    )
    ours = convert_config(plain, SFTConfig)
    assert type(ours) is SFTConfig
    for field in dataclasses.fields(trl.SFTConfig):
        if field.name == "padding_free":
            continue
        assert getattr(ours, field.name) == getattr(plain, field.name), field.name
    assert ours.hub_token == "secret" and ours.eos_token == "<e>"  # to_dict hides these two
    defaults = SFTConfig(str(tmp_path), bf16=False, use_cpu=True)
    for name in ("packing_order", "balance_samples_per_step", "loss_normalization", "max_samples_per_row"):
        assert getattr(ours, name) == getattr(defaults, name), name
    assert convert_config(ours, SFTConfig) is ours


@pytest.mark.parametrize(("given", "expected"), [(False, None), (True, True)])
def test_plain_trl_padding_free_false_counts_as_not_set(tmp_path, sft_args, given, expected):
    """A plain ``trl.SFTConfig`` cannot tell ``padding_free=False`` from its default: it becomes ``None``."""
    assert (
        convert_config(sft_args(tmp_path, cls=trl.SFTConfig, padding_free=given), SFTConfig).padding_free is expected
    )


def test_plain_trl_config_gets_our_documented_defaults(tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama):
    """Issue 20 item 2: ``trl.SFTConfig(packing=True)`` trained with windowed rows and balanced steps, as ours does
    (it got ``packing_order="decreasing"`` and a random sampler)."""
    plain = sft_args(tmp_path, cls=trl.SFTConfig, packing=True, per_device_train_batch_size=2)
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=plain,
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.args, SFTConfig)
    assert trainer.args.packing_order == "windowed"
    assert "packing_order='windowed'" in trainer.unpack_decision.reason
    assert isinstance(trainer._get_train_sampler(), BalancedStepSampler)
    assert type(plain) is trl.SFTConfig and plain.packing is True  # the user's config is left alone


# ------------------------------------------------------------------------------------------------ compatibility


def test_a_missing_private_trl_method_is_one_clear_error(
    tokenizer, tmp_path, monkeypatch, prompt_completion, sft_args, tiny_llama
):
    monkeypatch.delattr(trl.SFTTrainer, "_prepare_dataset")
    with pytest.raises(RuntimeError, match=r"`trl\.SFTTrainer\._prepare_dataset`.*Known to work: TRL 1\.16"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )


def test_a_missing_trl_attribute_or_class_is_one_clear_error(monkeypatch):
    class Bare:
        pass

    with pytest.raises(RuntimeError, match=r"attribute `trl\.SFTTrainer\._tokenizer`"):
        _trl_compat.require_attributes(Bare(), _trl_compat.SFT_TRAINER_ATTRIBUTES, "trl.SFTTrainer")
    from trl.trainer import sft_trainer

    monkeypatch.delattr(sft_trainer, "DataCollatorForLanguageModeling")
    with pytest.raises(RuntimeError, match="DataCollatorForLanguageModeling"):
        _trl_compat.sft_padded_collator_class()


def test_an_evaluation_loop_argument_is_found_by_name_not_position(monkeypatch):
    """``evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)``: the prefix
    by position, by keyword, or its default; a signature without it is one clear error."""
    find = _trl_compat.evaluation_loop_argument
    assert find((None, "Evaluation", None, None, "test"), {}, "metric_key_prefix") == "test"
    assert find((None, "Evaluation"), {"metric_key_prefix": "dev"}, "metric_key_prefix") == "dev"
    assert find((None, "Evaluation"), {}, "metric_key_prefix") == "eval"
    import transformers

    monkeypatch.setattr(transformers.Trainer, "evaluation_loop", lambda self, dataloader, description: None)
    with pytest.raises(RuntimeError, match=r"parameter `transformers\.Trainer\.evaluation_loop\.metric_key_prefix`"):
        find((None, "Evaluation"), {}, "metric_key_prefix")


def test_a_method_gone_from_trl_is_the_one_clear_error_for_its_parameters_too():
    class Moved:  # a TRL trainer class whose method was renamed
        pass

    with pytest.raises(RuntimeError, match=r"method `trl\.GRPOTrainer\._get_per_token_logps_and_entropies`.*Known"):
        _trl_compat.require_parameters(Moved, "_get_per_token_logps_and_entropies", ("model",), "trl.GRPOTrainer")


def test_every_name_listed_exists_in_the_installed_trl():
    _trl_compat.require_methods(trl.SFTTrainer, _trl_compat.TRAINER_METHODS, "transformers.Trainer")
    _trl_compat.require_methods(trl.SFTTrainer, _trl_compat.SFT_TRAINER_METHODS, "trl.SFTTrainer")
    assert _trl_compat.sft_padded_collator_class() is not None


# ------------------------------------------------------------------------------------------------ the core's shape


def test_sft_trainer_is_the_core_in_front_of_trls_trainer():
    assert SFTTrainer.__mro__[1:4] == (PackedTrainerMixin, TrainerHooks, trl.SFTTrainer)
    assert SFTTrainer.unpack_config_class is SFTConfig and SFTTrainer.unpack_trl_class is trl.SFTTrainer


def test_the_core_holds_only_the_trainer_methods_it_overrides():
    """Issue 44: what the core does around them is in its collaborators, what differs between trainers in its hooks."""
    from transformers import Trainer

    kinds = (types.FunctionType, classmethod, staticmethod, property)
    methods = {name for name, value in vars(PackedTrainerMixin).items() if isinstance(value, kinds)}
    assert methods - {"__init_subclass__"} <= set(dir(Trainer)), methods - set(dir(Trainer))
    assert len(methods) <= 15


@pytest.mark.parametrize("spec", TRAINERS, ids=lambda spec: spec.command)
def test_every_declared_trainer_declares_its_config_and_takes_its_names(spec):
    """The table names each trainer's module and class; the class declares its config and reads nothing back."""
    trainer = spec.trainer_class()
    assert trainer.unpack_config_class is spec.config_class()
    assert trainer.unpack_name == spec.trainer == trainer.__name__
    assert trainer.unpack_trl_class is getattr(trl, spec.trainer)

    class Custom(trainer):  # a user's subclass keeps the names it derives from
        pass

    assert (Custom.unpack_name, Custom.unpack_trl_class) == (spec.trainer, trainer.unpack_trl_class)


def test_the_run_state_is_the_one_place_a_run_keeps_what_it_decided(
    tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama
):
    """One object per run: nothing stamped on the trainer under ``_unpack_*``; the public attributes are its fields,
    the mode stored once (the decision's)."""
    from unpack_trainer.trainers.sft import SFTRun

    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True),
        train_dataset=prompt_completion(),
        eval_dataset=prompt_completion(4),
        processing_class=tokenizer,
    )
    trainer.get_train_dataloader()
    trainer.evaluate()
    run = trainer.unpack_run
    assert type(run) is SFTRun and run.decision.mode == "pack" and run.train_prepared
    assert trainer.unpack_decision is run.decision and trainer.unpack_stats is run.stats
    assert trainer.unpack_selfcheck is run.selfcheck and run.selfcheck.ok and run.checked
    assert not [name for name in vars(trainer) if name.startswith("_unpack")]
    assert [name for name in vars(trainer) if name.startswith("unpack_")] == ["unpack_run"]


# ------------------------------------------------------------------------------------------------ what the core reads

_STREAM: list = []  # the one-shot source of _one_shot_rows (a module-level function: datasets hashes it by reference)
_FEATURES = Features({"prompt": Value("string"), "completion": Value("string")})


def _one_shot_rows():
    yield from _STREAM[0]


def _one_shot_stream(n: int) -> IterableDataset:
    _STREAM[:] = [iter([{"prompt": f"ab{'a' * i}", "completion": "ba"} for i in range(n)])]
    return IterableDataset.from_generator(_one_shot_rows, features=_FEATURES)


def test_the_decision_reads_no_example_of_a_one_shot_stream():
    """Issue 20 item 7: ``_first_example`` consumed the first example of a one-shot iterable training set."""
    stream = _one_shot_stream(3)
    assert set(_first_example(stream)) == {"prompt", "completion"}
    assert next(iter(stream))["prompt"] == "ab"  # still the first example
    rows = Dataset.from_list([{"prompt": "x", "completion": "y"}, {"prompt": "z", "completion": "w"}])
    assert _first_example(rows) == {"prompt": "x", "completion": "y"}


def test_an_empty_declared_stream_is_the_clear_empty_error(tokenizer, tmp_path, sft_args, tiny_llama):
    with pytest.raises(ValueError, match=r"`train_dataset` is empty \(0 examples\)"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, max_steps=1),
            train_dataset=_one_shot_stream(0),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("padding_free", [False, None])
def test_packing_says_once_that_its_rows_are_padding_free(
    tokenizer, tmp_path, caplog, prompt_completion, sft_args, tiny_llama, padding_free
):
    """Issue 20 item 9: ``packing=True, padding_free=False`` packed padding-free rows without a word."""
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, padding_free=padding_free),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    assert trainer.unpack_decision.mode == "pack"
    said = [r for r in caplog.records if "padding_free=False has no effect with packing=True" in r.getMessage()]
    assert len(said) == (1 if padding_free is False else 0)
    assert all(r.levelno == logging.WARNING for r in said)


# ------------------------------------------------------------------------------------------------ what users see


@pytest.fixture
def transformers_verbosity():
    """transformers' default verbosity (WARNING) for the test, whatever an earlier test of this process left, and the
    verbosity put back as found after it (the Trainer sets it from ``log_level``)."""
    from transformers.utils import logging as hf_logging

    from unpack_trainer._logging import reset_log_once

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    reset_log_once()
    yield
    hf_logging.set_verbosity(level)
    reset_log_once()


@pytest.mark.parametrize(("log_level", "expected"), [("passive", logging.WARNING), ("error", logging.INFO)])
def test_the_decision_line_is_seen_at_the_default_verbosity(
    tmp_path, sft_args, tiny_llama, tokenizer, prompt_completion, caplog, transformers_verbosity, log_level, expected
):
    """Issue 46 item 3: the one line that says what the trainer decided was logged at INFO, which transformers' default
    verbosity (and Python's, with no logging configured) hides; ``log_level`` above WARNING silences it again."""
    with caplog.at_level(logging.DEBUG, logger="unpack_trainer"):
        SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, log_level=log_level),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    [line] = [r for r in caplog.records if r.getMessage().startswith("SFTTrainer: mode=pack")]
    assert line.levelno == expected


def test_unpack_disable_announces_itself(
    tmp_path, sft_args, tiny_llama, tokenizer, prompt_completion, caplog, monkeypatch, transformers_verbosity
):
    """Issue 46 item 3: ``UNPACK_DISABLE=1`` left no line in the log (only ``trainer.unpack_decision.reason``)."""
    monkeypatch.setenv("UNPACK_DISABLE", "1")
    with caplog.at_level(logging.DEBUG, logger="unpack_trainer"):
        trainer = SFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
    assert type(trainer.data_collator).__module__.startswith("trl.")
    said = [r for r in caplog.records if "UNPACK_DISABLE=1" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "exactly as trl.SFTTrainer" in said[0].getMessage()
