"""unpack_trainer.DPOTrainer == trl.DPOTrainer on the same pairs: one step's loss, every logged metric, the
per-pair chosen/rejected log-probs and every gradient, fp32 relative 1e-5 (gradients of a loss that amplifies
rounding: ``GRAD_TOLERANCE``); every loss_type TRL 1.16 offers, lists with loss_weights, ld_alpha, use_weighting,
every f_divergence_type, label smoothing; llama, qwen3 (window), gemma2 (softcap), a MoE with its auxiliary loss;
full fine-tuning with a separate reference model, LoRA (reference = adapter disabled) and precomputed reference
log-probs; prompts shared and not."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
import trl
from datasets import Dataset
from dpo_steps import one_dpo_step

from unpack_trainer.configs import DPOConfig
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model
from unpack_trainer.trainers.dpo import DPOTrainer

REL = 1e-5
LOSS_TYPES = [
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
SIZES = dict(hidden_size=32, max_position_embeddings=256, sliding_window=6, head_dim=8)
MODELS = {
    "llama": {},
    "qwen3": dict(use_sliding_window=True, max_window_layers=1),
    "gemma2": dict(attn_logit_softcapping=20.0, final_logit_softcapping=15.0, query_pre_attn_scalar=8),
    "qwen3_moe": dict(router_aux_loss_coef=0.3),
}
ATTENTION = {"gemma2": "eager"}
NUM_PAIRS = 4
# Gradient bounds of losses that amplify fp32 rounding past REL (measured on a 2-core AVX-512 CPU, torch 2.11 and 2.13
# alike). forward_kl scores a sequence by 1 - exp(-log ratio): on these pairs one rejected sequence weighs exp(3.94) =
# 51 times, and the log-probs' rounding (7.5e-8 of the largest, as for every loss) reaches the gradients 165-fold:
# ours against stock 1.24e-5 (model.norm.weight; prompts unshared 2.46e-5), where the default sigmoid loss gives
# 8.6e-7 and js_divergence 4.1e-6. The same step in float64 end to end (TRL's fused LM head and the RMSNorm included):
# 2.43e-14 (sigmoid 1.3e-15): 104 and 109 machine epsilons, rounding of an equal computation. Stock against itself
# repadded does not show it on that CPU (its log-probs come out bit for bit, floor 3e-7), so the floor cannot.
GRAD_TOLERANCE = {"forward_kl": 5e-5}


def _pairs(n: int = NUM_PAIRS, seed: int = 0, conversational: bool = False) -> Dataset:
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(low, high)))

    rows = [{"prompt": text(3, 12), "chosen": text(1, 9), "rejected": text(1, 9)} for _ in range(n)]
    rows[0]["chosen"] = rows[0]["rejected"][:2] + "x"  # a pair whose completions share their first tokens (ld_alpha)
    if conversational:
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    return Dataset.from_list(rows)


def _model(model_type: str, seed: int):
    tokenizer = char_tokenizer()
    overrides = {**SIZES, **MODELS[model_type], "vocab_size": len(tokenizer)}
    return tiny_model(model_type, seed=seed, attn_implementation=ATTENTION.get(model_type, "sdpa"), **overrides)


def one_step(
    trainer_class, config_class, tmp_path, *, model_type="llama", reference="model", dataset=None, **config
) -> dict:
    """One training step's loss, metrics, per-pair log-probs and gradients of ``trainer_class`` on the dataset's
    first ``NUM_PAIRS`` pairs (one batch)."""
    from peft import LoraConfig, get_peft_model

    tokenizer = char_tokenizer()
    policy = _model(model_type, seed=0)
    ref_model = None
    if reference == "model":
        ref_model = _model(model_type, seed=1)
    elif reference == "peft":
        policy = get_peft_model(
            policy, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    args = config_class(
        output_dir=str(tmp_path),
        per_device_train_batch_size=NUM_PAIRS,
        report_to=[],
        bf16=False,
        use_cpu=True,
        precompute_ref_log_probs=reference == "precompute",
        **config,
    )
    trainer = trainer_class(
        model=policy, ref_model=ref_model, args=args, train_dataset=dataset or _pairs(), processing_class=tokenizer
    )
    return one_dpo_step(trainer, [trainer.train_dataset[i] for i in range(NUM_PAIRS)])


def _error(actual, expected, scale: float | None = None) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    scale = expected.abs().max().clamp(min=1e-6) if scale is None else scale
    return float((actual - expected).abs().max() / scale)


def _close(actual, expected, what: str, scale: float | None = None, tolerance: float = REL) -> None:
    error = _error(actual, expected, scale)
    values = [torch.as_tensor(x).tolist() for x in (actual, expected)]
    assert error <= tolerance, f"{what}: relative error {error:.2e} ({values[0]} vs {values[1]})"


def stock_noise_floor(stock: dict, stock_repadded: dict) -> float:
    """The largest per-tensor relative gradient difference of stock TRL to itself when only its padding width
    changes: the fp32 rounding floor of a comparison where repadding changes stock's rounding (on some CPUs it
    does not: on a 2-core AVX-512 one, torch 2.11 and 2.13, stock's log-probs come out bit for bit and the floor is
    3e-7; see ``GRAD_TOLERANCE``)."""
    return max(_error(stock_repadded["grads"][name], grad) for name, grad in stock["grads"].items())


def _tied_pairs(step: dict, tolerance: float) -> int:
    """How many pairs of the step have a reward margin within ``tolerance`` of 0, where the batch carries the
    reference log-probs (precomputed); 0 otherwise."""
    batch = step["batch"]
    if "ref_chosen_logps" not in batch:
        return 0
    chosen, rejected = step["logps"].double()
    ref_chosen, ref_rejected = batch["ref_chosen_logps"].double().cpu(), batch["ref_rejected_logps"].double().cpu()
    margins = step["trainer"].beta * ((chosen.cpu() - ref_chosen) - (rejected.cpu() - ref_rejected))
    return int((margins.abs() <= tolerance).sum())


def assert_same_step(ours: dict, stock: dict, floor=None, grad_tolerance: float = REL) -> None:
    """``ours`` == ``stock``: loss, log-probs and metrics within ``REL``; every gradient within ``grad_tolerance``
    relative to its tensor's largest entry, or, where the loss amplifies rounding past that, within twice ``floor()``
    (stock's own difference when only its padding width changes, :func:`stock_noise_floor`)."""
    _close(ours["loss"], stock["loss"], "loss")
    _close(ours["logps"], stock["logps"], "chosen/rejected log-probs")
    assert ours["metrics"].keys() == stock["metrics"].keys()
    beta = stock["trainer"].beta
    for key, value in stock["metrics"].items():
        # Rewards and margins are beta * (differences of log-probs): relative to the log-probs they come from.
        scale = beta * float(stock["logps"].abs().max()) if key.startswith("rewards/") else None
        if key == "rewards/accuracies":
            # The share of pairs with chosen reward > rejected: a pair whose margin is 0 within that tolerance (a tie
            # in exact arithmetic, e.g. every pair at step 1 with precomputed reference log-probs) may count either way.
            ties = _tied_pairs(stock, REL * scale)
            message = f"metric {key}: {ours['metrics'][key]} vs {value}, {ties} tied pairs"
            assert abs(ours["metrics"][key] - value) <= ties / NUM_PAIRS + 1e-9, message
            continue
        _close(ours["metrics"][key], value, f"metric {key}", scale)
    assert ours["grads"].keys() == stock["grads"].keys()
    tolerance = grad_tolerance
    largest = max(_error(ours["grads"][name], grad) for name, grad in stock["grads"].items())
    if floor is not None and largest > tolerance:
        tolerance = max(tolerance, 2 * floor())
    for name, grad in stock["grads"].items():
        _close(ours["grads"][name], grad, f"gradient of {name}", tolerance=tolerance)


def compare(tmp_path, *, prefix_sharing: bool = True, grad_tolerance: float = REL, **kwargs) -> dict:
    stock = one_step(trl.DPOTrainer, trl.DPOConfig, tmp_path / "stock", **kwargs)
    ours = one_step(DPOTrainer, DPOConfig, tmp_path / "ours", prefix_sharing=prefix_sharing, **kwargs)
    assert ours["trainer"].unpack_decision.packed, ours["trainer"].unpack_decision.reason
    assert "packed_input_ids" in ours["trainer"].data_collator([ours["trainer"].train_dataset[0]])

    def floor() -> float:
        repadded = one_step(trl.DPOTrainer, trl.DPOConfig, tmp_path / "stock64", pad_to_multiple_of=64, **kwargs)
        return stock_noise_floor(stock, repadded)

    assert_same_step(ours, stock, floor, grad_tolerance)
    return ours


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_equals_stock(loss_type, tmp_path):
    label_smoothing = 0.1 if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0
    compare(tmp_path, loss_type=[loss_type], label_smoothing=label_smoothing)


@pytest.mark.parametrize(
    "config",
    [
        dict(loss_type=["sigmoid", "sft", "ipo"], loss_weights=[1.0, 0.5, 0.25]),
        dict(ld_alpha=0.5),
        dict(use_weighting=True),
        dict(f_divergence_type="forward_kl"),
        dict(f_divergence_type="js_divergence"),
        dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5),
        dict(label_smoothing=0.2),
    ],
    ids=["loss_weights", "ld_alpha", "use_weighting", "forward_kl", "js_divergence", "alpha_divergence", "smoothing"],
)
def test_loss_options_equal_stock(config, tmp_path):
    compare(tmp_path, grad_tolerance=GRAD_TOLERANCE.get(config.get("f_divergence_type"), REL), **config)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "qwen3_moe"])
