"""Mistral: Llama plus ``config.sliding_window`` on every layer (``None`` for full attention).

The attention module passes ``sliding_window=config.sliding_window`` to the attention function, which applies it per
sample; the decoder builds its mask with ``create_sliding_window_causal_mask``, which the patch turns into no mask for
packed batches.
"""

from unpack_trainer.models import ArchitectureSpec

SPEC = ArchitectureSpec(
    model_type="mistral",
    modeling_module="transformers.models.mistral.modeling_mistral",
    decoder_class="MistralModel",
    attention_class="MistralAttention",
    sliding_window="config.sliding_window, every layer",
)
