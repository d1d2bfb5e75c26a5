"""unpack_trainer/models/packed_forward.py: the once-per-forward decision whether a batch is packed, and the edits it
makes to the decoder's keyword arguments."""

import types

import pytest
import torch

from unpack_trainer.models import packed_forward
from unpack_trainer.models.packed_forward import packed_info_for_forward
from unpack_trainer.packed_seq_info import PackedSeqInfo


def ids(total, rows=1):
    return torch.arange(rows * total).view(rows, total)


def test_lengths_make_a_packed_batch_and_fill_in_positions():
    kwargs = {"input_ids": ids(5), "packed_seq_lengths": torch.tensor([3, 2], dtype=torch.int32)}
    info = packed_info_for_forward(kwargs)
    assert info is kwargs["packed_seq_info"]
    assert info.seq_lengths.tolist() == [3, 2] and (info.batch_size, info.seq_len) == (1, 5)
    assert kwargs["position_ids"].dtype == torch.int64
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert kwargs["use_cache"] is False


def test_the_collators_metadata_is_adopted_not_rebuilt():
    """The hook's PackedSeqInfo holds the collator's own cumsum and longest length (checked, not derived again)."""
    from unpack_trainer import DataCollatorForPacking

    batch = DataCollatorForPacking(pad_token_id=0)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    kwargs = {key: value for key, value in batch.items() if key != "labels"}
    info = packed_info_for_forward(kwargs)
    assert info.cu_seqlens.data_ptr() == batch["cu_seq_lens_q"].data_ptr()  # the collator's tensor, not a new one
    assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
    assert info.max_seqlen == batch["max_length_q"] == 3
    assert info.seq_lengths.tolist() == [3, 2]


def test_cu_seqlens_and_an_all_ones_mask():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    kwargs = {
        "input_ids": ids(5),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": 3,
        "max_length_k": 3,
        "attention_mask": torch.ones(1, 5, dtype=torch.int64),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        "use_cache": True,
    }
    info = packed_info_for_forward(kwargs)
    assert info.seq_lengths.tolist() == [3, 2]
    assert kwargs["attention_mask"] is None  # hides nothing: dropped
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1]]  # given positions are kept
    assert kwargs["use_cache"] is True  # an explicit choice is kept


def test_positions_that_restart_make_a_packed_batch():
    kwargs = {
        "input_ids": ids(4, rows=2),
        "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]),
        "attention_mask": torch.ones(2, 4),
    }
    info = packed_info_for_forward(kwargs)
    assert info.seq_lengths.tolist() == [2, 2, 4] and (info.batch_size, info.seq_len) == (2, 4)
    assert kwargs["attention_mask"] is None
    assert kwargs["use_cache"] is False


def test_one_position_row_is_broadcast_over_the_batch():
    kwargs = {"inputs_embeds": torch.zeros(2, 4, 8), "position_ids": torch.tensor([[0, 1, 0, 1]])}
    info = packed_info_for_forward(kwargs)
    assert info.seq_lengths.tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_ids": ids(4), "position_ids": torch.tensor([[0, 1, 2, 3]])},  # one sample per row
        {"input_ids": ids(4)},  # no positions, no metadata
        {"input_ids": ids(1), "position_ids": torch.tensor([[0]])},  # one token
        {  # a mask that hides tokens: a padded batch, not a packed one
            "input_ids": ids(4),
            "position_ids": torch.tensor([[0, 1, 0, 1]]),
            "attention_mask": torch.tensor([[1, 1, 1, 0]]),
        },
        {"position_ids": torch.tensor([[0, 1, 0, 1]])},  # nothing to pack
    ],
)
def test_unpacked_batches_are_left_as_they_came(kwargs):
    before = dict(kwargs)
    assert packed_info_for_forward(kwargs) is None
    assert kwargs.pop("packed_seq_info") is None
    assert kwargs == before


def test_positions_with_cached_tokens_are_not_packed():
    cache = types.SimpleNamespace(get_seq_length=lambda: 3)
    kwargs = {"input_ids": ids(4), "position_ids": torch.tensor([[3, 4, 0, 1]]), "past_key_values": cache}
    assert packed_info_for_forward(kwargs) is None


