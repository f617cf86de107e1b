"""What makes Keras variables, optimizers and metrics created in scope distribution-aware.

``install()`` patches four Keras methods once, each keeping Keras' behaviour
outside a strategy:

* a JAX Keras variable initialized inside a strategy's scope is placed
  replicated on the strategy's mesh (a MirroredVariable) and remembers the
  strategy (``variable_created_in_scope``); read in cross-replica context
  (``v.value``, ``v + x``, ``keras.ops.convert_to_tensor(v)``, ``float(v)``) it
  gives one device's copy, as TF (see ``_cross_replica_read``);
* an optimizer remembers the scope it was created in; its ``apply`` inside
  ``strategy.run`` sums the gradients across replicas first (as TF's
  ``apply_gradients``) and refuses to run for another strategy;
* a metric created in scope remembers the strategy (to refuse another
  strategy's steps);
* ``BatchNormalization(synchronized=True)`` (Keras 3 allows it on TensorFlow
  only) computes its batch moments over every replica's rows, as TF's
  SyncBatchNormalization: sums, squared sums and counts are all-reduced;
* in an uneven step, an activity regularizer's loss is rescaled from Keras'
  "divided by this replica's rows" to "divided by the global batch's rows", so
  the replicas' losses add up to one device's;
* inside ``strategy.run`` and fit, each replica draws its own random numbers
  (Dropout masks differ between replicas, as in TF) while the seed generator's
  state stays mirrored;
* a model compiled in scope trains, evaluates and predicts over all replicas
  (``trainer.py``);
* Keras' recurrent layers start their scan from per-replica states (``rnn.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from distribute import _context
from distribute._keras import (
    get_stateless_scope,
)
from distribute import ownership
from distribute.lifting import LiftingScope, check_ownership



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
        if placement is not None and get_stateless_scope() is None:
            placement.before_read(self)  # a ParameterServerStrategy variable: its coordinator copy made current (TF reads the ps)
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
        original(self, *args, **kwargs)
        placement = placement_of(self)
        if placement is not None:
            placement.on_created(self)

    return __init__


def variable_initialize_layout(original):
    """``JaxVariable._initialize_layout``: the value is created with its placement's sharding."""

    def _initialize_layout(self):
        placement = placement_of(self)
        if placement is not None and self._layout is None:
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


def direct_assign(original):
    """``JaxVariable._direct_assign``: an assignment outside any step is told to the variable's placement."""

    def _direct_assign(self, value):
        original(self, value)
        placement = self.__dict__.get("_distribute_placement")
        if placement is not None:
            placement.on_assign(self)

    return _direct_assign


def optimizer_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        ownership.register(self)
        return original(self, *args, **kwargs)

    return __init__


def optimizer_apply(original):
    def apply(self, grads, trainable_variables=None):
        context = _context.current_replica_context()
        if context is not None and context._in_program:
            strategy = context.strategy
            # Its step counter was created with it: the same error as for any variable.
            check_ownership(strategy, [self.iterations])
            grads = context._sum_gradients(list(grads))
        scope = get_stateless_scope()
        if context is None or not isinstance(scope, LiftingScope):
            return original(self, grads, trainable_variables)
        # TF applies the (summed) update in cross-replica context (extended.update): a
        # variable's aggregation does not count it once per replica.
        scope.update_depth += 1
        try:
            return original(self, grads, trainable_variables)
        finally:
            scope.update_depth -= 1

    return apply


def metric_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        ownership.register(self)
        original(self, *args, **kwargs)

    return __init__


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
    current = getattr(variable, "_value", None)
    if not (isinstance(value, jax.Array) and isinstance(current, jax.Array)) or isinstance(value, jax.core.Tracer) \
            or isinstance(current, jax.core.Tracer) or not value.committed:
        return value
    read = _cross_replica_read(variable, current)
    devices = read.sharding.device_set
    if value.sharding.device_set == devices:
        return value
    return jax.device_put(value, read.sharding if len(devices) > 1 else next(iter(devices)))


def batch_norm_init(original):
    def __init__(self, *args, **kwargs):
        synchronized = kwargs.pop("synchronized", False)
        original(self, *args, synchronized=False, **kwargs)
        # Keras 3 refuses synchronized=True outside TensorFlow; the moments below do it.
        self.synchronized = bool(synchronized)

    # Keras' Operation.__new__ reads the constructor's argspec: keep Keras' own.
    __init__.__signature__ = inspect.signature(original)
    return __init__


