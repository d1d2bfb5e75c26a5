"""DistillationTrainer: one optimizer step of ours == the same step of stock ``trl.DistillationTrainer`` padded (the
same completions generated, the loss, every logged metric, the student's and the teacher's hidden states at every
completion position, every gradient), the decision and its fallbacks, the layout built once for both models, and a
contamination probe.

A step generates with a tiny random student whose end-of-sequence logit is raised, so that completions end at
different lengths (right padding), from prompts of different lengths (left padding); the teacher is another tiny
model over the same character vocabulary (the same family with other weights and widths, or another family); image
prompts on tiny Qwen2.5-VL and Gemma 3 models with their processors. Bounds: fp32, relative to the largest entry of
what is compared (``RTOL``); a logged value relative to itself.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import trl
from datasets import Dataset
from transformers import TrainerCallback

from unpack_trainer import DistillationConfig, DistillationTrainer
from unpack_trainer.model_zoo import tiny
from unpack_trainer.trainers import distillation

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

RTOL = 1e-5
PROMPTS = ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvw", "xyz"]
TOKENIZER = tiny.char_tokenizer()
TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")


def prompts(values: list[str] | None = None) -> Dataset:
    return Dataset.from_dict({"prompt": list(PROMPTS if values is None else values)})


def tiny_lm(model_type: str = "llama", *, seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A tiny random causal LM over the character tokenizer whose ``</s>`` logit is raised by about 2.5 on average, so
    that sampled completions end at different lengths."""
    config = (
        dict(
            vocab_size=len(TOKENIZER),
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        | overrides
    )
    model = tiny.tiny_model(model_type, seed=seed, attn_implementation=attn_implementation, **config)
    return tiny.raise_token_logit(model, TOKENIZER.eos_token_id, 2.5)


class _Recorder(TrainerCallback):
    """Every parameter's gradient right before each optimizer step (cloned)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def run_steps(trainer_class, config_class, tmp_path, student, teacher, *, peft_config=None, train_dataset=None,
              processing_class=TOKENIZER, **config) -> dict:  # fmt: skip
    """``max_steps`` (default 1) optimizer steps of ``trainer_class`` from ``student`` and ``teacher`` (deep-copied),
    seeded: what it logged, its gradients, every hidden-state call (its ``attention_mask``, ``logits_to_keep`` and
    output), its completions, the trainer."""
    config = (
        dict(
            per_device_train_batch_size=4,
            max_completion_length=12,
            max_steps=1,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=7,
            save_strategy="no",
            disable_tqdm=True,
        )
        | config
    )
    args = config_class(output_dir=str(tmp_path / trainer_class.__module__), **config)
    recorder = _Recorder()
    trainer = trainer_class(
        model=copy.deepcopy(student),
        teacher_model=copy.deepcopy(teacher),
        args=args,
        train_dataset=prompts() if train_dataset is None else train_dataset,
        processing_class=processing_class,
        callbacks=[recorder],
        peft_config=peft_config,
    )
    calls, completions = [], []
    hidden_method, generate = trainer._get_last_hidden_state, trainer._generate

    def recorded_hidden(unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs):
        hidden = hidden_method(unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs)
        calls.append((attention_mask[:, -logits_to_keep:].bool().clone(), hidden.detach().clone()))
        return hidden

    def recorded_generate(prompts):
        out = generate(prompts)
        completions.append([list(ids) for ids in out[1]])
        return out

    trainer._get_last_hidden_state, trainer._generate = recorded_hidden, recorded_generate
    trainer.train()
    logs = [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in trainer.state.log_history]
    return {"logs": logs, "grads": recorder.grads, "calls": calls, "completions": completions, "trainer": trainer}


def _relative(ours: torch.Tensor, stock: torch.Tensor) -> float:
    """``max |ours - stock| / max |stock|`` (0 for empty tensors)."""
    if stock.numel() == 0:
        return 0.0
    return float((ours - stock).abs().max()) / max(float(stock.abs().max()), 1e-30)


def assert_same_steps(ours: dict, stock: dict, *, packed: int | None = None) -> dict[str, float]:
    """Ours == stock: completions, every logged value, every hidden-state call at the completion positions TRL's loss
    reads, every gradient of every step; ``packed``: how many of our forwards ran packed (default: all of them).
    Returns the largest relative differences measured."""
    assert ours["completions"] == stock["completions"]  # generation untouched: the same seed, the same samples
    lengths = {len(ids) for batch in stock["completions"] for ids in batch}
    assert len(lengths) > 1, lengths  # completions of different lengths: the padded batch has right padding
    assert len(ours["logs"]) == len(stock["logs"])
    for ours_entry, stock_entry in zip(ours["logs"], stock["logs"]):
        assert ours_entry.keys() == stock_entry.keys()
        for key, value in stock_entry.items():
            assert ours_entry[key] == pytest.approx(value, rel=RTOL, abs=1e-6), (key, ours_entry[key], value)
    measured = {"hidden": 0.0, "grads": 0.0}
    assert len(ours["calls"]) == len(stock["calls"]) and stock["calls"]
    for (mask, hidden), (stock_mask, stock_hidden) in zip(ours["calls"], stock["calls"]):
        assert torch.equal(mask, stock_mask) and hidden.shape == stock_hidden.shape
        difference = _relative(hidden[mask], stock_hidden[stock_mask])
        measured["hidden"] = max(measured["hidden"], difference)
        assert difference <= RTOL, difference
    assert len(ours["grads"]) == len(stock["grads"]) and stock["grads"]
    for grads, stock_grads in zip(ours["grads"], stock["grads"]):
        assert grads.keys() == stock_grads.keys()
        largest = max(float(g.abs().max()) for g in stock_grads.values())
        assert largest > 0, "a step without gradient compares nothing"
        difference = max(float((grads[n] - g).abs().max()) for n, g in stock_grads.items()) / largest
        measured["grads"] = max(measured["grads"], difference)
        assert difference <= RTOL, difference
    forwards = ours["trainer"].unpack_stats.get("forwards")
    if not ours["trainer"].unpack_decision.packed:  # stock or padded: nothing of ours ran, nothing counted
        assert forwards is None and not packed, forwards
        return measured
    expected = len(ours["calls"]) if packed is None else packed
    assert forwards == {"packed": expected, "padded": len(ours["calls"]) - expected}, forwards
    return measured


@pytest.fixture(scope="module")
def student():
    return tiny_lm()


@pytest.fixture(scope="module")
def teacher():
    """The same family, other weights and widths."""
    return tiny_lm(seed=1, hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3)


CASES = {
    "beta 1 (reverse KL, TRL's default)": {},
    "beta 0 (forward KL), temperature 0.7": dict(beta=0.0, temperature=0.7),
    "beta 0.5 (JSD), no activation checkpointing": dict(beta=0.5, gradient_checkpointing=False),
    "beta 0.3, gradient accumulation 2": dict(beta=0.3, per_device_train_batch_size=2, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_distillation_step_equals_stock(case, tmp_path, student, teacher):
    config = CASES[case]
    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher, **config)
    ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher, **config)
    trainer = ours["trainer"]
    assert trainer.unpack_decision.packed and trainer.unpack_selfcheck.ok and trainer.unpack_selfcheck_teacher.ok
    assert trainer.unpack_teacher_reason is None
    assert_same_steps(ours, stock)


TEACHERS = {
    "qwen2 (attention biases)": ("qwen2", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)),
    "mistral (sliding window 4)": ("mistral", dict(sliding_window=4)),
    "gemma2 (attention and final-logit softcapping, sliding window, eager)": (
        "gemma2",
        dict(
            head_dim=8,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            attn_implementation="eager",
        ),
    ),
}


@pytest.mark.parametrize("name", list(TEACHERS))
def test_a_teacher_of_another_family_is_patched_and_equals_stock(name, tmp_path, student):
    model_type, overrides = TEACHERS[name]
    teacher = tiny_lm(model_type, seed=2, **overrides)
    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher, beta=0.5)
    ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher, beta=0.5)
    trainer = ours["trainer"]
    from unpack_trainer.models import is_patched

    assert is_patched(trainer.teacher_model) and trainer.unpack_selfcheck_teacher.ok
    assert_same_steps(ours, stock)


def test_lora_student_equals_stock(tmp_path, student, teacher):
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher, peft_config=lora())
    ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher, peft_config=lora())
    assert ours["grads"][0] and all("lora" in name for name in ours["grads"][0])
    assert_same_steps(ours, stock)


def test_repeated_prompts_are_packed_once_and_equal_stock(tmp_path, student, teacher, monkeypatch):
    """A batch holding a prompt twice: the prompt is packed once, both completions branch from it (student and
    teacher alike), and the step equals stock; ``prefix_sharing=False`` packs each completion after its own copy."""
    layouts = []
    packed_layout = distillation.packed_layout

    def recorded(*args, **kwargs):
        batch, reason = packed_layout(*args, **kwargs)
        layouts.append(batch)
        return batch, reason

    monkeypatch.setattr(distillation, "packed_layout", recorded)
    dataset = prompts(["abcdefg", "abcdefg", "de", "hi"])
    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher,
                      train_dataset=dataset)  # fmt: skip
    ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher, train_dataset=dataset)
    assert len(layouts) == 1  # one micro-batch: one layout, built once for the student and the teacher
    assert layouts[0]["packed_seq_parents"].tolist().count(0) == 2  # the shared prompt's two branches
    assert_same_steps(ours, stock)
    layouts.clear()
    unshared = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher, train_dataset=dataset,
                         prefix_sharing=False)  # fmt: skip
    assert (layouts[0]["packed_seq_parents"] == -1).all()
    assert_same_steps(unshared, stock)


def test_the_layout_is_built_once_per_micro_batch(tmp_path, student, teacher, monkeypatch):
    built = []
    packed_layout = distillation.packed_layout

    def counted(*args, **kwargs):
        built.append(1)
        return packed_layout(*args, **kwargs)

    monkeypatch.setattr(distillation, "packed_layout", counted)
    ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2)  # fmt: skip
    assert len(ours["calls"]) == 4 and len(built) == 2  # student + teacher per micro-batch, one layout each


# ------------------------------------------------------------------------------------------------ image prompts


def image_prompts() -> Dataset:
    """Image prompts of TRL's conversational format: one prompt twice (the same text and image: packed once, its two
    completions branches of it), the same text and image size with other pixels (equal token ids: only the images
    tell it apart, so it is packed on its own), a longer text with a larger image."""
    from random_images import random_image

    rows = [("what is it?", 56, 56, 0), ("what is it?", 56, 56, 0), ("what is it?", 56, 56, 1),
            ("describe the picture, please", 84, 112, 2)]  # fmt: skip
    return Dataset.from_list(
        [{"image": random_image(h, w, seed), "prompt": [{"role": "user", "content": t}]} for t, h, w, seed in rows]
    )


@pytest.mark.parametrize("family, raise_eos", [("qwen2_5_vl", 4.0), ("gemma3", 12.0)])
def test_image_prompts_equal_stock(family, raise_eos, tmp_path, monkeypatch):
    """A vision-language student and teacher (Qwen2.5-VL: multi-axis positions from each full sequence; Gemma 3:
    image tokens attending both ways): each distinct image prompt goes to the model once on the packed row (the
    repeated one with its two completions as branches), and the step equals stock's (every logged value, hidden
    state and gradient, the vision towers' included)."""
    layouts = []
    packed_layout = distillation.packed_layout

    def recorded(*args, **kwargs):
        batch, reason = packed_layout(*args, **kwargs)
        layouts.append(batch)
        return batch, reason

    monkeypatch.setattr(distillation, "packed_layout", recorded)
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model

    monkeypatch.setattr(distillation, "PACKED_TOKEN_SHARE", 1.01)  # pack even where it would barely save tokens
    processor = tiny_processor(family)
    processor.tokenizer.padding_side = "left"  # as TRL loads a processor itself
    eos = processor.tokenizer.eos_token_id
    student = tiny.raise_token_logit(tiny_vision_model(family, attn_implementation="sdpa"), eos, raise_eos)
    teacher = tiny_vision_model(family, seed=1, attn_implementation="sdpa")
    config = dict(max_completion_length=8, train_dataset=image_prompts(), processing_class=processor)
    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher, **config)
    ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher, **config)
    assert ours["trainer"].unpack_decision.packed and ours["trainer"].unpack_selfcheck_teacher.ok
    parents = layouts[0]["packed_seq_parents"].tolist()  # 3 distinct prompts, the repeated one with 2 branches
    assert parents.count(-1) == 3 and len(parents) == 5 and len({p for p in parents if p >= 0}) == 1, parents
    assert_same_steps(ours, stock)