def test_architectures_equal_stock(model_type, tmp_path):
    ours = compare(tmp_path, model_type=model_type)
    if model_type == "qwen3_moe":
        assert "aux_loss" in ours["metrics"]


@pytest.mark.parametrize("reference", ["peft", "precompute"])
def test_reference_variants_equal_stock(reference, tmp_path):
    compare(tmp_path, reference=reference)


def test_without_prefix_sharing_equals_stock(tmp_path):
    ours = compare(tmp_path, prefix_sharing=False)
    batch = ours["trainer"].data_collator([ours["trainer"].train_dataset[0]])
    assert batch["packed_seq_parents"].tolist() == [-1, -1]


def test_truncation_equals_stock(tmp_path):
    for mode in ("keep_start", "keep_end"):
        compare(tmp_path / mode, max_length=10, truncation_mode=mode)


def test_conversational_pairs_equal_stock(tmp_path):
    compare(tmp_path, dataset=_pairs(conversational=True))


@pytest.mark.parametrize("reference", ["model", "peft"])
def test_the_lm_head_scores_only_the_completion_tokens(reference, tmp_path):
    """The fused LM head of the policy and of the reference runs on one compact row of the positions whose next
    token is a completion token (plus the one TRL's shift drops), not on the padded view; the step still equals
    stock (``compare``), so the scattered-back log-probs, metrics and gradients are the view's."""
    from accelerate.utils import is_peft_model

    trainer = compare(tmp_path, reference=reference)["trainer"]
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(NUM_PAIRS)]))
    scored = int(batch["completion_mask"][:, 1:].sum())
    assert scored < batch["completion_mask"][:, 1:].numel()  # the view has padding the head no longer scores
    shapes = []
    handles = []
    for model in (trainer.model, trainer.ref_model):  # no ref_model with LoRA: the policy, its adapter disabled
        if model is not None:
            model = trainer.accelerator.unwrap_model(model)
            decoder = (model.get_base_model() if is_peft_model(model) else model).base_model
            hook = decoder.register_forward_hook(
                lambda module, args, output: shapes.append(output.last_hidden_state.shape)
            )
            handles.append(hook)
    try:
        trainer.compute_loss(trainer.model, batch)
    finally:
        for handle in handles:
            handle.remove()
    hidden = trainer.model.config.hidden_size
    assert [tuple(shape) for shape in shapes] == [(1, scored + 1, hidden)] * 2  # the policy, then the reference
    for model in (trainer.model, trainer.ref_model):  # the class's signature stays (`generate` checks kwargs on it)
        if model is not None:
            model = trainer.accelerator.unwrap_model(model)
            lm = model.get_base_model() if is_peft_model(model) else model
            assert (
                list(inspect.signature(lm.forward).parameters)
                == list(inspect.signature(type(lm).forward).parameters)[1:]
            )


