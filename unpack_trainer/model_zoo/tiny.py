"""Tiny models of any architecture and a character-level tokenizer, built locally (no hub downloads).

The one home for "a tiny model of architecture X", and for the two batches every equivalence check compares (the same
samples packed in one row, and padded): the coverage check (``tools/model_coverage.py``), the default data's tiny
Llama (:func:`unpack_trainer.data.default_data.tiny_model_config`), the tests (through the fixtures in
``tests/conftest.py``) and the scripts they launch all build their models here.

    >>> from unpack_trainer.model_zoo.tiny import char_tokenizer, tiny_config, tiny_model
    >>> tiny_config("qwen3").hidden_size
    32
    >>> model = tiny_model("llama", vocab_size=len(char_tokenizer()), attn_implementation="eager")

Nothing happens at import time: transformers, tokenizers and torch are imported by the functions that need them.
"""

from __future__ import annotations

import inspect
import string
from typing import Any

from unpack_trainer._logging import quiet_loggers

__all__ = [
    "TINY_SIZES",
    "char_tokenizer",
    "config_class",
    "loss_and_grads",
    "packed_batch",
    "padded_batch",
    "tiny_config",
    "tiny_model",
]

# Tiny sizes, applied to every config attribute of that name the config class has (see tiny_config).
TINY_SIZES: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=128,
    max_position_embeddings=64,
    initializer_range=0.1,  # larger than the usual 0.02, so attention patterns (and contamination) move the logits
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # mixture of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    output_router_logits=True,  # the router's auxiliary loss is part of the loss compared with the padded batch
    # multi-head latent attention
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    # partial rotary (GPT-J, CodeGen, MiniMax-M3): half of each head rotated; a default of 64 is more than the head
    rotary_dim=4,
    # windows smaller than the samples of the coverage check (5, 2 and 7 tokens)
    sliding_window=3,
    attention_chunk_size=3,
)

