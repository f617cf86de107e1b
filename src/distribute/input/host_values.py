"""Non-numeric features (strings, objects) in distributed input: host-side values per replica.

Accelerators hold numbers only. A non-numeric component of an element
(``dtype.kind`` S, U or O) is replaced, before splitting, by the int32 ids of
its rows; the ids go through exactly the same split, sharding and
end-of-data agreement as every numeric component, and each replica's ids are
looked up again in the host array afterwards. So a string feature is split
with TF's layout (``ceil(n / replicas)`` rows per replica, in order) and comes
back as a ``HostPerReplica`` of numpy arrays, one per local replica.

A ``HostPerReplica`` can be read with ``experimental_local_results`` (and
``.values``); passing it into ``strategy.run`` (or ``reduce``/``gather``)
raises a TypeError that names the feature: turn strings into numbers in the
input pipeline instead (TF 2.21 takes string tensors into ``run``).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from distribute.data._structure import is_host_leaf
from distribute.values import PerReplica

_KEPT_ELEMENTS = 256  # host arrays kept for lookup; the iterator is at most a few elements ahead
_MAX_ID = 2**31 - 1


class HostPerReplica(PerReplica):
    """A PerReplica of host numpy values (a non-numeric feature), one per local replica.

    Raises:
        TypeError: on entering a compiled computation (``strategy.run``,
            ``reduce``, ``gather``); the message names the feature and the fix.
    """

    __slots__ = ("_dtype", "_feature", "_host_values")

    @classmethod
    def _from_host(cls, strategy: Any, values: list[Any], feature: str) -> HostPerReplica:
        self = cls.__new__(cls)
        self._strategy = strategy
        self._host_values = tuple(values)
        self._feature = feature
        self._dtype = np.asarray(values[0]).dtype if values else np.dtype("S")
        self._lengths = None
        self._cached_local = None
        self._sum = None
        return self

    def _local_values(self) -> tuple:
        return self._host_values

    @property
    def _array(self) -> Any:
        raise TypeError(
            f"Input feature {self._feature} holds non-numeric values (dtype {self._dtype}), which cannot enter a "
            "compiled computation (strategy.run, reduce, gather). Turn it into numbers in the input pipeline, "
            "e.g. dataset.map(lambda features: {**features, 'name': lookup(features['name'])}) with a vocabulary "
            "dict, or read it on the host with strategy.experimental_local_results(value)."
        )


class HostCodec:
    """Replaces host leaves by row ids while iterating, and looks replicas' ids up again.

    One codec serves one pass of a distributed dataset (one iterator).
    """

    def __init__(self) -> None:
        self._next_id = 0
        self._elements: collections.deque[tuple[int, int, list[Any]]] = collections.deque(maxlen=_KEPT_ELEMENTS)

    def encode(self, leaves: list[Any], host: list[int]) -> list[Any]:
        """``leaves`` with every position in ``host`` replaced by int32 row ids of the same leading shape."""
        first = leaves[host[0]]
        num_rows = 1 if np.ndim(first) == 0 else int(np.shape(first)[0])
        if self._next_id + num_rows > _MAX_ID:
            self._next_id = 0
        start = self._next_id
        self._next_id += num_rows
        self._elements.append((start, num_rows, [leaves[j] for j in host]))
        out = list(leaves)
        for j in host:
            out[j] = np.int32(start) if np.ndim(leaves[j]) == 0 else np.arange(start, start + num_rows, dtype=np.int32)
        return out

    def decode(self, ids: Any, position: int) -> Any:
        """The host rows with ``ids`` (one replica's piece) of host leaf number ``position``."""
        ids = np.asarray(ids)
        if ids.size == 0:
            template = self._elements[-1][2][position] if self._elements else np.zeros(0, "S1")
            return np.asarray(template)[:0]
        first = int(ids.reshape(-1)[0])
        for start, num_rows, values in reversed(self._elements):
            if start <= first < start + num_rows:
                value = values[position]
                if np.ndim(value) == 0:
                    return value
                return np.asarray(value)[ids - start]
        raise AssertionError(f"host rows {first}.. were dropped before use")  # more than _KEPT_ELEMENTS ahead


def host_positions(leaves: list[Any]) -> list[int]:
    return [j for j, leaf in enumerate(leaves) if is_host_leaf(leaf)]


def feature_names(treedef: Any) -> list[str]:
    """Readable paths of the leaves of ``treedef`` (``['name']``, ``[0]``, ``element``)."""
    import jax

    dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    paths = jax.tree_util.tree_flatten_with_path(dummy)[0]
    return ["".join(str(k) for k in path) or "element" for path, _ in paths]
