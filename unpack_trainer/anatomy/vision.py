"""Vision-language models on packed rows: what such a model is made of, what cannot be packed exactly, and each
sample's own multi-axis positions and bidirectional image blocks, all from the model's own code.

A vision-language model (its config has a ``vision_config``) runs its vision tower per image and writes the image
features into the image tokens of its text model, the one decoder :func:`~unpack_trainer.models.patch_model` makes
pack. Its *multimodal model* (the module that holds the text decoder and the vision tower: ``Qwen2_5_VLModel``,
``Gemma3Model``, ``LlavaModel``, ``Idefics3Model``, ...) is found from the structure (:func:`find_vision_language`).
Three model-family fixes (:mod:`unpack_trainer.models.fixes`) put a forward pre-hook on it, in this order:

1. ``vision_language`` (every vision-language model, :mod:`~unpack_trainer.models.fixes.vision_language`): takes the
   packing metadata (``packed_seq_info``, ``packed_seq_lengths``, ``cu_seq_lens_*``, ``max_length_*``) off the call,
   because transformers hands a multimodal model's keyword arguments on to its vision tower, whose attention runs per
   image and must stay exactly as stock; decides the packing with the one detector and hands it to the text
   decoder's state (:attr:`~unpack_trainer.models.state.DecoderState.carried`, adopted by the decoder hook, and
   :attr:`~unpack_trainer.models.state.DecoderState.running`, which answers the mask functions a multimodal model
   calls itself: Gemma 3 builds its text masks);
2. ``multimodal_rope`` (the Qwen2-VL family, :mod:`~unpack_trainer.models.fixes.multimodal_rope`): gives every sample
   the positions the model's own ``get_rope_index`` gives it alone (:func:`multimodal_positions`), in the layout the
   text model takes: 4 rows ``[text; t; h; w]`` with a per-sample text row where the text model reads one
   (``position_ids[0]``), else 3. Positions that already have that layout are used as given, and so are the
   collator's (``packed_multimodal_position_ids``, computed ahead on the CPU with :class:`SamplePositions`, so the
   forward needs no host sync); 3 rows where 4 are read, or 2-D positions other than the per-sample ``arange``, are
   refused with a ``ValueError``: each runs without an error and contaminates (measured 0.29-0.43 logit error);
3. ``image_blocks`` (Gemma 3, Gemma 4, :mod:`~unpack_trainer.models.fixes.image_blocks`): image tokens that attend
   to each other both ways (``token_type_ids``, Gemma 4's ``mm_token_type_ids``; Gemma 4's on its sliding-window
   layers only): each sample's image spans from the model's own ``get_block_sequence_ids_for_mask``, cut at sample
   boundaries, on the :class:`~unpack_trainer.packed_seq_info.PackedSeqInfo` (``bidirectional_spans``): flex, SDPA
   and eager apply them; the varlen kernels cannot and refuse (:mod:`unpack_trainer.patches.attention`).

Under sequence parallelism (DeepSpeed Ulysses) a process's forward holds one shard of the row
(:func:`sequence_shard`): it runs the vision tower on the images with a token in its shard only and keeps the
features of its own image tokens (:func:`shard_image_selection`, :func:`shard_image_features`), the fix
``vision_language`` handing them to the model with the shard's slice of the positions.

Nothing else changes: an unpacked forward (a padded batch, generation) runs exactly as stock. What cannot be made
exact is refused before any forward (:func:`vision_problem`, read by :mod:`unpack_trainer.models.refusals`): a
multi-axis RoPE without a ``get_rope_index``, image tokens attending by a rule this module does not read, or a
model with more than one text decoder.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from unpack_trainer.anatomy.structure import ModelStructure, class_references, mentions, pretrained_model, unwrapped
from unpack_trainer.packed_seq_info import PackedSeqInfo, id_runs

__all__ = [
    "MM_TOKEN_TYPES_KEY",
    "ROPE_INDEX_INPUTS",
    "TOKEN_TYPES_KEY",
    "RopeIndex",
    "SamplePositions",
    "ImageSelection",
    "SequencePositions",
    "VisionLanguage",
    "decoders_problem",
    "find_vision_language",
    "has_image_blocks",
    "image_block_key",
    "image_block_layer_types",
    "image_block_problem",
    "image_block_spans",
    "image_runs",
    "is_vision_language",
    "multi_axis_problem",
    "multimodal_positions",
    "rope_index_of",
    "sample_positions_of",
    "sequence_positions_of",
    "sequence_shard",
    "shard_image_features",
    "shard_image_selection",
    "text_model",
    "vision_problem",
]

# The keys of a multimodal batch that carry each token's modality (Qwen2-VL's and Gemma 4's, Gemma 3's).
MM_TOKEN_TYPES_KEY = "mm_token_type_ids"
TOKEN_TYPES_KEY = "token_type_ids"
# The arguments of ``get_rope_index`` besides the tokens, handed on from the batch where its signature has them.
ROPE_INDEX_INPUTS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class VisionLanguage:
    """What the packing of a vision-language model needs from it (:func:`find_vision_language`).

    Attributes:
        module: the multimodal model (holds the text decoder and the vision tower).
        decoder: the text decoder (the module the patch hooks).
        position_rows: rows of the position ids the text model takes on a packed batch: 1 (plain positions), 4
            (multi-axis RoPE with a text row, ``[text; t; h; w]``) or 3 (multi-axis without one).
        image_blocks: the model's ``get_block_sequence_ids_for_mask`` (``token types (B, T) -> (B, T)`` int64,
            ``-1`` for text, an image's tokens one id) when its image tokens attend both ways, else ``None``.
        image_block_key: the per-token key of the batch ``image_blocks`` reads (:func:`image_block_key`:
            ``token_type_ids`` or ``mm_token_type_ids``), ``None`` without image blocks.
    """

    module: torch.nn.Module
    decoder: torch.nn.Module
    position_rows: int
    image_blocks: Callable[..., torch.Tensor] | None
    image_block_key: str | None = None


def is_vision_language(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a ``PreTrainedModel`` or a ``PeftModel`` wrapping one) is a vision-language model: its
    config has a ``vision_config``."""
    return getattr(pretrained_model(model).config, "vision_config", None) is not None


