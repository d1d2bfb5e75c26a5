"""On-policy distillation under sequence parallelism (DeepSpeed Ulysses through accelerate's ``ParallelismConfig``).

The group of ``N`` processes takes each process's batch of prompts in turn (DeepSpeed's data loader adapter copies it
whole to every process), generates on whole sequences under the group's random state (the first process's completions
kept), and packs the same micro-batch into one row: the student (training mode) runs its shard of the row, the hidden
states gathered for TRL's loss; the teacher (evaluation mode, which Ulysses leaves whole) runs the whole row on every
process. Two real processes on gloo: one optimizer step == the same step in one process (the scored batch, the loss,
every logged metric, every parameter update), with a teacher of the student's family and of another one; greedy
generation and evaluation under Ulysses == in one process. What cannot be exact is refused at start.
"""

import sys

import pytest
import torch
from test_sequence_parallel import (
    DEEPSPEED,
    SCRIPTS,
    _torchrun,
    _ulysses,
    assert_config_takes_ulysses_only,
    assert_sgd_step,
)

from unpack_trainer.model_zoo.tiny import char_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _script():
    sys.path.insert(0, SCRIPTS)
    try:
        import sp_distillation
    finally:
        sys.path.remove(SCRIPTS)
    return sp_distillation


def _trainer(tmp_path, family: str = "llama", **changes):
    from datasets import Dataset

    from unpack_trainer import DistillationTrainer

    script = _script()
    tokenizer = char_tokenizer()
    return DistillationTrainer(
        model=script.model(tokenizer),
        teacher_model=script.teacher(tokenizer, family),
        args=script.config(str(tmp_path / "one"), **changes),
        train_dataset=Dataset.from_dict({"prompt": script.PROMPTS}),
        processing_class=tokenizer,
    )


@DEEPSPEED
@pytest.mark.timeout(420)
@pytest.mark.parametrize("family, stage", [("llama", 1), ("qwen2", 1), ("qwen2-padded", 1), ("llama", 3)])
def test_one_step_at_sp_2_equals_the_step_in_one_process(tmp_path, family, stage, monkeypatch):
    """sp_size=2, ZeRO-1 (and ZeRO-3: the student's and the teacher's weights partitioned), ``beta=0.5``, each
    process with its own random state, a teacher of the student's family, of another one, or one the patch refuses
    (TRL's padded forward, whole, under Ulysses' wrapper, which would drop its mask): the micro-batch the step scored
    and trained on is the same on both processes; scored in one process from the same completions it is the same;
    the logged loss, every logged metric (``entropy``, ``num_tokens``, ``completions/*``), TRL's table of logged
    completions and every parameter update == one process's step on it; greedy generation and evaluation under
    Ulysses == in one process."""
    from datasets import Dataset

    from unpack_trainer.models import refusals

    script = _script()
    result = _torchrun("sp_distillation.py", tmp_path, family, str(stage))
    assert "sequence parallelism (sp_size=2" in result["reason"]
    padded = int(family.endswith("-padded"))  # the student's and the teacher's forwards, on one packed row
    assert result["forwards"] == {"packed": 2 - padded, "padded": padded}
    refused = {}
    script.refuse_padded_teacher(family, refused)
    for model_type, why in refused.items():
        monkeypatch.setitem(refusals.BLOCKLIST, model_type, why)
    step = torch.load(tmp_path / "step.pt", weights_only=False)
    for ours, theirs in zip(step["copies"][0], step["copies"][1]):
        for key, value in ours.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, msg=key)

    trainer = _trainer(tmp_path, family)
    assert (trainer.unpack_teacher_reason is not None) == bool(padded)
    completion_ids = step["generated"][1]
    trainer._generate_single_turn = lambda *args, **kwargs: [list(ids) for ids in completion_ids]
    trainer.model.train()
    scored = trainer._generate_and_score_completions(step["examples"])
    # TRL's table of the step's prompts and completions (log_completions=True) holds each once, as in one process
    assert result["completions"] == {key: list(values) for key, values in trainer._logs.items()}
    # TRL's token count is gathered over every process, the group's batch once per process (its loss divides it back
    # by the process count)
    assert int(step["scored"].pop("num_items_in_batch")) == 2 * int(scored["num_items_in_batch"])
    for key, value in step["scored"].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(scored[key], value, rtol=0, atol=0, msg=key)
    model = trainer.model
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before a step
    loss = trainer.compute_loss(model, step["inputs"] | {"num_items_in_batch": scored["num_items_in_batch"]})
    loss.backward()
    logged = result["logged"]
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    prompt_ids = step["generated"][0]
    assert metrics["num_tokens"] == sum(map(len, prompt_ids)) + sum(map(len, completion_ids))
    assert {"entropy", "num_tokens", "completions/mean_length", "completions/clipped_ratio"} <= set(metrics)
    for key, value in metrics.items():
        assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert_sgd_step(result, model)

    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            parameter.copy_(torch.tensor(result["parameters"][parameter_name]))
    trainer.generation_config.do_sample = False
    del trainer._generate_single_turn  # TRL's generation again
    greedy = trainer._generate(step["prompts"])[1]
    assert result["greedy"] == [list(ids) for ids in greedy]
    if stage == 3:  # (not evaluated under ZeRO-3, see the script)
        assert result["evaluation"] is None
        return
    # Each process evaluates its own batch of 2 prompts whole, as under data parallelism; TRL's metrics are over the
    # gather of both, in one process one batch of the 4 prompts
    trainer.args.per_device_eval_batch_size = 4
    evaluation = trainer.evaluate(eval_dataset=Dataset.from_dict({"prompt": script.PROMPTS[:4]}))
    for key in ("eval_completions/mean_length", "eval_entropy"):
        assert result["evaluation"][key] == pytest.approx(evaluation[key], rel=1e-5, abs=1e-6), key


