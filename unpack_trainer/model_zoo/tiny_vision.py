"""Tiny vision-language models of each supported family, their samples and processors, built locally (no downloads).

The one home for "a tiny VLM of family X" (as :mod:`unpack_trainer.model_zoo.tiny` is for text models): the tests, the
self-check's probe of a VLM, the coverage table's VLM section, ``examples/vlm_packing.py`` and
``benchmarks/bench_vlm.py`` build their models, samples and processors here.

- :func:`tiny_vision_config` / :func:`tiny_vision_model`: a ``*ForConditionalGeneration`` of the family with a vision
  tower of hidden size 32 and a text model of :data:`~unpack_trainer.model_zoo.tiny.TINY_SIZES`, as transformers' own
  model testers build them;
- :func:`vision_sample`: one sample's model inputs (a batch of one: ``input_ids``, the processor's token-type keys,
  ``pixel_values`` and the family's image keys), images of the given sizes, random pixels, built without a processor;
- :func:`tiny_processor`: the family's processor over a character tokenizer with the family's image tokens and a chat
  template, and the family's image processor (the PIL one: no torchvision needed), for the data path.

Token ids of the tiny vocabulary (128): ``0`` pad, ``1`` bos, ``2`` eos, then the image tokens of
:data:`IMAGE_TOKENS`, text from :data:`FIRST_TEXT_ID` on.

Nothing happens at import time.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

from unpack_trainer._logging import quiet_loggers
from unpack_trainer.model_zoo.tiny import TINY_SIZES, loss_and_grads

__all__ = [
    "FIRST_TEXT_ID",
    "STOCK_SPREAD",
    "IMAGE_TOKENS",
    "VISION_FAMILIES",
    "family_unavailable_reason",
    "gradient_mismatch",
    "grads_one_by_one",
    "image_size",
    "processed_batch",
    "tiny_processor",
    "tiny_vision_config",
    "tiny_vision_model",
    "vision_sample",
]

# The special tokens of every family's image markup, in id order after pad / bos / eos.
IMAGE_TOKENS: tuple[str, ...] = (
    "<|image_pad|>",  # 3  qwen image placeholder
    "<|video_pad|>",  # 4  qwen video placeholder
    "<|vision_start|>",  # 5
    "<|vision_end|>",  # 6
    "<image>",  # 7  llava / idefics3 / smolvlm placeholder
    "<start_of_image>",  # 8  gemma3 boi
    "<end_of_image>",  # 9  gemma3 eoi
    "<image_soft_token>",  # 10 gemma3 placeholder
    "<fake_token_around_image>",  # 11 idefics3 / smolvlm
    "<global-img>",  # 12
    "[IMG]",  # 13 mistral3 placeholder
    "[IMG_BREAK]",  # 14
    "[IMG_END]",  # 15
    "<end_of_utterance>",  # 16
)
_SPECIALS = ("<pad>", "<s>", "</s>", *IMAGE_TOKENS)
FIRST_TEXT_ID = len(_SPECIALS)
_ID = {token: index for index, token in enumerate(_SPECIALS)}

VOCAB = TINY_SIZES["vocab_size"]
PATCH = 14  # the vision towers' patch size (pixels)

# model_type -> the text config's model type of the family (its decoder is a text model of this type).
VISION_FAMILIES: dict[str, str] = {
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "idefics3": "llama",
    "smolvlm": "llama",
    "llava": "llama",
    "llava_next": "llama",
    "mistral3": "mistral",
}

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    initializer_range=0.1,  # as the tiny text models: attention patterns (and contamination) move the logits
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, patch_size=PATCH)
_QWEN_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=PATCH, temporal_patch_size=2
)
_QWEN_IDS = dict(
    image_token_id=_ID["<|image_pad|>"],
    video_token_id=_ID["<|video_pad|>"],
    vision_start_token_id=_ID["<|vision_start|>"],
    vision_end_token_id=_ID["<|vision_end|>"],
)


def _mrope(head_dim: int) -> dict[str, Any]:
    """Multimodal RoPE parameters for ``head_dim``: its ``head_dim / 2`` frequencies over t, h, w as 1/2, 1/4, 1/4
    (the tiny head dim of 8: ``[2, 1, 1]``)."""
    half = head_dim // 2
    return {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [half // 2, half // 4, half - half // 2 - half // 4],
    }


GEMMA3_IMAGE_SIZE = 56  # 4 x 4 patches, pooled to 4 tokens per image
GEMMA4_PATCH = 16  # Gemma 4's patches (pixels), pooled 3 x 3 into one token: images of multiples of 48 pixels
GEMMA4_POOLING = 3
GEMMA4_SOFT_TOKENS = 70  # the Gemma 4 image processor's smallest budget: an image resized to at most 70 tokens
IDEFICS3_IMAGE_SIZE = 56  # 4 x 4 patches, pixel shuffle by 2: 4 tokens per image
LLAVA_IMAGE_SIZE = 28  # 2 x 2 patches + CLS: 4 tokens per image
# LLaVA-NeXT's anyres tiles: an image is resized to the best of these (height, width) and cut into tiles of
# LLAVA_IMAGE_SIZE, after a base tile of the whole image (2 to 5 tiles of 4 tokens; a newline token ends each row)
LLAVA_NEXT_PINPOINTS = ((28, 28), (28, 56), (56, 28), (56, 56))


def family_unavailable_reason(model_type: str) -> str | None:
    """Why the installed transformers cannot build the tiny model of ``model_type`` (``None``: it can)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in VISION_FAMILIES:
        return f"{model_type!r} is not one of the tiny vision families ({', '.join(VISION_FAMILIES)})"
    if model_type not in CONFIG_MAPPING:
        return f"this transformers has no model type {model_type!r}"
    return None