# -- decisions, switches, fallbacks and a real run ------------------------------------------------------------------


def _trainer(tmp_path, *, args=None, **kwargs):
    tokenizer = char_tokenizer()
    if args is None:
        args = DPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], bf16=False, use_cpu=True
        )
    return DPOTrainer(
        model=_model("llama", 0),
        ref_model=_model("llama", 1),
        args=args,
        train_dataset=_pairs(),
        processing_class=tokenizer,
        **kwargs,
    )


def test_padding_free_false_is_stock(tmp_path):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    args = DPOConfig(output_dir=str(tmp_path), padding_free=False, report_to=[], bf16=False, use_cpu=True)
    trainer = _trainer(tmp_path, args=args)
    assert not trainer.unpack_decision.packed and "padding_free=False" in trainer.unpack_decision.reason
    assert type(trainer.data_collator) is DataCollatorForPreference


def test_unpack_disable_is_stock(tmp_path, monkeypatch):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    monkeypatch.setenv("UNPACK_DISABLE", "1")
    trainer = _trainer(tmp_path)
    assert trainer.unpack_decision.mode == "stock"
    assert type(trainer.data_collator) is DataCollatorForPreference


def test_packing_true_is_logged_as_per_batch_rows(tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), packing=True, report_to=[], bf16=False, use_cpu=True)
    trainer = _trainer(tmp_path, args=args)
    assert trainer.unpack_decision.packed and "pairs of each batch" in trainer.unpack_decision.reason


