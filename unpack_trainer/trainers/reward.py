"""``RewardTrainer`` / ``RewardConfig``: TRL's reward-model trainer on packed pairs, the prompt run once for chosen
and rejected.

TRL's ``RewardTrainer`` pads ``[prompt; chosen]`` and ``[prompt; rejected]`` (chosen rows, then rejected rows) to the
batch's longest sequence and reads one score per row from a ``*ForSequenceClassification`` model. Here the pairs of
each batch run as one packed row: with ``prefix_sharing`` a pair is one branched segment ``[shared; chosen';
rejected']`` (:mod:`unpack_trainer.preference`'s layout: both continue the shared tokens, neither sees the other),
where the shared tokens are the longest common start of the two tokenized sequences (the prompt, explicit or
implicit, and whatever the completions share at their start), at most all but one token of the shorter one. The
model's packed forward ([`unpack_trainer.models.classification_head`]) reads each sequence's score at its own last
non-pad token and returns them in TRL's order, so TRL's ``compute_loss`` is kept whole: the loss (``margin``,
``center_rewards_coefficient``), every metric (``accuracy``, ``margin``, ``min/mean/max_reward``, ``num_tokens``,
counted from TRL's padded ``attention_mask``, which the batch keeps) and the predictions evaluation hands to
``compute_metrics`` (one row per sequence, as stock) are TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import trl
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer import _trl_compat
from unpack_trainer.decision import PackingDecision, explicit_padding_free
from unpack_trainer.models.classification_head import SCORE_ORDER_KEY, score_head_refusal
from unpack_trainer.preference import pack_preference_pairs
from unpack_trainer.trainers.branched import BranchedTrainerMixin

__all__ = ["DataCollatorForPackedReward", "RewardConfig", "RewardTrainer", "shared_prefix_length"]


@dataclass
class RewardConfig(trl.RewardConfig):
    r"""
    [`trl.RewardConfig`] for [`unpack_trainer.RewardTrainer`]. Every TRL field keeps its meaning; these are added:

    > Parameters that control packing of preference pairs

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether to run the pairs of each batch as one packed row without padding, instead of TRL's padded batch
            of `2 * per_device_train_batch_size` rows (chosen rows, then rejected rows). Pairs never attend to each
            other, each sequence is scored at its own last token, and the loss, every logged metric and every
            gradient are those of TRL's padded batch. `None` lets the trainer decide: it turns it on when the model,
            collator and data allow it and logs why (set `UNPACK_DISABLE_AUTO_PADDING_FREE=1` to keep padded
            batches); it stays off for a custom `data_collator`, prompt-learning PEFT, a model the packing patch
            refuses, or a model whose score head cannot be read per packed sequence (logged with the reason).
            `False` is never overridden and trains exactly as `trl.RewardTrainer`.
        prefix_sharing (`bool`, *optional*, defaults to `True`):
            With packed rows, run the tokens chosen and rejected start with once: a pair is one segment
            `[shared, chosen', rejected']` in which both continue the shared tokens (positions and attention) and
            never see each other. The shared tokens are the longest common start of the two tokenized sequences
            (the prompt, explicit or implicit, and what the completions share), at most all but one token of the
            shorter one. `False` packs `[prompt, chosen]` and `[prompt, rejected]` as two ordinary samples.
    """

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Run the pairs of each batch as one packed row without padding (exact: TRL's loss and metrics). "
            "None (default) lets the trainer decide and log why; False is never overridden."
        },
    )
    prefix_sharing: bool = field(
        default=True,
        metadata={"help": "With packed rows, run the tokens chosen and rejected start with once per pair."},
    )


def shared_prefix_length(chosen: list[int], rejected: list[int]) -> int:
    """How many tokens a pair's two sequences share at their start, at most all but one of the shorter one (so each
    keeps a token of its own, whose hidden state can score it).

    Example::

        >>> shared_prefix_length([5, 6, 7, 2], [5, 6, 8, 9, 2])
        2
        >>> shared_prefix_length([5, 6], [5, 6, 7])
        1
    """
    limit = min(len(chosen), len(rejected)) - 1
    shared = 0
    while shared < limit and chosen[shared] == rejected[shared]:
        shared += 1
    return shared


@dataclass
class DataCollatorForPackedReward(DataCollatorMixin):
    """TRL's reward collator plus the packed row the model runs.

    The batch is TRL's padded one (``input_ids`` / ``attention_mask`` ``(2 * num_pairs, L)``, chosen rows first, and
    ``margin`` ``(num_pairs,)`` float when the examples have it; never run through the model) and the pairs as one
    packed row (:func:`unpack_trainer.preference.pack_preference_pairs`): ``packed_input_ids`` /
    ``packed_position_ids`` ``(1, T)`` int64, ``packed_seq_lengths`` ``(num_seqs,)`` int32, ``packed_seq_parents``
    ``(num_seqs,)`` int64; and ``packed_score_order`` ``(2 * num_pairs,)`` int64: for each row of TRL's batch, its
    sequence among the row's scored sequences (``[c1, r1, c2, r2, ...]``). Each example is a dict with ``chosen_ids``
    and ``rejected_ids`` (lists of ints, each at least one token) and optionally ``margin``::

        chosen_ids [5, 6, 7], rejected_ids [5, 6, 8, 9]
        packed_input_ids [[5, 6, 7, 8, 9]]   packed_seq_lengths [2, 1, 2]   packed_seq_parents [-1, 0, 0]
        packed_position_ids [[0, 1, 2, 2, 3]]   packed_score_order [0, 1]

    Args:
        pad_token_id (`int`): padding of TRL's batch (what the model's pooling reads too).
        pad_to_multiple_of (`int` or `None`, *optional*): padding of TRL's batch, as in TRL.
        prefix_sharing (`bool`, *optional*, defaults to `True`): share the start the two sequences have in common
            ([`shared_prefix_length`]); `False`: two plain samples per pair.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    prefix_sharing: bool = True
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        view = _trl_compat.reward_padded_collator_class()(
            pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of
        ).torch_call(examples)
        pairs = []
        for example in examples:
            chosen, rejected = list(example["chosen_ids"]), list(example["rejected_ids"])
            shared = shared_prefix_length(chosen, rejected) if self.prefix_sharing else 0
            pairs.append(
                {"prompt_ids": chosen[:shared], "chosen_ids": chosen[shared:], "rejected_ids": rejected[shared:]}
            )
        packed = pack_preference_pairs(pairs, prefix_sharing=self.prefix_sharing)
        del packed["packed_token_index"]
        order = torch.arange(2 * len(examples), dtype=torch.int64).view(-1, 2).t().reshape(-1)
        return {**view, **packed, SCORE_ORDER_KEY: order}


