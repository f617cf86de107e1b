"""A ps makes its shards of a variable from an initializer's description (``keras_support/ps_init.py``).

The rule for random initializers (documented in docs/tf_compat.md): a variable
stored as one shard gets exactly the value Keras gives on one device (the same
key, shape and JAX calls); the shard of rows ``[start, stop)`` of a partitioned
variable is drawn on its own, at its own shape, with the key
``jax.random.fold_in(key, start)`` (TF's partitioned variables likewise draw
each shard on its own, with the partition's offset as nonce), from the
distribution the full shape sets (``VarianceScaling``'s fans are the full
shape's, as TF's).  So the value depends on the seed and on the shard layout,
never on which ps holds a shard or when it is made.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def make(spec: tuple, shape: tuple, dtype: str, start: int | None) -> np.ndarray:
    """The value of one shard: ``shape`` (the shard's), rows from ``start`` (None: the whole variable)."""
    kind = spec[0]
    if kind == "fill":
        return np.full(shape, spec[1], dtype=np.dtype(dtype))
    import jax
    import jax.numpy as jnp

    key = jnp.asarray(spec[1], dtype=jnp.uint32)
    if start is not None:
        key = jax.random.fold_in(key, start)
    if kind == "uniform":
        value = jax.random.uniform(key, shape=shape, dtype=dtype, minval=spec[2], maxval=spec[3])
    elif kind == "normal":
        value = jax.random.normal(key, shape=shape, dtype=dtype) * spec[3] + spec[2]
    elif kind == "truncated_normal":
        value = jax.random.truncated_normal(key, shape=shape, lower=-2.0, upper=2.0, dtype=dtype) * spec[3] + spec[2]
    else:
        raise ValueError(f"unknown initializer description {kind!r}")
    return np.asarray(value)


def shard_specs(spec: Any, shards: tuple, full_shape: tuple, dtype: str) -> dict[int, dict]:
    """``{ps: {key: (spec, shard shape, dtype, start)}}``: what each ps makes of one variable."""
    out: dict[int, dict] = {}
    for s in shards:
        shape = full_shape if s.start is None else (s.stop - s.start, *full_shape[1:])
        out.setdefault(s.ps, {})[s.key] = (spec, tuple(shape), dtype, s.start)
    return out
