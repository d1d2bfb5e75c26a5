"""unpack_trainer.KTOTrainer == trl.KTOTrainer on the same unpaired examples: one step's loss, every logged metric
(the KL estimate included), the per-example log-probs (main and KL sequences) and every gradient, fp32 relative 1e-5;
both loss types TRL 1.16 offers (``kto`` with its KL rows, ``apo_zero_unpaired`` without), desirable / undesirable
weights, a batch of one label only, truncation, conversational data; llama, qwen3_moe (auxiliary loss), gemma2
(softcap); full fine-tuning with a separate reference model, LoRA (reference = the frozen "ref" adapter, or the
adapter disabled), precomputed reference log-probs, QLoRA (bf16 adapters: bf16's tolerance); prompts shared and not;
gradient accumulation over a real ``train()``; a contamination probe; the switches (``UNPACK_DISABLE``,
``padding_free=False``, a custom collator), the self-check's fallback, and image data (packed: ``tests/test_kto_trainer_vision.py``)."""

from __future__ import annotations

import random

import pytest
import torch
import trl
from datasets import Dataset
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from unpack_trainer.configs import KTOConfig
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model
from unpack_trainer.trainers.kto import KTOTrainer

REL = 1e-5
SIZES = dict(hidden_size=32, max_position_embeddings=256, head_dim=8)
BATCH = 4

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _examples(n: int = BATCH, seed: int = 0, conversational: bool = False, labels=None) -> Dataset:
    """``n`` unpaired examples; examples 1, 2 and 3 share their prompt, so the KL sequences of examples 2 and 3 (TRL
    pairs each prompt with the previous example's completion) are the main sequences of examples 1 and 2."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(low, high)))

    rows = [{"prompt": text(3, 12), "completion": text(1, 9), "label": i % 3 != 1} for i in range(n)]
    if n >= 4:
        rows[2]["prompt"] = rows[1]["prompt"]
        rows[3]["prompt"] = rows[2]["prompt"]
    if labels is not None:
        for row, label in zip(rows, labels, strict=True):
            row["label"] = label
    if conversational:
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "completion": [{"role": "assistant", "content": r["completion"]}],
                "label": r["label"],
            }
            for r in rows
        ]
    return Dataset.from_list(rows)


MODELS = {
    "llama": {},
    "qwen3_moe": dict(router_aux_loss_coef=0.3),
    "gemma2": dict(attn_logit_softcapping=20.0, final_logit_softcapping=15.0, query_pre_attn_scalar=8),
}
ATTENTION = {"gemma2": "eager"}


def _model(seed: int, model_type: str = "llama"):
    overrides = {**SIZES, **MODELS[model_type], "vocab_size": len(char_tokenizer())}
    return tiny_model(model_type, seed=seed, attn_implementation=ATTENTION.get(model_type, "sdpa"), **overrides)


def _policy_and_reference(reference: str, model_type: str = "llama"):
    from peft import LoraConfig, get_peft_model

    policy, ref_model, extra = _model(0, model_type), None, {}
    if reference == "model":
        ref_model = _model(1, model_type)
    elif reference == "peft":  # a PeftModel: TRL copies its adapter into a frozen "ref" adapter
        policy = get_peft_model(
            policy, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    elif reference == "peft_config":  # LoRA from a config: the reference is the adapter disabled
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    return policy, ref_model, extra


def _args(config_class, tmp_path, *, reference: str = "model", **config):
    return config_class(
        output_dir=str(tmp_path),
        per_device_train_batch_size=config.pop("per_device_train_batch_size", BATCH),
        report_to=[],
        bf16=False,
        use_cpu=True,
        precompute_ref_log_probs=reference == "precompute",
        **config,
    )


def one_step(
    trainer_class,
    config_class,
    tmp_path,
    *,
    reference: str = "model",
    dataset=None,
    model_type: str = "llama",
    **config,
) -> dict:
    """One training step's loss, metrics, per-example log-probs and gradients of ``trainer_class`` on the dataset's
    first ``BATCH`` examples (one batch)."""
    torch.manual_seed(0)
    policy, ref_model, extra = _policy_and_reference(reference, model_type)
    args = _args(config_class, tmp_path, reference=reference, **config)
    trainer = trainer_class(
        model=policy,
        ref_model=ref_model,
        args=args,
        train_dataset=dataset or _examples(),
        processing_class=char_tokenizer(),
        **extra,
    )
    if reference in ("peft", "peft_config"):  # as after some training: the policy's adapter is not the reference's
        generator = torch.Generator().manual_seed(7)
        for name, parameter in trainer.model.named_parameters():
            if ".default." in name:
                parameter.data += 0.2 * torch.randn(parameter.shape, generator=generator)
    examples = [trainer.train_dataset[i] for i in range(BATCH)]
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    model = trainer.model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    # The policy's log-probs of every main and KL sequence, as the precompute path computes them (no gradient).
    with torch.no_grad():
        main, kl = trainer.compute_ref_log_probs(model, trainer._prepare_inputs(trainer.data_collator(examples)))
    logps = torch.stack([main, kl]) if kl is not None else main[None]
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return {"loss": loss.detach(), "grads": grads, "metrics": metrics, "logps": logps, "trainer": trainer,
            "batch": batch}  # fmt: skip


def _error(actual, expected, scale: float | None = None) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    scale = expected.abs().max().clamp(min=1e-6) if scale is None else scale
    return float((actual - expected).abs().max() / scale)


def _close(actual, expected, what: str, scale: float | None = None, tolerance: float = REL) -> None:
    error = _error(actual, expected, scale)
    values = [torch.as_tensor(x).tolist() for x in (actual, expected)]
    assert error <= tolerance, f"{what}: relative error {error:.2e} ({values[0]} vs {values[1]})"


def assert_same_step(ours: dict, stock: dict) -> None:
    """``ours`` == ``stock``: loss, log-probs, every metric and every gradient within ``REL`` (a reward and the KL
    estimate relative to the log-probs they are differences of, a gradient relative to its tensor's largest entry)."""
    _close(ours["loss"], stock["loss"], "loss")
    _close(ours["logps"], stock["logps"], "main / KL log-probs")
    assert ours["metrics"].keys() == stock["metrics"].keys()
    beta = stock["trainer"].beta
    logps_scale = float(stock["logps"].abs().max())
    for key, value in stock["metrics"].items():
        scale = None
        if key.startswith("rewards/"):
            scale = beta * logps_scale
        elif key == "kl":
            scale = logps_scale
        _close(ours["metrics"][key], value, f"metric {key}", scale)
    assert ours["grads"].keys() == stock["grads"].keys()
    for name, grad in stock["grads"].items():
        _close(ours["grads"][name], grad, f"gradient of {name}")


def compare(tmp_path, *, prefix_sharing: bool = True, **kwargs) -> dict:
    stock = one_step(trl.KTOTrainer, trl.KTOConfig, tmp_path / "stock", **kwargs)
    ours = one_step(KTOTrainer, KTOConfig, tmp_path / "ours", prefix_sharing=prefix_sharing, **kwargs)
    trainer = ours["trainer"]
    assert trainer.unpack_decision.packed, trainer.unpack_decision.reason
    assert "packed_input_ids" in ours["batch"]
    assert_same_step(ours, stock)
    return ours


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_every_loss_type_equals_stock(loss_type, tmp_path):
    ours = compare(tmp_path, loss_type=loss_type)
    assert ("kl" in ours["metrics"]) and (ours["logps"].shape[0] == (2 if loss_type == "kto" else 1))


@pytest.mark.parametrize(
    "config",
    [
        dict(desirable_weight=1.7, undesirable_weight=0.6, beta=0.3),
        dict(max_length=11, dataset=_examples(8)),
        dict(dataset=_examples(labels=[True, True, True, True])),
        dict(dataset=_examples(labels=[False, False, False, False]), loss_type="apo_zero_unpaired"),
        dict(dataset=_examples(conversational=True)),
    ],
    ids=["weights", "truncation", "all_desirable", "all_undesirable", "conversational"],
)
def test_options_and_batches_equal_stock(config, tmp_path):
    ours = compare(tmp_path, **config)
    if "max_length" in config:  # some sequence of the batch was cut
        assert int(ours["batch"]["attention_mask"].sum(1).max()) == config["max_length"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma2"])
def test_architectures_equal_stock(model_type, tmp_path):
    ours = compare(tmp_path, model_type=model_type)
    if model_type == "qwen3_moe":
        assert "aux_loss" in ours["metrics"]


@pytest.mark.parametrize("reference", ["peft", "peft_config", "precompute"])
def test_reference_variants_equal_stock(reference, tmp_path):
    compare(tmp_path, reference=reference)


def test_without_prefix_sharing_equals_stock(tmp_path):
    ours = compare(tmp_path, prefix_sharing=False)
    assert (ours["batch"]["packed_seq_parents"] == -1).all()


def test_each_prompt_runs_once_per_forward(tmp_path):
    """The policy's row holds each distinct prompt once, its completions as branches; the reference's row also holds
    the KL completions, each (prompt, completion) once; the KL row of the policy (no gradient) each prompt once."""
    trainer = compare(tmp_path)["trainer"]
    examples = [trainer.train_dataset[i] for i in range(BATCH)]
    batch = trainer.data_collator(examples)
    prompts = {tuple(e["prompt_ids"]) for e in examples}
    main_pairs = {(tuple(e["prompt_ids"]), tuple(e["completion_ids"])) for e in examples}
    kl_pairs = {(tuple(e["prompt_ids"]), tuple(e["KL_completion_ids"])) for e in examples}
    prompt_tokens = sum(len(p) for p in prompts)
    main_tokens = prompt_tokens + sum(len(c) for _, c in main_pairs)
    assert batch["packed_input_ids"].shape[1] == main_tokens
    assert batch["packed_kl_row"]["packed_input_ids"].shape[1] == prompt_tokens + sum(len(c) for _, c in kl_pairs)
    both = main_pairs | kl_pairs
    assert batch["packed_ref_row"]["packed_input_ids"].shape[1] == prompt_tokens + sum(len(c) for _, c in both)
    assert len(both) < len(main_pairs) + len(kl_pairs)  # example 3's KL sequence is example 2's main sequence


def test_the_collator_matches_its_worked_example():
    from unpack_trainer.data.kto import DataCollatorForPackedUnpairedPreference

    examples = [
        {"prompt_ids": [5, 6], "completion_ids": [7], "KL_completion_ids": [9, 8], "label": True},
        {"prompt_ids": [5, 6], "completion_ids": [9, 8], "KL_completion_ids": [7], "label": False},
    ]
    batch = DataCollatorForPackedUnpairedPreference(pad_token_id=0)(examples)
    assert batch["packed_input_ids"].tolist() == [[5, 6, 7, 9, 8]]
    assert batch["packed_seq_lengths"].tolist() == [2, 1, 2]
    assert batch["packed_seq_parents"].tolist() == [-1, 0, 0]
    assert batch["packed_position_ids"].tolist() == [[0, 1, 2, 2, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["input_ids"].tolist() == [[6, 7, 0], [6, 9, 8]]
    assert batch["completion_mask"].tolist() == [[0, 1, 0], [0, 1, 1]]
    assert batch["packed_view_index"].tolist() == [[1, 2, 0], [1, 3, 4]]
    kl = batch["packed_kl_row"]
    assert kl["packed_input_ids"].tolist() == [[5, 6, 9, 8, 7]]
    assert kl["input_ids"].tolist() == [[6, 9, 8], [6, 7, 0]]
    assert kl["labels"].tolist() == [[-100, 9, 8], [-100, 7, -100]]
    ref = batch["packed_ref_row"]  # main rows, then KL rows; (5 6, 7) and (5 6, 9 8) once each
    assert ref["packed_input_ids"].tolist() == [[5, 6, 7, 9, 8]]
    assert ref["packed_view_index"].tolist() == [[1, 2, 0], [1, 3, 4], [1, 3, 4], [1, 2, 0]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(3, 9), max_size=4)), min_size=1, max_size=8),
    st.sampled_from([None, 3, 5]),
    st.booleans(),
)
def test_every_sequence_is_read_back_from_the_packed_row(rows, max_length, prefix_sharing):
    """Property: each view row's tokens, read from the packed row through ``packed_token_index``, are its truncated
    sequence in order, at positions 0.. (a branch continues its prompt's), and with prompts shared each distinct
    (kept prompt, rest) occurs once on the row."""
    from unpack_trainer.data.kto import pack_unpaired_sequences

    prompts = [[], [5], [5, 6, 7], [8, 6]]
    sequences = [(prompts[p], c) for p, c in rows]
    assume(any(prompt or completion for prompt, completion in sequences))  # TRL appends EOS to every completion
    packed = pack_unpaired_sequences(sequences, max_length=max_length, prefix_sharing=prefix_sharing)
    ids, positions = packed["packed_input_ids"][0], packed["packed_position_ids"][0]
    index = packed["packed_token_index"]
    distinct = set()
    for row, (prompt, completion) in enumerate(sequences):
        expected = (prompt + completion)[:max_length]
        length = len(expected)
        assert ids[index[row, :length]].tolist() == expected
        assert positions[index[row, :length]].tolist() == list(range(length))
        shared = min(len(prompt), length)
        distinct.add((tuple(expected[:shared]), tuple(expected[shared:])))
    if prefix_sharing:
        prompt_tokens = sum(len(p) for p in {kept for kept, _ in distinct})
        assert ids.numel() == prompt_tokens + sum(len(rest) for _, rest in distinct)


# -- gradient accumulation over a real train(), and the contamination probe ----------------------------------------


def _train_once(trainer_class, config_class, tmp_path, **config) -> tuple[dict, list[dict]]:
    """One optimizer step over two accumulated micro-batches of 2 examples: the accumulated gradients as the optimizer
    gets them (the step's loss scaled for accumulation, then clipped) and the log."""
    from transformers import TrainerCallback

    grads = {}

    class KeepGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})

    policy, ref_model, _ = _policy_and_reference("model")
    args = _args(config_class, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                 logging_steps=1, save_strategy="no", **config)  # fmt: skip
    trainer = trainer_class(model=policy, ref_model=ref_model, args=args, train_dataset=_examples(8),
                            processing_class=char_tokenizer(), callbacks=[KeepGradients()])  # fmt: skip
    trainer.train()
    return grads, trainer.state.log_history


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_gradient_accumulation_equals_stock(loss_type, tmp_path):
    stock, stock_log = _train_once(trl.KTOTrainer, trl.KTOConfig, tmp_path / "stock", loss_type=loss_type)
    ours, ours_log = _train_once(KTOTrainer, KTOConfig, tmp_path / "ours", loss_type=loss_type)
    assert ours.keys() == stock.keys() and stock
    for name, grad in stock.items():
        _close(ours[name], grad, f"accumulated gradient of {name}")
    logged, expected = ours_log[0], stock_log[0]
    assert logged.keys() == expected.keys()
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "entropy",
                "logits/chosen", "logits/rejected", "num_tokens", "grad_norm"):  # fmt: skip
        if key in expected:
            _close(logged[key], expected[key], key, scale=max(abs(expected[key]), 1e-3))


