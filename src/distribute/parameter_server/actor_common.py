"""What both actors share: loading exported programs, a lock per actor, answering requests on a channel."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from distribute.parameter_server.channel import Server

# What Worker.run returns on a restarted worker the coordinator has not recovered
# yet (no iterators, no plans): the coordinator re-queues the closure and recovers it.
LOST = "lost"


def _load(cache: dict, program_id: int, box: list | None) -> Any:
    """The program ``box`` holds, deserialized once and wrapped in ``jax.jit``.

    ``Exported.call`` outside ``jit`` re-binds the call primitive (type checks,
    custom-vjp tracing) on every call, 1-2 ms on the mlp benchmark; under ``jit``
    a call is one cached dispatch.
    """
    program = cache.get(program_id)
    if program is None:
        import jax
        import ray

        if box is None:
            raise RuntimeError(f"program {program_id} was never sent here; this is a bug in distribute.")
        program = jax.jit(jax.export.deserialize(bytearray(ray.get(box[0]))).call)
        cache[program_id] = program
    return program


def start_warm_up(actor: Any = None) -> None:
    """Starts loading JAX's CPU backend in a thread of this actor's process (its first program needs it).

    Called as ``handle.__ray_call__.remote(start_warm_up)`` right after the actor
    is created: JAX loads (seconds on a loaded machine) while the coordinator
    builds the model, not in the first step (issue 27).
    """
    threading.Thread(target=load_jax, name="distribute-warm-up", daemon=True).start()


def load_jax() -> None:
    import jax

    jax.devices()


def _rows(parts: list) -> Any:
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def _locked(method: Any) -> Any:
    """Runs ``method`` holding the ps's lock: Ray calls and channel requests apply one at a time."""

    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


class _Served:
    """An actor that also answers requests on a channel (``channel.py``): ``(name of a method in REQUESTS, *args)``.

    Subclasses set ``_lock``, ``_server`` (None) and ``_name``.
    """

    REQUESTS: tuple[str, ...] = ()

    @_locked
    def channel(self) -> tuple:
        """``(host, port, token)`` of this actor's channel (started on the first call), on its Ray node's address."""
        if self._server is None:
            import ray

            self._server = Server(ray.util.get_node_ip_address(), self._request, self._name)
        return self._server.address

    def _request(self, request: tuple) -> Any:
        kind, *args = request
        if kind not in self.REQUESTS:
            raise ValueError(f"{self._name} got an unknown request {kind!r}; this is a bug in distribute.")
        return getattr(self, kind)(*args)
