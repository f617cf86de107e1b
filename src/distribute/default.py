"""The default strategy, and the context functions that fall back to it (tf.distribute's distribute_lib).

Outside every ``strategy.scope()`` the default strategy is current: one replica,
no distribution. The context (``_context.py``) holds None then; only the public
functions here build the default strategy object, so nothing below needs it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from distribute import _context, collectives
from distribute.keras_support import patches
from distribute.mesh_strategy import MeshExtended, MeshStrategy, check_reduce_axis
from distribute.replica import ReplicaContext
from distribute.strategy import Strategy, ValueContext, check_run_args
from distribute.values import ReduceOp, is_distributed


class _DefaultExtended(MeshExtended):
    """The default strategy's extended half: variables made outside every scope are its own (TF)."""

    def variable_created_in_scope(self, v: Any) -> bool:
        """True for variables created outside every strategy's scope (TF's default strategy)."""
        return getattr(v, "_distribute_strategy", None) is None

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None) -> Any:
        """A plain array (``float()`` works), as TF's default strategy."""
        return self._container_strategy.reduce(reduce_op, value, axis=None)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence, options: Any = None) -> list:
        """Plain arrays, as TF's default strategy."""
        return [self.reduce_to(reduce_op, value, destinations, options) for value, destinations in value_destination_pairs]


class _DefaultStrategy(MeshStrategy):
    """The strategy in force when no scope is entered: one replica, no distribution.

    As in TF, ``reduce`` returns its input and ``experimental_distribute_dataset``
    returns the dataset unchanged.  ``run`` compiles ``fn`` like the other
    strategies (TF users get that from ``tf.function``), over the default device,
    with any Keras variables created outside a scope.
    """

    _extended_cls = _DefaultExtended

    def __init__(self) -> None:
        patches.install_core()
        super().__init__([jax.local_devices()[0]])

    def scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def scope_in_replica(self) -> Strategy | None:
        return None

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None, options: Any = None) -> Any:
        check_run_args(args, kwargs)
        from distribute import tracing

        if _context.current_replica_context() is not None:
            return fn(*args, **(kwargs or {}))
        outputs = tracing.run(self, fn, tuple(args), dict(kwargs or {}))
        # One replica: plain values, as TF's default strategy returns.
        return jax.tree_util.tree_map(lambda v: v.values[0] if is_distributed(v) else v, outputs, is_leaf=is_distributed)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        op = ReduceOp.from_value(reduce_op)
        check_reduce_axis(axis)
        return jax.tree_util.tree_map(
            lambda v: collectives.reduce_plain(op, jnp.asarray(v.values[0] if is_distributed(v) else v), axis),
            value,
            is_leaf=is_distributed,
        )

    def gather(self, value: Any, axis: int) -> Any:
        return value

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        from distribute.input.input_context import InputContext

        return dataset_fn(InputContext())

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        return value_fn(ValueContext(0, 1))

    def __repr__(self) -> str:
        return "DefaultStrategy()"


_DEFAULT: list[_DefaultStrategy] = []


def default_strategy() -> _DefaultStrategy:
    """The default strategy (made on first use)."""
    if not _DEFAULT:
        _DEFAULT.append(_DefaultStrategy())
    return _DEFAULT[0]


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope is active, else the default one (TF: same name)."""
    return _context.scope_strategy() or default_strategy()


def get_replica_context() -> ReplicaContext | None:
    """The current ReplicaContext (TF: same name).

    Inside ``run``: the replica's context.  In a strategy's scope outside ``run``:
    None (cross-replica context).  Outside any scope: the default strategy's
    context (one replica).
    """
    state = _context.state()
    if state.replica_context is not None:
        return state.replica_context
    if state.strategy is not None:
        return None
    return ReplicaContext._default(default_strategy())