def test_custom_collator_keeps_padded_batches_with_the_reason(tmp_path):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collator = DataCollatorForPreference(pad_token_id=0)
    trainer = _trainer(tmp_path, data_collator=collator)
    assert not trainer.unpack_decision.packed and trainer.data_collator is collator
    assert "custom data_collator" in trainer.unpack_decision.reason


def test_a_plain_trl_config_gets_our_defaults(tmp_path):
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, beta=0.3)
    trainer = _trainer(tmp_path, args=args)
    assert trainer.unpack_decision.packed and trainer.args.prefix_sharing and trainer.args.beta == 0.3
    assert trainer.data_collator.prefix_sharing


def test_a_failed_self_check_trains_padded(tmp_path, monkeypatch):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from unpack_trainer import selfcheck
    from unpack_trainer.trainers import contamination

    failed = selfcheck.ContaminationReport(False, 1.0, 1e-4, float("nan"), torch.float32, 0.0)
    monkeypatch.setattr(contamination, "check_uncontaminated", lambda *a, **k: failed)
    trainer = _trainer(tmp_path)
    assert trainer.unpack_decision.packed
    trainer.get_train_dataloader()
    assert not trainer.unpack_decision.packed and "self-check failed" in trainer.unpack_decision.reason
    assert type(trainer.data_collator) is DataCollatorForPreference
    monkeypatch.setenv("UNPACK_STRICT", "1")
    with pytest.raises(RuntimeError, match="UNPACK_STRICT"):
        _trainer(tmp_path).get_train_dataloader()


def test_the_self_check_passes_on_a_real_run(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.get_train_dataloader()
    assert trainer.unpack_selfcheck.ok and trainer.unpack_decision.packed
    assert trainer.unpack_selfcheck_branched.ok and trainer.data_collator.prefix_sharing


def test_without_prefix_sharing_no_branched_row_is_probed(tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), prefix_sharing=False, report_to=[], bf16=False, use_cpu=True)
    trainer = _trainer(tmp_path, args=args)
    trainer.get_train_dataloader()
    assert trainer.unpack_selfcheck.ok and trainer.unpack_selfcheck_branched is None