def _parent(root: torch.nn.Module, child: torch.nn.Module) -> torch.nn.Module | None:
    for module in root.modules():
        if any(c is child for c in module.children()):
            return module
    return None


def _rope_index_owner(module: torch.nn.Module) -> type | None:
    """The class whose ``get_rope_index`` the multimodal model ``module`` has (its own class), or ``None``."""
    return type(module) if callable(getattr(type(module), "get_rope_index", None)) else None


def _multi_axis(config: Any) -> bool:
    """Whether the text model of ``config`` rotates by several position axes (``mrope_section`` in its RoPE
    parameters)."""
    text = config.get_text_config()
    for name in ("rope_parameters", "rope_scaling"):
        parameters = getattr(text, name, None)
        if isinstance(parameters, dict) and parameters.get("mrope_section") is not None:
            return True
    return False


def _reads_text_row(decoder: torch.nn.Module) -> bool:
    """Whether the text decoder's ``forward`` takes a text row of positions (``text_position_ids``: the 4-row layout
    ``[text; t; h; w]`` of Qwen2-VL's text models), read from its code."""
    forward = unwrapped(type(decoder).forward, "forward")
    return "text_position_ids" in getattr(getattr(forward, "__code__", None), "co_varnames", ())


def _image_block_function(module: torch.nn.Module) -> Callable[..., torch.Tensor] | None:
    """The model's ``get_block_sequence_ids_for_mask`` (Gemma 3, Gemma 4), found among the globals its methods use."""
    function = class_references(type(module)).get("get_block_sequence_ids_for_mask")
    return function if isinstance(function, types.FunctionType) else None


def _image_blocks_switched_off(module: torch.nn.Module) -> bool:
    """Whether the multimodal model ``module`` reads its blocks' switch from the text config
    (``use_bidirectional_attention``, Gemma 4: image tokens attend both ways only where it is ``"vision"``) and the
    config switches them off (Gemma 4's smaller models: ``None``)."""
    if not mentions(type(module), "use_bidirectional_attention"):
        return False
    return getattr(module.config.get_text_config(), "use_bidirectional_attention", None) != "vision"


def image_block_key(block_ids: Callable[..., torch.Tensor]) -> str:
    """The per-token key of the batch the model's ``get_block_sequence_ids_for_mask`` reads: the name of its first
    parameter (Gemma 3: ``token_type_ids``, Gemma 4: ``mm_token_type_ids``)."""
    return next(iter(inspect.signature(block_ids).parameters))


