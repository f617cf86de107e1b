"""TF guide "Distributed input" (tutorials/distribute/input.ipynb), ported by substitution only.

Substitutions: tf.distribute -> distribute, tf.data -> distribute.data, tf.keras -> keras,
@tf.function dropped (input_signature too), tf.print -> collecting values, tf.range -> range,
tf.constant -> numpy. The guide's two virtual CPUs are conftest's CPU devices 0 and 1.
Expected values are the guide's printed output, recorded with TF 2.21 where the guide prints
tensors (MirroredStrategy over 2 CPUs).
"""

from __future__ import annotations

import numpy as np
from helpers import mirrored

import distribute
from distribute.data import Dataset


def local(strategy, value):
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def test_non_distributed_loop():
    global_batch_size = 16
    dataset = Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)

    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    out = [np.asarray(train_step(inputs)) for inputs in dataset]
    assert [o.shape for o in out] == [(16, 1)] * 6 + [(4, 1)]
    np.testing.assert_allclose(np.concatenate(out), np.full((100, 1), 0.7), rtol=1e-6)


def test_experimental_distribute_dataset_first_element():
    mirrored_strategy = mirrored(2)
    dataset = Dataset.from_tensors(([1.], [1.])).repeat(100).batch(16)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    features, _labels = next(iter(dist_dataset))
    assert local(mirrored_strategy, features) == [[[1.]] * 8, [[1.]] * 8]


def test_auto_shard_options():
    dataset = Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
    options = distribute.data.Options()
    options.experimental_distribute.auto_shard_policy = distribute.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    assert dataset.options().experimental_distribute.auto_shard_policy == distribute.data.experimental.AutoShardPolicy.DATA
    assert dataset.cardinality() == 4


def test_distribute_datasets_from_function_double_batch():
    global_batch_size = 16
    mirrored_strategy = mirrored(2)

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        dataset = dataset.prefetch(2)
        return dataset

    dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
    shapes = [[np.shape(t) for t in mirrored_strategy.experimental_local_results(x[0])] for x in dist_dataset]
    # TF 2.21: one step; replica 0 gets the one (4, 16, 1) element, replica 1 an empty (0, 0, 1)
    assert len(shapes) == 1 and shapes[0][0] == (4, 16, 1) and shapes[0][1][0] == 0
    one = "PerReplicaSpec(TensorSpec(shape=(None, None, 1), dtype=float32, name=None), TensorSpec(shape=(None, None, 1), dtype=float32, name=None))"
    assert str(dist_dataset.element_spec) == f"({one}, {one})"  # TF 2.21's, with dtype=tf.float32


def test_distributed_loop_and_iterator_epochs():
    mirrored_strategy = mirrored(2)
    dataset = Dataset.from_tensors(([1.], [1.])).repeat(100).batch(16)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    losses = [local(mirrored_strategy, mirrored_strategy.run(train_step, args=(x,))) for x in dist_dataset]
    assert [[len(r) for r in step] for step in losses] == [[8, 8]] * 6 + [[2, 2]]
    np.testing.assert_allclose(np.concatenate([np.concatenate(s) for s in losses]), np.full((100, 1), 0.7), rtol=1e-6)

    num_epochs, steps_per_epoch = 3, 5
    seen = []
    for epoch in range(num_epochs):
        dist_iterator = iter(dist_dataset)
        for step in range(steps_per_epoch):
            loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
            loss2 = mirrored_strategy.run(train_step, args=(dist_iterator.get_next(),))
            seen.append((len(local(mirrored_strategy, loss)[0]), len(local(mirrored_strategy, loss2)[0])))
            if step == 2:
                break  # 7 batches: 3 pairs of next/get_next fit
    assert seen == [(8, 8), (8, 8), (8, 8)] * num_epochs


def test_get_next_as_optional_break():
    global_batch_size = 4
    steps_per_loop = 5
    strategy = mirrored(2)
    dataset = Dataset.range(9).batch(global_batch_size)
    distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))
    printed = []

    def train_fn(distributed_iterator):
        for _ in range(steps_per_loop):
            optional_data = distributed_iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
            printed.append(local(strategy, per_replica_results))

    train_fn(distributed_iterator)
    assert printed == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]  # the guide's tf.print output