@pytest.mark.parametrize("kind", ["sibling", "parents"])
def test_a_leaking_branched_path_turns_prefix_sharing_off_and_says_why(kind, tmp_path, leak_branches, caplog):
    """With prefix sharing the self-check also probes a branched row; when only that probe fails (a branch that sees
    its sibling, or misses its prompt), the narrowest fallback: the pairs stay packed, unshared ([p, c] and [p, r],
    which the plain probe passed), logged once with the measured difference. UNPACK_STRICT=1 raises instead."""
    leak_branches(kind)
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[], bf16=False,
                     use_cpu=True)  # fmt: skip
    trainer = _trainer(tmp_path, args=args)
    assert trainer.data_collator.prefix_sharing
    with caplog.at_level("INFO", logger="unpack_trainer"):
        trainer.train()
        trainer.evaluate(_pairs(2))
    assert trainer.unpack_selfcheck.ok and not trainer.unpack_selfcheck_branched.ok
    assert trainer.unpack_decision.packed and trainer.data_collator.prefix_sharing is False
    messages = [r.getMessage() for r in caplog.records if "prefix sharing is off" in r.getMessage()]
    assert len(messages) == 1, messages
    assert "max |packed - one-by-one|" in messages[0] and "[prompt, rejected]" in messages[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNPACK_STRICT", "1")
        with pytest.raises(RuntimeError, match="UNPACK_STRICT"):
            _trainer(tmp_path).get_train_dataloader()


@pytest.mark.parametrize("conversational", [False, True])
def test_train_and_evaluate_on_the_embedded_preference_set(conversational, tmp_path):
    from peft import LoraConfig
    from transformers import LlamaForCausalLM

    from unpack_trainer import load_default_tokenizer, tiny_model_config
    from unpack_trainer.data.default_preference_data import load_default_preference_dataset

    tokenizer = load_default_tokenizer()
    config = tiny_model_config(tokenizer)
    config.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8))  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    train = load_default_preference_dataset("train", conversational=conversational).select(range(16))
    evaluation = load_default_preference_dataset("eval", conversational=conversational).select(range(8))
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, max_length=256,
                     report_to=[], bf16=False, use_cpu=True, eval_strategy="no")  # fmt: skip
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, target_modules="all-linear"),
    )
    assert trainer.unpack_decision.packed
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    metrics = trainer.evaluate()
    assert "eval_rewards/accuracies" in metrics and torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_the_collator_matches_its_worked_example():
    from unpack_trainer.data.preference import DataCollatorForPackedPreference

    batch = DataCollatorForPackedPreference(pad_token_id=0)(
        [{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9]}]
    )
    assert batch["packed_input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["packed_seq_lengths"].tolist() == [2, 1, 2]
    assert batch["packed_seq_parents"].tolist() == [-1, 0, 0]
    assert batch["packed_position_ids"].tolist() == [[0, 1, 2, 2, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["packed_token_index"].tolist() == [[0, 1, 2, 0], [0, 1, 3, 4]]
    assert batch["input_ids"].tolist() == [[6, 7, 0], [6, 8, 9]]
    assert batch["completion_mask"].tolist() == [[0, 1, 0], [0, 1, 1]]
    assert batch["packed_view_index"].tolist() == [[1, 2, 0], [1, 3, 4]]


def test_a_model_whose_mixers_carry_state_packs_pairs_unshared_and_says_why(tmp_path, caplog):
    """A branch cannot continue a recurrent or convolution state from its prompt when mixers run per sample, so the
    default prefix sharing is turned off for such a model (logged with the reason) instead of failing at the first
    step; the pairs are still packed, as [p, c] and [p, r]."""
    tokenizer = char_tokenizer()
    sizes = dict(hidden_size=32, vocab_size=len(tokenizer), max_position_embeddings=256)
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], bf16=False, use_cpu=True)
    with caplog.at_level("INFO", logger="unpack_trainer"):
        trainer = DPOTrainer(
            model=tiny_model("lfm2", seed=0, **sizes),
            ref_model=tiny_model("lfm2", seed=1, **sizes),
            args=args,
            train_dataset=_pairs(),
            processing_class=tokenizer,
        )
    assert trainer.unpack_decision.packed
    assert trainer.data_collator.prefix_sharing is False
    assert any("prefix_sharing" in r.getMessage() and "Lfm2ShortConv" in r.getMessage() for r in caplog.records)
    trainer.train()