def image_block_layer_types(module: torch.nn.Module) -> frozenset[str] | None:
    """The layer types of the text model whose attention applies the image blocks, read from the multimodal model's
    own mask builder (``create_masks_for_vision_model``: Gemma 3's every layer type, Gemma 4's sliding-window layers
    only): its masks of a 3-token row whose first two tokens are one image, a layer type applying the blocks where
    its first token sees the second. ``None`` (every layer) for a model without that builder."""
    import copy

    from unpack_trainer._compat import set_attention_implementation

    build = class_references(type(module)).get("create_masks_for_vision_model")
    if not isinstance(build, types.FunctionType):
        return None
    config = copy.deepcopy(module.config.get_text_config())
    set_attention_implementation(config, "sdpa")  # a boolean mask (None where it is causal)
    inputs = {
        "config": config,
        "inputs_embeds": torch.zeros(1, 3, 1),
        "attention_mask": None,
        "position_ids": torch.arange(3).unsqueeze(0),
        "block_sequence_ids": torch.tensor([[0, 0, -1]]),
        "cache": None,
        "past_key_values": None,
    }
    accepted = inspect.signature(build).parameters
    masks = build(**{name: value for name, value in inputs.items() if name in accepted})
    return frozenset(
        layer_type
        for layer_type, mask in masks.items()
        if isinstance(mask, torch.Tensor) and bool(mask.reshape(-1, 3, 3)[0, 0, 1])
    )


def _bidirectional_rule(module: torch.nn.Module) -> str | None:
    """How the multimodal model ``module`` makes some tokens attend both ways, when it does and not through
    ``get_block_sequence_ids_for_mask``: the names it uses (``blockwise_overlay``, ``block_sequence_ids``,
    ``token_type_ids_mask_function``, ``or_mask_function``), else ``None``."""
    references = class_references(type(module))
    names = [name for name in ("blockwise_overlay", "token_type_ids_mask_function") if name in references]
    names += [name for name in ("block_sequence_ids", "or_mask_function") if mentions(type(module), name)]
    return ", ".join(names) or None


def _multimodal_module(structure: ModelStructure) -> torch.nn.Module | None:
    """The multimodal model of a vision-language model with one text decoder (the decoder's parent), else ``None``."""
    if getattr(structure.config, "vision_config", None) is None or len(structure.decoders) != 1:
        return None
    return _parent(structure.pretrained, structure.decoders[0].module) or structure.pretrained


def decoders_problem(structure: ModelStructure) -> str | None:
    """A vision-language model with other than one text decoder: this module knows which to pack for one only."""
    if getattr(structure.config, "vision_config", None) is None or len(structure.decoders) == 1:
        return None
    return f"it is a vision-language model with {len(structure.decoders)} text decoders where one is expected"


def multi_axis_problem(structure: ModelStructure) -> str | None:
    """A vision-language model whose text model rotates by several position axes without a ``get_rope_index`` to
    compute each sample's positions with (its packed rows would run on positions counted along the row)."""
    module = _multimodal_module(structure)
    if module is None or not _multi_axis(structure.config) or _rope_index_owner(module) is not None:
        return None
    return (
        f"its text model rotates by several position axes (multimodal RoPE) and {type(module).__name__} has no "
        "get_rope_index to compute each sample's positions with"
    )


def image_block_problem(structure: ModelStructure) -> str | None:
    """A vision-language model some of whose tokens attend both ways by a rule this module does not read (anything
    but Gemma 3's and Gemma 4's ``get_block_sequence_ids_for_mask``)."""
    module = _multimodal_module(structure)
    if module is None or _image_block_function(module) is not None:
        return None
    rule = _bidirectional_rule(module)
    if rule is None:
        return None
    return (
        f"{type(module).__name__} lets some tokens attend both ways by a rule this package does not read ({rule}); "
        "only get_block_sequence_ids_for_mask (Gemma 3's, Gemma 4's) is applied per sample"
    )


def vision_problem(model: torch.nn.Module, structure: ModelStructure | None = None) -> str | None:
    """Why the packed rows of the vision-language model ``model`` cannot be exact (:func:`decoders_problem`,
    :func:`multi_axis_problem`, :func:`image_block_problem`), or ``None`` (also for a model that is no vision-language
    model). Read from the model's structure and code, before any forward; works on the ``meta`` device."""
    from unpack_trainer.anatomy.structure import discover

    if not is_vision_language(model):
        return None
    structure = structure if structure is not None else discover(model)
    for check in (decoders_problem, multi_axis_problem, image_block_problem):
        problem = check(structure)
        if problem is not None:
            return problem
    return None


