"""Attention that the extension points do not reach: the ALiBi families (bloom, mpt) compute attention in their own
``forward``, not through ``ALL_ATTENTION_FUNCTIONS``, and add ALiBi position biases.

For these classes (:data:`PACKED_FORWARDS`, looked up along the class's MRO) the fix gives each attention module a
``forward`` of its own (an instance attribute, as a patched token mixer has) that, inside a packed forward of its
decoder, computes q, k, v exactly as the model does and hands them to
:func:`unpack_trainer.patches.attention.packed_attention_forward` with the model's own ALiBi slopes
(``alibi_slopes``: the bias counts distance within each sample, as for the sample alone; SDPA buckets, eager or
flash-attn's ``alibi_slopes``), then applies the model's own output projection. Their decoders hand the attention no
keyword arguments: the packed forward is the one running on the decoder's state, reached from the module's
:class:`~unpack_trainer.models.state.AttentionState`. Every other call (a padded batch, generation with a cache) runs
the class's ``forward``. The slopes are read from the ALiBi tensor the model passes its attention (no copy of the
formulas): adjacent keys differ by one slope, and one of the two entries read is an exact 0. Their decoders use the
mask as a tensor (mpt: ``.to(torch.bool)``), so the mask function gives them a placeholder their packed attention
ignores.

These models have only transformers' eager attention, so the packed path chooses its backend automatically
(``UNPACK_ATTENTION_BACKEND`` forces one). ``output_attentions=True`` on a packed batch is refused (the packed path
returns no weights and the model has no exact dense packed path to hand over to).

Their ``*ForCausalLM`` forwards hand the decoder only its named arguments, dropping the packing keywords:
:mod:`unpack_trainer.models.fixes.outer_carry` carries them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import attention_state
from unpack_trainer.patches.attention import packed_attention_forward

__all__ = ["FIX", "PACKED_FORWARDS", "packed_forward_for"]


def _alibi_context(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slopes: torch.Tensor,
    *,
    scaling: float,
    dropout: float,
    **kwargs: Any,
) -> torch.Tensor:
    """The one packed ALiBi attention both families share. ``query`` / ``key`` / ``value`` ``(B, H, T, D)``, ``slopes``
    ``(H,)`` (any float dtype; handed on as float32), ``dropout`` the module's training-time rate (0 in eval mode) ->
    the attention output ``(B, T, H * D)``, ready for the model's own output projection."""
    context, _ = packed_attention_forward(
        module,
        query,
        key,
        value,
        None,
        scaling=scaling,
        dropout=dropout if module.training else 0.0,
        alibi_slopes=slopes.float(),
        **kwargs,
    )
    return context.reshape(*context.shape[:2], -1)


def _bloom_attention(
    self: Any,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``BloomAttention.forward`` of a packed batch. ``hidden_states`` / ``residual`` ``(B, T, hidden)``, ``alibi``
    ``(B * num_heads, 1, T)`` (``slope * j``, no padding) -> ``((B, T, hidden), None)``."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch_size, q_length, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))  # 3 x (B, H, T, D)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    slopes = alibi.view(batch_size, self.num_heads, -1)[0, :, 1] - alibi.view(batch_size, self.num_heads, -1)[0, :, 0]
    context = _alibi_context(
        self, query, key, value, slopes, scaling=self.inv_norm_factor, dropout=self.attention_dropout.p, **kwargs
    )
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            output = output + F.linear(
                context[:, :, int(i * slices) : int((i + 1) * slices)],
                self.dense.weight[:, int(i * slices) : int((i + 1) * slices)],
            )
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def _mpt_attention(
    self: Any,
    hidden_states: torch.Tensor,
    position_bias: torch.Tensor,
    past_key_values: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``MptAttention.forward`` of a packed batch. ``hidden_states`` ``(B, T, hidden)``, ``position_bias``
    ``(num_heads, 1, max_seq_len)`` (``slope * (j - max_seq_len + 1)``) -> ``((B, T, hidden), None)``."""
    batch_size, seq_length = hidden_states.shape[:2]
    mixed_qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (
        x.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
        for x in mixed_qkv.chunk(3, dim=2)
    )
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    slopes = position_bias[:, 0, -1] - position_bias[:, 0, -2]  # 0 - (-slope)
    context = _alibi_context(
        self, query, key, value, slopes, scaling=self.softmax_scale, dropout=self.attn_dropout_p, **kwargs
    )
    return self.out_proj(context), None


# "module.QualifiedName" of an attention class -> its packed forward.
PACKED_FORWARDS: dict[str, Callable[..., Any]] = {
    "transformers.models.bloom.modeling_bloom.BloomAttention": _bloom_attention,
    "transformers.models.mpt.modeling_mpt.MptAttention": _mpt_attention,
}


def _owner(cls: type) -> type | None:
    """The class of ``cls``'s MRO that :data:`PACKED_FORWARDS` names, or ``None``."""
    return next((k for k in cls.__mro__ if f"{k.__module__}.{k.__qualname__}" in PACKED_FORWARDS), None)


def packed_forward_for(cls: type) -> Callable[..., Any] | None:
    """The packed forward of attention class ``cls`` (or of the class it inherits its forward from), or ``None``."""
    owner = _owner(cls)
    return None if owner is None else PACKED_FORWARDS[f"{owner.__module__}.{owner.__qualname__}"]


class _PackedForward:
    """Installed as an attention module's ``forward`` (an instance attribute): its class's packed forward inside a
    packed forward of its decoder, else the class's own ``forward``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.packed = packed_forward_for(type(module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = attention_state(self.module)
        info = None if state is None else state.decoder.attention_info()
        if info is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.packed(self.module, *args, packed_seq_info=info, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["module"])


def _own_forward_modules(site: FixSite) -> list[torch.nn.Module]:
    return [module for module in site.decoder.attention if packed_forward_for(type(module)) is not None]


def _applies(site: FixSite) -> str | None:
    modules = _own_forward_modules(site)
    if not modules or not site.state.attention:
        return None
    return f"its attention ({type(modules[0]).__name__}) computes attention and ALiBi in its own forward"


def _install(site: FixSite) -> None:
    for module in _own_forward_modules(site):
        module.__dict__["forward"] = _PackedForward(module)
    # Their decoders use the mask as a tensor (mpt: .to(torch.bool)); their packed attention ignores it.
    site.state.mask_placeholder = torch.zeros((1, 1, 1, 1), dtype=torch.bool)
    site.state.no_dense_path = "its attention applies ALiBi over the whole row"


def _remove(site: FixSite) -> None:
    for module in site.module.modules():
        if isinstance(module.__dict__.get("forward"), _PackedForward):
            del module.__dict__["forward"]
    site.state.mask_placeholder = None


FIX = Fix("alibi", _applies, _install, _remove)
