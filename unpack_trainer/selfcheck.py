"""Contamination probe: do packed samples give the same logits as the same samples run one by one, on *this* model?

Beside the trainer's decision (:mod:`unpack_trainer.decision`), which it confirms on the user's model: it builds its
probe batches with the data path's collator ([`unpack_trainer.data.collator.packed_metadata`]; a vision-language
model's image samples from :mod:`unpack_trainer.model_zoo.tiny_vision`) and runs them through the model, patched by
:mod:`unpack_trainer.models`, as it will train; the trainers call it before the first batch. Read-only: the model is
left as found.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch

from unpack_trainer._compat import gathered_parameters, hook_dicts, output_capturing_flag
from unpack_trainer.data.collator import packed_metadata
from unpack_trainer.data.validation import check_lengths
from unpack_trainer.packed_seq_info import SEQ_LENGTHS_KEY, SEQ_PARENTS_KEY, PackedSeqInfo

# Relative tolerance on logits, by the dtype the model computes in: packed and one-by-one runs sum in different orders.
_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_PROBE_LENGTHS = (3, 1, 4)
# Low precision judges every token, not only the largest difference (see ContaminationReport): no token may differ by
# more than _HARD_BOUND * max|alone| (a mixture-of-experts router whose top-k flips between two summation orders moves
# its token by up to about 0.3 * max|alone|), and at most _MAX_OFF_SHARE of the packed tokens may differ by more than
# the tolerance (contamination moves every token of a sample that sees another one).
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_HARD_BOUND = 0.5
_MAX_OFF_SHARE = 0.25


@dataclass(frozen=True)
class ContaminationReport:
    """Result of [`check_uncontaminated`].

    The criterion, by the dtype the model computes in (``M = max|alone|``, ``tolerance = rtol(dtype) * M + 1e-5``;
    a token's difference is ``max |packed - alone|`` over its final hidden state):

    | dtype | ``ok`` when |
    | --- | --- |
    | fp32, fp64 (any other) | ``max_abs_diff <= tolerance``: every token within the tolerance |
    | fp16, bf16 | ``max_abs_diff <= hard_bound`` and ``off_tokens <= 0.25 * compared_tokens`` |

    with ``hard_bound = max(0.5 * M + 1e-5, tolerance)`` and ``off_tokens`` the packed tokens that differ by more than
    ``tolerance``: in low precision no token may differ by more than half the largest state, and at most a quarter of
    the packed tokens by more than the tolerance.

    Low precision is judged per token because its noise is uneven. A mixture-of-experts router whose top-k flips
    between two summation orders moves that token (and the later tokens of its sample, through attention) by up to
    about ``0.3 * M`` (bf16, gpt_oss of 4 to 16 layers, CPU), while the others stay within ``tolerance``.
    Contamination moves every token of a sample that sees another sample, and every packed sample of the probe sees
    one in one of its two rows: with the packing metadata dropped, or one layer attending over the whole row, every
    model measured (six tiny families, SmolLM2-135M) had 5 to 8 of its 8 packed tokens off. The share is what catches
    it: SmolLM2's largest difference was only ``0.3`` to ``0.6 * M`` (its few outlier features make ``M`` large),
    each of its contaminated tokens ``0.08`` to ``0.6 * M``.

    The unpacked run of the first sample (the model's own code path, see [`check_uncontaminated`]) is held to
    ``hard_bound`` only, its tokens not counted among the packed ones: nothing comes before that sample, so no
    contamination shows there, and two code paths differ more than one path on two rows (the routing flips above
    were all there on the CPU; the packed rows agreed exactly). So in low precision a packed path that computes a
    slightly different function on every sample alike can pass (gpt_oss without its attention sinks: ``0.3`` to
    ``0.6 * M`` on 4 layers, mostly passing; above ``0.5 * M`` on 16); full precision still fails it.

    Attributes:
        ok: the probe passed the criterion above.
        max_abs_diff: largest ``|packed - alone|`` over every final hidden state of every probe sample (or every
            logit, for a model that returns no hidden states), the unpacked run included.
        tolerance: ``rtol(dtype) * max|alone| + 1e-5``; a packed token that differs by more is *off*.
        contaminated_diff: the same difference when the row is run as one plain causal sequence (what contamination
            would look like; NaN when not measured); if that row would pass the criterion (see ``conclusive``) the
            probe cannot see contamination on this model.
        dtype: the logits' dtype.
        seconds: wall-clock cost of the probe.
        error: the exception text if the packed forward failed (then ``ok`` is False).
        hard_bound: in low precision (fp16, bf16), the difference no token may exceed,
            ``max(0.5 * max|alone| + 1e-5, tolerance)``; ``None`` in full precision, where ``tolerance`` is that bound.
        off_tokens: how many of the ``compared_tokens`` differ by more than ``tolerance``.
        compared_tokens: how many packed tokens were compared with their references (every token of the packed probe
            rows and of the image probes; the unpacked run's tokens are not counted).
        contaminated_off_share: the share of the plain causal row's tokens that differ by more than ``tolerance``
            (NaN when not measured).
    """

    ok: bool
    max_abs_diff: float
    tolerance: float
    contaminated_diff: float
    dtype: torch.dtype | None
    seconds: float
    error: str | None = None
    hard_bound: float | None = None
    off_tokens: int = 0
    compared_tokens: int = 0
    contaminated_off_share: float = float("nan")

    @property
    def bound(self) -> float:
        """The difference no token may exceed: ``hard_bound`` in low precision, else ``tolerance``."""
        return self.tolerance if self.hard_bound is None else self.hard_bound

    @property
    def off_share(self) -> float:
        """``off_tokens / compared_tokens`` (0.0 when nothing was compared)."""
        return self.off_tokens / self.compared_tokens if self.compared_tokens else 0.0

    @property
    def conclusive(self) -> bool:
        """False when contamination was measured and the contaminated row would pass the criterion on this model: its
        largest difference within ``bound`` and (in low precision) at most a quarter of its tokens off. True when not
        measured (NaN)."""
        if self.hard_bound is not None and self.contaminated_off_share > _MAX_OFF_SHARE:
            return True
        return not self.contaminated_diff <= self.bound

    def failure(self) -> str:
        """What failed, in words, for a report that is not ``ok``: the packed forward's error or the measured
        difference (in low precision: which of the two limits it broke)."""
        if self.error is not None:
            return f"the packed forward raised {self.error}"
        if self.hard_bound is None:
            return (
                f"contamination measured: max |packed - one-by-one| = {self.max_abs_diff:.3g} > tolerance "
                f"{self.tolerance:.3g} ({self.dtype})"
            )
        broken = []
        if self.max_abs_diff > self.hard_bound:
            broken.append(f"max |packed - one-by-one| = {self.max_abs_diff:.3g} > hard bound {self.hard_bound:.3g}")
        if self.off_share > _MAX_OFF_SHARE:
            broken.append(
                f"{self.off_tokens} of {self.compared_tokens} packed tokens ({self.off_share:.0%}) differ by more than "
                f"the tolerance {self.tolerance:.3g}, at most {_MAX_OFF_SHARE:.0%} may"
            )
        if not broken:
            broken.append(f"max |packed - one-by-one| = {self.max_abs_diff:.3g}")
        return f"contamination measured: {'; '.join(broken)} ({self.dtype})"

    def summary(self) -> str:
        if self.error is not None:
            return f"packed forward failed ({self.error}) [{self.seconds * 1000:.0f} ms]"
        contamination = (
            ""
            if self.contaminated_diff != self.contaminated_diff
            else f"; a contaminated row would differ by {self.contaminated_diff:.3g}"
        )
        tokens = (
            ""
            if self.hard_bound is None
            else f": {self.off_tokens} of {self.compared_tokens} packed tokens above it, at most "
            f"{_MAX_OFF_SHARE:.0%} may be; hard bound {self.hard_bound:.3g}"
        )
        return (
            f"max |packed - one-by-one| = {self.max_abs_diff:.3g} (tolerance {self.tolerance:.3g}, {self.dtype}"
            f"{tokens}{contamination}) [{self.seconds * 1000:.0f} ms]"
        )


def _judge(
    diffs: torch.Tensor, unpacked: torch.Tensor, *, tolerance: float, scale: float, dtype: torch.dtype | None
) -> tuple[bool, float, float | None, int]:
    """The probe's verdict from its per-token differences (the table of [`ContaminationReport`]).

    Args:
        diffs: ``(compared_tokens,)`` float32, each packed token's ``max |packed - alone|`` over its hidden size.
        unpacked: ``(n,)`` float32, the same for the first sample's tokens against its unpacked run (empty when not
            compared).
        tolerance: ``rtol(dtype) * scale + 1e-5``.
        scale: ``max|alone|``.
        dtype: the dtype the model computes in; fp16 and bf16 get the low-precision rule.

    Returns:
        ``(ok, max_abs_diff, hard_bound, off_tokens)``; ``hard_bound`` is ``None`` outside low precision. Diffs of
        ``[0.01, 0.3, 0.01, 0.01]`` with ``tolerance`` 0.1 and ``scale`` 1: fp32 fails (0.3 > 0.1); bf16 passes
        (1 of 4 off, 0.3 <= hard bound 0.5).
    """
    everything = torch.cat([diffs.flatten(), unpacked.flatten()])
    max_diff = float(everything.max()) if everything.numel() else 0.0
    off_tokens = int((diffs > tolerance).sum())
    if dtype not in _LOW_PRECISION:
        return bool(max_diff <= tolerance), max_diff, None, off_tokens
    hard_bound = max(_HARD_BOUND * scale + 1e-5, tolerance)
    ok = max_diff <= hard_bound and off_tokens <= _MAX_OFF_SHARE * diffs.numel()
    return bool(ok), max_diff, hard_bound, off_tokens


def _vocab_size(model: torch.nn.Module) -> int:
    embeddings = model.get_input_embeddings()
    return int(embeddings.num_embeddings if hasattr(embeddings, "num_embeddings") else embeddings.weight.shape[0])


def _device(model: torch.nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings()
    return embeddings.weight.device


@torch.no_grad()
def check_uncontaminated(
    model: torch.nn.Module,
    *,
    lengths: tuple[int, ...] = _PROBE_LENGTHS,
    branched: bool = False,
    seed: int = 0,
    rtol: float | None = None,
    measure_contamination: bool = True,
) -> ContaminationReport:
    """Run a few short random samples packed into one row and each alone; compare every token's outputs.

    With ``branched=True`` the probe is a branched segment instead (a prompt whose completions all continue it,
    ``packed_seq_parents``, the batches of ``DPOTrainer``'s and ``GRPOTrainer``'s prefix sharing; see
    [`_branched_probe_batch`]): every token of the prompt and of each completion must give what
    ``[prompt; completion]`` gives alone, so a branch that sees a sibling, or misses its prompt, fails it.

    A vision-language model of a known family (:mod:`unpack_trainer.model_zoo.tiny_vision`) is also probed with two
    image+text samples packed in one row against each alone (see [`_vision_probe`]): its images, positions and image
    blocks per sample; with ``branched=True``, with a prompt holding an image shared by two completions against each
    full sequence alone (see [`_vision_branched_probe`]).

    One forward of one packed batch of two rows does it (see [`_probe_batch`]): the samples in one order and in the
    reverse order, so each end sample is alone in one row and after all the others in the other; and one forward of
    the first sample alone, unpacked (no packing metadata), so that positions a model numbers itself (RoBERTa's
    embeddings count from ``padding_idx + 1``, not from the packed row's 0) are compared too. The batch carries
    exactly what the packed collator emits (``position_ids``, ``packed_seq_lengths``, ``cu_seq_lens_*``,
    ``max_length_*``, no attention mask), so this checks the attention path training will use, patched or not. What is
    compared is every token's final hidden state (what the LM head reads), so a model that accepts ``logits_to_keep``
    skips most of the LM head's cost. No gradients are kept; on CPU the probe runs single-threaded. The verdict: in
    fp32 every token within the tolerance; in fp16 / bf16 no token beyond a hard bound and at most a quarter of the
    packed tokens beyond the tolerance (the table of [`ContaminationReport`]).

    The probe is read-only: dropout is off (eval mode) except in layers holding quantized weights (a ``quant_state``,
    e.g. bitsandbytes ``Linear4bit``), which stay in training mode so that they run the kernels training runs (in eval
    mode under ``no_grad`` bitsandbytes converts 4-bit weights on AVX512-BF16 CPUs to an inference-only layout, and
    back-propagating through it gives wrong gradients). Every module's training flag, every parameter and buffer
    (the tensor objects and their storage) and every quantization state are put back exactly as found.

    Args:
        model: a causal LM (plain, ``PeftModel`` or quantized) whose forward returns ``logits``.
        lengths: probe sample lengths (a length-1 sample included by default); with ``branched=True``, the length of
            the prompt, then those of its completions (two or more; the default: two).
        branched: probe a branched segment (shared prompt) instead of plain packed samples.
        seed: seed of the random token ids.
        rtol: relative tolerance; ``None`` picks it by dtype (fp32 1e-4, fp16 1e-2, bf16 4e-2). In fp16 / bf16 it
            tells which packed tokens are *off* (at most a quarter may be), under a hard bound of
            ``0.5 * max|alone|`` per token (the criterion of [`ContaminationReport`]).
        measure_contamination: also run the row as one plain causal sequence, to report how large contamination
            would be on this model (one more forward).

    Under DeepSpeed ZeRO-3 the partitioned weights are gathered for the probe (read-only) and partitioned again
    after it ([`unpack_trainer._compat.gathered_parameters`]).

    Returns:
        A [`ContaminationReport`]; ``report.ok`` says whether packing is safe on this model.
    """
    with gathered_parameters(model):
        return _probe(model, lengths, branched, seed, rtol, measure_contamination)


def _probe(
    model: torch.nn.Module,
    lengths: tuple[int, ...],
    branched: bool,
    seed: int,
    rtol: float | None,
    measure_contamination: bool,
) -> ContaminationReport:
    """[`check_uncontaminated`] on a model whose weights are all there."""
    lengths = check_lengths(lengths, "lengths", min_count=3 if branched else 2)
    start = time.perf_counter()
    device = _device(model)
    threads = torch.get_num_threads()
    snapshot = _Snapshot(model)
    model.eval()
    for module in snapshot.quantized:
        module.training = True
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        build = _branched_probe_batch if branched else _probe_batch
        input_ids, metadata, packed_index, alone_index, (first_row, first_tokens) = build(
            lengths, _vocab_size(model), seed
        )
        input_ids = input_ids.to(device)
        metadata = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in metadata.items()}
        options = _output_options(model)
        try:
            outputs = model(input_ids=input_ids, **options, **metadata)
            # The first compared sample alone, as an unpacked batch: what a model that numbers positions itself
            # (RoBERTa's embeddings start at padding_idx + 1) gives it outside a packed row.
            first_ids = input_ids[first_row : first_row + 1, :first_tokens]
            first = _last_states(model(input_ids=first_ids, **options))[0].float()
        except Exception as error:  # noqa: BLE001 - any failure of the packed path means "not safe"
            return ContaminationReport(
                False, float("inf"), 0.0, 0.0, None, time.perf_counter() - start, f"{type(error).__name__}: {error}"
            )
        states = _last_states(outputs).float()
        states = states.reshape(-1, states.shape[-1])
        packed, alone = states[packed_index.to(states.device)], states[alone_index.to(states.device)]
        images = None
        try:
            probe = _vision_branched_probe if branched else _vision_probe
            images = probe(model, options, device, seed)
        except Exception as error:  # noqa: BLE001 - any failure of the packed path means "not safe"
            return ContaminationReport(
                False,
                float("inf"),
                0.0,
                0.0,
                None,
                time.perf_counter() - start,
                f"{type(error).__name__}: {error}",
            )
        contaminated_diffs = None
        if measure_contamination:  # the first row (every compared packed token) as one plain causal sequence
            contaminated = _last_states(model(input_ids=input_ids[:1], **options))[0].float()
            contaminated_diffs = (contaminated[packed_index.to(states.device)] - alone).abs().amax(dim=-1)
        unpacked = packed.new_zeros(0)
        if first.shape == packed[:first_tokens].shape:
            unpacked = (packed[:first_tokens] - first).abs().amax(dim=-1)
        if images is not None:
            packed, alone = torch.cat([packed, images[0]]), torch.cat([alone, images[1]])
        dtype = outputs.logits.dtype if rtol is not None else _logits_dtype(model, device)
        scale = float(alone.abs().max())
        tolerance = (rtol if rtol is not None else _RTOL.get(dtype, 4e-2)) * scale + 1e-5
        diffs = (packed - alone).abs().amax(dim=-1)
        ok, max_diff, hard_bound, off_tokens = _judge(diffs, unpacked, tolerance=tolerance, scale=scale, dtype=dtype)
        contaminated_diff = contaminated_off_share = float("nan")
        if contaminated_diffs is not None:
            contaminated_diff = float(contaminated_diffs.max())
            contaminated_off_share = float((contaminated_diffs > tolerance).float().mean())
        return ContaminationReport(
            ok,
            max_diff,
            tolerance,
            contaminated_diff,
            dtype,
            time.perf_counter() - start,
            hard_bound=hard_bound,
            off_tokens=off_tokens,
            compared_tokens=int(diffs.numel()),
            contaminated_off_share=contaminated_off_share,
        )
    finally:
        torch.set_num_threads(threads)
        snapshot.restore()


def _on_model(batch: dict[str, Any], model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """``batch``'s tensors on ``device``, floating-point ones in the model's parameter dtype (pixel values in bf16 for a
    bf16 model); other values as they are."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {
        key: (value.to(device, dtype) if value.is_floating_point() else value.to(device))
        if isinstance(value, torch.Tensor)
        else value
        for key, value in batch.items()
    }


def _vision_probe(
    model: torch.nn.Module, options: dict[str, object], device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a vision-language model of a family :mod:`unpack_trainer.model_zoo.tiny_vision` knows: two samples of text
    around one image each (the smallest image the model takes, random pixels, sizes read from its config) packed in
    one row as the vision collator packs them ([`unpack_trainer.data.vision.pack_processed`]), and each run alone.
    Returns ``(packed, alone)``: every token's final hidden state, float32 ``(tokens, hidden)`` each; ``None`` for
    any other model (the text probe covers it)."""
    from unpack_trainer.anatomy.structure import pretrained_model
    from unpack_trainer.anatomy.vision import is_vision_language
    from unpack_trainer.data.vision import pack_processed
    from unpack_trainer.model_zoo.tiny_vision import image_size, processed_batch, vision_sample

    if not is_vision_language(model):
        return None
    config = pretrained_model(model).config
    size = image_size(config.model_type, config)
    if size is None:
        return None
    samples = [
        vision_sample(config.model_type, config, segments, seed=seed + index)
        for index, segments in enumerate([[2, size, 3], [1, size, 2]])
    ]

    def on_device(batch: dict[str, Any]) -> dict[str, Any]:
        return _on_model({key: value for key, value in batch.items() if key != "labels"}, model, device)

    batch = pack_processed(processed_batch(samples), [s["input_ids"].shape[1] for s in samples], use_cache=None)
    packed = _last_states(model(**on_device(batch), **options))[0].float()
    alone = torch.cat([_last_states(model(**on_device(sample), **options))[0].float() for sample in samples])
    return packed, alone


def _vision_branched_probe(
    model: torch.nn.Module, options: dict[str, object], device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a vision-language model of a family :mod:`unpack_trainer.model_zoo.tiny_vision` knows: a prompt of text around
    one image (as in [`_vision_probe`]) and two completions of random text, packed as a preference pair is
    ([`unpack_trainer.data.preference.pack_vision_pairs`]: the prompt and its image once, the completions as its
    branches, positions read from each full sequence), against each full sequence ``[prompt; completion]`` run alone
    with its image. Returns ``(packed, alone)``: the final hidden state of every packed token (the prompt's and the
    first completion's against the first sequence, the second completion's against the second), float32
    ``(tokens, hidden)`` each; ``None`` for any other model (the text probe covers it)."""
    from unpack_trainer.anatomy.structure import pretrained_model
    from unpack_trainer.anatomy.vision import is_vision_language, sequence_positions_of
    from unpack_trainer.data.preference import pack_vision_pairs
    from unpack_trainer.model_zoo.tiny_vision import FIRST_TEXT_ID, image_size, vision_sample

    if not is_vision_language(model):
        return None
    pretrained = pretrained_model(model)
    config = pretrained.config
    size = image_size(config.model_type, config)
    if size is None:
        return None
    prompt = vision_sample(config.model_type, config, [2, size, 3], seed=seed)
    prompt_length = prompt["input_ids"].shape[1]
    generator = torch.Generator().manual_seed(seed)
    completions = [torch.randint(FIRST_TEXT_ID, FIRST_TEXT_ID + 16, (1, n), generator=generator) for n in (2, 3)]
    per_token = [
        key for key, value in prompt.items() if key != "input_ids" and value.shape == prompt["input_ids"].shape
    ]
    vision = {key: value for key, value in prompt.items() if key != "input_ids" and key not in per_token}
    width = prompt_length + max(c.shape[1] for c in completions)
    sequences = []
    for completion in completions:
        sequence = {"input_ids": torch.cat([prompt["input_ids"], completion], dim=1)}
        sequence.update({key: torch.cat([prompt[key], torch.zeros_like(completion)], dim=1) for key in per_token})
        sequences.append(sequence)

    def padded(key: str) -> torch.Tensor:
        rows = [s[key][0] for s in sequences]
        return torch.stack([torch.cat([r, r.new_zeros(width - r.numel())]) for r in rows])

    lengths = torch.tensor([s["input_ids"].shape[1] for s in sequences])
    real = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    view = {key: padded(key) for key in ("input_ids", *per_token)}
    view["attention_mask"] = real.to(torch.int64)
    view["completion_mask"] = (real & (torch.arange(width) >= prompt_length)).to(torch.int64)
    view.update({key: torch.cat([value, value]) for key, value in vision.items()})  # TRL lists each image twice
    packed = pack_vision_pairs(view, positions=sequence_positions_of(pretrained))

    def on_device(batch: dict[str, Any]) -> dict[str, Any]:
        return _on_model(batch, model, device)

    inputs = {key: value for key, value in packed.items() if key not in ("packed_token_index",)}
    inputs["input_ids"] = inputs.pop("packed_input_ids")
    inputs["position_ids"] = inputs.pop("packed_position_ids")
    states = _last_states(model(**on_device(inputs), **options))[0].float()
    first, second = (_last_states(model(**on_device({**s, **vision}), **options))[0].float() for s in sequences)
    rejected = completions[1].shape[1]
    return states, torch.cat([first, second[-rejected:]])


def _quant_states(owner: Any) -> list[Any]:
    """The quantization state objects reachable from ``owner`` (a module or a parameter), nested ones included."""
    states, state = [], getattr(owner, "quant_state", None)
    while state is not None and hasattr(state, "__dict__") and not isinstance(state, torch.Tensor):
        states.append(state)
        state = getattr(state, "state2", None)
    return states


_ABSENT = object()


class _Snapshot:
    """Everything a forward could change on a model, recorded so that [`check_uncontaminated`] leaves it as found.

    Kept: each module's ``training`` flag; each parameter and buffer object and the storage its ``.data`` points at
    (a forward that reassigns ``weight.data``, as bitsandbytes' CPU weight conversion does, is undone); the attribute
    dictionaries of every quantization state (bitsandbytes reassigns ``absmax``, ``dtype``, ``nested``, ``state2``),
    references only, so nothing is copied; every module's hook dictionaries (``_forward_hooks``,
    ``_forward_pre_hooks``, ...), a multimodal model's ``rope_deltas`` (what its last forward leaves for generation)
    and transformers' ``_output_capturing_hooks_installed`` flag (the probe's
    ``output_hidden_states=True`` forward makes transformers install forward hooks for good, local functions that
    ``torch.save(model)`` cannot pickle).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.modes = [(module, module.training) for module in model.modules()]
        self.parameters = [
            (module, name, parameter, parameter.data)
            for module in model.modules()
            for name, parameter in module.named_parameters(recurse=False, remove_duplicate=False)
        ]
        self.buffers = [
            (module, name, buffer)
            for module in model.modules()
            for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False)
        ]
        owners = [module for module, _ in self.modes] + [parameter for _, _, parameter, _ in self.parameters]
        states = {id(state): state for owner in owners for state in _quant_states(owner)}
        self.states = [(state, dict(vars(state))) for state in states.values()]
        self.quantized = [
            module
            for module, _ in self.modes
            if _quant_states(getattr(module, "weight", None)) or _quant_states(module)
        ]
        self.hooks = [(hooks, dict(hooks)) for module, _ in self.modes for hooks in hook_dicts(module)]
        # multimodal models keep the RoPE offsets of their last forward for generation (``rope_deltas``)
        self.caches = [
            (module, vars(module)["rope_deltas"]) for module, _ in self.modes if "rope_deltas" in vars(module)
        ]
        self.flag = output_capturing_flag()
        self.flags = (
            [] if self.flag is None else [(module, vars(module).get(self.flag, _ABSENT)) for module, _ in self.modes]
        )

    def restore(self) -> None:
        for state, attributes in self.states:
            vars(state).clear()
            vars(state).update(attributes)
        for module, name, parameter, data in self.parameters:
            setattr(module, name, parameter)
            current = parameter.data
            if (current.data_ptr(), current.shape, current.dtype) != (data.data_ptr(), data.shape, data.dtype):
                parameter.data = data
        for module, name, buffer in self.buffers:
            setattr(module, name, buffer)
        for module, training in self.modes:
            module.training = training
        for module, cache in self.caches:
            vars(module)["rope_deltas"] = cache
        for hooks, found in self.hooks:
            if hooks != found:
                hooks.clear()
                hooks.update(found)
        for module, flag in self.flags:
            if flag is _ABSENT:
                vars(module).pop(self.flag, None)
            else:
                vars(module)[self.flag] = flag


_ProbeBatch = tuple[torch.Tensor, dict[str, object], torch.Tensor, torch.Tensor, tuple[int, int]]


def _probe_batch(lengths: tuple[int, ...], vocab_size: int, seed: int) -> _ProbeBatch:
    """One packed batch of two rows holding the same samples in opposite orders.

    The first sample of each row has nothing before it, so in any causal model its outputs there are what it gives
    alone; in the other row it comes last, after every other sample. Without contamination every sample's outputs
    are the same in both rows; with it, at least the two end samples differ.

    Returns ``input_ids`` ``(2, total)`` int64, the collator's metadata for it (``position_ids`` ``(2, total)``,
    ``packed_seq_lengths`` row-major, ``cu_seq_lens_*``, ``max_length_*``), and the tokens to compare (row-major
    indices over ``2 * total``, ``(total,)`` int64 each): every token of the first row, and the same token in the
    second row; and ``(0, len(first sample))``, the row and length of the unpacked run of the first sample, which
    gives the first compared tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]
    rows = torch.stack([torch.cat(samples), torch.cat(samples[::-1])])
    metadata = packed_metadata(list(lengths) + list(lengths[::-1]))
    metadata["position_ids"] = metadata["position_ids"].view(2, -1)
    total = rows.shape[1]
    second = torch.arange(total, 2 * total, dtype=torch.int64)
    alone_index = torch.cat(second.split(list(lengths[::-1]))[::-1])
    return rows, metadata, torch.arange(total, dtype=torch.int64), alone_index, (0, lengths[0])


def _branched_probe_batch(lengths: tuple[int, ...], vocab_size: int, seed: int) -> _ProbeBatch:
    """A packed batch of ``k + 2`` rows: a branched segment and each of its branches alone.

    With ``p`` of ``lengths[0]`` tokens (a prompt) and its ``k >= 2`` completions ``c1 .. ck`` of ``lengths[1:]``,
    ``a`` of ``|ck|`` tokens and ``b`` of one, and fillers ``x`` (plain samples of random tokens that make the rows
    equally long); for ``k = 2`` (DPO's chosen and rejected)::

        row 0   [a] [p c1 c2] [b]      a, the segment p -> c1, p -> c2 (packed_seq_parents [-1, -1, 1, 1, -1]), b
        row 1   [p c1] [x]             c1 continues p, alone at the start of its row
        row 2   [p c2] [x]             c2 continues p, alone at the start of its row
        row 3   [b] [x]                b alone

    The segment comes after another sample and before one, and each reference starts its row, where any causal
    model gives what it gives alone. Compared: ``p`` and ``c1`` of row 0 with row 1, each later ``ci`` with row
    ``i``, ``b`` with the last row. The metadata is what the packed view of a trainer with shared prompts hands the
    decoder: ``position_ids`` ``(k + 2, T)`` int64 (each branch continuing its prompt's), ``packed_seq_lengths``
    ``(num_seqs,)`` int32 row-major and ``packed_seq_parents`` ``(num_seqs,)`` int64.

    Returns ``input_ids`` ``(k + 2, T)`` int64, the metadata, and the tokens to compare (row-major indices over
    ``(k + 2) * T``, ``(|p| + sum |ci| + 1,)`` int64 each): the packed ones and their references; and
    ``(1, |p| + |c1|)``, the row and length of the unpacked run of ``[p; c1]``, which gives the first compared tokens.
    """
    p, *branch_lengths = lengths
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=generator)

    prompt = tokens(p)
    branches = [tokens(n) for n in branch_lengths]
    before, after = tokens(branch_lengths[-1]), tokens(1)
    segment_length = p + sum(branch_lengths)
    total = branch_lengths[-1] + segment_length + 1
    rows = [([before, prompt, *branches, after], [-1, -1, *[1] * len(branches), -1])]
    for start in [torch.cat([prompt, branch]) for branch in branches] + [after]:
        rows.append(([start, tokens(total - len(start))], [-1, -1]))
    input_ids = torch.stack([torch.cat(samples) for samples, _ in rows])
    seq_lengths = torch.tensor([len(x) for samples, _ in rows for x in samples], dtype=torch.int32)
    parents, offset = [], 0
    for samples, row_parents in rows:
        parents += [parent if parent < 0 else parent + offset for parent in row_parents]
        offset += len(samples)
    seq_parents = torch.tensor(parents, dtype=torch.int64)
    info = PackedSeqInfo.from_seq_lengths(seq_lengths, batch_size=len(rows), seq_len=total, seq_parents=seq_parents)
    metadata = {"position_ids": info.position_ids(), SEQ_LENGTHS_KEY: seq_lengths, SEQ_PARENTS_KEY: seq_parents}
    start = branch_lengths[-1]
    segment = torch.arange(start, start + segment_length + 1, dtype=torch.int64)
    references = [torch.arange(total, total + p + branch_lengths[0])]  # p, c1: row 1
    for row, length in enumerate(branch_lengths[1:], start=2):  # ci: row i
        references.append(torch.arange(row * total + p, row * total + p + length))
    references.append(torch.tensor([(len(rows) - 1) * total]))  # b: the last row
    return input_ids, metadata, segment, torch.cat(references).to(torch.int64), (1, p + branch_lengths[0])


