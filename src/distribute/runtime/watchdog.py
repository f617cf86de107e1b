"""Heartbeats: every worker publishes a counter; one whose counter stops is named and every other stops."""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

from distribute.runtime.cluster import Cluster, missing_text
from distribute.runtime.exits import stop_now
from distribute.runtime.service import EXIT_WORKER_LOST


class Watchdog(threading.Thread):
    """Every worker publishes a heartbeat counter; a worker whose counter stops for
    ``timeout_seconds`` is lost: this worker prints whom and exits (a blocked
    collective cannot be interrupted from Python).  A worker that exits normally
    says so first and is not counted as lost."""

    def __init__(self, client: Any, cluster: Cluster, timeout_seconds: float):
        super().__init__(name="distribute-watchdog", daemon=True)
        self._client, self._cluster, self._timeout = client, cluster, timeout_seconds
        self._period = min(1.0, timeout_seconds / 4)
        self._stopped = threading.Event()
        atexit.register(self.stop)

    def stop(self, final: str = "exited") -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            try:
                self._client.key_value_set(self._key(self._cluster.worker_id), final, allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service may be gone already
                pass

    def _key(self, worker_id: int) -> str:
        return f"distribute/alive/{worker_id}"

    def silent_peers(self) -> list[int]:
        """The other workers whose heartbeat does not advance over the next few periods (at most the timeout).

        Called after a collective failed because some peer's process ended: the
        live ones keep beating, so the dead one is the one left.  Empty when the
        store cannot be read.
        """
        others = [w for w in range(self._cluster.num_workers) if w != self._cluster.worker_id]
        try:
            before = {w: self._try_get(self._key(w)) for w in others}
            self._stopped.wait(min(self._timeout, 4 * self._period))
            after = {w: self._try_get(self._key(w)) for w in others}
        except Exception:  # noqa: BLE001 - the caller then names every candidate
            return []
        return [w for w in others if after[w] == before[w] and before[w] != "exited"]

    def run(self) -> None:
        cluster, beat = self._cluster, 0
        others = [w for w in range(cluster.num_workers) if w != cluster.worker_id]
        last = {w: (None, time.monotonic()) for w in others}
        service_ok = time.monotonic()
        while not self._stopped.wait(self._period):
            now = time.monotonic()
            beat += 1
            try:
                self._client.key_value_set(self._key(cluster.worker_id), str(beat), allow_overwrite=True)
                values = {w: self._try_get(self._key(w)) for w in others}
                service_ok = now
            except Exception as err:  # noqa: BLE001
                if now - service_ok > self._timeout and not self._stopped.is_set():
                    self._fail([0], f"the coordination service on it does not answer ({err})")
                continue
            for w, value in values.items():
                if value is not None and value.startswith("failed:") and not self._stopped.is_set():
                    self._fail([w], f"it exited with status {value.split(':', 1)[1]}")
                elif value == "exited" or value != last[w][0]:
                    last[w] = (value, now)
                elif now - last[w][1] > self._timeout and not self._stopped.is_set():
                    self._fail([w], f"it sent no heartbeat for {self._timeout:g} s")

    def _try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as err:
            if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
                return None
            raise

    def _fail(self, lost: list[int], why: str) -> None:
        cluster = self._cluster
        stop_now(
            f"MultiWorkerMirroredStrategy on {cluster.names[cluster.worker_id]}: lost "
            f"{missing_text(cluster, lost)}: {why} (CommunicationOptions.timeout_seconds="
            f"{self._timeout:g}). Stopping this worker too; restart the "
            "job (BackupAndRestore resumes from the last backup).",
            EXIT_WORKER_LOST,
        )


