"""The pieces every trainer with shared prompts uses (unpack_trainer.trainers.branched), and the one declaration per
trainer that the public exports and the command line come from (unpack_trainer.trainers.TRAINERS)."""

from __future__ import annotations

import copy

import pytest
import torch
import trl

import unpack_trainer
from unpack_trainer.models import is_patched, unpatch_model
from unpack_trainer.selfcheck import check_uncontaminated
from unpack_trainer.trainers import TRAINERS
from unpack_trainer.trainers.branched import install_branched_hooks


def _hooked(module: torch.nn.Module) -> int:
    return sum(len(getattr(module, name)) for name in ("_forward_pre_hooks", "_forward_hooks"))


def test_unpatch_model_takes_the_prompt_sharing_hooks_off_too(tiny_llama):
    """``install_branched_hooks`` (the decoder's packed view, the compact LM head on TRL's fused forward) is undone by
    ``unpatch_model``, also on a deep copy (the undo acts on the copy). Before, the view's hooks and the compact head
    stayed on the model after the padded fallback unpatched it."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    fused = model.__dict__["forward"]
    hooks = _hooked(model.model)
    install_branched_hooks(model)
    install_branched_hooks(model)  # idempotent
    assert is_patched(model) and model.__dict__["forward"] is not fused
    twin = copy.deepcopy(model)
    for one in (model, twin):
        unpatch_model(one)
        assert not is_patched(one) and _hooked(one.model) == hooks
        assert one.__dict__["forward"].__func__ is fused.__func__ and one.__dict__["forward"].__self__ is one
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(model(input_ids=ids).logits, twin(input_ids=ids).logits)


@pytest.mark.parametrize("branches", [2, 5])
def test_the_branched_probe_takes_any_number_of_completions(branches, tiny_llama, leak_branches):
    """``check_uncontaminated(branched=True)`` with a prompt and ``branches`` completions (GRPO's groups): passes on the
    patched model, fails when a completion sees a sibling or misses its prompt."""
    model = tiny_llama()
    install_branched_hooks(model)
    lengths = (3, *((1, 4, 2)[i % 3] for i in range(branches)))
    assert check_uncontaminated(model, branched=True, lengths=lengths).ok
    leak_branches("sibling")
    report = check_uncontaminated(model, branched=True, lengths=lengths)
    assert not report.ok and report.max_abs_diff > report.tolerance


def test_the_branched_probe_misses_no_prompt(tiny_llama, leak_branches):
    model = tiny_llama()
    install_branched_hooks(model)
    leak_branches("parents")
    assert not check_uncontaminated(model, branched=True, lengths=(3, 1, 4, 2, 1)).ok


def test_exports_and_commands_come_from_the_declaration():
    """Every declared trainer is exported with its config, and is an ``unpack-trainer`` command whose parser is
    TRL's with our config."""
    from unpack_trainer.cli.commands.train import COMMANDS, make_parser

    for spec in TRAINERS:
        trainer, config = getattr(unpack_trainer, spec.trainer), getattr(unpack_trainer, spec.config)
        assert {spec.trainer, spec.config} <= set(unpack_trainer.__all__)
        assert trainer is spec.trainer_class() and trainer.unpack_config_class is config
        assert issubclass(trainer, trainer.unpack_trl_class) and issubclass(config, getattr(trl, spec.config))
        assert spec.command in COMMANDS and config in make_parser(spec.command).dataclass_types
