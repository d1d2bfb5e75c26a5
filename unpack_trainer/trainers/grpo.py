"""``GRPOTrainer``: TRL's GRPO trainer whose training forwards run packed rows, each group's prompt computed once.

TRL's GRPO step is kept whole (generation, rewards, advantages, the loss of every ``loss_type``, importance sampling,
clipping, the KL term, entropy masking, every logged metric). Every per-token log-probability it needs goes through
one method, ``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)``: the policy
with gradients in ``compute_loss``, the old policy (``num_iterations > 1``, or generation and optimisation steps not
aligned) and the reference model (``beta > 0``: a separate ``ref_model``, or the PEFT model with its adapter disabled)
in ``_generate_and_score_completions``. [`PackedCompletionsMixin`] overrides that method only: TRL's ``(rows,
prompt + completion)`` batch (left-padded prompts, right-padded completions) becomes one packed row per chunk in which
each distinct prompt appears once, followed by its completions as branches ([`pack_completions`]: the ``G``
completions of a group wherever they sit in the batch, a partial group included), and TRL's fused LM head scores only
the completion tokens ([`unpack_trainer.trainers.branched.install_compact_lm_head`]); the per-token log-probs and
entropies come back in TRL's ``(rows, completion)`` layout, zero where TRL's are. A batch with vision inputs, or not in
TRL's layout, runs as TRL runs it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import trl

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.trainers.branched import BranchedTrainerMixin, pack_completions

__all__ = ["GRPOTrainer", "PackedCompletionsMixin"]

logger = logging.getLogger("unpack_trainer")

# A forward runs TRL's padded batch instead when the packed row would hold more than this share of its tokens: there
# packing saves too little to pay for its per-sample attention (the benchmark's uniform lengths, short prompts).
PACKED_TOKEN_SHARE = 0.9


class PackedCompletionsMixin(BranchedTrainerMixin):
    """The packed-trainer core for TRL's online trainers with groups of completions (GRPO, RLOO): the training
    forwards run packed rows, each distinct prompt once (see the module docstring). The trainer packs inside its step
    (``unpack_packs_in = "step"``): TRL's collator and data are untouched, so the padded fallback only unpatches.

    The branched self-check probes a prompt with ``num_generations`` completions.
    """

    unpack_packs_in = "step"
    unpack_unshared = "each completion is packed after its own copy of its prompt"

    def _unpack_before_init(self, model: Any, args: Any, **arguments: Any) -> Any:
        """The core's decision, after checking the arguments of the one method every log-prob forward goes through."""
        where = f"trl.{self.unpack_trl_class.__name__}"
        logps = "_get_per_token_logps_and_entropies"
        _trl_compat.require_parameters(self.unpack_trl_class, logps, _trl_compat.ONLINE_LOGPS_PARAMETERS, where)
        return super()._unpack_before_init(model, args, **arguments)

    @classmethod
    def unpack_data_columns(cls, args: Any) -> tuple[tuple[str, ...], ...]:
        """``prompt``."""
        return (("prompt",),)

    def _unpack_probe_branches(self) -> int:
        return int(self.num_generations)

    def _unpack_chunks(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int, fixed: bool
    ) -> list[tuple[int, int]] | str:
        """Row ranges ``[start, end)`` to pack one at a time, or why TRL's padded batch runs instead (``input_ids``
        and ``attention_mask`` on the CPU).

        ``fixed``: TRL's own chunks of ``batch_size`` rows (the MoE auxiliary loss is TRL's mean over them). Otherwise
        consecutive rows while the packed row stays within the padded tokens of one of TRL's chunks (``batch_size *
        L``), so memory stays within TRL's and a group split by TRL's chunks shares its prompt. TRL's batch runs when
        the packed rows would hold more than [`PACKED_TOKEN_SHARE`] of its tokens.
        """
        rows, width = input_ids.shape
        mask = attention_mask.bool()
        num_prompt = width - logits_to_keep
        prompt_lengths = mask[:, :num_prompt].sum(1).tolist()
        completion_lengths = mask[:, num_prompt:].sum(1).tolist()
        sharing = self._unpack_sharing()
        ids = input_ids.tolist() if sharing else None
        budget = batch_size * width
        chunks: list[tuple[int, int]] = []
        start, used, seen, total = 0, 0, set(), 0
        for row in range(rows):
            key = tuple(ids[row][num_prompt - prompt_lengths[row] : num_prompt]) if sharing else None
            cost = completion_lengths[row] + (0 if sharing and key in seen else prompt_lengths[row])
            split = row - start == batch_size if fixed else (row > start and used + cost > budget)
            if split:
                chunks.append((start, row))
                start, used, seen = row, 0, set()
                cost = completion_lengths[row] + prompt_lengths[row]
            used += cost
            total += cost
            seen.add(key)
        chunks.append((start, rows))
        if total > PACKED_TOKEN_SHARE * rows * width:
            return f"the packed rows would hold {total / (rows * width):.0%} of the padded batch's tokens"
        return chunks

    def _unpack_count_forward(self, kind: str) -> None:
        """Count a log-prob forward as ``"packed"`` or ``"padded"`` (TRL's batch) in ``unpack_stats["forwards"]``."""
        counts = self.unpack_stats.setdefault("forwards", {"packed": 0, "padded": 0})
        counts[kind] += 1

    @_trl_compat.profiled
    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's method, on packed rows: ``(per_token_logps (rows, logits_to_keep), entropies or None, aux_loss or
        None)`` as TRL returns them, from ``input_ids`` / ``attention_mask`` ``(rows, L)`` (see the module
        docstring). TRL's own code runs for a batch with vision inputs (any other keyword argument), or when the
        trainer is not packing."""

        def stock() -> Any:
            return super(PackedCompletionsMixin, self)._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **kwargs,
            )

        if not self.unpack_decision.packed or any(value is not None for value in kwargs.values()):
            if self.unpack_decision.packed:
                self._unpack_count_forward("padded")
            return stock()
        batch_size = batch_size or input_ids.size(0)
        ids, mask = input_ids.detach().cpu(), attention_mask.detach().cpu()  # one copy to the host per forward
        chunks = self._unpack_chunks(ids, mask, logits_to_keep, batch_size, fixed=compute_aux_loss)
        if isinstance(chunks, str):
            log_once(logger, logging.INFO, f"{self.unpack_name}: a forward ran TRL's padded batch: {chunks}")
            self._unpack_count_forward("padded")
            return stock()
        sharing = self._unpack_sharing()
        packed = []
        for start, end in chunks:
            batch = pack_completions(
                ids[start:end], mask[start:end], logits_to_keep, prefix_sharing=sharing, device=input_ids.device
            )
            if isinstance(batch, str):
                log_once(logger, logging.WARNING, f"{self.unpack_name}: a forward ran TRL's padded batch: {batch}")
                self._unpack_count_forward("padded")
                return stock()
            packed.append((start, end, batch[0]))
        self._unpack_count_forward("packed")
        all_logps, all_entropies, all_aux_losses = [], [], []
        for start, end, batch in packed:
            labels = batch.pop("labels")
            if compute_aux_loss:
                batch["output_router_logits"] = True
            with self.accelerator.autocast():
                outputs = model(**batch, attention_mask=attention_mask[start:end], labels=labels, fused_lm_head=True)
            all_logps.append(outputs.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                all_entropies.append(outputs.entropy[:, -logits_to_keep:])
            if compute_aux_loss:
                all_aux_losses.append(outputs.aux_loss)
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        aux_loss = torch.stack(all_aux_losses).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss


class GRPOTrainer(PackedCompletionsMixin, trl.GRPOTrainer):
    """Drop-in for [`trl.GRPOTrainer`]: ``from unpack_trainer import GRPOTrainer``; the arguments are TRL's.

    The training forwards run packed rows, each group's prompt once for its ``num_generations`` completions
    ([`PackedCompletionsMixin`]); generation, rewards and the loss are TRL's. The decision, switches, self-checks and
    fallbacks are those of [`BranchedTrainerMixin`] (and its core [`PackedTrainerMixin`], which documents the
    attributes). ``args`` may be any ``TrainingArguments`` (converted to our [`GRPOConfig`]).
    """

    _unpack_trl_methods = _trl_compat.ONLINE_TRAINER_METHODS
    _unpack_trl_attributes = _trl_compat.ONLINE_TRAINER_ATTRIBUTES
