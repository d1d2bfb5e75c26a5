"""KTO's packed rows under sequence parallelism (DeepSpeed Ulysses through accelerate's ``ParallelismConfig``).

- The collator: under ``sp_size = N`` the KL row and the reference row come padded to a multiple of ``N`` and marked
  for the cut (the main row is made ready for DeepSpeed's adapter around it), the sequences read back unchanged.
- Two real processes on gloo (``tests/scripts/sp_kto.py``): one ``KTOTrainer`` step at ``sp_size=2`` (ZeRO-1, SGD)
  == the same batch's step in one process: the logged loss, every metric TRL logs (``kl``, ``rewards/*``,
  ``logps/*``, ``logits/*``, ``entropy``, ``num_tokens``) and every parameter update; ``loss_type="kto"`` (the KL row
  cut like the main row, in a training-mode forward without gradient) and ``"apo_zero_unpaired"`` (no KL row) with a
  separate reference model, and ``"kto"`` with a LoRA policy whose reference is the model with its adapter off (a
  training-mode forward of the reference row, cut too).
- What cannot stay exact is refused at start with its reason: ``precompute_ref_log_probs=True`` (before TRL's
  ``__init__`` when ``args`` carries the parallelism, after it when only the accelerator does),
  ``sp_disable_in_eval=False``, a model whose token mixers carry state across the cut.
"""

import sys

import pytest
import torch
from test_sequence_parallel import DEEPSPEED, SCRIPTS, _torchrun, _ulysses, assert_sgd_step

from unpack_trainer.data.kto import KL_ROW_KEY, REF_ROW_KEY, DataCollatorForPackedUnpairedPreference
from unpack_trainer.model_zoo.tiny import char_tokenizer
from unpack_trainer.packed_seq_info import INFO_KEY, PACKED_INPUT_IDS_KEY, TOKEN_INDEX_KEY, PackedSeqInfo

# What transformers' Trainer logs beside TRL's metrics.
TRAINER_LOGS = {"loss", "grad_norm", "learning_rate", "epoch", "step"}


# ---------------------------------------------------------------------------------------------------- the collator


def _read_back(row: dict, view_row: int) -> list[int]:
    """The packed tokens of view row ``view_row`` of ``row`` (a packed row's model inputs), padding dropped."""
    index = row[TOKEN_INDEX_KEY][view_row]
    tokens = row[PACKED_INPUT_IDS_KEY][0, index]
    length = int((index > 0).nonzero().max()) + 1 if bool((index > 0).any()) else 0
    return tokens[:length].tolist()


@pytest.mark.parametrize("shards", [2, 3])
def test_the_kl_and_reference_rows_come_ready_for_the_cut(shards):
    examples = [
        {"prompt_ids": [5, 6], "completion_ids": [7], "KL_completion_ids": [9, 8, 4], "label": True},
        {"prompt_ids": [5, 6], "completion_ids": [9, 8, 4], "KL_completion_ids": [7], "label": False},
        {"prompt_ids": [3], "completion_ids": [2, 2], "KL_completion_ids": [7], "label": True},
    ]
    plain = DataCollatorForPackedUnpairedPreference(pad_token_id=0)(examples)
    ready = DataCollatorForPackedUnpairedPreference(pad_token_id=0, sequence_shards=shards)(examples)
    assert INFO_KEY not in plain or plain[INFO_KEY].sequence_shards == 1
    for key in (KL_ROW_KEY, REF_ROW_KEY):
        before, after = plain[key], ready[key]
        length = before[PACKED_INPUT_IDS_KEY].shape[1]
        padded = after[PACKED_INPUT_IDS_KEY].shape[1]
        assert padded % shards == 0 and 0 <= padded - length < shards, key
        info = after[INFO_KEY]
        assert info.sequence_shards == shards and info.seq_len == padded, key
        assert info.seq_lengths.sum() == padded and after["packed_seq_lengths"].sum() == padded, key
        if padded > length:  # the padding is one more sample, on no view position
            assert info.seq_lengths[-1] == padded - length and info.seq_parents[-1] == -1, key
            assert int(after[TOKEN_INDEX_KEY].max()) < length, key
        for row in range(before[TOKEN_INDEX_KEY].shape[0]):
            assert _read_back(after, row) == _read_back(before, row), (key, row)
        for name in ("input_ids", "labels", "packed_view_index"):
            assert torch.equal(after[name], before[name]), (key, name)
    # the main row is left for DeepSpeed's adapter (ShardReadyCollator around this collator)
    assert torch.equal(ready[PACKED_INPUT_IDS_KEY], plain[PACKED_INPUT_IDS_KEY])


