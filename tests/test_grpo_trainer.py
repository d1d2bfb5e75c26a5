"""GRPOTrainer / RLOOTrainer: one optimizer step of ours == the same step of stock ``trl.GRPOTrainer`` /
``trl.RLOOTrainer`` padded (the same completions generated, loss, every logged metric, every per-token log-prob and
entropy, every gradient), the decision and its fallbacks, and the packed layout of TRL's batch.

A step generates with a tiny random model whose end-of-sequence logit is raised so that completions end at different
lengths (right padding), from prompts of different lengths (left padding); 6 completions per step, 3 per prompt (two
groups per batch, interleaved by TRL's shuffle before the loss). Bounds: fp32, relative to the largest entry of what is
compared (``RTOL``); after the first optimizer step, twice stock's own difference when only its padding width changes
([`stock_floor`]) where that is larger; a logged loss that cancels, ``LOSS_RTOL`` (the ``vespo`` and ``bnpo`` cases
in float64 end to end agree within 1e-14). The measured floor is in docs/grpo.md, "Tests".
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import trl
from datasets import Dataset
from transformers import TrainerCallback

from unpack_trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from unpack_trainer.model_zoo import tiny
from unpack_trainer.trainers.branched import pack_completions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

RTOL = 1e-5
PROMPTS = ["abc", "de", "fghij", "k", "lmnopq", "rs", "tuvw", "xyz"]
TOKENIZER = tiny.char_tokenizer()
TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")


def count_a(completions, **kwargs):
    """A programmatic reward: how many ``a`` a completion holds, minus a length term (so a group's rewards differ)."""
    return [float(text.count("a")) - 0.1 * len(text) for text in completions]


def prompts(n: int = 4) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def grpo_model(model_type: str = "llama", **overrides):
    """A tiny random causal LM over the character tokenizer whose ``</s>`` logit is raised by about 2.5 on average
    (along the mean final hidden state of random text), so that sampled completions end at different lengths."""
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
    return tiny.raise_token_logit(tiny.tiny_model(model_type, **config), TOKENIZER.eos_token_id, 2.5)


class _Recorder(TrainerCallback):
    """Every parameter's gradient right before each optimizer step (cloned)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def run_steps(
    trainer_class,
    config_class,
    tmp_path,
    model,
    *,
    peft_config=None,
    train_dataset=None,
    processing_class=TOKENIZER,
    reward_funcs=count_a,
    defaults=None,
    watch=None,
    **config,
) -> dict:
    """``max_steps`` (default 1) optimizer steps of ``trainer_class`` from ``model`` (deep-copied; or a saved model's
    folder), seeded: what it logged, its gradients, every log-prob call's outputs, its completions, the trainer.

    ``train_dataset`` / ``processing_class`` / ``reward_funcs`` default to the text prompts, their tokenizer and
    [`count_a`], ``defaults`` to this
    file's config (``config`` overrides either). ``watch(trainer)``, when given, returns an object whose ``before(args,
    kwargs)`` and ``after()`` run around every log-prob call, whose ``close()`` runs after training and whose
    ``results`` (a dict) join the returned one."""
    defaults = defaults or dict(per_device_train_batch_size=6, num_generations=3, max_completion_length=12)
    config = (
        defaults
        | dict(
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
    args = config_class(output_dir=str(tmp_path / trainer_class.__name__), **config)
    recorder = _Recorder()
    trainer = trainer_class(
        model=model if isinstance(model, str) else copy.deepcopy(model),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=prompts() if train_dataset is None else train_dataset,
        processing_class=processing_class,
        callbacks=[recorder],
        peft_config=peft_config,
    )
    calls, call_steps, completions = [], [], []
    logps_method, generate = trainer._get_per_token_logps_and_entropies, trainer._generate
    watcher = None if watch is None else watch(trainer)

    def recorded_logps(*args, **kwargs):
        if watcher is not None:
            watcher.before(args, kwargs)
        logps, entropies, aux = logps_method(*args, **kwargs)
        calls.append((logps.detach().clone(), None if entropies is None else entropies.detach().clone(), aux))
        call_steps.append(trainer.state.global_step)  # optimizer steps taken before this call
        if watcher is not None:
            watcher.after()
        return logps, entropies, aux

    def recorded_generate(prompts):
        out = generate(prompts)
        completions.append([list(ids) for ids in out[1]])
        return out

    trainer._get_per_token_logps_and_entropies, trainer._generate = recorded_logps, recorded_generate
    try:
        trainer.train()
    finally:
        if watcher is not None:
            watcher.close()
    logs = [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in trainer.state.log_history]
    results = {"logs": logs, "grads": recorder.grads, "calls": calls, "call_steps": call_steps,
               "completions": completions, "trainer": trainer}  # fmt: skip
    return results | ({} if watcher is None else watcher.results)


def _relative(ours: torch.Tensor, stock: torch.Tensor) -> float:
    """``max |ours - stock| / max |stock|`` (0 for empty tensors)."""
    if stock.numel() == 0:
        return 0.0
    return float((ours - stock).abs().max()) / max(float(stock.abs().max()), 1e-30)


def _grad_differences(ours: dict, stock: dict) -> list[float]:
    """Per optimizer step: the largest ``|ours - stock|`` over every gradient entry, relative to the step's largest
    stock gradient entry."""
    differences = []
    for grads, stock_grads in zip(ours["grads"], stock["grads"]):
        largest = max(float(g.abs().max()) for g in stock_grads.values())
        assert largest > 0, "a step without gradient compares nothing"
        differences.append(max(float((grads[n] - g).abs().max()) for n, g in stock_grads.items()) / largest)
    return differences


def _call_differences(ours: dict, stock: dict) -> list[dict[str, float]]:
    """Per log-prob call: the [`_relative`] difference of its per-token log-probs, entropies and MoE auxiliary loss
    (those the call returned), ours against stock. Columns beyond stock's completion width (a repadded run's right
    padding, zero) are left out."""
    differences = []
    for (logps, entropies, aux), (stock_logps, stock_entropies, stock_aux) in zip(ours["calls"], stock["calls"]):
        width = stock_logps.shape[-1]
        difference = {"logps": _relative(logps[..., :width], stock_logps)}
        if entropies is not None and stock_entropies is not None:
            difference["entropies"] = _relative(entropies[..., :width], stock_entropies)
        if aux is not None and stock_aux is not None:
            difference["aux"] = _relative(aux.detach(), stock_aux.detach())
        differences.append(difference)
    return differences


def _log_differences(ours: dict, stock: dict) -> list[dict[str, float]]:
    """Per logged entry: each numeric value's relative difference, ours against stock."""
    return [
        {key: abs(ours_entry[key] - value) / max(abs(value), 1e-30) for key, value in stock_entry.items()}
        for ours_entry, stock_entry in zip(ours["logs"], stock["logs"])
    ]


