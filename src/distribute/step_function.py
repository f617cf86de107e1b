"""``distribute.function``: the substitution for ``tf.function``.

A decorated step is compiled where JAX can make it one program, and is the
function a ``distribute.GradientTape`` inside runs again (``_invocation.py``):

* called with no strategy's scope active and no distributed values among its
  arguments, it is compiled as one program per input signature (the default
  strategy's ``run``: Keras variables it reads and writes are lifted into the
  program, Python numbers are constants, other Python objects static), and
  returns plain arrays;
* called inside a replica function (``strategy.run``'s, a scheduled one, or
  another ``distribute.function``), it is part of that program;
* a cross-replica step (it calls a strategy's ``run`` / ``reduce``, or takes
  distributed values, iterators or datasets) runs as Python: each ``strategy.run`` inside
  is one compiled program, reused for every call (also when the replica
  function is defined inside the step, as TF's multi_worker_with_ctl does), its
  small outputs already summed for the ``reduce`` that follows.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from distribute import _context, _invocation
from distribute.default import default_strategy
from distribute.values import DistributedValues



def function(func: Callable | None = None, input_signature: Sequence | None = None, autograph: bool = True,
             jit_compile: bool | None = None, reduce_retracing: bool = False, experimental_implements: Any = None,
             experimental_autograph_options: Any = None, experimental_attributes: Any = None,
             experimental_relax_shapes: Any = None, experimental_compile: Any = None,
             experimental_follow_type_hints: Any = None) -> Any:
    """Compiles a step function (tf.function's signature; used as ``@distribute.function`` or with arguments).

    Args:
        func: the function (or method) to compile.
        input_signature: a sequence of specs (``distribute.data.TensorSpec`` or
            ``tf.TensorSpec``: ``shape`` with ``None`` for any size, ``dtype``), one
            per positional argument; calls that do not match raise TF's ``TypeError``.
            JAX compiles per concrete shape, so a ``None`` dim still compiles once per size.
        autograph: accepted and ignored: Python control flow runs at trace time
            (a Python ``if`` on an array value needs ``jnp.where`` / ``lax.cond``;
            a Python loop is unrolled).
        jit_compile: accepted; XLA always compiles.
        reduce_retracing, experimental_relax_shapes: accepted; programs are
            compiled per input shape.
        experimental_*: accepted and ignored.

    Returns:
        The compiled function (``python_function`` is the original).

    Raises:
        TypeError: arguments that do not match ``input_signature``.
    """
    if func is None:
        return functools.partial(function, input_signature=input_signature, autograph=autograph,
                                 jit_compile=jit_compile, reduce_retracing=reduce_retracing)
    return Function(func, input_signature)


class Function:
    """A ``distribute.function``-decorated function (TF: ``PolymorphicFunction``)."""

    def __init__(self, func: Callable, input_signature: Sequence | None = None):
        self.python_function = func
        self.input_signature = None if input_signature is None else tuple(input_signature)
        self._cross_replica = False  # it calls a strategy's run/reduce: runs as Python
        functools.update_wrapper(self, func)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        bound = instance.__dict__.get(("distribute.function", id(self)))
        if bound is None:
            bound = Function(self.python_function.__get__(instance, owner), self.input_signature)
            try:
                instance.__dict__[("distribute.function", id(self))] = bound
            except (AttributeError, TypeError):  # pragma: no cover - an instance without a __dict__
                pass
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_signature is not None:
            _check_signature(self.python_function, self.input_signature, args, kwargs)
        if _context.current_replica_context() is not None:
            return _invocation.call(self.python_function, args, kwargs)  # part of the enclosing program
        # Run as Python: a loop a tape inside may not replay (python_loop), unless an engine's own call (a
        # function ClusterCoordinator.schedule traces) already makes this code one step.
        if self._cross_replica or _context.scope_strategy() is not None or _has_distributed(args, kwargs):
            return _invocation.call(self.python_function, args, kwargs, python_loop=_invocation.current() is None)
        try:
            with _context.function_trace():
                return default_strategy().run(self.python_function, args=args, kwargs=kwargs)
        except _context.NeedsCrossReplica:
            self._cross_replica = True
            return _invocation.call(self.python_function, args, kwargs, python_loop=_invocation.current() is None)

    def __repr__(self) -> str:
        return f"<distribute.function {getattr(self.python_function, '__qualname__', self.python_function)!r}>"


def _has_distributed(args: tuple, kwargs: dict) -> bool:
    """Distributed values, iterators or datasets among the arguments: a step of the Python loop kind.

    A compiled program cannot take one element of an iterator per call (TF's graph can):
    a function taking an iterator or a dataset runs as Python, its ``strategy.run`` calls compiled.
    """
    for leaf in jax.tree_util.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, DistributedValues)):
        if isinstance(leaf, DistributedValues) or hasattr(leaf, "__next__"):
            return True
        if hasattr(leaf, "__iter__") and not isinstance(leaf, (jax.Array, np.ndarray, str, bytes)):
            return True
    return False


def _check_signature(func: Callable, signature: tuple, args: tuple, kwargs: dict) -> None:
    """TF's check of a call against ``input_signature``: one compatible array per spec."""
    import inspect

    from distribute.data._spec import TensorSpec, spec_of_value

    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"Binding inputs to distribute.function failed due to `{err}`. Received args: {args!r} "
                        f"and kwargs: {kwargs!r} for signature: {signature!r}.") from err
    values = list(bound.arguments.values())
    if len(values) != len(signature):
        raise TypeError(f"Binding inputs to distribute.function failed: {len(values)} arguments for an "
                        f"input_signature of {len(signature)} specs ({signature!r}).")
    for value, spec in zip(values, signature):
        dtype = getattr(spec.dtype, "as_numpy_dtype", spec.dtype)
        shape = None if spec.shape is None else tuple(getattr(spec.shape, "as_list", lambda: spec.shape)() or ())
        wanted = TensorSpec(shape, dtype)
        if not wanted.is_compatible_with(value):
            raise TypeError(
                f"Binding inputs to distribute.function failed due to `Can not cast {spec_of_value(value)!r} "
                f"to {wanted!r}`: the argument does not match input_signature. Pass an array of a compatible "
                "shape (None: any size) and the same dtype."
            )
