"""The Keras methods a model compiled in a strategy's scope gets (the ``Patch.wrap`` functions of
``patches.CORE`` for ``Trainer.compile``, ``fit``/``evaluate``/``predict``, ``make_*_function``,
``Layer.__setattr__`` and ``CallbackList.on_*_batch_end``).

``compile`` remembers the strategy; ``fit``/``evaluate``/``predict`` and the ``*_on_batch`` methods run in its
scope with ``distribute.data`` inputs adapted; ``make_*_function`` builds the distributed step of ``trainer.py``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import keras
import numpy as np

from distribute import _context
from distribute._keras import DataAdapter, tree
from distribute.keras_support import interrupts, trainer
from distribute.keras_support.data_adapter import adapt
from distribute.mesh_strategy import MeshStrategy


# -- the per-step cost of Keras' loop, for models compiled in a strategy's scope --------
# Keras' JAX loop stores the step's state on the model every step (``self._jax_state =
# {...}``), and Layer.__setattr__ walks it for variables and layers to track (about
# 0.2 ms a step on the mlp workload). It holds arrays only, read back by
# ``jax_state_sync``; nothing in it is ever tracked. For a distributed model it is stored
# as is.
_LOOP_STATE = frozenset({"_jax_state", "_jax_state_synced"})


def untracked_loop_state(original):
    def __setattr__(self, name, value):
        if name in _LOOP_STATE and self.__dict__.get("_distribute_strategy") is not None:
            object.__setattr__(self, name, value)
            return
        original(self, name, value)

    return __setattr__


def _listens(callbacks: list, kind: str) -> bool:
    """Whether any callback overrides the ``on_<kind>batch_end`` hook (or ``on_batch_end`` for train)."""
    names = (f"on_{kind}_batch_end", "on_batch_end") if kind == "train" else (f"on_{kind}_batch_end",)
    return any(not getattr(getattr(c, n, None), "_is_default", False) for c in callbacks for n in names)


def batch_end(original, kind):
    """``CallbackList.on_<kind>batch_end``: nothing to do when no callback listens (distributed models).

    Keras hands every step's logs to a thread that converts them to Python floats
    (a device-to-host read per metric) and then calls hooks that do nothing
    (History, and every callback without batch hooks). For a distributed model,
    when no callback in the list overrides the hook, the call is skipped: no callback
    could observe it. Any callback with a batch hook (the progress bar, a user's)
    gets every step's logs exactly as from Keras.
    """

    def method(self, batch, logs=None):
        # Callback.model (a property) would sync the loop's state into the model's variables.
        if model_strategy(self.__dict__.get("_model")) is not None and not _listens(self.callbacks, kind):
            return None
        return original(self, batch, logs)

    return method


def model_strategy(model: Any) -> Any:
    return getattr(model, "__dict__", {}).get("_distribute_strategy")


def compile_wrapper(original):
    def compile(self, *args, **kwargs):
        strategy = _context.scope_strategy()
        if strategy is None:
            owners = {getattr(v, "_distribute_strategy", None) for v in self.weights}
            owners.discard(None)
            strategy = owners.pop() if len(owners) == 1 else None
        object.__setattr__(self, "_distribute_strategy", strategy)
        if strategy is None:
            return original(self, *args, **kwargs)
        with strategy.scope():
            result = original(self, *args, **kwargs)
        given = [kwargs.get(name, args[i] if len(args) > i else None) for i, name in ((3, "metrics"), (4, "weighted_metrics"))]
        _adopt_metrics_made_outside(strategy, [m for m in tree.flatten(given) if isinstance(m, keras.metrics.Metric)])
        return result

    return compile


def _adopt_metrics_made_outside(strategy: Any, metrics: list) -> None:
    """Makes metrics created outside every scope ``strategy``'s (TF's answer for compile).

    A metric object created outside ``strategy.scope()`` (TF's tutorials build
    ``METRICS = [...]`` at module level) and passed to ``compile`` inside it
    trains in TF as if it had been created inside.  Its state (SyncOnRead
    variables) is replicated onto the strategy's devices, keeping its value (the
    cross-replica value), and belongs to ``strategy`` from then on.  Layers' and
    optimizers' variables are never taken (a model or optimizer made outside stays
    a ValueError).
    """
    if not isinstance(strategy, MeshStrategy):
        return
    for metric in metrics:
        if getattr(metric, "_distribute_strategy", None) is not None:
            continue
        for var in metric.variables:
            if getattr(var, "_distribute_strategy", None) is None and var._value is not None and var.synchronization == "on_read":
                var._distribute_strategy = strategy
                var._distribute_placement = strategy.extended.place_variable(var)
                var._layout = var._distribute_placement.layout
                var._value = jax.device_put(var._value, var._layout)
        object.__setattr__(metric, "_distribute_strategy", strategy)


def in_scope(original):
    """fit/evaluate/predict and the *_on_batch methods: read distribute.data.Dataset inputs, run in the model's strategy scope."""

    # Positions of the arguments that may be datasets: x, and fit's validation_data.
    positions = (0, 7) if original.__name__ == "fit" else (0,)

    def method(self, *args, **kwargs):
        strategy = model_strategy(self)
        args = tuple(adapt(a, strategy) if i in positions else a for i, a in enumerate(args))
        for name in ("x", "validation_data"):
            if name in kwargs:
                kwargs[name] = adapt(kwargs[name], strategy)
        if strategy is None or (original.__name__.endswith("_on_batch") and not isinstance(strategy, MeshStrategy)):
            return original(self, *args, **kwargs)  # *_on_batch: mesh strategies only (ParameterServerStrategy: as before)
        if original.__name__ == "fit":
            self.__dict__["_distribute_partial_rows"] = _partial_rows(args, kwargs)
        try:
            with strategy.scope(), interrupts.kept() if isinstance(strategy, MeshStrategy) else contextlib.nullcontext():
                return original(self, *args, **kwargs)
        finally:
            self.__dict__.pop("_distribute_partial_rows", None)

    return method


def _partial_rows(args: tuple, kwargs: dict) -> int | None:
    """Rows of the last, partial training batch of ``fit(x, ..., batch_size)`` on arrays; None if unknown or none.

    Follows Keras: ``batch_size`` defaults to 32 and ``validation_split`` keeps
    the first ``floor(n * (1 - split))`` rows for training.
    """
    x = kwargs.get("x", args[0] if args else None)
    batch_size = kwargs.get("batch_size", args[2] if len(args) > 2 else None) or 32
    if kwargs.get("steps_per_epoch") is not None or len(args) > 12 or isinstance(x, DataAdapter):
        return None
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(x) if isinstance(leaf, (np.ndarray, jax.Array))]
    if not leaves or not getattr(leaves[0], "ndim", 0):
        return None
    rows = int(leaves[0].shape[0])
    split = kwargs.get("validation_split", args[6] if len(args) > 6 else 0.0) or 0.0
    if split and kwargs.get("validation_data", args[7] if len(args) > 7 else None) is None:
        rows = int(np.floor(rows * (1.0 - float(split))))
    partial = rows % int(batch_size)
    return partial or None


def routed_to(kind: str):
    """The ``Patch.wrap`` of ``make_<kind>_function``."""
    return functools.partial(routed, kind=kind)


def batch_end_of(kind: str):
    """The ``Patch.wrap`` of ``CallbackList.on_<kind>_batch_end``."""
    return functools.partial(batch_end, kind=kind)


def routed(original, kind):
    def make_function(self, force=False):
        strategy = model_strategy(self)
        if strategy is None:
            return original(self, force)
        return trainer.make_function(self, strategy, force, kind)

    return make_function
