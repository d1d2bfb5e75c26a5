"""A model that contaminates on purpose, for the self-check's tests (``tests/test_trainer.py``,
``tests/models/test_selfcheck.py``), and attention backends that leak across samples (:func:`leak_every_backend`).
Importable from every test folder: pytest puts ``tests/`` (the folder of the root ``conftest.py``) on ``sys.path``.
"""

from __future__ import annotations

import torch

from unpack_trainer.packed_seq_info import PACKED_BATCH_KEYS, PackedSeqInfo


class DropsPackingMetadata(torch.nn.Module):
    """A model wrapper that forgets the packing metadata: each packed row then runs as one causal sequence, every
    sample seeing the ones before it (what contamination is)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, **kwargs):
        packing = set(PACKED_BATCH_KEYS) - {"input_ids", "labels"}
        return self.inner(input_ids=input_ids, **{k: v for k, v in kwargs.items() if k not in packing})


def leak_every_backend(monkeypatch) -> None:
    """Hand every packed attention backend one sample per row (``monkeypatch``: pytest's, undone after the test): each
    sample then attends to the ones before it in its row."""
    from unpack_trainer.patches import attention

    def leak(function):
        def whole_rows(query, key, value, info, options):
            rows = PackedSeqInfo.from_seq_lengths(
                torch.full((info.batch_size,), info.seq_len), batch_size=info.batch_size, seq_len=info.seq_len
            )
            return function(query, key, value, rows, options)

        return whole_rows

    for name, record in dict(attention.REGISTRY).items():
        monkeypatch.setitem(attention.REGISTRY, name, record._replace(forward=leak(record.forward)))