def stock_floor(trainer_class, config_class, tmp_path, model, stock: dict, **config) -> dict:
    """Stock's own differences when only its padding width changes (``pad_to_multiple_of=16``): the rounding a later
    step amplifies (after the first optimizer step the runs start from weights that differ by rounding: Adam's first
    update, ``lr * g / |g|``, turns a rounding difference in a near-zero gradient entry into one of up to ``2 * lr`` in
    the weight, and losses such as SAPO's soft gates amplify that past 1e-5). ``grads``: per optimizer step
    ([`_grad_differences`]); ``calls``: per log-prob call ([`_call_differences`]); ``logs``: per logged entry
    ([`_log_differences`])."""
    repadded = run_steps(trainer_class, config_class, tmp_path, model, pad_to_multiple_of=16, **config)
    assert repadded["completions"] == stock["completions"]
    assert len(repadded["calls"]) == len(stock["calls"]) and len(repadded["logs"]) == len(stock["logs"])
    return {
        "grads": _grad_differences(repadded, stock),
        "calls": _call_differences(repadded, stock),
        "logs": _log_differences(repadded, stock),
    }


def assert_same_steps(ours: dict, stock: dict, rtol: float = RTOL, floor: dict | None = None,
                      loss_rtol: float | None = None) -> dict:  # fmt: skip
    """Ours == stock: completions, every logged value, every log-prob call (per-token log-probs, entropies, MoE
    auxiliary loss), every gradient of every step; every log-prob forward of ours packed. A value is within ``rtol``
    (a logged value: of itself; a call's output or a gradient: of its largest entry), or, where it comes after the
    first optimizer step, within twice ``floor`` (stock's own difference when its padding width changes, see
    [`stock_floor`]). ``loss_rtol``, where given, bounds the logged ``loss`` and ``train_loss`` instead of ``rtol``
    (a loss that cancels: see ``LOSS_RTOL``). Returns the largest relative differences measured."""
    assert ours["completions"] == stock["completions"]  # generation untouched: the same seed, the same samples
    lengths = {len(ids) for batch in stock["completions"] for ids in batch}
    assert len(lengths) > 1, lengths  # completions of different lengths: the padded batch has right padding

    def bound(after_first_step: bool, floor_value: float, base: float = rtol) -> float:
        return max(base, 2 * floor_value) if after_first_step and floor is not None else base

    assert len(ours["logs"]) == len(stock["logs"])
    for index, (ours_entry, stock_entry) in enumerate(zip(ours["logs"], stock["logs"])):
        assert ours_entry.keys() == stock_entry.keys()
        for key, value in stock_entry.items():
            base = loss_rtol if loss_rtol is not None and key in ("loss", "train_loss") else rtol
            later = stock_entry.get("step", 1) > 1  # transformers logs the optimizer steps taken so far
            tolerance = bound(later, floor["logs"][index][key] if floor is not None else 0.0, base)
            assert ours_entry[key] == pytest.approx(value, rel=tolerance, abs=1e-6), (key, ours_entry[key], value)
    measured = {"logps": 0.0, "grads": 0.0}
    assert len(ours["calls"]) == len(stock["calls"])
    for index, ((logps, entropies, aux), (stock_logps, stock_entropies, stock_aux)) in enumerate(
        zip(ours["calls"], stock["calls"])
    ):
        assert logps.shape == stock_logps.shape
        assert torch.equal(logps == 0, stock_logps == 0)  # zero exactly where TRL's are (masked completion tokens)
        assert (entropies is None) == (stock_entropies is None) and (aux is None) == (stock_aux is None)
        later = stock["call_steps"][index] > 0  # a call after the first optimizer step
        for kind, difference in _call_differences(
            {"calls": [(logps, entropies, aux)]}, {"calls": [(stock_logps, stock_entropies, stock_aux)]}
        )[0].items():
            tolerance = bound(later, floor["calls"][index][kind] if floor is not None else 0.0)
            if kind == "logps":
                measured["logps"] = max(measured["logps"], difference)
            assert difference <= tolerance, (index, kind, difference, tolerance)
    assert len(ours["grads"]) == len(stock["grads"]) and stock["grads"]
    assert all(grads.keys() == stock_grads.keys() for grads, stock_grads in zip(ours["grads"], stock["grads"]))
    for step, diff in enumerate(_grad_differences(ours, stock)):
        tolerance = bound(step > 0, floor["grads"][step] if floor is not None else 0.0)
        measured["grads"] = max(measured["grads"], diff)
        assert diff <= tolerance, (step, diff, tolerance)
    forwards = ours["trainer"].unpack_stats.get("forwards", {})
    assert forwards.get("packed", 0) == len(ours["calls"]) and not forwards.get("padded"), forwards
    return measured


