"""The packed-trainer core (``unpack_trainer/trainers/_packed.py``): config conversion, the TRL compatibility checks,
and the hooks a trainer built on the core implements."""

from __future__ import annotations

import dataclasses

import pytest
import trl

from unpack_trainer import SFTConfig, SFTTrainer, _trl_compat
from unpack_trainer.config import convert_config
from unpack_trainer.sampler import BalancedStepSampler
from unpack_trainer.trainers import PackedTrainerMixin

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


def test_every_name_listed_exists_in_the_installed_trl():
    _trl_compat.require_methods(trl.SFTTrainer, _trl_compat.TRAINER_METHODS, "transformers.Trainer")
    _trl_compat.require_methods(trl.SFTTrainer, _trl_compat.SFT_TRAINER_METHODS, "trl.SFTTrainer")
    assert _trl_compat.sft_padded_collator_class() is not None


# ------------------------------------------------------------------------------------------------ the core's shape


def test_sft_trainer_is_the_core_in_front_of_trls_trainer():
    assert SFTTrainer.__mro__[1:3] == (PackedTrainerMixin, trl.SFTTrainer)
    assert SFTTrainer.unpack_config_class is SFTConfig and SFTTrainer.unpack_trl_class is trl.SFTTrainer
    from unpack_trainer import trainer

    assert trainer.SFTTrainer is SFTTrainer  # the former module stays importable
