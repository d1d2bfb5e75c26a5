"""Random RGB images for the vision-language tests: noise pixels, so two images of one size differ unless their seeds
are equal."""

from __future__ import annotations

import numpy as np
from PIL import Image


def random_image(height: int, width: int, seed: int) -> Image.Image:
    """A ``height`` x ``width`` RGB image of uniform noise (uint8) drawn from ``seed``."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))
