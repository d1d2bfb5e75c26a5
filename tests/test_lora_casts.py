"""LoRA's input casts skipped under autocast (unpack_trainer/trainers/lora_casts.py): bit-identical to PEFT's own
path, fewer copies, nothing left behind, only where exact; and the trainers' step uses it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from unpack_trainer.trainers import lora_casts
from unpack_trainer.trainers.lora_casts import lora_input_casts_skipped, plain_lora_layers

peft = pytest.importorskip("peft")


LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)  # B non-zero


def tiny_llama(dtype=torch.bfloat16, vocab_size=100):
    """A tiny Llama (2 layers, hidden 64) in ``dtype``, seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).to(dtype)


def lora_model(dtype=torch.bfloat16, **lora):
    """:func:`tiny_llama` with LoRA (float32 adapters, PEFT's default) on every linear layer."""
    return peft.get_peft_model(tiny_llama(dtype), peft.LoraConfig(**{**LORA, **lora}))


def step(model, context, *, autocast=True):
    """Loss, every gradient and the number of dtype copies of one forward + backward inside ``context``."""
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.profiler.profile() as prof, context, amp:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, copies


def test_bit_identical_to_peft_with_fewer_copies_and_nothing_left_behind():
    model = lora_model()
    layers = plain_lora_layers(model)
    assert len(layers) == 14 and {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    loss, grads, copies = step(model, contextlib.nullcontext())
    loss_skipped, grads_skipped, copies_skipped = step(model, lora_input_casts_skipped(layers))
    assert torch.equal(loss, loss_skipped)
    assert grads.keys() == grads_skipped.keys() and len(grads) == 28
    assert all(torch.equal(grads[name], grads_skipped[name]) for name in grads)
    assert copies_skipped < copies  # bf16 -> float32 per layer call, and its backward
    assert all(layer.cast_input_dtype_enabled is True and not layer._forward_pre_hooks for layer in layers)


def test_without_autocast_peft_casts_as_always():
    """A call without autocast inside the context (a bf16 input, float32 adapters) still casts: without the cast
    it would be a dtype error."""
    model = lora_model()
    loss, grads, _ = step(model, contextlib.nullcontext(), autocast=False)
    loss_in_context, grads_in_context, _ = step(model, lora_input_casts_skipped(plain_lora_layers(model)), autocast=False)
    assert torch.equal(loss, loss_in_context)
    assert all(torch.equal(grads[name], grads_in_context[name]) for name in grads)


def test_a_users_own_switch_stays_off():
    model = lora_model(torch.float32)
    layer = plain_lora_layers(model)[0]
    layer.cast_input_dtype_enabled = False
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(module.cast_input_dtype_enabled))
    with lora_input_casts_skipped([layer]), torch.no_grad():
        layer(torch.randn(3, layer.in_features))
    assert seen == [False] and layer.cast_input_dtype_enabled is False


def test_paused_runs_peft_s_path_and_hooks_again_after():
    """``paused()`` (the online trainers' generation): no hook of ours and the switches as found inside it, the skip
    back after it; outside the context it does nothing."""
    model = lora_model()
    layers = plain_lora_layers(model)
    x = torch.randn(3, layers[0].in_features, dtype=torch.bfloat16)
    seen = []
    layers[0].register_forward_hook(lambda module, args, out: seen.append(module.cast_input_dtype_enabled))
    skip = lora_input_casts_skipped(layers)
    with skip.paused():
        assert not layers[0]._forward_pre_hooks
    with skip, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layers[0](x)
        with skip.paused():
            assert all(layer.cast_input_dtype_enabled is True and not layer._forward_pre_hooks for layer in layers)
            layers[0](x)
        layers[0](x)
    assert seen == [False, True, False]
    assert all(layer.cast_input_dtype_enabled is True and not layer._forward_pre_hooks for layer in layers)


def test_only_layers_where_the_skip_is_exact():
    """Dropout (drawn and rounded per dtype) and variants such as DoRA (their own forward) keep PEFT's casts."""
    assert plain_lora_layers(lora_model(lora_dropout=0.1)) == []
    assert plain_lora_layers(lora_model(use_dora=True)) == []
    assert plain_lora_layers(torch.nn.Linear(2, 2)) == []


def _dataset(trainer: str):
    from datasets import Dataset

    if trainer == "sft":
        return Dataset.from_list([{"input_ids": list(range(3, 3 + n))} for n in (7, 12, 5, 9)])
    rows = [("the cat", " sat", " ran away"), ("a dog", " barked", " slept"), ("it", " is", " was not"),
            ("hello", " world", " there")]  # fmt: skip
    return Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows])


