"""An optimizer's update on sharded state: each replica updates its slice (ZeRO's update).

With ``sharding=`` a level other than ``NONE`` (``sharding.py``), a variable
whose optimizer slots are split over the replicas (``placement.update_dim``) is
updated slice by slice inside the SPMD step, by Keras' own optimizer code:

1. gradients: reduce-scattered (each replica receives only the sum of its
   slice; at every level, as DeepSpeed's stage 1 sends what its stage 2 sends);
2. the optimizer's ``stateless_apply`` runs on this replica's slices of the
   variables, gradients and slots (Keras sees the slices' shapes: ``shape``
   of a sliced variable is its slice's while the update runs);
3. norms that span a whole gradient (``clipnorm``, ``global_clipnorm``: the norm
   over every replica's slice, then over all variables) and
   ``LossScaleOptimizer``'s finiteness check are taken across the replicas, so
   every replica makes the same decision as one device;
4. the new slices are all-gathered into whole values (what the rest of the step
   reads; unused gathers are compiled away), and a split variable or slot
   stores its slice (``placement.Sharded``).

The result equals ``NONE``'s update to float rounding. Only optimizers whose
update of an element depends on that element alone are sliced (Keras' SGD,
Adam, AdamW, Adagrad, RMSprop, Adadelta, Adamax, Nadam, Ftrl, Lion, and
subclasses that keep their update; a ``LossScaleOptimizer`` around one of
them; or a class declaring ``distribute_elementwise_update = True``). Any other
optimizer (Lamb's trust ratio reads whole-variable norms) keeps its slots split
in storage but runs its update on whole values (gathered inside the step),
which is exact; a warning names it once. A variable constraint runs on the
whole new value.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Iterator

import jax.numpy as jnp
import keras
from jax import lax

from distribute._keras import keras_backend
from distribute.lifting import LiftingScope
from distribute.mesh import AXIS
from distribute.replica import is_varying

# id(variable) -> the shape of this replica's slice, while a sliced update runs.
_SLICE_SHAPES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("distribute_slice_shapes", default=None)

_ELEMENTWISE = (
    keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.Adagrad,
    keras.optimizers.RMSprop, keras.optimizers.Adadelta, keras.optimizers.Adamax, keras.optimizers.Nadam,
    keras.optimizers.Ftrl, keras.optimizers.Lion,
)
# The methods that decide what an update does to each element; a subclass that keeps them updates elementwise.
_UPDATE_METHODS = ("update_step", "apply", "stateless_apply", "_backend_apply_gradients", "_backend_update_step",
                   "_apply_weight_decay", "build")
_WARNED: set = set()


def active() -> bool:
    """Whether a sliced update is being traced (inner optimizers then apply as they are)."""
    return _SLICE_SHAPES.get() is not None


def slice_shape(variable: Any) -> tuple | None:
    """Inside a sliced update: the shape of this replica's slice of ``variable`` (None: whole)."""
    shapes = _SLICE_SHAPES.get()
    return None if shapes is None else shapes.get(id(variable))


def is_elementwise(optimizer: Any) -> bool:
    """Whether ``optimizer`` updates each element of a variable from that element alone (see the module docstring)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return is_elementwise(optimizer.inner_optimizer)
    if getattr(type(optimizer), "distribute_elementwise_update", False) is True:
        return True
    base = next((c for c in type(optimizer).__mro__ if c in _ELEMENTWISE), None)
    return base is not None and all(getattr(type(optimizer), m) is getattr(base, m) for m in _UPDATE_METHODS)


def why_whole(optimizer: Any) -> str | None:
    """Why ``optimizer``'s update cannot run on slices (None: it can)."""
    if not is_elementwise(optimizer):
        return "is not known to update each element of a variable from that element alone"
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if inner.gradient_accumulation_steps:
        return ("accumulates gradients (gradient_accumulation_steps), which Keras does inside a lax.cond whose "
                "branches cannot mix slices and whole values")
    return None


