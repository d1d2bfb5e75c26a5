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
entropies come back in TRL's ``(rows, completion)`` layout, zero where TRL's are. On a vision-language model an image
prompt is shared the same way: each group's vision inputs go to the model once, in every layout TRL's forward cuts
(Qwen2-VL's ``image_grid_thw``, one entry per image as LLaVA's and Gemma 3's, one per row as Idefics3's, tiles), and
every token keeps the positions its full sequence has alone (a multi-axis text model's from its own
``get_rope_index``) ([`unpack_trainer.trainers.image_prompts`]). A batch whose vision inputs are of no known layout,
or not in TRL's layout, runs as TRL runs it (logged once with the reason).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import trl

from unpack_trainer import _trl_compat
from unpack_trainer._logging import log_once
from unpack_trainer.configs import GRPOConfig
from unpack_trainer.data.sequence_shards import padded_for_shards
from unpack_trainer.models.routing import outside_wrappers
from unpack_trainer.packed_seq_info import (
    MULTIMODAL_POSITIONS_KEY,
    TOKEN_INDEX_KEY,
    VIEW_INDEX_KEY,
)
from unpack_trainer.trainers.branched import BranchedTrainerMixin, pack_completions, whole_in_evaluation_reason
from unpack_trainer.trainers.generation_groups import GeneratingGroupMixin, generation_reason, padded_forward_refusal
from unpack_trainer.trainers.image_prompts import PER_TOKEN_INPUTS, image_keys, pack_image_inputs, row_slices

__all__ = ["GRPOTrainer", "PackedCompletionsMixin"]

logger = logging.getLogger("unpack_trainer")

# A forward runs TRL's padded batch instead when the packed row would hold more than this share of its tokens: there
# packing saves too little to pay for its per-sample attention (the benchmark's uniform lengths, short prompts).
PACKED_TOKEN_SHARE = 0.9


