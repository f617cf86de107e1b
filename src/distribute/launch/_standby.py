"""A pre-started worker for an elastic launch: ``python -m distribute.launch._standby`` (run by the launcher only).

Importing JAX, Keras and this package takes a worker most of its start (seconds,
more on a loaded machine).  While a generation trains, the elastic launcher starts
spare processes that do those imports and then wait on stdin; when a worker is
lost, the next generation's workers are these spares: the launcher writes one JSON
line, ``{"env": {...}, "program": [...]}`` (TF_CONFIG, the generation; the
program as ``SCRIPT ARGS...``, ``-m MODULE ARGS...`` or ``-c CODE ARGS...``),
and the spare runs the program as ``python -u PROGRAM`` would.  EOF on stdin
(the spare is not needed) ends it quietly.  Nothing here touches a device:
``jax.distributed.initialize`` must come before the backend starts.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def _warm_up() -> None:
    import keras  # noqa: F401

    import distribute

    for name in ("MultiWorkerMirroredStrategy", "BackupAndRestore", "Checkpoint", "experimental"):
        getattr(distribute, name)
    import distribute.checkpoint.preemption  # noqa: F401
    import distribute.keras_support.trainer  # noqa: F401


def main() -> int:
    _warm_up()
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # not needed
    spec = json.loads(line)
    os.environ.update(spec["env"])
    sys.stdin = open(os.devnull)  # as the launcher's workers: no input
    program = list(spec["program"])
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    elif program[0] == "-c":
        sys.argv = ["-c", *program[2:]]
        exec(compile(program[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - as python -c
    else:
        sys.argv = program
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))  # as `python SCRIPT`
        runpy.run_path(program[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
