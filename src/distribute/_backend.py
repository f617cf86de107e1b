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