class RewardTrainer(BranchedTrainerMixin, trl.RewardTrainer):
    """Drop-in for [`trl.RewardTrainer`]: ``from unpack_trainer import RewardTrainer``; the arguments are TRL's.

    The pairs of each batch run as one packed row; with ``prefix_sharing`` (default) the tokens both sequences of a
    pair start with run once (see the module docstring). The decision, switches, self-checks and fallbacks are those
    of [`BranchedTrainerMixin`] (and its core [`PackedTrainerMixin`], which documents the attributes); on top, a
    model whose score cannot be read per packed sequence
    ([`unpack_trainer.models.classification_head.score_head_refusal`]) trains on TRL's padded batches, logged once
    with the reason. Evaluation batches are packed too, also with ``compute_metrics``: its predictions are one score
    per sequence in TRL's order, as stock.
    """

    unpack_config_class = RewardConfig
    unpack_trl_class = trl.RewardTrainer
    unpack_name = "RewardTrainer"
    unpack_unshared = "each pair is packed as two samples, [prompt, chosen] and [prompt, rejected]"
    _unpack_trl_methods = _trl_compat.REWARD_TRAINER_METHODS

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        args = self._unpack_before_init(
            model,
            args,
            data_collator=data_collator,
            processing_class=processing_class,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            has_metrics=False,  # a packed batch's predictions are TRL's: one score per sequence, in its order
        )
        super().__init__(
            model,
            args,
            data_collator,
            train_dataset,
            eval_dataset,
            processing_class,
            compute_metrics,
            callbacks,
            optimizers,
            optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics,
            quantization_config,
            peft_config,
        )
        self._unpack_after_init(train_dataset, eval_dataset)

    # ------------------------------------------------------------------------------------------------ core hooks

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """Tokenized ``chosen_ids`` + ``rejected_ids``, else ``chosen`` + ``rejected`` (an explicit ``prompt``
        column, or a prompt implicit in both)."""
        return (("chosen_ids", "rejected_ids"), ("chosen", "rejected"))

    def _packed_collator(self) -> DataCollatorForPackedReward:
        padded = self._padded_collator()
        return DataCollatorForPackedReward(
            pad_token_id=padded.pad_token_id,
            pad_to_multiple_of=padded.pad_to_multiple_of,
            prefix_sharing=self._unpack_sharing(),
        )

    def _padded_collator(self) -> Any:
        collator = getattr(self, "_unpack_padded_collator", None)
        if collator is None:
            collator = self._unpack_padded_collator = self.data_collator  # TRL's, as its __init__ built it
            if not isinstance(collator, _trl_compat.reward_padded_collator_class()):
                raise TypeError(f"RewardTrainer expected TRL's reward collator, found {type(collator).__name__}")
        return collator

    def _unpack_stop_sharing(self) -> None:
        self.data_collator = self._packed_collator()

    def _unpack_install_hooks(self, model: Any) -> None:
        """Nothing on top of the patch: ``patch_model`` gives a sequence-classification model its packed scoring
        ([`unpack_trainer.models.classification_head.install_score_hooks`])."""

    def _enable_packed_path(self) -> None:
        """The packed path, unless the model's score cannot be read per packed sequence: then TRL's padded batches,
        the reason in the start line."""
        refusal = score_head_refusal(self.accelerator.unwrap_model(self.model))
        if refusal is not None:
            explicit = explicit_padding_free(self._unpack_args) is True  # ours (TRL's copy has it False)
            what = "padding_free=True ignored" if explicit else "automatic padding-free off"
            self.unpack_decision = PackingDecision(
                "padded",
                f"{what} (the model's score cannot be read per packed sequence: {refusal})",
                automatic=True,
                overridden_request=explicit,
            )
            self._unpack_mode = "padded"
            return
        self._padded_collator()  # keep TRL's collator before the core replaces it
        super()._enable_packed_path()
