"""Branched packed segments (a shared prompt with two continuations) == each branch run alone with its prompt.

A segment ``[p, c, r]`` is one packed sample ``p`` with two branches ``c`` and ``r`` that both continue from ``|p|``
(``packed_seq_parents``). Its logits and every parameter gradient must equal those of ``[p, c]`` and ``[p, r]`` run
separately and unpatched, fp32, relative 1e-5, on every CPU backend, with sliding windows, softcap and a MoE.
"""

from __future__ import annotations

import pytest
import torch

from unpack_trainer.model_zoo.tiny import tiny_model
from unpack_trainer.models import patch_model
from unpack_trainer.packed_seq_info import SEQ_PARENTS_KEY, PackedSeqInfo

REL = 1e-5
SIZES = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=512, head_dim=16, sliding_window=5)
# model_type -> overrides; windows of 5 tokens are shorter than the segments below, so they cut inside the branches.
ARCHITECTURES = {
    "llama": {},
    "qwen3": dict(use_sliding_window=True, max_window_layers=1),
    "gemma2": dict(attn_logit_softcapping=20.0, final_logit_softcapping=None, query_pre_attn_scalar=16),
    "qwen3_moe": dict(use_sliding_window=True, max_window_layers=1),
}
# (|p|, |c|, |r|) per pair; one pair with a single-token prompt, one with equal branch lengths.
PAIRS = [(6, 4, 7), (1, 3, 2), (9, 5, 5)]


def _pairs(vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, vocab, (n,), generator=generator) for n in sizes) for sizes in PAIRS]


def branched_batch(pairs) -> dict:
    """One packed row ``[p1, c1, r1, p2, ...]`` with ``packed_seq_lengths`` and ``packed_seq_parents``."""
    ids, lengths, parents = [], [], []
    for p, c, r in pairs:
        root = len(lengths)
        ids += [p, c, r]
        lengths += [len(p), len(c), len(r)]
        parents += [-1, root, root]
    return {
        "input_ids": torch.cat(ids).unsqueeze(0),
        "packed_seq_lengths": torch.tensor(lengths, dtype=torch.int32),
        SEQ_PARENTS_KEY: torch.tensor(parents),
    }


def _weights(pairs, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(len(p) + len(c) + len(r), vocab, generator=generator) for p, c, r in pairs]


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp(min=1e-6)
    error = (actual - expected).abs().max() / scale
    assert error <= REL, f"{what}: relative error {float(error):.2e}"


def test_positions_and_units_of_a_branched_segment():
    info = PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2, 1]), batch_size=1, seq_len=6, seq_parents=[-1, 0, 0])
    assert info.is_branched
    assert info.position_ids().tolist() == [[0, 1, 2, 3, 4, 3]]
    unit_info, gather, owner = info.branch_units()
    assert unit_info.seq_lengths.tolist() == [5, 4]
    assert gather.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5]
    assert owner.tolist() == [0, 1, 2, 3, 4, 8]


@pytest.mark.parametrize(
    "lengths, parents, expected_lengths, expected_parents",
    [
        # |p| = 4: c's and r's first tokens share positions 3-5's chunk with p's last token
        ([4, 3, 2], [-1, 0, 0], [3, 1, 2, 1, 2], [-1, -1, 1, -1, 1]),
        # every sample fits a chunk, but c's second token (position 3) starts the next one
        ([2, 2], [-1, 0], [2, 1, 1], [-1, 0, -1]),
        # |p| a multiple of the chunk: the branches start fresh chunks
        ([3, 4], [-1, 0], [3, 3, 1], [-1, -1, -1]),
    ],
)
def test_chunks_of_a_branched_batch_follow_positions(lengths, parents, expected_lengths, expected_parents):
    info = PackedSeqInfo.from_seq_lengths(
        torch.tensor(lengths), batch_size=1, seq_len=sum(lengths), seq_parents=parents
    )
    chunks = info.chunked(3)
    assert chunks.seq_lengths.tolist() == expected_lengths
    assert chunks.seq_parents.tolist() == expected_parents


