"""unpack_trainer.RewardTrainer == trl.RewardTrainer on the same pairs: one step's loss, every logged metric
(accuracy, margin, min/mean/max reward, num_tokens) and every gradient, fp32 within 1e-5 of the largest; with and
without a ``margin`` column, ``center_rewards_coefficient``, LoRA (``task_type="SEQ_CLS"``, the score head trained);
llama, qwen3 (sliding window), gemma2 (softcap), qwen3_moe, mistral (sliding window); explicit, implicit and
conversational prompts; prompts shared and not; evaluation metrics with ``compute_metrics``; the self-check on the
classification model, the fallbacks and the switches."""

from __future__ import annotations

import random

import pytest
import torch
import trl
from datasets import Dataset

from unpack_trainer._logging import announce_level
from unpack_trainer.configs import RewardConfig
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_config
from unpack_trainer.trainers.reward import DataCollatorForPackedReward, RewardTrainer

REL = 1e-5
NUM_PAIRS = 4
SIZES = dict(hidden_size=32, max_position_embeddings=256, sliding_window=6, head_dim=8, num_labels=1)
MODELS = {
    "llama": {},
    "qwen3": dict(use_sliding_window=True, max_window_layers=1),
    "gemma2": dict(attn_logit_softcapping=20.0, final_logit_softcapping=15.0, query_pre_attn_scalar=8),
    "qwen3_moe": {},
    "mistral": {},
}
ATTENTION = {"gemma2": "eager"}


def _pairs(n: int = NUM_PAIRS, *, seed: int = 0, margin: bool = False, kind: str = "explicit") -> Dataset:
    """``n`` pairs over a few letters: an explicit prompt (default), the prompt inside both (``"implicit"``), or
    conversational; one pair whose completions share their first tokens, one whose chosen is a prefix of rejected."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(low, high)))

    rows = [{"prompt": text(3, 12), "chosen": text(1, 9), "rejected": text(1, 9)} for _ in range(n)]
    rows[0]["chosen"] = rows[0]["rejected"][:2] + "x"
    rows[1]["rejected"] = rows[1]["chosen"] + "yz"
    if kind == "implicit":
        rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    elif kind == "conversational":
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    if margin:
        for row in rows:
            row["margin"] = rng.uniform(-1.0, 1.0)
    return Dataset.from_list(rows)


def _model(model_type: str = "llama", seed: int = 0):
    from transformers import AutoModelForSequenceClassification

    config = tiny_config(model_type, **{**SIZES, **MODELS[model_type], "vocab_size": len(char_tokenizer())})
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(
        config, attn_implementation=ATTENTION.get(model_type, "sdpa")
    )


def _args(config_class, tmp_path, **config):
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=NUM_PAIRS, report_to=[], bf16=False,
                    use_cpu=True, save_strategy="no")  # fmt: skip
    return config_class(**(defaults | config))


def one_step(
    trainer_class, config_class, tmp_path, *, model_type="llama", lora=False, dataset=None, eos_pad=False, **config
):
    """One training step of ``trainer_class`` on the dataset's first ``NUM_PAIRS`` pairs (one batch): the loss, every
    parameter gradient, the last logged value of every train metric, the trainer and the batch. ``eos_pad``: the
    tokenizer pads with its end-of-sequence token (TRL's choice for a tokenizer without a padding token)."""
    tokenizer = char_tokenizer()
    if eos_pad:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear",
                                 init_lora_weights=False)  # fmt: skip
    trainer = trainer_class(
        model=_model(model_type),
        args=_args(config_class, tmp_path, **config),
        train_dataset=dataset if dataset is not None else _pairs(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(NUM_PAIRS)]))
    model = trainer.model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return {"loss": loss.detach(), "grads": grads, "metrics": metrics, "trainer": trainer, "batch": batch}


def _close(actual, expected, what: str, scale: float | None = None) -> None:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    scale = float(expected.abs().max().clamp(min=1e-6)) if scale is None else scale
    error = float((actual - expected).abs().max()) / scale
    assert error <= REL, f"{what}: relative error {error:.2e} ({actual.tolist()} vs {expected.tolist()})"


def compare(tmp_path, *, prefix_sharing: bool = True, **kwargs) -> dict:
    stock = one_step(trl.RewardTrainer, trl.RewardConfig, tmp_path / "stock", **kwargs)
    ours = one_step(RewardTrainer, RewardConfig, tmp_path / "ours", prefix_sharing=prefix_sharing, **kwargs)
    assert ours["trainer"].unpack_decision.packed, ours["trainer"].unpack_decision.reason
    assert "packed_input_ids" in ours["batch"]
    _close(ours["loss"], stock["loss"], "loss")
    assert ours["metrics"].keys() == stock["metrics"].keys()
    rewards = max(abs(stock["metrics"][key]) for key in ("min_reward", "max_reward"))
    for key, value in stock["metrics"].items():
        # rewards, their differences and means: relative to the largest reward they come from
        _close(ours["metrics"][key], value, f"metric {key}", None if key in ("accuracy", "num_tokens") else rewards)
    assert ours["grads"].keys() == stock["grads"].keys()
    for name, grad in stock["grads"].items():
        _close(ours["grads"][name], grad, f"gradient of {name}")
    return ours


