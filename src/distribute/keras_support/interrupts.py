"""Ctrl-C during fit / evaluate / predict stops at the next step boundary, keeping every finished step.

Python raises KeyboardInterrupt in the main thread at the next bytecode after the
signal, wherever that is.  During a step that is nearly always just after the compiled
program returned and before its new state was stored (``result, state = program(...)``):
the old state was donated to the program, so the model was left holding deleted arrays
(every later evaluate, fit or save failed: "Array has been deleted").  And where that
bytecode is Python code called from C that clears errors, the KeyboardInterrupt
vanished and fit trained on (the compile-ahead job of tests/test_uneven_interrupt.py,
120 s after Ctrl-C, once in about four loaded suite runs).

So while one of these methods runs in the main thread with Python's default SIGINT
handler, Ctrl-C is recorded, and KeyboardInterrupt is raised at the next step boundary
(:func:`raise_pending`, where Keras holds the finished step's state), or when the
method returns; a second Ctrl-C raises at once, wherever it lands (a step that hangs
can always be stopped; that step's state may then be lost).  TensorFlow's fit keeps
the finished steps too: its variables are updated in place by each step.  A handler
the user installed is left alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_pending: list[int] = []  # Ctrl-Cs received while kept() runs and not yet raised
_active = False


def _handler(signum: int, frame: object) -> None:
    _pending.append(signum)
    if len(_pending) > 1:  # the second Ctrl-C: now
        _pending.clear()
        raise KeyboardInterrupt


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Runs the body with Ctrl-C raised at step boundaries (see the module doc); raises it at the end if still pending."""
    global _active
    if (_active or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    signal.signal(signal.SIGINT, _handler)
    _active = True
    try:
        yield
    finally:
        interrupted = bool(_pending)
        _active = False
        _pending.clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:  # came during the last step: the method finished, its state is stored
        raise KeyboardInterrupt


def raise_pending() -> None:
    """Raises KeyboardInterrupt if Ctrl-C came since the last step boundary (main thread only)."""
    if _pending and threading.current_thread() is threading.main_thread():
        _pending.clear()
        raise KeyboardInterrupt