def tiny_vision_config(model_type: str, **text_overrides: Any) -> Any:
    """A tiny config of the vision-language family ``model_type`` (a key of :data:`VISION_FAMILIES`).

    The text model has :data:`~unpack_trainer.model_zoo.tiny.TINY_SIZES`' sizes (vocabulary 128, 2 layers, 4 heads of 8,
    2 key/value heads), ``text_overrides`` on top (``sliding_window=4``, ...); the vision tower 2 layers of hidden size
    32, patches of 14 pixels. The image token ids are those of :data:`IMAGE_TOKENS`.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    reason = family_unavailable_reason(model_type)
    if reason is not None:
        raise ValueError(reason)
    text = {**_TEXT, **text_overrides}
    cls = CONFIG_MAPPING[model_type]
    if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        text["rope_parameters"] = _mrope(text["head_dim"])
        vision = dict(_QWEN_VISION, spatial_merge_size=2)
        width = text["hidden_size"]  # the merger's output: the text model's hidden size
        if model_type == "qwen2_vl":
            vision = dict(depth=2, embed_dim=32, hidden_size=width, num_heads=4, mlp_ratio=2, patch_size=PATCH,
                          temporal_patch_size=2, spatial_merge_size=2)  # fmt: skip
        elif model_type == "qwen2_5_vl":
            vision.update(out_hidden_size=width, window_size=56, fullatt_block_indexes=[1])
        else:
            vision.update(out_hidden_size=width, num_position_embeddings=64, deepstack_visual_indexes=[1])
        if model_type == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
        return cls(text_config=text, vision_config=vision, **_QWEN_IDS)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        # a gated-delta-net (linear attention) layer, then a full one; multimodal RoPE over the whole head dim
        text["rope_parameters"] = dict(_mrope(text["head_dim"]), mrope_interleaved=True, partial_rotary_factor=1.0)
        text.update(
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        if model_type == "qwen3_5_moe":
            del text["intermediate_size"]
            text.update(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
            )
        vision = dict(_QWEN_VISION, spatial_merge_size=2, out_hidden_size=text["hidden_size"])
        vision.update(num_position_embeddings=64)
        return cls(text_config=text, vision_config=vision, **_QWEN_IDS)
    if model_type == "gemma3":
        text.update(sliding_window=text_overrides.get("sliding_window", 512), query_pre_attn_scalar=8)
        text["layer_types"] = ["sliding_attention", "full_attention"]
        vision = dict(_VISION, image_size=GEMMA3_IMAGE_SIZE, vision_use_head=False)
        return cls(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            boi_token_index=_ID["<start_of_image>"],
            eoi_token_index=_ID["<end_of_image>"],
            image_token_index=_ID["<image_soft_token>"],
        )
    if model_type == "gemma4":
        text.update(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=text_overrides.get("sliding_window", 512),
            global_head_dim=text["head_dim"],
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=text["vocab_size"],
        )
        text.setdefault("use_bidirectional_attention", "vision")  # as Gemma 4's larger models (the small ones: None)
        vision = dict(_VISION, num_key_value_heads=4, head_dim=8, patch_size=GEMMA4_PATCH)
        vision.update(pooling_kernel_size=GEMMA4_POOLING, position_embedding_size=128)  # 128: the longest patch row
        return cls(
            text_config=text,
            vision_config=vision,
            audio_config=None,
            boi_token_id=_ID["<start_of_image>"],
            eoi_token_id=_ID["<end_of_image>"],
            image_token_id=_ID["<image_soft_token>"],
            video_token_id=_ID["<|video_pad|>"],
        )
    if model_type in ("idefics3", "smolvlm"):
        vision = dict(_VISION, image_size=IDEFICS3_IMAGE_SIZE)
        return cls(text_config=text, vision_config=vision, scale_factor=2, image_token_id=_ID["<image>"])
    if model_type == "llava":
        vision = dict(_VISION, model_type="clip_vision_model", image_size=LLAVA_IMAGE_SIZE, projection_dim=32)
        return cls(
            text_config=text,
            vision_config=vision,
            image_token_index=_ID["<image>"],
            image_seq_length=(LLAVA_IMAGE_SIZE // PATCH) ** 2,
        )  # vision_feature_layer -2 (the default, as the hub's tiny LLaVA): the tower's last layer gets no gradient
    if model_type == "llava_next":
        vision = dict(_VISION, model_type="clip_vision_model", image_size=LLAVA_IMAGE_SIZE, projection_dim=32)
        return cls(
            text_config=dict(text, model_type="llama"),
            vision_config=vision,
            image_token_index=_ID["<image>"],
            image_grid_pinpoints=[list(point) for point in LLAVA_NEXT_PINPOINTS],
            image_seq_length=(LLAVA_IMAGE_SIZE // PATCH) ** 2,
        )  # vision_feature_layer -2 (the default, as LLaVA-NeXT's): the tower's last layer gets no gradient
    if model_type == "mistral3":
        text.update(sliding_window=None)
        vision = dict(_VISION, model_type="pixtral", image_size=112, head_dim=8)
        return cls(text_config=text, vision_config=vision, image_token_index=_ID["[IMG]"], spatial_merge_size=2)
    raise AssertionError(model_type)  # pragma: no cover - family_unavailable_reason covers the rest


def tiny_vision_model(
    model_type: str, *, seed: int = 0, attn_implementation: str | None = None, **text_overrides: Any
) -> Any:
    """The ``*ForConditionalGeneration`` model of :func:`tiny_vision_config`, random weights drawn after
    ``torch.manual_seed(seed)``, fp32 on the CPU, in training mode (call ``.eval()`` for inference)."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = tiny_vision_config(model_type, **text_overrides)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    torch.manual_seed(seed)
    with quiet_loggers():
        return AutoModelForImageTextToText.from_config(config, **kwargs)


