"""Lifting Keras variables into programs, and classifying a replica function's inputs and outputs.

``LiftingScope`` is a Keras ``StatelessScope`` whose variable values are traced
program inputs; it records what the function reads (``missing``) and assigns
(``written``).  The input kinds (``SHARDED`` per-replica, ``REPLICATED``,
``STATIC`` Python values) and output kinds (``ARRAY_OUT``, ``SUMMED_OUT`` small
numbers also summed in the step, ``STATIC_OUT`` Python constants) are shared by
the SPMD step (``tracing.py``) and the uneven step (``uneven_step.py``).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context, _invocation, ownership
from distribute.placement import Placement
from distribute._keras import KerasVariable, StatelessScope
from distribute.values import DistributedValues, Mirrored


SHARDED, REPLICATED, STATIC = 0, 1, 2
ARRAY_OUT, SUMMED_OUT, STATIC_OUT = 0, 1, 2
FUSED_REDUCE_MAX_SIZE = 64  # elements per replica; bigger outputs are reduced on demand


class LiftingScope(StatelessScope):
    """A StatelessScope whose variable values are traced program inputs.

    Reads of variables it does not map are recorded in ``missing`` (and answered
    by the parent scope, if any); assignments are recorded in ``written``.

    With ``placeholders`` (a discovery trace inside the SPMD program, whose results
    are thrown away once ``missing`` is known), an unmapped variable reads as zeros of
    its shape and dtype instead of its concrete array: that array is sharded on the
    strategy's (automatic) mesh, and some ops refuse it inside ``shard_map``'s
    manual context (indexing a GRU's bias: "Context mesh ... should match the mesh
    of sharding ...").
    """

    def __init__(self, mapping: dict[int, Any], parent: "LiftingScope | None" = None, device: Any = None,
                 placeholders: bool = False):
        # StatelessScope.__init__ converts values eagerly; ours are tracers already.
        self.collect_losses = False
        self.initialize_variables = False
        self.losses: list = []
        self.state_mapping = dict(mapping)
        self.parent = parent
        self.missing: dict[int, KerasVariable] = {}
        self.written: dict[int, KerasVariable] = {}
        self.device = device  # an uneven step's replica device: unmapped variables read their copy there
        self.plain: set[int] = set()  # variables whose last write was a plain assign (not assign_add/sub)
        self.additive_depth = 0  # > 0 inside assign_add / assign_sub
        self.placeholders = placeholders
        self.updates: set[int] = set()  # variables an optimizer updated (TF: extended.update, cross-replica)
        self.update_depth = 0  # > 0 inside an optimizer's apply
        self.observe_reads = True  # reads pass through _invocation.on_read (a GradientTape's recording)
        self.created: list = []  # (variable, InitialValue) of variables this trace created (creation.py)
        self.creates = False  # True in strategy.run's program trace: the one that can create variables
        self.unvalued: dict[int, KerasVariable] = {}  # variables read as zeros: they had no value yet

    def add_update(self, update: tuple) -> None:
        variable, value = update
        if not self.update_depth and _sums_replica_writes(variable):
            value = self._summed_write(variable, value)
        self.state_mapping[id(variable)] = value
        self.written[id(variable)] = variable
        if self.update_depth or _sums_replica_writes(variable):
            self.updates.add(id(variable))  # identical on every replica already: combined as is
        if self.additive_depth:
            self.plain.discard(id(variable))
        else:
            self.plain.add(id(variable))

    def _summed_write(self, variable: KerasVariable, value: Any) -> Any:
        """A replica's write of a ``sum`` MirroredVariable, summed over the replicas at once (TF's merge_call).

        TF's ``MirroredVariable`` with ``aggregation=SUM`` reduces a write in
        replica context when it happens: ``assign(x)`` stores the sum of every
        replica's ``x``; ``assign_add(d)`` adds the sum of every replica's ``d``.
        Every replica then reads that value in the rest of the step (a hand
        accumulator read by ``apply_gradients`` in the same ``run``).
        """
        context = _context.current_replica_context()
        if context is None or not context._in_program:
            return value
        if not self.additive_depth:
            return context.all_reduce("sum", value)
        # Keras' assign_add(d) is assign(read + d): the delta is what this replica added to its read.
        observe, self.observe_reads = self.observe_reads, False
        try:
            previous = self.get_current_value(variable)
        finally:
            self.observe_reads = observe
        previous = jnp.asarray(previous, dtype=variable.dtype)
        return previous + context.all_reduce("sum", jnp.asarray(value, dtype=variable.dtype) - previous)

    def get_current_value(self, variable: KerasVariable) -> Any:
        value = self.state_mapping.get(id(variable))
        if value is None and self.parent is not None:
            value = self.parent.get_current_value(variable)
            if value is not None:
                return value  # the parent passed it to on_read
        if value is None and self.device is not None and variable._value is not None:
            value = self.state_mapping[id(variable)] = local_value(variable, self.device)
        if value is None:
            self.missing[id(variable)] = variable
            if self.placeholders and variable._value is not None:
                value = placeholder(variable)
            if value is None and (self.placeholders or variable._value is None):
                # A variable created by this very trace (a model built lazily by its first step) whose
                # value Keras defers: zeros of its shape, never None, which Keras' own reads (a
                # regularizer of ``model.losses``) cannot take.
                self.unvalued[id(variable)] = variable
                value = np.zeros(variable.shape, variable.dtype)
        if value is not None and self.observe_reads:
            value = _invocation.on_read(self, variable, value)
        return value


def placeholder(variable: KerasVariable) -> np.ndarray | None:
    """A variable's value in a discovery trace: a host copy of its first local replica's copy.

    A host constant (numpy), so also inside ``shard_map``'s manual context and a nested trace
    (lax.scan), where its sharded array is refused; its real value, so a variable that the trace
    creates from it (``keras.Variable(other * 2)`` inside ``run``, ``creation.py``) gets the right
    initial value. None when this worker cannot read the whole value (split over several workers).
    """
    placement = variable.__dict__.get("_distribute_placement")
    mesh = getattr(placement, "replica_mesh", None)
    stored = variable._value
    if isinstance(stored, jax.core.Tracer) or (isinstance(stored, jax.Array) and not stored.is_fully_addressable):
        return None
    with jax.ensure_compile_time_eval():  # concrete arrays, read outside the trace
        return np.asarray(stored if mesh is None else placement.local_value(variable, mesh.local_devices[0]))


def _sums_replica_writes(variable: Any) -> bool:
    """Whether a replica's write of ``variable`` is summed over the replicas when it happens (``Placement``)."""
    placement = variable.__dict__.get("_distribute_placement")
    return placement is not None and placement.sums_replica_writes(variable)


