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
import weakref
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from distribute import _context, sync_on_read
from distribute._keras import (
    BaseOptimizer,
    BatchNormalization,
    JaxVariable,
    JAXTrainer,
    KerasVariable,
    Layer,
    Metric,
    SeedGenerator,
    get_stateless_scope,
    install_per_thread_attributes,
)
from distribute._keras import patch as _patch
from distribute.tracing import check_ownership

_INSTALLED: list[bool] = []
_OBJECTS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers and metrics, to name owners in errors


def install() -> None:
    """Installs the hooks (idempotent)."""
    if _INSTALLED:
        return
    from distribute.keras_support import rnn, trainer

    _patch(JaxVariable, "_initialize_layout", _variable_initialize_layout)
    _patch(JaxVariable, "_initialize", _variable_initialized)
    _patch(JaxVariable, "_initialize_with_initializer", _variable_initialized)
    _patch(BaseOptimizer, "__init__", _optimizer_init)
    _patch(BaseOptimizer, "apply", _optimizer_apply)
    _patch(Metric, "__init__", _metric_init)
    _patch(SeedGenerator, "next", _seed_next)
    trainer.install()
    rnn.install()
    install_per_thread_attributes()
    _install_activity_regularizer_property(Layer)
    _patch(BatchNormalization, "__init__", _batch_norm_init)
    _patch(KerasVariable, "assign_add", _additive)
    _patch(KerasVariable, "assign_sub", _additive)
    _patch(BatchNormalization, "_moments", _batch_norm_moments)
    _patch(KerasVariable, "value", _variable_value)
    _patch(JAXTrainer, "_get_jax_state", _whole_state)
    _INSTALLED.append(True)


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


def _whole_state(original):
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