def test_perturbing_one_example_changes_only_its_own_sequences(tmp_path):
    """Contamination probe on the packed forwards: change example 0's completion; the log-probs of every main and
    KL sequence that does not hold it (all but main 0 and KL 1) stay bit for bit within 1e-6."""
    trainer = one_step(KTOTrainer, KTOConfig, tmp_path)["trainer"]
    examples = [dict(trainer.train_dataset[i]) for i in range(BATCH)]
    model = trainer.model.eval()

    def logps(examples):
        batch = trainer._prepare_inputs(trainer.data_collator(examples))
        with torch.no_grad():
            return torch.stack(trainer.compute_ref_log_probs(model, batch))

    before = logps(examples)
    examples[0]["completion_ids"] = [t + 1 for t in examples[0]["completion_ids"]]
    examples[1]["KL_completion_ids"] = examples[0]["completion_ids"]  # TRL's KL rotation: example 1 sees 0's
    after = logps(examples)
    changed = (before - after).abs() > 1e-6
    assert changed[0, 0] and changed[1, 1]
    changed[0, 0] = changed[1, 1] = False
    assert not changed.any(), (before - after).abs()


# -- decisions, switches, fallbacks --------------------------------------------------------------------------------


def _trainer(tmp_path, *, args=None, **kwargs):
    if args is None:
        args = _args(KTOConfig, tmp_path, per_device_train_batch_size=2)
    return KTOTrainer(model=_model(0), ref_model=_model(1), args=args, train_dataset=_examples(),
                      processing_class=char_tokenizer(), **kwargs)  # fmt: skip


