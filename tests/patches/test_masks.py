"""unpack_trainer/patches/masks.py: the per-thread stack of packed forwards, the mask function registered for
transformers, and the once-per-forward decision whether a batch is packed."""

import threading
import types

import pytest
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches import masks
from unpack_trainer.patches.masks import (
    current_packed_info,
    make_mask_function,
    packed_forward_active,
    packed_info_for_forward,
    reset_packed_forward,
)


def decoder():
    """Stands in for a decoder model: only ``config`` is read."""
    return types.SimpleNamespace(config=types.SimpleNamespace())


def info_of(lengths):
    return PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=sum(lengths))


@pytest.fixture(autouse=True)
def _empty_stack():
    """Every test starts and ends with no packed forward running in this thread."""
    masks.RUNNING_FORWARDS.clear()
    yield
    masks.RUNNING_FORWARDS.clear()


# ---------------------------------------------------------------------------------------------------------------------
# The per-thread stack of packed forwards
# ---------------------------------------------------------------------------------------------------------------------


def test_no_packed_forward_running():
    assert current_packed_info() is None
    assert current_packed_info(decoder().config) is None


def test_innermost_forward_wins_and_config_selects():
    outer, inner = decoder(), decoder()
    outer_info, inner_info = info_of([3, 2]), info_of([1, 4])
    packed_forward_active(outer, outer_info)
    packed_forward_active(inner, inner_info)
    assert current_packed_info() is inner_info
    assert current_packed_info(inner.config) is inner_info
    assert current_packed_info(outer.config) is outer_info
    assert current_packed_info(decoder().config) is None  # a decoder whose forward is not packed
    reset_packed_forward(inner)
    assert current_packed_info() is outer_info
    assert current_packed_info(inner.config) is None
    reset_packed_forward(outer)
    assert current_packed_info() is None


def test_marking_twice_replaces_the_entry():
    model = decoder()
    first, second = info_of([3, 2]), info_of([5])
    packed_forward_active(model, first)
    packed_forward_active(model, second)  # e.g. after a failed trace left the first entry behind
    assert masks.RUNNING_FORWARDS.stack == [(model, second, True)]
    reset_packed_forward(model)
    assert current_packed_info() is None
    reset_packed_forward(model)  # not packed any more: a no-op
    assert current_packed_info() is None


def test_one_entry_serves_attention_and_the_mixers():
    """With ``output_attentions`` the hook publishes the forward for the token mixers only: attention and the mask
    function take transformers' dense path, the mixers still run per sample."""
    model, info = decoder(), info_of([3, 2])
    packed_forward_active(model, info, attention=False)
    assert current_packed_info(model.config) is None and current_packed_info() is None
    assert current_packed_info(for_attention=False) is info
    assert current_packed_info(model.config, for_attention=False) is info
    packed_forward_active(model, info)
    assert current_packed_info(model.config) is info and current_packed_info(for_attention=False) is info
    reset_packed_forward(model)
    assert current_packed_info(for_attention=False) is None


def test_stack_is_per_thread():
    model = decoder()
    packed_forward_active(model, info_of([3, 2]))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(current_packed_info(model.config)))
    thread.start()
    thread.join()
    assert seen == [None]
    assert current_packed_info(model.config) is not None


# ---------------------------------------------------------------------------------------------------------------------
# make_mask_function: None inside a packed forward, else the original implementation's mask
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def original_mask(monkeypatch):
    """A mask function registered in transformers' class-wide mapping under a test name; records its calls."""
    calls = []

    def mask(*args, **kwargs):
        calls.append((args, kwargs))
        return "original mask"

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "unpack_test_original", mask)
    return calls


def test_mask_function_calls_its_fallback():
    """Registered under transformers' own name in place of a per-instance function, it falls back to that one."""
    calls = []
    function = make_mask_function("sdpa", fallback=lambda *args, **kwargs: calls.append(kwargs) or "fallback mask")
    config = decoder().config
    assert function(config=config) == "fallback mask" and calls == [{"config": config}]


def test_mask_function_calls_the_original_outside_a_packed_forward(original_mask):
    function = make_mask_function("unpack_test_original")
    assert function.original_implementation == "unpack_test_original"
    config = decoder().config
    assert function(1, 2, config=config, flag=True) == "original mask"
    assert original_mask == [((1, 2), {"config": config, "flag": True})]


def test_mask_function_builds_no_mask_inside_a_packed_forward(original_mask):
    model = decoder()
    packed_forward_active(model, info_of([3, 2]))
    function = make_mask_function("unpack_test_original")
    assert function(config=model.config) is None
    assert function() is None  # no config: the innermost packed forward
    assert original_mask == []
    # Another model's mask inside this packed forward (e.g. a draft model) is built as usual.
    assert function(config=decoder().config) == "original mask"
    assert len(original_mask) == 1


def test_mask_function_of_an_implementation_without_masks():
    assert "unpack_test_no_mask" not in ALL_MASK_ATTENTION_FUNCTIONS
    assert make_mask_function("unpack_test_no_mask")(config=decoder().config) is None


def test_mask_function_reaches_transformers_sdpa_mask():
    """Outside a packed forward the result is exactly what the model's own implementation returns."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    options = {
        "batch_size": 1,
        "q_length": 4,
        "kv_length": 4,
        "config": config,
        "allow_is_causal_skip": False,
    }
    expected = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**options)
    got = make_mask_function("sdpa")(**options)
    assert got is not None and torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------------------------
# packed_info_for_forward: decide once per forward, and edit the forward's kwargs
# ---------------------------------------------------------------------------------------------------------------------


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
    monkeypatch.setattr(masks, "is_tracing", lambda: True)
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
    batch["packed_seq_info"] = info_of([4, 4])
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