@pytest.mark.parametrize(("trainer_name", "checkpointing"), [("sft", False), ("sft", True), ("dpo", True)])
def test_the_step_skips_the_casts_exactly(tmp_path, monkeypatch, trainer_name, checkpointing):
    """One step of our SFTTrainer / DPOTrainer (its reference: the same model with the adapter disabled) with LoRA on
    a bf16 model and ``bf16=True`` (TRL's default on a GPU; autocast on the CPU here), with and without activation
    checkpointing (the recomputed forward skips as the forward did): the step runs inside the context, and its loss
    and every LoRA gradient equal the same step with the context off."""
    from unpack_trainer import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
    from unpack_trainer.model_zoo.tiny import char_tokenizer

    trainer_class, config_class = {"sft": (SFTTrainer, SFTConfig), "dpo": (DPOTrainer, DPOConfig)}[trainer_name]
    entered, switches = [], []
    real = lora_casts.lora_input_casts_skipped

    def spy(layers):
        entered.append(len(layers))
        for layer in layers:  # after the call: the switch as the call saw it
            layer.register_forward_hook(lambda module, args, out: switches.append(module.cast_input_dtype_enabled))
        return real(layers)

    def one_step(context):
        monkeypatch.setattr("unpack_trainer.trainers._packed.lora_input_casts_skipped", context)
        base = tiny_llama(vocab_size=128)  # the character tokenizer's 107 ids
        args = config_class(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=True, max_steps=1,
                            per_device_train_batch_size=4, max_length=64, learning_rate=0.0,
                            gradient_checkpointing=checkpointing, save_strategy="no", logging_strategy="no",
                            disable_tqdm=True, **({"packing": True} if trainer_name == "sft" else {}))  # fmt: skip
        trainer = trainer_class(model=base, args=args, train_dataset=_dataset(trainer_name),
                                processing_class=char_tokenizer(), peft_config=peft.LoraConfig(**LORA))  # fmt: skip
        assert trainer.unpack_decision.packed
        grads = {}
        for name, parameter in trainer.model.named_parameters():
            if parameter.requires_grad:
                parameter.register_hook(lambda grad, name=name: grads.setdefault(name, grad.clone()))
        trainer.train()
        return trainer.state.log_history[-1]["train_loss"], grads

    loss, grads = one_step(spy)
    assert entered and entered[0] == 14
    assert switches and not any(switches)  # every LoRA call of the step ran under autocast, its cast skipped
    loss_stock, grads_stock = one_step(lambda layers: real([]))
    assert loss == loss_stock
    assert grads.keys() == grads_stock.keys() and len(grads) == 28
    assert all(torch.equal(grads[name], grads_stock[name]) for name in grads)


def reward_a(completions, **kwargs):
    """A reward that differs within a group: how many ``a`` a completion holds, minus a length term."""
    return [float(text.count("a")) - 0.1 * len(text) for text in completions]


@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
def test_the_online_step_skips_the_casts_and_generation_keeps_peft(tmp_path, monkeypatch, trainer_name):
    """One step of our GRPOTrainer / RLOOTrainer with LoRA on a bf16 model and ``bf16=True``, generation included
    (``model.generate`` inside the step): every LoRA call of the log-prob forwards (old policy, reference with the
    adapter disabled, policy) skips its cast, generation runs PEFT's own path with none of our hooks (as stock:
    a compiled decode step keeps its graph), and the loss and every LoRA gradient equal the step with no skip."""
    from datasets import Dataset

    from unpack_trainer import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from unpack_trainer.model_zoo.tiny import char_tokenizer

    trainer_class, config_class = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}[trainer_name]
    real = lora_casts.lora_input_casts_skipped

    def one_step(context):
        monkeypatch.setattr("unpack_trainer.trainers._packed.lora_input_casts_skipped", context)
        args = config_class(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=True, max_steps=1,
                            per_device_train_batch_size=4, num_generations=2, max_completion_length=8, seed=3,
                            beta=0.1, learning_rate=0.0, save_strategy="no", logging_strategy="no",
                            disable_tqdm=True)  # fmt: skip
        prompts = Dataset.from_dict({"prompt": ["the cat", "a dog", "it is", "hello"]})
        trainer = trainer_class(model=tiny_llama(vocab_size=128), reward_funcs=reward_a, args=args,
                                train_dataset=prompts, processing_class=char_tokenizer(),
                                peft_config=peft.LoraConfig(**LORA))  # fmt: skip
        assert trainer.unpack_decision.packed
        calls = {"generation": [], "log-probs": []}
        phase = []  # "log-probs" inside the training step, "generation" inside its generation

        def record(module, args, out):  # after each call: the switch it saw, our hooks on it
            if phase:
                calls[phase[-1]].append((module.cast_input_dtype_enabled, len(module._forward_pre_hooks)))

        for layer in plain_lora_layers(trainer.model):
            layer.register_forward_hook(record)

        def within(method, name):
            def recorded(*args, **kwargs):
                phase.append(name)
                try:
                    return method(*args, **kwargs)
                finally:
                    phase.pop()

            return recorded

        trainer.training_step = within(trainer.training_step, "log-probs")  # the self-check's forwards are not
        trainer._generate = within(trainer._generate, "generation")
        grads = {}
        for name, parameter in trainer.model.named_parameters():
            if parameter.requires_grad:
                parameter.register_hook(lambda grad, name=name: grads.setdefault(name, grad.clone()))
        trainer.train()
        return trainer.state.log_history[-1]["train_loss"], grads, calls

    loss, grads, calls = one_step(real)
    assert calls["generation"] and calls["generation"] == [(True, 0)] * len(calls["generation"])
    assert calls["log-probs"] and all(not switch and hooks == 1 for switch, hooks in calls["log-probs"])
    loss_stock, grads_stock, calls_stock = one_step(lambda layers: real([]))
    assert len(calls_stock["log-probs"]) == len(calls["log-probs"])
    assert all(switch for switch, _ in calls_stock["log-probs"])
    assert loss == loss_stock
    assert grads.keys() == grads_stock.keys() and len(grads) == 28
    assert all(torch.equal(grads[name], grads_stock[name]) for name in grads)