def test_padding_free_false_is_stock(tmp_path):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    trainer = _trainer(tmp_path, args=_args(KTOConfig, tmp_path, padding_free=False))
    assert not trainer.unpack_decision.packed and "padding_free=False" in trainer.unpack_decision.reason
    assert type(trainer.data_collator) is DataCollatorForUnpairedPreference


def test_unpack_disable_is_stock(tmp_path, monkeypatch):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    monkeypatch.setenv("UNPACK_DISABLE", "1")
    trainer = _trainer(tmp_path)
    assert trainer.unpack_decision.mode == "stock"
    assert type(trainer.data_collator) is DataCollatorForUnpairedPreference
    stock = one_step(trl.KTOTrainer, trl.KTOConfig, tmp_path / "stock")
    ours = one_step(KTOTrainer, KTOConfig, tmp_path / "ours")
    assert "packed_input_ids" not in ours["batch"]
    assert_same_step(ours, stock)


def test_packing_true_is_logged_as_per_batch_rows(tmp_path):
    trainer = _trainer(tmp_path, args=_args(KTOConfig, tmp_path, packing=True))
    assert trainer.unpack_decision.packed and "examples of each batch" in trainer.unpack_decision.reason


def test_custom_collator_keeps_padded_batches_with_the_reason(tmp_path):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    collator = DataCollatorForUnpairedPreference(pad_token_id=0)
    trainer = _trainer(tmp_path, data_collator=collator)
    assert not trainer.unpack_decision.packed and trainer.data_collator is collator
    assert "custom data_collator" in trainer.unpack_decision.reason


