"""Checks on the data, shared by every entry point: ``packing.py``, ``collator.py``, ``streaming.py`` and the trainer.

Beside the data path rather than a stage of it: every stage of ``unpack_trainer/data/`` checks its input here.

One place decides what a valid sample is, so the packing API, the collator, the streaming packer and the trainer
accept and reject the same inputs with the same words. Every error is a ``ValueError`` that names the sample (its
index, and the field) and says what is allowed.

A token sequence (``input_ids``, ``labels``, a mask, ``seq_lengths``) is valid when it is a flat 1-D sequence of
integers that fit in int64:

- a Python ``list`` / ``tuple`` (or any ``collections.abc.Sequence``) of ``int`` or numpy integer scalars;
- a 1-D ``numpy.ndarray`` of an integer dtype;
- a 1-D ``torch.Tensor`` of an integer dtype.

Rejected: floats (``1.0`` included: a float id is a sign of a broken pipeline, and casting would silently truncate
``1.5``), ``bool`` (except in masks), strings, ``None``, nested lists, 2-D arrays and values outside
``[-2**63, 2**63 - 1]``.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

Overflow = Literal["error", "truncate", "split"]
OVERFLOWS = ("error", "truncate", "split")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_NESTED = (list, tuple, np.ndarray, torch.Tensor)


# --------------------------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------------------------


def check_positive_int(value: Any, name: str, *, requirement: str = "a positive integer") -> int:
    """``value`` as an ``int`` if it is an integer >= 1 (``bool`` is not); ``ValueError`` naming ``name`` otherwise.

    ``requirement`` is what the message says the value must be (``"`name` must be <requirement>, got <value>."``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"`{name}` must be {requirement}, got {value!r}.")
    return int(value)


def check_overflow(overflow: Any) -> Overflow:
    """``overflow`` if it is one of ``"error"``, ``"truncate"``, ``"split"``; ``ValueError`` otherwise."""
    if not isinstance(overflow, str) or overflow not in OVERFLOWS:
        raise ValueError(f"Unknown overflow policy {overflow!r}; use one of {OVERFLOWS}.")
    return overflow  # type: ignore[return-value]


def too_long_error(index: int, length: int, max_length: int, *, where: str = "") -> ValueError:
    """The error for a sample longer than ``max_length`` under ``overflow="error"`` (``where``: e.g. ``" of the
    stream"``, appended to ``"Sample <index>"``)."""
    return ValueError(
        f"Sample {index}{where} has {length} tokens, more than max_length={max_length}. "
        "Pass overflow='truncate' or overflow='split' to handle long samples, or raise max_length."
    )


def overflow_spans(
    index: int, length: int, max_length: int, overflow: Overflow, *, where: str = ""
) -> list[tuple[int, int]]:
    """The ``[start, stop)`` token spans kept of sample ``index`` (``length`` tokens) under ``overflow``.

    A sample that fits is kept whole (``[(0, length)]``). A longer one: ``"error"`` raises [`too_long_error`] (with
    ``where``), ``"truncate"`` keeps its first ``max_length`` tokens, ``"split"`` cuts it into consecutive chunks of
    ``max_length`` tokens (the last one shorter). The one overflow policy of ``pack_sequences``,
    ``concatenate_and_pack`` and the streaming packer.

    Example:
        >>> overflow_spans(0, 10, 4, "split")
        [(0, 4), (4, 8), (8, 10)]
    """
    if length <= max_length:
        return [(0, length)]
    if overflow == "error":
        raise too_long_error(index, length, max_length, where=where)
    if overflow == "truncate":
        return [(0, max_length)]
    return [(start, min(start + max_length, length)) for start in range(0, length, max_length)]


def log_overflow(
    logger: logging.Logger,
    overflow: Overflow,
    samples: int,
    max_length: int,
    *,
    tokens: int | None = None,
    chunks: int | None = None,
) -> None:
    """Warn that ``samples`` samples longer than ``max_length`` were truncated (``tokens``: the tokens dropped) or
    split (into ``chunks`` chunks, or re-packing ``tokens`` tokens); nothing when ``samples`` is 0."""
    if not samples:
        return
    if overflow == "truncate":
        action = f"truncated, dropping {tokens} token(s)"
    else:
        action = "split into " + ("chunks" if chunks is None else f"{chunks} chunks")
        action += ", re-packing " + ("them" if tokens is None else f"{tokens} token(s)")
    logger.warning(
        "overflow=%r: %d sample(s) longer than max_length=%d were %s.", overflow, samples, max_length, action
    )


