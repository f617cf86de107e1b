"""TF 2.21's values for SyncOnRead variables, regrouping, static run arguments, reduce_to,
scopes, InputContext and cross_device_ops (tests/parity/tf_2_21.json, section "values")."""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import mirrored, tf_fixture

import distribute
from distribute.data import Dataset

TF = tf_fixture()["values"]


def _local(s, value):
    return [np.asarray(v).tolist() for v in s.experimental_local_results(value)]


def _per_replica(s, make):
    return s.experimental_distribute_values_from_function(lambda c: make(c.replica_id_in_sync_group))


# -- SyncOnRead variables ---------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica"])
def test_sync_on_read_variable_matches_tf(aggregation):
    expected = TF[f"sync_on_read_{aggregation}"]
    s = mirrored(2)
    with s.scope():
        v = keras.Variable(1.0, synchronization="on_read", aggregation=aggregation)
    created = expected["created"]
    assert float(v.numpy()) == created["numpy"]
    with s.scope():
        assert float(v.numpy()) == created["numpy_in_scope"]
    assert _local(s, v) == created["local_results"]
    assert float(s.reduce("SUM", v, axis=None)) == created["reduce_sum"]
    assert float(s.reduce("MEAN", v, axis=None)) == created["reduce_mean"]

    def step():
        ctx = distribute.get_replica_context()
        read = v.value + 0.0
        v.assign_add(ctx.replica_id_in_sync_group.astype("float32") + 1.0)
        return read, v.value + 0.0

    read, after = s.run(step)
    in_run = expected["run_assign_add_replica_id_plus_1"]
    assert _local(s, read) == in_run["read_in_run"]
    assert _local(s, after) == in_run["after_assign_add_in_run"]
    assert float(v.numpy()) == in_run["numpy"]
    assert _local(s, v) == in_run["local_results"]

    cross = expected["cross_replica"]
    with s.scope():
        v.assign(6.0)
        assert float(v.numpy()) == cross["assign_6"]["numpy"]
        assert _local(s, v) == cross["assign_6"]["local_results"]
        v.assign_add(1.0)
        assert float(v.numpy()) == cross["then_assign_add_1"]["numpy"]
        assert _local(s, v) == cross["then_assign_add_1"]["local_results"]


def test_sync_on_read_variable_with_no_aggregation_is_refused():
    # TF creates it but cannot read it in cross-replica context.
    assert TF["sync_on_read_none"]["numpy"]["error"] == "ValueError"
    s = mirrored(2)
    with s.scope(), pytest.raises(NotImplementedError, match="aggregation='none'"):
        keras.Variable(1.0, synchronization="on_read", aggregation="none")


def test_sync_on_read_variable_in_an_uneven_step_keeps_each_replicas_copy():
    s = mirrored(2)
    with s.scope():
        v = keras.Variable(1.0, synchronization="on_read", aggregation="sum")

    def step(x):
        v.assign_add(keras.ops.sum(x))
        return v.value + 0.0

    data = Dataset.from_tensor_slices(np.array([5.0, 6.0, 7.0], np.float32)).batch(4)
    (x,) = list(s.experimental_distribute_dataset(data))
    assert _local(s, x) == [[5.0, 6.0], [7.0]]
    assert _local(s, s.run(step, args=(x,))) == [12.0, 8.0]  # 1 + 11, 1 + 7
    assert float(v.numpy()) == 20.0
    assert _local(s, v) == [12.0, 8.0]
    full = Dataset.from_tensor_slices(np.array([1.0, 2.0, 3.0, 4.0], np.float32)).batch(4)
    (y,) = list(s.experimental_distribute_dataset(full))
    assert _local(s, s.run(step, args=(y,))) == [15.0, 15.0]  # 12 + 3, 8 + 7: the SPMD step continues the copies
    assert float(v.numpy()) == 30.0


