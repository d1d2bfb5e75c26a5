"""``GRPOConfig`` and ``RLOOConfig``: TRL's configs with ``padding_free`` (left unset by default, so the trainer can
decide) and ``prefix_sharing`` for the training forwards of [`unpack_trainer.GRPOTrainer`] and
[`unpack_trainer.RLOOTrainer`]."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trl

_DOC = r"""
    [`trl.{name}`] for [`unpack_trainer.{trainer}`]. Every TRL field keeps its meaning; these are added:

    > Parameters that control packing of the training forwards

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether the forwards that compute per-token log-probabilities (the policy with gradients, the old policy
            with `num_iterations > 1` or importance sampling, the reference model with `beta > 0`) run each batch as
            one packed row without padding, instead of TRL's `(completions, prompt + completion)` batch with
            left-padded prompts and right-padded completions. Completions never attend to each other, and the loss,
            every logged metric and every gradient are those of TRL's padded batch; generation is untouched. `None`
            lets the trainer decide: it turns it on when the model and the data allow it (not for vision inputs, a
            processor, prompt-learning PEFT or a model the packing patch refuses), logs why, and per forward runs
            TRL's padded batch instead where packing would not save enough tokens to be faster. `False` is never
            overridden and trains exactly as `trl.{trainer}`.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run each distinct prompt of a forward once, its completions (the `num_generations` of
            a group, wherever they are in the batch) as branches that continue from it (positions, attention, and
            each first completion token's prediction from the prompt's last token) and never see each other.
            `False` packs each completion after its own copy of its prompt.
"""


def _padding_free_field() -> Any:
    return field(
        default=None,
        metadata={
            "help": "Run the training forwards (policy, old policy, reference) as packed rows without padding (exact: "
            "TRL's loss and metrics). None (default) lets the trainer decide and log why; False is never overridden."
        },
    )


def _prefix_sharing_field() -> Any:
    return field(
        default=True,
        metadata={"help": "With packed rows, run each distinct prompt once for all its completions."},
    )


@dataclass
class GRPOConfig(trl.GRPOConfig):
    __doc__ = _DOC.format(name="GRPOConfig", trainer="GRPOTrainer")

    padding_free: bool | None = _padding_free_field()
    prefix_sharing: bool = _prefix_sharing_field()


@dataclass
class RLOOConfig(trl.RLOOConfig):
    __doc__ = _DOC.format(name="RLOOConfig", trainer="RLOOTrainer")

    padding_free: bool | None = _padding_free_field()
    prefix_sharing: bool = _prefix_sharing_field()
