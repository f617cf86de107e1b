"""What a ``GradientTape`` records about one run of a function: its tapes' states and its events.

A *level* is one run of an invocation's function (``_invocation.py``): the
original run (the engine's call) or a *replay* (that function run again as a
JAX trace by ``tape.gradient``, see ``_replay.py``).  Both see the same
sequence of events (tape entries and exits, variable reads while a tape
records, ``tape.watch`` calls, gradient calls), numbered in order: a replay
finds its counterpart of every event of the level that asked for it by number.

In a replay, events leave marks in the trace (``tape_marker`` equations, and
reads of watched variables pass through a ``tape_tag`` equation) that tell the
differentiation where each tape recorded.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from distribute import _context
from distribute._invocation import Invocation
import distribute.tape._marks as _marks

_LEVEL: contextvars.ContextVar["Level | None"] = contextvars.ContextVar("distribute_tape_level", default=None)


@dataclasses.dataclass(eq=False)
class TapeState:
    """One tape's state within one level (a tape object may be entered in several levels)."""

    ordinal: int
    persistent: bool
    watch_accessed: bool
    recording: bool = False
    epoch: int = 0  # bumped by reset(): earlier recordings no longer count
    used: bool = False  # a non-persistent tape computed its gradients
    watched: dict = dataclasses.field(default_factory=dict)  # id -> variable, watched explicitly
    accessed: dict = dataclasses.field(default_factory=dict)  # id -> variable, read while recording


class Level:
    """One run of ``invocation.fn``: the original one (``parent`` None) or a replay asked by ``parent``.

    ``stop_at``: the gradient call at which a replay stops; ``diff_tapes``: the
    ordinals of the tapes this replay and its ancestors differentiate.
    """

    def __init__(self, invocation: Invocation, parent: "Level | None" = None, stop_at: int | None = None,
                 diff_tapes: tuple = ()):
        self.invocation = invocation
        self.parent = parent
        self.replay = parent is not None
        self.stop_at = stop_at
        self.diff_tapes = diff_tapes
        self.trace = invocation.trace if parent is None else None  # a replay's: set when its trace starts
        self.states: dict[int, TapeState] = {}
        self.recording: list[TapeState] = []
        self.num_tapes = 0
        self.num_events = 0
        self.num_gradient_calls = 0
        self.cache: dict = {}
        self.values: dict[int, Any] = {}  # event number -> the read value / watched tensor in this level
        self.tags: dict[int, tuple] = {}  # read event number -> (variable, ((tape ordinal, epoch), ...))
        self.results: dict[int, Any] = {}  # the original run's gradient results, by call number
        self.snapshot_ids = {id(v) for v in invocation.snapshot.values()}
        self.context = _context.current_replica_context()

    @property
    def root(self) -> "Level":
        level = self
        while level.parent is not None:
            level = level.parent
        return level

    # -- tapes -------------------------------------------------------------------------------
    def state(self, tape: Any) -> TapeState | None:
        return self.states.get(id(tape))

    def is_recording(self, ordinal: int) -> bool:
        return any(s.ordinal == ordinal for s in self.recording)

    def enter(self, tape: Any) -> TapeState:
        state = self.states.get(id(tape))
        if state is None:
            state = self.states[id(tape)] = TapeState(self.num_tapes, tape._persistent, tape._watch_accessed_variables)
            self.num_tapes += 1
            self._keep = getattr(self, "_keep", []) + [tape]  # ids stay unique while the level lives
        self.start(state, "enter")
        return state

    def start(self, state: TapeState, kind: str) -> None:
        state.recording = True
        self.recording.append(state)
        self.mark(kind, state.ordinal)

    def stop(self, state: TapeState, kind: str) -> None:
        state.recording = False
        self.recording = [s for s in self.recording if s is not state]
        self.mark(kind, state.ordinal)

    def reset(self, state: TapeState) -> None:
        state.epoch += 1
        state.watched.clear()
        state.accessed.clear()
        state.used = False
        self.mark("reset", state.ordinal)

    def mark(self, kind: str, ordinal: int, key: int = -1, tensor: Any = None) -> None:
        if self.replay:
            _marks.marker(self, kind, ordinal, key, tensor)

    def in_own_trace(self) -> bool:
        with jax_core.take_current_trace() as trace:
            return trace is self.trace

    # -- events --------------------------------------------------------------------------------
    def next_event(self) -> int:
        self.num_events += 1
        return self.num_events - 1

    def on_read(self, scope: Any, variable: Any, value: Any) -> Any:
        """A variable read: recorded by every recording tape that watches it; tagged in a replay."""
        if not self.recording:
            return value
        watchers = tuple((s.ordinal, s.epoch) for s in self.recording if s.watch_accessed or id(variable) in s.watched)
        if not watchers:
            return value
        for s in self.recording:
            if s.watch_accessed or id(variable) in s.watched:
                s.accessed.setdefault(id(variable), variable)
        if not jnp.issubdtype(jnp.result_type(value), jnp.inexact):
            return value  # TF's tape does not watch integer variables
        cache_key = (id(variable), id(value), watchers)
        hit = self.cache.get(cache_key)
        if hit is not None:
            return hit[1]
        key = self.next_event()
        out = value
        if self.replay:
            out = _marks.tag(self, value, key, from_snapshot=id(value) in self.snapshot_ids)
        self.cache[cache_key] = (value, out)
        self.values[key] = out
        self.tags[key] = (variable, watchers)
        return out

    def watch_tensor(self, state: TapeState, tensor: Any) -> None:
        key = self.next_event()
        self.values[key] = tensor
        self.mark("watch", state.ordinal, key, tensor)

    def prepare_input(self, x: Any) -> Any:
        """An argument of the replayed call: its arrays per-replica (others unchanged)."""
        if isinstance(x, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(x.dtype, jnp.inexact):
            return self.prepare(x)
        return x

    def prepare(self, x: Any) -> Any:
        """``x`` as a per-replica value (its gradient stays this replica's, as TF's tape)."""
        if self.context is None:
            return x
        return self.context._prepare_for_gradients([x])[0]


def current_level(invocation: Invocation) -> Level:
    """The level running ``invocation``'s function now (its original run unless a replay is under way)."""
    level = _LEVEL.get()
    if level is not None and level.invocation is invocation:
        return level
    if invocation.tape_level is None:
        invocation.tape_level = Level(invocation)
    return invocation.tape_level


def is_tensor(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer))
