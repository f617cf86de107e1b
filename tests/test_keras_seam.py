"""The Keras seam: every row of the patch table against the installed Keras.

A Keras upgrade that renames, removes or re-signs a patched attribute fails
here, by name, and nowhere else (``_keras.py`` does not refuse another version
at import). The check runs in a fresh process: Keras as installed, then every
group of the table installed, then every Keras attribute scanned for a
replacement that is not in the table.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import inspect, json, sys
    import distribute  # noqa: F401 - sets KERAS_BACKEND
    import keras
    from distribute import _keras
    from distribute.keras_support import patches

    report = {"missing": [], "signature": [], "instance": [], "undeclared": [], "rows": len(patches.TABLE)}

    def original_of(row):
        if isinstance(row.owner, type):
            value = row.owner.__dict__.get(row.attribute, getattr(row.owner, row.attribute, None))
        else:
            value = getattr(row.owner, row.attribute, None)
        return value.fget if isinstance(value, property) else value

    def name(row):
        owner = row.owner
        return f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{row.attribute}"

    # Before anything is installed: Keras' own attributes.
    layer = keras.layers.Dense(1)
    for row in patches.TABLE:
        if row.signature is None:  # an instance attribute Keras sets in __init__
            if row.attribute not in vars(layer):
                report["instance"].append(name(row))
            continue
        original = original_of(row)
        if original is None:
            report["missing"].append(name(row))
            continue
        got = str(inspect.signature(original))
        if got != row.signature:
            report["signature"].append([name(row), row.signature, got])
    patches.install_core(); patches.install_multi_worker(); patches.install_parameter_server()
    installed = set(map(id, _keras.installed()))
    report["not_installed"] = [name(r) for r in patches.TABLE if id(r) not in installed]
    declared = {(id(r.owner), r.attribute) for r in patches.TABLE}
    # Any Keras attribute now defined by this package must be a row of the table.
    owners = {r.owner for r in patches.TABLE if isinstance(r.owner, type)}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("keras.src") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__.startswith("keras"):
                owners.add(value)
            elif callable(value) and getattr(value, "__module__", "").startswith("distribute") and (id(module), attr) not in declared:
                report["undeclared"].append(f"{module_name}.{attr}")
    for owner in owners:
        for attr, value in vars(owner).items():
            target = value.fget if isinstance(value, property) else value
            if getattr(target, "__module__", "") and str(getattr(target, "__module__", "")).startswith("distribute") \\
                    and (id(owner), attr) not in declared:
                report["undeclared"].append(f"{owner.__module__}.{owner.__qualname__}.{attr}")
    print(json.dumps(report))
    """
)


def _report() -> dict:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_row_of_the_patch_table_matches_the_installed_keras():
    report = _report()
    assert report["rows"] >= 40
    assert report["missing"] == [], f"Keras no longer has these patched attributes: {report['missing']}"
    assert report["signature"] == [], f"Keras changed these signatures (row, expected, found): {report['signature']}"
    assert report["instance"] == [], f"Keras layers no longer set these instance attributes: {report['instance']}"
    assert report["not_installed"] == []
    assert report["undeclared"] == [], f"Keras attributes replaced outside the table: {report['undeclared']}"


def test_install_refuses_an_attribute_keras_does_not_have():
    import pytest

    from distribute import _keras

    class Owner:
        pass

    row = _keras.Patch(Owner, "missing", lambda original: original, "(self)", "a test row")
    with pytest.raises(AttributeError, match="has no Owner.missing"):
        _keras.install((row,))
