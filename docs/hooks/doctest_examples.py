"""A Griffe extension for the API reference (mkdocs.yml): an ``Example:`` section that holds doctest lines (``>>>``)
is read as Google style's ``Examples:`` section, so its lines render as code and not as one paragraph of markdown.

The package's docstrings keep their wording; only how this site parses them changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


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
            obj.docstring.value = doctest_examples(obj.docstring.value)