def image_size(model_type: str, config: Any) -> tuple[int, int] | None:
    """The size in pixels of the smallest image the family's model takes, ``(height, width)``: one merged token of
    a Qwen2-VL-family model, 2 x 2 of a Mistral 3 model, two pooled tokens of a Gemma 4 model (whose image tokens may
    attend to each other), one tile of a LLaVA-NeXT model (its base tile and one more); the fixed size of the others
    (``vision_config.image_size``). ``None`` for a model type that is not one of :data:`VISION_FAMILIES`."""
    vision = config.vision_config
    if model_type.startswith("qwen"):
        side = vision.patch_size * vision.spatial_merge_size
        return side, side
    if model_type == "mistral3":  # one merged token fails in the model (Pixtral's patch merger): 2 x 2 of them
        side = 2 * vision.patch_size * config.spatial_merge_size
        return side, side
    if model_type == "gemma4":  # two pooled tokens: one token would hide whether an image's tokens see each other
        side = vision.patch_size * vision.pooling_kernel_size
        return side, 2 * side
    if model_type in VISION_FAMILIES:
        return vision.image_size, vision.image_size
    return None


def vision_sample(
    model_type: str,
    config: Any,
    segments: Sequence[int | tuple[int, int]],
    *,
    seed: int = 0,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """One sample's model inputs, as the family's processor would give them for a batch of one, random pixels.

    Every size is read from ``config``, so the samples fit the tiny models and real ones alike (the self-check
    probes a user's model with them).

    Args:
        model_type: the family (a key of :data:`VISION_FAMILIES`).
        config: the model's config (its image token ids, patch, merge and pooling sizes).
        segments: in order, an ``int`` for that many random text tokens, a ``(height, width)`` in pixels for an image
            (Qwen2-VL family and Mistral 3: multiples of :func:`image_size`; the other families take images of one
            size, so theirs is ignored).
        seed: the seed of the text tokens and the pixels.
        vocab_size: the text tokens are drawn from ``[FIRST_TEXT_ID, vocab_size)`` (default: the text config's
            vocabulary), never an image token of the config. A marker id of the config outside the vocabulary
            (``vision_start_token_id``, ``vision_end_token_id``, ``boi_token_id``, ``eoi_token_id``: a config that
            keeps transformers' default, 151653, on a smaller vocabulary) is left out: the model cannot embed it, so
            its processor never emits it and the training data cannot hold it.

    Returns:
        ``input_ids`` ``(1, L)`` int64; ``mm_token_type_ids`` ``(1, L)`` int64 (qwen: 0 text, 1 image) or
        ``token_type_ids`` ``(1, L)`` int64 (gemma3: 1 image); and the image tensors: qwen ``pixel_values``
        ``(sum t*h*w, 3 * temporal_patch * patch**2)`` float32 and ``image_grid_thw`` ``(num_images, 3)`` int64;
        gemma3 / llava ``pixel_values`` ``(num_images, 3, S, S)``; idefics3 / smolvlm ``(1, num_images, 3, S, S)``
        with ``pixel_attention_mask`` ``(1, num_images, S, S)`` bool; mistral3 ``(num_images, 3, H, W)`` with
        ``image_sizes`` ``(num_images, 2)``. No image keys for a sample without images.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    patch = vision.patch_size
    vocab = vocab_size or config.get_text_config().vocab_size
    reserved = {
        getattr(config, name, None)
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                     "boi_token_id", "eoi_token_id")
    }  # fmt: skip
    image_token = getattr(config, "image_token_id", None)
    if image_token is not None and not 0 <= image_token < vocab:
        raise ValueError(
            f"the config's image_token_id {image_token} is outside its text vocabulary of {vocab} ids: the model "
            "cannot embed an image placeholder"
        )
    ids: list[int] = []
    types: list[int] = []
    images: list[torch.Tensor] = []
    grids: list[list[int]] = []
    sizes: list[list[int]] = []

    def add(tokens: list[int], kind: int = 0) -> None:
        tokens = [token for token in tokens if 0 <= token < vocab]  # a marker the vocabulary cannot hold: left out
        ids.extend(tokens)
        types.extend([kind] * len(tokens))

    def text(length: int) -> list[int]:
        drawn = torch.randint(FIRST_TEXT_ID, vocab, (length,), generator=generator).tolist()
        return [FIRST_TEXT_ID if token in reserved else token for token in drawn]

    for segment in segments:
        if isinstance(segment, int):
            add(text(segment))
            continue
        height, width = segment
        if model_type.startswith("qwen"):
            merge = vision.spatial_merge_size
            grid = [1, height // patch, width // patch]
            grids.append(grid)
            channels = vision.in_channels * vision.temporal_patch_size * patch * patch
            images.append(torch.randn(grid[0] * grid[1] * grid[2], channels, generator=generator))
            add([config.vision_start_token_id])
            add([config.image_token_id] * (grid[0] * grid[1] * grid[2] // merge**2), kind=1)
            add([config.vision_end_token_id])
        elif model_type == "gemma3":
            images.append(torch.randn(3, vision.image_size, vision.image_size, generator=generator))
            add([config.boi_token_id])
            add([config.image_token_id] * config.mm_tokens_per_image, kind=1)
            add([config.eoi_token_id])
        elif model_type in ("idefics3", "smolvlm"):
            images.append(torch.randn(3, vision.image_size, vision.image_size, generator=generator))
            tokens = (vision.image_size // patch) ** 2 // config.scale_factor**2
            add(text(2))
            add([config.image_token_id] * tokens, kind=1)
            add(text(1))
        elif model_type == "llava":
            images.append(torch.randn(3, vision.image_size, vision.image_size, generator=generator))
            add([config.image_token_id] * config.image_seq_length, kind=1)
        elif model_type == "gemma4":
            pool = vision.pooling_kernel_size
            rows, columns = height // patch, width // patch
            images.append(torch.rand(rows * columns, 3 * patch * patch, generator=generator))
            grids.append([rows, columns])
            add([config.boi_token_id])
            add([config.image_token_id] * (rows // pool) * (columns // pool), kind=1)
            add([config.eoi_token_id])
        elif model_type == "llava_next":
            tiles, tokens = _llava_next_image(config, height, width)
            images.append(torch.randn(tiles, 3, vision.image_size, vision.image_size, generator=generator))
            sizes.append([height, width])
            add([config.image_token_id] * tokens, kind=1)
        elif model_type == "mistral3":
            merge = config.spatial_merge_size
            rows, columns = height // (patch * merge), width // (patch * merge)
            images.append(torch.randn(3, height, width, generator=generator))
            sizes.append([height, width])
            for _ in range(rows):
                add([config.image_token_id] * columns, kind=1)
                add(text(1))  # [IMG_BREAK] / [IMG_END] in a processor's output: text tokens to the model
        else:
            raise ValueError(family_unavailable_reason(model_type) or model_type)
    sample: dict[str, Any] = {"input_ids": torch.tensor([ids], dtype=torch.int64)}
    if model_type.startswith("qwen") or model_type == "gemma4":
        sample["mm_token_type_ids"] = torch.tensor([types], dtype=torch.int64)
    elif model_type == "gemma3":
        sample["token_type_ids"] = torch.tensor([types], dtype=torch.int64)
    if not images:
        return sample
    if model_type.startswith("qwen"):
        sample["pixel_values"] = torch.cat(images)
        sample["image_grid_thw"] = torch.tensor(grids, dtype=torch.int64)
    elif model_type in ("idefics3", "smolvlm"):
        sample["pixel_values"] = torch.stack(images).unsqueeze(0)
        sample["pixel_attention_mask"] = torch.ones(1, len(images), *images[0].shape[1:], dtype=torch.bool)
    elif model_type == "mistral3":
        sample["pixel_values"] = _padded_stack(images)
        sample["image_sizes"] = torch.tensor(sizes, dtype=torch.int64)
    elif model_type == "gemma4":
        sample["pixel_values"], sample["image_position_ids"] = _patch_rows(images, grids)
    elif model_type == "llava_next":
        sample["pixel_values"] = _padded_tiles(images)
        sample["image_sizes"] = torch.tensor(sizes, dtype=torch.int64)
    else:
        sample["pixel_values"] = torch.stack(images)
    return sample


def _llava_next_image(config: Any, height: int, width: int) -> tuple[int, int]:
    """``(tiles, tokens)`` of an image of ``height`` x ``width`` pixels for a LLaVA-NeXT model, from the model's own
    code: the base tile and the tiles of the best grid pinpoint (``image_size_to_num_patches``); each tile's
    ``(S / patch)**2`` features (CLS dropped), the tiles' feature grid cut back to the image's aspect ratio
    (``unpad_image``) with a newline token after each row, after the base tile's."""
    import torch
    from transformers.models.llava_next.modeling_llava_next import (
        get_anyres_image_grid_shape,
        image_size_to_num_patches,
        unpad_image,
    )

    side = config.vision_config.image_size
    per_tile = side // config.vision_config.patch_size
    pinpoints = [list(point) for point in config.image_grid_pinpoints]
    tiles = image_size_to_num_patches([height, width], pinpoints, side)
    rows, columns = get_anyres_image_grid_shape([height, width], pinpoints, side)
    grid = unpad_image(torch.empty(1, rows * per_tile, columns * per_tile), [height, width])
    return tiles, per_tile**2 + grid.shape[1] * (grid.shape[2] + 1)


def _patch_rows(images: list[Any], grids: list[list[int]]) -> tuple[Any, Any]:
    """Gemma 4's batch of images: ``pixel_values`` ``(n, patches_max, 3 * patch**2)`` (each image's patches in
    row-major order, zero-padded to the most patches) and ``image_position_ids`` ``(n, patches_max, 2)`` int64, each
    patch's ``(x, y)`` in its image's grid, ``(-1, -1)`` on padding."""
    import torch

    count = max(image.shape[0] for image in images)
    pixels = torch.zeros(len(images), count, images[0].shape[1], dtype=images[0].dtype)
    positions = torch.full((len(images), count, 2), -1, dtype=torch.int64)
    for index, (image, (rows, columns)) in enumerate(zip(images, grids)):
        pixels[index, : image.shape[0]] = image
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
        positions[index, : image.shape[0]] = torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)
    return pixels, positions