@pytest.mark.parametrize(
    "parents, message",
    [([-1, 1, 0], "parent 1"), ([-1, 0, 1], "parent 1"), ([-1, 0], "2 entries"), ([0, -1, -1], "parent 0")],
)
def test_bad_parents_are_refused(parents, message):
    with pytest.raises(ValueError, match=message):
        PackedSeqInfo.from_seq_lengths(torch.tensor([3, 2, 1]), batch_size=1, seq_len=6, seq_parents=parents)


def test_a_parent_in_another_row_is_refused():
    with pytest.raises(ValueError, match="same row"):
        PackedSeqInfo.from_seq_lengths(torch.tensor([3, 3]), batch_size=2, seq_len=3, seq_parents=[-1, 0])


# gemma2 and gpt_oss (sinks) have no SDPA implementation in transformers; eager is their backend. bloom and mpt (ALiBi) have only
# transformers' eager attention (the packed path picks its own backend) and forward only their named arguments from
# the causal LM to the decoder, so the packing keys, the parents included, are carried to it.
# gpt_oss: attention sinks, sliding windows. llama4_text: chunked attention (chunks of 3 tokens counted by position,
# so a branch's first tokens share the chunk of its prompt's last ones unless |p| is a multiple of 3).
ARCHITECTURES.update({"bloom": {}, "mpt": {}, "gpt_oss": {}, "llama4_text": {}})
CASES = [
    (arch, backend)
    for arch in ARCHITECTURES
    for backend in ("sdpa", "eager")
    if (arch, backend) not in {("gemma2", "sdpa"), ("bloom", "sdpa"), ("mpt", "sdpa"), ("gpt_oss", "sdpa")}
]


@pytest.mark.parametrize("arch, backend", CASES)
def test_branched_logits_and_gradients_equal_each_branch_alone(arch, backend):
    model = tiny_model(arch, attn_implementation=backend, **{**SIZES, **ARCHITECTURES[arch]}).eval()
    vocab = model.config.vocab_size
    pairs = _pairs(vocab)
    weights = _weights(pairs, vocab)

    # Reference: [p, c] and [p, r] one by one, unpatched; p's logits are taken from [p, c] only.
    expected_logits = []
    for (p, c, r), w in zip(pairs, weights):
        chosen = model(input_ids=torch.cat([p, c]).unsqueeze(0)).logits[0]
        rejected = model(input_ids=torch.cat([p, r]).unsqueeze(0)).logits[0]
        logits = torch.cat([chosen, rejected[len(p) :]])
        (logits * w).sum().backward()
        expected_logits.append(logits.detach())
    expected_grads = _grads(model)

    patch_model(model)
    logits = model(**branched_batch(pairs)).logits[0]
    (logits * torch.cat(weights)).sum().backward()
    _close(logits.detach(), torch.cat(expected_logits), f"{arch}/{backend} logits")
    grads = _grads(model)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        _close(grad, expected_grads[name], f"{arch}/{backend} grad {name}")


def test_branches_never_see_each_other():
    """Changing the rejected branch leaves the prompt's and the chosen branch's logits bit-identical."""
    model = tiny_model("llama", **SIZES).eval()
    patch_model(model)
    pairs = _pairs(model.config.vocab_size)
    batch = branched_batch(pairs)
    before = model(**batch).logits[0]
    p, c, r = pairs[0]
    batch["input_ids"][0, len(p) + len(c) : len(p) + len(c) + len(r)] = 3
    after = model(**batch).logits[0]
    assert torch.equal(before[: len(p) + len(c)], after[: len(p) + len(c)])
    assert torch.equal(before[sum(map(len, pairs[0])) :], after[sum(map(len, pairs[0])) :])


def test_attention_weights_of_a_branched_row_are_refused():
    """``output_attentions=True`` sends a packed row to transformers' dense-mask path, which knows no branches: the
    second completion lost its prompt (logits off by 2.6 on this model), without a word."""
    model = tiny_model("llama", attn_implementation="eager", **SIZES).eval()
    patch_model(model)
    batch = branched_batch(_pairs(model.config.vocab_size))
    with pytest.raises(ValueError, match="shared prompts"):
        model(**batch, output_attentions=True)


