"""Spare worker processes for an elastic launch: started early, given their TF_CONFIG when a generation needs them.

See ``_standby.py`` (what a spare runs).  A spare is a ``_Task`` whose output
readers start when it is assigned, so its lines carry its worker name.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from distribute.launch._tasks import _Output, _Task

STANDBY = [sys.executable, "-u", "-m", "distribute.launch._standby"]


def program_of(command: list[str]) -> list[str] | None:
    """The program of ``[python, -u, PROGRAM...]`` (what a spare can run), or None for another command."""
    if len(command) > 2 and command[0] == sys.executable and command[1] == "-u":
        return command[2:]
    return None


class Spare(_Task):
    """A started ``_standby`` process, waiting for its assignment."""

    def __init__(self, env: dict[str, str], output: _Output):  # noqa: D107 - no readers until assigned
        self.task_type, self.task_id = "worker", -1
        self._output = output
        self.proc = subprocess.Popen(STANDBY, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.name = f"spare {self.proc.pid}"
        self.readers: list[threading.Thread] = []

    def assign(self, task_id: int, name: str, env: dict[str, str], program: list[str]) -> bool:
        """Makes this spare worker ``task_id``; False when it has ended (the caller starts a worker instead)."""
        if self.proc.poll() is not None:
            return False
        try:
            self.proc.stdin.write(json.dumps({"env": env, "program": program}).encode("utf-8") + b"\n")
            self.proc.stdin.close()
        except OSError:
            return False
        self.task_id, self.name = task_id, name
        self.readers = [
            threading.Thread(target=self._output.pump, args=(self.proc.stdout, name, False), daemon=True),
            threading.Thread(target=self._output.pump, args=(self.proc.stderr, name, True), daemon=True),
        ]
        for reader in self.readers:
            reader.start()
        return True

    def discard(self) -> None:
        """Ends an unassigned spare (EOF, then SIGKILL if it lingers)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()
