"""Keras variables made in a strategy's scope: where they live, how they are read and added to.

The wrappers of ``patches.py``'s variable rows. A variable asks its strategy
where it lives once, at creation (``placement_of``: ``extended.place_variable``);
its value is created with that placement's sharding; a read in cross-replica
context (``v.value``, ``v + x``, ``keras.ops.convert_to_tensor(v)``,
``float(v)``) gives what the placement says (one device's copy, as TF's
``_get_cross_replica``); an assignment outside any step is told to the
placement (a parameter server pushes it); ``assign_add`` inside ``run`` tells
run's scope the write adds to the variable (sum aggregation counts every
replica's change once).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax

from distribute import _context, creation, per_copy
from distribute._keras import get_stateless_scope
from distribute.lifting import LiftingScope
from distribute.placement import committed

# -- cross-replica reads of a distributed variable ----------------------------------------
_WHOLE_READS: contextvars.ContextVar[bool] = contextvars.ContextVar("distribute_whole_variable_reads", default=False)


@contextlib.contextmanager
def whole_variable_reads() -> Iterator[None]:
    """Inside, ``variable.value`` is the whole replicated array: state handed to a compiled program."""
    token = _WHOLE_READS.set(True)
    try:
        yield
    finally:
        _WHOLE_READS.reset(token)


def whole_state(original):
    """``JAXTrainer._get_jax_state`` of a distributed model: the variables' replicated arrays.

    Keras' fit / evaluate / predict collect their loop state with ``v.value``;
    the SPMD step takes it replicated, so one device's copy there would cost a
    transfer of every variable at every state sync.
    """

    def _get_jax_state(self, *args, **kwargs):
        if self.__dict__.get("_distribute_strategy") is None:
            return original(self, *args, **kwargs)
        with whole_variable_reads():
            return original(self, *args, **kwargs)

    return _get_jax_state


def variable_value(original):
    """``Variable.value``: Keras' own, except a cross-replica read of a distributed variable (``_cross_replica_read``)."""
    keras_read = original.fget

    def value(self):
        placement = self.__dict__.get("_distribute_placement")
        scope = get_stateless_scope()
        if placement is not None and scope is not None and placement.remote(self):
            # A variable the coordinator holds no value of (a large ps variable): a traced function reads
            # its program input, or while the trace discovers its inputs a stand-in of its shape.
            mapped = scope.get_current_value(self)
            if mapped is None:
                mapped = jax.numpy.broadcast_to(jax.numpy.zeros((), self._dtype), self._shape) \
                    if isinstance(scope, LiftingScope) else placement.stored(self)
            return self._maybe_autocast(mapped)
        if placement is not None and scope is None:
            placement.before_read(self)  # a ParameterServerStrategy variable: its coordinator copy made current (TF reads the ps)
            current = placement.stored(self)  # a large one with no coordinator copy: gathered from its ps
        else:
            current = self._value
        if current is None or get_stateless_scope() is not None:
            # Inside any stateless scope (strategy.run's and fit's programs, Keras'
            # stateless_call / stateless_apply): Keras' own answer.
            return keras_read(self)
        return self._maybe_autocast(_cross_replica_read(self, current))

    return property(value, original.fset, original.fdel, original.__doc__)


def _cross_replica_read(variable: Any, current: Any) -> Any:
    """The array a read of ``variable`` gives outside any replica context (TF's ``_get_cross_replica``).

    TF 2.21, 2 replicas, ``v = keras.Variable(1.0)`` in scope and ``loss =
    strategy.reduce("SUM", strategy.run(lambda: 2.0), axis=None)`` (4.0, on one
    device): ``v.value`` is the copy on the current device, else the primary copy
    (``MirroredVariable._get_cross_replica``; a SyncOnRead variable's aggregate
    likewise), so ``v + loss`` is 5.0 on that device.  The variable's placement
    answers (``placement.Replicated.read``: its buffer on that device, no
    transfer), where ``strategy.reduce`` also puts its result; the result of
    ``v + loss``, ``keras.ops.add(v, loss)``, ``v.assign(v + loss)``,
    ``metric.result() + loss`` is one device's too, as in TF.

    Unchanged (the whole stored array): inside a replica context (the
    function given to ``strategy.run`` and Keras fit's steps read their variables
    as program inputs; a read there is every replica's own copy), inside
    ``whole_variable_reads`` (state handed to a program), and for variables made
    outside any strategy's scope.
    """
    placement = variable.__dict__.get("_distribute_placement")
    if placement is None or _WHOLE_READS.get() or _context.current_replica_context() is not None:
        return current
    return placement.read(variable, current)


