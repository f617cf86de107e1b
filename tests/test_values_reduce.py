"""Strategy.reduce / gather / experimental_local_results on distributed and plain values."""

from __future__ import annotations

import numpy as np
import pytest

import distribute
from distribute import ReduceOp
from helpers import local_lists, mirrored, tf_fixture

REDUCE = tf_fixture()["reduce"]


def _even_values(strategy):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([1.0, 2.0], np.float32) + 2.0 * ctx.replica_id_in_sync_group
    )


def test_values_from_function_gives_each_replica_its_value():
    s = mirrored(2)
    v = _even_values(s)
    assert local_lists(s, v) == REDUCE["even_values_from_function_n2"]["per_replica_input"]


@pytest.mark.parametrize(
    "op, axis, key",
    [
        (ReduceOp.SUM, None, "sum_axis_none"),
        (ReduceOp.MEAN, None, "mean_axis_none"),
        (ReduceOp.SUM, 0, "sum_axis0"),
        (ReduceOp.MEAN, 0, "mean_axis0"),
    ],
)
def test_reduce_even_values_matches_tf(op, axis, key):
    s = mirrored(2)
    expected = REDUCE["even_values_from_function_n2"][key]
    np.testing.assert_allclose(np.asarray(s.reduce(op, _even_values(s), axis=axis)), expected, rtol=0, atol=0)


def test_gather_even_values_matches_tf():
    s = mirrored(2)
    got = s.gather(_even_values(s), axis=0)
    assert np.asarray(got).tolist() == REDUCE["even_values_from_function_n2"]["gather_axis0"] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("op, expected", [("sum", [4.0, 6.0]), ("Mean", [2.0, 3.0]), ("SUM", [4.0, 6.0]), ("mEaN", [2.0, 3.0])])
def test_reduce_accepts_strings_in_any_case(op, expected):
    s = mirrored(2)
    assert np.asarray(s.reduce(op, _even_values(s), axis=None)).tolist() == expected


def test_reduce_string_parity_with_tf():
    errors = tf_fixture()["errors"]
    s = mirrored(2)
    assert np.asarray(s.reduce("sum", _even_values(s), axis=None)).tolist() == errors["reduce_op_sum"]["no_error_result"]
    assert np.asarray(s.reduce("Mean", _even_values(s), axis=None)).tolist() == errors["reduce_op_Mean"]["no_error_result"]


def test_uneven_per_replica_values_reduce_with_true_count():
    s = mirrored(2)
    with s.scope():
        v = distribute.PerReplica((np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.array([5.0, 6.0], np.float32)))
    case = REDUCE["uneven_values_from_function_n2"]
    assert local_lists(s, v) == case["per_replica_input"]
    assert float(s.reduce(ReduceOp.MEAN, v, axis=0)) == case["mean_axis0"] == 3.5
    assert float(s.reduce(ReduceOp.SUM, v, axis=0)) == case["sum_axis0"] == 21.0
    assert np.asarray(s.gather(v, axis=0)).tolist() == case["gather_axis0"]


def test_uneven_per_replica_values_cannot_be_reduced_elementwise():
    # TF raises InvalidArgumentError (AddN shape mismatch); ours is a ValueError naming the sizes.
    s = mirrored(2)
    with s.scope():
        v = distribute.PerReplica((np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.array([5.0, 6.0], np.float32)))
    for op in ("SUM", "MEAN"):
        with pytest.raises(ValueError, match=r"\[4, 2\]"):
            s.reduce(op, v, axis=None)


def test_reduce_non_distributed_value_with_two_replicas():
    case = REDUCE["non_distributed"]
    s = mirrored(2)
    value = np.asarray(case["value"], np.float32)
    with s.scope():
        assert np.asarray(s.reduce("MEAN", value, axis=None)).tolist() == case["n2_mean_axis_none"]
        assert float(s.reduce("MEAN", value, axis=0)) == case["n2_mean_axis_0"]
        assert float(s.reduce("SUM", value, axis=0)) == case["n2_sum_axis_0"] == 6.0
        assert float(s.reduce("MEAN", 3.0, axis=None)) == case["n2_mean_python_float_3.0"]
        with pytest.raises(ValueError):
            s.reduce("SUM", value, axis=None)
        with pytest.raises(ValueError):
            s.reduce("SUM", 3.0, axis=None)


def test_reduce_non_distributed_value_with_one_replica():
    case = REDUCE["non_distributed"]
    s = mirrored(1)
    value = np.asarray(case["value"], np.float32)
    assert np.asarray(s.reduce("MEAN", value, axis=None)).tolist() == case["n1_mean_axis_none"]
    assert float(s.reduce("MEAN", value, axis=0)) == case["n1_mean_axis_0"]
    assert np.asarray(s.reduce("SUM", value, axis=None)).tolist() == case["n1_sum_axis_none"]
    assert float(s.reduce("SUM", value, axis=0)) == case["n1_sum_axis_0"]
    assert np.asarray(s.gather(value, axis=0)).tolist() == case["n1_gather_axis0"]


def test_reduce_on_default_strategy_returns_the_value():
    value = np.array([1.0, 2.0], np.float32)
    strategy = distribute.get_strategy()
    assert np.asarray(strategy.reduce("SUM", value, axis=None)).tolist() == [1.0, 2.0]
    assert np.asarray(strategy.reduce("MEAN", value, axis=None)).tolist() == [1.0, 2.0]


