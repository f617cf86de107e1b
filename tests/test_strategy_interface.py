"""A strategy plugs in by implementing the execution interface, without editing the base.

``SequentialStrategy`` (below, 40 lines) runs its replicas one after another in
Python on the default device: the smallest strategy that is a real one. It
implements ``strategy.Strategy``'s abstract members and ``place_variable``, and
installs the Keras integration when built (``patches.install_core``); the base gives it ``scope``, the context functions and TF's ``reduce_to``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import distribute
from distribute import _context
from distribute.extended import StrategyExtended
from distribute.keras_support import patches
from distribute.placement import Placement
from distribute.replica import ReplicaContext
from distribute.strategy import Strategy, ValueContext
from distribute.values import ReduceOp


class _Extended(StrategyExtended):
    def place_variable(self, variable: Any) -> Placement:
        return Placement()  # Keras' own storage: one copy on the default device


class _Context(ReplicaContext):
    def __init__(self, strategy: Strategy, replica: int):
        super().__init__(strategy, in_program=False)
        self._replica = replica

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica


class SequentialStrategy(Strategy):
    _extended_cls = _Extended

    def __init__(self, num_replicas: int):
        patches.install_core()  # Keras variables made in its scope ask place_variable
        super().__init__()
        self._num = num_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num

    def run(self, fn, args=(), kwargs=None, options=None):
        def call(replica: int) -> Any:
            with _context.enter_replica(self, _Context(self, replica)):
                mine = [a[replica] if isinstance(a, tuple) else a for a in args]
                return fn(*mine, **(kwargs or {}))

        return tuple(call(r) for r in range(self._num))

    def reduce(self, reduce_op, value, axis=None):
        stacked = jnp.stack([jnp.asarray(v) for v in value])
        total = jnp.sum(stacked, axis=0 if axis is None else (0, axis + 1))
        count = len(value) * (1 if axis is None else stacked.shape[axis + 1])
        return total / count if ReduceOp.from_value(reduce_op) is ReduceOp.MEAN else total

    def gather(self, value, axis):
        return jnp.concatenate([jnp.asarray(v) for v in value], axis=axis)

    def experimental_local_results(self, value):
        return tuple(value) if isinstance(value, tuple) else (value,)

    def experimental_distribute_dataset(self, dataset, options=None):
        return (tuple(np.array_split(np.asarray(batch), self._num)) for batch in dataset)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        return self.experimental_distribute_dataset(dataset_fn(distribute.InputContext(1, 0, self._num)))

    def experimental_distribute_values_from_function(self, value_fn):
        return tuple(value_fn(ValueContext(r, self._num)) for r in range(self._num))


def test_a_new_strategy_runs_reduces_and_places_variables_through_the_interface():
    strategy = SequentialStrategy(2)
    assert strategy.num_replicas_in_sync == 2 and not distribute.has_strategy()
    with strategy.scope():
        assert distribute.get_strategy() is strategy and distribute.in_cross_replica_context()
        v = keras.Variable(3.0)  # asks strategy.extended.place_variable
    assert strategy.extended.variable_created_in_scope(v) and isinstance(v._distribute_placement, Placement)
    for batch in strategy.experimental_distribute_dataset([np.arange(4.0), np.arange(4.0, 8.0)]):
        per_replica = strategy.run(lambda x: jnp.sum(x) * v.value + distribute.get_replica_context().replica_id_in_sync_group,
                                   args=(batch,))
        assert strategy.reduce("SUM", per_replica) == pytest.approx(3.0 * float(np.sum(batch)) + 1.0)
    assert strategy.extended.reduce_to("MEAN", (jnp.float32(1.0), jnp.float32(3.0))) == pytest.approx(2.0)
    assert np.asarray(strategy.gather((jnp.ones(2), jnp.zeros(1)), axis=0)).tolist() == [1.0, 1.0, 0.0]
    ids = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group * 10)
    assert strategy.experimental_local_results(ids) == (0, 10)
    assert jax.numpy.asarray(v.value) == 3.0


def test_a_strategy_missing_part_of_the_interface_cannot_be_built():
    class Incomplete(Strategy):
        _extended_cls = _Extended

        @property
        def num_replicas_in_sync(self) -> int:
            return 1

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
