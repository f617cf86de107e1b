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

# The Keras this seam was written against (pyproject pins it). Another version is not refused
# here: tests/test_keras_seam.py checks every patched attribute and its signature instead, so an
# upgrade fails in one named test, not at import.
SUPPORTED_KERAS = ("3.15",)

from keras.src import backend as keras_backend  # noqa: E402
from keras.src import tree  # noqa: E402
from keras.src.losses import loss as loss_module  # noqa: E402
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
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer  # noqa: E402
from keras.src.random.seed_generator import SeedGenerator  # noqa: E402
from keras.src.trainers import data_adapters  # noqa: E402
from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: E402
from keras.src.trainers.data_adapters.data_adapter import DataAdapter  # noqa: E402
from keras.src.trainers.trainer import Trainer  # noqa: E402
from keras.src.utils import rng_utils  # noqa: E402
from keras.src.initializers.random_initializers import compute_fans  # noqa: E402
from keras.src.random.seed_generator import draw_seed  # noqa: E402
from keras.src.saving.saving_lib import H5IOStore  # noqa: E402

__all__ = [
    "BaseOptimizer", "BatchNormalization", "DataAdapter", "H5IOStore", "JAXTrainer", "JaxVariable", "KerasVariable", "Layer",
    "LossScaleOptimizer", "Metric", "compute_fans", "draw_seed", "Patch", "SeedGenerator", "StatelessScope", "Trainer", "copy_thread_state", "data_adapter_utils",
    "data_adapters", "get_stateless_scope", "global_state", "initialize_all_variables", "install", "installed",
    "keras_backend", "loss_module", "per_thread", "placeholder_value", "rng_utils", "tree",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Patch:
    """One replacement of a Keras attribute: a row of ``keras_support/patches.py``'s table.

    Attributes:
        owner: the Keras class or module.
        attribute: the attribute's name.
        wrap: ``wrap(original) -> replacement`` (the original is Keras' attribute, or
            the replacement an earlier row made of it).
        signature: ``str(inspect.signature(original))`` of Keras' own attribute as this
            package was written against (Keras 3.15), checked by the seam test; None
            for an instance attribute (set in ``__init__``, not on the class).
        why: one line: what the replacement does.
    """

    owner: Any
    attribute: str
    wrap: Callable[[Any], Any]
    signature: str | None
    why: str


_INSTALLED: list[Patch] = []  # in installation order


def install(rows: "tuple[Patch, ...] | list[Patch]") -> None:
    """Installs each row not installed yet, in order (idempotent, process-wide).

    Raises:
        AttributeError: this Keras has no such class attribute (the seam needs
            updating for a new Keras version).
    """
    for row in rows:
        if any(row is done for done in _INSTALLED):
            continue
        original = row.owner.__dict__.get(row.attribute) if isinstance(row.owner, type) else None
        original = original if original is not None else getattr(row.owner, row.attribute, None)
        if original is None and row.signature is not None:
            raise AttributeError(
                f"Keras {keras.__version__} has no {getattr(row.owner, '__name__', row.owner)}.{row.attribute}, which "
                f"distribute patches; install a supported Keras ({', '.join(SUPPORTED_KERAS)}.x)."
            )
        replacement = row.wrap(original)
        if callable(replacement) and callable(original) and not isinstance(replacement, type):
            functools.update_wrapper(replacement, original)
        setattr(row.owner, row.attribute, replacement)
        _INSTALLED.append(row)


def installed() -> tuple:
    """The rows installed so far, in order."""
    return tuple(_INSTALLED)


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


def per_thread(name: str, make_default: Callable[[], Any]) -> Callable[[Any], _PerThread]:
    """A ``Patch.wrap`` that makes instance attribute ``name`` per thread (``make_default()`` on first read)."""

    def wrap(_original: Any) -> _PerThread:
        return _PerThread(name, make_default)

    return wrap


def placeholder_value(variable: Any) -> Any:
    """What Keras reads for a variable created while a program is traced (its value is deferred):
    its initializer's output (``Variable.value``'s own fallback)."""
    return variable._initializer(variable._shape, dtype=variable._dtype)