def test_a_plain_trl_config_gets_our_defaults(tmp_path):
    args = trl.KTOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, beta=0.3,
                         per_device_train_batch_size=2)  # fmt: skip
    trainer = _trainer(tmp_path, args=args)
    assert trainer.unpack_decision.packed and trainer.args.prefix_sharing and trainer.args.beta == 0.3
    assert trainer.data_collator.prefix_sharing


def test_a_failed_self_check_trains_padded(tmp_path, monkeypatch):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from unpack_trainer import selfcheck
    from unpack_trainer.trainers import contamination

    failed = selfcheck.ContaminationReport(False, 1.0, 1e-4, float("nan"), torch.float32, 0.0)
    monkeypatch.setattr(contamination, "check_uncontaminated", lambda *a, **k: failed)
    trainer = _trainer(tmp_path)
    assert trainer.unpack_decision.packed
    trainer.get_train_dataloader()
    assert not trainer.unpack_decision.packed and "self-check failed" in trainer.unpack_decision.reason
    assert type(trainer.data_collator) is DataCollatorForUnpairedPreference
    monkeypatch.setenv("UNPACK_STRICT", "1")
    with pytest.raises(RuntimeError, match="UNPACK_STRICT"):
        _trainer(tmp_path).get_train_dataloader()


def test_train_and_evaluate_with_lora(tmp_path):
    """A short run with LoRA and an evaluation set: the self-checks pass, the loss and eval metrics are finite, and
    ``evaluate`` on a new dataset with precomputed reference log-probs goes through the packed reference forward."""
    from peft import LoraConfig

    args = _args(KTOConfig, tmp_path, reference="precompute", per_device_train_batch_size=2, max_steps=2,
                 eval_strategy="no", save_strategy="no")  # fmt: skip
    trainer = KTOTrainer(model=_model(0), args=args, train_dataset=_examples(8), eval_dataset=_examples(4, seed=1),
                         processing_class=char_tokenizer(),
                         peft_config=LoraConfig(r=4, target_modules="all-linear"))  # fmt: skip
    assert trainer.unpack_decision.packed
    result = trainer.train()
    assert trainer.unpack_selfcheck.ok and trainer.unpack_selfcheck_branched.ok
    assert torch.isfinite(torch.tensor(result.training_loss))
    metrics = trainer.evaluate()
    assert "eval_kl" in metrics and torch.isfinite(torch.tensor(metrics["eval_loss"]))
    metrics = trainer.evaluate(_examples(4, seed=2))
    assert "eval_kl" in metrics and torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_an_image_dataset_packs_through_the_vision_collator(tmp_path):
    """TRL 1.16's KTO trains vision-language models on image data (its vision collator); ours packs it (TRL's
    vision batch as the view, ``tests/test_kto_trainer_vision.py`` for the whole step), and its loss is stock's."""
    from random_images import random_image

    from unpack_trainer.data.kto import DataCollatorForPackedVisionUnpairedPreference
    from unpack_trainer.model_zoo.tiny_vision import tiny_processor, tiny_vision_model

    rows = [
        {
            "images": [random_image(56 + 7 * i, 63, i)],
            "prompt": [{"role": "user", "content": "describe" + "?" * i}],
            "completion": [{"role": "assistant", "content": "a shape " * (i % 2 + 1)}],
            "label": i % 2 == 0,
        }
        for i in range(BATCH)
    ]

    def step(trainer_class, config_class, path):
        args = _args(config_class, path)
        trainer = trainer_class(model=tiny_vision_model("qwen2_5_vl", seed=0, attn_implementation="sdpa"),
                                ref_model=tiny_vision_model("qwen2_5_vl", seed=1, attn_implementation="sdpa"),
                                args=args, train_dataset=Dataset.from_list(rows),
                                processing_class=tiny_processor("qwen2_5_vl"))  # fmt: skip
        batch = trainer._prepare_inputs(trainer.data_collator([dict(row) for row in rows]))
        loss = trainer.compute_loss(trainer.model.train(), batch)
        return trainer, loss.detach()

    ours, loss = step(KTOTrainer, KTOConfig, tmp_path / "ours")
    assert ours.unpack_decision.packed, ours.unpack_decision.reason
    assert type(ours.data_collator) is DataCollatorForPackedVisionUnpairedPreference
    _, stock_loss = step(trl.KTOTrainer, trl.KTOConfig, tmp_path / "stock")
    _close(loss, stock_loss, "loss")