def test_metric_updated_in_run_reads_each_replicas_result_inside_and_the_total_outside():
    expected = TF["metric_sum_updated_in_run"]
    s = mirrored(2)
    with s.scope():
        total = keras.metrics.Sum()
    x = _per_replica(s, lambda r: jnp.float32(r + 1))

    def step(value):
        total.update_state(value)
        return total.result()

    assert _local(s, s.run(step, args=(x,))) == expected["result_in_run"]
    assert float(total.result()) == expected["result_after"]
    assert _local(s, total.variables[0]) == expected["variable_local_results"]
    total.reset_state()
    assert float(total.result()) == 0.0 and _local(s, total.variables[0]) == [0.0, 0.0]


def test_metric_total_after_fit_is_exact_and_its_copies_are_the_even_split():
    s = mirrored(2)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.ones((6, 1), np.float32)
    with s.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(keras.optimizers.SGD(0.0), "mse", metrics=[keras.metrics.MeanAbsoluteError()])
    model.evaluate(x, y, batch_size=4, verbose=0)
    mae = model.metrics[-1].metrics[0] if hasattr(model.metrics[-1], "metrics") else model.metrics[-1]
    total, count = mae.variables
    assert float(count.numpy()) == 6.0 and float(total.numpy()) == 6.0  # |0 - 1| for 6 rows
    assert _local(s, count) == [3.0, 3.0]  # documented: the even split after fit (README)


# -- regrouping, static arguments -------------------------------------------------------------
def test_python_constant_from_run_is_returned_as_is_and_sum_refuses_it():
    expected = TF["run_returns_python_8"]
    s = mirrored(2)
    out = s.run(lambda: 8)
    assert out == expected["run_result"] and type(out).__name__ == expected["run_result_type"]
    assert expected["reduce_sum"]["error"] == "ValueError"
    with pytest.raises(ValueError, match="non-DistributedValues value 8"):
        s.reduce("SUM", out, axis=None)
    assert s.reduce("MEAN", out, axis=None) == expected["reduce_mean"]


@pytest.mark.parametrize("uneven", [False, True])
def test_run_passes_strings_and_models_through_as_static_arguments(uneven):
    expected = TF["run_static_args"]
    s = mirrored(2)
    x = _per_replica(s, lambda r: jnp.array([1.0, 2.0]) + 10.0 * r)
    with s.scope():
        model = keras.Sequential([keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])
        model.build((None, 2))
    if not uneven:
        assert _local(s, s.run(lambda tag, v: v * 2.0 if tag == "tag" else v, args=("tag", x))) == expected["tag_and_value"]
        assert s.run(lambda tag, v: tag, args=("tag", x)) == expected["returns_tag"]
        assert _local(s, s.run(lambda m, v: m(v[None]), args=(model, x))) == expected["model_in_args"]
        return
    data = Dataset.from_tensor_slices(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)).batch(4)
    (rows,) = list(s.experimental_distribute_dataset(data))
    assert _local(s, s.run(lambda tag, m, v: m(v) * (2.0 if tag == "tag" else 1.0), args=("tag", model, rows))) == [[[6.0], [14.0]], [[22.0]]]


# -- gathers whose other dims differ ----------------------------------------------------------------
def _uneven_rows(s):
    data = Dataset.from_tensor_slices(np.arange(6, dtype=np.float32).reshape(3, 2)).batch(4)
    return next(iter(s.experimental_distribute_dataset(data)))


def test_gather_of_an_uneven_batch_follows_tf():
    s = mirrored(2)
    x = _uneven_rows(s)
    assert np.asarray(s.gather(x, axis=0)).tolist() == TF["gather_uneven_batch_axis_0"]
    gathered = s.run(lambda v: distribute.get_replica_context().all_gather(v, axis=0), args=(x,))
    assert _local(s, gathered) == TF["all_gather_uneven_batch_axis_0"]
    # Along axis 1 the other dim (rows: 2 and 1) differs: TF's collective fails with a shape mismatch.
    assert "Shape mismatch" in TF["gather_uneven_batch_axis_1"]["message"]
    assert "Shape mismatch" in TF["all_gather_uneven_batch_axis_1"]["message"]
    with pytest.raises(ValueError, match="axis 0 only, not axis 1"):
        s.gather(x, axis=1)
    with pytest.raises(ValueError, match="other dims differ between replicas"):
        s.run(lambda v: distribute.get_replica_context().all_gather(v, axis=1), args=(x,))


