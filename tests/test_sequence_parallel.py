"""Packed rows under sequence parallelism (DeepSpeed Ulysses through accelerate's ``ParallelismConfig``).

- The pieces as pure functions: the collator's rows cut-ready for ``N`` shards (padded to a multiple, the whole row's
  metadata carried as one object), the detector adopting whole-row metadata on a shard, which models are exact (the
  rule of :mod:`unpack_trainer.models.sequence_parallel`), which trainers pack under it.
- Ulysses' head split simulated in one process: the packed attention on every share of the heads == on all of them.
- Two real processes on gloo: a patched model inside ``UlyssesSPAttentionHF`` (each process embedding half of a packed
  and of a branched row) == each sample alone, logits and every gradient, per CPU backend, with the contamination
  probe (a token of one sample changed, no other sample moves; stock Ulysses moves them); and one SFT step through the
  trainer, as a user sets it up (``sp_size=2``, DeepSpeed ZeRO-1), == the step computed from each sample alone.
"""

import json
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch

from unpack_trainer.data.collator import DataCollatorForPacking
from unpack_trainer.decision import parallelism_reason, sequence_parallel_size
from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_model
from unpack_trainer.models import patch_model
from unpack_trainer.models.sequence_parallel import sequence_parallel_reason
from unpack_trainer.packed_seq_info import INFO_KEY, PackedSeqInfo, detect_packed

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
DEEPSPEED = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'unpack-trainer[sp]', or pip install deepspeed)",
)


# ---------------------------------------------------------------------------------------------------- pure pieces


@pytest.mark.parametrize("shards, pad_to", [(2, None), (4, None), (4, 6)])
def test_the_collator_cuts_ready_rows_for_the_shards(shards, pad_to):
    collate = DataCollatorForPacking(pad_token_id=0, pad_to_multiple_of=pad_to, sequence_shards=shards)
    batch = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}, {"input_ids": [9]}])
    length = batch["input_ids"].shape[1]
    multiple = shards if pad_to is None else 12
    assert length % multiple == 0 and length - 9 < multiple
    # only what DeepSpeed's adapter can cut along the row, and the whole row's metadata as one object
    assert {k for k, v in batch.items() if torch.is_tensor(v)} == {"input_ids", "labels", "position_ids"}
    assert all(batch[k].shape == (1, length) for k in ("input_ids", "labels", "position_ids"))
    info = batch[INFO_KEY]
    assert info.sequence_shards == shards and info.seq_len == length
    assert info.seq_lengths.tolist() == [3, 5, 1] + ([length - 9] if length > 9 else [])
    assert batch["labels"][0, 9:].eq(-100).all()  # the padding is a pseudo-sample with no label
    # the object crosses processes (DeepSpeed gathers a batch's non-tensors as pickles): samples kept, caches dropped
    info.plans.get((), lambda: 1)
    copy = pickle.loads(pickle.dumps(info))
    assert copy.sequence_shards == shards and torch.equal(copy.seq_lengths, info.seq_lengths)
    assert len(info.plans) == 1 and len(copy.plans) == 0


def test_an_unsharded_collator_is_unchanged():
    batch = DataCollatorForPacking(pad_token_id=0)([{"input_ids": [1, 2, 3]}])
    assert "packed_seq_lengths" in batch and INFO_KEY not in batch and batch["input_ids"].shape == (1, 3)


def test_a_shard_adopts_the_whole_rows_metadata():
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([5, 3]), batch_size=1, seq_len=8).for_sequence_shards(2)
    assert detect_packed(1, 4, packed_seq_info=info) is info  # one of two shards
    assert detect_packed(1, 8, packed_seq_info=info) is info  # the whole row (evaluation, Ulysses off)
    with pytest.raises(ValueError, match="describes 1 row"):
        detect_packed(1, 2, packed_seq_info=info)
    with pytest.raises(ValueError, match="cannot be cut into 3 equal"):
        PackedSeqInfo.from_seq_lengths(torch.tensor([5, 3]), batch_size=1, seq_len=8).for_sequence_shards(3)
    unsharded = PackedSeqInfo.from_seq_lengths(torch.tensor([5, 3]), batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="describes 1 row"):
        detect_packed(1, 4, packed_seq_info=unsharded)