# ------------------------------------------------------------------------------------------------ refused at start


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
        ({"after": {"use_vllm": True}}, "use_vllm=True"),
        ({"tools": True}, "each tool call would run once per process"),
        ({"teacher": None}, "without a local teacher model"),
        ({"handler": {"sp_disable_in_eval": False}}, "sp_disable_in_eval=False: the teacher runs in evaluation mode"),
    ],
)
def test_a_run_that_cannot_stay_exact_under_ulysses_is_refused_with_its_reason(change, expected, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """What the trainer checks once the accelerator exists (one process here: its parallelism config stubbed): the
    automatic padding-free cannot fall back to TRL's padded forwards either (Ulysses would cut them as one row)."""
    from unpack_trainer.trainers import sequence_parallel

    handler, after = change.pop("handler", {}), change.pop("after", {})
    tools, teacher = change.pop("tools", False), change.pop("teacher", "kept")
    trainer = _trainer(tmp_path, **change)
    for field, value in after.items():  # set after construction (vLLM is not installed here)
        setattr(trainer.args, field, value)
    if tools:
        trainer.tools = [lambda query: query]  # what TRL keeps of `tools=` (built with a chat template here)
    if teacher is None:
        trainer.teacher_model = None  # what TRL's server distillation leaves: a teacher served over the network
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(**handler), raising=False)
    with pytest.raises(ValueError, match=r"cannot train padded under sequence parallelism \(sp_size=2\)") as raised:
        sequence_parallel.check_parallelism(trainer)
    assert expected in str(raised.value)


def test_image_prompts_are_refused_under_ulysses(tmp_path, monkeypatch):
    """A vision-language student (Qwen2.5-VL, verified under Ulysses for SFT's image rows) with image prompts: the
    packed row's vision inputs are not cut into shards in distillation, so the trainer refuses the model at start with
    the reason (as GRPO's and DPO's), before any forward."""
    from test_distillation_trainer import image_prompts

    from unpack_trainer import DistillationConfig, DistillationTrainer
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model
    from unpack_trainer.trainers import sequence_parallel

    trainer = DistillationTrainer(
        model=tiny_vision_model("qwen2_5_vl", seed=0, attn_implementation="sdpa"),
        teacher_model=tiny_vision_model("qwen2_5_vl", seed=1, attn_implementation="sdpa"),
        args=DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, use_cpu=True),
        train_dataset=image_prompts(),
        processing_class=tiny_processor("qwen2_5_vl"),
    )
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(), raising=False)
    trainer.unpack_run.sequence_shards = 2
    with pytest.raises(ValueError, match="cannot train padded under sequence parallelism.*not in this trainer"):
        sequence_parallel.refuse_model(trainer)


def test_a_run_that_can_stay_exact_under_ulysses_cuts_its_rows(tmp_path, monkeypatch):
    from unpack_trainer.data.sequence_shards import ShardReadyCollator
    from unpack_trainer.trainers import sequence_parallel

    trainer = _trainer(tmp_path)
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(), raising=False)
    sequence_parallel.check_parallelism(trainer)
    assert trainer.unpack_run.sequence_shards == 2
    assert "sequence parallelism (sp_size=2, DeepSpeed Ulysses)" in trainer.unpack_decision.reason
    trainer._enable_packed_path()
    assert isinstance(trainer.data_collator, ShardReadyCollator) and trainer.data_collator.prompts


def test_the_distillation_config_takes_ulysses_and_leaves_torch_cp_and_unpack_disable_to_trl(tmp_path, monkeypatch):
    """TRL's config refuses any sequence-dim parallelism; ours takes ``sp_size`` (the trainer cuts its rows), and keeps
    TRL's refusal for ``cp_size`` and under ``UNPACK_DISABLE=1`` (then TRL's trainer runs)."""
    from unpack_trainer import DistillationConfig

    assert_config_takes_ulysses_only(
        DistillationConfig, monkeypatch, output_dir=str(tmp_path), use_cpu=True, report_to="none"
    )
