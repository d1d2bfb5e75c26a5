"""unpack_trainer/models/routing.py: the mask function registered for transformers (no mask inside a packed forward
of its decoders, the original implementation's mask otherwise) and the registration it lives in."""

import copy
import types
import weakref

import pytest
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from unpack_trainer.models.routing import make_mask_function
from unpack_trainer.models.state import DecoderState
from unpack_trainer.packed_seq_info import PackedSeqInfo


def state_of(config=None):
    """The state of a decoder routed under a test name: only ``config`` and the running forward are read."""
    return DecoderState("test", "sdpa", True, True, config=config if config is not None else types.SimpleNamespace())


def info_of(lengths):
    return PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=sum(lengths))


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
    state = state_of()
    function = make_mask_function(
        "sdpa",
        {id(state.config): (weakref.ref(state),)},
        fallback=lambda *args, **kwargs: calls.append(kwargs) or "fallback mask",
    )
    config = types.SimpleNamespace()
    assert function(config=config) == "fallback mask" and calls == [{"config": config}]


def test_mask_function_calls_the_original_outside_a_packed_forward(original_mask):
    state = state_of()
    function = make_mask_function("unpack_test_original", {id(state.config): (weakref.ref(state),)})
    assert function.original_implementation == "unpack_test_original"
    config = types.SimpleNamespace()
    assert function(1, 2, config=config, flag=True) == "original mask"
    assert original_mask == [((1, 2), {"config": config, "flag": True})]


def test_mask_function_builds_no_mask_inside_a_packed_forward(original_mask):
    state = state_of()
    function = make_mask_function("unpack_test_original", {id(state.config): (weakref.ref(state),)})
    state.running = info_of([3, 2])
    assert function(config=state.config) is None
    assert function() is None  # no config: any decoder's packed forward
    assert original_mask == []
    # Another model's mask inside this packed forward (e.g. a draft model) is built as usual.
    assert function(config=types.SimpleNamespace()) == "original mask"
    assert len(original_mask) == 1
    # Where attention takes transformers' dense path (output_attentions), its mask is built.
    state.dense = True
    assert function(config=state.config) == "original mask"
    # The forward has ended.
    state.running, state.dense = None, False
    assert function(config=state.config) == "original mask"


def test_mask_function_gives_the_decoders_placeholder(original_mask):
    """A decoder that needs a tensor where the mask goes (mpt) gets its placeholder."""
    state = state_of()
    state.mask_placeholder = torch.zeros((1, 1, 1, 1), dtype=torch.bool)
    state.running = info_of([2, 2])
    assert (
        make_mask_function("unpack_test_original", {id(state.config): (weakref.ref(state),)})(config=state.config)
        is state.mask_placeholder
    )


def test_a_copy_of_a_state_is_not_inside_the_forward():
    state = state_of()
    state.running, state.carried = info_of([3, 2]), {"position_ids": None}
    copied = copy.deepcopy(state)
    assert copied.running is None and copied.carried is None and copied.routed is False
    assert state.running is not None


def test_mask_function_of_an_implementation_without_masks():
    assert "unpack_test_no_mask" not in ALL_MASK_ATTENTION_FUNCTIONS
    assert make_mask_function("unpack_test_no_mask", {})(config=types.SimpleNamespace()) is None


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
    state = state_of(config)
    got = make_mask_function("sdpa", {id(state.config): (weakref.ref(state),)})(**options)
    assert got is not None and torch.equal(got, expected)


