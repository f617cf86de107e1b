"""Where a variable made in a strategy's scope lives: the answers to ``StrategyExtended.place_variable``.

Every Keras variable created inside a strategy's scope asks its strategy once,
at creation, ``extended.place_variable(variable)``, and keeps the answer
(``variable._distribute_placement``). The answer decides:

* its storage: ``layout``, the sharding its value gets (None: Keras' default
  device);
* what a read in cross-replica context returns (``read``): TF's
  ``_get_cross_replica``;
* the strategy's hooks at creation, first value, read and assignment
  (``on_created``, ``on_initialized``, ``before_read``, ``on_assign``);
* how it enters and leaves a mesh strategy's compiled step (the engine asks
  the placement, nothing else): its ``shard_map`` spec (``in_spec`` /
  ``out_spec``), its program input, what a replica reads from its block
  (``replica_value``), how the replicas' new values are combined
  (``combine``) and stored (``program_output``, ``store``), and in an uneven
  step (one thread per replica) its copy on a device (``local_value``) and the
  store of the replicas' results (``store_from_replicas``);
* ``update_dim``: the dim along which an optimizer updates the variable's
  slices (sharded state, ``sharding.py``), or None (the whole variable).

Answers today: :class:`Replicated` (TF's MirroredVariable: one identical copy
per replica), :class:`Sharded` (split over the replicas: sharded state),
``sync_on_read.SyncOnRead`` (one copy per replica, aggregated on read), and
ParameterServerStrategy's (on a ps, ``parameter_server/strategy.py``).
Keras reaches these only through the patches in ``keras_support/patches.py``;
nothing else reads a strategy's mesh to decide placement.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from distribute import collectives
from distribute.sharding import spec_entries


class Placement:
    """Where one variable lives and how it is read (the base answer: Keras' own, unchanged).

    Attributes:
        layout: the ``jax.sharding.Sharding`` the variable's value is created
            with, or None (Keras' default device).
        update_dim: the dim an optimizer updates slices of this variable along
            (its slots are split there), or None.
    """

    layout: Any = None
    update_dim: int | None = None
    split = False  # True: the value is split over the replicas (its layout wins over one Keras passes)

    def on_created(self, variable: Any) -> None:
        """After the variable's constructor (its first value may be deferred: a variable made while tracing)."""

    def on_initialized(self, variable: Any) -> None:
        """After its first value is set."""

    def read(self, variable: Any, value: Any) -> Any:
        """What a read in cross-replica context returns, given the stored ``value``."""
        return value

    def initialize_with(self, variable: Any, initializer: Any) -> bool:
        """Called instead of Keras making the first value from ``initializer``; True: the placement made it
        elsewhere (a parameter server makes a large variable on its ps), so Keras makes nothing here."""
        return False

    def remote(self, variable: Any) -> bool:
        """Whether this process holds no value of the variable (a large ps variable; ``stored`` gathers it)."""
        return False

    def table_parts(self, variable: Any, name: str) -> list:
        """A remote variable (``remote``): the parts ``[{"file", "start", "stop"}]`` ``save_parts`` writes it as."""
        raise NotImplementedError(f"variable '{variable.path}' is held here; a checkpoint stores its value")

    def save_parts(self, variable: Any, directory: str, name: str) -> list:
        """A remote variable (``remote``): writes it where it lives into ``directory`` (``checkpoint/_tables.py``);
        returns its parts (``table_parts``)."""
        raise NotImplementedError(f"variable '{variable.path}' is held here; a checkpoint stores its value")

    def load_parts(self, variable: Any, table: Any) -> None:
        """A remote variable: reads a saved table (``_tables.TableRef``) where it lives, shard by shard."""
        raise NotImplementedError(f"variable '{variable.path}' is held here; restore assigns its value")

    def stored(self, variable: Any) -> Any:
        """The variable's stored value for a read outside any step (a parameter server gathers a variable
        the coordinator holds no copy of)."""
        return variable._value

    def before_read(self, variable: Any) -> None:
        """Before a read outside any compiled step (a parameter server's copy is made current)."""

    def on_assign(self, variable: Any) -> None:
        """After an assignment outside any compiled step (a parameter server is told)."""

    def sums_replica_writes(self, variable: Any) -> bool:
        """Whether a replica's write inside a step is summed over the replicas at once (``LiftingScope``)."""
        return False

    # -- the SPMD step (tracing.py, keras_support/trainer.py) -------------------------------
    def in_spec(self) -> Any:
        """The ``shard_map`` spec of the variable's program input."""
        return P()

    def out_spec(self) -> Any:
        """The ``shard_map`` spec of its program output (``program_output``'s structure)."""
        return P()

    def program_input(self, variable: Any) -> Any:
        """The array the program takes for the variable (its stored value, placed by ``layout``)."""
        return placed(variable._value, self.layout)

    def replica_value(self, context: Any, block: Any) -> Any:
        """What a replica's code reads from its block of the program input: the whole variable."""
        return block

    @classmethod
    def combine(cls, context: Any, variables: Sequence[Any], new: Sequence[Any], old: Sequence[Any],
                plain: frozenset = frozenset(), updates: frozenset = frozenset()) -> list:
        """Every replica's new values of assigned variables of this class, combined (``ReplicaContext._combine_all``).

        Called by the replica (in the SPMD program or an uneven step's thread) with
        its own ``new`` / ``old`` values; see ``combine_all``.
        """
        return context._combine_all(list(variables), list(new), list(old), plain, updates)

    def program_output(self, context: Any, combined: Any) -> Any:
        """The program output of the variable from its ``combine`` result."""
        return combined

    def store(self, variable: Any, output: Any) -> None:
        """Stores the program output as the variable's value."""
        variable._value = output

    # -- an uneven step: one thread per replica (uneven_step.py) ----------------------------
    def local_value(self, variable: Any, device: Any) -> Any:
        """The variable's whole value on ``device`` (its copy there)."""
        value = variable._value
        if isinstance(value, jax.Array) and device in value.sharding.addressable_devices:
            local = collectives.local_buffers(value)[device]
            if local.shape == value.shape:
                return local
        return jax.device_put(value, device)

    def prepare_local(self, variable: Any) -> None:
        """Called on the main thread before an uneven step's replica threads read ``local_value``."""

    def store_from_replicas(self, variable: Any, strategy: Any, combined: list) -> None:
        """Stores this worker's replicas' ``combine`` results (identical) as the variable's value."""
        variable._value = collectives.replicated_from_local(strategy, combined)


class Replicated(Placement):
    """One identical copy on every replica's device (TF's MirroredVariable).

    The value is one replicated ``jax.Array`` over the strategy's mesh. A read
    in cross-replica context is one device's copy (``ReplicaMesh.local_copy``: the
    current device's if it is a replica's, else the first local replica's), as
    TF's ``MirroredVariable._get_cross_replica``; no transfer.

    Args:
        replica_mesh: the strategy's ``ReplicaMesh``.
        update_dim: the dim an optimizer updates slices of it along (its slots
            are ``Sharded`` there: ``Sharding.OPTIMIZER_STATE`` / ``GRADIENTS``), or None.
    """

    def __init__(self, replica_mesh: Any, update_dim: int | None = None):
        self.replica_mesh = replica_mesh
        self.layout = replica_mesh.replicated_sharding
        self.update_dim = update_dim

    def read(self, variable: Any, value: Any) -> Any:
        return self.replica_mesh.local_copy(value)

    def sums_replica_writes(self, variable: Any) -> bool:
        """A ``sum`` MirroredVariable: TF reduces its writes in replica context when they happen.

        Two replicas writing ``assign_add(1.0)`` and ``assign_add(2.0)`` leave
        ``old + 3.0``, and both read ``old + 3.0`` in the rest of the step.
        """
        return variable.aggregation == "sum" and variable.synchronization != "on_read"


class Sharded(Placement):
    """Split over the replicas along one dim (sharded state, ``sharding.py``).

    The value is one ``jax.Array`` of the variable's shape, each replica's
    device holding ``shape[dim] / num_replicas`` of it along ``dim``. A read in
    cross-replica context (``v.numpy()``, ``v.value``, ``get_weights()``, a
    checkpoint, ``predict``) is the whole value, gathered onto one device (the
    device of a replicated variable's read). Inside a step each replica reads
    the whole value too (gathered at the step's start); an optimizer updates the
    replica's slice only, and the slice is what the step stores.

    Across workers a cross-replica read is a collective: every worker reads the
    variable (``v.numpy()``, ``get_weights()``, ``model.save`` on every worker, as
    TF's multi-worker tutorial saves); the workers first meet through ``meet``, so
    a worker that does not read it makes the others raise after the strategy's
    timeout, naming it, instead of waiting for ever.

    Args:
        replica_mesh: the strategy's ``ReplicaMesh``.
        dim: the dim it is split along.
        ndim: the variable's rank.
        meet: ``meet(local, what)``: every worker's ``local`` (a bounded wait;
            ``MeshExtended.agree_on_shapes``), called before a read spanning workers.
    """

    split = True

    def __init__(self, replica_mesh: Any, dim: int, ndim: int, meet: Any = None):
        self.replica_mesh = replica_mesh
        self._meet = meet
        self.update_dim = dim
        self.spec = P(*spec_entries(dim, ndim))
        self.layout = NamedSharding(replica_mesh.mesh, self.spec)
        self._whole: tuple | None = None  # (stored value, its replicated copy): prepare_local

    def read(self, variable: Any, value: Any) -> Any:
        if isinstance(value, jax.Array) and not value.is_fully_addressable and self._meet is not None:
            self._meet([], f"the read of variable '{variable.path}', which is split over every worker's replicas "
                           "(sharded state): every worker reads it together (call v.numpy(), get_weights(), "
                           "model.save() on every worker)")
        return self.replica_mesh.whole_copy(value)

    def in_spec(self) -> Any:
        return self.spec

    def out_spec(self) -> Any:
        return self.spec

    def replica_value(self, context: Any, block: Any) -> Any:
        return context._slices.gather(block, self.update_dim)

    def program_output(self, context: Any, combined: Any) -> Any:
        return context._slices.part(combined, self.update_dim)

    def local_value(self, variable: Any, device: Any) -> Any:
        value = variable._value
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            known = self._whole
            if known is None or known[0] is not value:
                raise AssertionError("a split variable spanning workers was read in an uneven step before prepare_local")
            return next(s.data for s in known[1].addressable_shards if s.device == device)
        return jax.device_put(value, device)

    def prepare_local(self, variable: Any) -> None:
        """Before an uneven step's threads start: a variable spanning workers is gathered once (a collective)."""
        value = variable._value
        if isinstance(value, jax.Array) and not value.is_fully_addressable and (self._whole is None or self._whole[0] is not value):
            self._whole = (value, self.replica_mesh.replicate(value))

    def store_from_replicas(self, variable: Any, strategy: Any, combined: list) -> None:
        self._whole = None
        variable._value = placed(collectives.replicated_from_local(strategy, combined), self.layout)


def placed(value: Any, sharding: Any) -> Any:
    """``value`` with ``sharding`` (None: as it is); an array spanning workers is resharded by a program."""
    if sharding is None or (isinstance(value, jax.Array) and value.sharding == sharding):
        return value
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return _reshard_program(sharding)(value)
    return jax.device_put(value, sharding)


def committed(value: Any, sharding: Any) -> Any:
    """``value`` committed to ``sharding`` (None: as it is), as a variable's stored value.

    Keras keeps an uncommitted array whose sharding merely fits the layout (one
    device's array for a mesh of one device); a compiled step takes it as an
    input of unspecified sharding, and then its own (committed) output as
    another, which compiled each step twice at one replica.
    """
    if sharding is None or not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
        return value
    if value.committed and value.sharding.is_equivalent_to(sharding, value.ndim):
        return value
    return placed(value, sharding)


@functools.lru_cache(maxsize=None)
def _reshard_program(sharding: Any) -> Any:
    return jax.jit(lambda a: a, out_shardings=sharding)


# -- the engine's questions about several variables at once ----------------------------------
def of(variable: Any, replica_mesh: Any) -> Placement:
    """``variable``'s placement; a variable without one (made outside every scope) counts as replicated."""
    placement = variable.__dict__.get("_distribute_placement")
    return placement if placement is not None else Replicated(replica_mesh)


def in_specs(placements: Sequence[Placement]) -> list:
    return [p.in_spec() for p in placements]


def out_specs(placements: Sequence[Placement]) -> list:
    return [p.out_spec() for p in placements]


def combine_all(context: Any, variables: Sequence[Any], placements: Sequence[Placement], new: Sequence[Any],
                old: Sequence[Any], plain: frozenset = frozenset(), updates: frozenset = frozenset()) -> list:
    """Every assigned variable's combined new value, each group of placements by its class's ``combine``.

    ``new`` / ``old``: this replica's values. One ``combine`` call per placement
    class, so its collectives are batched (one all-reduce for every SyncOnRead
    aggregate).
    """
    new = [jnp.asarray(n, dtype=o.dtype) for n, o in zip(new, old)]
    out: list = [None] * len(variables)
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(placements):
        groups.setdefault(type(p).combine.__func__, []).append(i)
    for combine, index in groups.items():
        owner = type(placements[index[0]])
        results = combine(owner, context, [variables[i] for i in index], [new[i] for i in index], [old[i] for i in index], plain, updates)
        for i, value in zip(index, results):
            out[i] = value
    return out


class StateLayout:
    """How a compiled Keras fit step holds its state (``keras_support/trainer.py``): each variable's stored
    value, split as stored (``Sharded``) or whole (a SyncOnRead variable's aggregate too: fit keeps
    totals, not copies).

    Args:
        parts: the state's variables, one list per part (trainable, non-trainable, ...).
        replica_mesh: the strategy's ``ReplicaMesh``.
    """

    _WHOLE = Placement()

    def __init__(self, parts: Sequence[Sequence[Any]], replica_mesh: Any):
        self.places = [[p if isinstance(p, Sharded) else self._WHOLE for p in (of(v, replica_mesh) for v in part)] for part in parts]
        self.split = any(isinstance(p, Sharded) for part in self.places for p in part)

    def spec(self) -> Any:
        """The state's ``shard_map`` spec: one per variable where some are split, else P() for all."""
        return tuple([p.in_spec() for p in part] for part in self.places) if self.split else P()

    def replica_values(self, context: Any, state: Any) -> Any:
        """The state (a tuple of lists) as the replica's step reads it: split values gathered."""
        return self._map(lambda p, x: p.replica_value(context, x), state)

    def program_outputs(self, context: Any, state: Any) -> Any:
        """The step's new state as the program returns it: split values sliced again."""
        return self._map(lambda p, x: p.program_output(context, x), state)

    def _map(self, fn: Any, state: Any) -> Any:
        if not self.split:
            return state
        return type(state)([fn(p, x) for p, x in zip(places, part)] for places, part in zip(self.places, state))