# ------------------------------------------------------------------------------------------------ contamination probe


def test_a_perturbed_sample_changes_no_other_row(tmp_path, student, teacher):
    """The packed forward of TRL's micro-batch (student and teacher): perturbing one row's prompt and completion
    tokens leaves every other row's hidden states unchanged, and each row equals TRL's padded forward."""
    trainer = _trainer(tmp_path, student, teacher)
    trainer.get_train_dataloader()  # the self-checks
    generator = torch.Generator().manual_seed(0)
    prompt_lengths, completion_lengths = [5, 2, 7, 3], [4, 9, 1, 6]
    width_p, width_c = max(prompt_lengths), max(completion_lengths)
    ids = torch.zeros(4, width_p + width_c, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        ids[row, width_p - p : width_p + c] = torch.randint(3, len(TOKENIZER), (p + c,), generator=generator)
        mask[row, width_p - p : width_p + c] = 1
    perturbed = ids.clone()
    perturbed[1] = torch.where(mask[1].bool(), (ids[1] + 7) % len(TOKENIZER), ids[1])
    completion = mask[:, width_p:].bool()
    for model in (trainer.model, trainer.teacher_model):
        model.eval()
        with torch.no_grad():
            stock = trl.DistillationTrainer._get_last_hidden_state(trainer, model, ids, mask, width_c)
            ours = trainer._get_last_hidden_state(model, ids, mask, width_c)
            moved = trainer._get_last_hidden_state(model, perturbed, mask, width_c)
        assert _relative(ours[completion], stock[completion]) <= RTOL
        others = torch.tensor([0, 2, 3])
        assert torch.equal(moved[others][completion[others]], ours[others][completion[others]])
        assert not torch.allclose(moved[1][completion[1]], ours[1][completion[1]])
    assert trainer.unpack_stats["forwards"] == {"packed": 4, "padded": 0}


# ------------------------------------------------------------------------------------------------ decision and checks


def _trainer(tmp_path, student, teacher, config_class=DistillationConfig, **config):
    args = config_class(output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=8, max_steps=1,
                        report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, **config)  # fmt: skip
    return DistillationTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=args,
                               train_dataset=prompts(), processing_class=TOKENIZER)  # fmt: skip