@pytest.mark.parametrize(
    "config",
    [{}, dict(margin=True), dict(center_rewards_coefficient=0.5), dict(margin=True, center_rewards_coefficient=0.1)],
    ids=["plain", "margin", "center_rewards", "margin+center_rewards"],
)
def test_one_step_equals_stock(config, tmp_path):
    dataset = _pairs(margin=config.pop("margin", False))
    ours = compare(tmp_path, dataset=dataset, **config)
    batch = ours["batch"]
    assert (batch["packed_seq_parents"] >= 0).any()  # prompts shared
    assert ("margin" in batch) == ("margin" in dataset.column_names)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "qwen3_moe", "mistral"])
def test_architectures_equal_stock(model_type, tmp_path):
    compare(tmp_path, model_type=model_type)


def test_lora_with_the_score_head_trained_equals_stock(tmp_path):
    ours = compare(tmp_path, lora=True, dataset=_pairs(margin=True))
    trained = [name for name in ours["grads"] if "score" in name]
    assert trained and any("lora_" in name for name in ours["grads"]), sorted(ours["grads"])


@pytest.mark.parametrize("kind", ["implicit", "conversational"])
def test_implicit_and_conversational_prompts_equal_stock(kind, tmp_path):
    compare(tmp_path, dataset=_pairs(kind=kind))


def test_padding_with_the_eos_token_equals_stock(tmp_path):
    """With the end-of-sequence token as padding, stock scores each sequence at the token before its trailing EOS
    (its rightmost non-pad token); so does each packed sequence, also where that token is in the shared part (a
    chosen answer that starts the rejected one)."""
    ours = compare(tmp_path, eos_pad=True)
    assert ours["trainer"].model.config.pad_token_id == char_tokenizer().eos_token_id


def test_without_prefix_sharing_equals_stock(tmp_path):
    ours = compare(tmp_path, prefix_sharing=False)
    assert (ours["batch"]["packed_seq_parents"] == -1).all()


def test_evaluation_equals_stock(tmp_path):
    """``evaluate`` on held-out pairs (packed, also with ``compute_metrics``: its predictions are one score per
    sequence in TRL's order) logs what stock logs, and ``compute_metrics`` gets stock's predictions."""
    import numpy as np

    seen = {}

    def metrics(name):
        def compute(prediction):
            seen[name] = np.asarray(prediction.predictions)
            return {"mean_score": float(seen[name].mean())}

        return compute

    results = {}
    for name, trainer_class, config_class in (("stock", trl.RewardTrainer, trl.RewardConfig),
                                              ("ours", RewardTrainer, RewardConfig)):  # fmt: skip
        trainer = trainer_class(
            model=_model(),
            args=_args(config_class, tmp_path / name, per_device_eval_batch_size=3),
            train_dataset=_pairs(),
            eval_dataset=_pairs(7, seed=1, margin=True),
            processing_class=char_tokenizer(),
            compute_metrics=metrics(name),
        )
        results[name] = trainer.evaluate()
    assert results["ours"].keys() == results["stock"].keys()
    for key, value in results["stock"].items():
        if not key.endswith(("runtime", "per_second", "preparation_time")):
            _close(results["ours"][key], value, key, scale=max(1.0, abs(value)))
    np.testing.assert_allclose(seen["ours"], seen["stock"], rtol=0, atol=1e-6)


# -- the collator, decisions, switches, self-checks and fallbacks ---------------------------------------------------


def test_the_collator_matches_its_worked_example():
    batch = DataCollatorForPackedReward(pad_token_id=0)([{"chosen_ids": [5, 6, 7], "rejected_ids": [5, 6, 8, 9]}])
    assert batch["packed_input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["packed_seq_lengths"].tolist() == [2, 1, 2]
    assert batch["packed_seq_parents"].tolist() == [-1, 0, 0]
    assert batch["packed_position_ids"].tolist() == [[0, 1, 2, 2, 3]]
    assert batch["packed_score_order"].tolist() == [0, 1]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [5, 6, 8, 9]]  # TRL's padded batch, kept for its metrics
    two = DataCollatorForPackedReward(pad_token_id=0)(
        [{"chosen_ids": [5, 6], "rejected_ids": [5, 6, 7]}, {"chosen_ids": [3], "rejected_ids": [4, 2]}]
    )
    # a chosen that is a prefix of its rejected keeps one token of its own; nothing shared in the second pair
    assert two["packed_seq_lengths"].tolist() == [1, 1, 2, 1, 2]
    assert two["packed_seq_parents"].tolist() == [-1, 0, 0, -1, -1]
    assert two["packed_score_order"].tolist() == [0, 2, 1, 3]


def _trainer(tmp_path, *, args=None, model=None, **kwargs):
    return RewardTrainer(
        model=model if model is not None else _model(),
        args=args if args is not None else _args(RewardConfig, tmp_path, per_device_train_batch_size=2, max_steps=1),
        train_dataset=_pairs(),
        processing_class=char_tokenizer(),
        **kwargs,
    )


