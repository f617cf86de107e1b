"""The Keras seam for replica threads: private Keras state that an uneven step must handle.

Keras keeps some settings per thread (``keras.src.backend.common.global_state``:
the dtype policy, the autocast scope, the current Keras distribution); an
uneven step runs every replica in a thread of its own, which must see the
caller's settings.  And some per-call state lives on shared Keras objects
(``Layer._losses_override``); it is made per thread here.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

from keras.src.backend.common import global_state

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
    from keras.src.layers.layer import Layer

    for name, make_default in _PER_THREAD_LAYER_ATTRIBUTES.items():
        if not isinstance(Layer.__dict__.get(name), _PerThread):
            setattr(Layer, name, _PerThread(name, make_default))