def has_image_blocks(model: torch.nn.Module, structure: ModelStructure | None = None) -> bool:
    """Whether some tokens of ``model`` (a vision-language model's image tokens: Gemma 3, Gemma 4 where its config
    switches them on) attend to each other both
    ways on packed rows (an attention feature the varlen kernels cannot apply). Works on the ``meta`` device."""
    from unpack_trainer.anatomy.structure import discover

    if not is_vision_language(model):
        return False
    module = _multimodal_module(structure if structure is not None else discover(model))
    return module is not None and _image_block_function(module) is not None and not _image_blocks_switched_off(module)


def text_model(model: torch.nn.Module, structure: ModelStructure | None = None) -> torch.nn.Module | None:
    """The text decoder of the vision-language model ``model`` (the one module the patch packs), or ``None`` for a
    model that is no vision-language model or has other than one text decoder. Works on the ``meta`` device."""
    from unpack_trainer.anatomy.structure import discover

    if not is_vision_language(model):
        return None
    decoders = (structure if structure is not None else discover(model)).decoders
    return decoders[0].module if len(decoders) == 1 else None


def find_vision_language(model: torch.nn.Module, structure: ModelStructure | None = None) -> VisionLanguage | None:
    """What the packing of the vision-language model ``model`` needs (see :class:`VisionLanguage`); ``None`` for a
    model that is no vision-language model.

    Raises:
        ValueError: :func:`vision_problem` found a reason it cannot be packed exactly.
    """
    from unpack_trainer.anatomy.structure import discover

    if not is_vision_language(model):
        return None
    structure = structure if structure is not None else discover(model)
    problem = vision_problem(model, structure)
    if problem is not None:
        raise ValueError(f"{type(structure.pretrained).__name__} cannot be packed exactly: {problem}.")
    module = _multimodal_module(structure)
    decoder = structure.decoders[0].module
    rows = 1
    if _multi_axis(structure.config):
        rows = 4 if _reads_text_row(decoder) else 3
    blocks = None if _image_blocks_switched_off(module) else _image_block_function(module)
    return VisionLanguage(module, decoder, rows, blocks, None if blocks is None else image_block_key(blocks))


# --------------------------------------------------------------------------------------------------------------------
# Positions and image blocks per sample, from the model's own code
# --------------------------------------------------------------------------------------------------------------------