# --------------------------------------------------------------------------------------------------------------------
# Containers of samples
# --------------------------------------------------------------------------------------------------------------------


def as_sequence(value: Any, name: str) -> Sequence | np.ndarray | torch.Tensor:
    """An ordered container of samples (or lengths) that can be indexed and measured.

    Lists, tuples, arrays and tensors are returned as they are; any other iterable (a generator, ``map``, a
    ``datasets`` column iterator) is read into a list once. Strings, bytes, mappings and non-iterables are rejected:
    they are not sequences of samples.
    """
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(
            f"`{name}` must be a sequence (a list, tuple, array or tensor, or an iterable such as a generator), "
            f"got {type(value).__name__}."
        )
    if isinstance(value, Sequence):
        return value
    return list(value)


# --------------------------------------------------------------------------------------------------------------------
# Token sequences
# --------------------------------------------------------------------------------------------------------------------


def _subject(what: str, index: int) -> str:
    text = what.format(index=index)
    return text[:1].upper() + text[1:]


def _integer_dtype(dtype: Any, allow_bool: bool) -> bool:
    if isinstance(dtype, torch.dtype):
        if dtype == torch.bool:
            return allow_bool
        return not (dtype.is_floating_point or dtype.is_complex)
    if dtype == np.bool_:
        return allow_bool
    return bool(np.issubdtype(dtype, np.integer))


def _out_of_int64_range(values: list, what: str, index: int) -> None:
    for position, token in enumerate(values):
        if not INT64_MIN <= token <= INT64_MAX:
            raise ValueError(
                f"{_subject(what, index)} holds the id {token} at position {position}, outside the int64 range "
                "[-2**63, 2**63 - 1]; token ids must be valid vocabulary indices."
            )


def token_list(
    value: Any, index: int, what: str = "sample {index}", *, allow_bool: bool = False, scan: bool = True
) -> list[int]:
    """A flat 1-D sequence of integer ids as a Python ``list[int]``; ``ValueError`` naming the sample otherwise.

    Args:
        value: a list / tuple / other ``Sequence`` of integers, or a 1-D integer ``numpy.ndarray`` / ``torch.Tensor``.
        index: the sample's index, for the message.
        what: how the message names the sequence, with ``{index}``: ``"sample {index}"``, ``"labels of sample
            {index}"``, ``"`input_ids` of example {index}"``.
        allow_bool: accept ``bool`` values (masks); ids and labels never are booleans.
        scan: check every value of a Python list (about 80 ns per value on a busy 2-core CPU). ``False`` checks the
            container, an array's or tensor's dtype and shape, and a list's first and last values only: O(1) per
            sample, for the streaming packer, whose rows reach a collator that checks every value
            ([`DataCollatorForPacking`] does). It catches what real pipelines produce (a column of floats, text
            instead of ids, a batch instead of a sample), not one bad value inside a list of ints.

    Returns:
        The ids as a ``list`` of Python ``int`` (a plain list of ``int`` is returned as it is, not copied). May be
        empty: callers say themselves why a sample needs tokens.
    """
    if type(value) is list:
        values = value
    elif isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"{_subject(what, index)} must be 1-D, got shape {tuple(value.shape)}.")
        if not _integer_dtype(value.dtype, allow_bool):
            raise ValueError(f"{_subject(what, index)} must hold integer ids, got dtype {value.dtype}.")
        values = value.tolist()
        if value.dtype != torch.uint64:
            return values if value.dtype != torch.bool else [int(v) for v in values]
    elif isinstance(value, np.ndarray):
        if value.ndim != 1 or (value.dtype != object and value.size and not _integer_dtype(value.dtype, allow_bool)):
            raise ValueError(
                f"{_subject(what, index)} must be a 1-D array of integer ids, got {value.dtype} {value.shape}."
            )
        values = value.tolist()
        if value.dtype not in (object, np.uint64, np.bool_):
            return values
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(
            f"{_subject(what, index)} must be a list or 1-D tensor of ids (or a 1-D integer array), got "
            f"{type(value).__name__}."
        )
    else:
        values = list(value)
    if not values:
        return values
    if not scan:
        first, last = values[0], values[-1]
        if (
            type(first) is int
            and type(last) is int
            and INT64_MIN <= first <= INT64_MAX
            and INT64_MIN <= last <= INT64_MAX
        ):
            return values
    if set(map(type, values)) != {int}:
        for position, token in enumerate(values):
            if type(token) is int or (isinstance(token, bool) and allow_bool):
                continue
            if isinstance(token, numbers.Integral) and not isinstance(token, bool):
                continue
            if isinstance(token, _NESTED):
                raise ValueError(
                    f"{_subject(what, index)} holds a nested sequence at position {position}; a sample must be a "
                    "flat 1-D list of ids (one list per sample, not a batch of them)."
                )
            raise ValueError(
                f"{_subject(what, index)} holds a non-integer id {token!r} at position {position}; token ids must "
                "be integers (tokenize the text and store the ids as int)."
            )
        values = [int(token) for token in values]
    if min(values) < INT64_MIN or max(values) > INT64_MAX:
        _out_of_int64_range(values, what, index)
    return values


