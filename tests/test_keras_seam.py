"""The Keras seam: every patched Keras attribute still exists in the installed Keras."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import inspect
    import distribute
    from distribute import _keras
    from distribute.keras_support import hooks, ps_hooks, saving

    distribute.MirroredStrategy(["/cpu:0"])
    hooks.install(); ps_hooks.install(); saving.install()
    names = []
    for owner, name in _keras.PATCHED:
        value = owner.__dict__.get(name)
        if isinstance(value, property) or not callable(value):
            original = None
        else:
            original = inspect.unwrap(value)
        if inspect.ismodule(owner):  # a backend function (keras_support/rnn.py)
            names.append(f"{owner.__name__}.{name}")
        else:
            names.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
        if original is not None and original is not value:
            assert original.__module__.startswith("keras."), (name, original.__module__)
    print(len(names))
    """
)


def test_every_patched_attribute_wraps_keras_own():
    env_check = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert env_check.returncode == 0, env_check.stderr[-3000:]
    assert int(env_check.stdout.strip().splitlines()[-1]) >= 20


def test_patch_refuses_an_attribute_keras_does_not_have():
    import pytest

    from distribute import _keras

    class Owner:
        pass

    with pytest.raises(AttributeError, match="has no Owner.missing"):
        _keras.patch(Owner, "missing", lambda original: original)