def _variable_value(original):
    """``Variable.value``: Keras' own, except a cross-replica read of a distributed variable (``_cross_replica_read``)."""
    keras_read = original.fget

    def value(self):
        before_read = self.__dict__.get("_distribute_before_read")
        if before_read is not None and get_stateless_scope() is None:
            before_read(self)  # a ParameterServerStrategy variable: its coordinator copy made current (TF reads the ps)
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
    likewise), so ``v + loss`` is 5.0 on that device.  Here the variable's
    replicated array gives its buffer on that device (``ReplicaMesh.local_copy``:
    no transfer), where ``strategy.reduce`` also puts its result; the result of
    ``v + loss``, ``keras.ops.add(v, loss)``, ``v.assign(v + loss)``,
    ``metric.result() + loss`` is one device's too, as in TF.

    Unchanged (the whole replicated array): inside a replica context (the
    function given to ``strategy.run`` and Keras fit's steps read their variables
    as program inputs; a read there is every replica's own copy), inside
    ``whole_variable_reads`` (state handed to a program), and for variables made
    outside any mesh strategy's scope.
    """
    strategy = variable.__dict__.get("_distribute_strategy")
    if strategy is None or _WHOLE_READS.get() or _context.current_replica_context() is not None:
        return current
    mesh = getattr(strategy.extended, "replica_mesh", None)
    return current if mesh is None else mesh.local_copy(current)


def _variable_initialize_layout(original):
    def _initialize_layout(self):
        strategy = _context.scope_strategy()
        self._distribute_strategy = strategy
        if strategy is not None and self._layout is None:
            self._layout = strategy.extended.replica_mesh.replicated_sharding
        return original(self)

    return _initialize_layout


def _variable_initialized(original):
    """After a variable's first value is set: a SyncOnRead one's value becomes its copies' aggregate."""

    def initialize(self, *args):
        outer = not self.__dict__.get("_distribute_initializing")
        self.__dict__["_distribute_initializing"] = True
        try:
            original(self, *args)
        finally:
            if outer:
                del self.__dict__["_distribute_initializing"]
        if outer:
            sync_on_read.on_created(self)

    return initialize


def _optimizer_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        _OBJECTS.add(self)
        return original(self, *args, **kwargs)

    return __init__


def _optimizer_apply(original):
    def apply(self, grads, trainable_variables=None):
        from distribute.tracing import LiftingScope

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


def _metric_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        _OBJECTS.add(self)
        original(self, *args, **kwargs)

    return __init__


def _additive(original):
    """assign_add / assign_sub: tells run's scope that the write adds to the variable (sum aggregation)."""

    def method(self, value):
        from distribute.tracing import LiftingScope

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


def _batch_norm_init(original):
    def __init__(self, *args, **kwargs):
        synchronized = kwargs.pop("synchronized", False)
        original(self, *args, synchronized=False, **kwargs)
        # Keras 3 refuses synchronized=True outside TensorFlow; the moments below do it.
        self.synchronized = bool(synchronized)

    # Keras' Operation.__new__ reads the constructor's argspec: keep Keras' own.
    __init__.__signature__ = inspect.signature(original)
    return __init__


def _batch_norm_moments(original):
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


def _install_activity_regularizer_property(layer_cls: type) -> None:
    """``Layer.activity_regularizer`` becomes a property that rescales its loss in uneven steps."""

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

    layer_cls.activity_regularizer = property(get, set)


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


def _seed_next(original):
    def next(self, ordered=True):
        seed = original(self, ordered=ordered)
        context = _context.current_replica_context()
        if context is None or not context._in_program or context.num_replicas_in_sync == 1:
            return seed
        # A different stream per replica; the generator's state itself stays mirrored.
        replica = context.replica_id_in_sync_group.astype(seed.dtype)
        return seed + jnp.stack([replica * jnp.asarray(0x9E3779B1 % (2**31), seed.dtype), jnp.zeros((), seed.dtype)])

    return next


def describe_object(obj: Any) -> str:
    kind = "metric" if isinstance(obj, Metric) else "optimizer"
    return f"{kind} '{type(obj).__name__}' (name {getattr(obj, 'name', '?')!r})"


def _owner(variable: Any) -> Any:
    """The most specific optimizer or metric holding ``variable`` (a user's metric, not Keras' MetricsList)."""
    owners = []
    for obj in list(_OBJECTS):
        try:
            owned = obj.variables
        except Exception:  # noqa: BLE001 - an object mid-construction
            continue
        if any(v is variable for v in owned):
            # Fewest variables first; on a tie, not one of Keras' compile containers (CompileMetrics, MetricsList).
            owners.append((len(owned), type(obj).__module__.startswith("keras.src.trainers"), id(obj), obj))
    return min(owners, key=lambda entry: entry[:3])[3] if owners else None


def describe_owner(variable: Any) -> str:
    """Names the optimizer or metric that owns ``variable``, else the variable itself."""
    owner = _owner(variable)
    return describe_object(owner) if owner is not None else f"Keras variable '{variable.path}' (of a layer or model)"


def ownership_error(strategy: Any, variable: Any) -> ValueError:
    """The error for ``variable`` used with ``strategy`` but not made in its scope; names the user's object."""
    owner = _owner(variable)
    what = describe_object(owner) if owner is not None else f"Keras variable '{variable.path}' (of a layer or model)"
    where = getattr(variable, "_distribute_strategy", None)
    made_in = getattr(owner, "_distribute_strategy", None) if owner is not None else None
    if where is None and made_in is strategy:
        if what.startswith("optimizer"):
            verb, fix = "built", "`with strategy.scope(): optimizer.build(model.trainable_variables)` (or let its first apply_gradients inside strategy.run / model.fit build it)"
        else:
            verb, fix = "first used (its variables were created)", "call update_state for the first time inside the scope or inside strategy.run"
        return ValueError(
            f"{what} was created inside {strategy!r}'s scope, but {verb} outside it: its variable "
            f"'{variable.path}' was created outside any strategy.scope(). Build it inside the scope too: {fix}."
        )
    if where is None:
        return ValueError(
            f"{what} was created outside any strategy.scope() and is used with {strategy!r} "
            "(strategy.run, model.fit or ClusterCoordinator.schedule). Create models, optimizers and metrics inside the scope: "
            "`with strategy.scope(): model = ...; optimizer = ...`."
        )
    return ValueError(
        f"{what} belongs to {where!r} (it was created in that scope) and is used with {strategy!r}. "
        "Use each model, optimizer and metric with the strategy whose scope created it."
    )