def test_padding_free_false_and_unpack_disable_are_stock(tmp_path, monkeypatch):
    from trl.trainer.reward_trainer import DataCollatorForPreference

    trainer = _trainer(tmp_path, args=_args(RewardConfig, tmp_path, padding_free=False))
    assert not trainer.unpack_decision.packed and "padding_free=False" in trainer.unpack_decision.reason
    assert type(trainer.data_collator) is DataCollatorForPreference
    monkeypatch.setenv("UNPACK_DISABLE", "1")
    trainer = _trainer(tmp_path)
    assert trainer.unpack_decision.mode == "stock" and type(trainer.data_collator) is DataCollatorForPreference


def test_a_plain_trl_config_gets_our_defaults(tmp_path):
    trainer = _trainer(tmp_path, args=_args(trl.RewardConfig, tmp_path, center_rewards_coefficient=0.01))
    assert trainer.unpack_decision.packed and trainer.args.prefix_sharing
    assert trainer.args.center_rewards_coefficient == 0.01 and trainer.data_collator.prefix_sharing


def test_a_model_whose_score_cannot_be_read_per_sequence_trains_padded_and_says_why(tmp_path, caplog):
    """A sequence-classification model whose class does not pool by ``pad_token_id`` (here: a subclass that keeps
    the first token's score) is refused by the packed path before any batch: TRL's padded batches, one log line."""
    from transformers import LlamaForSequenceClassification
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast
    from trl.trainer.reward_trainer import DataCollatorForPreference

    class FirstTokenScorer(LlamaForSequenceClassification):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            hidden = self.model(input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
            return SequenceClassifierOutputWithPast(logits=self.score(hidden[:, 0]))

    model = FirstTokenScorer(_model().config)
    with caplog.at_level("INFO", logger="unpack_trainer"):
        trainer = _trainer(tmp_path, model=model)
        trainer.train()
    assert trainer.unpack_decision.mode == "padded" and type(trainer.data_collator) is DataCollatorForPreference
    lines = [r for r in caplog.records if "cannot be read per packed sequence" in r.getMessage()]
    # the start line, at the level a user sees by default (an automatic choice; the explicit request below warns)
    assert len(lines) == 1 and "pad_token_id" in lines[0].getMessage() and lines[0].levelno == announce_level(), lines
    caplog.clear()
    with caplog.at_level("INFO", logger="unpack_trainer"):  # asked for explicitly: a warning that says it is ignored
        _trainer(tmp_path, model=model, args=_args(RewardConfig, tmp_path, padding_free=True))
    lines = [r for r in caplog.records if "cannot be read per packed sequence" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING" and "padding_free=True ignored" in lines[0].getMessage()


def test_the_self_check_passes_on_a_real_run(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    assert trainer.unpack_selfcheck.ok and trainer.unpack_selfcheck_branched.ok
    assert trainer.unpack_decision.packed and trainer.data_collator.prefix_sharing


def test_a_leaking_branched_path_turns_prefix_sharing_off_and_says_why(tmp_path, leak_branches, caplog):
    """The branched probe runs on the classification model; when a branch sees its sibling, the pairs stay packed,
    unshared ([p, c] and [p, r], which the plain probe passed), logged once with the measured difference, and the
    step still equals stock. UNPACK_STRICT=1 raises instead."""
    leak_branches("sibling")
    with caplog.at_level("INFO", logger="unpack_trainer"):
        trainer = _trainer(tmp_path)
        trainer.train()
        trainer.evaluate(_pairs(2))
    assert trainer.unpack_selfcheck.ok and not trainer.unpack_selfcheck_branched.ok
    assert trainer.unpack_decision.packed and trainer.data_collator.prefix_sharing is False
    messages = [r.getMessage() for r in caplog.records if "prefix sharing is off" in r.getMessage()]
    assert len(messages) == 1 and "max |packed - one-by-one|" in messages[0], messages
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNPACK_STRICT", "1")
        with pytest.raises(RuntimeError, match="UNPACK_STRICT"):
            _trainer(tmp_path).get_train_dataloader()


def test_train_and_evaluate_on_the_embedded_preference_set(tmp_path):
    from peft import LoraConfig
    from transformers import LlamaForSequenceClassification

    from unpack_trainer import load_default_tokenizer, tiny_model_config
    from unpack_trainer.data.default_preference_data import load_default_preference_dataset

    tokenizer = load_default_tokenizer()
    config = tiny_model_config(tokenizer)
    config.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_labels=1))  # fmt: skip
    torch.manual_seed(0)
    trainer = RewardTrainer(
        model=LlamaForSequenceClassification(config),
        args=_args(RewardConfig, tmp_path, per_device_train_batch_size=4, max_steps=2, max_length=256),
        train_dataset=load_default_preference_dataset("train", conversational=True).select(range(8)),
        eval_dataset=load_default_preference_dataset("eval", conversational=True).select(range(4)),
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear"),
    )
    assert trainer.unpack_decision.packed
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))
    metrics = trainer.evaluate()
    assert "eval_accuracy" in metrics and torch.isfinite(torch.tensor(metrics["eval_loss"]))