def test_a_packed_forward_skips_transformers_packed_sequence_detection(monkeypatch, tiny_model):
    """transformers' ``find_packed_sequence_indices`` (run by ``create_causal_mask`` when ``position_ids`` come without
    an ``attention_mask``) reads a value back from the device: a host sync per forward on a GPU. Inside a packed
    forward of a patched decoder its result is not used (the mask function returns the placeholder), so it is not
    called; an unpatched model, or a batch that is not packed, calls it as before, and unpatching restores it."""
    from transformers import masking_utils

    from unpack_trainer.models import patch_model, unpatch_model
    from unpack_trainer.packed_seq_info import restart_positions

    stock = masking_utils.find_packed_sequence_indices
    calls = []

    def spy(position_ids):
        calls.append(position_ids.shape)
        return stock(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    model = tiny_model("llama", attn_implementation="sdpa", vocab_size=64)
    ids = torch.randint(3, 64, (1, 12))
    lengths = torch.tensor([5, 7], dtype=torch.int32)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(12).unsqueeze(0), use_cache=False)
        assert len(calls) == 1
        patch_model(model)
        packed = model(input_ids=ids, packed_seq_lengths=lengths).logits
        assert len(calls) == 1
        model(input_ids=ids, position_ids=torch.arange(12).unsqueeze(0), use_cache=False)  # one sample: not packed
        assert len(calls) == 2
        unpatch_model(model)
        assert masking_utils.find_packed_sequence_indices is spy
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(lengths.tolist(), dim=1)], dim=1)
        restarted = model(input_ids=ids, position_ids=restart_positions(lengths).unsqueeze(0), use_cache=False).logits
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(restarted, alone, rtol=1e-5, atol=1e-5)


def test_garbage_collection_never_shrinks_what_a_trace_reads(tiny_model):
    """A patched model dropped in a reference cycle is collected whenever the garbage collector runs, which may be in
    the middle of ``torch.compile`` or ``torch.export`` of another patched model: between the trace, which read the
    routing table through the mask function, and the guards dynamo builds from the same paths afterwards. The
    finalizer pruned the table then, and the guard building failed with an ``IndexError`` (CI's oldest releases,
    ``test_export_of_a_patched_model``). Now the mask function reads only the entry of its own config, and the
    collector removes an entry only when no decoder of that config is left; route / release_route prune the rest."""
    import gc

    from unpack_trainer.models import patch_model, routing, unpatch_model

    model = patch_model(tiny_model("llama", attn_implementation="sdpa", vocab_size=64))
    shared = patch_model(type(model)(model.config))  # the same config: the entry a trace of `model` reads
    alone = patch_model(tiny_model("llama", attn_implementation="sdpa", vocab_size=64))  # a config of its own
    table = routing._routed_states["sdpa"]
    entry, own = table[id(model.config)], id(alone.config)
    assert len(entry) == 2 and own in table
    for dropped in (shared, alone):
        dropped.cycle = [dropped]  # collected only by the garbage collector, not when the last name goes
    alive = [weakref.ref(shared), weakref.ref(alone)]
    del shared, alone, dropped
    gc.collect()
    assert all(known() is None for known in alive)
    assert table[id(model.config)] is entry and own not in table
    unpatch_model(model)
    assert id(model.config) not in table


def test_a_model_collected_before_the_guards_of_an_export_are_built(monkeypatch, tiny_model):
    """The same in a real trace: the garbage collector runs after ``torch.export`` (strict: dynamo) traced the forward
    and before its guards are built, and collects a dropped patched model sharing the traced model's config."""
    import gc

    from torch._dynamo import guards

    from unpack_trainer.models import patch_model, unpatch_model

    model = patch_model(tiny_model("llama", attn_implementation="sdpa", vocab_size=64))
    dropped = patch_model(type(model)(model.config))
    dropped.cycle = [dropped]
    alive = weakref.ref(dropped)
    del dropped
    build_guards = guards.CheckFunctionManager.__init__

    def collect_then_build(self, *args, **kwargs):
        gc.collect()
        return build_guards(self, *args, **kwargs)

    monkeypatch.setattr(guards.CheckFunctionManager, "__init__", collect_then_build)
    ids, mask = torch.randint(3, 64, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    exported = torch.export.export(model, args=(), kwargs=inputs, strict=True)
    monkeypatch.undo()
    assert alive() is None
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(**inputs).logits, model(**inputs).logits)
    unpatch_model(model)
