"""Contamination probe: do packed samples give the same logits as the same samples run one by one, on *this* model?"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from unpack_trainer.collator import packed_metadata

# Relative tolerance on logits, by the dtype the model computes in: packed and one-by-one runs sum in different orders.
_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_PROBE_LENGTHS = (6, 1, 11, 4, 8)


@dataclass(frozen=True)
class ContaminationReport:
    """Result of [`check_uncontaminated`].

    Attributes:
        ok: packed logits matched the one-by-one logits within ``tolerance``.
        max_abs_diff: largest ``|packed - alone|`` over every logit of every probe sample.
        tolerance: the bound used: ``rtol(dtype) * max|alone logits| + 1e-5``.
        contaminated_diff: the same difference when the row is run as one plain causal sequence (what contamination
            would look like; NaN when not measured); if it is not above ``tolerance`` the probe cannot see
            contamination on this model.
        dtype: the logits' dtype.
        seconds: wall-clock cost of the probe.
        error: the exception text if the packed forward failed (then ``ok`` is False).
    """

    ok: bool
    max_abs_diff: float
    tolerance: float
    contaminated_diff: float
    dtype: torch.dtype | None
    seconds: float
    error: str | None = None

    @property
    def conclusive(self) -> bool:
        """False when contamination was measured and would not exceed the tolerance on this model (NaN: not measured)."""
        return not self.contaminated_diff <= self.tolerance

    def summary(self) -> str:
        if self.error is not None:
            return f"packed forward failed ({self.error}) [{self.seconds * 1000:.0f} ms]"
        contamination = (
            ""
            if self.contaminated_diff != self.contaminated_diff
            else f"; a contaminated row would differ by {self.contaminated_diff:.3g}"
        )
        return (
            f"max |packed - one-by-one| = {self.max_abs_diff:.3g} (tolerance {self.tolerance:.3g}, {self.dtype}"
            f"{contamination}) [{self.seconds * 1000:.0f} ms]"
        )


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
    seed: int = 0,
    rtol: float | None = None,
    measure_contamination: bool = True,
) -> ContaminationReport:
    """Run a few short random samples packed into one row and as a padded batch through ``model``; compare logits.

    The packed row carries exactly what the packed collator emits (``position_ids``, ``packed_seq_lengths``,
    ``cu_seq_lens_*``, ``max_length_*``, no attention mask), so this checks the attention path training will use,
    patched or not. The reference is the ordinary padded batch (right padding, ``attention_mask``), which equals each
    sample run alone for every real token. The model is put in eval mode (no dropout) and restored; no gradients are
    kept; on CPU the probe runs single-threaded (its tensors are tiny, threads only add synchronisation).

    Args:
        model: a causal LM (plain, ``PeftModel`` or quantized) whose forward returns ``logits``.
        lengths: probe sample lengths (a length-1 sample included by default).
        seed: seed of the random token ids.
        rtol: relative tolerance on logits; ``None`` picks it by dtype (fp32 1e-4, fp16 1e-2, bf16 4e-2).
        measure_contamination: also run the row as one plain causal sequence, to report how large contamination
            would be on this model (one more forward).

    Returns:
        A [`ContaminationReport`]; ``report.ok`` says whether packing is safe on this model.
    """
    start = time.perf_counter()
    was_training = model.training
    device = _device(model)
    threads = torch.get_num_threads()
    model.eval()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(seed)
        samples = [torch.randint(0, _vocab_size(model), (n,), generator=generator) for n in lengths]
        padded = torch.zeros(len(samples), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(padded)
        for i, sample in enumerate(samples):
            padded[i, : sample.numel()] = sample
            mask[i, : sample.numel()] = 1
        logits = model(input_ids=padded.to(device), attention_mask=mask.to(device), use_cache=False).logits
        reference = logits.float()[mask.to(device).bool()]
        row = torch.cat(samples).unsqueeze(0).to(device)
        metadata = {
            key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in packed_metadata(lengths).items()
        }
        try:
            packed = model(input_ids=row, use_cache=False, **metadata).logits[0].float()
        except Exception as error:  # noqa: BLE001 - any failure of the packed path means "not safe"
            return ContaminationReport(
                False, float("inf"), 0.0, 0.0, None, time.perf_counter() - start, f"{type(error).__name__}: {error}"
            )
        contaminated_diff = float("nan")
        if measure_contamination:
            contaminated = model(input_ids=row, use_cache=False).logits[0].float()
            contaminated_diff = float((contaminated - reference).abs().max())
        dtype = logits.dtype if rtol is not None else _logits_dtype(model)
        tolerance = (rtol if rtol is not None else _RTOL.get(dtype, 4e-2)) * float(reference.abs().max()) + 1e-5
        max_diff = float((packed - reference).abs().max())
        ok = bool(max_diff <= tolerance)
        return ContaminationReport(ok, max_diff, tolerance, contaminated_diff, dtype, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
        model.train(was_training)


def _logits_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in: the output embedding's weight dtype, or its compute dtype when quantized."""
    config = getattr(model, "config", None)
    quantization = getattr(config, "quantization_config", None)
    compute = getattr(quantization, "bnb_4bit_compute_dtype", None) if quantization is not None else None
    if isinstance(compute, torch.dtype):
        return compute
    if isinstance(compute, str) and hasattr(torch, compute):
        return getattr(torch, compute)
    output = model.get_output_embeddings()
    weight = getattr(output, "weight", None)
    return weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.float32