def _padded_tiles(images: list[Any]) -> Any:
    """``(n, tiles_max, C, S, S)``: each image's tiles, zero-padded to the most tiles (LLaVA-NeXT's batch; the model
    reads each image's own count from its size)."""
    import torch

    count = max(image.shape[0] for image in images)
    out = torch.zeros(len(images), count, *images[0].shape[1:], dtype=images[0].dtype)
    for index, image in enumerate(images):
        out[index, : image.shape[0]] = image
    return out


def _padded_stack(images: list[Any]) -> Any:
    """``(n, C, H_max, W_max)``: the images zero-padded at the bottom and right to the largest (Pixtral's batch)."""
    import torch

    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    out = torch.zeros(len(images), images[0].shape[0], height, width, dtype=images[0].dtype)
    for index, image in enumerate(images):
        out[index, :, : image.shape[-2], : image.shape[-1]] = image
    return out


def processed_batch(samples: Sequence[dict[str, Any]], *, pad_token_id: int = 0) -> dict[str, Any]:
    """Samples of :func:`vision_sample` as one right-padded batch, as the family's processor batches them: per-token
    keys ``(n, L)`` padded with ``pad_token_id`` (types with 0) and an ``attention_mask``; ``labels`` the tokens with
    ``-100`` on padding and on each sample's first token (as a packed row has them); ``pixel_values`` and the image
    keys of all samples in order (a 5-D ``pixel_values``, idefics3's ``(n, images, 3, S, S)``, padded with all-zero
    images, which the model drops; a 4-D one of images of different sizes zero-padded to the largest)."""
    import torch

    longest = max(sample["input_ids"].shape[1] for sample in samples)
    out: dict[str, Any] = {}
    token_keys = [key for key in samples[0] if key in ("input_ids", "mm_token_type_ids", "token_type_ids")]
    for key in token_keys:
        rows = torch.full((len(samples), longest), pad_token_id if key == "input_ids" else 0, dtype=torch.int64)
        for row, sample in enumerate(samples):
            rows[row, : sample[key].shape[1]] = sample[key][0]
        out[key] = rows
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, sample in enumerate(samples):
        mask[row, : sample["input_ids"].shape[1]] = 1
    out["attention_mask"] = mask
    labels = out["input_ids"].masked_fill(mask == 0, -100)
    labels[:, 0] = -100
    out["labels"] = labels
    with_images = [sample for sample in samples if "pixel_values" in sample]
    if not with_images:
        return out
    first = with_images[0]["pixel_values"]
    if "image_position_ids" in with_images[0]:  # gemma4: (images, patches, 3 * patch**2), padded to the most patches
        pixels = [image for sample in with_images for image in sample["pixel_values"]]
        positions = [ids for sample in with_images for ids in sample["image_position_ids"]]
        count = max(image.shape[0] for image in pixels)
        out["pixel_values"] = torch.zeros(len(pixels), count, first.shape[-1], dtype=first.dtype)
        out["image_position_ids"] = torch.full((len(pixels), count, 2), -1, dtype=torch.int64)
        for index, (image, ids) in enumerate(zip(pixels, positions)):
            out["pixel_values"][index, : image.shape[0]] = image
            out["image_position_ids"][index, : ids.shape[0]] = ids
        return out
    if first.dim() == 5 and "image_sizes" in with_images[0]:  # llava_next: (images, tiles, 3, S, S)
        out["pixel_values"] = _padded_tiles([image for sample in with_images for image in sample["pixel_values"]])
        out["image_sizes"] = torch.cat([sample["image_sizes"] for sample in with_images])
        return out
    if first.dim() == 5:
        count = max(sample["pixel_values"].shape[1] if "pixel_values" in sample else 0 for sample in samples)
        pixels = torch.zeros(len(samples), count, *first.shape[2:], dtype=first.dtype)
        pixel_mask = torch.zeros(len(samples), count, *first.shape[3:], dtype=torch.bool)
        for row, sample in enumerate(samples):
            if "pixel_values" in sample:
                pixels[row, : sample["pixel_values"].shape[1]] = sample["pixel_values"][0]
                pixel_mask[row, : sample["pixel_values"].shape[1]] = sample["pixel_attention_mask"][0]
        out["pixel_values"], out["pixel_attention_mask"] = pixels, pixel_mask
        return out
    if first.dim() == 4:
        out["pixel_values"] = _padded_stack([image for sample in with_images for image in sample["pixel_values"]])
    else:
        out["pixel_values"] = torch.cat([sample["pixel_values"] for sample in with_images])
    for key in ("image_grid_thw", "image_sizes"):
        if key in with_images[0]:
            out[key] = torch.cat([sample[key] for sample in with_images])
    return out


