"""LoRA's input casts under autocast, skipped where they are exact round trips.

PEFT keeps LoRA adapters in float32 by default (``get_peft_model(autocast_adapter_dtype=True)``), and every LoRA
linear layer casts its input to the adapter's dtype before ``lora_A``: on a bf16 model trained with ``bf16=True``
(TRL's default on a GPU) that is a bf16 -> float32 copy of the layer's input, which autocast then casts straight back
to bf16 for ``lora_A``'s matmul -- two passes over an activation-sized tensor per LoRA layer and call (the forward, the
forward recomputed under activation checkpointing, and their casts' backward), for no numerical effect: a bf16 or fp16
tensor is exact in float32, so ``autocast(x.float()) == autocast(x)`` bit for bit, and their gradients too.

[`lora_input_casts_skipped`] turns the cast off (PEFT's own switch, ``cast_input_dtype_enabled``, the one
``peft.helpers.disable_input_dtype_casting`` sets) for one call of a layer exactly when that holds: autocast is on
for the input's device and the input is bf16, fp16 or float32 (float64 would round twice). The layers it touches
([`plain_lora_layers`]) are vanilla LoRA linear layers (no DoRA or other variant) with no dropout (dropout on a float32
and on a bf16 input may draw and round differently). Outside the context, and for a call without autocast inside it,
PEFT runs as it always does. The trainers enter it around each training step; those that generate inside their step
(GRPO, RLOO) pause it while they generate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from unpack_trainer import _compat

__all__ = ["LoraInputCastSkip", "lora_input_casts_skipped", "plain_lora_layers"]

# Input dtypes whose round trip through float32 is exact.
EXACT_IN_FLOAT32 = (torch.bfloat16, torch.float16, torch.float32)


def plain_lora_layers(model: nn.Module) -> list[nn.Module]:
    """The LoRA linear layers of ``model`` whose input cast [`lora_input_casts_skipped`] may skip: every active adapter
    vanilla LoRA (no variant) without dropout. Empty without PEFT or LoRA."""
    return _compat.plain_lora_linear_layers(model)


def _autocast_covers(x: object) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.dtype in EXACT_IN_FLOAT32
        and torch.is_autocast_enabled(x.device.type)
    )


class LoraInputCastSkip:
    """The skip over ``layers`` as a reusable context manager (what [`lora_input_casts_skipped`] returns): entering
    hooks each layer, leaving removes the hooks and restores every layer's switch, and [`paused`] runs PEFT's own
    path inside the context (no hook of ours on any layer)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self._saved: list[bool] | None = None  # the switches as the context found them, while hooked
        self._handles: list = []

    def _hook(self) -> None:
        self._saved = [layer.cast_input_dtype_enabled for layer in self.layers]

        def skip_when_exact(enabled: bool):  # a user's own switch (off) stays off
            def before_call(module: nn.Module, args: tuple) -> None:
                module.cast_input_dtype_enabled = enabled and not (args and _autocast_covers(args[0]))

            return before_call

        pairs = zip(self.layers, self._saved)
        self._handles = [layer.register_forward_pre_hook(skip_when_exact(on)) for layer, on in pairs]

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        for layer, value in zip(self.layers, self._saved or ()):
            layer.cast_input_dtype_enabled = value
        self._handles, self._saved = [], None

    def __enter__(self) -> LoraInputCastSkip:
        if self.layers:
            self._hook()
        return self

    def __exit__(self, *exc: object) -> None:
        self._unhook()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """PEFT's own path for the calls inside (the trainers' generation: a hook per LoRA layer and decoded token,
        and hooks that come and go would make a compiled decode step recompile); hooked again after."""
        if self._saved is None:
            yield
            return
        self._unhook()
        try:
            yield
        finally:
            self._hook()


def lora_input_casts_skipped(layers: Sequence[nn.Module]) -> LoraInputCastSkip:
    """A context manager within which each of ``layers`` (from [`plain_lora_layers`]) skips its input cast on a call
    that runs under autocast with a bf16 / fp16 / float32 input, and casts as PEFT does otherwise; on exit every
    layer's switch is as it was and no hook is left. ``with skip.paused():`` inside it runs PEFT's own path."""
    return LoraInputCastSkip(layers)