def batch_norm_moments(original):
    """Moments over every replica's rows for ``synchronized=True`` (TF's SyncBatchNormalization).

    As TF: the sum, the sum of squares and the count of the reduced elements are
    all-reduced, ``mean = sum / count``, ``variance = sum_sq / count - mean**2``.
    Differentiable (the all-reduce's gradient is an all-reduce); a replica with no
    rows adds zeros; outside a replica context it is the layer's own moments.
    Unsynchronized, an empty replica's moments are 0 and 1 instead of NaN.
    """

    def _moments(self, inputs, mask):
        if not self.synchronized:
            if any(inputs.shape[a] == 0 for a in self._reduction_axes):
                # An empty replica of an uneven step: Keras' moments would be NaN (0 / 0)
                # and poison the gradients; its output is empty, and its moving
                # statistics are left out of the replicas' mean (uneven.py).
                shape = [d for i, d in enumerate(inputs.shape) if i not in self._reduction_axes]
                return jnp.zeros(shape, inputs.dtype), jnp.ones(shape, inputs.dtype)
            return original(self, inputs, mask)
        if mask is not None:
            raise NotImplementedError(
                "BatchNormalization(synchronized=True) with a mask is not supported; pass no mask, "
                "or use synchronized=False."
            )
        context = _context.current_replica_context()
        axes = tuple(self._reduction_axes)
        x = jnp.asarray(inputs)
        dtype = x.dtype
        if dtype in (jnp.float16, jnp.bfloat16):
            x = x.astype(jnp.float32)
        count = 1
        for axis in axes:
            count *= x.shape[axis]
        local = (jnp.sum(x, axis=axes), jnp.sum(jnp.square(x), axis=axes), jnp.asarray(count, jnp.float32))
        if context is not None and context._in_program and context.num_replicas_in_sync > 1:
            total, total_sq, total_count = context.all_reduce("SUM", local)
        else:
            total, total_sq, total_count = local
        total_count = jnp.maximum(total_count, 1.0)
        mean = total / total_count
        variance = jnp.maximum(total_sq / total_count - jnp.square(mean), 0.0)
        return mean.astype(dtype), variance.astype(dtype)

    return _moments


def activity_regularizer_property(_original: Any) -> property:
    """``Layer.activity_regularizer`` (an instance attribute in Keras) as a property that rescales its loss in uneven steps."""

    def get(self):
        regularizer = self.__dict__.get("_distribute_activity_regularizer")
        context = _context.current_replica_context()
        if regularizer is None or context is None or context._global_rows is None:
            return regularizer
        if context._rows * context.num_replicas_in_sync == context._global_rows:
            return regularizer
        return _RescaledRegularizer(regularizer, context._rows, context._rows * context.num_replicas_in_sync / max(context._global_rows, 1))

    def set(self, value):
        self.__dict__["_distribute_activity_regularizer"] = value

    return property(get, set)


class _RescaledRegularizer:
    """An activity regularizer whose loss is multiplied by ``factor`` on outputs of this replica's rows.

    Keras divides an activity loss by the output's rows ``n_r`` and distributed
    steps divide layer losses by the replica count ``R``; ``factor = n_r R / N``
    makes each replica's share ``regularizer(its rows) / N``, so the shares add up
    to one device's ``regularizer(all rows) / N``.
    """

    def __init__(self, regularizer: Any, rows: int, factor: float):
        self._regularizer, self._rows, self._factor = regularizer, rows, factor

    def __call__(self, output: Any) -> Any:
        loss = self._regularizer(output)
        if getattr(output, "ndim", 0) and output.shape[0] == self._rows:
            loss = loss * jnp.asarray(self._factor, loss.dtype)
        return loss


def seed_next(original):
    def next(self, ordered=True):
        seed = original(self, ordered=ordered)
        context = _context.current_replica_context()
        if context is None or not context._in_program or context.num_replicas_in_sync == 1:
            return seed
        # A different stream per replica; the generator's state itself stays mirrored.
        replica = context.replica_id_in_sync_group.astype(seed.dtype)
        return seed + jnp.stack([replica * jnp.asarray(0x9E3779B1 % (2**31), seed.dtype), jnp.zeros((), seed.dtype)])

    return next