def test_which_models_are_exact_under_ulysses():
    llama = patch_model(tiny_model("llama"))  # 4 heads, 2 key/value heads
    assert sequence_parallel_reason(llama, 2) is None
    assert sequence_parallel_reason(llama, 4) is None  # key/value heads replicated
    assert "4 attention heads do not divide by sp_size=3" in sequence_parallel_reason(llama, 3)
    assert "token mixers (Qwen3NextGatedDeltaNet)" in sequence_parallel_reason(
        patch_model(tiny_model("qwen3_next")), 2
    )
    assert "attention sinks" in sequence_parallel_reason(patch_model(tiny_model("gpt_oss")), 2)
    assert "'alibi'" in sequence_parallel_reason(patch_model(tiny_model("bloom")), 2)
    assert sequence_parallel_reason(patch_model(tiny_model("gemma3_text")), 2) is None  # sliding windows


def test_sequence_parallelism_packs_only_in_the_trainers_that_carry_the_rows_boundaries():
    from accelerate.utils import ParallelismConfig

    config = ParallelismConfig.__new__(ParallelismConfig)  # the fields only: no process group to validate against
    config.cp_size, config.sp_size, config.sp_backend = 1, 2, "deepspeed"
    assert sequence_parallel_size(config, {}) == 2
    assert parallelism_reason(config, {}, sequence_parallel=True) is None
    assert "in this trainer" in parallelism_reason(config, {})
    config.cp_size, config.sp_size = 2, 1
    assert "context parallelism" in parallelism_reason(config, {}, sequence_parallel=True)


def test_all_seven_trainers_pack_under_sequence_parallelism():
    from unpack_trainer.trainers import TRAINERS

    packs = {spec.command: spec.trainer_class().unpack_sequence_parallel for spec in TRAINERS}
    assert packs == dict.fromkeys(("sft", "dpo", "reward", "grpo", "rloo", "kto", "distillation"), True)


