"""Row tables of a step (parameter_server/rows.py, rows_program.py), without a cluster.

A step's jaxpr is analysed for variables read only through row gathers along
dim 0; the row program run on the looked-up rows must give exactly what the
whole-table program gives: the same outputs, and a gradient whose looked-up
rows are the whole gradient's and whose other rows are zero.  Anything else a
table meets (a matmul, a regularizer, ids computed from its values) keeps it
whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distribute.parameter_server import rows, rows_program

N, D = 50, 3


def _table():
    return jnp.asarray(np.random.default_rng(0).normal(size=(N, D)).astype(np.float32))


def _analyze(f, *args, grads=None):
    closed = jax.make_jaxpr(f)(*args)
    flat = rows.flatten(closed)
    return closed, rows.analyze(flat, {0}, {1: 0} if grads is None else grads)


def _run_rows(closed, an, args):
    """The ids program, the distinct ids, the row program; row gradients made whole again (zeros elsewhere)."""
    flat_args = list(args)
    ids_fn = rows_program.ids_function(an)
    id_arrays = jax.jit(ids_fn)(*[flat_args[p] for p in rows_program.ids_inputs(an)])
    groups = rows_program.id_vars(an)
    sizes = [int(sum(g.indices.values())) for g in an.groups]
    uniques = []
    for k in range(len(an.groups)):
        ids = np.concatenate([np.asarray(a).ravel() for (g, _), a in zip(groups, id_arrays) if g == k])
        u = np.unique(ids).astype(np.int32)
        padded = np.full((sizes[k],), N, np.int32)
        padded[: len(u)] = u
        uniques.append((u, padded))
    tables = [0]
    table_rows = [np.concatenate([np.asarray(args[0])[uniques[0][0]],
                                  np.zeros((sizes[0] - len(uniques[0][0]), D), np.float32)])]
    fn = rows_program.row_function(an, tables, sizes)
    others = flat_args[1:]
    outs = jax.jit(fn)(others, table_rows, [p for _, p in uniques])
    probes = outs[len(closed.jaxpr.outvars):]
    outs = list(outs[: len(closed.jaxpr.outvars)])
    for pos in an.grad_outputs:
        u = uniques[an.grad_outputs[pos]][0]
        whole = np.zeros((N, D), np.float32)
        whole[u] = np.asarray(outs[pos])[: len(u)]
        outs[pos] = whole
    return outs, probes, id_arrays


def _dense(closed, args):
    return jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*args)


def _assert_same(f, *args, grads=None, rtol=0.0):
    closed, an = _analyze(f, *args, grads=grads)
    assert [g.tables for g in an.groups] == [{0}], an.dense_reasons
    got, probes, _ = _run_rows(closed, an, args)
    want = _dense(closed, args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=0)
    for probe in probes:
        np.testing.assert_array_equal(np.asarray(probe), 0)
    return an


def _loss_and_grad(use):
    def f(table, ids):
        loss, grad = jax.value_and_grad(lambda t: use(t, ids))(table)
        return loss, grad

    return f


def test_take_and_its_gradient_run_on_the_looked_up_rows_with_duplicates_summed():
    ids = jnp.asarray([[3, 3, 7], [7, 1, 3]], jnp.int32)  # 3 three times, 7 twice
    an = _assert_same(_loss_and_grad(lambda t, i: jnp.sum(jnp.take(t, i, axis=0) ** 2)), _table(), ids)
    assert sum(an.groups[0].indices.values()) == 6  # the ids it can look up: the row programs hold 6 rows


def test_indexing_two_lookups_and_clipping_by_global_norm():
    def use(t, i):
        return jnp.sum(jnp.tanh(t[i])) + jnp.sum(jnp.take(t, i[:, ::-1] + 1, axis=0) * 2.0)

    def f(table, ids):
        loss, grad = jax.value_and_grad(lambda t: use(t, ids))(table)
        norm = jnp.sqrt(jnp.sum(grad * grad))
        return loss, grad * jnp.minimum(1.0, 0.5 / norm)

    # The norm sums the same squares in another order (8 rows instead of 50): the last bit may differ.
    ids = jnp.asarray([[0, 4], [4, 9]], jnp.int32)
    an = _assert_same(f, _table(), ids, rtol=1e-6)
    assert sum(an.groups[0].indices.values()) == 8


def test_packed_steps_update_the_rows_on_the_worker():
    # steps_per_execution: the worker updates its copy between steps; the next step reads the updated rows.
    def f(table, ids):
        grad = jax.grad(lambda t: jnp.sum(jnp.take(t, ids[0], axis=0) ** 2))(table)
        table2 = table - 0.1 * grad
        loss, grad2 = jax.value_and_grad(lambda t: jnp.sum(jnp.take(t, ids[1], axis=0) ** 3))(table2)
        return loss, grad2, grad

    _assert_same(f, _table(), jnp.asarray([[1, 2, 2], [2, 5, 6]], jnp.int32), grads={1: 0, 2: 0})


@pytest.mark.parametrize("name, use", [
    ("matmul", lambda t, i: jnp.sum(jnp.take(t, i, axis=0)) + jnp.sum(t @ jnp.ones((D,)))),
    ("regularizer", lambda t, i: jnp.sum(jnp.take(t, i, axis=0)) + 0.01 * jnp.sum(t * t)),
    ("ids from values", lambda t, i: jnp.sum(jnp.take(t, jnp.argmax(jnp.take(t, i, axis=0), axis=1), axis=0))),
    ("column gather", lambda t, i: jnp.sum(jnp.take(t, jnp.asarray([0, 2]), axis=1))),
])
def test_a_table_meeting_anything_else_is_read_whole(name, use):
    _, an = _analyze(_loss_and_grad(use), _table(), jnp.asarray([1, 2], jnp.int32))
    assert an.groups == []
    assert 0 in an.dense_reasons, name


def test_the_ids_checked_are_the_ones_written_before_jnp_take_wraps_negatives():
    # jnp.take turns -1 into N - 1; the ids program returns -1, so the worker can reject it as TF does.
    closed, an = _analyze(_loss_and_grad(lambda t, i: jnp.sum(jnp.take(t, i, axis=0))), _table(),
                          jnp.asarray([2, -1], jnp.int32))
    ids = jax.jit(rows_program.ids_function(an))(*[[_table(), jnp.asarray([2, -1], jnp.int32)][p]
                                                   for p in rows_program.ids_inputs(an)])
    assert [np.asarray(a).tolist() for a in ids] == [[2, -1]]
