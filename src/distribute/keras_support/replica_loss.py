"""What a replica's loss is in distributed ``fit`` / ``evaluate``: one rule for every loss Keras computes.

The rule: replica ``r`` holds ``n_r`` of the global batch's ``N`` rows and
differentiates ``(n_r / N) * L_r``, where ``L_r`` is whatever the model's
``compute_loss`` returns for the replica's rows (Keras' own, an override with
or without ``super()``, Keras ``Loss`` objects or plain ``keras.ops``), with
the user's own sample weights. Gradients are summed over the replicas, so the
step differentiates ``sum_r (n_r / N) * L_r``.

That is one device's loss of the global batch, exactly (uneven batches too),
whenever ``L_r`` is the replica's *estimate* of the batch's loss from its rows,
which holds for:

* a mean over the rows (Keras' default ``sum_over_batch_size``, a ``keras.ops.mean``
  of per-row terms, a mask that reaches the loss);
* a term that does not depend on the batch (weight regularizers, a constant
  ``add_loss``): every replica adds it, weighted ``n_r / N``, total once;
* an activity regularizer: Keras divides it by the output's rows, so it is a
  mean over rows too.

Keras ``Loss`` objects whose reduction is not a mean over the replica's rows are
made estimates here, while a fit step's loss is computed (``reduce_values`` and
``apply_mask`` of ``keras.src.losses.loss``, patched in ``patches.CORE``):

* ``reduction="sum"``: ``sum_r / (n_r / N)``;
* ``reduction="mean_with_sample_weight"``: ``sum_r(l * w) / ((n_r / N) * sum_all(w))``
  (``sum_all``: an all-reduce over the replicas);
* a mask with ``sum_over_batch_size``: the valid entries counted over every
  replica, as one device counts them.

Inside ``strategy.run`` (a custom loop), a Keras ``Loss`` reduced to a mean over the
replica's rows (``sum_over_batch_size``, ``mean_with_sample_weight``) is scaled for the sum
over replicas, as Keras 3 on TF scales it (``scale_loss_for_distribution``: divided by the
replica count), but by the replica's rows ``n_r / N`` where they are known (exact on uneven
batches, as ``compute_average_loss``); ``reduction="sum"`` is left as it is, as TF.

A term that is neither (a ``keras.ops.sum`` over rows in a ``compute_loss``
override, a batch statistic other than a mean) gives the row-weighted mean of
the replicas' values; TF's Keras gives their plain mean (it divides every
replica's loss by the replica count), which is the same on even batches.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import jax.numpy as jnp

from distribute import _context

_ACTIVE = threading.local()  # per thread: an uneven step runs each replica in a thread of its own


@contextlib.contextmanager
def replica_share(context: Any, rows: int) -> Iterator[float]:
    """Marks the calling replica's loss computation; yields its share ``rows / N`` of the global batch.

    Args:
        context: the replica's ``ReplicaContext`` (its ``_global_rows`` is ``N``).
        rows: the replica's rows ``n_r`` (0 for an empty replica of an uneven step).
    """
    share = rows / max(int(context._global_rows), 1)
    previous = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = (share, context)
    try:
        yield share
    finally:
        _ACTIVE.value = previous


@contextlib.contextmanager
def fit_step() -> Iterator[None]:
    """Marks a fit step's replica code: outside its loss (``replica_share``), Keras losses reduce as on one
    device (a ``Loss`` object given to ``compile(metrics=...)`` is a metric, not a share of the loss)."""
    previous = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = _METRICS
    try:
        yield
    finally:
        _ACTIVE.value = previous


_METRICS = ("metrics", None)  # _ACTIVE's value in a fit step outside its loss


def active() -> bool:
    """Whether a fit step's replica is computing its loss on this thread."""
    return getattr(_ACTIVE, "value", None) not in (None, _METRICS)


def _sum_all(context: Any, value: Any) -> Any:
    return context.all_reduce("SUM", value) if context.num_replicas_in_sync > 1 else value


def reduce_values(original: Any) -> Any:
    """``keras.src.losses.loss.reduce_values``: in a fit step, every reduction gives the replica's estimate."""

    def reduce(values, sample_weight=None, reduction="sum_over_batch_size"):
        state = getattr(_ACTIVE, "value", None)
        if reduction is None or reduction == "none" or tuple(values.shape) == ():
            return original(values, sample_weight, reduction)
        if state is None:
            loss = original(values, sample_weight, reduction)
            return loss if reduction == "sum" else _scaled_for_run(loss, values)
        if state is _METRICS:
            return original(values, sample_weight, reduction)
        share, context = state
        total = jnp.sum(values)
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            # Every replica meets here, an empty one too (its loss is computed, then dropped).
            weights = _sum_all(context, jnp.sum(sample_weight).astype(total.dtype))
            return jnp.where(weights * share > 0, total / jnp.where(weights * share > 0, weights * share, 1), 0).astype(total.dtype)
        if share == 0:
            return jnp.zeros((), total.dtype)
        if reduction == "sum":
            return total / jnp.asarray(share, total.dtype)
        return total / jnp.asarray(values.size, total.dtype)  # sum_over_batch_size, mean

    return reduce


def _scaled_for_run(loss: Any, values: Any) -> Any:
    """A mean reduced inside ``strategy.run``'s replica function, scaled for the sum over replicas.

    Keras 3 on TF divides it by the replica count (``scale_loss_for_distribution``), so that
    summing the replicas' losses and gradients gives the global batch's mean. Here it is
    weighted by the replica's rows when they are known (``n_r / N``, as ``compute_average_loss``
    does: exact on uneven batches), else divided by the replica count, as TF.
    """
    context = _context.current_replica_context()
    if context is None or context.num_replicas_in_sync == 1 or not context._in_program:
        return loss
    rows, global_rows = context._rows, context._global_rows
    if global_rows and values.ndim and values.shape[0] == rows:
        share = rows / global_rows
    else:
        share = 1.0 / context.num_replicas_in_sync
    return loss * jnp.asarray(share, loss.dtype)


def apply_mask(original: Any) -> Any:
    """``keras.src.losses.loss.apply_mask``: in a fit step, a mean over valid entries counts every replica's."""

    def apply(sample_weight, mask, dtype, reduction):
        state = getattr(_ACTIVE, "value", None)
        if state is None or state is _METRICS or mask is None or reduction not in ("mean", "sum_over_batch_size"):
            return original(sample_weight, mask, dtype, reduction)
        share, context = state
        mask = jnp.asarray(mask).astype(dtype)
        valid = _sum_all(context, jnp.sum(mask)) * share  # the valid entries one device divides by, this replica's share
        weight = jnp.where(valid > 0, mask.size / jnp.where(valid > 0, valid, 1), 0).astype(dtype)
        return original(sample_weight, mask.astype(bool), dtype, "sum") * weight if sample_weight is not None else mask * weight

    return apply