# ------------------------------------------------------------------------------------ Ulysses' head split, one process


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_every_share_of_the_heads_attends_as_all_of_them(backend, monkeypatch):
    """What each rank's attention does inside Ulysses: the whole row for H/N heads (key/value heads split alike, or
    replicated when fewer than N), with the whole row's metadata; the shares side by side == all heads at once."""
    from unpack_trainer.patches.attention import packed_attention_forward

    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", backend)
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, length = 8, 2, 40
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([7, 15, 18]), batch_size=1, seq_len=length)
    q = torch.randn(1, heads, length, 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, length, 16, generator=generator, requires_grad=True) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = True
    whole, _ = packed_attention_forward(module, q, k, v, None, scaling=0.25, packed_seq_info=info)
    for shards in (2, 4):
        sharded = info.for_sequence_shards(shards)
        per_q, per_kv = heads // shards, max(kv_heads // shards, 1)
        outs = []
        for rank in range(shards):
            kv_index = rank * kv_heads // shards if kv_heads < shards else rank
            kv = slice(kv_index * per_kv, (kv_index + 1) * per_kv)
            out, _ = packed_attention_forward(
                module,
                q[:, rank * per_q : (rank + 1) * per_q],
                k[:, kv],
                v[:, kv],
                None,
                scaling=0.25,
                packed_seq_info=sharded,
            )
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------- two processes on gloo


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun(script: str, tmp_path, *arguments: str, env: dict | None = None) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        os.path.join(SCRIPTS, script),
        str(tmp_path),
        *arguments,
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    variables = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    variables |= env or {}
    proc = subprocess.run(command, env=variables, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


@DEEPSPEED
@pytest.mark.timeout(420)
def test_a_patched_model_inside_ulysses_equals_each_sample_alone(tmp_path):
    """sp_size=2: each process embeds half of a row of four samples (the second across the cut) and a row of a
    prompt with three branches; the gathered logits and the summed gradients == each sample alone, on every CPU
    backend (flex: forward only on the CPU), and changing one sample moves no other. Stock Ulysses on the same packed
    row runs it as one causal document."""
    result = _torchrun("sp_model.py", tmp_path, "llama", "sdpa", "eager", "flex", "stock")
    for backend in ("sdpa", "eager", "flex"):
        for layout in ("packed", "branched"):
            measured = result[backend][layout]
            assert measured["logits"] < 1e-5, (backend, layout, measured)
            assert measured["contamination"] == 0.0, (backend, layout, measured)
            if backend != "flex":
                assert measured["gradients"] < 1e-5 * measured["gradient_scale"], (backend, layout, measured)
    stock = result["stock"]["packed"]
    assert stock["contamination"] > 0.1 and stock["logits"] > 0.1


def _reference_step(result: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The step from each sample of the trained row alone, in one process: TRL's loss (the mean over the row's
    trained tokens) and the parameters after plain SGD."""
    tokenizer = char_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512, attn_implementation="sdpa")
    ids, labels = torch.tensor(result["input_ids"]), torch.tensor(result["labels"])
    total, count, start = 0.0, 0, 0
    for length in result["seq_lengths"]:
        sample, target = ids[start : start + length], labels[start : start + length]
        start += length
        if target[1:].eq(-100).all():
            continue  # the padding pseudo-sample
        logits = model(input_ids=sample[None]).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits, target[1:], ignore_index=-100, reduction="sum")
        count += int(target[1:].ne(-100).sum())
    loss = total / count
    loss.backward()
    lr = result["learning_rate"]
    return float(loss.detach()), {n: (p - lr * p.grad).detach() for n, p in model.named_parameters()}


@DEEPSPEED
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode, backend", [("pack", "sdpa"), ("pack", "eager"), ("padding_free", "sdpa")])
def test_one_sft_step_at_sp_2_equals_the_step_from_each_sample_alone(tmp_path, mode, backend):
    result = _torchrun("sp_train.py", tmp_path, mode, env={"UNPACK_ATTENTION_BACKEND": backend})
    assert result["mode"] == mode and "sequence parallelism (sp_size=2" in result["reason"]
    assert result["sequence_shards"] == 2
    if mode == "pack":
        assert len(result["seq_lengths"]) > 2  # several samples on the row, one across the cut
    loss, expected = _reference_step(result)
    assert result["logged"]["loss"] == pytest.approx(loss, rel=1e-5)
    lr = result["learning_rate"]
    for name, value in expected.items():
        trained = torch.tensor(result["parameters"][name])
        # the update is lr * gradient: compare gradients
        torch.testing.assert_close(trained / lr, value / lr, rtol=0, atol=2e-5, msg=name)
    if mode == "pack":  # evaluation under sp_size=2 (each process its batches whole) == one process's
        assert result["eval_loss"] == pytest.approx(_one_process_eval_loss(result, tmp_path), rel=1e-5)


def _one_process_eval_loss(result: dict, tmp_path) -> float:
    """``SFTTrainer.evaluate`` in one process, without sequence parallelism, of the model trained at sp_size=2."""
    from datasets import Dataset

    from unpack_trainer import SFTConfig, SFTTrainer

    sys.path.insert(0, SCRIPTS)
    try:
        from sp_train import model as build
        from sp_train import rows
    finally:
        sys.path.remove(SCRIPTS)
    model = build()
    model.load_state_dict({name: torch.tensor(value) for name, value in result["parameters"].items()}, strict=False)
    args = SFTConfig(
        output_dir=str(tmp_path / "one"), report_to="none", use_cpu=True, bf16=False, max_length=96,
        pad_to_multiple_of=96, packing=True, per_device_eval_batch_size=8, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows()),
        eval_dataset=Dataset.from_list(rows(8)),
        processing_class=char_tokenizer(),
    )
    return trainer.evaluate()["eval_loss"]


def _ulysses(sp_size: int = 2, **handler):
    """accelerate's sequence-parallel config, its fields only (validating it needs the processes it describes)."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    config = ParallelismConfig.__new__(ParallelismConfig)
    config.cp_size, config.sp_size, config.sp_backend = 1, sp_size, "deepspeed"
    config.sp_handler = DeepSpeedSequenceParallelConfig(**handler)
    return config


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"per_device_train_batch_size": 2}, "per_device_train_batch_size=2: each batch is one packed row"),
        ({"loss_normalization": "sample"}, "loss_normalization='sample'"),
        ({"handler": {"sp_disable_in_eval": False}}, "sp_disable_in_eval=False"),
    ],
)
def test_a_run_that_cannot_stay_exact_under_ulysses_is_refused_with_its_reason(
    change, expected, tokenizer, tmp_path, prompt_completion, sft_args, tiny_llama, monkeypatch
):
    """What the trainer checks once the accelerator exists (one process here: its parallelism config stubbed)."""
    from unpack_trainer import SFTTrainer
    from unpack_trainer.trainers.sequence_parallel import check_parallelism

    handler = change.pop("handler", {})
    args = sft_args(tmp_path, packing=True, **(dict(per_device_train_batch_size=1) | change))
    trainer = SFTTrainer(
        model=tiny_llama(len(tokenizer)),
        args=args,
        train_dataset=prompt_completion(),
        eval_dataset=prompt_completion(4),
        processing_class=tokenizer,
    )
    monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(**handler), raising=False)
    with pytest.raises(ValueError, match="sequence parallelism") as raised:
        check_parallelism(trainer)
    assert expected in str(raised.value)


