"""The demo image data: shapes of colours drawn locally with captions, as a conversational image dataset.

Nothing is downloaded or shipped: every image is drawn with Pillow from a seed (a circle, square, triangle or cross of
one of eight colours on a plain background, at a random place and size), and its caption says what is drawn. The
example (``examples/vlm_packing.py``), the benchmark (``benchmarks/bench_vlm.py``) and the offline stand-ins of TRL's
image tests use it. A model that learns it can name the shape and the colour, which a held-out loss measures.

Columns, as TRL's vision datasets have them: ``images`` (a list of ``PIL.Image``, one or more), and ``messages`` (a
user turn asking, an assistant turn answering), or ``prompt`` / ``completion`` with ``prompt_completion=True``.

    >>> from unpack_trainer.data.default_vision_data import load_shapes_dataset
    >>> row = load_shapes_dataset(2, seed=0)[0]
    >>> row["messages"][1]["content"].startswith("A ")
    True
"""

from __future__ import annotations

import math
import random
from typing import Any

__all__ = ["COLOURS", "SHAPES", "draw_shape", "load_shapes_dataset"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 30),
    "purple": (140, 50, 170),
    "orange": (245, 140, 20),
    "black": (10, 10, 10),
    "pink": (240, 130, 180),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (250, 250, 250), "grey": (170, 170, 170)}
QUESTIONS = (
    "What is in the image?",
    "Describe the picture.",
    "What shape do you see, and what colour is it?",
    "Tell me what is drawn here, in a few words, and where it sits in the picture.",
)


def draw_shape(shape: str, colour: str, *, height: int, width: int, seed: int, background: str = "white") -> Any:
    """A ``PIL.Image`` (RGB, ``width`` x ``height``) with one ``shape`` of ``colour`` at a place and size drawn from
    ``seed`` (at least a third of the shorter side)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), BACKGROUNDS[background])
    draw = ImageDraw.Draw(image)
    side = min(height, width)
    size = rng.randint(side // 3, max(side // 3, side - 4))
    left, top = rng.randint(0, width - size), rng.randint(0, height - size)
    box = (left, top, left + size, top + size)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(left + size // 2, top), (left, top + size), (left + size, top + size)], fill=fill)
    elif shape == "cross":
        bar = max(size // 4, 1)
        draw.rectangle((left, top + (size - bar) // 2, left + size, top + (size + bar) // 2), fill=fill)
        draw.rectangle((left + (size - bar) // 2, top, left + (size + bar) // 2, top + size), fill=fill)
    else:
        raise ValueError(f"Unknown shape {shape!r}; draw one of {SHAPES}.")
    return image


_PLACES = ("near the top", "near the bottom", "on the left", "on the right", "in the middle")
_SENTENCES = (
    "The {shape} sits {place} of a picture {width} pixels wide and {height} pixels high.",
    "Its colour is {colour}, a plain fill with no outline.",
    "Nothing else is drawn: the rest of the picture is {background}.",
    "A {shape} like this one is a simple figure, easy to tell from the other shapes of the set.",
    "Seen from afar, the {colour} of the {shape} stands out against the {background} around it.",
    "There is no text, no shadow and no texture in the picture, only the {shape} and its background.",
)


def load_shapes_dataset(
    n: int = 256,
    *,
    seed: int = 0,
    sizes: tuple[int, int] = (56, 224),
    sentences: tuple[float, float] = (1.0, 1.0),
    images_per_example: tuple[int, int] = (1, 1),
    prompt_completion: bool = False,
) -> Any:
    """``n`` examples of drawn shapes with their captions, a ``datasets.Dataset``.

    Args:
        n: examples.
        seed: everything (shapes, colours, sizes, texts) is drawn from it.
        sizes: each image's height and width are drawn from ``[sizes[0], sizes[1]]`` pixels (varied image sizes).
        sentences: ``(median, sigma)`` of the lognormal number of sentences each answer adds to its one-line caption
            (rounded down, at most 24): a chat mix of mostly short answers and a long tail (``(1.0, 1.0)``: half the
            answers are the caption alone, one in ten adds three sentences or more); ``(0, 0)``: the caption alone.
        images_per_example: the least and most images an example has (``(0, 2)``: some examples are text only,
            some have two images, each answered in turn).
        prompt_completion: ``prompt`` / ``completion`` columns (a user turn, an assistant turn) instead of
            ``messages``.

    Returns:
        A ``datasets.Dataset`` with ``images`` (list of ``PIL.Image``) and ``messages`` (or ``prompt`` /
        ``completion``).
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for index in range(n):
        count = rng.randint(*images_per_example)
        images, answers = [], []
        for _ in range(count):
            shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
            background = rng.choice(list(BACKGROUNDS))
            height, width = rng.randint(*sizes), rng.randint(*sizes)
            image_seed = rng.randrange(1 << 30)
            images.append(
                draw_shape(shape, colour, height=height, width=width, seed=image_seed, background=background)
            )
            answer = f"A {colour} {shape} on a {background} background."
            median, sigma = sentences
            extra = min(int(rng.lognormvariate(math.log(median), sigma)), 24) if median > 0 else 0
            fields = dict(shape=shape, colour=colour, background=background, width=width, height=height,
                          place=rng.choice(_PLACES))  # fmt: skip
            answer += "".join(" " + _SENTENCES[k % len(_SENTENCES)].format(**fields) for k in range(extra))
            answers.append(answer)
        question = QUESTIONS[index % len(QUESTIONS)] if count else "Say something about shapes."
        answer = " ".join(answers) if answers else "Circles, squares, triangles and crosses are shapes."
        user = {"role": "user", "content": question}
        assistant = {"role": "assistant", "content": answer}
        if prompt_completion:
            rows.append({"images": images, "prompt": [user], "completion": [assistant]})
        else:
            rows.append({"images": images, "messages": [user, assistant]})
    return Dataset.from_list(rows)
