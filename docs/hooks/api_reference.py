"""mkdocs hook: the API reference pages, generated from the package's public names.

A page under ``docs/api/`` holds one marker line, ``<!-- api: distribute.data -->``. At build
time this hook imports that module, reads its ``__all__`` (the public names, the same list
``dir()`` gives) and replaces the marker with one mkdocstrings block per name, pointing at the
object's real location (``obj.__module__``), so a module moved inside the package, a name
added or a name removed changes the page with no edit here. A name already documented on an
earlier page (``distribute.experimental.MultiWorkerMirroredStrategy`` is
``distribute.MultiWorkerMirroredStrategy``) becomes a link to it, so every object has one
anchor. The same function feeds ``tests/test_docs.py``, which checks that every public name
is on its page with a docstring.

Also: ``<!-- layers -->`` (architecture page) becomes the import-linter layers contract of
``pyproject.toml``, and ``<!-- execution-interface -->`` the table of the methods a strategy
implements, each with the first line of its docstring.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import sys
import tomllib
import types
from dataclasses import dataclass
from functools import cache

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The API pages, in nav order: a name documented on an earlier page is linked from later ones.
API_PAGES = {
    "distribute": "api/distribute.md",
    "distribute.experimental": "api/experimental.md",
    "distribute.coordinator": "api/coordinator.md",
    "distribute.cluster_resolver": "api/cluster_resolver.md",
    "distribute.data": "api/data.md",
    "distribute.checkpoint": "api/checkpoint.md",
}
MARKER = re.compile(r"^<!-- api: ([\w.]+) -->$", re.M)


@dataclass(frozen=True)
class Entry:
    """One public name of one module, as its API page shows it."""

    public: str          # distribute.data.Dataset
    kind: str            # "class", "function", "constant" or "module"
    target: str | None   # the object mkdocstrings renders here; None: a link to `link` instead
    link: str | None     # "api/data.md#distribute.data.dataset.Dataset": where it is documented
    doc: str             # the first paragraph of its docstring ("" for a constant: griffe reads its own)


def _import(name: str) -> types.ModuleType:
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("KERAS_BACKEND", "jax")
    return importlib.import_module(name)


def summary(obj: object) -> str:
    """The first paragraph of an object's docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def _names(module: types.ModuleType) -> list[str]:
    # classes and constants first, then functions and submodules; each group alphabetical
    return sorted(module.__all__, key=lambda n: (n[0].islower(), n.lower()))


def _public_objects() -> list[tuple[str, str, object, str]]:
    """(page, public name, object, static path) for every public name, in page order."""
    rows = []
    page_modules = {id(_import(m)): m for m in API_PAGES}
    for module_name, page in API_PAGES.items():
        module = _import(module_name)
        for name in _names(module):
            obj, public = getattr(module, name), f"{module_name}.{name}"
            rows.append((page, public, obj, public))
            if isinstance(obj, types.ModuleType) and id(obj) not in page_modules:
                # a submodule without a page of its own (distribute.data.experimental): its names go here
                rows += [(page, f"{public}.{sub}", getattr(obj, sub), f"{obj.__name__}.{sub}") for sub in _names(obj)]
    return rows


@cache
def entries() -> dict[str, list[Entry]]:
    """Every API page's entries, in page order. Each class or function is rendered once, under the
    first public name spelled as the object itself (``CommunicationImplementation``, not its alias
    ``CollectiveCommunication``); its other public names link there."""
    rows = _public_objects()
    home: dict[int, tuple[str, str]] = {}  # id(obj) -> (page, public name) where it is rendered
    for page, public, obj, _ in rows:
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if id(obj) not in home or (public.rsplit(".", 1)[1] == obj.__name__
                                       and home[id(obj)][1].rsplit(".", 1)[1] != obj.__name__):
                home[id(obj)] = (page, public)
    page_of_module = {id(_import(m)): API_PAGES[m] for m in API_PAGES}
    pages: dict[str, list[Entry]] = {page: [] for page in API_PAGES.values()}
    for page, public, obj, static_path in rows:
        if isinstance(obj, types.ModuleType):
            own = page_of_module.get(id(obj))
            pages[page].append(Entry(public, "module", None, own, summary(obj)))
        elif inspect.isclass(obj) or inspect.isfunction(obj):
            kind, target = ("class" if inspect.isclass(obj) else "function"), f"{obj.__module__}.{obj.__qualname__}"
            home_page, home_public = home[id(obj)]
            if home_public == public:
                pages[page].append(Entry(public, kind, target, None, summary(obj)))
            else:
                pages[page].append(Entry(public, kind, None, f"{home_page}#{target}", summary(obj)))
        else:  # a constant: griffe follows the module's static import to the documented assignment
            pages[page].append(Entry(public, "constant", static_path, None, ""))
    return pages