# ------------------------------------------------------------------------------------------- two processes on gloo


def _whole(info: PackedSeqInfo) -> PackedSeqInfo:
    """``info`` (marked for the cut) as one process's row: the same samples, not cut."""
    return PackedSeqInfo(info.seq_lengths, batch_size=1, seq_len=info.seq_len, seq_parents=info.seq_parents)


@pytest.mark.parametrize(
    ("case", "stage"), [("kto", 1), ("apo_zero_unpaired", 1), ("peft", 1), ("kto", 3)], ids=lambda value: str(value)
)
@DEEPSPEED
@pytest.mark.timeout(420)
def test_one_kto_step_at_sp_2_equals_the_step_in_one_process(tmp_path, case, stage):
    """sp_size=2, ZeRO-1 (and ZeRO-3 for ``kto``: DeepSpeed averages the group's gradients there before 0.20.2, the
    loss share follows it): each process runs its half of the main row (with gradient) and of the KL row (without),
    the hidden states gathered for TRL's views; the reference row runs whole (a separate reference in evaluation
    mode) or cut like the others (LoRA's reference: the policy, in training mode, its adapter off). The logged loss,
    every metric TRL logs and every parameter update == the same batch's step in one process."""
    from datasets import Dataset

    from unpack_trainer import KTOTrainer

    result = _torchrun("sp_kto.py", tmp_path, case, str(stage))
    assert result["mode"] == "padding_free" and "sequence parallelism (sp_size=2" in result["reason"]
    sys.path.insert(0, SCRIPTS)
    try:
        from sp_kto import config, examples, models
    finally:
        sys.path.remove(SCRIPTS)
    batch = torch.load(tmp_path / "batch.pt", weights_only=False)
    rows = [batch] + [batch[key] for key in (KL_ROW_KEY, REF_ROW_KEY) if key in batch]
    assert len(rows) == (2 if case == "apo_zero_unpaired" else 3)
    for row in rows:
        info = row[INFO_KEY]
        assert info.sequence_shards == 2 and info.seq_len % 2 == 0
        row[INFO_KEY] = _whole(info)
    assert batch[INFO_KEY].seq_lengths.numel() == 4  # four examples, prompts distinct: a cut through the second
    # with KL sequences each prompt once on the reference row, its completion and KL completion as branches
    assert batch[REF_ROW_KEY][INFO_KEY].is_branched == (case != "apo_zero_unpaired")
    tokenizer = char_tokenizer()
    trainer = KTOTrainer(
        **models(tokenizer, case),
        args=config(str(tmp_path / "one"), case),
        train_dataset=Dataset.from_list(examples()),
        processing_class=tokenizer,
    )
    model = trainer.model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    logged = result["logged"]
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    assert set(logged) - TRAINER_LOGS == set(metrics)
    assert metrics["num_tokens"] == int(batch["attention_mask"].sum())  # each token counted once, not per process
    if case != "apo_zero_unpaired":
        assert metrics["kl"] > 0  # the KL estimate is not clamped away: the KL row's log-probs reach the loss
    assert abs(metrics["rewards/chosen"]) > 0.1  # the reference differs from the policy
    for key, value in metrics.items():
        assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert {name for name, _ in model.named_parameters()} == set(result["parameters"])
    assert_sgd_step(result, model)


# ------------------------------------------------------------------------------------------------ what is refused


def _examples(count: int = 8):
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": "ab" * (1 + i % 3), "completion": "cd" * (1 + i % 2), "label": i % 2 == 0} for i in range(count)]
    )


def _args(tmp_path, **changes):
    from unpack_trainer import KTOConfig

    return KTOConfig(
        **{
            "output_dir": str(tmp_path),
            "report_to": "none",
            "use_cpu": True,
            "bf16": False,
            "per_device_train_batch_size": 2,
            "max_length": 32,
        }
        | changes
    )


def _under_ulysses(monkeypatch, **handler) -> None:
    """Every trainer built from now on finds accelerate's sequence parallelism (``sp_size=2``) on its accelerator
    (one process here: the config's fields only), as a run from accelerate's config file does."""
    from unpack_trainer.trainers import sequence_parallel

    real = sequence_parallel.check_parallelism

    def under_ulysses(trainer):
        monkeypatch.setattr(trainer.accelerator.state, "parallelism_config", _ulysses(**handler), raising=False)
        real(trainer)

    monkeypatch.setattr(sequence_parallel, "check_parallelism", under_ulysses)


