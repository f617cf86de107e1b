"""What a ps needs to make a variable's value itself: a Keras initializer described as plain data.

A large variable created in a ParameterServerStrategy's scope is made on its ps
(``parameter_server/initializers.py`` makes it), never on the coordinator: the
coordinator sends :func:`describe`'s answer, a tuple of numbers, and each ps
makes its own shards.  Described here: ``Zeros``, ``Ones``, ``Constant`` of a
scalar, ``RandomUniform``, ``RandomNormal``, ``TruncatedNormal`` and
``VarianceScaling`` with its subclasses (``GlorotUniform``, ``HeNormal``,
``LecunUniform``, ...).  The random ones draw their key on the coordinator
exactly as Keras would (``draw_seed(initializer.seed)``: an int seed gives
``[seed, 0]``; a ``SeedGenerator`` advances once), and ``VarianceScaling``'s
scale comes from the full shape, so a variable of one shard gets the value one
device gives.  Anything else (``Orthogonal``, ``Identity``, a user's callable)
is not described: the coordinator makes the value and sends it in pieces.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from distribute._keras import compute_fans, draw_seed

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def describe(initializer: Any, shape: tuple, dtype: str) -> tuple | None:
    """``("fill", value)``, ``("uniform", key, minval, maxval)``, ``("normal", key, mean, stddev)``,
    ``("truncated_normal", key, mean, stddev)``, or None (not described: made on the coordinator)."""
    init = keras.initializers
    kind = type(initializer)
    if kind is init.Zeros:
        return ("fill", 0)
    if kind is init.Ones:
        return ("fill", 1)
    if kind is init.Constant and np.ndim(initializer.value) == 0:
        return ("fill", float(initializer.value))
    if dtype not in _FLOATS:
        return None
    if kind is init.RandomUniform:
        return ("uniform", _key(initializer), float(initializer.minval), float(initializer.maxval))
    if kind is init.RandomNormal:
        return ("normal", _key(initializer), float(initializer.mean), float(initializer.stddev))
    if kind is init.TruncatedNormal:
        return ("truncated_normal", _key(initializer), float(initializer.mean), float(initializer.stddev))
    if isinstance(initializer, init.VarianceScaling) and kind.__call__ is init.VarianceScaling.__call__:
        return _variance_scaling(initializer, shape)
    return None


def _key(initializer: Any) -> np.ndarray:
    return np.asarray(draw_seed(initializer.seed)).astype(np.uint32)


def _variance_scaling(initializer: Any, shape: tuple) -> tuple:
    """Keras' ``VarianceScaling.__call__`` for the full ``shape``, as the distribution it then draws from."""
    scale = initializer.scale
    fan_in, fan_out = compute_fans(shape, input_axes=initializer.input_axes, output_axes=initializer.output_axes)
    if initializer.mode == "fan_in":
        scale /= max(1.0, fan_in)
    elif initializer.mode == "fan_out":
        scale /= max(1.0, fan_out)
    else:
        scale /= max(1.0, (fan_in + fan_out) / 2.0)
    key = _key(initializer)
    if initializer.distribution == "truncated_normal":
        return ("truncated_normal", key, 0.0, math.sqrt(scale) / 0.87962566103423978)
    if initializer.distribution == "untruncated_normal":
        return ("normal", key, 0.0, math.sqrt(scale))
    limit = math.sqrt(3.0 * scale)
    return ("uniform", key, -limit, limit)
