"""The current strategy and replica context, held in one ContextVar.

Three situations, as in tf.distribute:

* no strategy scope entered: the default strategy is current and the code runs
  in its (only) replica context (``default.py`` finds it: the state holds None);
* inside ``strategy.scope()`` and outside ``strategy.run``: cross-replica context;
* inside the function given to ``strategy.run``: replica context.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from distribute.replica import ReplicaContext
    from distribute.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class _State:
    strategy: "Strategy | None" = None  # None: the default strategy
    replica_context: "ReplicaContext | None" = None  # set inside run


_STATE: contextvars.ContextVar[_State] = contextvars.ContextVar(
    "distribute_state", default=_State()
)


def state() -> _State:
    return _STATE.get()


def scope_strategy() -> "Strategy | None":
    """The strategy whose scope (or run) is active, or None for the default one."""
    return _STATE.get().strategy


def current_replica_context() -> "ReplicaContext | None":
    return _STATE.get().replica_context


class enter_scope:
    """``strategy.scope()``: a context manager that may be re-entered, even inside itself.

    TF's testSameScopeNesting enters one scope object inside itself
    (``with a: with b: with a: ...``); each entry pushes its own token.
    """

    def __init__(self, strategy: "Strategy"):
        self._strategy = strategy
        self._tokens: list = []

    def __enter__(self) -> None:
        current = _STATE.get()
        if current.strategy is not None and current.strategy is not self._strategy:
            raise RuntimeError(
                f"Mixing different tf.distribute.Strategy objects: cannot enter the "
                f"scope of {self._strategy!r} inside the scope of {current.strategy!r}. "
                "Exit the first strategy's scope before entering another one, and "
                "build each model entirely inside one strategy's scope."
            )
        if current.replica_context is not None:
            # TF allows re-entering the same scope inside run; it changes nothing.
            self._tokens.append(None)
            return
        self._tokens.append(_STATE.set(_State(strategy=self._strategy, replica_context=None)))

    def __exit__(self, *exc: object) -> None:
        token = self._tokens.pop()
        if token is not None:
            _STATE.reset(token)


@contextlib.contextmanager
def enter_replica(strategy: "Strategy", replica_context: "ReplicaContext") -> Iterator[None]:
    """Replica context of ``strategy`` (inside ``run``); the default strategy's is no scope (``has_strategy()`` stays False)."""
    token = _STATE.set(_State(strategy=strategy.scope_in_replica(), replica_context=replica_context))
    try:
        yield
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def leave_replica() -> Iterator[None]:
    """Cross-replica context for a moment inside a replica function (the engine's own calls)."""
    token = _STATE.set(_State(strategy=_STATE.get().strategy, replica_context=None))
    try:
        yield
    finally:
        _STATE.reset(token)


class NeedsCrossReplica(Exception):
    """A ``distribute.function`` being compiled as one replica program called a strategy's cross-replica API."""


_FUNCTION_TRACE: contextvars.ContextVar[bool] = contextvars.ContextVar("distribute_function_trace", default=False)


@contextlib.contextmanager
def function_trace() -> Iterator[None]:
    """Inside: a ``distribute.function`` is being compiled as the default strategy's replica function."""
    token = _FUNCTION_TRACE.set(True)
    try:
        yield
    finally:
        _FUNCTION_TRACE.reset(token)


def check_cross_replica_call() -> None:
    """Called by a strategy's cross-replica API inside a replica context: a ``distribute.function``'s
    trace then gives up (the function runs as Python); otherwise nothing happens."""
    if _FUNCTION_TRACE.get():
        raise NeedsCrossReplica()


@contextlib.contextmanager
def outside_scope() -> Iterator[None]:
    """Runs the block as if no strategy scope were entered (variables made there are plain, local ones)."""
    token = _STATE.set(_State())
    try:
        yield
    finally:
        _STATE.reset(token)


# -- which variable a new variable belongs with (an optimizer slot's model variable) ----------
_COLOCATE: contextvars.ContextVar = contextvars.ContextVar("distribute_colocate", default=None)


def colocated_with() -> Any:
    """The variable new variables are placed with (an optimizer slot's model variable), or None.

    Set around ``BaseOptimizer.add_variable_from_reference`` (every slot: a mesh
    strategy splits a slot as its variable's update, a parameter server puts it
    on its variable's ps) and by ``extended.colocate_vars_with``.
    """
    return _COLOCATE.get()


@contextlib.contextmanager
def colocate(variable: Any) -> Iterator[None]:
    """Inside, new variables are placed with ``variable``."""
    token = _COLOCATE.set(variable)
    try:
        yield
    finally:
        _COLOCATE.reset(token)