def test_mismatched_position_ids_are_refused():
    model = tiny_model("llama", **SIZES).eval()
    patch_model(model)
    batch = branched_batch(_pairs(model.config.vocab_size))
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0)
    with pytest.raises(ValueError, match="branched"):
        model(**batch)


# -- the attention helper alone: every backend, window, softcap, GQA; the GPU kernels with @pytest.mark.gpu ----------


class _Module(torch.nn.Module):
    is_causal = True


def _reference_attention(q, k, v, info, *, scaling, window, softcap):
    """fp64 attention of every branch over ``[prefix; branch]`` (prefix alone for a root), one unit at a time."""
    q, k, v = (x.transpose(0, 1).flatten(1, 2).double() for x in (q, k, v))  # (H, B * T, D), rows one after another
    heads_per_kv = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(heads_per_kv, 0), v.repeat_interleave(heads_per_kv, 0)
    out = torch.zeros(q.shape[1], q.shape[0], v.shape[-1], dtype=torch.float64, device=q.device)
    starts, lengths, parents = info.cu_seqlens.tolist(), info.seq_lengths.tolist(), info.seq_parents.tolist()
    for index, parent in enumerate(parents):
        own = list(range(starts[index], starts[index] + lengths[index]))
        keys = (list(range(starts[parent], starts[parent] + lengths[parent])) if parent >= 0 else []) + own
        scores = q[:, own] @ k[:, keys].transpose(1, 2) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(len(own), device=q.device).unsqueeze(1) + len(keys) - len(own)
        j = torch.arange(len(keys), device=q.device).unsqueeze(0)
        allowed = (j <= i) & ((j > i - window) if window is not None else True)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[own] = (weights @ v[:, keys]).transpose(0, 1)
    return out


# (lengths, parents, rows): a prefix with two branches, a sample alone, a prefix with three; a later branch after
# another sample; a first branch that does not follow its prefix (run as [prefix; branch] units); two rows; two
# preference pairs in a row as DPOTrainer packs them, each first branch shorter than the second.
LAYOUTS = {
    "mixed": ([7, 3, 5, 4, 9, 2, 1, 6], [-1, 0, 0, -1, -1, 4, 4, 4], 1),
    "late_branch": ([5, 3, 4, 6], [-1, 0, -1, 0], 1),
    "apart": ([5, 4, 3, 6], [-1, -1, 0, 1], 1),
    "two_rows": ([4, 2, 3, 5, 4], [-1, 0, 0, -1, 3], 2),
    "two_pairs": ([10, 5, 6, 8, 3, 6], [-1, 0, 0, -1, 3, 3], 1),
}


def _layout(layout: str) -> tuple[PackedSeqInfo, list[torch.Tensor], torch.Generator]:
    """The metadata of ``LAYOUTS[layout]``, fp32 q (4 heads), k and v (2 heads) ``(rows, heads, seq_len, 16)`` drawn
    from seed 0, and the generator, to draw more from."""
    lengths, parents, rows = LAYOUTS[layout]
    seq_len = sum(lengths) // rows
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=rows, seq_len=seq_len, seq_parents=parents)
    generator = torch.Generator().manual_seed(0)
    return info, [torch.randn(rows, h, seq_len, 16, generator=generator) for h in (4, 2, 2)], generator