@pytest.fixture(scope="module")
def llama():
    return grpo_model()


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory, llama):
    """The tiny Llama saved as a folder: TRL builds a separate reference model (``beta > 0``) from the policy's."""
    path = tmp_path_factory.mktemp("grpo-llama")
    llama.save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return str(path)


GRPO_CASES = {
    # one step of the default GRPO set-up: loss_type "dapo", beta 0 (no reference), old log-probs = the current ones
    "dapo": {},
    "grpo, beta > 0 (separate reference model), temperature": dict(loss_type="grpo", beta=0.1, temperature=0.7),
    # two iterations on one generation: old log-probs computed, the second step's ratios differ from 1
    "dr_grpo, num_iterations 2, masked truncated completions, top-entropy mask": dict(
        loss_type="dr_grpo", num_iterations=2, max_steps=2, mask_truncated_completions=True, top_entropy_quantile=0.5
    ),
    # generation every 2 steps (steps_per_generation 2): old log-probs and sequence-level importance sampling
    "bnpo, steps_per_generation 2, sequence importance sampling": dict(
        loss_type="bnpo",
        steps_per_generation=2,
        per_device_train_batch_size=3,
        max_steps=2,
        importance_sampling_level="sequence",
    ),
    "cispo": dict(loss_type="cispo", num_iterations=2, max_steps=2),
    "sapo": dict(loss_type="sapo", num_iterations=2, max_steps=2),
    "luspo, vespo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo", num_iterations=2, max_steps=2, scale_rewards="batch"),
}