class RopeIndex:
    """The model's own ``get_rope_index``, callable without the model: the method of the multimodal model's class,
    bound to an object that holds only its config (so a data loader worker can take it; the method reads nothing
    but the config and the class's other methods). Falls back to the live model's bound method where the class's
    method needs more (``_live``; then only the forward hook uses it, never a collator).

    Args:
        module: the multimodal model (``Qwen2_5_VLModel``, ...), whose class has ``get_rope_index``.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        owner = _rope_index_owner(module)
        if owner is None:
            raise ValueError(f"{type(module).__name__} has no get_rope_index.")
        self._owner = owner
        self.config = module.config
        self._live: Callable[..., Any] | None = None
        parameters = inspect.signature(owner.get_rope_index).parameters
        self._accepts = {name for name in parameters if name != "self"}
        try:
            self._call(torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.int64), {})
        except AttributeError:  # the method reads a module of the model, not only its config
            self._live = module.get_rope_index

    def __getattr__(self, name: str) -> Any:
        # The class's other methods (``get_vision_position_ids``, ...), bound to this object.
        value = getattr(object.__getattribute__(self, "_owner"), name)
        return types.MethodType(value, self) if isinstance(value, types.FunctionType) else value

    def accepts(self, name: str) -> bool:
        """Whether the model's ``get_rope_index`` takes the argument ``name``."""
        return name in self._accepts

    @property
    def needs_model(self) -> bool:
        """Whether the method reads a module of the live model, not only its config (then only the forward hook
        computes the positions, never a collator)."""
        return self._live is not None

    def _call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        kwargs = {name: value for name, value in inputs.items() if name in self._accepts and value is not None}
        kwargs["attention_mask"] = attention_mask
        if MM_TOKEN_TYPES_KEY in self._accepts:
            kwargs.setdefault(MM_TOKEN_TYPES_KEY, torch.zeros_like(input_ids))
        function = self._live or types.MethodType(self._owner.get_rope_index, self)
        positions, _ = function(input_ids, **kwargs)
        return positions

    def padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """``(3, B, L)`` int64: the multi-axis positions of a padded batch, each row's real tokens
        (``attention_mask`` ``(B, L)``, 1 on them) as ``get_rope_index`` numbers the row alone; padding as the method
        leaves it. ``inputs`` as for ``__call__``, in the batch's layout (``(B, L)`` per-token keys)."""
        return self._call(input_ids, attention_mask, inputs).to(torch.int64)

    def __call__(self, input_ids: torch.Tensor, info: PackedSeqInfo, inputs: dict[str, Any]) -> torch.Tensor:
        """``(3, B, T)`` int64: each sample's multi-axis positions, as ``get_rope_index`` gives it alone.

        The samples (``info``, row-major over ``input_ids`` ``(B, T)``) become one padded batch with an attention
        mask, which ``get_rope_index`` numbers sample by sample, its image and video grids taken in order as in any
        batch; the positions are read back into the packed order.

        Args:
            input_ids: ``(B, T)`` int64 token ids of the packed batch.
            info: its samples.
            inputs: the batch's other inputs the method takes (``mm_token_type_ids`` ``(B, T)``, ``image_grid_thw``
                ``(num_images, 3)``, ``video_grid_thw``, ``second_per_grid_ts``), on the device of ``input_ids``.
        """
        device = input_ids.device
        lengths = info.seq_lengths.to(torch.int64)
        longest = int(lengths.max())
        slots, real = _sample_slots(info, longest)
        slots, real = slots.to(device), real.to(device)
        flat = input_ids.reshape(-1)
        padded = {"input_ids": flat[slots].masked_fill(~real, 0)}
        per_token = {}
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.shape == input_ids.shape:
                per_token[name] = value.reshape(-1)[slots].masked_fill(~real, 0)
        positions = self._call(padded["input_ids"], real.to(torch.int64), {**inputs, **per_token})
        # the samples tile the row-major tokens in order: their real slots, in order, are the tokens
        out = positions.reshape(3, -1)[:, real.reshape(-1)].to(torch.int64)
        return out.reshape(3, info.batch_size, info.seq_len)


def _sample_slots(info: PackedSeqInfo, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_seqs, longest)`` int64: the token (row-major over ``B * T``) of each slot of the samples padded to
    ``longest`` (padding reads the sample's first token), and the ``(num_seqs, longest)`` bool mask of real slots."""
    starts = info.cu_seqlens[:-1].to(torch.int64).unsqueeze(1)
    steps = torch.arange(longest, dtype=torch.int64).unsqueeze(0)
    real = steps < info.seq_lengths.to(torch.int64).unsqueeze(1)
    return torch.where(real, starts + steps, starts), real


def multimodal_positions(
    rope_index: Callable[..., torch.Tensor], input_ids: torch.Tensor, info: PackedSeqInfo, inputs: dict[str, Any],
    *, rows: int = 4,
) -> torch.Tensor:  # fmt: skip
    """Every sample's positions as the model gives them to the sample alone, in the layout its text model takes.

    Args:
        rope_index: a :class:`RopeIndex` of the model.
        input_ids: ``(B, T)`` int64 token ids of the packed batch.
        info: its samples.
        inputs: what ``get_rope_index`` reads besides the tokens (``mm_token_type_ids``, the grids).
        rows: 4 for ``[text; t; h; w]`` (the text row each sample's own ``arange``), 3 for ``[t; h; w]``.

    Returns:
        ``(rows, B, T)`` int64 on the device of ``input_ids``.

    Example (two samples of 3 text tokens and of 2 text + a 2 x 2 image merged to 1 token + 1 text)::

        text row  [0 1 2 | 0 1 2 3]
        t / h / w [0 1 2 | 0 1 2 3] for text, the image token at its grid position
    """
    multi = rope_index(input_ids, info, inputs)
    if rows == 3:
        return multi
    text = info.position_ids(input_ids.device).unsqueeze(0)
    return torch.cat([text, multi], dim=0)


def image_block_spans(
    block_ids: Callable[..., torch.Tensor], token_type_ids: torch.Tensor, info: PackedSeqInfo
) -> torch.Tensor | None:
    """The token spans that attend both ways, per sample: the model's own block ids of ``token_type_ids`` ``(B, T)``
    (the batch's key :func:`image_block_key` names; ``get_block_sequence_ids_for_mask``: ``-1`` for causal tokens,
    one id per image), as ``(num_spans, 2)`` int64 CPU ``[start, end)`` runs of one id, cut at every sample start;
    ``None`` when there is none."""
    cpu = {"device": torch.device("cpu")} if "device" in inspect.signature(block_ids).parameters else {}
    ids = block_ids(token_type_ids.detach().cpu(), **cpu).reshape(-1).to(torch.int64)
    if not bool((ids >= 0).any()):
        return None
    return id_runs(ids, info.cu_seqlens[:-1].to(torch.int64))


def rope_index_of(model: torch.nn.Module) -> RopeIndex | None:
    """A :class:`RopeIndex` of ``model`` when its text model takes multi-axis positions, else ``None``."""
    vision = find_vision_language(model)
    if vision is None or vision.position_rows == 1:
        return None
    return RopeIndex(vision.module)


class SamplePositions:
    """What a data collator computes a packed batch's positions with, on the CPU, so that the forward hook does not
    have to: ``(input_ids (1, T), info, inputs) -> (rows, 1, T)`` int64, :func:`multimodal_positions` of the model's
    :class:`RopeIndex` in the layout its text model takes. Picklable (a data loader worker can take it)."""

    def __init__(self, rope_index: RopeIndex, rows: int) -> None:
        self.rope_index = rope_index
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, info: PackedSeqInfo, inputs: dict[str, Any]) -> torch.Tensor:
        return multimodal_positions(self.rope_index, input_ids, info, inputs, rows=self.rows)