# -- reduce_to / batch_reduce_to ---------------------------------------------------------------------
def _kind(s, value):
    if isinstance(value, distribute.DistributedValues):
        return {"type": type(value).__name__, "local_results": _local(s, value)}
    return {"type": "EagerTensor", "value": np.asarray(value).tolist()}  # TF's plain tensor: a plain array here


def test_default_strategy_reduce_to_gives_plain_values():
    expected = TF["default_strategy_reduce_to"]
    d = distribute.get_strategy()
    total = d.extended.reduce_to("SUM", jnp.float32(3.0), destinations="/cpu:0")
    assert float(total) == 3.0 and _kind(d, total) == expected["reduce_to_sum"]
    assert _kind(d, d.extended.reduce_to("MEAN", jnp.float32(3.0), destinations="/cpu:0")) == expected["reduce_to_mean"]
    pairs = [(jnp.float32(3.0), "/cpu:0"), (jnp.float32(4.0), "/cpu:0")]
    assert [_kind(d, r) for r in d.extended.batch_reduce_to("SUM", pairs)] == expected["batch_reduce_to_sum"]


def test_mirrored_reduce_to_gives_tfs_kinds_of_values():
    expected = TF["mirrored_reduce_to"]
    s = mirrored(2)
    x = _per_replica(s, lambda r: jnp.array([1.0, 2.0]) + 10.0 * r)
    assert _kind(s, s.extended.reduce_to("SUM", x, destinations=x)) == expected["per_replica_to_per_replica"]
    assert _kind(s, s.extended.reduce_to("SUM", x, destinations="/cpu:1")) == expected["per_replica_to_device_name"]
    assert _kind(s, s.extended.reduce_to("MEAN", jnp.float32(3.0), destinations=x)) == expected["plain_mean"]
    assert expected["plain_sum"]["error"] == "ValueError"
    with pytest.raises(ValueError, match="non-DistributedValues"):
        s.extended.reduce_to("SUM", jnp.float32(3.0), destinations=x)
    both = s.extended.batch_reduce_to("MEAN", [(x, x), (x, "/cpu:0")])
    assert [_kind(s, r) for r in both] == expected["batch_mean_to_replicas_and_device"]
    assert [_kind(s, r) for r in s.extended.batch_reduce_to("MEAN", [(x, "/cpu:0")])] == expected["batch_mean_to_device_only"]


# -- scopes, aliases, InputContext ------------------------------------------------------------------
def test_the_same_scope_object_can_be_entered_inside_itself():
    expected = TF["same_scope_nesting"]
    s = mirrored(2)
    a = s.scope()
    with a:
        b = s.scope()
        with b:
            with a:
                inner = distribute.get_strategy() is s
            middle = distribute.get_strategy() is s
        outer = distribute.get_strategy() is s
    got = {"inner": inner, "middle": middle, "outer": outer, "has_strategy_after": distribute.has_strategy(),
           "has_alias": hasattr(s, "experimental_distribute_datasets_from_function")}
    assert got == expected


def test_experimental_distribute_datasets_from_function_is_the_same_as_the_new_name():
    s = mirrored(2)

    def dataset_fn(context):
        return Dataset.range(8).batch(context.get_per_replica_batch_size(4))

    old = [_local(s, x) for x in s.experimental_distribute_datasets_from_function(dataset_fn)]
    new = [_local(s, x) for x in s.distribute_datasets_from_function(dataset_fn)]
    assert old == new == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_input_context_str_matches_tf():
    expected = TF["input_context_str"]
    assert str(distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)) == expected["pipelines_2_id_1_replicas_4"]
    assert str(distribute.InputContext()) == expected["default"]