def classify_outputs(out_leaves: list) -> tuple[list, list, list]:
    """Python constants pass through (TF's regroup returns them as they are); arrays become PerReplica."""
    kinds, statics, arrays = [], [], []
    for x in out_leaves:
        if is_python_constant(x):
            kinds.append(STATIC_OUT)
            statics.append(x)
            continue
        x = as_output(x)
        small = x.size <= FUSED_REDUCE_MAX_SIZE and jnp.issubdtype(x.dtype, jnp.number)
        kinds.append(SUMMED_OUT if small else ARRAY_OUT)
        statics.append(None)
        arrays.append(x)
    return kinds, statics, arrays


def is_python_constant(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex, str, bytes, type(None)))


def dynamic_kinds(kinds: list) -> list:
    """The kinds of the array leaves only (``dynamic`` holds no static leaves)."""
    return [k for k in kinds if k != STATIC]


def local_value(var: KerasVariable, device: Any) -> Any:
    """Variable ``var``'s copy on ``device``: its placement's answer (``Placement.local_value``)."""
    placement = var.__dict__.get("_distribute_placement")
    if placement is not None:
        return placement.local_value(var, device)
    return Placement().local_value(var, device)


def array_of(value: Any) -> Any:
    return value._array if isinstance(value, Mirrored) else value


def as_output(x: Any) -> jax.Array:
    if isinstance(x, KerasVariable):
        x = x.value
    if isinstance(x, DistributedValues):
        raise TypeError("the replica function returned a distributed value; return arrays instead.")
    try:
        return jnp.asarray(x)
    except TypeError as err:
        raise TypeError(
            f"the replica function returned {x!r} of type {type(x).__name__}; strategy.run "
            "returns arrays only (nested in tuples, lists or dicts). Return arrays, or "
            "keep other values outside the replica function."
        ) from err


def check_ownership(strategy, variables: list) -> None:
    """Raises ``ownership.ownership_error`` for the first variable not made in ``strategy``'s scope
    (``extended.variable_created_in_scope``)."""
    for var in variables:
        if not strategy.extended.variable_created_in_scope(var):
            raise ownership.ownership_error(strategy, var)


def function_key(fn: Callable, depth: int = 0) -> Any:
    """Cache key of a replica function: its code, closure, defaults and globals, not the object.

    TF's multi_worker_with_ctl defines ``step_fn`` inside ``train_step``: every
    call makes a new function object with the same code, so keying on the
    object would compile every step (``tf.function`` traces the nested function
    once, as part of the outer graph).  Two functions share a program when
    their code, globals, defaults and closure contents are the same objects
    (Python numbers and strings: equal values; closed-over functions: compared
    the same way, to depth 3).  ``obj.step`` makes a new bound-method object on
    every access: the key is (function, instance).  A ``functools.partial``:
    its function's key and its arguments (identical objects).
    """
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None:
        return ("method", function_key(func, depth), id(owner))
    if isinstance(fn, functools.partial) and depth < 3:
        return ("partial", function_key(fn.func, depth + 1), tuple(_content_key(a, depth) for a in fn.args),
                tuple(sorted((k, _content_key(v, depth)) for k, v in fn.keywords.items())))
    if not isinstance(fn, types.FunctionType) or depth >= 3:
        return fn
    cells = []
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned after the function was made)
            cells.append(_EMPTY_CELL)
            continue
        cells.append(_content_key(contents, depth))
    return ("function", fn.__code__, _Same(fn.__globals__), tuple(cells), _content_key(fn.__defaults__, depth),
            _content_key(fn.__kwdefaults__, depth))


_EMPTY_CELL = object()
_VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None))


def _content_key(x: Any, depth: int) -> Any:
    if isinstance(x, _VALUE_TYPES):
        return (type(x), x)
    if isinstance(x, types.FunctionType):
        return function_key(x, depth + 1)
    if type(x) is tuple and depth < 3:  # defaults: a new tuple for every new function object
        return ("tuple", tuple(_content_key(v, depth + 1) for v in x))
    if type(x) is dict and depth < 3 and all(isinstance(k, str) for k in x):  # keyword-only defaults
        return ("dict", tuple(sorted((k, _content_key(v, depth + 1)) for k, v in x.items())))
    return _Same(x)


class _Same:
    """An object compared by identity; holds it, so its id is not reused while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def place(value: Any, sharding: Any) -> Any:
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    return jax.device_put(value, sharding)


def is_input_leaf(x: Any) -> bool:
    return isinstance(x, (DistributedValues, KerasVariable))


def is_keras_variable(x: Any) -> bool:
    return isinstance(x, KerasVariable)


def static_key(leaf: Any) -> Any:
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))
    if isinstance(leaf, KerasVariable):
        return ("id", id(leaf))
    return (type(leaf), leaf)
