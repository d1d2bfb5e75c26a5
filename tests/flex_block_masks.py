"""What flex computes with the flex backend's block mask, for the block-mask exactness tests
(``tests/patches/test_flex.py``, ``tests/patches/test_bidirectional.py``,
``tests/patches/test_bidirectional_branched.py``). Importable from every test folder: pytest puts ``tests/`` (the folder
of the root ``conftest.py``) on ``sys.path``.
"""

from __future__ import annotations

import torch

from unpack_trainer.packed_seq_info import PackedSeqInfo
from unpack_trainer.patches.attention import flex as flex_backend


def effective_mask(info: PackedSeqInfo, window: int | None) -> torch.Tensor:
    """What flex computes with the backend's block mask of ``info``: full blocks wholly, partial blocks through the
    mask function, nothing else; ``(N_pad, N_pad)`` bool over the padded row."""
    padded = flex_backend.padded_length(info.total_tokens)
    mask = flex_backend.block_mask(info, padded, window, torch.device("cpu"))
    size = flex_backend.BLOCK_SIZE
    q = torch.arange(padded).view(-1, 1)
    k = torch.arange(padded).view(1, -1)
    by_function = mask.mask_mod(torch.tensor(0), torch.tensor(0), q, k)
    result = torch.zeros(padded, padded, dtype=torch.bool)
    for qb in range(padded // size):
        rows = slice(qb * size, (qb + 1) * size)
        for kb in mask.full_kv_indices[0, 0, qb, : mask.full_kv_num_blocks[0, 0, qb]].tolist():
            result[rows, kb * size : (kb + 1) * size] = True
        for kb in mask.kv_indices[0, 0, qb, : mask.kv_num_blocks[0, 0, qb]].tolist():
            cols = slice(kb * size, (kb + 1) * size)
            result[rows, cols] = by_function[rows, cols]
    return result