def _attention_case(backend, window, softcap, dtype, device, monkeypatch, layout="mixed"):
    from unpack_trainer.patches import attention

    monkeypatch.setenv(attention.ENV_BACKEND, backend)
    info, inputs, _ = _layout(layout)
    q, k, v = (x.to(device, dtype).requires_grad_() for x in inputs)
    out, _ = attention.packed_attention_forward(
        _Module(), q, k, v, None, scaling=0.25, sliding_window=window, softcap=softcap, packed_seq_info=info
    )
    expected = _reference_attention(
        q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), info, scaling=0.25, window=window, softcap=softcap
    )
    return out.flatten(0, 1).float().cpu(), expected


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend, softcap", [("sdpa", None), ("eager", None), ("eager", 2.0)])
def test_branched_attention_equals_the_reference(backend, softcap, window, layout, monkeypatch):
    out, expected = _attention_case(backend, window, softcap, torch.float32, "cpu", monkeypatch, layout)
    _close(out.double(), expected, f"{backend} window={window} softcap={softcap} {layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_branched_attention_gradients_equal_the_reference(backend, layout, monkeypatch):
    """q, k and v gradients through the branch buckets (a prefix's keys read by several units) == fp64 reference."""
    from unpack_trainer.patches import attention

    monkeypatch.setenv(attention.ENV_BACKEND, backend)
    info, inputs, generator = _layout(layout)
    weight = torch.randn(info.total_tokens, 4, 16, generator=generator, dtype=torch.float64)
    packed = _output_and_grads(info, inputs, weight, torch.float64, window=3, softcap=None)
    expected = _output_and_grads(info, inputs, weight, torch.float64, window=3, softcap=None, reference=True)
    for name, actual, reference in zip(["dq", "dk", "dv"], packed[1:], expected[1:]):
        _close(actual, reference, f"{backend} {layout} {name}")


def _output_and_grads(info, inputs, weight, dtype, *, window, softcap, reference=False) -> list[torch.Tensor]:
    """``[out, dq, dk, dv]`` in fp64 of packed attention (the backend of ``UNPACK_ATTENTION_BACKEND``) on ``inputs``
    cast to ``dtype``, or of the fp64 reference (``reference=True``), for the loss ``sum(out * weight)``
    (``weight``: ``(total_tokens, 4, 16)`` fp64)."""
    from unpack_trainer.patches import attention

    q, k, v = (x.detach().to(torch.float64 if reference else dtype).clone().requires_grad_() for x in inputs)
    if reference:
        out = _reference_attention(q, k, v, info, scaling=0.25, window=window, softcap=softcap)
    else:
        out = attention.packed_attention_forward(
            _Module(), q, k, v, None, scaling=0.25, sliding_window=window, softcap=softcap, packed_seq_info=info
        )[0].flatten(0, 1)
    (out.double() * weight).sum().backward()
    return [out.detach().double()] + [x.grad.double() for x in (q, k, v)]


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_the_prompt_is_queried_once(backend, monkeypatch):
    """A segment [p, c, r] computes p's queries once: attention runs [p; c] causally and r's queries alone against
    the keys [p; r] (aligned to the end of its keys), so the query rows computed are |p| + |c| + |r|, not
    2|p| + |c| + |r| (each branch re-running the prompt)."""
    from unpack_trainer.patches import attention

    monkeypatch.setenv(attention.ENV_BACKEND, backend)
    rows = []
    if backend == "sdpa":
        original = torch.nn.functional.scaled_dot_product_attention

        def counting(q, k, v, **kwargs):
            rows.append(q.shape[0] * q.shape[2])
            return original(q, k, v, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    else:
        original = torch.nn.functional.softmax

        def counting(scores, *args, **kwargs):
            rows.append(scores.shape[0] * scores.shape[2])
            return original(scores, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "softmax", counting)
    lengths = [6, 4, 7]
    info = PackedSeqInfo.from_seq_lengths(torch.tensor(lengths), batch_size=1, seq_len=17, seq_parents=[-1, 0, 0])
    q, k, v = (torch.randn(1, h, 17, 16) for h in (4, 2, 2))
    out, _ = attention.packed_attention_forward(_Module(), q, k, v, None, scaling=0.25, packed_seq_info=info)
    assert sum(rows) == 17
    expected = _reference_attention(q, k, v, info, scaling=0.25, window=None, softcap=None)
    _close(out[0].double(), expected, backend)


class _BottomRightFlash:
    """A CPU stand-in for ``flash_attn_varlen_func`` with flash-attn's documented semantics (2.1 and later): with
    ``causal=True`` each sequence's queries are aligned to the end of its keys (query ``i`` of ``n_q`` sees keys
    ``j <= i + n_k - n_q``), the window ``(left, 0)`` counted from there; grouped kv heads as they are."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal, **options):
        assert causal is True and dropout_p == 0.0
        assert cu_q.dtype == cu_k.dtype == torch.int32 and int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0]
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn 2 takes one head dim for q, k and v"
        q_lengths, k_lengths = (x[1:] - x[:-1] for x in (cu_q, cu_k))
        assert max_q == int(q_lengths.max()) and max_k == int(k_lengths.max())
        self.calls.append((q.shape[0], k.shape[0]))
        left = options.get("window_size", (-1, -1))[0]
        heads_per_kv = q.shape[1] // k.shape[1]
        outputs = []
        for u in range(len(q_lengths)):
            qs = q[int(cu_q[u]) : int(cu_q[u + 1])]
            ks, vs = (x[int(cu_k[u]) : int(cu_k[u + 1])].repeat_interleave(heads_per_kv, 1) for x in (k, v))
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
            if options.get("softcap") is not None:
                scores = torch.tanh(scores / options["softcap"]) * options["softcap"]
            i = torch.arange(qs.shape[0]).unsqueeze(1) + ks.shape[0] - qs.shape[0]
            j = torch.arange(ks.shape[0]).unsqueeze(0)
            allowed = (j <= i) & ((j >= i - left) if left >= 0 else True)
            outputs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vs))
        return torch.cat(outputs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window, softcap", [(None, None), (3, None), (None, 2.0)])
def test_branched_attention_on_flash_queries_each_token_once(window, softcap, layout, monkeypatch, stand_in_kernel):
    """flash-attn gets the row's tokens as queries once and ``[prefix; branch]`` keys per unit (cu_seqlens_q !=
    cu_seqlens_k, bottom-right causal); a first branch apart from its prefix runs as ``[prefix; branch]`` units.
    Output and q/k/v gradients == the fp64 reference."""
    from unpack_trainer.patches import attention

    kernel = _BottomRightFlash()
    stand_in_kernel("flash", kernel, cpu=True, dtypes=(torch.float32,))
    monkeypatch.setenv(attention.ENV_BACKEND, "flash")
    info, inputs, generator = _layout(layout)
    weight = torch.randn(info.total_tokens, 4, 16, generator=generator, dtype=torch.float64)
    flash = _output_and_grads(info, inputs, weight, torch.float32, window=window, softcap=softcap)
    expected = _output_and_grads(info, inputs, weight, torch.float32, window=window, softcap=softcap, reference=True)
    for name, actual, reference in zip(["out", "dq", "dk", "dv"], flash, expected):
        _close(actual, reference, f"flash {layout} window={window} softcap={softcap} {name}")
    ((queries, keys),) = kernel.calls
    assert queries == info.total_tokens
    # the units path (apart) hands the kernel the same units as queries and keys
    assert (keys == queries) == (layout == "apart")


def test_the_reference_builds_on_the_inputs_device():
    """The fp64 reference never mixes a CPU tensor into inputs on another device (``meta``: any CPU tensor raises)."""
    info, inputs, _ = _layout("mixed")
    q, k, v = (x.to("meta") for x in inputs)
    out = _reference_attention(q, k, v, info, scaling=0.25, window=3, softcap=2.0)
    assert out.device.type == "meta" and out.shape == (info.total_tokens, 4, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", ["flash", "torch_varlen", "xformers", "flex", "sdpa"])
def test_branched_attention_on_the_cuda_kernels(backend, window, monkeypatch):
    from unpack_trainer.patches import attention

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if backend == "flash":
        pytest.importorskip("flash_attn")
    if backend == "xformers":
        pytest.importorskip("xformers")
    reason = attention.backend_unavailable_reason(backend, torch.device("cuda"), torch.bfloat16)
    if backend in ("torch_varlen", "flex") and reason is not None:
        pytest.skip(reason)
    out, expected = _attention_case(backend, window, None, torch.bfloat16, "cuda", monkeypatch)
    error = (out.double() - expected).abs().max() / expected.abs().max()
    assert error <= 2e-2, f"{backend}: relative error {float(error):.2e}"