# Per model type: what the generic sizes do not fit. Values override TINY_SIZES (None removes a key).
_TYPE_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen2": dict(use_sliding_window=True, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, max_window_layers=1),
    # Their default configs are attention-only; the released models interleave short convolutions.
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # Its router logits are not collected by the model: stock transformers fails on output_router_logits=True.
    "flint": dict(output_router_logits=None),
    # Hybrids: one token-mixer layer and one attention layer (their defaults give two mixer layers at 2 layers);
    # state-space chunks and mixer heads smaller than the samples and the hidden size.
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp_text": dict(
        layer_types=["linear_attention", "indexed_attention"],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=4,
        indexer_compress_ratio=2,
    ),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=4,
    ),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=4),
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_chunk_size=4),
    "nemotron_h": dict(chunk_size=4),
    "mamba2": dict(num_heads=4, head_dim=16, chunk_size=4, n_groups=1),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "zamba": dict(
        num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], mamba_dt_rank=8, use_mamba_kernels=False
    ),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid"],
        hybrid_layer_ids=[1],
        mamba_headdim=16,
        n_mamba_heads=4,
        attention_head_dim=8,
        use_mamba_kernels=False,
        chunk_size=4,
    ),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=32),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], linear_num_heads=4, linear_head_dim=8),
    "bailing_hybrid": dict(
        layer_types=["linear_attention", "full_attention"], linear_num_heads=4, linear_head_dim=8, layer_group_size=2
    ),
    "zaya": dict(num_experts_per_tok=1),
    # Attention and feed-forward settings live in sub-configs: the modeling code reads the rotary base from the
    # attention sub-config (and clamps with clip_qkv, which fails when unset: 8 as in the released model); the
    # feed-forward sub-config copies d_model before the hidden_size alias is applied, so d_model is given by name.
    "dbrx": dict(
        hidden_size=None,
        d_model=32,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    # Full-attention layers take their own head size (global_head_dim, a per-layer override; Gemma 4 uses twice the
    # sliding layers' head_dim); per-layer input embeddings at the tiny vocabulary.
    "gemma4_text": dict(global_head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),
    "gemma4_unified_text": dict(global_head_dim=16),
    # Its last num_kv_shared_layers layers reuse the keys and values of the last earlier layer of their type: four
    # layers, the last two sharing (one sliding, one full), the first with sparse activations as in the released model.
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        laurel_rank=4,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
    ),
    # Rotary settings per layer type (None: no rotary embedding), with M-RoPE sections summing to head_dim / 2; one
    # sliding layer with rotary positions and one full-attention layer without, as Cohere's interleaved models.
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
            "full_attention": None,
        },
    ),
    # A causal LM only as a decoder; one local-chunk and one LSH layer, chunks smaller than the samples, axial position
    # embeddings factoring max_position_embeddings (64 = 8 x 8) and summing to the hidden size.
    "reformer": dict(
        is_decoder=True,
        attn_layers=["local", "lsh"],
        attention_head_size=8,
        feed_forward_size=64,
        axial_pos_shape=[8, 8],
        axial_pos_embds_dim=[16, 16],
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
        num_buckets=2,
        hash_seed=0,
        hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
    ),
    # Its language adapters need a language: the config's only default one.
    "xmod": dict(default_language="en_XX"),
    "xlstm": dict(v_head_dim=None, qk_head_dim=None, head_dim=None, num_heads=4, num_key_value_heads=None),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}</s>{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def config_class(model_type: str) -> type:
    """The transformers config class of ``model_type`` (``CONFIG_MAPPING[model_type]``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _has_attribute(config: Any, name: str) -> bool:
    """Whether ``config`` has ``name``; a per-layer attribute of a heterogeneous config (Gemma 4's ``head_dim``),
    which refuses a global read, counts as present."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError is no AttributeError
        return True


def _read_only(cls: type, name: str) -> bool:
    """Whether ``name`` is a property of the config class ``cls`` without a setter, derived from other sizes
    (Falcon's ``head_dim`` since transformers 5.25: ``hidden_size // num_attention_heads``)."""
    attribute = inspect.getattr_static(cls, name, None)
    return isinstance(attribute, property) and attribute.fset is None


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of ``model_type``.

    Every size in :data:`TINY_SIZES` the config class has (multi-head latent attention gets as many key/value heads
    as query heads; a default ``layer_types`` mixing sliding and full attention becomes one layer of each), then the
    type's own fixes, then ``overrides``. An override of ``None`` removes the key, so the config class's default
    applies (``initializer_range=None`` gives the class's usual 0.02).

    Args:
        model_type: a ``config.model_type`` of transformers (``"llama"``, ``"qwen3"``, ...).
        **overrides: config arguments replacing the tiny sizes (``vocab_size=len(tokenizer)``, ...).

    Returns:
        An instance of the model type's config class.
    """
    cls = config_class(model_type)
    with quiet_loggers():
        default = cls()
    present = set(default.to_dict()) | {name for name in TINY_SIZES if _has_attribute(default, name)}
    values = {name: value for name, value in TINY_SIZES.items() if name in present and not _read_only(cls, name)}
    if "kv_lora_rank" in values:  # multi-head latent attention: as many key/value heads as query heads
        values["num_key_value_heads"] = values.get("num_attention_heads", 4)
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and {"sliding_attention", "full_attention"} <= set(layer_types):
        values["layer_types"] = ["sliding_attention", "full_attention"]
    for name, value in {**_TYPE_OVERRIDES.get(model_type, {}), **overrides}.items():
        if value is None:
            values.pop(name, None)
        else:
            values[name] = value
    with quiet_loggers():
        return cls(**values)


def tiny_model(
    model_type: str, *, seed: int = 0, attn_implementation: str | None = None, config: Any = None, **overrides: Any
) -> Any:
    """A causal LM with random weights drawn after ``torch.manual_seed(seed)``, in fp32 on the CPU.

    Args:
        model_type: a ``config.model_type`` of transformers; the config is ``tiny_config(model_type, **overrides)``.
        seed: the seed set right before the weights are drawn (same seed, same config: same weights).
        attn_implementation: ``"sdpa"``, ``"eager"``, ...; ``None`` lets transformers choose (SDPA where supported).
        config: a config to build instead of ``tiny_config(model_type)`` (``overrides`` must then be empty).
        **overrides: config arguments, see :func:`tiny_config`.

    Returns:
        An ``AutoModelForCausalLM`` model in training mode (call ``.eval()`` for inference).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if config is None:
        config = tiny_config(model_type, **overrides)
    elif overrides:
        raise TypeError(f"tiny_model: pass either `config` or config overrides, not both (got {sorted(overrides)})")
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    torch.manual_seed(seed)
    with quiet_loggers():
        return AutoModelForCausalLM.from_config(config, **kwargs)


def char_tokenizer() -> Any:
    """A character-level tokenizer over printable ASCII with ``<pad>`` (0), ``<s>`` (1), ``</s>`` (2), ``<unk>`` and
    the role markers ``<|user|>``, ``<|assistant|>``, ``<|system|>``, and a chat template that marks the assistant's
    turns with ``{% generation %}`` (for ``assistant_only_loss``). 107 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {token: i for i, token in enumerate(specials + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def packed_batch(samples: list[Any]) -> dict[str, Any]:
    """The samples in one packed row, in the collator's contract: ``input_ids`` / ``labels`` ``(1, total_tokens)``
    int64 with ``-100`` at each sample's first label, no ``attention_mask``, and
    [`unpack_trainer.data.collator.packed_metadata`] (restarting ``position_ids`` ``(1, total_tokens)``,
    ``packed_seq_lengths``, ``cu_seq_lens_*``, ``max_length_*``).

    Args:
        samples: 1-D int64 tensors of token ids.
    """
    import torch

    from unpack_trainer.data.collator import IGNORE_INDEX, packed_metadata

    ids = torch.cat(samples).unsqueeze(0)
    labels = ids.clone()
    start = 0
    for sample in samples:
        labels[0, start] = IGNORE_INDEX
        start += len(sample)
    return {"input_ids": ids, "labels": labels, **packed_metadata([len(s) for s in samples])}


def padded_batch(samples: list[Any], *, pad_token_id: int = 0, left: bool = False) -> dict[str, Any]:
    """The samples as one padded batch: ``input_ids`` / ``attention_mask`` / ``labels`` ``(num_samples, longest)``
    int64, padding ``pad_token_id`` on the right (``left=True``: on the left), labels ``-100`` on padding and on each
    sample's first token, as in a packed row.

    Args:
        samples: 1-D int64 tensors of token ids.
    """
    import torch

    longest = max(len(s) for s in samples)
    ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        span = slice(longest - len(sample), longest) if left else slice(0, len(sample))
        ids[row, span] = sample
        mask[row, span] = 1
    labels = ids.masked_fill(mask == 0, -100)
    for row, sample in enumerate(samples):
        labels[row, longest - len(sample) if left else 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_grads(
    model: Any, batch: dict[str, Any], *, skip_unused: bool = False, **forward: Any
) -> tuple[Any, dict]:
    """The loss of one forward of ``batch`` (plus ``forward`` keyword arguments) and the gradient of every trainable
    parameter, cloned; the model's gradients are cleared before and after.

    Args:
        skip_unused: leave out parameters that got no gradient (a mixture of experts may route no token to an
            expert); by default every trainable parameter must have one.

    Returns:
        ``(loss, {parameter name: gradient})``, detached.
    """
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **forward).loss
    loss.backward()
    grads = {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and not (skip_unused and p.grad is None)
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def raise_token_logit(model: Any, token_id: int, amount: float, *, seed: int = 0) -> Any:
    """Raise ``model``'s logit of ``token_id`` by about ``amount`` on average (in place; returns ``model``): its output
    embedding row moves along the mean final hidden state of random text (4 rows of 16 token ids from ``seed``).
    With the end-of-sequence token, a random model's sampled completions end at different lengths (GRPO's tests and
    benchmarks)."""
    import torch

    with torch.no_grad():
        vocab = model.get_output_embeddings().weight.shape[0]
        text = torch.randint(vocab // 16, vocab, (4, 16), generator=torch.Generator().manual_seed(seed))
        hidden = model.base_model(input_ids=text).last_hidden_state.mean((0, 1))
        model.get_output_embeddings().weight[token_id] += amount * hidden / hidden.square().sum()
    return model