# How far a packed gradient may be from the padded batch's where it is past 1e-5 of its largest entry (a gradient that
# cancels to a small value, one through a ReLU at its kink): a multiple of the stock path's own spread, how far its
# other summations of the gradient land (each sample alone, the padded rows reversed; see gradient_mismatch). In
# float64 the tiny Qwen3.5 MoE's packed A_log and dt_bias gradients equal the padded ones (its experts on "eager"),
# and a tiny CTRL's are within 4e-7 of each tensor's largest entry (transformers' loss casts the logits to float32).
STOCK_SPREAD = 2.0


def grads_one_by_one(
    model: Any, samples: Sequence[dict[str, Any]], *, skip_unused: bool = False, **forward: Any
) -> dict[str, Any]:
    """The gradient of :func:`processed_batch`'s loss (the token mean over all samples) of every trainable parameter,
    computed from each sample run alone, unpacked (its share ``n_i / N`` of the loss: its predicted tokens over all of
    them): one of the stock path's own other summations of the same gradient (:func:`gradient_mismatch`). The model's
    gradients are cleared before and after; ``skip_unused`` and ``forward`` (keyword arguments of every forward) as
    :func:`~unpack_trainer.model_zoo.tiny.loss_and_grads`."""
    counts = [sample["input_ids"].shape[1] - 1 for sample in samples]  # each token predicts the next
    total = sum(counts)
    model.zero_grad(set_to_none=True)
    for sample, count in zip(samples, counts):
        if not count:
            continue
        labels = sample["input_ids"].clone()
        labels[:, 0] = -100
        (model(**sample, labels=labels, **forward).loss * (count / total)).backward()
    grads = {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and not (skip_unused and p.grad is None)
    }
    model.zero_grad(set_to_none=True)
    return grads


