"""A sliding window the decoder applies through its mask only.

Some decoders build a sliding-window mask from ``config.sliding_window`` (``create_sliding_window_causal_mask``) while
their attention modules never hand ``sliding_window`` to the attention function (Phimoe: stock SDPA and eager get the
window from the mask alone). The packed path builds no mask, so the registered attention function hands the window
itself: each attention module's :class:`~unpack_trainer.models.state.AttentionState` carries it.
"""

from __future__ import annotations

from unpack_trainer.anatomy.structure import class_references, mentions
from unpack_trainer.models.fixes.record import Fix, FixSite
from unpack_trainer.models.state import attention_state

__all__ = ["FIX"]


def window_not_passed(site: FixSite) -> int | None:
    """``config.sliding_window`` when the decoder builds a sliding-window mask but its attention modules never pass
    ``sliding_window`` to the attention function; else ``None``."""
    from transformers import masking_utils

    config = site.module.config
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "layer_types", None) is not None:
        return None
    builders = class_references(type(site.module)).values()
    if not any(value is masking_utils.create_sliding_window_causal_mask for value in builders):
        return None
    if any(
        "sliding_window" in class_references(type(m)) or mentions(type(m), "sliding_window")
        for m in site.decoder.attention
    ):
        return None
    return int(window)


def _applies(site: FixSite) -> str | None:
    window = window_not_passed(site)
    if window is None:
        return None
    return f"its decoder applies sliding_window={window} through its mask only, which packed attention does not build"


def _install(site: FixSite) -> None:
    window = window_not_passed(site)
    for module in site.decoder.attention:
        attention_state(module).sliding_window = window


def _remove(site: FixSite) -> None:
    for module in site.module.modules():
        state = attention_state(module)
        if state is not None:
            state.sliding_window = None


FIX = Fix("sliding_window", _applies, _install, _remove)
