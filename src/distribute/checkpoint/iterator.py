"""``checkpoints_iterator``: new checkpoints as they appear (tf.train.checkpoints_iterator).

The side-car evaluator of TF's parameter-server tutorial::

    for latest_checkpoint in distribute.checkpoint.checkpoints_iterator(checkpoint_dir):
        checkpoint.restore(latest_checkpoint).expect_partial()
        eval_model.evaluate(...)

It watches a directory written by ``distribute.CheckpointManager`` (or
``Checkpoint.save``): each yielded path is the newest committed
``{checkpoint_name}-N`` there (an orbax checkpoint still being written is never
yielded), as ``tf.train.latest_checkpoint`` would name it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator

from distribute.checkpoint.manager import _numbered

_LOG = logging.getLogger("distribute")
_POLL_SECONDS = 1.0  # TF's wait_for_new_checkpoint(seconds_to_sleep=1)

__all__ = ["checkpoints_iterator", "wait_for_new_checkpoint"]


def wait_for_new_checkpoint(
    checkpoint_dir: str | os.PathLike,
    last_checkpoint: str | None = None,
    seconds_to_sleep: float | None = None,
    timeout: float | None = None,
    *,
    checkpoint_name: str = "ckpt",
) -> str | None:
    """Waits until the newest checkpoint in ``checkpoint_dir`` is not ``last_checkpoint`` (TF's helper).

    Args:
        checkpoint_dir: the directory checkpoints are saved in (need not exist yet).
        last_checkpoint: the path already seen, or None before the first.
        seconds_to_sleep: seconds between looks (TF: 1).
        timeout: the most seconds to wait; None waits indefinitely.  As TF, the
            wait ends without sleeping past the deadline (a ``timeout`` shorter
            than ``seconds_to_sleep`` looks once).
        checkpoint_name: the checkpoints' prefix (``CheckpointManager(checkpoint_name=)``).

    Returns:
        The new checkpoint's path, or None when the timeout was reached.
    """
    sleep = _POLL_SECONDS if seconds_to_sleep is None else float(seconds_to_sleep)
    stop_time = None if timeout is None else time.monotonic() + float(timeout)
    directory = os.fspath(checkpoint_dir)
    while True:
        numbered = _numbered(directory, checkpoint_name, wait=False)  # committed checkpoints only
        path = numbered[-1][1] if numbered else None
        if path is not None and path != last_checkpoint:
            _LOG.info("Found new checkpoint at %s", path)
            return path
        if stop_time is not None and time.monotonic() + sleep > stop_time:
            return None
        time.sleep(sleep)


def checkpoints_iterator(
    checkpoint_dir: str | os.PathLike,
    min_interval_secs: float = 0,
    timeout: float | None = None,
    timeout_fn: Callable[[], bool] | None = None,
    *,
    checkpoint_name: str = "ckpt",
) -> Iterator[str]:
    """Yields each new latest checkpoint path in ``checkpoint_dir`` as it appears (tf.train.checkpoints_iterator).

    As TF's: the iterator looks for a new checkpoint only when the caller asks
    for the next one, so it yields the newest at that time and skips those
    overwritten in between (it can miss checkpoints written faster than the
    caller consumes them, or faster than ``min_interval_secs``).  ``timeout``
    bounds each wait: when it expires without ``timeout_fn`` the iterator
    ends; with one, ``timeout_fn()`` is called and a true result ends it, a
    false one waits again (the timeout applies anew).

    Args:
        checkpoint_dir: the directory ``CheckpointManager`` / ``Checkpoint.save`` writes.
        min_interval_secs: the least seconds between two yields.
        timeout: the most seconds to wait for each new checkpoint; None waits indefinitely.
        timeout_fn: called without arguments after a timeout; True means no
            more checkpoints will come.
        checkpoint_name: the checkpoints' prefix (``ckpt``, as TF's).

    Yields:
        Checkpoint paths (``{checkpoint_dir}/{checkpoint_name}-N``), each newer than the last.

    Raises:
        ValueError: ``min_interval_secs`` or ``timeout`` negative.
    """
    if min_interval_secs < 0 or (timeout is not None and timeout < 0):
        raise ValueError(f"checkpoints_iterator needs min_interval_secs >= 0 and timeout >= 0 or None; got "
                         f"min_interval_secs={min_interval_secs!r}, timeout={timeout!r}.")
    checkpoint_path = None
    while True:
        new_path = wait_for_new_checkpoint(checkpoint_dir, checkpoint_path, timeout=timeout,
                                           checkpoint_name=checkpoint_name)
        if new_path is None:
            if timeout_fn is None:
                _LOG.info("Timed-out waiting for a checkpoint.")
                return
            if timeout_fn():
                return
            continue
        start = time.monotonic()
        checkpoint_path = new_path
        yield checkpoint_path
        time_to_next = start + min_interval_secs - time.monotonic()
        if time_to_next > 0:
            time.sleep(time_to_next)
