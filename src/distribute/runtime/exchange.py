"""Small values between workers through the coordination service's key-value store, every wait bounded.

Batch sizes at each step, shuffle seeds, shapes before a collective, the
preemption protocol's keys: a few bytes, with the communication timeout; a
worker that does not answer is named (``WorkerLostError``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from distribute.runtime.cluster import Cluster, missing_text
from distribute.runtime.exits import WorkerLostError


class Exchange:
    """All-gathers a few bytes between workers through the coordination service, with a timeout."""

    def __init__(self, client: Any, cluster: Cluster, timeout_seconds: float):
        self._client, self._cluster, self._timeout = client, cluster, timeout_seconds
        self._count = 0

    def new_channel(self) -> str:
        self._count += 1
        return f"distribute/{self._count}"

    def all_gather(self, key: str, payload: bytes, what: str) -> list[bytes]:
        cluster = self._cluster
        self._client.key_value_set_bytes(f"{key}/{cluster.worker_id}", payload)
        deadline = time.monotonic() + self._timeout
        out: list[bytes] = []
        for w in range(cluster.num_workers):
            if w == cluster.worker_id:
                out.append(payload)
                continue
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                out.append(self._client.blocking_key_value_get_bytes(f"{key}/{w}", remaining_ms))
            except Exception as err:
                missing = [v for v in range(w, cluster.num_workers) if v != cluster.worker_id and not self._has(f"{key}/{v}")]
                raise WorkerLostError(
                    f"{missing_text(cluster, missing or [w])} did not reach {what} within "
                    f"{self._timeout:g} s (CommunicationOptions.timeout_seconds): the worker is lost "
                    f"or stuck. Restart the job; BackupAndRestore resumes from the last backup. ({err})"
                ) from err
        return out

    def _has(self, key: str) -> bool:
        try:
            return self._client.key_value_try_get_bytes(key) is not None
        except Exception:  # noqa: BLE001 - a missing key raises NOT_FOUND
            return False

    def delete(self, key: str) -> None:
        try:
            self._client.key_value_delete(f"{key}/{self._cluster.worker_id}")
        except Exception:  # noqa: BLE001 - cleanup only
            pass

    # -- single keys (the preemption protocol) --------------------------------------------------
    @property
    def cluster(self) -> Cluster:
        return self._cluster

    @property
    def timeout_seconds(self) -> float:
        return self._timeout

    def claim(self, key: str, value: str) -> bool:
        """Sets ``key`` unless some worker set it first; True when this worker's value is the one stored."""
        try:
            self._client.key_value_set(key, value)
            return True
        except Exception as err:
            if "ALREADY_EXISTS" in str(err) or "already exists" in str(err).lower():
                return False
            raise

    def wait_for(self, key: str, timeout_seconds: float) -> str | None:
        """The value of ``key`` once some worker sets it, or None after ``timeout_seconds``."""
        try:
            return self._client.blocking_key_value_get(key, max(int(timeout_seconds * 1000), 1))
        except Exception as err:
            if "DEADLINE_EXCEEDED" in str(err) or "timed out" in str(err).lower():
                return None
            raise

    def barrier(self, name: str, what: str, worker_ids: Any = None) -> None:
        """Waits until every worker (or ``worker_ids``) reaches barrier ``name``, within the communication timeout.

        Raises:
            WorkerLostError: some worker did not reach it in time; the message names ``what``.
        """
        timeout_ms = max(int(self._timeout * 1000), 1)
        try:
            if worker_ids is None:
                self._client.wait_at_barrier(name, timeout_ms)
            else:
                self._client.wait_at_barrier(name, timeout_ms, list(worker_ids))
        except Exception as err:
            raise WorkerLostError(
                f"{missing_text(self._cluster, range(self._cluster.num_workers))} did not reach {what} within "
                f"{self._timeout:g} s (CommunicationOptions.timeout_seconds): a worker is lost or stuck. ({err})"
            ) from err


def agree_on_seed(exchange: Exchange) -> None:
    """Gives every worker Keras' global seed of worker 0, unless one is set (as Keras' own multi-host init).

    Variables are initialized on every worker and must be identical there.
    """
    from distribute._keras import rng_utils

    if rng_utils.get_random_seed() is not None:
        return
    mine = int(np.random.SeedSequence().generate_state(1)[0] % (2**31 - 1))
    seeds = exchange.all_gather(exchange.new_channel(), str(mine).encode(), "the random-seed agreement")
    rng_utils.set_random_seed(int(seeds[0].decode()))
