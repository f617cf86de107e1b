"""Keras backend selection: the one place that reads KERAS_BACKEND."""

from __future__ import annotations

import os
import sys


def require_jax_backend() -> None:
    """Makes Keras use JAX, or explains why it cannot.

    Sets ``KERAS_BACKEND=jax`` when Keras is not loaded yet.

    Raises:
        RuntimeError: Keras is already loaded with another backend, or
            ``KERAS_BACKEND`` names another backend.
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        backend = keras.backend.backend()
        if backend != "jax":
            raise RuntimeError(
                f"Keras is already loaded with the {backend!r} backend; distribute needs the "
                "'jax' backend. Set KERAS_BACKEND=jax before anything imports keras "
                "(e.g. `export KERAS_BACKEND=jax`, or `os.environ['KERAS_BACKEND'] = 'jax'` "
                "at the top of your script), or import distribute before keras."
            )
        return
    requested = os.environ.get("KERAS_BACKEND")
    if requested and requested != "jax":
        raise RuntimeError(
            f"KERAS_BACKEND={requested!r}, but distribute needs the 'jax' backend. "
            "Unset KERAS_BACKEND or set it to 'jax'."
        )
    os.environ["KERAS_BACKEND"] = "jax"


def _started_as_command() -> bool:
    """Whether this process is ``python -m distribute ...`` or the ``jax-distribute`` script, still starting.

    While ``python -m`` imports the package of the module it runs, ``sys.argv[0]`` is ``"-m"``.
    """
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or os.path.basename(first) == "jax-distribute"


def require_jax_backend_at_import() -> None:
    """``require_jax_backend()``; for the command line, its error is one line on stderr and exit status 2."""
    try:
        require_jax_backend()
    except RuntimeError as err:
        if not _started_as_command():
            raise
        sys.stderr.write(f"python -m distribute: error: {err}\n")
        raise SystemExit(2) from None