def test_a_model_that_cannot_stay_exact_under_ulysses_is_refused_unpatched(
    tokenizer, tmp_path, prompt_completion, sft_args, tiny_model, monkeypatch
):
    from unpack_trainer import SFTTrainer
    from unpack_trainer.models import is_patched
    from unpack_trainer.trainers.sequence_parallel import refuse_model

    trainer = SFTTrainer(
        model=tiny_model("qwen3_next", vocab_size=len(tokenizer)),
        args=sft_args(tmp_path, packing=True, per_device_train_batch_size=1),
        train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )
    trainer.unpack_run.sequence_shards = 2
    with pytest.raises(ValueError, match=r"sp_size=2, DeepSpeed Ulysses\): token mixers \(Qwen3NextGatedDeltaNet\)"):
        refuse_model(trainer)
    assert not is_patched(trainer.model)


def assert_config_takes_ulysses_only(config_class: type, monkeypatch, **common) -> None:
    """``config_class`` (ours of a TRL config whose ``__post_init__`` refuses any sequence-dim parallelism) takes
    ``sp_size`` (the trainer cuts its rows) and keeps TRL's refusal for ``cp_size`` and under ``UNPACK_DISABLE=1``
    (then TRL's trainer runs); ``common``: the config's other fields."""
    assert config_class(**common, parallelism_config=_ulysses()).parallelism_config.sp_size == 2
    monkeypatch.setenv("UNPACK_DISABLE", "1")
    with pytest.raises(ValueError, match="does not support sequence-dim parallelism"):
        config_class(**common, parallelism_config=_ulysses())
    monkeypatch.delenv("UNPACK_DISABLE")
    parallelism = _ulysses()
    parallelism.cp_size = 2
    with pytest.raises(ValueError, match="does not support sequence-dim parallelism"):
        config_class(**common, parallelism_config=parallelism)


def assert_sgd_step(result: dict, model: torch.nn.Module) -> None:
    """Every parameter of ``result`` (a script's, after its SGD step) == ``model``'s parameter minus the learning rate
    times its gradient (``model``: the same step's backward done in one process), within 2e-5 of the gradient; a
    frozen one (a LoRA model's base) unchanged."""
    lr = result["learning_rate"]
    for name, parameter in model.named_parameters():
        trained = torch.tensor(result["parameters"][name])
        if not parameter.requires_grad:
            torch.testing.assert_close(trained, parameter.detach(), rtol=0, atol=0, msg=name)
            continue
        expected = (parameter - lr * parameter.grad).detach()
        torch.testing.assert_close(trained / lr, expected / lr, rtol=0, atol=2e-5, msg=name)