def test_padding_free_false_and_unpack_disable_train_stock(tmp_path, student, teacher, monkeypatch):
    trainer = _trainer(tmp_path, student, teacher, padding_free=False)
    assert trainer.unpack_decision.mode == "padded" and "padding_free=False" in trainer.unpack_decision.reason
    trainer.train()
    assert "forwards" not in trainer.unpack_stats
    monkeypatch.setenv("UNPACK_DISABLE", "1")
    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher)
    disabled = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher)
    assert disabled["trainer"].unpack_decision.mode == "stock"
    assert assert_same_steps(disabled, stock, packed=0) == {"hidden": 0.0, "grads": 0.0}


def test_a_plain_trl_config_is_converted_and_packs(tmp_path, student, teacher):
    trainer = _trainer(tmp_path, student, teacher, config_class=trl.DistillationConfig)
    assert type(trainer.args) is DistillationConfig and trainer.unpack_decision.packed
    assert trainer.unpack_decision.automatic


def test_a_refused_teacher_runs_padded_with_one_logged_reason(tmp_path, student, monkeypatch, caplog):
    """A teacher whose model type the patch refuses (here: put on the blocklist) runs TRL's padded forward, unpatched,
    logged once with the reason, while the student packs; the step still equals stock."""
    from unpack_trainer.models import is_patched, refusals

    teacher = tiny_lm("qwen2", seed=2)
    monkeypatch.setitem(refusals.BLOCKLIST, "qwen2", "refused for this test")
    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher)
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher)
    trainer = ours["trainer"]
    assert "refused for this test" in trainer.unpack_teacher_reason and not is_patched(trainer.teacher_model)
    lines = [r.getMessage() for r in caplog.records if "the teacher runs TRL's padded forwards" in r.getMessage()]
    assert len(lines) == 1 and "refused for this test" in lines[0]
    assert_same_steps(ours, stock, packed=1)  # the student's forward packed, the teacher's padded


