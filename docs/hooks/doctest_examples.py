"""A Griffe extension for the API reference (mkdocs.yml): how this site reads the package's docstrings.

- An ``Example:`` section that holds doctest lines (``>>>``) is read as Google style's ``Examples:`` section, so its
  lines render as code and not as one paragraph of markdown.
- A reference in transformers' docstring style, ``[`~unpack_trainer.data.packing.best_fit_decreasing`]`` or
  ``[`TRAINERS`]``, renders as the name in code (``best_fit_decreasing``: the last part after a ``~``), not in brackets.

The package's docstrings keep their wording; only how this site renders them changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_REFERENCE = re.compile(r"\[`(~?)([\w.]+)`\](?![(\[])")


def plain_references(text: str) -> str:
    """``text`` with every ``[`name`]`` / ``[`~a.b.name`]`` reference written as ``name`` in code."""
    return _REFERENCE.sub(lambda m: f"`{m[2].rpartition('.')[2] if m[1] else m[2]}`", text)


def doctest_examples(text: str) -> str:
    """``text`` with every ``Example:`` title whose section holds a ``>>>`` line renamed ``Examples:``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _EXAMPLE.match(line)
        if match is None:
            continue
        indent = len(match.group(1))
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= indent:
                break
            body.append(following)
        if any(entry.lstrip().startswith(">>>") for entry in body):
            lines[i] = f"{match.group(1)}Examples:"
    return "\n".join(lines)


class DoctestExamples(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_references(doctest_examples(obj.docstring.value))