class SequencePositions:
    """Each sequence's multi-axis positions in a padded batch, in the layout the text model takes: what the packed
    row of a batch with shared prompts reads every token's positions from (a prompt token's from its full sequence,
    a completion token's continuing its prompt's), so a branch is numbered exactly as its full sequence alone.

    ``(input_ids (B, L), attention_mask (B, L), inputs) -> (rows, B, L)`` int64: the rows of
    :meth:`RopeIndex.padded` (the model's own ``get_rope_index``), with each sequence's text row (``0, 1, 2, ...``
    over its real tokens) in front for the 4-row layout. Picklable (a data loader worker can take it) unless the
    model's method reads its live modules (:attr:`RopeIndex.needs_model`).
    """

    def __init__(self, rope_index: RopeIndex, rows: int) -> None:
        self.rope_index = rope_index
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        multi = self.rope_index.padded(input_ids, attention_mask, inputs)
        if self.rows == 3:
            return multi
        text = (attention_mask.to(torch.int64).cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0)
        return torch.cat([text.to(multi.device), multi], dim=0)


def sequence_positions_of(model: torch.nn.Module) -> SequencePositions | None:
    """The :class:`SequencePositions` of ``model`` when its text model takes multi-axis positions, else ``None``."""
    vision = find_vision_language(model)
    if vision is None or vision.position_rows == 1:
        return None
    return SequencePositions(RopeIndex(vision.module), vision.position_rows)


def sample_positions_of(model: torch.nn.Module) -> SamplePositions | None:
    """The :class:`SamplePositions` of ``model`` when its text model takes multi-axis positions, else ``None`` (its
    positions are the restarting 1-D ones any collator gives)."""
    vision = find_vision_language(model)
    if vision is None or vision.position_rows == 1:
        return None
    rope_index = RopeIndex(vision.module)
    if rope_index.needs_model:  # the forward hook computes the positions
        return None
    return SamplePositions(rope_index, vision.position_rows)


# --------------------------------------------------------------------------------------------------------------------
# Sequence parallelism: one shard of a packed row, its image features and the whole row's layout
# --------------------------------------------------------------------------------------------------------------------