# -- cross_device_ops --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["NcclAllReduce", "HierarchicalCopyAllReduce", "ReductionToOneDevice", "CrossDeviceOps"])
def test_cross_device_ops_match_tf(name):
    expected = TF[f"cross_device_ops_{name}"]
    s = mirrored(2)
    x = _per_replica(s, lambda r: jnp.array([1.0, 2.0]) + 10.0 * r)
    ops = getattr(distribute, name)()

    def got(fn):
        try:
            return fn()
        except NotImplementedError as err:
            return {"error": "NotImplementedError", "message": str(err)}

    def check(key, value):
        want = expected[key]
        if "error" in want:
            assert value == {"error": want["error"], "message": want["message"]}
        else:
            assert value == want

    check("reduce_sum_to_replicas", got(lambda: _kind(s, ops.reduce(distribute.ReduceOp.SUM, x, destinations=x))))
    check("reduce_mean_to_device_name", got(lambda: _kind(s, ops.reduce("MEAN", x, destinations="/cpu:0"))))
    check("reduce_sum_of_plain_value", got(lambda: _kind(s, ops.reduce("SUM", jnp.float32(3.0), destinations=x))))
    check("batch_reduce_mean", got(lambda: [_kind(s, r) for r in ops.batch_reduce("MEAN", [(x, x), (x, "/cpu:1")])]))
    check("broadcast", got(lambda: _kind(s, ops.broadcast(jnp.float32(2.0), x))))
    if "num_packs_minus_1" in expected:
        with pytest.raises(ValueError, match=expected["num_packs_minus_1"]["message"]):
            getattr(distribute, name)(num_packs=-1)
    strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    ids = strategy.run(lambda: distribute.get_replica_context().replica_id_in_sync_group)
    assert int(strategy.reduce("SUM", ids, axis=None)) == expected["strategy_with_it_reduce_sum_replica_id"]


# -- objects made outside the scope -----------------------------------------------------------------
def test_metric_created_outside_the_scope_and_compiled_inside_trains_as_if_made_inside():
    # TF: a metric object built outside (METRICS = [...] at module level) and compiled in the scope trains.
    x, y = np.arange(16, dtype=np.float32).reshape(8, 2) / 16, np.arange(8, dtype=np.float32).reshape(8, 1) / 8
    histories = []
    for outside in (True, False):
        s = mirrored(2)
        mae = keras.metrics.MeanAbsoluteError(name="my_mae") if outside else None
        with s.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", metrics=[mae if outside else keras.metrics.MeanAbsoluteError(name="my_mae")])
        histories.append(model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history)
    assert histories[0]["my_mae"] == histories[1]["my_mae"] and histories[0]["loss"] == histories[1]["loss"]
    assert histories[0]["my_mae"][1] < histories[0]["my_mae"][0]


def test_metric_created_outside_the_scope_is_refused_in_strategy_run_naming_it():
    s = mirrored(2)
    mae = keras.metrics.MeanAbsoluteError(name="my_mae")

    def step():
        mae.update_state(jnp.ones((2, 1)), jnp.zeros((2, 1)))
        return 0.0

    with pytest.raises(ValueError, match=r"metric 'MeanAbsoluteError' \(name 'my_mae'\) was created outside any strategy.scope\(\)"):
        s.run(step)


def test_optimizer_created_in_scope_but_built_outside_says_so():
    s = mirrored(2)
    with s.scope():
        layer = keras.layers.Dense(1)
        layer.build((None, 2))
        optimizer = keras.optimizers.Adam(0.1, name="my_adam")
    optimizer.build(layer.trainable_variables)

    def step():
        optimizer.apply_gradients(zip([jnp.ones_like(v.value) for v in layer.trainable_variables], layer.trainable_variables))
        return 0.0

    with pytest.raises(ValueError, match=r"optimizer 'Adam' \(name 'my_adam'\) was created inside .* scope, but built outside it"):
        s.run(step)


def test_local_results_of_a_sync_on_read_variable_outlive_the_next_step():
    s = mirrored(2)
    with s.scope():
        v = keras.Variable(1.0, synchronization="on_read", aggregation="sum")

    def step():
        v.assign_add(1.0)
        return 0.0

    s.run(step)
    before = s.experimental_local_results(v)
    held = [np.asarray(x) for x in before]  # arrays the user took
    s.run(step)  # donates the copies' buffers
    # The copies are live, as TF's component variables (TF 2.21, tests/parity/record_tf_lazy_variables.py:
    # "live after next step [3.0, 3.0]"); arrays taken before keep their values.
    assert [float(x) for x in before] == [3.0, 3.0]
    assert [float(x) for x in held] == [2.0, 2.0]
    assert _local(s, v) == [3.0, 3.0] and float(v.numpy()) == 6.0
