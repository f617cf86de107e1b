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



def test_ctrl_c_during_fit_stops_at_the_next_step_keeping_the_finished_steps():
    """Ctrl-C during fit's 3rd step: KeyboardInterrupt after it, the model holds exactly 3 steps' weights, usable.

    The signal comes from inside the 3rd step's program (a debug callback), so Python
    handles it just after the program returned: it used to raise before the new state
    was stored, leaving the model with donated (deleted) arrays.  A callback that drops
    a KeyboardInterrupt (as C code that clears errors does) cannot hide the Ctrl-C either.
    Expected: one device (no strategy) trained 3 steps from the same weights.
    """
    import jax
    import keras
    import numpy as np

    import distribute

    calls = []

    def on_replica_step(_):
        calls.append(1)
        if len(calls) == 5:  # first replica of the 3rd step (2 replicas)
            os.kill(os.getpid(), signal.SIGINT)

    class Probe(keras.layers.Layer):
        def call(self, x):
            jax.debug.callback(on_replica_step, x[0, 0])
            return x

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), Probe(), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    rng = np.random.default_rng(0)
    x, y = rng.random((64, 4), dtype=np.float32), rng.random((64, 1), dtype=np.float32)
    strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = build()
    initial = model.get_weights()
    after_callback = []

    class DropsCtrlC(keras.callbacks.Callback):  # a KeyboardInterrupt raised here would be dropped
        def on_train_batch_end(self, batch, logs=None):
            try:
                after_callback.append(batch)
            except KeyboardInterrupt:
                pass

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            model.fit(x, y, batch_size=8, epochs=100, shuffle=False, verbose=0, callbacks=[DropsCtrlC()])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # fit restored it
    finally:
        signal.signal(signal.SIGINT, previous)
    assert after_callback == [0, 1, 2] and int(model.optimizer.iterations.numpy()) == 3
    reference = build()
    reference.set_weights(initial)
    reference.fit(x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=8, verbose=0), reference.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # and trains on
    assert int(model.optimizer.iterations.numpy()) == 11
