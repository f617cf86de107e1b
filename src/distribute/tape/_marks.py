"""The marks a replay leaves in its trace (``_replay.py``): tape events and watched variable reads."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.interpreters import ad, batching, mlir

# -- the two marks -------------------------------------------------------------------------
marker_p = jax_core.Primitive("tape_marker")
marker_p.multiple_results = True
marker_p.def_impl(lambda *args, **params: [])
marker_p.def_abstract_eval(lambda *args, **params: [])
mlir.register_lowering(marker_p, lambda ctx, *args, **params: [])
ad.primitive_jvps[marker_p] = lambda primals, tangents, **params: (marker_p.bind(*primals, **params), [])
batching.primitive_batchers[marker_p] = lambda args, dims, **params: (marker_p.bind(*args, **params), [])

tag_p = jax_core.Primitive("tape_tag")
tag_p.def_impl(lambda x, **params: x)
tag_p.def_abstract_eval(lambda x, **params: x)
mlir.register_lowering(tag_p, lambda ctx, x, **params: [x])
ad.primitive_jvps[tag_p] = lambda primals, tangents, **params: (tag_p.bind(*primals, **params), tangents[0])
batching.primitive_batchers[tag_p] = lambda args, dims, **params: (tag_p.bind(*args, **params), dims[0])


def marker(level: Any, kind: str, ordinal: int, key: int, tensor: Any) -> None:
    """Leaves a mark of a tape event in the replay's trace."""
    operands = [] if tensor is None else [tensor]
    with jax_core.set_current_trace(level.trace):
        marker_p.bind(*operands, kind=kind, tape=ordinal, key=key)


def tag(level: Any, value: Any, key: int, from_snapshot: bool) -> Any:
    """A watched variable's read in a replay: the value, marked as read event ``key``.

    A value the call began with is marked in the replay's own trace, also when
    read inside a nested trace (a Keras RNN reads its kernel inside
    ``lax.scan``), which then closes over it.
    """
    if from_snapshot or not isinstance(value, jax.core.Tracer):
        with jax_core.set_current_trace(level.trace):
            return tag_p.bind(level.prepare(value), key=key)
    return tag_p.bind(level.prepare(value), key=key)


@jax.custom_jvp
def _inject(x: Any, delta: Any) -> Any:
    """``x``, whose tangent also gets ``delta``'s: where a source meets the recorded computation."""
    return x


@_inject.defjvp
def _inject_jvp(primals, tangents):
    (x, _), (tx, td) = primals, tangents
    return x, tx + td


@jax.custom_jvp
def _fresh(x: Any) -> Any:
    """``x`` without its tangent (an unrecorded equation; a variable read is a fresh value, as TF's)."""
    return x


@_fresh.defjvp
def _fresh_jvp(primals, tangents):
    return primals[0], jnp.zeros_like(tangents[0])