# A logged loss that cancels, bounded by more than RTOL (measured on a 2-core AVX-512 CPU; torch 2.11 and 2.13 alike).
# VESPO with num_iterations 2: the first step weighs each sequence by phi(w), w = exp(sum of its new - old log-probs),
# phi - 1 = -/+ log w near w = 1. Stock's old-policy forward and the step's run the same padded rows, so w == 1
# exactly; ours packs the rows in the order TRL shuffled them into between the two, so the sums differ by fp32
# rounding (|log w| <= 1.9e-6) and the loss, per-sequence terms of mean-zero advantages (their absolute values sum to
# 3.70 for a loss of -0.4036), moves by 4.35e-6 (those terms predict 4.4e-6): rel 1.08e-5. The same comparison in
# float64 end to end (TRL's fused LM head and the RMSNorm included): 9.5e-15.
LOSS_RTOL = {"vespo": 5e-5}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_one_grpo_step_equals_stock(case, tmp_path, llama, llama_path):
    config = GRPO_CASES[case]
    model = llama_path if config.get("beta") else llama
    stock = run_steps(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, model, **config)
    ours = run_steps(GRPOTrainer, GRPOConfig, tmp_path, model, **config)
    assert ours["trainer"].unpack_decision.packed and ours["trainer"].unpack_selfcheck_branched.ok
    floor = (
        stock_floor(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, model, stock, **config)
        if len(stock["grads"]) > 1
        else None
    )
    assert_same_steps(ours, stock, floor=floor, loss_rtol=LOSS_RTOL.get(case))


def test_grpo_with_lora_and_the_adapter_disabled_reference_equals_stock(tmp_path, llama):
    """LoRA, ``beta > 0``: the reference is the model with its adapter disabled (TRL's ``use_adapter``), packed too;
    two steps, so the second one's KL term is not zero."""
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    config = dict(beta=0.2, max_steps=2, learning_rate=5e-2)
    stock = run_steps(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, llama, peft_config=lora(), **config)
    ours = run_steps(GRPOTrainer, GRPOConfig, tmp_path, llama, peft_config=lora(), **config)
    assert len(ours["calls"]) == 2 * 2  # per step: the reference's forward and the policy's
    assert_same_steps(ours, stock)


