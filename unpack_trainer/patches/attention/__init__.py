"""The one attention helper for packed rows: every sample attends only to itself, at the cost of the samples alone.

A packed batch holds several samples per row. Stock transformers (5.x) turns packed ``position_ids`` into a dense
``(T, T)`` block-causal mask for SDPA and eager, so attention costs ``O(T**2)`` time and memory whatever the samples.
This package computes the same result from the per-sample lengths, one module per backend, each declaring one
record (:class:`~unpack_trainer.patches.attention._common.AttentionBackend`: name, what it applies, why it cannot run
for a device and compute dtype, forward, branched forward) listed once in
:data:`~unpack_trainer.patches.attention.registry.REGISTRY`:

- ``flash``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16), split at sample boundaries where a row is so
  large that the kernel's 32-bit offsets would overflow;
- ``torch_varlen``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, no extra install);
- ``xformers``: ``memory_efficient_attention`` with a ``BlockDiagonalCausalMask`` (CUDA);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` per sample, without any ``(T, T)`` mask: samples of
  similar length are gathered into one padded ``(n, num_heads, L, head_dim)`` batch (padding at the end of each
  sample, where causal attention of real tokens never sees it; :mod:`unpack_trainer.patches.buckets`) and run in one
  causal call, so memory is linear in ``T`` and thousands of tiny samples cost a handful of calls;
- ``flex``: ``torch.nn.attention.flex_attention`` with one block mask per batch built from the samples' bounds
  (compiled on CUDA, forward only on the CPU); chosen automatically on CUDA for what the varlen kernels cannot
  apply (softcap, sinks, ALiBi, float32 compute), before SDPA;
- ``eager``: the same buckets with an explicit ``softmax(QK^T * scaling + mask) V``, the readable reference.

Worked example, one row of two samples of lengths 3 and 2::

    position_ids        [[0, 1, 2, 0, 1]]
    packed_seq_lengths  [3, 2]          int32
    cu_seqlens          [0, 3, 5]       int32
    max_seqlen          3

Sliding-window attention (a query at position ``i`` sees keys ``j`` with ``i - sliding_window < j <= i``, as in
transformers' masks), grouped-query attention (``num_kv_heads`` dividing ``num_heads``), any ``scaling`` and a value
head dim different from the query head dim (MLA) work on every backend. The model families' other quirks are applied
by the backends that can, and handed to one that can by the automatic choice (logged once):

=================  =====  ============  ========  ====  ====  =====
feature            flash  torch_varlen  xformers  flex  sdpa  eager
=================  =====  ============  ========  ====  ====  =====
logit ``softcap``  yes    no            no        yes   no    yes
sinks (``s_aux``)  no     no            no        yes   no    yes
dropout            yes    no            yes       no    yes   yes
ALiBi              yes    no            no        yes   yes   yes
=================  =====  ============  ========  ====  ====  =====

Under ``torch.autocast`` attention computes in the autocast dtype: float32 q / k / v are cast to it and the backend
is chosen for it (:func:`~unpack_trainer.patches.attention.registry.compute_dtype`).

``UNPACK_ATTENTION_BACKEND=flash|torch_varlen|xformers|flex|sdpa|eager`` forces a backend; asking for one that cannot run,
or that cannot apply what the model asks for, is an error naming the variable. So is a ``backend=`` argument that
cannot apply it (as transformers' own ``sdpa_attention_forward`` refuses ``softcap``).

The packing metadata is computed once per forward on the CPU
(:class:`~unpack_trainer.packed_seq_info.PackedSeqInfo`); each backend caches the index tensors it derives from it on
that object (``PackedSeqInfo.plan``, one namespace per backend), so no layer synchronises with the device.
"""

from unpack_trainer.patches.attention import registry
from unpack_trainer.patches.attention._common import logger
from unpack_trainer.patches.attention.dispatch import packed_attention_forward
from unpack_trainer.patches.attention.metadata import chunked_info, packed_info_from_kwargs
from unpack_trainer.patches.attention.registry import *  # noqa: F403  (its __all__: one list, not two in step)
from unpack_trainer.patches.attention.registry import (
    _BACKEND_FUNCTIONS,  # noqa: F401  (the forwards by name, for spies: tests, unpack_trainer.models.coverage)
)
from unpack_trainer.patches.attention.routing import make_attention_function

# The registry's (the table and the choice), then the forward, its metadata and its routing.
__all__ = [
    *registry.__all__,
    "chunked_info",
    "logger",
    "make_attention_function",
    "packed_attention_forward",
    "packed_info_from_kwargs",
]