def placement_of(variable: Any) -> Any:
    """``variable``'s placement, asking its strategy the first time (``StrategyExtended.place_variable``).

    The strategy is the one whose scope is active when the variable is created
    (None outside every scope: a plain Keras variable, no placement).
    """
    if "_distribute_placement" in variable.__dict__:
        return variable.__dict__["_distribute_placement"]
    strategy = _context.scope_strategy()
    variable._distribute_strategy = strategy
    placement = None if strategy is None else strategy.extended.place_variable(variable)
    variable._distribute_placement = placement
    return placement


def variable_init(original):
    """``Variable.__init__``: the variable asks its strategy where it lives (if its value did not already)."""

    def __init__(self, *args, **kwargs):
        scope = get_stateless_scope()
        initial = None
        if isinstance(scope, LiftingScope):
            # Inside a replica function (strategy.run): created once, from the first replica's value (creation.py).
            args, kwargs, initial = creation.defer(scope, args, kwargs)
        original(self, *args, **kwargs)
        if initial is not None:
            creation.created(scope, self, initial)
        placement = placement_of(self)
        if placement is not None:
            placement.on_created(self)

    return __init__


def variable_initialize_layout(original):
    """``JaxVariable._initialize_layout``: the value is created with its placement's sharding."""

    def _initialize_layout(self):
        placement = placement_of(self)
        # An optimizer slot comes with its variable's layout (add_variable_from_reference); a slot
        # split over the replicas (sharded state) is stored as its placement says.
        if placement is not None and (self._layout is None or placement.split):
            self._layout = placement.layout
        return original(self)

    return _initialize_layout


def variable_initialized(original):
    """After a variable's first value is set: its placement's ``on_initialized`` (a SyncOnRead value becomes its copies' aggregate)."""

    def initialize(self, *args):
        outer = not self.__dict__.get("_distribute_initializing")
        self.__dict__["_distribute_initializing"] = True
        try:
            original(self, *args)
        finally:
            if outer:
                del self.__dict__["_distribute_initializing"]
        placement = self.__dict__.get("_distribute_placement")
        if outer and placement is not None:
            placement.on_initialized(self)

    return initialize


def variable_initialized_with(original):
    """``_initialize_with_initializer``: its placement may make the value elsewhere (a large ps variable on its ps)."""
    initialized = variable_initialized(original)

    def _initialize_with_initializer(self, initializer):
        placement = placement_of(self)
        if placement is not None and placement.initialize_with(self, initializer):
            return None
        return initialized(self, initializer)

    return _initialize_with_initializer


def direct_assign(original):
    """``JaxVariable._direct_assign``: an assignment outside any step is told to the variable's placement."""

    def _direct_assign(self, value):
        original(self, value)
        placement = self.__dict__.get("_distribute_placement")
        if placement is not None:
            # Committed to its layout, so a step compiled for it takes it as it takes its own outputs.
            self._value = committed(self._value, placement.layout)
            placement.on_assign(self)

    return _direct_assign


def additive(original):
    """assign_add / assign_sub: tells run's scope that the write adds to the variable (sum aggregation)."""

    def method(self, value):
        scope = get_stateless_scope()
        if not isinstance(scope, LiftingScope):
            # Outside any (stateless) scope: the user's cross-replica code.
            return original(self, _to_variable_devices(self, value) if scope is None else value)
        scope.additive_depth += 1
        try:
            return original(self, value)
        finally:
            scope.additive_depth -= 1

    return method


def _to_variable_devices(variable: Any, value: Any) -> Any:
    """In cross-replica context, ``value`` on the device of ``variable``'s cross-replica read, when committed elsewhere.

    Keras' ``assign_add(delta)`` is ``assign(variable + delta)``; the read is one
    device's copy (``_cross_replica_read``).  TF copies ``delta`` there
    implicitly, wherever it lives (another replica's component of
    ``experimental_local_results``, a replicated value); JAX does not, so it is
    moved here.  ``strategy.reduce``'s result lives there already (no transfer).
    """
    if _context.current_replica_context() is not None:
        return value  # inside strategy.run (a replica's own copies): as it is
    if isinstance(value, per_copy.VariableCopy):
        value = value.value  # a copy from experimental_local_results: its array
    current = getattr(variable, "_value", None)
    if not (isinstance(value, jax.Array) and isinstance(current, jax.Array)) or isinstance(value, jax.core.Tracer) \
            or isinstance(current, jax.core.Tracer) or not value.committed:
        return value
    read = _cross_replica_read(variable, current)
    devices = read.sharding.device_set
    if value.sharding.device_set == devices:
        return value
    return jax.device_put(value, read.sharding if len(devices) > 1 else next(iter(devices)))


