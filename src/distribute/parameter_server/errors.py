"""The errors ClusterCoordinator raises, with tf.errors' names.

TF raises ``tf.errors.UnavailableError`` when a parameter server is lost and
``tf.errors.CancelledError`` from ``RemoteValue.fetch()`` of a cancelled
closure; these classes carry the same names and messages.
"""

from __future__ import annotations


class OpError(Exception):
    """Base of the coordinator's errors (TF: ``tf.errors.OpError``)."""


class CancelledError(OpError):
    """A scheduled function was cancelled (TF: ``tf.errors.CancelledError``)."""


class UnavailableError(OpError):
    """A task of the cluster is unreachable (TF: ``tf.errors.UnavailableError``)."""


class PSUnavailableError(UnavailableError):
    """A parameter server was lost; its variables are gone (TF: ``PSUnavailableError``).

    Recover as TF says: bring the ps back (here: create a new strategy), re-create
    the variables and restore the last checkpoint.
    """


def ps_lost(task_id: int) -> PSUnavailableError:
    """The error reporting ps ``task_id`` lost, with the way to recover; its ``task_id`` names the ps."""
    error = PSUnavailableError(
        f"parameter server {task_id} (ps-{task_id}, /job:ps/replica:0/task:{task_id}) is unavailable: its process "
        "died and its variables are lost. Bring the ps back (a new ParameterServerStrategy), re-create the "
        "variables and restore the last checkpoint."
    )
    error.task_id = task_id
    return error


class InvalidArgumentError(OpError, ValueError):
    """An op got an invalid argument, e.g. a row id outside its table (TF: ``tf.errors.InvalidArgumentError``)."""


class OutOfRangeError(OpError):
    """A worker's dataset iterator is exhausted (TF: ``tf.errors.OutOfRangeError``)."""


class ClosureInputError(OpError):
    """An input of a scheduled function failed (TF: ``ClosureInputError``)."""


class ClosureAbortedError(OpError):
    """A resource (an iterator) was lost with its worker and is being rebuilt."""


CANCELLED_MESSAGE = "The corresponding function is cancelled. Please reschedule the function."
ABORTED_MESSAGE = "The corresponding function is aborted. Please reschedule the function."
