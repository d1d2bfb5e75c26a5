"""The trainers that generate inside their step (GRPO, RLOO, on-policy distillation) under sequence parallelism
(DeepSpeed Ulysses): what makes the ``N`` processes of a sequence-parallel group take one batch of prompts, generate
the same completions and count them once, as one process does.

- **The prompts** go through DeepSpeed's data loader adapter whole ([`prompts_collator`]:
  [`unpack_trainer.data.sequence_shards.prompts_ready`]), so the group takes each process's batch in turn; TRL's
  ``_prepare_inputs`` reads them back ([`prepared_in_group`]) under the group's random state ([`group_random_state`],
  drawn by the first process), so every process shuffles the generated batch alike.
- **Generation** runs on whole sequences, as one process runs it ([`generated_as_one_process`]): the packed attention
  registered again under its name in place of Ulysses' wrapper, the first process's output broadcast to the group
  ([`from_first_process`]: sampling on accelerators need not be bitwise equal across processes), and the tokens TRL
  counted over its gather of every process's lengths (each batch once per process of the group) counted once;
  TRL's table of the logged prompts and completions holds each completion once ([`completions_logged_once`]).
- **What stays refused** for the same reasons in each of them ([`generation_reason`]), and the error of a training
  forward that would run TRL's padded batch ([`padded_forward_refusal`]).

A trainer takes them through [`GeneratingGroupMixin`] (TRL's ``_enable_packed_path``, ``_prepare_inputs``,
``_generate``, ``_generate_and_score_completions`` routed here); nothing here runs outside sequence parallelism but the
LoRA path of generation (``unpack_run.peft_lora_path``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from unpack_trainer._compat import sequence_parallel_group
from unpack_trainer.data.sequence_shards import ShardReadyCollator
from unpack_trainer.models.routing import outside_wrappers
from unpack_trainer.packed_seq_info import SHARDED_BATCH_KEY

__all__ = [
    "GeneratingGroupMixin",
    "completions_logged_once",
    "from_first_process",
    "generated_as_one_process",
    "generation_reason",
    "group_random_state",
    "padded_forward_refusal",
    "prepared_in_group",
    "prompts_collator",
]


def _ulysses(shards: int) -> str:
    return f"sequence parallelism (sp_size={shards}, DeepSpeed Ulysses)"


def generation_reason(trainer: Any, shards: int) -> str | None:
    """Why ``trainer``'s generation cannot run as one process's under DeepSpeed Ulysses with ``shards`` processes per
    row, or ``None``: generation through vLLM or transformers' continuous batching (not verified there), and tools or
    environments (every process of the group generates the same completions, so each call would run once per
    process)."""
    what = _ulysses(shards)
    args = trainer.args
    if getattr(args, "use_vllm", False):
        return f"{what} with use_vllm=True: generation through vLLM is not verified there; set use_vllm=False"
    if getattr(args, "use_transformers_continuous_batching", False):
        return (
            f"{what} with use_transformers_continuous_batching=True: its paged attention is not verified outside "
            "Ulysses' wrapper; set use_transformers_continuous_batching=False"
        )
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        return (
            f"{what} with tools or environments: every process of the group generates the same completions, so "
            "each tool call would run once per process (the first process's results kept)"
        )
    return None


def prompts_collator(trainer: Any, collator: Any) -> Any:
    """``collator`` (TRL's, which hands the examples on as they are), its batches made ready for DeepSpeed's adapter
    as prompts copied whole to the group ([`unpack_trainer.data.sequence_shards.ShardReadyCollator`] with
    ``prompts=True``) where ``trainer`` packs under sequence parallelism; else ``collator`` unchanged."""
    shards = trainer.unpack_run.sequence_shards
    if not trainer.unpack_decision.packed or shards == 1:
        return collator
    return ShardReadyCollator(collator, shards, prompts=True)


def prepared_in_group(trainer: Any, prepare: Callable[[Any], Any], generation_batch: Any) -> Any:
    """``prepare`` (TRL's ``_prepare_inputs``) on ``generation_batch``, the prompts read back from a batch that went
    through DeepSpeed's adapter ([`prompts_collator`]); in a training step under sequence parallelism with the group's
    random state ([`group_random_state`]), so that every process shuffles the generated batch alike
    ([`generated_as_one_process`] makes the completions equal)."""
    if isinstance(generation_batch, dict) and SHARDED_BATCH_KEY in generation_batch:
        generation_batch = generation_batch[SHARDED_BATCH_KEY]
    if trainer.unpack_run.sequence_shards == 1 or not trainer.model.training:
        return prepare(generation_batch)
    with group_random_state(sequence_parallel_group(), trainer.accelerator.device):
        return prepare(generation_batch)


def generated_as_one_process(trainer: Any, generate: Callable[[list], Any], prompts: list) -> Any:
    """``generate(prompts)`` (TRL's ``_generate``: token ids and tensors, with its metrics), with PEFT's own LoRA path
    (the step's cast skip paused: [`unpack_trainer.trainers._packed.PackedTrainerMixin.training_step`]). Under
    sequence parallelism each process generates on whole sequences, as one process does, with the packed attention
    registered again under its name in place of Ulysses' wrapper around it
    ([`unpack_trainer.models.routing.outside_wrappers`]: the wrapper would cut the sequences in a training step, and
    drops a padded batch's mask even in evaluation, where it leaves them whole). In a training step every process of
    the group holds the same prompts: the first process's output is then every process's, and the tokens TRL counted
    once per process of the group (``num_input_tokens_seen``, the ``num_tokens`` metric) are counted once."""
    shards = trainer.unpack_run.sequence_shards
    with trainer.unpack_run.peft_lora_path():
        if shards == 1:
            return generate(prompts)
        if not trainer.model.training:  # evaluation: each process generates for its own batch
            with outside_wrappers():
                return generate(prompts)
        seen = trainer.state.num_input_tokens_seen
        with outside_wrappers():
            generated = generate(prompts)
        generated = from_first_process(generated, sequence_parallel_group())
    # TRL gathered the prompt and completion lengths of every process: each of the group's once per process
    trainer.state.num_input_tokens_seen = seen + (trainer.state.num_input_tokens_seen - seen) // shards
    trainer._metrics["train"]["num_tokens"] = [trainer.state.num_input_tokens_seen]
    return generated


def completions_logged_once(trainer: Any, score: Callable[[list], Any], inputs: list) -> Any:
    """``score(inputs)`` (TRL's ``_generate_and_score_completions`` of GRPO, RLOO or distillation, on this process's
    ``inputs``: a list of examples, one completion each), with TRL's table of logged completions
    (``log_completions=True``: ``trainer._logs``, deques of one entry per example of every process appended in process
    order -- prompts, completions, advantages, images -- and dicts of such deques per reward function and extra
    column) holding each of the step's entries once. In a training step under sequence parallelism every process of
    a group generated the same completions for the same prompts, so TRL's gathers hold each once per process of the
    group: only the entries of each group's first process are kept (the counts and the first processes known from one
    gather of two int64 per process)."""
    shards = trainer.unpack_run.sequence_shards
    if shards == 1 or not trainer.model.training or not getattr(trainer, "log_completions", False):
        return score(inputs)
    scored = score(inputs)
    first = torch.distributed.get_rank(sequence_parallel_group()) == 0
    local = torch.tensor([[len(inputs), int(first)]], dtype=torch.int64, device=trainer.accelerator.device)
    processes = trainer.accelerator.gather(local).tolist()  # (processes, 2): each one's count, whether it is first
    added = sum(count for count, _ in processes)
    columns = [
        column
        for logged in trainer._logs.values()
        for column in (logged.values() if isinstance(logged, dict) else (logged,))
        if isinstance(column, collections.deque) and len(column) >= added
    ]
    for column in columns:
        entries = list(column)
        kept, start = entries[: len(entries) - added], len(entries) - added
        for count, is_first in processes:
            if is_first:
                kept.extend(entries[start : start + count])
            start += count
        column.clear()
        column.extend(kept)
    return scored


class GeneratingGroupMixin:
    """The four TRL methods a trainer that generates in its step (GRPO, RLOO, on-policy distillation) routes through
    this module: put before the packed-trainer core in its bases, each calls TRL's (``super()``) as one process of a
    sequence-parallel group must (and, outside sequence parallelism, exactly as TRL's but for PEFT's LoRA path of
    generation). A trainer that needs more in one of them overrides it and calls ``super()``."""

    def _enable_packed_path(self) -> None:
        """The core's; under sequence parallelism the batches of prompts then go through DeepSpeed's adapter whole
        ([`prompts_collator`])."""
        super()._enable_packed_path()
        self.data_collator = prompts_collator(self, self.data_collator)

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's, on the prompts of a batch that went through DeepSpeed's adapter; in a training step under sequence
        parallelism with the group's random state, so that every process shuffles the generated batch alike
        ([`prepared_in_group`])."""
        return prepared_in_group(self, super()._prepare_inputs, generation_batch)

    def _generate(self, prompts: list) -> Any:
        """TRL's generation, with PEFT's own LoRA path; under sequence parallelism on whole sequences, the first
        process's completions every process's and the tokens counted once ([`generated_as_one_process`])."""
        return generated_as_one_process(self, super()._generate, prompts)

    def _generate_and_score_completions(self, inputs: list) -> Any:
        """TRL's (this process's batch of examples -> the generated and scored batch); under sequence parallelism its
        table of logged completions holds each once ([`completions_logged_once`])."""
        return completions_logged_once(self, super()._generate_and_score_completions, inputs)


def padded_forward_refusal(name: str, shards: int, reason: str) -> ValueError:
    """The error of a training forward of trainer ``name`` under sequence parallelism that would run TRL's padded
    batch (``reason``: why it is not packed), which DeepSpeed Ulysses would cut as one row."""
    return ValueError(
        f"{name}: a training forward under sequence parallelism (sp_size={shards}) cannot run TRL's padded batch, "
        f"which DeepSpeed Ulysses would cut as one row: {reason}."
    )


def from_first_process(value: Any, group: Any) -> Any:
    """``value`` of the first process of ``group`` (a torch.distributed process group), on every process of it
    (pickled: TRL's generation output, lists of token ids and tensors)."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_global_rank(group, 0), group=group)
    return box[0]


@contextlib.contextmanager
def group_random_state(group: Any, device: torch.device) -> Iterator[None]:
    """torch's random state seeded alike on every process of ``group`` (with a seed the first process draws from its
    own state: one int64 broadcast), the processes' own states restored afterwards."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
    torch.distributed.broadcast(seed, src=torch.distributed.get_global_rank(group, 0), group=group)
    devices = [device] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(int(seed))
        yield
