"""``RewardTrainer``: TRL's reward-model trainer on packed pairs, the prompt run once for chosen and rejected.

TRL's ``RewardTrainer`` pads ``[prompt; chosen]`` and ``[prompt; rejected]`` (chosen rows, then rejected rows) to the
batch's longest sequence and reads one score per row from a ``*ForSequenceClassification`` model. Here the pairs of
each batch run as one packed row: with ``prefix_sharing`` a pair is one branched segment ``[shared; chosen';
rejected']`` (:mod:`unpack_trainer.data.preference`'s layout: both continue the shared tokens, neither sees the other),
where the shared tokens are the longest common start of the two tokenized sequences (the prompt, explicit or
implicit, and whatever the completions share at their start), at most all but one token of the shorter one. The
model's packed forward ([`unpack_trainer.models.fixes.classification_head`]) reads each sequence's score at its own last
non-pad token and returns them in TRL's order, so TRL's ``compute_loss`` is kept whole: the loss (``margin``,
``center_rewards_coefficient``), every metric (``accuracy``, ``margin``, ``min/mean/max_reward``, ``num_tokens``,
counted from TRL's padded ``attention_mask``, which the batch keeps) and the predictions evaluation hands to
``compute_metrics`` (one row per sequence, as stock) are TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import trl
from transformers.data.data_collator import DataCollatorMixin

from unpack_trainer import _trl_compat
from unpack_trainer.anatomy.score_head import score_head_refusal
from unpack_trainer.configs import RewardConfig
from unpack_trainer.data.preference import pack_preference_pairs
from unpack_trainer.decision import PackingDecision, explicit_padding_free
from unpack_trainer.packed_seq_info import SCORE_ORDER_KEY, TOKEN_INDEX_KEY
from unpack_trainer.trainers.branched import PackedPairsMixin

__all__ = ["DataCollatorForPackedReward", "RewardTrainer", "shared_prefix_length"]


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
    packed row (:func:`unpack_trainer.data.preference.pack_preference_pairs`): ``packed_input_ids`` /
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
        del packed[TOKEN_INDEX_KEY]
        order = torch.arange(2 * len(examples), dtype=torch.int64).view(-1, 2).t().reshape(-1)
        return {**view, **packed, SCORE_ORDER_KEY: order}


class RewardTrainer(PackedPairsMixin, trl.RewardTrainer):
    """Drop-in for [`trl.RewardTrainer`]: ``from unpack_trainer import RewardTrainer``; the arguments are TRL's.

    The pairs of each batch run as one packed row; with ``prefix_sharing`` (default) the tokens both sequences of a
    pair start with run once (see the module docstring). The decision, switches, self-checks and fallbacks are those
    of [`PackedPairsMixin`] (and its core [`PackedTrainerMixin`], which documents the attributes); on top, a
    model whose score cannot be read per packed sequence
    ([`unpack_trainer.anatomy.score_head.score_head_refusal`]) trains on TRL's padded batches, logged once
    with the reason. Evaluation batches are packed too, also with ``compute_metrics``: its predictions are one score
    per sequence in TRL's order, as stock.
    """

    unpack_unshared = "each pair is packed as two samples, [prompt, chosen] and [prompt, rejected]"
    unpack_sequence_parallel = True  # the packed row cut by DeepSpeed Ulysses, the head's scores gathered
    unpack_trl_collator = staticmethod(_trl_compat.reward_padded_collator_class)
    unpack_config_class = RewardConfig
    unpack_trl_methods = _trl_compat.REWARD_TRAINER_METHODS

    def _unpack_has_metrics(self, given: dict[str, Any]) -> bool:
        """No: a packed batch's predictions are TRL's, one score per sequence in its order, so evaluation packs too."""
        return False

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

    def _unpack_install_hooks(self, model: Any) -> None:
        """Nothing on top of the patch: ``patch_model`` gives a sequence-classification model its packed scoring
        ([`unpack_trainer.models.fixes.classification_head.install_score_hooks`])."""

    def _enable_packed_path(self) -> None:
        """The packed path, unless the model's score cannot be read per packed sequence: then TRL's padded batches,
        the reason in the start line."""
        refusal = score_head_refusal(self.accelerator.unwrap_model(self.model))
        if refusal is not None:
            explicit = explicit_padding_free(self.unpack_run.args) is True  # ours (TRL's copy has it False)
            what = "padding_free=True ignored" if explicit else "automatic padding-free off"
            self.unpack_decision = PackingDecision(
                "padded",
                f"{what} (the model's score cannot be read per packed sequence: {refusal})",
                automatic=True,
                overridden_request=explicit,
            )
            return
        super()._enable_packed_path()
