"""compute_average_loss / scale_regularization_loss, ReplicaContext collectives, and the context functions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from helpers import local_lists, mirrored, tf_fixture

LOSSES = tf_fixture()["losses"]
PER_EXAMPLE = np.asarray(LOSSES["inputs"]["per_example_loss"], np.float32)
WEIGHTS = np.asarray(LOSSES["inputs"]["sample_weight"], np.float32)


def _cases():
    return {
        "default": lambda: distribute.compute_average_loss(PER_EXAMPLE),
        "sample_weight_1010": lambda: distribute.compute_average_loss(PER_EXAMPLE, sample_weight=WEIGHTS),
        "global_batch_size_8": lambda: distribute.compute_average_loss(PER_EXAMPLE, global_batch_size=8),
        "empty": lambda: distribute.compute_average_loss(np.zeros((0,), np.float32)),
        "empty_global_batch_size_8": lambda: distribute.compute_average_loss(np.zeros((0,), np.float32), global_batch_size=8),
        "scale_regularization_loss_0.4": lambda: distribute.scale_regularization_loss(0.4),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
def test_losses_in_run_match_tf(name):
    s = mirrored(2)
    fn = _cases()[name]
    out = s.run(fn)
    got = [float(v) for v in s.experimental_local_results(out)]
    np.testing.assert_allclose(got, LOSSES["in_run_n2_tf_function"][name], rtol=1e-7)
    assert not np.isnan(got).any()


def test_compute_average_loss_sums_to_global_mean_over_replicas():
    s = mirrored(2)
    out = s.run(lambda: distribute.compute_average_loss(PER_EXAMPLE))
    assert float(s.reduce("SUM", out, axis=None)) == 2.5


@pytest.mark.parametrize("name", sorted(_cases()))
def test_losses_outside_any_strategy_match_tf(name):
    np.testing.assert_allclose(float(_cases()[name]()), LOSSES["outside_strategy"][name], rtol=1e-7)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_losses_in_cross_replica_context_match_tf(name):
    expected = LOSSES["in_scope_cross_replica_n2"][name]
    s = mirrored(2)
    with s.scope():
        if isinstance(expected, dict):
            with pytest.raises(RuntimeError, match="cross-replica context"):
                _cases()[name]()
        else:
            assert float(_cases()[name]()) == expected


def test_compute_average_loss_with_uneven_replicas_is_the_true_mean():
    """Deliberate difference: TF gives [1.25, 0.0] (divides by 4 * 2 replicas); ours sums to the real mean 2.5."""
    s = mirrored(2)
    with s.scope():
        v = distribute.PerReplica((PER_EXAMPLE, np.zeros((0,), np.float32)))
    out = s.run(distribute.compute_average_loss, args=(v,))
    got = [float(x) for x in s.experimental_local_results(out)]
    assert LOSSES["in_run_n2_tf_function"]["replica0_4_replica1_empty"] == [1.25, 0.0]
    assert got == [2.5, 0.0]


@pytest.mark.parametrize("num_replicas, n, batch", [(2, 5, 4), (3, 10, 8), (4, 10, 4), (2, 7, 6), (4, 9, 8)])
def test_compute_average_loss_in_padded_steps_equals_single_device_mean(num_replicas, n, batch):
    s = mirrored(num_replicas)
    data = (np.arange(n, dtype=np.float32) + 1.0) ** 2
    dist = s.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(batch))

    def step(x):
        return distribute.compute_average_loss(x * 0.5)

    for i, x in enumerate(dist):
        out = s.run(step, args=(x,))
        per_replica = [float(v) for v in s.experimental_local_results(out)]
        assert not np.isnan(per_replica).any()
        rows = data[i * batch : (i + 1) * batch] * 0.5
        np.testing.assert_allclose(float(s.reduce("SUM", out, axis=None)), rows.mean(), rtol=1e-6)
        for count, value in zip([len(p) for p in local_lists(s, x)], per_replica):
            if count == 0:
                assert value == 0.0


def test_compute_average_loss_with_extra_dims_and_weights_in_padded_step():
    s = mirrored(2)
    data = np.arange(10, dtype=np.float32).reshape(5, 2)
    weights = np.array([1.0, 2.0, 0.0, 1.0, 3.0], np.float32)
    dist = list(s.experimental_distribute_dataset(Dataset.from_tensor_slices((data, weights)).batch(4)))
    last_x, last_w = dist[1]
    out = s.run(lambda x, w: distribute.compute_average_loss(x, sample_weight=w), args=(last_x, last_w))
    # One real row [8, 9] with weight 3: sum 51 over 1 example.
    assert float(s.reduce("SUM", out, axis=None)) == 51.0


# -- ReplicaContext collectives -----------------------------------------------------------------
RC = tf_fixture()["replica_context"]


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_replica_context_collectives_match_tf(num_replicas):
    case = RC[f"n{num_replicas}_tf_function"]
    s = mirrored(num_replicas)

    def fn(matrix):
        ctx = distribute.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        return {
            "replica_id_in_sync_group": jnp.asarray(rid, jnp.int32),
            "all_reduce_sum_replica_id": ctx.all_reduce(distribute.ReduceOp.SUM, jnp.asarray(rid, jnp.int32)),
            "all_reduce_mean_float_replica_id": ctx.all_reduce("MEAN", jnp.asarray(rid, jnp.float32)),
            "all_gather_const_123_axis0": ctx.all_gather(jnp.array([1, 2, 3], jnp.int32), axis=0),
            "all_gather_matrix_axis1": ctx.all_gather(matrix, axis=1),
            "all_gather_matrix_axis0": ctx.all_gather(matrix, axis=0),
        }

    matrices = np.asarray(case["matrix_per_replica_input"], np.float32)
    per_replica = s.experimental_distribute_values_from_function(lambda ctx: matrices[ctx.replica_id_in_sync_group])
    out = s.run(fn, args=(per_replica,))
    for key, value in out.items():
        assert local_lists(s, value) == case[key]["per_replica"], key
        for part in s.experimental_local_results(value):
            assert str(np.asarray(part).dtype) == case[key]["dtype"], key


def test_all_reduce_sum_of_replica_id_with_three_replicas_is_three():
    s = mirrored(3)
    out = s.run(lambda: distribute.get_replica_context().all_reduce("sum", distribute.get_replica_context().replica_id_in_sync_group))
    assert [int(v) for v in s.experimental_local_results(out)] == [3, 3, 3]


def test_all_reduce_nested_structure():
    s = mirrored(4)
    out = s.run(lambda: distribute.get_replica_context().all_reduce("SUM", {"a": jnp.ones(2), "b": (jnp.float32(2.0),)}))
    assert local_lists(s, out["a"]) == [[4.0, 4.0]] * 4
    assert local_lists(s, out["b"][0]) == [8.0] * 4


# -- context functions ---------------------------------------------------------------------------
def test_contexts_outside_any_scope():
    assert not distribute.has_strategy()
    assert not distribute.in_cross_replica_context()
    ctx = distribute.get_replica_context()
    assert ctx is not None and ctx.num_replicas_in_sync == 1 and ctx.replica_id_in_sync_group == 0
    default = distribute.get_strategy()
    assert default.num_replicas_in_sync == 1
    assert default is distribute.get_strategy()
    assert ctx.strategy is default


def test_contexts_in_scope_and_in_run():
    s = mirrored(2)
    seen = {}
    with s.scope():
        assert distribute.get_replica_context() is None
        assert distribute.in_cross_replica_context()
        assert distribute.has_strategy()
        assert distribute.get_strategy() is s

    def fn():
        ctx = distribute.get_replica_context()
        seen["ctx_strategy"] = ctx.strategy
        seen["num"] = ctx.num_replicas_in_sync
        seen["cross"] = distribute.in_cross_replica_context()
        seen["has"] = distribute.has_strategy()
        seen["get"] = distribute.get_strategy()
        return ctx.replica_id_in_sync_group

    ids = s.run(fn)
    assert [int(v) for v in s.experimental_local_results(ids)] == [0, 1]
    assert seen == {"ctx_strategy": s, "num": 2, "cross": False, "has": True, "get": s}
    assert not distribute.has_strategy()


def test_nested_scope_of_same_strategy_is_fine():
    s = mirrored(2)
    with s.scope():
        with s.scope():
            assert distribute.get_strategy() is s
        assert distribute.get_strategy() is s
    assert not distribute.has_strategy()


def test_other_strategy_scope_inside_raises_naming_both():
    a, b = mirrored(2), mirrored(3)
    with a.scope():
        with pytest.raises(RuntimeError) as info:
            with b.scope():
                pass
        assert distribute.get_strategy() is a
    message = str(info.value)
    assert repr(a) in message and repr(b) in message and "Mixing" in message
    assert not distribute.has_strategy()