class PackedCompletionsMixin(GeneratingGroupMixin, BranchedTrainerMixin):
    """The packed-trainer core for TRL's online trainers with groups of completions (GRPO, RLOO): the training
    forwards run packed rows, each distinct prompt once (see the module docstring). The trainer packs inside its step
    (``unpack_packs_in = "step"``): TRL's collator and data are untouched, so the padded fallback only unpatches.

    The branched self-check probes a prompt with ``num_generations`` completions.
    """

    unpack_packs_in = "step"
    unpack_packs_vision = True  # image prompts: each group's images once (trainers.image_prompts)
    unpack_sequence_parallel = True  # prompts copied to the group, each packed row padded and cut in the step
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
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int,
        fixed: bool,
        prompts: list[tuple[int, ...]] | None,
        always: bool = False,
    ) -> list[tuple[int, int]] | str:
        """Row ranges ``[start, end)`` to pack one at a time, or why TRL's padded batch runs instead (``input_ids``
        and ``attention_mask`` on the CPU; ``prompts``: each row's [`_prompt_ids`] where the trainer shares prompts,
        ``None`` where it does not).

        ``fixed``: TRL's own chunks of ``batch_size`` rows (the MoE auxiliary loss is TRL's mean over them). Otherwise
        consecutive rows while the packed row stays within the padded tokens of one of TRL's chunks (``batch_size *
        L``), so memory stays within TRL's and a group split by TRL's chunks shares its prompt. TRL's batch runs when
        the packed rows would hold more than [`PACKED_TOKEN_SHARE`] of its tokens, unless ``always`` (under sequence
        parallelism, where TRL's batch cannot run).
        """
        rows, width = input_ids.shape
        mask = attention_mask.bool()
        num_prompt = width - logits_to_keep
        prompt_lengths = mask[:, :num_prompt].sum(1).tolist()
        completion_lengths = mask[:, num_prompt:].sum(1).tolist()
        sharing = prompts is not None
        budget = batch_size * width
        chunks: list[tuple[int, int]] = []
        start, used, seen, total = 0, 0, set(), 0
        for row in range(rows):
            key = prompts[row] if sharing else None
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
        if not always and total > PACKED_TOKEN_SHARE * rows * width:
            return f"the packed rows would hold {total / (rows * width):.0%} of the padded batch's tokens"
        return chunks

    # ------------------------------------------------------------------------------------------------ sequence parallel

    def _sequence_parallel_reason(self, config: Any, shards: int) -> str | None:
        """Why this run cannot train exactly under DeepSpeed Ulysses with ``shards`` processes per row, or ``None``.

        The adapter hands the group each process's batch of prompts in turn (every process of the group generates
        the same completions, see [`unpack_trainer.trainers.generation_groups.GeneratingGroupMixin`], and packs the
        same rows, each cut into ``shards``), so each batch must hold whole groups of completions and be generated for
        in its own step; and TRL's statistics over the gathered batch must not change when each batch is in it once per
        process of the group (means, per-group statistics, sums divided by the process count do not; a batch-wide
        standard deviation or quantile does)."""
        what = f"sequence parallelism (sp_size={shards}, DeepSpeed Ulysses)"
        args = self.args
        reason = generation_reason(self, shards)
        if reason is not None:
            return reason
        every = (args.steps_per_generation, getattr(self, "num_iterations", 1))
        if every != (1, 1):
            return (
                f"{what} with steps_per_generation={every[0]} and num_iterations={every[1]}: DeepSpeed's data loader "
                "hands the group each process's batch of prompts in turn, where TRL generates for one batch and "
                "trains on it for steps_per_generation * num_iterations steps (the other processes' prompts would be "
                "skipped); set steps_per_generation=1 and num_iterations=1 (gradient accumulation still accumulates)"
            )
        if args.per_device_train_batch_size % self.num_generations:
            return (
                f"{what} with per_device_train_batch_size={args.per_device_train_batch_size} and "
                f"num_generations={self.num_generations}: the group trains on one process's batch at a time, so each "
                "batch must hold whole groups of completions (TRL's advantages are computed per group); set "
                "per_device_train_batch_size to a multiple of num_generations"
            )
        batch_wide = {
            "scale_rewards='batch'": getattr(self, "scale_rewards", None) == "batch",
            "multi_objective_aggregation='normalize_then_sum'": getattr(self, "multi_objective_aggregation", None)
            == "normalize_then_sum",
            "normalize_advantages=True": bool(getattr(self, "normalize_advantages", False)),
            f"top_entropy_quantile={getattr(self, 'top_entropy_quantile', 1.0)}": getattr(
                self, "top_entropy_quantile", 1.0
            )
            < 1.0,
        }
        for name, chosen in batch_wide.items():
            if chosen:
                return (
                    f"{what} with {name}: TRL takes a batch-wide standard deviation or quantile over its gather of "
                    "every process's batch, which holds each batch once per process of the group (its value would "
                    "change); use the per-group statistics (scale_rewards='group', the default)"
                )
        return whole_in_evaluation_reason(config, shards)

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        """TRL's; under sequence parallelism (a training step) the batch-wide standard deviations TRL logs
        (``reward_std``, ``rewards/<function>/std``), taken over its gather of every process's rewards, which holds
        each batch once per process of the group, are logged as over each batch once (exact: the same values with
        Bessel's correction for their true count, [`_unduplicated_std`]); its table of logged completions holds each
        once ([`unpack_trainer.trainers.generation_groups.GeneratingGroupMixin`])."""
        shards = self.unpack_run.sequence_shards
        if shards == 1 or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        gathered = []
        calculate = self._calculate_rewards
        own = self.__dict__.get("_calculate_rewards")  # one set on this trainer (a test's), put back afterwards

        def capturing(*args: Any, **kwargs: Any) -> torch.Tensor:
            gathered.append(calculate(*args, **kwargs))
            return gathered[-1]

        self._calculate_rewards = capturing  # this call only: the instance attribute shadows the method
        try:
            scored = super()._generate_and_score_completions(inputs)  # its completions logged once
        finally:
            if own is None:
                del self._calculate_rewards
            else:
                self._calculate_rewards = own
        rewards_per_func = gathered[-1]
        metrics = self._metrics["train"]
        for column, function in enumerate(self.reward_func_names):
            key = f"rewards/{function}/std"
            metrics[key][-1] = _unduplicated_std(metrics[key][-1], rewards_per_func[:, column], shards)
        scorable = ~torch.isnan(rewards_per_func).all(dim=1)
        metrics["reward_std"][-1] = _unduplicated_std(metrics["reward_std"][-1], scorable, shards)
        return scored

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """TRL's loss; under sequence parallelism every process of the group computed it from the same whole rows
        (the model's packed view gathers the shards' hidden states), so each back-propagates its share
        ([`unpack_trainer.trainers.branched.BranchedTrainerMixin._sequence_parallel_share`])."""
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        return self._sequence_parallel_share(model, result, return_outputs, self.unpack_run.sequence_shards)

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
        docstring); ``kwargs`` are TRL's vision inputs (``pixel_values``, ``image_grid_thw``, ``num_images``,
        per-token ``mm_token_type_ids`` / ``token_type_ids``, ...), laid out per prompt segment
        (:mod:`unpack_trainer.trainers.image_prompts`). TRL's own code runs when the trainer is not packing, or for a
        batch that is not in TRL's layout, whose vision inputs fit no known layout, or that packing would barely
        shrink (each logged once)."""

        def stock() -> Any:
            # Under sequence parallelism (an evaluation forward: a training one never runs TRL's batch) outside
            # Ulysses' wrapper, which drops the padded batch's mask even where it leaves it whole
            outside = outside_wrappers() if self.unpack_run.sequence_shards > 1 else contextlib.nullcontext()
            with outside:
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
        # Under sequence parallelism a training forward is cut into the group's shards: it must run packed rows.
        shards = self.unpack_run.sequence_shards if model.training else 1

        def padded(reason: str, level: int) -> Any:
            if shards > 1:
                raise padded_forward_refusal(self.unpack_name, shards, reason)
            log_once(logger, level, f"{self.unpack_name}: a forward ran TRL's padded batch: {reason}")
            self._unpack_count_forward("padded")
            return stock()

        vision = {name: value for name, value in kwargs.items() if value is not None}
        batch_size = batch_size or input_ids.size(0)
        ids, mask = input_ids.detach().cpu(), attention_mask.detach().cpu()  # one copy to the host per forward
        sharing = self._unpack_sharing()
        prompts = _prompt_ids(ids, mask, logits_to_keep) if sharing else None
        chunks = self._unpack_chunks(
            ids, mask, logits_to_keep, batch_size, fixed=compute_aux_loss, prompts=prompts, always=shards > 1
        )
        if isinstance(chunks, str):
            return padded(chunks, logging.INFO)
        images = _ImageInputs(vision, ids, mask, logits_to_keep, prompts) if vision else None
        if images is not None and images.problem is not None:
            return padded(images.problem, logging.WARNING)
        if images is not None and shards > 1:
            return padded("image prompts are not cut into shards", logging.WARNING)
        positions = self._unpack_sequence_positions(model) if images is not None else None
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
                return padded(batch, logging.WARNING)
            batch = batch[0]
            if images is not None:
                batch = images.packed(batch, start, end, positions, input_ids.device)
            if shards > 1:  # the row padded to a multiple of the shards, its metadata marked for the cut
                batch = padded_for_shards(batch, shards)
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


def _prompt_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> list[tuple[int, ...]]:
    """Each row's prompt: its real token ids before the ``logits_to_keep`` completion columns (``(R, L)`` on the CPU,
    prompts left-padded), one hashable per row (rows of one group have equal ones)."""
    num_prompt = input_ids.shape[1] - logits_to_keep
    lengths = attention_mask[:, :num_prompt].sum(1).tolist()
    return [tuple(row[num_prompt - n :]) for row, n in zip(input_ids[:, :num_prompt].tolist(), lengths)]


class _ImageInputs:
    """TRL's vision inputs of one log-prob forward (``(R, L)`` rows), laid out per packed chunk
    ([`unpack_trainer.trainers.image_prompts`]); ``problem`` says why they cannot be (then TRL's batch runs)."""

    def __init__(self, vision: dict[str, Any], ids: torch.Tensor, mask: torch.Tensor, logits_to_keep: int,
                 prompts: list[tuple[int, ...]] | None) -> None:  # fmt: skip
        """``prompts``: each row's ``_prompt_ids`` when prompts are shared, else ``None``."""
        self.per_token = {
            name: vision[name].detach().cpu() for name in PER_TOKEN_INPUTS if vision.get(name) is not None
        }
        self.vision = {name: value for name, value in vision.items() if name not in self.per_token}
        if self.vision.get("image_grid_thw") is not None:  # read on the host (sizes, get_rope_index)
            self.vision["image_grid_thw"] = self.vision["image_grid_thw"].detach().cpu()
        slices = row_slices(self.vision, ids.shape[0])
        self.problem = slices if isinstance(slices, str) else None
        self.slices = None if isinstance(slices, str) else slices
        self.ids, self.mask, self.logits_to_keep = ids, mask, logits_to_keep
        self.keys = None
        if prompts is not None and self.slices is not None and self.slices.slices:
            self.keys = image_keys(self.vision, self.slices, prompts)

    def packed(self, batch: dict[str, torch.Tensor], start: int, end: int, positions: Any,
               device: torch.device) -> dict[str, torch.Tensor]:  # fmt: skip
        """``batch`` (rows ``start:end``, on the CPU) with its vision inputs, what the model reads on ``device``."""
        batch.update(
            pack_image_inputs(
                batch, self.ids[start:end], self.mask[start:end], self.logits_to_keep, vision=self.vision,
                slices=self.slices.rows(start, end),
                per_token={name: value[start:end] for name, value in self.per_token.items()}, positions=positions,
            )
        )  # fmt: skip
        model_inputs = ("input_ids", "labels", VIEW_INDEX_KEY, TOKEN_INDEX_KEY, MULTIMODAL_POSITIONS_KEY,
                        *self.per_token, *self.slices.slices)  # fmt: skip
        for name in model_inputs:
            if name in batch:
                batch[name] = batch[name].to(device, non_blocking=True)
        return batch


def _unduplicated_std(value: float, values: torch.Tensor, copies: int) -> float:
    """A standard deviation with Bessel's correction (TRL's ``nanstd``) taken over ``copies`` copies of a set of
    numbers, ``value``, as over one: ``values`` (1-D: the copied numbers, NaN where TRL skips one, or a ``bool`` mask
    of the numbers kept) gives the count ``n`` of each copy; the sum of squared deviations is ``copies`` times
    one copy's, so the variance scales by ``(copies * n - 1) / (copies * (n - 1))`` (NaN for ``n <= 1``, as TRL's)."""
    kept = values if values.dtype == torch.bool else ~torch.isnan(values)
    count = int(kept.sum()) // copies
    if count <= 1:
        return float("nan")
    return value * ((copies * count - 1) / (copies * (count - 1))) ** 0.5


class GRPOTrainer(PackedCompletionsMixin, trl.GRPOTrainer):
    """Drop-in for [`trl.GRPOTrainer`]: ``from unpack_trainer import GRPOTrainer``; the arguments are TRL's.

    The training forwards run packed rows, each group's prompt once for its ``num_generations`` completions
    ([`PackedCompletionsMixin`]); generation, rewards and the loss are TRL's. The decision, switches, self-checks and
    fallbacks are those of [`BranchedTrainerMixin`] (and its core [`PackedTrainerMixin`], which documents the
    attributes). ``args`` may be any ``TrainingArguments`` (converted to our [`GRPOConfig`]).
    """

    unpack_config_class = GRPOConfig
    unpack_trl_methods = _trl_compat.ONLINE_TRAINER_METHODS
    unpack_trl_attributes = _trl_compat.ONLINE_TRAINER_ATTRIBUTES