def _warn_whole(optimizer: Any, level: Any, why: str) -> None:
    name = type(optimizer).__name__
    if (name, why) in _WARNED:
        return
    _WARNED.add((name, why))
    fix = (f" If its update is elementwise, declare it: class {name}(...): distribute_elementwise_update = True."
           if why.startswith("is not known") else "")
    warnings.warn(
        f"Optimizer {name!r} {why}, so with sharding={level.value!r} its update runs on whole values, gathered "
        "inside each step: exact, with its slots still stored split over the replicas, but without the "
        f"update's memory saving.{fix}",
        stacklevel=4,
    )


def update_dim(variable: Any) -> int | None:
    """The dim ``variable``'s optimizer state is split along (its placement's), or None."""
    placement = variable.__dict__.get("_distribute_placement")
    return None if placement is None else placement.update_dim


@contextlib.contextmanager
def _sliced(shapes: dict, constrained: list) -> Iterator[None]:
    """While Keras' update runs on slices: their shapes, and no constraints (they run on whole values after)."""
    token = _SLICE_SHAPES.set(shapes)
    saved = [(v, v.constraint) for v in constrained]
    for v in constrained:
        v.constraint = None
    try:
        yield
    finally:
        for v, constraint in saved:
            v.constraint = constraint
        _SLICE_SHAPES.reset(token)


def _current(scope: Any, variable: Any) -> Any:
    value = scope.get_current_value(variable)
    return variable.value if value is None else value


def _reduce(context: Any, grads: list, dims: list) -> list:
    """Each replica's gradients -> their sums over replicas, or this replica's slice of the sum along ``dim``.

    Whole gradients are summed with one ``_sum_gradients`` call (in an uneven
    step's replica threads too: one meeting).
    """
    slices = context._slices
    whole = [i for i, (g, d) in enumerate(zip(grads, dims)) if g is not None and d is None]
    out = list(grads)
    for i, summed in zip(whole, context._sum_gradients([grads[i] for i in whole]) if whole else []):
        out[i] = summed
    for i, (g, d) in enumerate(zip(grads, dims)):
        if g is None or d is None:
            continue
        if not is_varying(g):  # summed already (autodiff of a replicated value): this replica's slice
            out[i] = slices.part(g, d)
        else:  # every level that splits the update: each replica receives only its slice's sum
            out[i] = lax.psum_scatter(g, AXIS, scatter_dimension=d, tiled=True)
    return out


def build(optimizer: Any, variables: list) -> None:
    """Builds ``optimizer`` on ``variables`` as Keras' ``apply`` does (its slots ask their placement then)."""
    if not optimizer.built:
        with keras_backend.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True


