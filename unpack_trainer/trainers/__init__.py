"""Trainers built on the packed-trainer core ([`unpack_trainer.trainers._packed.PackedTrainerMixin`]): each one is
TRL's own trainer with the core in front of it and the hooks for its batches (collators, data preparation, loss).

[`TRAINERS`] declares them, one entry each: the public exports (``unpack_trainer.SFTTrainer``, ``SFTConfig``, ...)
and the command line (``unpack-trainer sft``, mirroring ``trl sft``) are made from it. One rule places the classes:
the trainer class in ``unpack_trainer/trainers/<command>.py`` (it declares its config class, ``unpack_config_class``),
its config class in ``unpack_trainer/configs.py`` (every config there, so the command line's parsers and ``--help``
need no trainer, model or kernel). The table names the trainers' modules and none of them reads it back, so this face
imports downward only (``tests/test_layering.py`` reads its lazy table as imports).

Beside the trainer modules: the core (``_packed.py``, the ``Trainer`` methods it overrides) and its collaborators
(``hooks.py``: what a trainer declares and implements; ``run_state.py``: one run's state; ``packed_path.py``,
``contamination.py``, ``sequence_parallel.py``, ``loss.py``, ``evaluation.py``, ``start_line.py``), ``branched.py``
(what trainers whose prompts are shared by several completions add: DPO, GRPO, RLOO, reward, KTO, distillation).
Importing this package imports neither torch nor TRL; the classes are resolved on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from unpack_trainer._lazy import lazy_exports

# Where every trainer's config class lives.
CONFIG_MODULE = "unpack_trainer.configs"


@dataclass(frozen=True)
class TrainerSpec:
    """One trainer of the package.

    Attributes:
        command: TRL's command it mirrors (``trl <command>``, ``trl.scripts.<command>``), ours
            (``unpack-trainer <command>``) and the trainer's module, ``unpack_trainer.trainers.<command>``.
        trainer: the trainer class's name, in that module.
        config: the config class's name, in ``unpack_trainer.configs`` (:data:`CONFIG_MODULE`).
        title: what the command does, for its help (one line).
        differs: what the trainer does differently from TRL's, for the command's help (a sentence).
    """

    command: str
    trainer: str
    config: str
    title: str
    differs: str

    @property
    def trainer_module(self) -> str:
        return f"unpack_trainer.trainers.{self.command}"

    def trainer_class(self) -> type:
        return getattr(importlib.import_module(f"unpack_trainer.trainers.{self.command}"), self.trainer)

    def config_class(self) -> type:
        return getattr(importlib.import_module(CONFIG_MODULE), self.config)


TRAINERS: tuple[TrainerSpec, ...] = (
    TrainerSpec(
        "sft",
        "SFTTrainer",
        "SFTConfig",
        "Supervised fine-tuning with sample packing",
        "--packing packs globally with no cross-sample attention; without --packing, padding-free batching turns on "
        "automatically where safe (--padding_free false keeps padded batches)",
    ),
    TrainerSpec(
        "dpo",
        "DPOTrainer",
        "DPOConfig",
        "Preference training (DPO) on packed pairs",
        "the pairs of each batch run as one packed row, each prompt once for its chosen and rejected completions "
        "(--prefix_sharing false: [prompt, chosen] and [prompt, rejected] as two samples; --padding_free false: "
        "TRL's padded batches); the loss and every metric are TRL's",
    ),
    TrainerSpec(
        "grpo",
        "GRPOTrainer",
        "GRPOConfig",
        "Online RL (GRPO) with packed training forwards",
        "the forwards that score completions (policy, old policy, reference) run packed rows, each group's prompt "
        "once for its completions (--prefix_sharing false: each completion after its own prompt; --padding_free "
        "false: TRL's padded batches); generation, rewards, the loss and every metric are TRL's",
    ),
    TrainerSpec(
        "rloo",
        "RLOOTrainer",
        "RLOOConfig",
        "Online RL (RLOO) with packed training forwards",
        "the forwards that score completions (policy, old policy, reference) run packed rows, each group's prompt "
        "once for its completions (--prefix_sharing false: each completion after its own prompt; --padding_free "
        "false: TRL's padded batches); generation, rewards, the loss and every metric are TRL's",
    ),
    TrainerSpec(
        "reward",
        "RewardTrainer",
        "RewardConfig",
        "Reward modelling on packed pairs",
        "the pairs of each batch run as one packed row, the tokens chosen and rejected start with (the prompt) once, "
        "each sequence scored at its own last token (--prefix_sharing false: [prompt, chosen] and [prompt, rejected] "
        "as two samples; --padding_free false: TRL's padded batches); the loss and every metric are TRL's",
    ),
    TrainerSpec(
        "distillation",
        "DistillationTrainer",
        "DistillationConfig",
        "On-policy distillation with packed student and teacher forwards",
        "the student's forward (with gradients) and the teacher's run one packed row per micro-batch, built once for "
        "both (--padding_free false: TRL's padded batches; a teacher the patch refuses runs padded, logged); "
        "generation, the generalized JSD loss and every metric are TRL's",
    ),
    TrainerSpec(
        "kto",
        "KTOTrainer",
        "KTOConfig",
        "Unpaired preference training (KTO) on packed rows",
        "each batch runs as packed rows, each prompt once per forward with its completions (and the KL completions) "
        "as branches (--prefix_sharing false: every sequence after its own prompt; --padding_free false: TRL's "
        "padded batches); the loss, the KL estimate and every metric are TRL's",
    ),
)
"""Every trainer of the package, in the order ``unpack-trainer --help`` lists them."""


def trainer_spec(command: str) -> TrainerSpec:
    """The entry of [`TRAINERS`] for ``command``; ``KeyError`` naming the known commands otherwise."""
    for spec in TRAINERS:
        if spec.command == command:
            return spec
    raise KeyError(f"no trainer for {command!r}; known: {', '.join(spec.command for spec in TRAINERS)}")


__all__ = [
    "CONFIG_MODULE",
    "TRAINERS",
    "PackedTrainerMixin",
    "TrainerSpec",
    "trainer_spec",
    *(spec.trainer for spec in TRAINERS),
]

_CLASSES = {"PackedTrainerMixin": "unpack_trainer.trainers._packed"} | {
    spec.trainer: spec.trainer_module for spec in TRAINERS
}


__getattr__ = lazy_exports(__name__, _CLASSES)