def sequence_shard(info: PackedSeqInfo, length: int) -> tuple[int, int] | None:
    """The tokens ``[start, end)`` of the row that a forward of ``length`` tokens holds, when ``info`` describes one
    row cut into ``info.sequence_shards`` equal shards (DeepSpeed Ulysses) and the forward is one of them: the
    shard of this process's rank in DeepSpeed's sequence-parallel group (the rank DeepSpeed's data loader adapter
    cut it for). ``None`` when the forward holds the whole row (evaluation, which Ulysses leaves whole; no sequence
    parallelism).

    Raises:
        ValueError: a shard outside a DeepSpeed sequence-parallel group of ``info.sequence_shards`` processes.
    """
    from unpack_trainer._compat import sequence_parallel_group

    shards = info.sequence_shards
    if shards == 1 or length == info.seq_len:
        return None
    group = sequence_parallel_group()
    if group is None or torch.distributed.get_world_size(group) != shards:
        raise ValueError(
            f"A forward of {length} tokens of a packed row of {info.seq_len} cut into {shards} sequence-parallel "
            "shards ran outside a DeepSpeed Ulysses group of that size (accelerate's ParallelismConfig(sp_size=...) "
            "sets it up); its image features and positions cannot be told apart from the other shards'."
        )
    rank = torch.distributed.get_rank(group)
    return rank * length, (rank + 1) * length


@dataclass(frozen=True)
class ImageSelection:
    """Which images a shard of a packed row runs through the vision tower, and which of their features it keeps
    (:func:`shard_image_selection`).

    Attributes:
        first, stop: the images ``[first, stop)`` (in the row's order) that have a token in the shard.
        pixel_start, pixel_stop: their rows of ``pixel_values`` (dim 0); ``-1`` as ``pixel_stop``: every row (the
            layout does not tell each image's rows, so every image runs).
        feature_offset: the first feature of those images' features (concatenated, in order) the shard keeps.
        feature_count: the shard's image tokens, the features it keeps.
    """

    first: int
    stop: int
    pixel_start: int
    pixel_stop: int
    feature_offset: int
    feature_count: int


def image_runs(image_mask: torch.Tensor) -> torch.Tensor:
    """``(num_runs, 2)`` int64 ``[start, end)`` of every maximal run of ``True`` in ``image_mask`` ``(T,)`` bool: the
    images of a row, whose placeholder tokens the processors put between markers (Qwen2-VL's ``<|vision_start|>`` /
    ``<|vision_end|>``, Gemma 3's ``<start_of_image>`` / ``<end_of_image>``)."""
    flags = torch.nn.functional.pad(image_mask.to(torch.int8), (1, 1))
    steps = flags[1:] - flags[:-1]
    return torch.stack([torch.nonzero(steps == 1)[:, 0], torch.nonzero(steps == -1)[:, 0]], dim=1).to(torch.int64)


def shard_image_selection(
    image_mask: torch.Tensor, start: int, end: int, pixel_rows: torch.Tensor | None
) -> ImageSelection | None:
    """The images the shard ``[start, end)`` of a row runs through the vision tower, and the features it keeps.

    Args:
        image_mask: ``(T,)`` bool, the row's image placeholder tokens (the whole row's).
        start, end: the shard's tokens.
        pixel_rows: ``(num_images,)`` int, each image's rows of ``pixel_values`` (Qwen2-VL: ``t * h * w`` patches;
            one per image where ``pixel_values`` is ``(num_images, C, H, W)``), or ``None`` where the pixel values
            cannot be split per image (then every image runs, and the features are kept from the row's count).

    Returns:
        ``None`` when the row has no image; else the images with a token in the shard (an image cut by the shard
        boundary is run whole by every shard that holds a part of it: the tower attends over the whole image), and
        the slice of their features that belongs to the shard's image tokens. A shard without an image token of a
        row with images runs the row's smallest image and keeps none of its features: every process of the group
        then gives the vision tower a gradient (zero here), as DeepSpeed's ZeRO, which reduces gradients as each
        parameter's arrives, needs of every process.

    Example (images of 4 and 3 tokens at ``[2, 6)`` and ``[8, 11)``, one pixel row each, shards of 5 tokens)::

        shard [0, 5)   images [0, 1), features [0, 3)    3 tokens of image 0
        shard [5, 10)  images [0, 2), features [3, 6)    1 token of image 0, 2 of image 1
        shard [10, 15) images [1, 2), features [2, 3)    the last token of image 1
        shard [15, 20) images [0, 1), features [0, 0)    no image token: the smallest image run, nothing kept
    """
    runs = image_runs(image_mask)
    if runs.shape[0] == 0:
        return None
    count = int(image_mask[start:end].sum())
    if count == 0 and pixel_rows is not None and pixel_rows.numel() == runs.shape[0]:
        smallest = int(torch.argmin(pixel_rows))
        rows = torch.cat([torch.zeros(1, dtype=torch.int64), pixel_rows.to(torch.int64).cumsum(0)])
        return ImageSelection(smallest, smallest + 1, int(rows[smallest]), int(rows[smallest + 1]), 0, 0)
    if pixel_rows is None or pixel_rows.numel() != runs.shape[0]:
        total = int(pixel_rows.sum()) if pixel_rows is not None else -1
        return ImageSelection(0, runs.shape[0], 0, total, int(image_mask[:start].sum()), count)
    first = int((runs[:, 1] <= start).sum())
    stop = int((runs[:, 0] < end).sum())
    rows = torch.cat([torch.zeros(1, dtype=torch.int64), pixel_rows.to(torch.int64).cumsum(0)])
    offset = max(0, start - int(runs[first, 0]))
    return ImageSelection(first, stop, int(rows[first]), int(rows[stop]), offset, count)


