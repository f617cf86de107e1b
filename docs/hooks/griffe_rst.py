"""Griffe extension: the reStructuredText habits of the package's docstrings, read as Markdown.

The docstrings are Google style, written to read well in a terminal: ``code`` in double
backticks (Markdown renders it as code too), ``:class:`Name``` roles, ``text::``
before an indented example, and parameters described together in one ``Args`` entry
(``a, b: ...``, ``experimental_*: ...``, as TF's docstrings do). The API pages render them
as Markdown, where a role would show its colons and ``::`` both of its colons, and griffe
reads a shared entry as one parameter that is not in the signature; this extension
rewrites the three, on the docstring text only (the source files are untouched): a shared
entry becomes one entry per parameter it names (a ``*`` pattern: the signature's
parameters it matches that no other entry names), each with the shared description.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|obj|exc|data):`~?([^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::$", re.M)  # "an uninterrupted run::" before an indented block


_SECTION = re.compile(r"^(?P<indent>[ \t]*)(?:Args|Arguments|Parameters):[ \t]*$")
_ENTRY = re.compile(r"^(?P<indent>[ \t]+)(?P<names>[\w*]+(?:, [\w*]+)*):(?P<rest>.*)$")


def markdown(text: str) -> str:
    """The docstring with roles as inline code and ``::`` block introductions as ``:``."""
    return _LITERAL.sub(":", _ROLE.sub(r"`\1`", text))


def split_shared_args(text: str, parameters: list[str]) -> str:
    """``Args`` entries that name several parameters (``a, b:``, ``prefix_*:``) as one entry per parameter."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        section = _SECTION.match(lines[i])
        out.append(lines[i])
        i += 1
        if not section:
            continue
        entries: list[tuple[list[str], list[str]]] = []  # (names, the entry's lines)
        entry_indent = None
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(section["indent"])):
            match = _ENTRY.match(lines[i])
            if match and (entry_indent is None or match["indent"] == entry_indent):
                entry_indent = match["indent"]
                entries.append((match["names"].split(", "), [lines[i]]))
            elif entries:
                entries[-1][1].append(lines[i])
            else:
                out.append(lines[i])
            i += 1
        named = {name for names, _ in entries for name in names if "*" not in name}
        for names, body in entries:
            if len(names) == 1 and "*" not in names[0]:
                out.extend(body)
                continue
            expanded = [p for name in names for p in
                        ([q for q in parameters if fnmatch.fnmatchcase(q, name) and q not in named] if "*" in name else [name])]
            rest = _ENTRY.match(body[0])["rest"]
            end = len(body)
            while end > 1 and not body[end - 1].strip():
                end -= 1
            text_lines, trailing = body[1:end], body[end:]  # blank lines after the entry: once, after its copies
            for name in expanded:
                out.append(f"{entry_indent}{name}:{rest}")
                out.extend(text_lines)
            out.extend(trailing)
    return "\n".join(out)


def _parameters(obj: griffe.Object) -> list[str]:
    try:
        return [p.name for p in obj.parameters]  # a function's, or a class's __init__'s
    except (AttributeError, TypeError):
        return []


class ReStructuredTextHabits(griffe.Extension):
    """Rewrites each docstring once, when griffe has loaded its object."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_shared_args(markdown(obj.docstring.value), _parameters(obj))