def _relative(link: str, page: str) -> str:
    path, _, fragment = link.partition("#")
    relative = os.path.relpath(path, os.path.dirname(page)) if path != page else ""
    return relative + (f"#{fragment}" if fragment else "")


def render(module_name: str) -> str:
    """The markdown that replaces ``<!-- api: module_name -->``."""
    page = API_PAGES[module_name]
    out = []
    for entry in entries()[page]:
        short = entry.public.rsplit(".", 1)[1]
        if entry.target is not None:
            out.append(f"::: {entry.target}\n    options:\n      heading: \"{entry.public}\"\n"
                       f"      toc_label: \"{short}\"\n      show_if_no_docstring: true\n")
        elif entry.kind == "module" and entry.link is None:  # its names follow on this page
            out.append(f"## `{entry.public}`\n\n{entry.doc}\n")
        else:
            what = "The module" if entry.kind == "module" else "The same object as"
            link = _relative(entry.link, page) or "#"
            out.append(f"## `{entry.public}`\n\n{what} [`{_shown(entry)}`]({link}). {entry.doc}\n")
    return "\n".join(out)


def _shown(entry: Entry) -> str:
    """The public name a link goes to (``distribute.MirroredStrategy``, not its file path)."""
    path, _, fragment = entry.link.partition("#")
    if entry.kind == "module":
        return next(m for m, p in API_PAGES.items() if p == path)
    return next(e.public for e in entries()[path] if e.target == fragment)


def layers() -> str:
    """The import-linter layers contract, top layer first, as a numbered list (then its exceptions, if any)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    lines = []
    for i, layer in enumerate(contract["layers"], 1):
        modules = [m.strip() for m in layer.split("|")]
        lines.append(f"{i}. " + ", ".join(f"`{m}`" for m in modules))
    exceptions = contract.get("ignore_imports", [])
    if exceptions:
        lines.append("\nImports allowed against the layers, by name: " + ", ".join(f"`{e}`" for e in exceptions) + ".")
    return "\n".join(lines)


# The execution interface (architecture page): the abstract members of these public classes.
EXECUTION_INTERFACE = ("Strategy", "StrategyExtended")


def interface_members(cls: type) -> list[str]:
    """The abstract members of ``cls``, in the order the class defines them."""
    abstract = set(getattr(cls, "__abstractmethods__", ()))
    ordered = [name for klass in reversed(cls.__mro__) for name in vars(klass) if name in abstract]
    return list(dict.fromkeys(ordered))


def execution_interface() -> str:
    """A table of the execution interface's members and the first sentence of each docstring."""
    rows = ["| member | what it does |", "| --- | --- |"]
    for name in EXECUTION_INTERFACE:
        owner = getattr(_import("distribute"), name)
        anchor = f"{owner.__module__}.{owner.__qualname__}"
        for member in interface_members(owner):
            doc = summary(getattr(owner, member)).split(". ")[0].rstrip(".")
            rows.append(f"| [`{name}.{member}`](api/distribute.md#{anchor}.{member}) | {doc} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - the mkdocs hook signature
    markdown = MARKER.sub(lambda m: render(m.group(1)), markdown)
    markdown = markdown.replace("<!-- layers -->", layers())
    return markdown.replace("<!-- execution-interface -->", execution_interface())