def _pixel_rows(inputs: dict[str, Any], num_images: int) -> torch.Tensor | None:
    """Each image's rows of ``pixel_values`` (see :func:`shard_image_selection`), or ``None`` where the layout does
    not tell them."""
    pixels, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
    if isinstance(grid, torch.Tensor) and grid.shape[0] == num_images:
        rows = grid.to(torch.int64).prod(-1)
        if int(rows.sum()) == pixels.shape[0]:
            return rows
    if pixels.shape[0] == num_images:
        return torch.ones(num_images, dtype=torch.int64)
    return None


def shard_image_features(
    module: torch.nn.Module, inputs: dict[str, Any], start: int, end: int, device: torch.device
) -> dict[str, Any] | None:
    """The image features of the shard ``[start, end)`` of a packed row, as the multimodal model ``module`` takes
    them instead of pixel values (its ``mm_encoder_outputs={"image": ...}``): the model's own
    ``get_image_features`` on the images with a token in the shard (:func:`shard_image_selection`), cut to the
    shard's image tokens, in the layout the model's ``get_image_features`` returns (Qwen2-VL: a tuple of
    ``(tokens, hidden)``, one here; Gemma 3: ``(1, tokens, hidden)``). The model scatters them into its image tokens
    itself, with its own count check (a shard without image tokens gets none, the features of the row's smallest
    image kept in the graph, empty). ``None`` when the row has no image.

    Args:
        module: the multimodal model (``Qwen2_5_VLModel``, ``Gemma3Model``, ...).
        inputs: the whole row's inputs (``input_ids`` ``(1, T)``, ``pixel_values``, ``image_grid_thw``, ...), CPU.
        start, end: the shard's tokens.
        device: where the model runs.

    Raises:
        ValueError: the row holds video tokens (not supported under sequence parallelism).
    """
    ids = inputs["input_ids"].reshape(-1)
    config = module.config
    video = getattr(config, "video_token_id", None)
    if isinstance(video, int) and bool((ids == video).any()):
        raise ValueError(
            f"A packed row with videos cannot be cut for sequence parallelism with {type(module).__name__} (only "
            "images are laid out per shard); train videos without sequence parallelism."
        )
    image_mask = ids == config.image_token_id
    if inputs.get("pixel_values") is None or not bool(image_mask.any()):
        return None
    selection = shard_image_selection(
        image_mask, start, end, _pixel_rows(inputs, int(image_runs(image_mask).shape[0]))
    )
    if selection is None:
        return None
    pixels = inputs["pixel_values"]
    call: dict[str, Any] = {"return_dict": True}
    if selection.pixel_stop >= 0:
        pixels = pixels[selection.pixel_start : selection.pixel_stop]
    if "image_grid_thw" in inspect.signature(module.get_image_features).parameters:
        grid = inputs.get("image_grid_thw")
        call["image_grid_thw"] = None if grid is None else grid[selection.first : selection.stop].to(device)
    outputs = module.get_image_features(pixels.to(device), **call)
    pooled = outputs.pooler_output
    flat = (
        torch.cat(list(pooled), dim=0) if isinstance(pooled, (tuple, list)) else pooled.reshape(-1, pooled.shape[-1])
    )
    kept = flat[selection.feature_offset : selection.feature_offset + selection.feature_count]
    outputs.pooler_output = (kept,) if isinstance(pooled, (tuple, list)) else kept.unsqueeze(0)
    return {"image": outputs}