def test_under_tracing_positions_alone_take_transformers_path(monkeypatch):
    monkeypatch.setattr(packed_forward, "is_tracing", lambda: True)
    kwargs = {"input_ids": ids(4), "position_ids": torch.tensor([[0, 1, 0, 1]])}
    assert packed_info_for_forward(kwargs) is None
    # Explicit metadata still packs under tracing.
    kwargs = {"input_ids": ids(5), "packed_seq_lengths": torch.tensor([3, 2])}
    assert packed_info_for_forward(kwargs).seq_lengths.tolist() == [3, 2]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cu_seq_lens_q": torch.tensor([0, 2, 5], dtype=torch.int32)}, "`cu_seq_lens_q` does not match"),
        ({"cu_seq_lens_k": torch.tensor([0, 1, 5], dtype=torch.int32)}, "`cu_seq_lens_k` does not match"),
        ({"max_length_q": 2}, "`max_length_q`=2 but the longest packed sample has 3 tokens"),
        ({"attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}, "cannot also hide tokens"),
        (
            {"past_key_values": types.SimpleNamespace(get_seq_length=lambda: 7)},
            "KV cache that already holds 7 tokens",
        ),
    ],
)
def test_inconsistent_packed_batches_are_clear_errors(extra, message):
    kwargs = {"input_ids": ids(5), "packed_seq_lengths": torch.tensor([3, 2], dtype=torch.int32), **extra}
    with pytest.raises(ValueError, match=message):
        packed_info_for_forward(kwargs)


def test_cu_seqlens_q_and_k_must_agree():
    kwargs = {
        "input_ids": ids(5),
        "cu_seq_lens_q": torch.tensor([0, 3, 5], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, 2, 5], dtype=torch.int32),
    }
    with pytest.raises(ValueError, match="does not match"):
        packed_info_for_forward(kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Under torch.compile: the decision and the metadata on the host, the layers traced whole
# ---------------------------------------------------------------------------------------------------------------------


def varied_batches(count: int, seed: int = 0):
    """``count`` packed batches of 2 to 6 samples of 3 to 39 tokens each: every batch of other lengths."""
    from unpack_trainer.packed_seq_info import restart_positions

    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        lengths = torch.randint(3, 40, (int(torch.randint(2, 7, (1,), generator=generator)),), generator=generator)
        ids = torch.randint(1, 64, (1, int(lengths.sum())), generator=generator)
        yield {
            "input_ids": ids,
            "labels": ids,
            "position_ids": restart_positions(lengths).unsqueeze(0),
            "packed_seq_lengths": lengths.to(torch.int32),
        }


def compiled_model(tiny_model, implementation: str, **overrides):
    """A tiny Llama patched for compile, with an uncompiled twin of the same weights to compare against."""
    from unpack_trainer.models import patch_model

    def build():
        return tiny_model("llama", attn_implementation=implementation, vocab_size=64, **overrides)

    return patch_model(build(), compiled=True), patch_model(build())


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters emptied before and after the test."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_compiled_layers_have_no_graph_break_and_stop_recompiling(implementation, tiny_model, fresh_dynamo):
    """Each patched decoder layer compiled with ``fullgraph=True`` (a graph break inside it is an error) trains on 20
    packed batches of other lengths each: it recompiles only while the shapes turn symbolic (a few batches), never
    after, and its loss and gradients are the uncompiled model's."""
    model, reference = compiled_model(tiny_model, implementation)
    for layer in model.model.layers:
        layer.compile(backend="eager", fullgraph=True)
    seen = []
    for step, batch in enumerate(varied_batches(20)):
        loss = model(**batch).loss
        loss.backward()
        expected = reference(**batch).loss
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        if step % 5 == 4:
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        model.zero_grad(), reference.zero_grad()
        seen.append(graphs_compiled())
    assert seen[-1] <= 6, seen  # warm-up: static, then symbolic shapes
    assert seen[8] == seen[-1], seen  # and no recompile after it


def test_compiled_flex_layers_have_no_graph_break(monkeypatch, tiny_model, fresh_dynamo):
    """flex (forward only on the CPU) in compiled layers: the block mask planned on the host, no graph break, no
    recompile after the first batches, the uncompiled logits."""
    from unpack_trainer.patches.attention import ENV_BACKEND

    monkeypatch.setenv(ENV_BACKEND, "flex")
    model, reference = compiled_model(tiny_model, "sdpa", head_dim=16)  # flex's kernel takes head dims of 16 and up
    model.eval(), reference.eval()
    for layer in model.model.layers:
        layer.compile(backend="eager", fullgraph=True)
    seen = []
    with torch.no_grad():
        for batch in varied_batches(12, seed=1):
            torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-5)
            seen.append(graphs_compiled())
    assert seen[-1] <= 6 and seen[4] == seen[-1], seen


def test_a_compiled_model_breaks_only_at_the_decoder_hook(tiny_model, fresh_dynamo):
    """The whole model compiled (what ``torch_compile=True`` does): the one graph break in a packed forward is the
    decoder hook's host work (``_start_packed_forward``), before the layers; graphs stop being added after the first
    batches."""
    from torch._dynamo.utils import counters

    model, reference = compiled_model(tiny_model, "sdpa")
    compiled = torch.compile(model, backend="eager")
    seen = []
    for batch in varied_batches(12, seed=2):
        loss = compiled(**batch).loss
        loss.backward()
        torch.testing.assert_close(loss, reference(**batch).loss, rtol=1e-5, atol=1e-6)
        seen.append(graphs_compiled())
    breaks = list(counters["graph_break"])
    assert breaks and all("_start_packed_forward" in reason for reason in breaks), breaks
    # Graphs stop being added after the warm-up: from the 7th batch here (torch 2.13, transformers 5.24); torch 2.11
    # with transformers 5.22 recompiles one decorator frame per length until dynamo's cache limit (8), 2 batches more.
    assert seen[-4] == seen[-1] <= 10, seen