@DEEPSPEED
@pytest.mark.timeout(420)
@pytest.mark.parametrize("stage", [1, 3])
def test_one_dpo_step_at_sp_2_equals_the_step_in_one_process(tmp_path, stage):
    """DPO with a reference model, sp_size=2, ZeRO-1 and ZeRO-3: each process runs its half of the packed row (the
    prompt once, chosen and rejected as branches), the hidden states gathered for TRL's view; the logged loss and
    metrics and every parameter update == the same batch's step in one process."""
    from datasets import Dataset

    from unpack_trainer import DPOTrainer

    result = _torchrun("sp_dpo.py", tmp_path, str(stage))
    assert "sequence parallelism (sp_size=2" in result["reason"]
    sys.path.insert(0, SCRIPTS)
    try:
        from sp_dpo import config, models, pairs
    finally:
        sys.path.remove(SCRIPTS)
    batch = torch.load(tmp_path / "batch.pt", weights_only=False)
    info = batch[INFO_KEY]
    assert info.sequence_shards == 2 and info.is_branched
    batch[INFO_KEY] = PackedSeqInfo(info.seq_lengths, batch_size=1, seq_len=info.seq_len, seq_parents=info.seq_parents)
    tokenizer = char_tokenizer()
    policy, reference = models(tokenizer)
    initial = torch.load(tmp_path / "initial.pt")  # ZeRO-3 draws a model's weights per partition
    policy.load_state_dict(initial["policy"], strict=False)
    reference.load_state_dict(initial["reference"], strict=False)
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=config(str(tmp_path / "one")),
        train_dataset=Dataset.from_list(pairs()),
        processing_class=tokenizer,
    )
    model = trainer.model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    logged = result["logged"]
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "entropy"):
        assert logged[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    # TRL gathers the batch's token count over every process, each holding the group's batch: counted once
    assert logged["num_tokens"] == metrics["num_tokens"] == int(batch["attention_mask"].sum())
    assert_sgd_step(result, model)


def test_dpo_does_not_fall_back_to_padded_pairs_under_ulysses(tokenizer, tmp_path, tiny_model, monkeypatch):
    """A model refused under Ulysses with DPO's automatic padding-free: TRL's padded pairs cannot go through
    DeepSpeed's data loader, so the run stops at start with the reason (not in the adapter at the first batch)."""
    from datasets import Dataset

    from unpack_trainer import DPOConfig, DPOTrainer
    from unpack_trainer.trainers import sequence_parallel

    pairs = Dataset.from_list([{"prompt": "ab", "chosen": "cd", "rejected": "ef"}] * 4)
    args = DPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=1,
        max_length=32,
    )  # fmt: skip
    real = sequence_parallel.check_parallelism

    def under_ulysses(self):
        monkeypatch.setattr(self.accelerator.state, "parallelism_config", _ulysses(), raising=False)
        real(self)

    monkeypatch.setattr(sequence_parallel, "check_parallelism", under_ulysses)
    model, reference = (tiny_model("qwen3_next", vocab_size=len(tokenizer), seed=seed) for seed in (0, 1))
    with pytest.raises(ValueError, match=r"cannot train padded under sequence parallelism \(sp_size=2\).*token mixers"):
        DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=pairs, processing_class=tokenizer)


def test_an_unverified_model_type_is_refused_under_ulysses(tokenizer, tmp_path, prompt_completion, sft_args, monkeypatch):
    """SFT runs an unverified model type unpatched (its self-check decides); under Ulysses that is one causal document
    across the cut row, so packing is refused with the reason."""
    from unpack_trainer import SFTTrainer
    from unpack_trainer.model_zoo.tiny import tiny_model as build
    from unpack_trainer.trainers import sequence_parallel

    real = sequence_parallel.check_parallelism

    def under_ulysses(self):
        monkeypatch.setattr(self.accelerator.state, "parallelism_config", _ulysses(), raising=False)
        real(self)

    monkeypatch.setattr(sequence_parallel, "check_parallelism", under_ulysses)
    nothing_verified = (frozenset(), {})
    monkeypatch.setattr("unpack_trainer.trainers.packed_path.verified_model_types", lambda: nothing_verified)
    with pytest.raises(ValueError, match=r"sp_size=2, DeepSpeed Ulysses\) with a model type that is not verified"):
        SFTTrainer(
            model=build("llama", vocab_size=len(tokenizer)),
            args=sft_args(tmp_path, packing=True, per_device_train_batch_size=1),
            train_dataset=prompt_completion(),
            processing_class=tokenizer,
        )
