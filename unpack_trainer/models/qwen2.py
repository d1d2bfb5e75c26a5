"""Qwen2: Llama with q/k/v biases and optional sliding-window layers.

With ``use_sliding_window=True`` the layers listed as ``"sliding_attention"`` in ``config.layer_types`` (those from
``max_window_layers`` on) pass ``sliding_window=config.sliding_window`` to the attention function; the others pass
``None``. Both are applied per sample.
"""

from unpack_trainer.models import ArchitectureSpec

SPEC = ArchitectureSpec(
    model_type="qwen2",
    modeling_module="transformers.models.qwen2.modeling_qwen2",
    decoder_class="Qwen2Model",
    attention_class="Qwen2Attention",
    sliding_window='config.sliding_window on the "sliding_attention" entries of config.layer_types',
)
