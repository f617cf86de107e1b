"""Who owns a Keras variable, and the error for one used with a strategy that did not make it.

Optimizers and metrics created while a strategy may be active register here
(``keras_support/optimizers.py``), so an error about one of their variables names the
user's object ("optimizer 'Adam' was created outside strategy.scope() ...")
rather than an internal variable path.
"""

from __future__ import annotations

import weakref
from typing import Any

from distribute._keras import Metric

_OBJECTS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers and metrics, to name owners in errors


def register(obj: Any) -> None:
    """Records an optimizer or metric, to name it in errors about its variables."""
    _OBJECTS.add(obj)


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
