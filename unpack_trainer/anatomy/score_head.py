"""What a sequence-classification model is made of: its decoder, the head that scores every token, and whether its
forward pools that score at the last non-pad token (so each packed sequence's score can be read at its own).

transformers' ``*ForSequenceClassification`` decoders (``GenericForSequenceClassification`` and the models written
like it: GPT-2, GPT-NeoX, OPT, BLOOM, ...) run their decoder, apply a head (a ``Linear`` to ``num_labels``, usually
``score``) to every token's hidden state and keep, per batch row, the score at its rightmost token that is not
``config.pad_token_id``. Found from the structure, not from a list of models (:func:`find_score_head`): the decoder
is the module named by the class's ``base_model_prefix``; the head is the one other child that is (or wraps, under
PEFT) a ``Linear`` with ``config.num_labels`` outputs; the class's code must read ``pad_token_id``. The fix that reads
each packed sequence's score is :mod:`unpack_trainer.models.fixes.classification_head`.

Everything here only reads the model (it also works on a model built on the ``meta`` device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unpack_trainer.anatomy.structure import code_names, pretrained_model, unwrapped

__all__ = ["ScoreHead", "find_score_head", "is_sequence_classifier", "score_head_refusal"]


def is_sequence_classifier(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a ``PreTrainedModel``) is a sequence-classification model: a subclass of transformers'
    ``GenericForSequenceClassification``, or a class named ``*ForSequenceClassification`` (transformers' naming, also
    followed by remote-code models)."""
    from transformers.modeling_layers import GenericForSequenceClassification

    return isinstance(model, GenericForSequenceClassification) or any(
        cls.__name__.endswith("ForSequenceClassification") for cls in type(model).__mro__
    )


@dataclass(frozen=True)
class ScoreHead:
    """Where a sequence-classification model's scores come from (found by [`find_score_head`]).

    Attributes:
        decoder: the attribute holding the decoder (the class's ``base_model_prefix``, e.g. ``"model"``).
        head: the attribute holding the head (e.g. ``"score"``): a ``Linear`` (or a PEFT wrapper of one) from the
            hidden size to ``num_labels``.
        num_labels: ``config.num_labels``.
    """

    decoder: str
    head: str
    num_labels: int


def _linear_of(module: torch.nn.Module) -> torch.nn.Linear | None:
    """``module`` if it is a ``Linear``, or the ``Linear`` PEFT wrappers hold, however nested (``modules_to_save``'s
    ``original_module``, a LoRA layer's ``base_layer``; PEFT 0.18 wraps the head in both, a LoRA layer inside the
    ``modules_to_save`` wrapper), else ``None``."""
    seen: set[int] = set()
    while isinstance(module, torch.nn.Module) and id(module) not in seen:
        if isinstance(module, torch.nn.Linear):
            return module
        seen.add(id(module))
        module = getattr(module, "original_module", None) or getattr(module, "base_layer", None)
    return None


def _reads_pad_token_id(cls: type) -> bool:
    """Whether ``cls.forward`` (the one that runs, unwrapped from its decorators) reads an attribute named
    ``pad_token_id``."""
    code = getattr(unwrapped(getattr(cls, "forward", None), "forward"), "__code__", None)
    return code is not None and "pad_token_id" in code_names(code)


def find_score_head(model: torch.nn.Module) -> ScoreHead:
    """The decoder and the head of ``model``, a sequence-classification ``PreTrainedModel`` (see the module docstring).

    Raises:
        ValueError: the model is not one whose score can be read per packed sequence; the message says why.
    """
    name = type(model).__name__
    if not is_sequence_classifier(model):
        raise ValueError(f"{name} is not a sequence-classification model (*ForSequenceClassification).")
    prefix = getattr(model, "base_model_prefix", None)
    decoder = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(decoder, torch.nn.Module):
        raise ValueError(f"{name} has no decoder under its base_model_prefix {prefix!r}.")
    num_labels = getattr(model.config, "num_labels", None)
    heads = [
        child_name
        for child_name, child in model.named_children()
        if child is not decoder and (linear := _linear_of(child)) is not None and linear.out_features == num_labels
    ]
    if len(heads) != 1:
        found = f"{len(heads)} ({', '.join(heads)})" if heads else "none"
        raise ValueError(
            f"{name}'s head is not one Linear layer with num_labels={num_labels} outputs next to its decoder "
            f"{prefix!r} (found {found})."
        )
    if not _reads_pad_token_id(type(model)):
        raise ValueError(
            f"{name} does not pool its score at the last non-pad token (its forward never reads pad_token_id), so "
            "the token whose score it keeps cannot be found per sample."
        )
    return ScoreHead(prefix, heads[0], int(num_labels))


def score_head_refusal(model: torch.nn.Module) -> str | None:
    """Why [`find_score_head`] refuses ``model`` (a ``PreTrainedModel``, or a ``PeftModel`` wrapping one), or
    ``None`` when each packed sequence's score can be read."""
    try:
        find_score_head(pretrained_model(model))
    except ValueError as error:
        return str(error)
    return None