def test_a_teacher_failing_its_self_check_runs_padded(tmp_path, student, teacher, monkeypatch, caplog):
    from unpack_trainer import selfcheck
    from unpack_trainer.models import is_patched

    real = selfcheck.check_uncontaminated
    failed = selfcheck.ContaminationReport(False, 1.0, 1e-4, float("nan"), torch.float32, 0.0)

    def check(model, **kwargs):
        return failed if getattr(model.config, "hidden_size", None) == 48 else real(model, **kwargs)

    monkeypatch.setattr(selfcheck, "check_uncontaminated", check)
    stock = run_steps(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, student, teacher)
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        ours = run_steps(DistillationTrainer, DistillationConfig, tmp_path, student, teacher)
    trainer = ours["trainer"]
    assert trainer.unpack_selfcheck.ok and not trainer.unpack_selfcheck_teacher.ok
    assert "self-check failed" in trainer.unpack_teacher_reason and not is_patched(trainer.teacher_model)
    assert sum("Self-check of the teacher failed" in r.getMessage() for r in caplog.records) == 1
    assert_same_steps(ours, stock, packed=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNPACK_STRICT", "1")
        with pytest.raises(RuntimeError, match="UNPACK_STRICT"):
            _trainer(tmp_path, student, teacher).get_train_dataloader()


def test_short_uniform_batches_run_trls_padded_forward(tmp_path, student, teacher, caplog):
    """Where packing would save little (full rows), both forwards run TRL's padded batch (exact either way), logged
    once; a micro-batch with vision inputs, too."""
    trainer = _trainer(tmp_path, student, teacher)
    ids = torch.randint(3, 50, (4, 10))
    mask = torch.ones_like(ids)
    with caplog.at_level(logging.INFO, logger="unpack_trainer"), torch.no_grad():
        trainer._get_last_hidden_state(trainer.model, ids, mask, 6)
        trainer._get_last_hidden_state(trainer.teacher_model, ids, mask, 6)
    assert trainer.unpack_stats["forwards"] == {"packed": 0, "padded": 2}
    assert sum("ran TRL's padded forwards" in r.getMessage() for r in caplog.records) == 1


def test_vision_language_data_trains_padded_with_one_logged_reason(tmp_path, student, teacher, caplog):
    dataset = prompts().add_column("image", [None] * len(PROMPTS))
    args = DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                              bf16=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = DistillationTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=args,
                                      train_dataset=dataset, processing_class=TOKENIZER)  # fmt: skip
    assert trainer.unpack_decision.mode == "padded" and "images" in trainer.unpack_decision.reason
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DistillationTrainer: mode=padded")]
    assert len(lines) == 1


def test_packed_layout_worked_example():
    ids = torch.tensor([[5, 6, 8, 0], [0, 7, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    batch, reason = distillation.packed_layout(ids, mask, 2, prefix_sharing=True)
    assert reason is None and "labels" not in batch
    assert batch["packed_input_ids"].tolist() == [[5, 6, 8, 7, 9, 10]]
    assert batch["packed_position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]
    assert batch["input_ids"].tolist() == [[6, 8, 0], [7, 9, 10]]
    assert batch["packed_view_index"].tolist() == [[1, 2, 0], [3, 4, 5]]
    full = torch.arange(3, 11).view(2, 4)  # two different prompts, no padding
    assert distillation.packed_layout(full, torch.ones_like(full), 2, prefix_sharing=True) == (
        None,
        "the packed row would hold 100% of the padded batch's tokens",
    )
