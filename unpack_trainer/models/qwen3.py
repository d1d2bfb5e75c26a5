"""Qwen3: Qwen2's layout with RMSNorm on queries and keys (before RoPE) and an explicit ``head_dim``.

Sliding-window layers come from ``config.layer_types`` as in Qwen2. The q/k norms run inside the attention module
before the attention function, so packing needs nothing beyond the shared helper.
"""

from unpack_trainer.models import ArchitectureSpec

SPEC = ArchitectureSpec(
    model_type="qwen3",
    modeling_module="transformers.models.qwen3.modeling_qwen3",
    decoder_class="Qwen3Model",
    attention_class="Qwen3Attention",
    sliding_window='config.sliding_window on the "sliding_attention" entries of config.layer_types',
)