def test_the_trainer_patches_for_compile(tmp_path, sft_args, tiny_llama, prompt_completion):
    """``torch_compile=True``: the trainer patches its model for compile (the metadata planned on the host)."""
    from unpack_trainer import SFTTrainer
    from unpack_trainer.model_zoo.tiny import char_tokenizer
    from unpack_trainer.models.state import decoder_state

    tokenizer = char_tokenizer()
    args = sft_args(tmp_path, packing=True, torch_compile=True, torch_compile_backend="eager")
    trainer = SFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)), args=args, train_dataset=prompt_completion(),
        processing_class=tokenizer,
    )  # fmt: skip
    assert decoder_state(trainer.model.model).compiled


# ---------------------------------------------------------------------------------------------------------------------
# Device reads: a forward never reads the packing metadata back from the device
# ---------------------------------------------------------------------------------------------------------------------

_DEVICE_METADATA = ("packed_seq_lengths", "cu_seq_lens_q", "cu_seq_lens_k")


def _collated(seq_info, lengths=(5, 1, 9, 3, 6)):
    from unpack_trainer import DataCollatorForPacking

    generator = torch.Generator().manual_seed(7)
    examples = [{"input_ids": torch.randint(3, 60, (n,), generator=generator).tolist()} for n in lengths]
    return DataCollatorForPacking(pad_token_id=0, seq_info=seq_info)(examples)


def _as_seen_from_the_host(batch):
    """``batch`` with its metadata tensors on the meta device: what a GPU copy is to the host, unreadable (a read
    raises instead of waiting for the device)."""
    return {key: value.to("meta") if key in _DEVICE_METADATA else value for key, value in batch.items()}


@pytest.fixture
def patched_llama(tiny_model):
    from unpack_trainer.models import patch_model

    model = tiny_model("llama", attn_implementation="sdpa", vocab_size=64, max_position_embeddings=128)
    patch_model(model)
    return model


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_a_batch_carrying_its_info_is_never_read_back_from_the_device(backend, monkeypatch, patched_llama):
    """The collator's ``packed_seq_info`` (built on the host) is adopted: the forward and backward read none of
    ``packed_seq_lengths`` / ``cu_seq_lens_*`` (on a GPU each read waits for the device), and compute the same."""
    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", backend)
    batch = _collated(seq_info=True)
    assert isinstance(batch["packed_seq_info"], PackedSeqInfo)
    results = []
    for given in (batch, _as_seen_from_the_host(batch)):
        patched_llama.zero_grad()
        out = patched_llama(**given)
        out.loss.backward()
        results.append((out.logits.detach(), patched_llama.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_metadata_given_only_as_device_tensors_is_read_back(patched_llama):
    """Without ``packed_seq_info`` the hook has to read the metadata tensors (once per forward): the read the
    carried info avoids, and what the test above would catch."""
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        patched_llama(**_as_seen_from_the_host(_collated(seq_info=False)))


def test_carried_info_of_another_shape_is_a_clear_error(patched_llama):
    batch = _collated(seq_info=True)
    batch["packed_seq_info"] = PackedSeqInfo.from_seq_lengths(torch.tensor([4, 4]), batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match=r"`packed_seq_info` describes 1 row\(s\) of 8 tokens but the batch has 1"):
        patched_llama(**batch)
    batch["packed_seq_info"] = [4, 4]
    with pytest.raises(ValueError, match="`packed_seq_info` must be a PackedSeqInfo"):
        patched_llama(**batch)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "torch_varlen", "flex"])
def test_no_host_sync_in_a_packed_forward_and_backward(backend, monkeypatch, tiny_model):
    """On the GPU, a whole patched forward and backward of a new batch (the collator's, moved to the device as
    accelerate moves it) never waits for the device: torch's sync debug mode raises on any synchronising call."""
    from unpack_trainer.models import patch_model
    from unpack_trainer.patches.attention import backend_unavailable_reason

    reason = backend_unavailable_reason(backend, torch.device("cuda"), torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("UNPACK_ATTENTION_BACKEND", backend)
    model = tiny_model("llama", vocab_size=64, max_position_embeddings=256, head_dim=16).cuda()
    patch_model(model)

    def step(lengths):
        batch = {
            key: value.to("cuda", non_blocking=True) if isinstance(value, torch.Tensor) else value
            for key, value in _collated(seq_info=True, lengths=lengths).items()
        }
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        out.loss.backward()

    step((37, 1, 150, 9, 40))  # compiles kernels, loads libraries
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step((12, 80, 3, 64, 29, 7))
    finally:
        torch.cuda.set_sync_debug_mode("default")