ARCHITECTURES = {
    "qwen3_moe (router aux loss)": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            output_router_logits=False,  # True breaks generation (transformers 5.24); TRL enables the loss by coef
            router_aux_loss_coef=0.1,
        ),
    ),
    "mistral (sliding window 4)": ("mistral", dict(sliding_window=4)),
    "gemma2 (softcap, sliding window)": (
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


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_one_grpo_step_equals_stock_on_other_architectures(name, tmp_path):
    model_type, overrides = ARCHITECTURES[name]
    attn = overrides.pop("attn_implementation", None)
    model = grpo_model(model_type, **overrides) if attn is None else _with_attention(model_type, attn, overrides)
    stock = run_steps(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, model, loss_type="grpo")
    ours = run_steps(GRPOTrainer, GRPOConfig, tmp_path, model, loss_type="grpo")
    assert_same_steps(ours, stock)
    if "moe" in name:
        assert all(aux is not None for _, _, aux in ours["calls"][-1:])


def _with_attention(model_type: str, implementation: str, overrides: dict):
    model = grpo_model(model_type, **overrides)
    model.set_attn_implementation(implementation)
    return model


@pytest.mark.parametrize(
    "config", [{}, dict(beta=0.0, num_iterations=2, max_steps=2, learning_rate=1e-4)], ids=["beta 0.05", "beta 0"]
)
def test_one_rloo_step_equals_stock(config, tmp_path, llama, llama_path):
    model = llama if config.get("beta") == 0.0 else llama_path
    stock = run_steps(trl.RLOOTrainer, trl.RLOOConfig, tmp_path, model, **config)
    ours = run_steps(RLOOTrainer, RLOOConfig, tmp_path, model, **config)
    assert ours["trainer"].unpack_decision.packed
    floor = (
        stock_floor(trl.RLOOTrainer, trl.RLOOConfig, tmp_path, model, stock, **config)
        if len(stock["grads"]) > 1
        else None
    )
    assert_same_steps(ours, stock, floor=floor)


# ------------------------------------------------------------------------------------------------ the packed layout


def test_pack_completions_worked_example():
    ids = torch.tensor([[5, 6, 8, 0], [5, 6, 9, 10], [0, 7, 11, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    batch, total = pack_completions(ids, mask, 2)
    assert total == 7
    assert batch["packed_input_ids"].tolist() == [[5, 6, 8, 9, 10, 7, 11]]
    assert batch["packed_seq_lengths"].tolist() == [2, 1, 2, 2]
    assert batch["packed_seq_parents"].tolist() == [-1, 0, 0, -1]
    assert batch["packed_position_ids"].tolist() == [[0, 1, 2, 2, 3, 0, 1]]
    assert batch["packed_token_index"].tolist() == [[0, 1, 2, 0], [0, 1, 3, 4], [0, 5, 6, 0]]
    assert batch["input_ids"].tolist() == [[6, 8, 0], [6, 9, 10], [7, 11, 0]]
    assert batch["labels"].tolist() == [[-100, 8, -100], [-100, 9, 10], [-100, 11, -100]]
    assert batch["packed_view_index"].tolist() == [[1, 2, 0], [1, 3, 4], [5, 6, 0]]
    unshared, total = pack_completions(ids, mask, 2, prefix_sharing=False)
    assert total == 9 and unshared["packed_seq_parents"].tolist() == [-1, -1, -1]


def test_pack_completions_groups_any_rows_with_equal_prompts():
    """Rows of one group need not be adjacent (TRL shuffles a generation batch before the loss), a group may be partial,
    two groups may have equal prompts, a completion may be masked whole: every token of TRL's batch maps to one packed
    token holding the same id, and each distinct prompt is packed once."""
    generator = torch.Generator().manual_seed(0)
    prompts = [[3, 4, 5], [6], [3, 4, 5], [7, 8], [6], [3, 4, 5], [9, 10, 11, 12]]
    completions = [[20, 21], [22], [23, 24, 25, 26], [], [27, 28, 29], [30], [31]]
    width_p, width_c = 4, 4
    ids = torch.zeros(len(prompts), width_p + width_c, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[row, width_p - len(prompt) : width_p] = torch.tensor(prompt)
        mask[row, width_p - len(prompt) : width_p] = 1
        ids[row, width_p : width_p + len(completion)] = torch.tensor(completion, dtype=torch.int64)
        mask[row, width_p : width_p + len(completion)] = 1
    order = torch.randperm(len(prompts), generator=generator)
    ids, mask = ids[order], mask[order]
    batch, total = pack_completions(ids, mask, width_c)
    packed = batch["packed_input_ids"][0]
    assert total == sum(len(c) for c in completions) + 3 + 1 + 2 + 4  # each distinct prompt once
    index = batch["packed_token_index"]
    assert torch.equal(torch.where(mask.bool(), packed[index], 0), torch.where(mask.bool(), ids, 0))
    view = batch["packed_view_index"]
    labels = batch["labels"]
    assert torch.equal(packed[view[:, 1:]][labels[:, 1:] != -100], ids[:, width_p:][mask[:, width_p:].bool()])
    assert torch.equal(packed[view[:, 0]], ids[:, width_p - 1])  # the last prompt token predicts the first one


@pytest.mark.parametrize(
    "bad, reason",
    [
        (lambda m: m[:, 0].fill_(1), "not left-padded"),  # a hole in a prompt's padding
        (lambda m: m[0, :4].fill_(0), "empty prompt"),
    ],
)
def test_pack_completions_refuses_what_is_not_trls_layout(bad, reason):
    ids = torch.arange(12).view(2, 6)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]])
    bad(mask)
    assert reason in pack_completions(ids, mask, 2)


# ------------------------------------------------------------------------------------------------ decision and checks


def _trainer(tmp_path, model, config_class=GRPOConfig, trainer_class=GRPOTrainer, **config):
    args = config_class(
        output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3, max_completion_length=8,
        max_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, **config,
    )  # fmt: skip
    return trainer_class(model=copy.deepcopy(model), reward_funcs=count_a, args=args, train_dataset=prompts(),
                         processing_class=TOKENIZER)  # fmt: skip


def test_padding_free_false_and_unpack_disable_train_stock(tmp_path, llama, monkeypatch, caplog):
    trainer = _trainer(tmp_path, llama, padding_free=False)
    assert trainer.unpack_decision.mode == "padded" and "padding_free=False" in trainer.unpack_decision.reason
    trainer.train()
    assert "forwards" not in trainer.unpack_stats
    monkeypatch.setenv("UNPACK_DISABLE", "1")
    trainer = _trainer(tmp_path, llama)
    assert trainer.unpack_decision.mode == "stock"


def test_a_plain_trl_config_is_converted_and_packs(tmp_path, llama):
    trainer = _trainer(tmp_path, llama, config_class=trl.GRPOConfig)
    assert type(trainer.args) is GRPOConfig and trainer.unpack_decision.packed and trainer.unpack_decision.automatic


def test_vision_inputs_train_stock_with_one_logged_reason(tmp_path, llama, caplog):
    """A dataset with images (or a processor, or a vision-language model) is blocked by the decision: TRL's padded
    forwards, logged once with the reason."""
    dataset = prompts().add_column("image", [None] * 4)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3, report_to=[],
                      use_cpu=True, bf16=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer = GRPOTrainer(model=copy.deepcopy(llama), reward_funcs=count_a, args=args, train_dataset=dataset,
                              processing_class=TOKENIZER)  # fmt: skip
    assert trainer.unpack_decision.mode == "padded" and "images" in trainer.unpack_decision.reason
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GRPOTrainer: mode=padded")]
    assert len(lines) == 1 and "images (image)" in lines[0]


@pytest.mark.parametrize("kind", ["sibling", "parents"])
def test_a_completion_that_sees_a_sibling_fails_the_self_check_and_sharing_stops(kind, tmp_path, llama, leak_branches,
                                                                                 caplog):  # fmt: skip
    """The branched self-check probes a prompt with ``num_generations`` completions before the first step; a leak
    between completions (or from the prompt) fails it: the completions are packed unshared, logged once, and the step
    still equals stock. ``UNPACK_STRICT=1`` raises instead."""
    leak_branches(kind)
    stock = run_steps(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, llama)
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        ours = run_steps(GRPOTrainer, GRPOConfig, tmp_path, llama)
    trainer = ours["trainer"]
    assert trainer.unpack_selfcheck.ok and not trainer.unpack_selfcheck_branched.ok
    assert not trainer._unpack_sharing() and trainer.unpack_decision.packed
    messages = [r.getMessage() for r in caplog.records if "prefix sharing is off" in r.getMessage()]
    assert len(messages) == 1 and "its own copy of its prompt" in messages[0]
    assert_same_steps(ours, stock)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNPACK_STRICT", "1")
        with pytest.raises(RuntimeError, match="UNPACK_STRICT"):
            _trainer(tmp_path, llama).get_train_dataloader()


def test_a_failed_plain_self_check_trains_stock_and_unpatches(tmp_path, llama, monkeypatch):
    from unpack_trainer import selfcheck
    from unpack_trainer.models import is_patched
    from unpack_trainer.trainers import contamination

    failed = selfcheck.ContaminationReport(False, 1.0, 1e-4, float("nan"), torch.float32, 0.0)
    monkeypatch.setattr(contamination, "check_uncontaminated", lambda *a, **k: failed)
    trainer = _trainer(tmp_path, llama)
    trainer.train()
    assert trainer.unpack_decision.mode == "padded" and "self-check failed" in trainer.unpack_decision.reason
    assert not is_patched(trainer.model) and trainer.unpack_stats.get("forwards") is None
    assert "forward" not in trainer.model.__dict__ or not hasattr(trainer.model, "_unpack_compact_lm_head")


def test_short_uniform_batches_run_trls_padded_forward(tmp_path, llama, caplog):
    """Where packing would save little (every completion as long as the longest, prompts of one length), a forward
    runs TRL's padded batch (exact either way), logged once."""
    trainer = _trainer(tmp_path, llama)
    ids = torch.randint(3, 50, (6, 10))
    mask = torch.ones_like(ids)
    with caplog.at_level(logging.INFO, logger="unpack_trainer"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 8)
    assert trainer.unpack_stats["forwards"] == {"packed": 0, "padded": 1}
    assert any("ran TRL's padded batch" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ G branches per prompt


def _groups_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's batch of 19 rows: two prompts with 8 completions each and a third with 3 (a partial group), completions of
    1 to 9 tokens, one masked whole, rows shuffled; ``(input_ids, attention_mask, logits_to_keep)``."""
    prompts = [torch.randint(7, 100, (n,), generator=generator) for n in (5, 2, 7)]
    rows = [
        (p, int(torch.randint(1, 10, (), generator=generator))) for p, g in zip(prompts, (8, 8, 3)) for _ in range(g)
    ]
    width_p, width_c = 7, 9
    ids = torch.zeros(len(rows), width_p + width_c, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, (prompt, length) in enumerate(rows):
        ids[row, width_p - len(prompt) : width_p] = prompt
        ids[row, width_p : width_p + length] = torch.randint(7, 100, (length,), generator=generator)
        mask[row, width_p - len(prompt) : width_p + length] = 1
    mask[3, width_p:] = 0  # a completion masked whole (mask_truncated_completions)
    order = torch.randperm(len(rows), generator=generator)
    return ids[order], mask[order], width_c


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flash"])
def test_eight_completions_per_prompt_equal_the_padded_batch_on_every_backend(backend, monkeypatch, stand_in_kernel):
    """A prompt with 8 branches (GRPO's default group) and a partial group, on SDPA buckets, eager and flash-attn (the
    CPU stand-in with flash-attn's bottom-right alignment): per-token log-probs, entropies and every gradient of the
    packed forward == TRL's padded forward."""
    from models.test_branched import _BottomRightFlash
    from trl.trainer.utils import add_fused_lm_head

    from unpack_trainer.patches import attention
    from unpack_trainer.trainers.branched import install_branched_hooks

    model = grpo_model(attn_implementation="eager" if backend == "eager" else "sdpa")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask, width_c = _groups_batch(torch.Generator().manual_seed(0))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-width_c] = -100
    weight = torch.randn(ids.shape[0], width_c, generator=torch.Generator().manual_seed(1))

    def run(**inputs):
        model.zero_grad()
        out = model(**inputs, fused_lm_head=True)
        ((out.log_probs[:, -width_c:] * weight).sum() + out.entropy[:, -width_c:].sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.log_probs[:, -width_c:].detach(), out.entropy[:, -width_c:].detach(), grads

    stock = run(input_ids=ids, attention_mask=mask, labels=labels)
    if backend == "flash":
        kernel = _BottomRightFlash()
        stand_in_kernel("flash", kernel, cpu=True, dtypes=(torch.float32,))
        monkeypatch.setenv(attention.ENV_BACKEND, "flash")
    install_branched_hooks(model)
    batch, total = pack_completions(ids, mask, width_c)
    assert total < int(mask.sum()) and batch["packed_seq_parents"].tolist().count(0) >= 7
    labels = batch.pop("labels")
    ours = run(**batch, attention_mask=mask, labels=labels)
    if backend == "flash":
        assert kernel.calls and all(queries == total for queries, _ in kernel.calls)
    for actual, expected in zip(ours[:2], stock[:2]):
        assert _relative(actual, expected) <= RTOL
    largest = max(float(g.abs().max()) for g in stock[2].values())
    for name, grad in stock[2].items():
        assert float((ours[2][name] - grad).abs().max()) <= RTOL * largest, name
