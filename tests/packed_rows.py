"""Two packed rows of four short samples, and the fp32 comparison, shared by the per-family equivalence tests
(``tests/models/test_mixer_models.py``, ``tests/models/test_encoder_families.py``,
``tests/patches/test_mixer_kernels.py``). Importable from every test folder: pytest puts ``tests/`` (the folder of
the root ``conftest.py``) on ``sys.path``.
"""

from __future__ import annotations

import torch

REL = 1e-5
# Two rows of 8 tokens: [5, 3] and [1, 7].
ROWS = ((5, 3), (1, 7))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``max |actual - expected| <= REL * max |expected| + 1e-8`` (the floor: gradients that are zero in exact
    arithmetic come out as rounding noise)."""
    scale = expected.abs().max().clamp_min(1e-12)
    error = float((actual - expected).abs().max())
    assert error <= REL * float(scale) + 1e-8, f"{what}: max abs error {error:.3e} (max |expected| {float(scale):.3e})"


def random_samples(seed: int = 3) -> list[torch.Tensor]:
    """The four samples of :data:`ROWS`, row-major: ``(length,)`` int64 ids in ``[3, 128)``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (length,), generator=generator) for row in ROWS for length in row]


def two_rows(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The collator's batch for ``samples`` packed as :data:`ROWS`: ``input_ids`` / ``labels`` ``(2, 8)`` int64
    (each sample's first label ignored) and the packing metadata (``position_ids`` ``(2, 8)``)."""
    from unpack_trainer.data.collator import IGNORE_INDEX, packed_metadata

    ids = torch.stack([torch.cat(samples[:2]), torch.cat(samples[2:])])
    labels = ids.clone()
    for row, lengths in enumerate(ROWS):
        labels[row, 0] = labels[row, lengths[0]] = IGNORE_INDEX
    metadata = packed_metadata([length for row in ROWS for length in row])
    metadata["position_ids"] = metadata["position_ids"].view(2, 8)
    return {"input_ids": ids, "labels": labels, **metadata}


def assert_packed_equals_alone(model: torch.nn.Module, batch: dict[str, torch.Tensor], alone: list[torch.Tensor]):
    """The packed forward of :func:`two_rows`' ``batch`` gives each sample the logits ``alone[i]``
    ``(length_i, vocab)`` it gets run by itself (no gradients)."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    lengths = [length for row in ROWS for length in row]
    for index, (piece, expected) in enumerate(zip(torch.cat(list(logits)).split(lengths), alone)):
        assert_close(piece, expected, f"sample {index} logits")


def assert_same_loss_and_grads(loss, grads, expected_loss, expected_grads) -> None:
    """``loss`` and every gradient (``{name: tensor}``) equal the expected ones, over the same parameter names."""
    assert_close(loss, expected_loss, "loss")
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert_close(grads[name], grad, f"gradient of {name}")