def test_reduce_nested_structure():
    s = mirrored(2)
    v = s.experimental_distribute_values_from_function(
        lambda ctx: {"a": np.float32(ctx.replica_id_in_sync_group + 1), "b": (np.array([1.0, 1.0], np.float32) * ctx.replica_id_in_sync_group,)}
    )
    out = s.reduce("SUM", v, axis=None)
    assert float(out["a"]) == 3.0
    assert np.asarray(out["b"][0]).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("name", ["n2_range6_batch4_1d", "n2_range5_batch4_1d", "n2_range6_batch4_n_by_1", "n2_range5_batch4_n_by_1"])
def test_gather_and_reduce_of_partial_batches_match_tf(name):
    """Padding never shows: local results, gather and reduce of the input and of run's output."""
    case = tf_fixture()["gather_reduce_partial_batches"][name]
    s = mirrored(case["num_replicas"])
    n = int(name.split("range")[1].split("_")[0])
    column = name.endswith("n_by_1")
    ds = distribute.data.Dataset.range(n).map(lambda i: np.float32(i)).batch(4)
    if column:
        ds = distribute.data.Dataset.from_tensor_slices(np.arange(n, dtype=np.float32).reshape(n, 1)).batch(4)
    steps = list(s.experimental_distribute_dataset(ds))
    assert len(steps) == len(case["steps"])
    for x, expected in zip(steps, case["steps"]):
        y = s.run(lambda v: v * 2.0, args=(x,))
        for value, exp in ((x, expected["x"]), (y, expected["x_times_2"])):
            assert local_lists(s, value) == exp["per_replica"]
            assert np.asarray(s.gather(value, axis=0)).tolist() == exp["gather_axis0"]
            np.testing.assert_allclose(np.asarray(s.reduce("SUM", value, axis=0)), exp["reduce_sum_axis0"], rtol=1e-7)
            np.testing.assert_allclose(np.asarray(s.reduce("MEAN", value, axis=0)), exp["reduce_mean_axis0"], rtol=1e-7)


@pytest.mark.parametrize("name", ["range5_batch4", "range6_batch4"])
def test_reduce_axis_none_of_dataset_batches_matches_tf(name):
    steps = REDUCE["uneven_from_dataset_n2"][name]
    s = mirrored(2)
    n = int(name[5])
    ds = distribute.data.Dataset.from_tensor_slices(np.arange(n, dtype=np.float32)).batch(4)
    got = list(s.experimental_distribute_dataset(ds))
    assert len(got) == len(steps)
    for x, exp in zip(got, steps):
        assert local_lists(s, x) == exp["per_replica"]
        assert float(s.reduce("SUM", x, axis=0)) == exp["sum_axis0"]
        assert float(s.reduce("MEAN", x, axis=0)) == exp["mean_axis0"]
        assert np.asarray(s.gather(x, axis=0)).tolist() == exp["gather_axis0"]
        for op, key in (("SUM", "sum_axis_none"), ("MEAN", "mean_axis_none")):
            if isinstance(exp[key], dict):  # TF: shape mismatch error; ours: ValueError
                with pytest.raises(ValueError):
                    s.reduce(op, x, axis=None)
            else:
                assert np.asarray(s.reduce(op, x, axis=None)).tolist() == exp[key]


def test_gather_of_non_distributed_value_matches_tf():
    # TF 2.21 returns a plain (non-distributed) value unchanged: [1, 2], not [1, 2, 1, 2].
    case = REDUCE["non_distributed"]
    s = mirrored(2)
    value = np.asarray(case["value"], np.float32)
    with s.scope():
        got = np.asarray(s.gather(value, axis=0)).tolist()
    assert got == case["n2_gather_axis0"]


def test_local_results_of_plain_value_is_a_one_tuple():
    s = mirrored(2)
    value = np.array([1.0])
    out = s.experimental_local_results(value)
    assert isinstance(out, tuple) and len(out) == 1 and out[0] is value


def test_mirrored_value_local_results_and_reduce_mean():
    s = mirrored(2)
    m = distribute.Mirrored(np.array([1.0, 2.0], np.float32), s)
    assert local_lists(s, m) == [[1.0, 2.0], [1.0, 2.0]]
    assert np.asarray(s.reduce("MEAN", m, axis=None)).tolist() == REDUCE["mirrored_variable_n2_axis_none"]["MEAN"]


def test_padding_never_shows_when_replicas_have_equal_real_rows():
    """range(6).batch(4) on 2 replicas: the last step is [4] | [5], padded internally to 2 rows each."""
    s = mirrored(2)
    ds = distribute.data.Dataset.from_tensor_slices(np.arange(6, dtype=np.float32).reshape(6, 1)).batch(4)
    x = list(s.experimental_distribute_dataset(ds))[1]
    assert local_lists(s, x) == [[[4.0]], [[5.0]]]
    assert np.asarray(s.reduce("SUM", x, axis=None)).tolist() == [[9.0]]
    assert np.asarray(s.reduce("MEAN", x, axis=None)).tolist() == [[4.5]]
    assert np.asarray(s.reduce("SUM", x, axis=1)).tolist() == [9.0]
    assert np.asarray(s.gather(x, axis=1)).tolist() == [[4.0, 5.0]]
    y = s.run(lambda v: v * 2.0, args=(x,))
    assert np.asarray(s.reduce("SUM", y, axis=None)).tolist() == [[18.0]]
    assert np.asarray(s.gather(y, axis=1)).tolist() == [[8.0, 10.0]]


def test_reduce_of_a_mirrored_keras_variable_counts_every_replica():
    import keras

    strategy = mirrored(2)
    with strategy.scope():
        variable = keras.Variable(np.array([1.0, 2.0], np.float32))
    np.testing.assert_allclose(strategy.reduce("SUM", variable, axis=None), [2.0, 4.0])
    np.testing.assert_allclose(strategy.reduce("MEAN", variable, axis=None), [1.0, 2.0])