def _output_options(model: torch.nn.Module) -> dict[str, object]:
    """Forward options for the probe: no cache, the final hidden states, and (where the model accepts
    ``logits_to_keep``) logits for one position only, since the (tokens, vocab) LM head dominates the probe's cost."""
    options: dict[str, object] = {"use_cache": False, "output_hidden_states": True}
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        accepts = "logits_to_keep" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts:
        options["logits_to_keep"] = 1
    return options


def _last_states(outputs: object) -> torch.Tensor:
    """``(batch, tokens, hidden)`` final hidden states, or the full logits for a model that returns none.

    Hidden states with leading dimensions before ``(batch, tokens, hidden)`` (Gemma3n's AltUp streams,
    ``(streams, batch, tokens, hidden)``) come back with every stream of a token side by side:
    ``(batch, tokens, streams * hidden)``."""
    hidden_states = getattr(outputs, "hidden_states", None)
    if not hidden_states:
        return outputs.logits
    state = hidden_states[-1]
    if state.dim() > 3:
        state = state.movedim(-3, 0).movedim(-2, 1).flatten(2)
    return state


def _logits_dtype(model: torch.nn.Module, device: torch.device | None = None) -> torch.dtype:
    """The dtype the model computes in: under autocast on ``device`` (the trainer runs the check in its training
    precision), the autocast dtype where it is lower than the weights'; else the output embedding's weight dtype (the
    input embedding's for a model without one, e.g. a sequence classifier), or its compute dtype when quantized."""
    weights = _weights_dtype(model)
    if device is not None and torch.is_autocast_enabled(device.type):
        autocast = torch.get_autocast_dtype(device.type)
        if autocast.itemsize < weights.itemsize:
            return autocast
    return weights


def _weights_dtype(model: torch.nn.Module) -> torch.dtype:
    config = getattr(model, "config", None)
    quantization = getattr(config, "quantization_config", None)
    compute = getattr(quantization, "bnb_4bit_compute_dtype", None) if quantization is not None else None
    if isinstance(compute, torch.dtype):
        return compute
    if isinstance(compute, str) and hasattr(torch, compute):
        return getattr(torch, compute)
    output = model.get_output_embeddings()
    weight = getattr(output if output is not None else model.get_input_embeddings(), "weight", None)
    return weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.float32