def test_element_spec_step():
    mirrored_strategy = mirrored(2)
    dataset = Dataset.from_tensors(([1.], [1.])).repeat(100).batch(16)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    spec = dist_dataset.element_spec
    assert len(spec) == 2

    def train_step(per_replica_inputs):
        def step_fn(inputs):  # TF: 2 * inputs converts the (features, labels) tuple to one tensor
            return tuple(2 * t for t in inputs)

        return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))

    for _ in range(2):
        iterator = iter(dist_dataset)
        for _ in range(5):
            output = train_step(next(iterator))
            assert local(mirrored_strategy, output[0]) == [[[2.]] * 8, [[2.]] * 8]


def test_preprocessing_layer_in_dataset_fn():
    strategy = mirrored(2)
    vocab = ["a", "b", "c", "d", "f"]
    with strategy.scope():
        # was keras.layers.StringLookup(vocabulary=vocab): Keras 3's StringLookup needs TensorFlow
        # installed (ImportError), so a numpy lookup with its semantics (OOV -> 0, vocab from 1) stands in.
        table = {w: i + 1 for i, w in enumerate(vocab)}

        def layer(x):
            return np.asarray([table.get(w.decode() if isinstance(w, bytes) else str(w), 0) for w in np.asarray(x).reshape(-1)],
                              np.int64).reshape(np.shape(x))

    def dataset_fn(input_context):
        dataset = Dataset.from_tensor_slices(["a", "c", "e"]).repeat()
        global_batch_size = 4
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = dataset.batch(batch_size)
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

        def preprocess_with_kpl(input):
            return layer(input)

        return dataset.map(preprocess_with_kpl)

    it = iter(strategy.distribute_datasets_from_function(dataset_fn))
    got = [local(strategy, next(it)) for _ in range(3)]
    assert got == [[[1, 3], [0, 1]], [[3, 0], [1, 3]], [[0, 1], [3, 0]]]  # TF 2.21


def test_enumerate_predict():
    mirrored_strategy = mirrored(2)
    dataset = Dataset.range(24).enumerate().batch(6)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def predict(index, inputs):
        outputs = 2 * inputs
        return index, outputs

    result = {}
    for index, inputs in dist_dataset:
        output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
        rindices = []
        for a in mirrored_strategy.experimental_local_results(output_index):
            rindices.extend(np.asarray(a))  # was a.numpy()
        routputs = []
        for a in mirrored_strategy.experimental_local_results(outputs):
            routputs.extend(np.asarray(a))
        for i, value in zip(rindices, routputs):
            result[int(i)] = int(value)
    assert result == {i: 2 * i for i in range(24)}


def test_distribute_values_from_function():
    mirrored_strategy = mirrored(2)

    def value_fn(ctx):
        return np.asarray(ctx.replica_id_in_sync_group)  # was tf.constant

    distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
    for _ in range(4):
        result = mirrored_strategy.run(lambda x: x, args=(distributed_values,))
        assert [int(v) for v in local(mirrored_strategy, result)] == [0, 1]


def test_from_generator_unbatched_rank1():
    mirrored_strategy = mirrored(2)
    rng = np.random.RandomState(0)

    def input_gen():
        while True:
            yield rng.rand(4)

    dataset = Dataset.from_generator(input_gen, output_types=("float32"), output_shapes=(4,))
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    iterator = iter(dist_dataset)
    got = [local(mirrored_strategy, mirrored_strategy.run(lambda x: x, args=(next(iterator),))) for _ in range(2)]
    expected = np.random.RandomState(0).rand(8).astype(np.float32)
    # TF 2.21: each (4,) element is split 2 | 2 between the replicas
    np.testing.assert_allclose(np.array(got).reshape(-1), expected, rtol=1e-6)
    assert np.array(got).shape == (2, 2, 2)
