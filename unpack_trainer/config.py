"""``SFTConfig``: TRL's config with ``padding_free`` left unset by default, so the trainer can decide."""

from __future__ import annotations

from dataclasses import dataclass, field

import trl


@dataclass
class SFTConfig(trl.SFTConfig):
    r"""
    [`trl.SFTConfig`] for [`unpack_trainer.SFTTrainer`]. Every TRL field keeps its meaning; these differ or are added:

    Args:
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            Whether to flatten each batch into one row without padding (positions restart per example, no example
            attends to another). `None` lets the trainer decide: it turns padding-free on when the model, collator and
            data allow it and logs why (set `UNPACK_DISABLE_AUTO_PADDING_FREE=1` to keep padded batches). `False` is
            never overridden. With `packing=True`, rows are always padding-free. Unlike stock TRL, `max_length` is
            enforced (truncation exactly as padded training does), on every attention backend. The automatic choice
            stays off with `neftune_noise_alpha` (its noise scale depends on the row length), and evaluation stays
            padded when `compute_metrics` / `preprocess_logits_for_metrics` is set (unless `eval_packing=True` or
            `padding_free=True`), so that metrics see one row per example.
        packing_buffer_size (`int`, *optional*, defaults to `10000`):
            With `packing=True` and an `IterableDataset`, how many samples are buffered and packed together with
            best-fit decreasing; rows less than 99.5% full are held back (at most 2 rounds) to be topped up by later
            samples. Larger buffers pack tighter (99.97% at 10,000 samples of ~180 tokens into rows of 2,048) and use
            more memory. Ignored for a map-style `Dataset`, which is packed globally.
    """

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Flatten each batch into one row without padding. None (default) lets the trainer decide and log "
            "why; False is never overridden. With packing=True rows are always padding-free."
        },
    )
    packing_buffer_size: int = field(
        default=10_000,
        metadata={"help": "With packing=True and an IterableDataset: number of samples buffered and packed together."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.packing_buffer_size <= 0:
            raise ValueError(f"`packing_buffer_size` must be positive, got {self.packing_buffer_size}.")