def gradient_mismatch(
    model: Any,
    samples: Sequence[dict[str, Any]],
    packed_grads: dict[str, Any],
    padded_grads: dict[str, Any],
    close: Callable[[Any, Any, str], str | None],
    **forward: Any,
) -> str | None:
    """The first packed gradient that differs from the padded batch's (:func:`processed_batch` of ``samples``) beyond
    ``close`` (``(actual, expected, what) -> problem or None``, a bound relative to the tensor's largest entry) and
    also beyond :data:`STOCK_SPREAD` times the stock path's own spread of it; ``None`` when every gradient agrees.
    ``packed_grads`` / ``padded_grads``: by parameter name; ``forward``: keyword arguments of every stock forward.

    The stock spread of a gradient is how far stock transformers' own other summations of it land from the padded
    batch's: each sample run alone (:func:`grads_one_by_one`) and the padded batch with its rows in reverse order
    (computed only once a gradient is beyond ``close``). In fp32 two kinds of gradient move beyond a bound relative to
    their largest entry on the stock path itself: one that cancels to a small value (a gated-delta-net layer's
    ``A_log`` and ``dt_bias``: rounded as the larger terms summed into it are, so that reversing the padded rows alone
    moves it as far), and one through a ReLU whose input lies within rounding of zero for some token (the last bit
    switches that unit's gradient on or off: the 8192 units of a tiny CTRL's feed-forward). A leak between samples
    moves a gradient far beyond either, and the logits are compared on their own."""
    stock_sums: list[dict[str, Any]] | None = None
    for name, grad in padded_grads.items():
        problem = close(packed_grads[name], grad, f"gradient of {name}")
        if problem is None:
            continue
        if stock_sums is None:
            reversed_rows = processed_batch(list(reversed(samples)))
            stock_sums = [
                grads_one_by_one(model, samples, skip_unused=True, **forward),
                loss_and_grads(model, reversed_rows, skip_unused=True, **forward)[1],
            ]
        # a parameter no token reached in a summation (an expert no sample routes to alone) got zero gradient there
        spread = max(float((other[name] - grad if name in other else grad).abs().max()) for other in stock_sums)
        if float((packed_grads[name] - grad).abs().max()) > STOCK_SPREAD * spread:
            return (
                f"{problem}, beyond {STOCK_SPREAD} x the stock path's own spread (each sample alone, the padded rows "
                f"reversed): {STOCK_SPREAD * spread:.3e}"
            )
    return None


