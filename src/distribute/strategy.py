"""Strategy (tf.distribute.Strategy): the base of every strategy, and the context functions.

A strategy is a way to run one computation on several replicas. This base holds
what every strategy shares (``scope``, ``extended``, ``cluster_resolver``) and
declares the execution interface each one implements:

* ``num_replicas_in_sync``, ``run``, ``reduce``, ``gather``,
  ``experimental_local_results``;
* ``experimental_distribute_dataset``, ``distribute_datasets_from_function``,
  ``experimental_distribute_values_from_function``;
* on ``extended`` (``extended.py``): ``place_variable`` (where a variable made
  in the scope lives) and TF's ``reduce_to`` / ``batch_reduce_to`` / ``update``.

The mesh strategies (Mirrored, MultiWorkerMirrored, TPU, OneDevice, the default
strategy) implement it once, on an engine over a one-axis device mesh
(``mesh_strategy.py``); ParameterServerStrategy implements it on Ray
(``parameter_server/strategy.py``). A new strategy plugs in the same way,
without editing this base, and installs the Keras integration when it is built
(``keras_support.patches.install_core()``: Keras variables made in its scope then
ask its ``place_variable``); ``tests/test_strategy_interface.py`` has one in 40
lines.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, Sequence

from distribute import _context
from distribute.extended import StrategyExtended


class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn``.

    Matches tf.distribute.experimental.ValueContext.
    """

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class Strategy(abc.ABC):
    """A way to run one computation on several replicas (tf.distribute.Strategy).

    Use :class:`~distribute.MirroredStrategy` and friends; this base holds the API
    they share and declares the execution interface each implements.

    Args:
        **extended_kwargs: passed to the strategy's ``StrategyExtended`` class
            (``_extended_cls``).
    """

    _extended_cls: type = StrategyExtended

    def __init__(self, **extended_kwargs: Any):
        self._extended = self._extended_cls(self, **extended_kwargs)
        self._cluster_resolver = None

    # -- properties ----------------------------------------------------------------------
    @property
    def extended(self) -> StrategyExtended:
        """The less common half of the API (TF: ``Strategy.extended``)."""
        return self._extended

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, across all workers."""

    @property
    def cluster_resolver(self):
        """The cluster resolver, for multi-worker strategies; None here (as TF)."""
        return self._cluster_resolver

    # -- scope -----------------------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager:
        """Makes this strategy current: Keras variables, models, optimizers and
        metrics created inside become distribution-aware (each variable asks
        ``extended.place_variable`` where it lives).

        Nesting the same strategy's scope is fine.

        Raises:
            RuntimeError: another strategy's scope is already active (TF: "Mixing
                different tf.distribute.Strategy objects").
        """
        return _context.enter_scope(self)

    def scope_in_replica(self) -> "Strategy | None":
        """The strategy whose scope is active inside this strategy's ``run``: itself (the default strategy: None)."""
        return self

    # -- the execution interface -----------------------------------------------------------
    @abc.abstractmethod
    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None, options: Any = None) -> Any:
        """Runs ``fn`` once per replica (TF: Strategy.run); see the implementations."""

    @abc.abstractmethod
    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """Combines the replicas' values into one (TF: Strategy.reduce)."""

    @abc.abstractmethod
    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along ``axis`` (TF: Strategy.gather)."""

    @abc.abstractmethod
    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's components of ``value``, one per local replica (TF: same name)."""

    @abc.abstractmethod
    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Splits each global batch of ``dataset`` across the replicas (TF: same name)."""

    @abc.abstractmethod
    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Builds each worker's input pipeline with ``dataset_fn(InputContext)`` (TF: same name)."""

    @abc.abstractmethod
    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Builds a per-replica value from ``value_fn(ValueContext)`` (TF: same name)."""

    def experimental_distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """TF's older name of :meth:`distribute_datasets_from_function` (same behaviour)."""
        return self.distribute_datasets_from_function(dataset_fn, options)


class CoordinatedStrategy(Strategy):
    """A strategy whose steps a ``ClusterCoordinator`` schedules onto remote workers (TF's
    ``_should_use_with_coordinator``: ParameterServerStrategy).

    Its ``extended`` runs Keras ``fit`` / ``evaluate`` / ``predict`` with a loop of
    its own: ``extended.keras_fit(model, args, kwargs)``, ``keras_evaluate``,
    ``keras_predict``.
    """


def check_run_args(args: Any, kwargs: Any) -> None:
    """Raises ValueError (as TF) unless ``args`` is a tuple or list and ``kwargs`` None or a dict."""
    if not isinstance(args, (tuple, list)):
        raise ValueError(
            f"strategy.run: args must be a tuple or list, got {type(args).__name__}; "
            "wrap a single argument as args=(x,)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"strategy.run: kwargs must be a dict, got {type(kwargs).__name__}.")


def has_strategy() -> bool:
    """Whether a non-default strategy's scope is active (TF: same name)."""
    return _context.scope_strategy() is not None


def in_cross_replica_context() -> bool:
    """True inside a strategy's scope and outside ``run`` (TF: same name).

    False outside any scope (the default strategy's replica context) and inside
    ``run``.
    """
    state = _context.state()
    return state.strategy is not None and state.replica_context is None
