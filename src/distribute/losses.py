"""compute_average_loss and scale_regularization_loss (tf.nn names)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from distribute import _context


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None, global_batch_size: int | None = None) -> Any:
    """Scales per-example losses so that summing over replicas gives the global mean.

    Matches ``tf.nn.compute_average_loss``: returns
    ``sum(per_example_loss * sample_weight) / global_batch_size``, where the global
    batch size defaults to ``per_replica_batch * num_replicas_in_sync``.  Two
    replicas, ``[1., 2., 3., 4.]`` on each -> ``1.25`` per replica, 2.5 summed.

    Beyond TF: in an uneven step (the last, partial batch, split ``ceil(b/R)``
    rows per replica), the default global batch size is the number of real
    examples across all replicas (TF: this replica's rows times the replica
    count), so the sum over replicas equals the single-device mean exactly; a
    replica with no examples contributes 0 (never NaN).  Two replicas with
    ``[1., 2., 3., 4.]`` and ``[]``: 2.5 and 0 (TF: 1.25 and 0).

    Args:
        per_example_loss: ``(per_replica_batch, ...)`` losses; extra dims are summed.
        sample_weight: optional weights broadcastable to ``per_example_loss``.
        global_batch_size: divisor; default as above.

    Returns:
        A scalar.

    Raises:
        ValueError: ``global_batch_size`` is not positive.
        RuntimeError: called in cross-replica context without
            ``global_batch_size`` (as TF: the replica count is unknown there).
    """
    loss = jnp.asarray(per_example_loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        loss = loss.astype(jnp.float32)
    if sample_weight is not None:
        weight = jnp.asarray(sample_weight, dtype=loss.dtype)
        if weight.ndim < loss.ndim:
            weight = weight.reshape(weight.shape + (1,) * (loss.ndim - weight.ndim))
        loss = loss * weight
    context = _replica_context("compute_average_loss", global_batch_size is None)
    num_replicas = 1 if context is None else context.num_replicas_in_sync
    rows = loss.shape[0] if loss.ndim else 1
    if global_batch_size is not None:
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size={global_batch_size} must be positive.")
        divisor = jnp.asarray(global_batch_size, loss.dtype)
    elif context is not None and context._global_rows is not None and loss.ndim and rows == context._rows:
        # One loss per example of this step's batch: the real global batch size.
        divisor = jnp.asarray(context._global_rows, loss.dtype)
    else:
        divisor = jnp.asarray(rows * num_replicas, loss.dtype)
    total = jnp.sum(loss)
    return jnp.where(divisor > 0, total / jnp.where(divisor > 0, divisor, 1), jnp.zeros_like(total))


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divides a regularization loss by the number of replicas (``tf.nn.scale_regularization_loss``).

    Each replica adds it once, so the sum over replicas counts it once: with 2
    replicas, 0.4 -> 0.2. As TF, the loss is summed first: a list or tuple of
    losses (``model.losses``) adds up (``[0.4, 0.2]`` -> 0.3 on 2 replicas; ``[]`` -> 0.0)
    and an array sums over all its elements, so the result is a scalar.

    Raises:
        RuntimeError: called in cross-replica context (as TF).
    """
    context = _replica_context("scale_regularization_loss", True)
    num_replicas = 1 if context is None else context.num_replicas_in_sync
    if isinstance(regularization_loss, (list, tuple)):
        total = sum((jnp.sum(jnp.asarray(loss)) for loss in regularization_loss), jnp.zeros((), jnp.float32))
    else:
        total = jnp.sum(jnp.asarray(regularization_loss))
    return total / num_replicas


def _replica_context(what: str, needed: bool):
    state = _context.state()
    if needed and state.strategy is not None and state.replica_context is None:
        raise RuntimeError(
            f"{what} was called in cross-replica context (inside strategy.scope(), outside "
            "strategy.run), where the number of replicas sharing the batch is unknown (TF "
            "raises too). Call it inside the function given to strategy.run"
            + (", or pass global_batch_size." if what == "compute_average_loss" else ".")
        )
    return state.replica_context