def test_qlora_step_equals_stock(tmp_path):
    """QLoRA: a 4-bit base model (bitsandbytes) with a LoRA config, the reference = the adapters disabled. TRL keeps
    the adapters in bf16 for a quantized model, so loss, metrics and gradients are compared within bf16's tolerance; a
    real ``train()`` step runs the self-check first, which must leave the 4-bit weights trainable (read-only)."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback

    _model(0).save_pretrained(tmp_path / "base")

    def run(trainer_class, config_class, path):
        grads = {}

        class KeepGradients(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                grads.update({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})

        model = AutoModelForCausalLM.from_pretrained(
            tmp_path / "base",
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
        )
        args = _args(config_class, path, max_steps=1, logging_steps=1, save_strategy="no")
        trainer = trainer_class(model=model, args=args, train_dataset=_examples(), processing_class=char_tokenizer(),
                                callbacks=[KeepGradients()],
                                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))  # fmt: skip
        trainer.train()
        return trainer, grads, trainer.state.log_history[0]

    ours, ours_grads, ours_log = run(KTOTrainer, KTOConfig, tmp_path / "ours")
    assert ours.unpack_decision.packed and ours.unpack_selfcheck.ok, ours.unpack_decision
    _, stock_grads, stock_log = run(trl.KTOTrainer, trl.KTOConfig, tmp_path / "stock")
    assert ours_grads.keys() == stock_grads.keys() and stock_grads
    for name, grad in stock_grads.items():
        _close(ours_grads[name], grad, f"gradient of {name}", tolerance=1e-2)
    for key in ("loss", "kl", "logps/chosen", "logps/rejected", "entropy"):
        _close(ours_log[key], stock_log[key], key, scale=max(abs(stock_log[key]), 1e-3), tolerance=1e-2)
