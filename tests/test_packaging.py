"""Packaging a cluster user can install: light dependencies, extras, py.typed, one-line CLI errors, logging."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def test_light_install_and_examples_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("[")[0].split("=")[0].split("<")[0] for d in project["dependencies"]]
    assert "scikit-learn" not in names and "matplotlib" not in names
    assert "orbax-checkpoint" in names
    extras = project["optional-dependencies"]
    assert {d.split(">")[0] for d in extras["examples"]} == {"scikit-learn", "matplotlib"}
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("## ", 1)[0]
    commands = [line for line in quick_start.splitlines() if line.startswith("python3 -m venv")]
    assert commands[0] == "python3 -m venv .venv && .venv/bin/pip install '.[examples]' && .venv/bin/python -m distribute train"
    assert len(commands) == 2


def test_py_typed_is_shipped():
    assert (SRC / "distribute" / "py.typed").exists()
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["distribute"] == ["py.typed"]


def test_wrong_keras_backend_is_one_line_and_version():
    done = subprocess.run([sys.executable, "-m", "distribute", "train"], env={**ENV, "KERAS_BACKEND": "torch"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m distribute: error: KERAS_BACKEND='torch', but distribute needs the 'jax' backend. "
        "Unset KERAS_BACKEND or set it to 'jax'."]
    version = subprocess.run([sys.executable, "-m", "distribute", "--version"], env=ENV, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == "jax-distribute 0.1.0"
    # As a library, the same mistake is an exception with the fix.
    lib = subprocess.run([sys.executable, "-c", "import distribute"], env={**ENV, "KERAS_BACKEND": "torch"},
                         capture_output=True, text=True, timeout=60)
    assert lib.returncode == 1 and "RuntimeError: KERAS_BACKEND='torch'" in lib.stderr


def test_library_messages_go_through_logging_not_print():
    """Only the programs (the main job's cli/training and the launcher) print; the library logs to 'distribute'."""
    programs = {"cli.py", "training.py", "training_ps.py", "launch.py", "__main__.py"}  # the main job and the launcher
    offenders = []
    for path in (SRC / "distribute").rglob("*.py"):
        if path.name in programs:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "write" and getattr(node.value, "attr", None) in ("stderr", "stdout"):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    allowed = {"distribute/_backend.py"}  # the command line's one-line error, before logging matters
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []


def test_main_job_without_its_extras_is_one_line(monkeypatch):
    from distribute import training

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(training.JobError, match=r"need scikit-learn.*pip install '\.\[examples\]'"):
        training.load_data(None, 0)
