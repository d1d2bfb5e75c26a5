"""GRPO and RLOO under sequence parallelism (DeepSpeed Ulysses through accelerate's ``ParallelismConfig``).

The group of ``N`` processes takes each process's batch of prompts in turn (DeepSpeed's data loader adapter copies it
whole to every process), generates on whole sequences (Ulysses left out of generation), makes the completions and
the shuffle equal on every process, and packs the same rows, each cut into ``N`` shards for the training forwards; TRL's
advantages read the gathered batch, which holds each batch once per process of the group. Two real processes on gloo:
one optimizer step == the same step in one process (the scored batch, the loss, every metric of the loss, every
parameter update), and greedy generation under Ulysses == in one process. What cannot be exact is refused at start.
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


def _script():
    sys.path.insert(0, SCRIPTS)
    try:
        import sp_grpo
    finally:
        sys.path.remove(SCRIPTS)
    return sp_grpo


@DEEPSPEED
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "name, stage, backend", [("grpo", 1, "sdpa"), ("rloo", 1, "sdpa"), ("grpo", 3, "sdpa"), ("grpo", 1, "eager")]
)
def test_one_step_at_sp_2_equals_the_step_in_one_process(tmp_path, name, stage, backend, monkeypatch):
    """GRPO (``beta=0.1``) and RLOO (``beta=0.05``) with a separate reference model, sp_size=2, ZeRO-1 (GRPO: and
    ZeRO-3, generation gathering the partitioned weights; GRPO on the eager backend too), each process with its own
    random state: the batch
    the step scored and trained on is the same on both processes; scored in one process from the same completions it
    is the same (advantages, reference log-probs); the logged loss and every parameter update == one process's step on
    it; greedy generation under Ulysses == in one process."""
    sp_grpo = _script()
    result = _torchrun("sp_grpo.py", tmp_path, name, str(stage), env={"UNPACK_ATTENTION_BACKEND": backend})
    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", backend)  # the one-process step on the same backend
    assert "sequence parallelism (sp_size=2" in result["reason"]
    forwards = result["forwards"]  # the reference's, the policy's (RLOO: and the old policy's), all packed
    assert forwards["padded"] == 0 and forwards["packed"] == {"grpo": 2, "rloo": 3}[name]
    step = torch.load(tmp_path / "step.pt", weights_only=False)
    for ours, theirs in zip(step["copies"][0], step["copies"][1]):
        for key, value in ours.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, msg=key)

    tokenizer = char_tokenizer()
    trainer_class, _ = sp_grpo.TRAINERS[name]
    trainer = trainer_class(
        model=str(tmp_path / "model"),
        reward_funcs=sp_grpo.count_a,
        args=sp_grpo.config(name, str(tmp_path / "one")),
        train_dataset=__import__("datasets").Dataset.from_dict({"prompt": sp_grpo.PROMPTS}),
        processing_class=tokenizer,
    )
    trainer._generate = lambda prompts: step["generated"]
    trainer.model.train()
    scored = trainer._generate_and_score_completions(step["examples"])
    # TRL's table of the step's prompts, completions, rewards and advantages (log_completions=True) holds each once
    assert result["completions"] == sp_grpo.logged_table(trainer)
    # GRPO's token count is gathered over every process, the group's batch once per process (its loss divides it
    # back by the process count)
    items = {"num_items_in_batch": scored["num_items_in_batch"]} if name == "grpo" else {}
    if items:
        assert int(step["scored"].pop("num_items_in_batch")) == 2 * int(items["num_items_in_batch"])
    for key, value in step["scored"].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(scored[key], value, rtol=1e-5, atol=1e-6, msg=key)
    model = trainer.model
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before a step
    loss = trainer.compute_loss(model, step["inputs"] | items)
    loss.backward()
    logged = result["logged"]
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    prompt_ids, completion_ids = step["generated"][:2]
    assert logged["num_tokens"] == sum(map(len, prompt_ids)) + sum(map(len, completion_ids))  # counted once
    for key in ("reward", "reward_std", f"rewards/{sp_grpo.count_a.__name__}/std", "kl", "entropy"):
        if key in logged:
            assert logged[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    assert_sgd_step(result, model)

    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            parameter.copy_(torch.tensor(result["parameters"][parameter_name]))
    trainer.generation_config.do_sample = False
    del trainer._generate  # TRL's generation (ours) again
    greedy = trainer._generate(step["prompts"])[1]
    assert result["greedy"] == [list(ids) for ids in greedy]
    evaluation = trainer.evaluate(
        eval_dataset=__import__("datasets").Dataset.from_dict({"prompt": sp_grpo.PROMPTS[:4]})
    )
    # (each process evaluates its own batch, as under data parallelism: TRL's eval loss and standard deviations are
    # then the processes' joint ones, one process logs a mean of its batches'; means over equal batches compare)
    for key in ("eval_reward", "eval_completions/mean_length"):
        assert result["evaluation"][key] == pytest.approx(evaluation[key], rel=1e-5, abs=1e-6), key


# ------------------------------------------------------------------------------------------------ refused at start


def _trainer(name: str, tmp_path, **changes):
    from datasets import Dataset

    sp_grpo = _script()
    tokenizer = char_tokenizer()
    trainer_class, config_class = sp_grpo.TRAINERS[name]
    args = sp_grpo.config(name, str(tmp_path), **({"beta": 0.0} | changes))
    return trainer_class(
        model=sp_grpo.model(tokenizer),
        reward_funcs=sp_grpo.count_a,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": sp_grpo.PROMPTS}),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize(
    "name, change, expected",
    [
        ("grpo", {"steps_per_generation": 2}, "steps_per_generation=2 and num_iterations=1"),
        ("rloo", {"num_iterations": 2}, "steps_per_generation=1 and num_iterations=2"),
        ("grpo", {"after": {"per_device_train_batch_size": 1}}, "per_device_train_batch_size=1 and num_generations=2"),
        ("grpo", {"scale_rewards": "batch"}, "scale_rewards='batch'"),
        ("grpo", {"multi_objective_aggregation": "normalize_then_sum"}, "normalize_then_sum"),
        ("grpo", {"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5"),
        ("rloo", {"normalize_advantages": True}, "normalize_advantages=True"),
        ("grpo", {"after": {"use_transformers_continuous_batching": True}}, "use_transformers_continuous_batching"),
        ("grpo", {"handler": {"sp_disable_in_eval": False}}, "sp_disable_in_eval=False"),
    ],
)
def test_a_run_that_cannot_stay_exact_under_ulysses_is_refused_with_its_reason(name, change, expected, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """What the trainer checks once the accelerator exists (one process here: its parallelism config stubbed): the
    automatic padding-free cannot fall back to TRL's padded forwards either (Ulysses would cut them as one row)."""
    from unpack_trainer.trainers import sequence_parallel

    handler, after = change.pop("handler", {}), change.pop("after", {})
    trainer = _trainer(name, tmp_path, **change)
    for field, value in after.items():  # what two processes allow (one batch of 1 prompt each, a group across them)
        setattr(trainer.args, field, value)
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(**handler), raising=False)
    with pytest.raises(ValueError, match=r"cannot train padded under sequence parallelism \(sp_size=2\)") as raised:
        sequence_parallel.check_parallelism(trainer)
    assert expected in str(raised.value)


