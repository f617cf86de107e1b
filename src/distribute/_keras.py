"""The Keras seam: every private Keras name this package uses, and every patch it makes.

Keras keeps each backend behind a few functions and classes; this package
reaches into ``keras.src`` for the ones tf.distribute's model needs (stateless
scopes to lift variables into programs, the JAX trainer's step functions, the
classes it patches).  They are all imported here, once, after a Keras version
check; ``patch`` refuses an attribute this Keras no longer has, and
``PATCHED`` lists every patched attribute (a test checks each still exists in
Keras itself).

Keras also keeps some settings per thread (``global_state``: the dtype policy,
the autocast scope, the current Keras distribution); an uneven step runs every
replica in a thread of its own, which must see the caller's settings.  And some
per-call state lives on shared Keras objects (``Layer._losses``); it is made per
thread here.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable

import keras

SUPPORTED_KERAS = ("3.15",)
if not keras.__version__.startswith(SUPPORTED_KERAS):  # pragma: no cover - pinned in pyproject
    raise ImportError(
        f"distribute supports Keras {', '.join(SUPPORTED_KERAS)}.x, found {keras.__version__}; "
        "install a supported version: pip install 'keras>=3.15,<3.16'."
    )

from keras.src import backend as keras_backend  # noqa: E402
from keras.src import tree  # noqa: E402
from keras.src.backend.common import global_state  # noqa: E402
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope  # noqa: E402
from keras.src.backend.common.variables import Variable as KerasVariable  # noqa: E402
from keras.src.backend.common.variables import initialize_all_variables  # noqa: E402
from keras.src.backend.jax.core import JaxVariable  # noqa: E402
from keras.src.backend.jax.trainer import JAXTrainer  # noqa: E402
from keras.src.layers.layer import Layer  # noqa: E402
from keras.src.layers.normalization.batch_normalization import BatchNormalization  # noqa: E402
from keras.src.metrics.metric import Metric  # noqa: E402
from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: E402
from keras.src.random.seed_generator import SeedGenerator  # noqa: E402
from keras.src.trainers import data_adapters  # noqa: E402
from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: E402
from keras.src.trainers.data_adapters.data_adapter import DataAdapter  # noqa: E402
from keras.src.trainers.trainer import Trainer  # noqa: E402
from keras.src.utils import rng_utils  # noqa: E402

__all__ = [
    "BaseOptimizer", "BatchNormalization", "DataAdapter", "JAXTrainer", "JaxVariable", "KerasVariable", "Layer",
    "Metric", "PATCHED", "SeedGenerator", "StatelessScope", "Trainer", "copy_thread_state", "data_adapter_utils",
    "data_adapters", "get_stateless_scope", "global_state", "initialize_all_variables", "install_per_thread_attributes",
    "keras_backend", "patch", "placeholder_value", "rng_utils", "tree",
]

# (owner, attribute) of every patch this package makes, filled by ``patch``.
PATCHED: list[tuple[Any, str]] = []


def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replaces ``owner.name`` by ``make(original)`` (keeping its name and docstring).

    Raises:
        AttributeError: this Keras has no ``owner.name`` (the seam needs updating
            for a new Keras version).
    """
    original = getattr(owner, name, None)
    if original is None:
        raise AttributeError(
            f"Keras {keras.__version__} has no {getattr(owner, '__name__', owner)}.{name}, which distribute "
            f"patches; install a supported Keras ({', '.join(SUPPORTED_KERAS)}.x)."
        )
    wrapper = make(original)
    if callable(wrapper) and callable(original):
        functools.update_wrapper(wrapper, original)
    setattr(owner, name, wrapper)
    PATCHED.append((owner, name))


# Per-thread Keras attributes that belong to the thread's own call in progress.
_NOT_COPIED = frozenset({"stateless_scope", "uninitialized_variables", "current_call_context", "symbolic_scope"})


@dataclasses.dataclass(frozen=True)
class ThreadState:
    attributes: dict

    def apply(self) -> None:
        """Sets the recorded attributes on the calling thread."""
        for name, value in self.attributes.items():
            global_state.set_global_attribute(name, value)


def copy_thread_state() -> ThreadState:
    """The calling thread's Keras settings, to apply in a replica thread."""
    tracker: Any = global_state.GLOBAL_STATE_TRACKER
    return ThreadState({k: v for k, v in vars(tracker).items() if k not in _NOT_COPIED})


# -- per-thread Keras attributes ------------------------------------------------------------
class _PerThread:
    """A data descriptor whose value is per (object, thread): replica threads share Keras objects.

    Keras keeps a call's losses on the layer (``_losses``, ``_loss_ids``, cleared
    at every call) and its JAX trainer hands a forward pass's losses to
    ``compute_loss`` through ``_losses_override``; in an uneven step every
    replica's thread does that on the same model at once.
    """

    def __init__(self, name: str, make_default: Any):
        self._name, self._make_default = name, make_default
        self._local = threading.local()

    def _values(self) -> "weakref.WeakKeyDictionary":
        values = getattr(self._local, "values", None)
        if values is None:
            values = self._local.values = weakref.WeakKeyDictionary()
        return values

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        values = self._values()
        if obj not in values:
            values[obj] = self._make_default()
        return values[obj]

    def __set__(self, obj: Any, value: Any) -> None:
        self._values()[obj] = value


_PER_THREAD_LAYER_ATTRIBUTES = {"_losses": list, "_loss_ids": set, "_losses_override": list}


def install_per_thread_attributes() -> None:
    """Makes the per-call loss attributes of Keras layers per thread (idempotent)."""
    for name, make_default in _PER_THREAD_LAYER_ATTRIBUTES.items():
        if not isinstance(Layer.__dict__.get(name), _PerThread):
            setattr(Layer, name, _PerThread(name, make_default))
            PATCHED.append((Layer, name))


def placeholder_value(variable: Any) -> Any:
    """What Keras reads for a variable created while a program is traced (its value is deferred):
    its initializer's output (``Variable.value``'s own fallback)."""
    return variable._initializer(variable._shape, dtype=variable._dtype)
