"""Optimizers, metrics and random numbers inside a strategy (the wrappers of ``patches.py``'s rows).

* an optimizer remembers the scope it was created in; its ``apply`` inside
  ``strategy.run`` (and fit) sums the gradients across replicas first (as TF's
  ``apply_gradients``) and refuses to run for another strategy; the summed
  update is applied once, as TF applies it in cross-replica context;
* a metric created in scope remembers the strategy (to refuse another
  strategy's steps);
* inside ``strategy.run`` and fit each replica draws its own random numbers
  (Dropout masks differ between replicas, as in TF) while the seed generator's
  state stays mirrored.
"""

from __future__ import annotations

import jax.numpy as jnp

from distribute import _context, ownership
from distribute._keras import get_stateless_scope
from distribute.lifting import LiftingScope, check_ownership


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
