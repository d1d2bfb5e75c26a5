"""``RLOOTrainer``: TRL's RLOO trainer whose training forwards run packed rows, each group's prompt computed once.

The same packed forwards as [`unpack_trainer.trainers.grpo`] ([`PackedCompletionsMixin`]): TRL's RLOO step
(generation, rewards, the leave-one-out baseline, the loss, every logged metric) is kept whole, and the one method
its per-token log-probabilities go through (policy, old policy, reference) runs each distinct prompt once.
"""

from __future__ import annotations

import trl

from unpack_trainer import _trl_compat
from unpack_trainer.configs import RLOOConfig
from unpack_trainer.trainers.grpo import PackedCompletionsMixin

__all__ = ["RLOOTrainer"]


class RLOOTrainer(PackedCompletionsMixin, trl.RLOOTrainer):
    """Drop-in for [`trl.RLOOTrainer`]: ``from unpack_trainer import RLOOTrainer``; the arguments are TRL's.

    The training forwards run packed rows, each group's prompt once for its ``num_generations`` completions
    ([`PackedCompletionsMixin`]). ``args`` may be any ``TrainingArguments`` (converted to our [`RLOOConfig`]).
    """

    unpack_config_class = RLOOConfig
    unpack_trl_methods = _trl_compat.ONLINE_TRAINER_METHODS
    unpack_trl_attributes = _trl_compat.ONLINE_TRAINER_ATTRIBUTES
