"""Griffe extension: the reStructuredText habits of the package's docstrings, read as Markdown.

The docstrings are Google style, written to read well in a terminal: ``code`` in double
backticks (Markdown renders it as code too), ``:class:`Name``` roles, and ``text::``
before an indented example. The API pages render them as Markdown, where a role would show
its colons and ``::`` both of its colons; this extension rewrites the two, on the
docstring text only (the source files are untouched).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|obj|exc|data):`~?([^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::$", re.M)  # "an uninterrupted run::" before an indented block


def markdown(text: str) -> str:
    """The docstring with roles as inline code and ``::`` block introductions as ``:``."""
    return _LITERAL.sub(":", _ROLE.sub(r"`\1`", text))


class ReStructuredTextHabits(griffe.Extension):
    """Rewrites each docstring once, when griffe has loaded its object."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
