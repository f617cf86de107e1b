"""Optimizers, metrics and random numbers inside a strategy (the wrappers of ``patches.py``'s rows).

* an optimizer remembers the scope it was created in; its ``apply`` inside
  ``strategy.run`` (and fit) sums the gradients across replicas first (as TF's
  ``apply_gradients``) and refuses to run for another strategy; the summed
  update is applied once, as TF applies it in cross-replica context; with
  sharded state it updates each replica's slices (``sharded_update.py``); a
  slot (``add_variable_from_reference``) is placed with its variable;
* a metric created in scope remembers the strategy (to refuse another
  strategy's steps);
* inside ``strategy.run`` and fit each replica draws its own random numbers
  (Dropout masks differ between replicas, as in TF) while the seed generator's
  state stays mirrored.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from distribute import _context, ownership
from distribute._keras import LossScaleOptimizer, get_stateless_scope
from distribute.keras_support import sharded_update
from distribute.lifting import LiftingScope, check_ownership


def optimizer_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        ownership.register(self)
        return original(self, *args, **kwargs)

    return __init__


def optimizer_apply(original):
    """``apply`` (of every optimizer, ``LossScaleOptimizer``'s too): inside ``run`` the gradients are summed first.

    In the SPMD step of a strategy with sharded state (``sharding=``) the update
    runs on each replica's slices instead (``sharded_update.py``); a
    ``LossScaleOptimizer`` in a step runs Keras' ``stateless_apply`` (its own
    ``apply`` assigns inside ``lax.cond`` branches, which a traced step cannot
    take).
    """

    def apply(self, grads, trainable_variables=None):
        if sharded_update.active():  # an inner optimizer, or Keras' own apply inside a sliced update
            return original(self, grads, trainable_variables)
        context = _context.current_replica_context()
        scope = get_stateless_scope()
        if context is not None and context._in_program:
            strategy = context.strategy
            # Its step counter was created with it: the same error as for any variable.
            check_ownership(strategy, [self.iterations])
            sharding = context._sharding
            sliced = sharding is not None and sharding.splits_slots
            if isinstance(scope, LiftingScope) and (sliced or isinstance(self, LossScaleOptimizer)):
                scope.update_depth += 1
                try:
                    return sharded_update.apply(context, self, list(grads), trainable_variables, scope, slicing=sliced)
                finally:
                    scope.update_depth -= 1
            grads = context._sum_gradients(list(grads))
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


def stateless_apply(context: Any, optimizer: Any, optimizer_values: list, grads: list, trainable_values: list) -> tuple:
    """A fit step's update (``keras_support/steps.py``): Keras' ``stateless_apply`` of the summed gradients.

    In the SPMD step of a strategy with sharded state the update runs on each
    replica's slices (``sharded_update.stateless_apply``).
    """
    sharding = context._sharding
    if sharding is not None and sharding.splits_slots:
        return sharded_update.stateless_apply(context, optimizer, optimizer_values, grads, trainable_values)
    grads = context._sum_gradients(grads)
    with _context.leave_replica():  # the hooked optimizer would sum again
        return optimizer.stateless_apply(optimizer_values, grads, trainable_values)


def add_variable_from_reference(original):
    """``add_variable_from_reference``: a slot is placed with its variable (``_context.colocated_with``)."""

    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        with _context.colocate(reference_variable):
            return original(self, reference_variable, *args, **kwargs)

    return add_variable_from_reference


def clip_gradients(original):
    """``_clip_gradients``: in a sliced update, norms over every replica's slice (``sharded_update.clip``)."""

    def _clip_gradients(self, grads):
        if sharded_update.active():
            clipped = sharded_update.clip(self, grads)
            if clipped is not None:
                return clipped
        return original(self, grads)

    return _clip_gradients


def check_finite(original):
    """``LossScaleOptimizer.check_finite``: in a sliced update, finite on every replica's slice."""

    def method(self, grads):
        finite = original(self, grads)
        return sharded_update.all_finite(finite) if sharded_update.active() else finite

    return method


def variable_shape(original):
    """``Variable.shape``: inside a sliced update, a sliced variable's shape is its slice's."""
    getter = original.fget

    def shape(self):
        sliced = sharded_update.slice_shape(self)
        return getter(self) if sliced is None else sliced

    return property(shape, original.fset, original.fdel, original.__doc__)


def metric_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        ownership.register(self)
        original(self, *args, **kwargs)

    return __init__


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
