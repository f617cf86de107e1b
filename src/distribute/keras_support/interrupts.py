"""Ctrl-C during fit / evaluate / predict is never lost: a KeyboardInterrupt swallowed on its way is raised again.

Python runs a SIGINT handler in the main thread at the next bytecode, wherever that
is; when that is Python code called from C that clears errors (a ``__hash__`` or
``__eq__`` under ``PyDict_GetItem``, a callback whose error a C++ library drops), the
KeyboardInterrupt vanishes and the loop trains on: the compile-ahead job of
tests/test_uneven_interrupt.py went on for 120 s after Ctrl-C, once in about four
loaded suite runs.  While one of these methods runs in the main thread with Python's
default SIGINT handler, the handler below also records the interrupt, and every step
boundary (:func:`raise_pending`) raises it again if it was swallowed.  A handler the
user installed is left alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_pending: list[int] = []  # signals received while kept(); cleared when its method ends
_active = False


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Runs the body with a SIGINT handler that raises KeyboardInterrupt and remembers it (see module doc)."""
    global _active
    if (_active or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return

    def handler(signum, frame):
        _pending.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    _active = True
    try:
        yield
    finally:
        _active = False
        _pending.clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def raise_pending() -> None:
    """Raises KeyboardInterrupt if Ctrl-C came while :func:`kept` ran and its KeyboardInterrupt was swallowed.

    Called by the main thread at step boundaries; a KeyboardInterrupt that did
    propagate ends the method, which clears the record, so it is never raised twice.
    """
    if _pending and threading.current_thread() is threading.main_thread():
        _pending.clear()
        raise KeyboardInterrupt
