"""Trainers built on the packed-trainer core ([`unpack_trainer.trainers._packed.PackedTrainerMixin`]): each one is
TRL's own trainer with the core in front of it and the hooks for its batches (collators, data preparation, loss)."""

from __future__ import annotations

from unpack_trainer.trainers._packed import PackedTrainerMixin
from unpack_trainer.trainers.dpo import DPOTrainer
from unpack_trainer.trainers.sft import SFTTrainer

__all__ = ["DPOTrainer", "PackedTrainerMixin", "SFTTrainer"]
