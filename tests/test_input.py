"""Distributed input: batch splitting (TF's rule), partial batches, datasets from a function."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distribute
from distribute.data import Dataset
from helpers import local_lists, mirrored, split_rule, tf_fixture

BATCH_SPLIT = tf_fixture()["batch_split"]


def _steps(strategy, dataset) -> list:
    return [local_lists(strategy, x) for x in strategy.experimental_distribute_dataset(dataset)]


@pytest.mark.parametrize(
    "num_replicas, n, batch, expected",
    [
        (2, 7, 7, [[[0, 1, 2, 3], [4, 5, 6]]]),
        (2, 6, 4, [[[0, 1], [2, 3]], [[4], [5]]]),
        (2, 5, 4, [[[0, 1], [2, 3]], [[4], []]]),
    ],
)
def test_batch_split_contiguous_in_order(num_replicas, n, batch, expected):
    assert _steps(mirrored(num_replicas), Dataset.range(n).batch(batch)) == expected


@pytest.mark.parametrize("name", sorted(BATCH_SPLIT))
def test_batch_split_matches_tf(name):
    case = BATCH_SPLIT[name]
    n, batch = (int(p) for p in case["dataset"].replace("range(", "").replace(").batch(", " ").rstrip(")").split())
    assert _steps(mirrored(case["num_replicas"]), Dataset.range(n).batch(batch)) == case["steps"]


@pytest.mark.parametrize("name", sorted(BATCH_SPLIT))
def test_gather_and_reduce_of_input_and_run_output_show_only_real_rows(name):
    case = BATCH_SPLIT[name]
    n, batch = (int(p) for p in case["dataset"].replace("range(", "").replace(").batch(", " ").rstrip(")").split())
    s = mirrored(case["num_replicas"])
    dist = s.experimental_distribute_dataset(Dataset.range(n).map(lambda i: np.float32(i)).batch(batch))
    for step, expected in zip(dist, case["steps"]):
        rows = [float(v) for part in expected for v in part]
        doubled = s.run(lambda v: v * 2.0, args=(step,))
        assert local_lists(s, doubled) == [[2.0 * v for v in part] for part in expected]
        assert np.asarray(s.gather(step, axis=0)).tolist() == rows
        assert np.asarray(s.gather(doubled, axis=0)).tolist() == [2.0 * v for v in rows]
        np.testing.assert_allclose(float(s.reduce("MEAN", doubled, axis=0)), 2.0 * np.mean(rows), rtol=1e-6)
        np.testing.assert_allclose(float(s.reduce("SUM", step, axis=0)), np.sum(rows), rtol=1e-6)


def test_tuple_and_dict_elements_keep_structure_and_split_together():
    s = mirrored(2)
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    y = np.arange(5, dtype=np.int32)
    steps = list(s.experimental_distribute_dataset(Dataset.from_tensor_slices({"x": x, "y": y}).batch(4)))
    assert len(steps) == 2
    last = steps[1]
    assert set(last) == {"x", "y"}
    assert local_lists(s, last["x"]) == [[[8.0, 9.0]], []]
    assert local_lists(s, last["y"]) == [[4], []]
    first = s.experimental_local_results(steps[0]["x"])
    assert [np.asarray(p).shape for p in first] == [(2, 2), (2, 2)]


def test_distributed_dataset_can_be_iterated_twice_and_by_get_next():
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(Dataset.range(4).batch(4))
    assert [local_lists(s, x) for x in dist] == [[[0, 1], [2, 3]]]
    assert [local_lists(s, x) for x in dist] == [[[0, 1], [2, 3]]]
    it = iter(dist)
    assert local_lists(s, it.get_next()) == [[0, 1], [2, 3]]
    assert not it.get_next_as_optional().has_value()
    with pytest.raises(StopIteration):
        it.get_next()


def test_default_strategy_returns_dataset_unchanged():
    ds = Dataset.range(3).batch(2)
    assert distribute.get_strategy().experimental_distribute_dataset(ds) is ds


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_distribute_datasets_from_function_input_context_and_order(num_replicas):
    s = mirrored(num_replicas)
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return Dataset.range(7).batch(ctx.get_per_replica_batch_size(2 * ctx.num_replicas_in_sync))

    steps = [local_lists(s, x) for x in s.distribute_datasets_from_function(dataset_fn)]
    assert len(contexts) == 1
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, num_replicas)
    # Elements [0,1], [2,3], [4,5], [6] go to replicas in turn.
    elements = [[0, 1], [2, 3], [4, 5], [6]]
    expected = []
    for start in range(0, len(elements), num_replicas):
        group = elements[start : start + num_replicas]
        expected.append(group + [[]] * (num_replicas - len(group)))
    assert steps == expected
    flat = [v for step in steps for part in step for v in part]
    assert flat == list(range(7))


def test_datasets_from_function_output_runs_through_run():
    s = mirrored(2)
    dist = s.distribute_datasets_from_function(lambda ctx: Dataset.range(6).map(lambda i: np.float32(i)).batch(2))
    totals = [float(s.reduce("SUM", s.run(lambda v: v + 1.0, args=(x,)), axis=0)) for x in dist]
    # steps: [0,1]|[2,3] and [4,5]|[] ; +1 on real rows only
    assert totals == [1.0 + 2 + 3 + 4, 5.0 + 6]


def test_input_context_per_replica_batch_size():
    fixture = tf_fixture()["errors"]
    assert distribute.InputContext(1, 0, 4).get_per_replica_batch_size(64) == fixture["input_context_get_per_replica_batch_size_64_over_4"]["no_error_result"]
    assert distribute.InputContext(1, 0, 3).get_per_replica_batch_size(0) == fixture["input_context_get_per_replica_batch_size_0_over_3"]["no_error_result"]


# -- property: every example exactly once, in order, split per TF's rule -----------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.integers(min_value=0, max_value=50),
    batch=st.integers(min_value=1, max_value=12),
    num_replicas=st.integers(min_value=1, max_value=4),
)
def test_every_example_exactly_once_in_order(size, batch, num_replicas):
    s = mirrored(num_replicas)
    steps = _steps(s, Dataset.range(size).batch(batch))
    assert len(steps) == -(-size // batch)
    seen = []
    for i, parts in enumerate(steps):
        assert len(parts) == num_replicas
        rows = list(range(i * batch, min((i + 1) * batch, size)))
        expected = [[rows[j] for j in piece] for piece in split_rule(len(rows), num_replicas)]
        assert parts == expected
        for part in parts:
            seen.extend(part)
    assert seen == list(range(size))
