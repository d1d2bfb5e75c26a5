"""The SFT trainer's former home, kept importable: ``from unpack_trainer.trainer import SFTTrainer`` still works.

The trainers live in [`unpack_trainer.trainers`] (the packed-trainer core and one thin subclass per TRL trainer), the
per-sample loss weighting in [`unpack_trainer.loss`] and the balanced-step sampler in [`unpack_trainer.data.sampler`].
"""

from __future__ import annotations

from unpack_trainer.data.sampler import BalancedStepSampler
from unpack_trainer.loss import sample_weights
from unpack_trainer.trainers.sft import SFTTrainer

__all__ = ["BalancedStepSampler", "SFTTrainer", "sample_weights"]