def check_token_ids(ids: Any, index: int, *, field: str = "input_ids", where: str = "") -> list[int]:
    """Validate the ``field`` of sample ``index`` (``where``: e.g. ``" of the train dataset"``) and return it as a
    ``list[int]``. Masks (``completion_mask``, ``assistant_masks``, ``attention_mask``) may be booleans."""
    allow_bool = field.endswith(("mask", "masks"))
    return token_list(ids, index, f"`{field}` of sample {{index}}{where}", allow_bool=allow_bool)


def value_list(value: Any, index: int, what: str = "sample {index}") -> list:
    """A 1-D sequence of any per-token values (a custom token field) as a list; no check of the element type."""
    if type(value) is list:
        return value
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 1:
            raise ValueError(f"{_subject(what, index)} must be 1-D, got shape {tuple(value.shape)}.")
        return value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{_subject(what, index)} must be a list or 1-D tensor, got {type(value).__name__}.")
    return list(value)


def check_seq_lengths(seq_lengths: Any, num_tokens: int, index: int, what: str = "sample {index}") -> list[int]:
    """The ``seq_lengths`` of a row packed ahead of time: positive integers summing to its ``num_tokens`` tokens.

    ``what`` names the row (``"example {index}"``, ``"sample {index} of the stream"``).
    """
    lengths = token_list(seq_lengths, index, f"`seq_lengths` of {what}")
    if sum(lengths) != num_tokens or any(length <= 0 for length in lengths):
        raise ValueError(
            f"{_subject(what, index)} has {num_tokens} tokens but `seq_lengths` {lengths} (sum {sum(lengths)}); the "
            "lengths must be positive and sum to the number of tokens."
        )
    return lengths


def check_lengths(lengths: Any, name: str, *, min_count: int = 1) -> tuple[int, ...]:
    """Sample lengths given as an option (e.g. the self-check's probe ``lengths``): at least ``min_count`` positive
    integers, returned as a tuple; ``ValueError`` naming ``name`` otherwise."""
    values = token_list(as_sequence(lengths, name), 0, f"`{name}`")
    if len(values) < min_count or any(value <= 0 for value in values):
        raise ValueError(f"`{name}` must hold at least {min_count} positive integer length(s), got {values}.")
    return tuple(values)


# --------------------------------------------------------------------------------------------------------------------
# Datasets (the trainer)
# --------------------------------------------------------------------------------------------------------------------


def check_dataset_token_ids(dataset: Any, name: str, fields: Sequence[str] = ("input_ids", "labels")) -> None:
    """Reject a tokenized ``datasets.Dataset`` whose ``fields`` columns do not hold integer ids.

    The column's Arrow type is read (no pass over the data when it is a list of integers); otherwise the first
    sample that holds a bad value is named (``ValueError``). Streamed (``IterableDataset``) data is checked row by
    row where it is consumed, by the collator and the streaming packer.
    """
    import pyarrow as pa

    table = getattr(dataset, "data", None)
    schema = getattr(table, "schema", None)
    if schema is None:
        return
    for field in fields:
        if field not in schema.names:
            continue
        column_type = schema.field(field).type
        value_type = getattr(column_type, "value_type", None)  # list, large_list, fixed_size_list
        if value_type is not None and pa.types.is_integer(value_type):
            continue
        plain = dataset.with_format(None)
        for start in range(0, len(dataset), 1024):
            for index, ids in enumerate(plain[start : start + 1024][field], start=start):
                if isinstance(ids, (str, bytes)) or ids is None or not isinstance(ids, Sequence):
                    raise ValueError(
                        f"`{field}` of sample {index} of the {name} dataset must be a list of integer ids, got "
                        f"{type(ids).__name__} (column type {column_type})."
                    )
                if ids:
                    check_token_ids(ids, index, field=field, where=f" of the {name} dataset")
