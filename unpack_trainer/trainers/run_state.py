"""What one run of a packed trainer decided and keeps: one object per trainer, its ``unpack_run``.

The core ([`unpack_trainer.trainers._packed.PackedTrainerMixin`]) builds a [`RunState`] when it decides (before TRL's
``__init__``) and every part of the run reads and writes it there: the decision, the training set's statistics, the
self-check's report, the sequence-parallel shards, the loss normalization, evaluation's batch weights. A trainer that keeps more declares a subclass of [`RunState`] in its own module
(``unpack_run_class``): [`unpack_trainer.trainers.sft.SFTRun`] (the vision collator, the raw examples of rows packed
ahead), [`unpack_trainer.trainers.branched.BranchedRun`] (shared prompts), ... Nothing else is stamped on the
trainer: its public attributes (``unpack_decision``, ``unpack_stats``, ``unpack_selfcheck``, ...) are [`RunField`]s,
views of one field each.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from unpack_trainer.decision import PackingDecision
from unpack_trainer.selfcheck import ContaminationReport

__all__ = ["RunField", "RunState"]


@dataclasses.dataclass
class RunState:
    """One trainer run, from the decision to the end of ``train()``.

    Attributes:
        decision (`PackingDecision`): what was decided and why; its ``mode`` is the run's mode (``"stock"`` under
            ``UNPACK_DISABLE=1``; ``"padded"`` after a fallback). Public as ``trainer.unpack_decision``; ``None``
            only while the core decides.
        disabled (`bool`): ``UNPACK_DISABLE=1``: the trainer runs exactly as its TRL trainer.
        args: our config (the user's, converted), as the user set it; TRL's ``__init__`` sees a copy with
            ``packing`` / ``padding_free`` set for its own data path. ``None`` only under ``UNPACK_DISABLE=1``
            without a config.
        raw_train / raw_eval: the datasets as the user passed them (the padded fallback prepares them again).
        stats (`dict`): the training set's samples, rows, tokens, packing efficiency, estimated speedup, truncation
            counts, forwards packed and padded. Public as ``trainer.unpack_stats``.
        selfcheck (`ContaminationReport` or `None`): the self-check's report, once it ran. Public as
            ``trainer.unpack_selfcheck``.
        checked (`bool`): the self-check ran, or has nothing to check (it runs once, before the first batch).
        eval_flattened (`bool`) / eval_note (`str` or `None`): evaluation batches packed like training's, and why
            (or why not), logged once when there is an evaluation set.
        batches_whole (`bool`): accelerate's batch dispatching is off, each process reads its own packed batches.
        sample_loss (`bool`): ``loss_normalization="sample"`` is on.
        sequence_shards (`int`): the shards each packed row is cut into under sequence parallelism (1: none).
        eval_weights (`list` or `None`): during an evaluation loop whose batches are counted, each batch's
            ``(loss (), weight)``; ``None`` otherwise.
        lora_layers (`tuple` or `None`): ``(model, its plain LoRA layers)`` of the last training step.
        lora_skip: the LoRA cast skip of the training step running now, ``None`` outside one.
    """

    decision: PackingDecision | None = None
    disabled: bool = False
    args: Any = None
    raw_train: Any = None
    raw_eval: Any = None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    selfcheck: ContaminationReport | None = None
    checked: bool = True
    eval_flattened: bool = False
    eval_note: str | None = None
    batches_whole: bool = False
    sample_loss: bool = False
    sequence_shards: int = 1
    eval_weights: list[tuple[Any, int]] | None = None
    lora_layers: tuple[Any, list[Any]] | None = None
    lora_skip: Any = None

    def peft_lora_path(self) -> contextlib.AbstractContextManager:
        """Within a training step, a context in which every LoRA layer runs PEFT's own path (the step's cast skip,
        [`unpack_trainer.trainers.lora_casts`], paused: generation inside the step); outside a step, nothing."""
        return contextlib.nullcontext() if self.lora_skip is None else self.lora_skip.paused()


class RunField:
    """A trainer attribute that is one field of its run state: ``unpack_decision = RunField("decision")`` reads and
    writes ``trainer.unpack_run.decision`` (``AttributeError`` before the run state exists, as for an attribute never
    set)."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return getattr(trainer.unpack_run, self.field)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.unpack_run, self.field, value)
