"""Ctrl-C during uneven steps is a clean KeyboardInterrupt (exit status 130 in a shell), never an abort.

The replica threads of an eager uneven step and fit's compile-ahead thread used to be daemons the caller
joined: a join interrupted by Ctrl-C marks the thread finished (CPython 3.11), and the interpreter then ended
it inside XLA at exit, which aborted the process ("terminate called after throwing an instance of ...",
"FATAL: exception not rethrown", exit 134).  Each case interrupts tests/uneven_interrupt_job.py while the
caller waits for such a thread (the compiled uneven step runs no thread); the two run side by side.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve()
CASES = {"eager": 1.0, "compile_ahead": 1.0}  # kind -> seconds from its 2nd STEP to Ctrl-C


def _start(kind: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(HERE.parent / "uneven_interrupt_job.py"), kind], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.multiprocess
def test_ctrl_c_during_uneven_steps_is_a_clean_keyboard_interrupt():
    processes = {kind: _start(kind) for kind in CASES}
    try:
        for kind, process in processes.items():
            for _ in range(2):
                line = process.stdout.readline()
                assert line.strip() == "STEP", (kind, line, process.stderr.read()[-3000:] if process.poll() is not None else "")
        for kind, process in processes.items():
            time.sleep(CASES[kind])
            process.send_signal(signal.SIGINT)
        for kind, process in processes.items():
            try:
                _, err = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:  # still running after Ctrl-C: fail with every thread's stack
                process.send_signal(signal.SIGUSR1)
                time.sleep(2)
                process.send_signal(signal.SIGUSR1)  # twice: a loop that trains on moves, a deadlock does not
                time.sleep(2)
                process.kill()
                out, err = process.communicate()
                raise AssertionError(f"{kind} still ran 120 s after Ctrl-C, {out.count('STEP')} steps after it; "
                                     f"its threads, twice:\n{err[-12000:]}") from None
            assert process.returncode == -signal.SIGINT, (kind, process.returncode, err[-3000:])
            assert "KeyboardInterrupt" in err, (kind, err[-3000:])
            assert "terminate called" not in err and "FATAL" not in err, (kind, err[-3000:])
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_ctrl_c_swallowed_on_its_way_still_stops_fit():
    """A KeyboardInterrupt dropped where Python code runs under C that clears errors is raised at the next step.

    The callback plays that C code: Ctrl-C arrives while it runs and it drops the
    KeyboardInterrupt.  Without the record kept by keras_support.interrupts, fit
    trained on (the compile-ahead case above, once in about four loaded suite runs).
    """
    import keras
    import numpy as np

    import distribute

    strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    batches = []

    class SwallowsCtrlC(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(batch)
            if len(batches) == 2:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1.0)  # the handler runs here
                except KeyboardInterrupt:
                    pass  # dropped

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            model.fit(np.ones((64, 4), np.float32), np.ones((64, 1), np.float32), batch_size=8, epochs=100, verbose=0,
                      callbacks=[SwallowsCtrlC()])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # fit restored it
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(batches) == 2, batches  # stopped before the step after the dropped interrupt