def test_a_run_that_can_stay_exact_under_ulysses_cuts_its_rows(tmp_path, monkeypatch):
    from unpack_trainer.trainers import sequence_parallel

    trainer = _trainer("grpo", tmp_path)
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(), raising=False)
    sequence_parallel.check_parallelism(trainer)
    assert trainer.unpack_run.sequence_shards == 2
    assert "sequence parallelism (sp_size=2, DeepSpeed Ulysses)" in trainer.unpack_decision.reason


@pytest.mark.parametrize("config_name", ["GRPOConfig", "RLOOConfig"])
def test_the_online_configs_take_ulysses_and_leave_torch_cp_and_unpack_disable_to_trl(config_name, tmp_path,
                                                                                     monkeypatch):  # fmt: skip
    """TRL's configs refuse any sequence-dim parallelism; ours take ``sp_size`` (the trainer cuts its rows), and keep
    TRL's refusal for ``cp_size`` and under ``UNPACK_DISABLE=1`` (then TRL's trainer runs)."""
    import unpack_trainer

    config_class = getattr(unpack_trainer, config_name)
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert_config_takes_ulysses_only(config_class, monkeypatch, **common)
    # steps_per_generation: 1 where unset (each process's batch generated for in its own step), a value set kept
    accumulating = dict(common, gradient_accumulation_steps=4, parallelism_config=_ulysses())
    assert config_class(**accumulating).steps_per_generation == 1
    assert config_class(**accumulating, steps_per_generation=4).steps_per_generation == 4
    assert config_class(**common, gradient_accumulation_steps=4).steps_per_generation == 4  # TRL's without Ulysses


@DEEPSPEED
@pytest.mark.timeout(420)
def test_one_reward_step_at_sp_2_equals_the_step_in_one_process(tmp_path):
    """A reward model (a tiny Llama sequence classifier), two pairs with a margin per batch, sp_size=2, ZeRO-1: each
    process runs its half of the packed row (each pair's shared start once, chosen and rejected as branches), the
    head's per-token scores gathered before each sequence's is read; the logged loss and metrics and every parameter
    update == the same batch's step in one process."""
    from datasets import Dataset

    from unpack_trainer import RewardTrainer
    from unpack_trainer.packed_seq_info import INFO_KEY, PackedSeqInfo

    result = _torchrun("sp_reward.py", tmp_path)
    assert "sequence parallelism (sp_size=2" in result["reason"]
    sys.path.insert(0, SCRIPTS)
    try:
        from sp_reward import config, model, rows
    finally:
        sys.path.remove(SCRIPTS)
    batch = torch.load(tmp_path / "batch.pt", weights_only=False)
    info = batch[INFO_KEY]
    assert info.sequence_shards == 2 and info.is_branched
    batch[INFO_KEY] = PackedSeqInfo(info.seq_lengths, batch_size=1, seq_len=info.seq_len, seq_parents=info.seq_parents)
    tokenizer = char_tokenizer()
    classifier = model(tokenizer)
    classifier.load_state_dict(torch.load(tmp_path / "initial.pt"), strict=False)
    trainer = RewardTrainer(
        model=classifier, args=config(str(tmp_path / "one")), train_dataset=Dataset.from_list(rows()),
        processing_class=tokenizer,
    )  # fmt: skip
    trained = trainer.model.train()
    loss = trainer.compute_loss(trained, batch)
    loss.backward()
    logged = result["logged"]
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    for key in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        if key in logged:
            assert logged[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    # TRL gathers the batch's token count over every process, each holding the group's batch: counted once
    assert logged["num_tokens"] == metrics["num_tokens"] == int(batch["attention_mask"].sum())
    assert_sgd_step(result, trained)


def test_tools_are_refused_under_ulysses(tmp_path, monkeypatch):
    """Every process of the group generates the same completions: a tool call would run once per process."""
    from unpack_trainer.trainers import sequence_parallel

    trainer = _trainer("grpo", tmp_path)
    trainer.tools = [lambda query: query]  # what TRL keeps of `tools=` (built with a chat template here)
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(), raising=False)
    with pytest.raises(ValueError, match="each tool call would run once per process"):
        sequence_parallel.check_parallelism(trainer)