# --------------------------------------------------------------------------------------------------------------------
# Processors
# --------------------------------------------------------------------------------------------------------------------

# Role-tagged turns; an image part of a message is the family's image markup placeholder.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE_MARKUP{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_IMAGE_MARKUP = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
    "gemma4": "<image_soft_token>",
    "idefics3": "<image>",
    "smolvlm": "<image>",
    "llava": "<image>",
    "llava_next": "<image>",
    "mistral3": "[IMG]",
}


def vision_tokenizer() -> Any:
    """A character-level tokenizer over printable ASCII with ``<pad>`` / ``<s>`` / ``</s>`` and every token of
    :data:`IMAGE_TOKENS` as special tokens (ids as in the module docstring), 100 characters after them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {token: index for index, token in enumerate(_SPECIALS)}
    for character in characters[: VOCAB - len(vocab)]:
        vocab.setdefault(character, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    with quiet_loggers():
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            pad_token="<pad>",
            bos_token="<s>",
            eos_token="</s>",
            additional_special_tokens=list(IMAGE_TOKENS),
        )
    return tokenizer


def tiny_processor(model_type: str) -> Any:
    """The processor of the family ``model_type`` for its tiny model (:func:`tiny_vision_model`), built locally.

    A character tokenizer with the image tokens (:func:`vision_tokenizer`), a chat template that marks each image
    with the family's markup, and the family's PIL image processor sized for the tiny vision tower: Qwen2-VL family
    images resized to 56-112 pixels a side (4 to 16 tokens, merge 2); Gemma 3, Idefics3 / SmolVLM and LLaVA images
    resized to their tower's fixed size (4 tokens each). The Qwen2-VL-family processors are subclasses without a
    video processor (it needs torchvision); SmolVLM uses the Idefics3 processor (its own needs torchvision too).

    Raises:
        ValueError: a family without a processor here (mistral3: Pixtral's processor needs a Mistral tokenizer).
    """
    reason = family_unavailable_reason(model_type)
    if reason is not None:
        raise ValueError(reason)
    tokenizer = vision_tokenizer()
    template = _CHAT_TEMPLATE.replace("IMAGE_MARKUP", _IMAGE_MARKUP[model_type])
    tokenizer.chat_template = template
    with quiet_loggers():
        if model_type.startswith("qwen"):
            return _qwen_processor(model_type, tokenizer, template)
        if model_type == "gemma3":
            from transformers import Gemma3Processor
            from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

            for name, token in (("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
                                ("image_token", "<image_soft_token>")):  # fmt: skip
                setattr(tokenizer, name, token)
                setattr(tokenizer, name + "_id", _ID[token])
            size = {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}
            return Gemma3Processor(
                Gemma3ImageProcessorPil(size=size), tokenizer, chat_template=template, image_seq_length=4
            )
        if model_type == "gemma4":
            from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

            images = Gemma4ImageProcessorPil(
                max_soft_tokens=GEMMA4_SOFT_TOKENS, patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOLING
            )
            return _gemma4_processor_class()(images, tokenizer, chat_template=template)
        if model_type in ("idefics3", "smolvlm"):
            from transformers import Idefics3Processor
            from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

            edge = {"longest_edge": IDEFICS3_IMAGE_SIZE}
            images = Idefics3ImageProcessorPil(size=edge, max_image_size=edge, do_image_splitting=False)
            return Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=template)
        if model_type == "llava":
            from transformers import LlavaProcessor
            from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

            side = {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
            images = LlavaImageProcessorPil(size=side, crop_size=side)
            return LlavaProcessor(
                images, tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
                num_additional_image_tokens=1, chat_template=template,
            )  # fmt: skip
        if model_type == "llava_next":
            from transformers import LlavaNextProcessor
            from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

            side = {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
            pinpoints = [list(point) for point in LLAVA_NEXT_PINPOINTS]
            images = LlavaNextImageProcessorPil(size=side, crop_size=side, image_grid_pinpoints=pinpoints)
            return LlavaNextProcessor(
                images, tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
                num_additional_image_tokens=1, chat_template=template,
            )  # fmt: skip
    raise ValueError(f"no tiny processor for {model_type!r} here (Pixtral's processor needs a Mistral tokenizer)")


def _qwen_processor(model_type: str, tokenizer: Any, template: str) -> Any:
    """A Qwen2-VL-family processor without the video processor (which needs torchvision)."""
    import importlib

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    names = {
        "qwen2_vl": ("qwen2_vl", "Qwen2VLProcessor"),
        "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLProcessor"),
        "qwen3_vl": ("qwen3_vl", "Qwen3VLProcessor"),
        "qwen3_vl_moe": ("qwen3_vl", "Qwen3VLProcessor"),
        "qwen3_5": ("qwen3_vl", "Qwen3VLProcessor"),  # transformers' processor of Qwen3.5 (dense and MoE)
        "qwen3_5_moe": ("qwen3_vl", "Qwen3VLProcessor"),
    }
    package, name = names[model_type]
    base = getattr(importlib.import_module(f"transformers.models.{package}.processing_{package}"), name)
    processor_class = _image_only_processor_class(base)
    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=112 * 112
    )
    return processor_class(images, tokenizer, chat_template=template)


def _image_only_processor_class(base: type) -> type:
    """``base`` (a Qwen2-VL-family processor class) without its video processor: it tokenizes images and text."""
    from transformers import ProcessorMixin

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **_: Any):
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        for name in ("vision_start_token", "vision_end_token"):
            setattr(self, name, f"<|{name.removesuffix('_token')}|>")
            setattr(self, name + "_id", tokenizer.convert_tokens_to_ids(f"<|{name.removesuffix('_token')}|>"))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return _PROCESSOR_CLASSES.setdefault(base, type(base.__name__, (base,), {"__init__": __init__}))


_PROCESSOR_CLASSES: dict[type, type] = {}


def _gemma4_processor_class() -> type:
    """``Gemma4Processor`` over an image processor and a tokenizer only (no audio feature extractor, no video
    processor, which needs torchvision), the image markup of the Gemma 3 tokens of :data:`IMAGE_TOKENS`."""
    from transformers import Gemma4Processor, ProcessorMixin

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **_: Any):
        self.image_seq_length = GEMMA4_SOFT_TOKENS
        self.boi_token, self.eoi_token, self.image_token = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
        self.image_token_id = _ID[self.image_token]
        self.video_token, self.video_token_id = "<|video_pad|>", _ID["<|video_pad|>"]
        self.audio_seq_length, self.audio_ms_per_token = 750, 40
        self.audio_token = self.audio_token_id = None
        # not tokens of the vocabulary: Gemma4Processor's input check requires them set, and no audio comes
        self.boa_token, self.eoa_token = "<start_of_audio>", "<end_of_audio>"
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return _PROCESSOR_CLASSES.setdefault(
        Gemma4Processor, type("Gemma4Processor", (Gemma4Processor,), {"__init__": __init__})
    )
