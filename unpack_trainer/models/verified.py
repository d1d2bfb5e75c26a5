"""The model types verified on the fast packed path, per transformers release: what the coverage check
(``tools/model_coverage.py``, a developer's tool outside the package) found, kept as data (``verified.json`` beside
this module, shipped with the package) so that the patch and ``unpack-trainer env`` read it without running a check.

:data:`VERIFIED_MODEL_TYPES` is what the run on the newest release of :data:`VERIFIED_WITH` verified, and
:data:`NOT_VERIFIED_ON` what of it was not fast on each older one; ``tests/models/test_coverage.py`` keeps them exact on
the release installed.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "NOT_VERIFIED_ON",
    "VERIFIED_MODEL_TYPES",
    "VERIFIED_VISION_MODEL_TYPES",
    "VERIFIED_VISION_WITH",
    "VERIFIED_WITH",
    "verified_model_types",
    "verified_vision_model_types",
]

_TABLE = json.loads(Path(__file__).with_name("verified.json").read_text())
# The transformers releases the coverage check ran on, oldest first; the coverage test checks the installed one when
# it is among them.
VERIFIED_WITH: tuple[str, ...] = tuple(_TABLE["text"]["verified_with"])
# Fast on the newest release of VERIFIED_WITH.
VERIFIED_MODEL_TYPES: frozenset[str] = frozenset(_TABLE["text"]["fast"])
# On each older release of VERIFIED_WITH, the types of VERIFIED_MODEL_TYPES that were not fast there, and what they
# were ("absent": not in that release's causal-LM mapping; "refused (kind)"). Printed by the same command.
NOT_VERIFIED_ON: dict[str, dict[str, str]] = _TABLE["text"]["not_fast_on"]


def verified_model_types(version: str | None = None) -> frozenset[str]:
    """The model types verified on the fast packed path with transformers ``version`` (default: the installed one):
    :data:`VERIFIED_MODEL_TYPES` less what was not fast on that release (:data:`NOT_VERIFIED_ON`); for a release
    not in :data:`VERIFIED_WITH`, the newest measured set."""
    if version is None:
        import transformers

        version = transformers.__version__
    return VERIFIED_MODEL_TYPES - set(NOT_VERIFIED_ON.get(version, {}))


# Vision-language families whose packed image rows are exact: the VLM section of the coverage check
# (`python tools/model_coverage.py --vision`) on the releases of VERIFIED_VISION_WITH (oldest first);
# tests/models/test_vision.py keeps it exact on the release installed.
VERIFIED_VISION_WITH: tuple[str, ...] = tuple(_TABLE["vision"]["verified_with"])
VERIFIED_VISION_MODEL_TYPES: frozenset[str] = frozenset(_TABLE["vision"]["fast"])


def verified_vision_model_types() -> frozenset[str]:
    """The vision-language model types of :data:`VERIFIED_VISION_MODEL_TYPES` the installed transformers has."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return frozenset(model_type for model_type in VERIFIED_VISION_MODEL_TYPES if model_type in CONFIG_MAPPING)
