"""Where a variable made in a strategy's scope lives: the answers to ``StrategyExtended.place_variable``.

Every Keras variable created inside a strategy's scope asks its strategy once,
at creation, ``extended.place_variable(variable)``, and keeps the answer
(``variable._distribute_placement``). The answer decides:

* its storage: ``layout``, the sharding its value gets (None: Keras' default
  device);
* what a read in cross-replica context returns (``read``): TF's
  ``_get_cross_replica``;
* the strategy's hooks at creation, first value, read and assignment
  (``on_created``, ``on_initialized``, ``before_read``, ``on_assign``).

Answers today: :class:`Replicated` (TF's MirroredVariable: one identical copy
per replica), ``sync_on_read.SyncOnRead`` (one copy per replica, aggregated on
read), and ParameterServerStrategy's (on a ps, ``parameter_server/strategy.py``).
Keras reaches these only through the patches in ``keras_support/patches.py``;
nothing else reads a strategy's mesh to decide placement.
"""

from __future__ import annotations

from typing import Any


class Placement:
    """Where one variable lives and how it is read (the base answer: Keras' own, unchanged).

    Attributes:
        layout: the ``jax.sharding.Sharding`` the variable's value is created
            with, or None (Keras' default device).
    """

    layout: Any = None

    def on_created(self, variable: Any) -> None:
        """After the variable's constructor (its first value may be deferred: a variable made while tracing)."""

    def on_initialized(self, variable: Any) -> None:
        """After its first value is set."""

    def read(self, variable: Any, value: Any) -> Any:
        """What a read in cross-replica context returns, given the stored ``value``."""
        return value

    def before_read(self, variable: Any) -> None:
        """Before a read outside any compiled step (a parameter server's copy is made current)."""

    def on_assign(self, variable: Any) -> None:
        """After an assignment outside any compiled step (a parameter server is told)."""


class Replicated(Placement):
    """One identical copy on every replica's device (TF's MirroredVariable).

    The value is one replicated ``jax.Array`` over the strategy's mesh. A read
    in cross-replica context is one device's copy (``ReplicaMesh.local_copy``: the
    current device's if it is a replica's, else the first local replica's), as
    TF's ``MirroredVariable._get_cross_replica``; no transfer.

    Args:
        replica_mesh: the strategy's ``ReplicaMesh``.
    """

    def __init__(self, replica_mesh: Any):
        self.replica_mesh = replica_mesh
        self.layout = replica_mesh.replicated_sharding

    def read(self, variable: Any, value: Any) -> Any:
        return self.replica_mesh.local_copy(value)