def apply(context: Any, optimizer: Any, grads: list, trainable_variables: Any, scope: Any, slicing: bool = True) -> None:
    """``optimizer.apply(grads, trainable_variables)`` inside the SPMD step, on slices where the state is split.

    ``grads``: this replica's gradients (or already summed ones), one per
    variable of ``trainable_variables`` (default: the optimizer's). Reads the
    current values from ``scope`` (the step's ``LiftingScope``, or fit's) and
    writes the new whole values there. With ``slicing`` False (a ``NONE``
    strategy) the update runs on whole values through Keras' ``stateless_apply``.
    """
    level = context._sharding
    given = list(trainable_variables) if trainable_variables is not None else None
    build(optimizer, given if given is not None else list(optimizer._trainable_variables))
    variables = list(optimizer._trainable_variables)
    if given is not None:
        optimizer._check_variables_are_known(given)
    position = {id(v): i for i, v in enumerate(variables)}
    aligned: list = [None] * len(variables)
    for g, v in zip(grads, given if given is not None else variables):
        aligned[position[id(v)]] = g
    why = why_whole(optimizer) if slicing else None
    if why is not None:
        _warn_whole(optimizer, level, why)
        slicing = False
    slot_vars = list(optimizer.variables)
    dims = [update_dim(v) if slicing else None for v in variables]
    slot_dims = [update_dim(v) if slicing else None for v in slot_vars]
    slices = context._slices
    reduced = _reduce(context, aligned, dims)
    values = [_current(scope, v) for v in variables]
    values = [x if d is None else slices.part(x, d) for x, d in zip(values, dims)]
    slot_values = [_current(scope, v) for v in slot_vars]
    slot_values = [x if d is None else slices.part(x, d) for x, d in zip(slot_values, slot_dims)]
    shapes = {id(v): tuple(x.shape) for v, x, d in zip(variables + slot_vars, values + slot_values, dims + slot_dims) if d is not None}
    constrained = [v for v, d in zip(variables, dims) if d is not None and v.constraint is not None]
    constrained_ids = {id(v) for v in constrained}
    missing = [v for v, g in zip(variables, reduced) if g is None]
    with _sliced(shapes, constrained), warnings.catch_warnings():
        if given is not None and missing:
            warnings.filterwarnings("ignore", message="Gradients do not exist for variables")
        new_values, new_slots = optimizer.stateless_apply(slot_values, reduced, values)
    for v, d, old, new in zip(variables + slot_vars, dims + slot_dims, values + slot_values, list(new_values) + list(new_slots)):
        if new is old:
            continue
        whole = new if d is None else slices.gather(new, d)
        if id(v) in constrained_ids:
            whole = v.constraint(whole)
        scope.add_update((v, whole))


def stateless_apply(context: Any, optimizer: Any, optimizer_values: list, grads: list, trainable_values: list) -> tuple[list, list]:
    """Keras' ``optimizer.stateless_apply`` for a fit step in the SPMD program of a sharded strategy."""
    mapping = {id(v): x for v, x in zip(optimizer._trainable_variables, trainable_values)}
    mapping.update({id(v): x for v, x in zip(optimizer.variables, optimizer_values)})
    scope = LiftingScope(mapping)
    scope.update_depth += 1  # an optimizer's write: not summed over the replicas by the variable's aggregation
    with scope:
        apply(context, optimizer, grads, None, scope)
    return ([scope.state_mapping[id(v)] for v in optimizer._trainable_variables],
            [scope.state_mapping[id(v)] for v in optimizer.variables])


# -- the Keras rows (patches.py) ------------------------------------------------------------------
def clip(optimizer: Any, grads: list) -> list:
    """Keras' ``_clip_gradients`` where some gradients are slices: norms summed over the replicas."""

    def squares(g):
        total = jnp.sum(jnp.square(g))
        return lax.psum(total, AXIS) if is_varying(g) else total

    if optimizer.clipnorm and optimizer.clipnorm > 0:
        out = []
        for g in grads:
            if g is None:
                out.append(g)
                continue
            l2sum = squares(g)  # Keras' _clip_by_norm, over the whole gradient
            pred = l2sum > 0
            l2norm = jnp.where(pred, jnp.sqrt(jnp.where(pred, l2sum, jnp.ones_like(l2sum))), l2sum)
            out.append(jnp.asarray(g * optimizer.clipnorm) / jnp.maximum(l2norm, optimizer.clipnorm))
        return out
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        use_norm = jnp.sqrt(jnp.sum(jnp.stack([squares(g) for g in grads if g is not None])))  # Keras' clip_by_global_norm
        clip_norm = optimizer.global_clipnorm
        scale = clip_norm * jnp.minimum(1.0 / use_norm, 1.0 / clip_norm) + (use_norm - use_norm)
        return [g * scale if g is not None else g for g in grads]
    return None  # clipvalue or none: Keras' own (elementwise)


def all_finite(finite: Any) -> Any:
    """``LossScaleOptimizer.check_finite`` over slices: finite on every replica."""
    if not is_varying(finite):
        return finite
    return lax.psum(jnp.logical_not(finite).astype(jnp.int32), AXIS) == 0
