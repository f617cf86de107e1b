"""The engine's one seam for ``distribute.GradientTape``: each call of a user's replica function.

A tape cannot record JAX operations as TensorFlow's does; it computes
``tape.gradient`` by running the enclosing function again, as a JAX trace, up to
that call (``distribute/tape``).  To do that it needs the function, its
arguments and the variables' values when the call began.  Every engine that
calls a user's function (``strategy.run``'s SPMD and uneven steps, a
``ClusterCoordinator``'s scheduled function, ``distribute.function``) calls it
through :func:`call`; nothing else here is used by the engine.

``LiftingScope`` (``lifting.py``) passes each variable read through
:func:`on_read`, which changes nothing unless a tape is recording.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import dataclasses
from typing import Any, Callable

import jax
from jax.extend import core as jax_core
import numpy as np

from distribute._keras import get_stateless_scope


@dataclasses.dataclass(eq=False)
class Invocation:
    """One call of a user's function by the engine: what a tape needs to run it again.

    ``args`` / ``kwargs`` are copies of the arguments' structures made before the
    call ran (see :func:`copy_structure`): what the function changes in its own
    arguments is not seen by a run again.  ``scope`` is the Keras stateless scope
    the call began in (None: none) and ``snapshot`` a copy of its variable values then; ``trace`` is the JAX trace
    the function's own code runs in (the program being traced, or eager).
    ``tape_level`` belongs to ``distribute.tape`` (its record of this call's tapes).
    """

    fn: Callable
    args: tuple
    kwargs: dict
    scope: Any
    snapshot: dict
    trace: Any
    tape_level: Any = None
    python_loop: bool = False  # a distribute.function run as Python (a loop over a dataset, in cross-replica context)

    def arguments(self, leaf: Callable[[Any], Any]) -> tuple[tuple, dict]:
        """Fresh copies of the arguments as the call received them, each leaf passed through ``leaf``."""
        return copy_structure(self.args, leaf), copy_structure(self.kwargs, leaf)


_CURRENT: contextvars.ContextVar[Invocation | None] = contextvars.ContextVar("distribute_invocation", default=None)
_READ_HOOK: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("distribute_read_hook", default=None)


def call(fn: Callable, args: tuple = (), kwargs: dict | None = None, python_loop: bool = False) -> Any:
    """Calls ``fn(*args, **kwargs)`` as one invocation that a ``GradientTape`` inside may run again.

    The engine calls every user replica function (and scheduled or
    ``distribute.function`` function) through this, inside the scope that lifts
    its variables. ``python_loop``: ``fn`` is a ``distribute.function`` run as Python,
    not traced (it iterates a dataset, or runs in cross-replica context).
    """
    kwargs = dict(kwargs or {})
    scope = get_stateless_scope()
    snapshot = dict(getattr(scope, "state_mapping", None) or {})
    with jax_core.take_current_trace() as trace:
        pass
    # Before fn runs: a tape runs fn again from these (a python_loop call is never run again).
    saved = (tuple(args), kwargs) if python_loop else (copy_structure(tuple(args)), copy_structure(kwargs))
    invocation = Invocation(fn, *saved, scope, snapshot, trace, python_loop=python_loop)
    token = _CURRENT.set(invocation)
    hook_token = _READ_HOOK.set(_READ_HOOK.get())  # an enclosing call's recording tape sees these reads too
    try:
        return fn(*args, **kwargs)
    finally:
        _READ_HOOK.reset(hook_token)
        _CURRENT.reset(token)


_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


def copy_structure(x: Any, leaf: Callable[[Any], Any] = lambda v: v, memo: dict | None = None) -> Any:
    """A copy of ``x``'s containers, at every depth, with ``leaf(v)`` for each leaf ``v``.

    Containers: dicts (also ``OrderedDict``, ``defaultdict``; key order kept), lists,
    tuples and namedtuples, sets, and nodes registered with ``jax.tree_util`` (a
    registered dataclass).  A writable numpy array is copied (it can change in
    place).  Every other object (JAX arrays, Keras variables, models, iterators,
    objects of the user's classes) is a leaf, the same object.  A container that
    appears twice is copied once (``memo``, as ``copy.deepcopy``'s), so aliasing is kept.
    """
    memo = {} if memo is None else memo
    if id(x) in memo:
        return memo[id(x)][1]
    kind = type(x)
    if kind in _DICTS:
        new = copy.copy(x)  # keeps the type and a defaultdict's factory
        memo[id(x)] = (x, new)
        for key, value in x.items():
            new[key] = copy_structure(value, leaf, memo)
        return new
    if kind is list:
        new = []
        memo[id(x)] = (x, new)
        new.extend(copy_structure(v, leaf, memo) for v in x)
        return new
    if kind is tuple:
        return tuple(copy_structure(v, leaf, memo) for v in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return kind(*(copy_structure(v, leaf, memo) for v in x))
    if kind in (set, frozenset):
        return kind(x)  # set members are hashable, so not arrays
    if kind is np.ndarray and x.flags.writeable:
        new = leaf(x.copy())
        memo[id(x)] = (x, new)
        return new
    if x is None or isinstance(x, (jax.Array, jax.core.Tracer, str, bytes, int, float, complex, bool)):
        return leaf(x)
    children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)  # one level down
    if jax.tree_util.treedef_is_leaf(treedef):
        return leaf(x)
    return jax.tree_util.tree_unflatten(treedef, [copy_structure(c, leaf, memo) for c in children])


def current() -> Invocation | None:
    """The innermost invocation running now (None outside every engine call)."""
    return _CURRENT.get()


def set_read_hook(hook: Callable | None) -> contextvars.Token:
    """Makes ``hook(scope, variable, value) -> value`` see every variable read (the tape's recording)."""
    return _READ_HOOK.set(hook)


def reset_read_hook(token: contextvars.Token) -> None:
    _READ_HOOK.reset(token)


def on_read(scope: Any, variable: Any, value: Any) -> Any:
    """A variable read in a lifting scope: unchanged unless a tape records (then maybe tagged)."""
    hook = _READ_HOOK.get()
    return value if hook is None else hook(scope, variable, value)