def test_precomputed_reference_log_probs_are_refused_before_trl_precomputes_them(
    tokenizer, tmp_path, tiny_model, monkeypatch
):
    from unpack_trainer import KTOTrainer

    args = _args(tmp_path, precompute_ref_log_probs=True)
    args.parallelism_config = _ulysses()  # as a user sets it (its fields only: one process here)
    model, reference = (tiny_model("llama", vocab_size=len(tokenizer), seed=seed) for seed in (0, 1))
    precomputed = []
    original = KTOTrainer._precompute_ref_logps
    monkeypatch.setattr(
        KTOTrainer, "_precompute_ref_logps", lambda self, *a, **k: precomputed.append(1) or original(self, *a, **k)
    )
    with pytest.raises(ValueError, match=r"sp_size=2, DeepSpeed Ulysses\) with precompute_ref_log_probs=True") as e:
        KTOTrainer(model=model, ref_model=reference, args=args, train_dataset=_examples(), processing_class=tokenizer)
    assert "set precompute_ref_log_probs=False" in str(e.value)
    assert not precomputed


@pytest.mark.parametrize(
    "change, handler, expected",
    [
        (
            {"precompute_ref_log_probs": True},
            {},
            r"cannot train padded under sequence parallelism \(sp_size=2\).*precompute_ref_log_probs=True: TRL "
            "precomputes",
        ),
        (
            {"precompute_ref_log_probs": True, "padding_free": True},
            {},
            r"`padding_free=True` is not supported with sequence parallelism .*precompute_ref_log_probs=True",
        ),
        ({}, {"sp_disable_in_eval": False}, r"sp_disable_in_eval=False: the reference model, evaluation"),
    ],
)
def test_a_kto_run_that_cannot_stay_exact_under_ulysses_is_refused_with_its_reason(
    change, handler, expected, tokenizer, tmp_path, tiny_model, monkeypatch
):
    """The parallelism found on the accelerator only (accelerate's config file), checked once TRL's ``__init__`` is
    done: refused at start, with the reason and its fix."""
    from unpack_trainer import KTOTrainer

    _under_ulysses(monkeypatch, **handler)
    model, reference = (tiny_model("llama", vocab_size=len(tokenizer), seed=seed) for seed in (0, 1))
    with pytest.raises(ValueError, match=expected):
        KTOTrainer(
            model=model,
            ref_model=reference,
            args=_args(tmp_path, **change),
            train_dataset=_examples(),
            processing_class=tokenizer,
        )


def test_a_model_whose_mixers_cross_the_cut_is_refused_under_ulysses(tokenizer, tmp_path, tiny_model, monkeypatch):
    from unpack_trainer import KTOTrainer

    _under_ulysses(monkeypatch)
    model, reference = (tiny_model("qwen3_next", vocab_size=len(tokenizer), seed=seed) for seed in (0, 1))
    with pytest.raises(
        ValueError, match=r"cannot train padded under sequence parallelism \(sp_size=2\).*token mixers"
    ):
        KTOTrainer(
            model=model,
            ref_model=reference,
            args=_args(tmp_path),
            train_dataset=_examples(),
            processing_class=tokenizer,
        )


def test_kto_packs_under_ulysses_with_its_rows_ready_for_the_cut(tokenizer, tmp_path, tiny_model, monkeypatch):
    """A run that can stay exact: the start line names the cut, DeepSpeed's adapter gets the main row, and the KL and
    reference rows come padded and marked for the shards."""
    from unpack_trainer import KTOTrainer
    from unpack_trainer.data.sequence_shards import ShardReadyCollator
    from unpack_trainer.packed_seq_info import SHARDED_BATCH_KEY

    _under_ulysses(monkeypatch)
    model, reference = (tiny_model("llama", vocab_size=len(tokenizer), seed=seed) for seed in (0, 1))
    trainer = KTOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path), train_dataset=_examples(), processing_class=tokenizer
    )
    assert "sequence parallelism (sp_size=2" in trainer.unpack_decision.reason
    assert (
        isinstance(trainer.data_collator, ShardReadyCollator) and trainer.data_collator.collator.sequence_shards == 2
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[1] % 2 == 0
    whole = batch[SHARDED_BATCH_KEY]
    for row in (whole, whole[KL_ROW_KEY], whole[REF_ROW_KEY]):
        assert row[INFO_KEY].sequence_shards == 2 and row[PACKED_INPUT_IDS_KEY].shape[1] % 2 == 0
