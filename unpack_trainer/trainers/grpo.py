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
entropies come back in TRL's ``(rows, completion)`` layout, zero where TRL's are. On a vision-language model of the
Qwen2-VL family (images laid out by ``image_grid_thw``, multi-axis positions) an image prompt is shared the same way:
its images go to the vision tower once per group and every token keeps the positions the model's own
``get_rope_index`` gives its full sequence ([`unpack_trainer.trainers.image_prompts`]). A batch with another family's
vision inputs, or not in TRL's layout, runs as TRL runs it (logged once with the reason).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import trl

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.packed_seq_info import MULTIMODAL_POSITIONS_KEY, TOKEN_INDEX_KEY, VIEW_INDEX_KEY
from unpack_trainer.trainers.branched import BranchedTrainerMixin, pack_completions
from unpack_trainer.trainers.image_prompts import image_inputs_problem, image_keys, pack_image_inputs, row_images

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

    def _unpack_vision_reason(self, model_config: Any) -> str | None:
        """Image prompts are shared for a vision-language model whose text model rotates by several position axes
        (``mrope_section``: the Qwen2-VL family, images laid out by ``image_grid_thw``); any other keeps TRL's padded
        batches, with this reason."""
        if model_config is None or getattr(model_config, "vision_config", None) is None:
            return None
        text = model_config.get_text_config()
        for name in ("rope_parameters", "rope_scaling"):
            parameters = getattr(text, name, None)
            if isinstance(parameters, dict) and parameters.get("mrope_section") is not None:
                return None
        return (
            f"{self.unpack_name} shares image prompts for vision-language models whose images are laid out by "
            f"image_grid_thw with multi-axis positions (the Qwen2-VL family); model type "
            f"{getattr(model_config, 'model_type', None)!r} is not one"
        )

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

        if not self.unpack_decision.packed:
            return stock()
        vision = {name: value for name, value in kwargs.items() if value is not None}
        positions = None
        if vision:
            positions = self._unpack_sequence_positions(model, vision)
            if isinstance(positions, str):
                log_once(logger, logging.WARNING, f"{self.unpack_name}: a forward ran TRL's padded batch: {positions}")
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
        images = _ImageInputs(vision, ids, mask, logits_to_keep, sharing) if vision else None
        packed = []
        for start, end in chunks:
            batch = pack_completions(
                ids[start:end],
                mask[start:end],
                logits_to_keep,
                prefix_sharing=sharing,
                device="cpu" if images is not None else input_ids.device,
                keys=None if images is None or images.keys is None else images.keys[start:end],
            )
            if isinstance(batch, str):
                log_once(logger, logging.WARNING, f"{self.unpack_name}: a forward ran TRL's padded batch: {batch}")
                self._unpack_count_forward("padded")
                return stock()
            batch = batch[0]
            if images is not None:
                batch = images.packed(batch, start, end, positions, input_ids.device)
            packed.append((start, end, batch))
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

    def _unpack_sequence_positions(self, model: Any, vision: dict[str, Any]) -> Any:
        """The model's :class:`~unpack_trainer.models.vision.SequencePositions` for a forward with the vision inputs
        ``vision``, or why the forward runs TRL's padded batch (a string)."""
        from unpack_trainer.models.vision import sequence_positions_of

        problem = image_inputs_problem(vision)
        if problem is not None:
            return problem
        unwrapped = self.accelerator.unwrap_model(model)
        cache = self.__dict__.setdefault("_unpack_positions", weakref.WeakKeyDictionary())
        if unwrapped not in cache:
            cache[unwrapped] = sequence_positions_of(unwrapped)
        positions = cache[unwrapped]
        if positions is None:
            return f"{type(unwrapped).__name__} takes no multi-axis positions to number its image prompts with"
        return positions


class _ImageInputs:
    """TRL's vision inputs of one log-prob forward (``(R, L)`` rows), laid out per packed chunk
    ([`unpack_trainer.trainers.image_prompts`])."""

    def __init__(self, vision: dict[str, Any], ids: torch.Tensor, mask: torch.Tensor, logits_to_keep: int,
                 sharing: bool) -> None:  # fmt: skip
        self.pixel_values = vision.get("pixel_values")
        grid = vision.get("image_grid_thw")
        self.grid = None if grid is None else grid.detach().cpu()
        types = vision.get("mm_token_type_ids")
        self.types = None if types is None else types.detach().cpu()
        rows = ids.shape[0]
        counts = vision.get("num_images") or [0] * rows
        self.rows = row_images(self.grid if self.grid is not None else torch.zeros(0, 3, dtype=torch.int64), counts)
        self.ids, self.mask, self.logits_to_keep = ids, mask, logits_to_keep
        self.keys = None
        if sharing and self.pixel_values is not None:
            num_prompt = ids.shape[1] - logits_to_keep
            lengths = mask[:, :num_prompt].sum(1).tolist()
            prompts = [tuple(row[num_prompt - n : num_prompt]) for row, n in zip(ids.tolist(), lengths)]
            self.keys = image_keys(self.pixel_values, self.rows, prompts)

    def packed(self, batch: dict[str, torch.Tensor], start: int, end: int, positions: Any,
               device: torch.device) -> dict[str, torch.Tensor]:  # fmt: skip
        """``batch`` (rows ``start:end``, on the CPU) with its vision inputs, what the model reads on ``device``."""
        chunk_rows = type(self.rows)(
            self.rows.images[start:end], self.rows.pixels[start:end], self.rows.grids[start:end]
        )
        batch.update(
            pack_image_inputs(
                batch, self.ids[start:end], self.mask[start:end], self.logits_to_keep, rows=chunk_rows,
                pixel_values=self.pixel_values, image_grid_thw=self.grid,
                mm_token_type_ids=None if self.types is None else self.types[start:end], positions=positions,
            )
        )  # fmt: skip
        for name in ("input_ids", "labels", VIEW_INDEX_KEY, TOKEN_INDEX_KEY, MULTIMODAL_POSITIONS_KEY,
                     "mm_token_type_ids", "image_grid_thw"):  # fmt: skip
            if name in batch:
                batch[name] = batch[name].to(device, non_blocking=True)
        return batch


class GRPOTrainer(PackedCompletionsMixin, trl.GRPOTrainer):
    """Drop-in for [`trl.GRPOTrainer`]: ``from unpack_trainer import GRPOTrainer``; the arguments are TRL's.

    The training forwards run packed rows, each group's prompt once for its ``num_generations`` completions
    ([`PackedCompletionsMixin`]); generation, rewards and the loss are TRL's. The decision, switches, self-checks and
    fallbacks are those of [`BranchedTrainerMixin`] (and its core [`PackedTrainerMixin`], which documents the
    attributes). ``args`` may be any ``TrainingArguments`` (converted to our [`GRPOConfig`]).
    """

    _unpack_trl_methods = _trl_compat.ONLINE_TRAINER_METHODS
    _unpack_trl_attributes = _trl_compat.ONLINE_TRAINER_ATTRIBUTES
