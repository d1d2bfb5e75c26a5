"""Llama: full causal attention on every layer, grouped-query attention, RoPE through ``apply_rotary_pos_emb``."""

from unpack_trainer.models import ArchitectureSpec

SPEC = ArchitectureSpec(
    model_type="llama",
    modeling_module="transformers.models.llama.modeling_llama",
    decoder_class="LlamaModel",
    attention_class="LlamaAttention",
    sliding_window=None,
)
