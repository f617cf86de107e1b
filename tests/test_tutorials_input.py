"""The input sections of the official tf.distribute tutorials, ported by substitution only.

``tf.distribute`` -> ``distribute``, ``tf.data`` -> ``distribute.data``; where a
tutorial calls a TensorFlow op inside a ``map`` function or loads MNIST from
the network, the nearest numpy line stands in and says so. ``@tf.function``
decorators are dropped (``run`` always compiles). Values are asserted.

Tutorials (tensorflow.org, TF 2.21 docs):
distributed_training (tutorials/distribute/keras), custom_training
(tutorials/distribute/custom_training), multi_worker_with_keras,
multi_worker_with_ctl, and the guide distributed_input.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute

tf = None  # nothing below may use TensorFlow


def mnist_like(n=256):
    """MNIST stand-in: sklearn's 8x8 digits as uint8 28x28-free images (the tutorials download MNIST)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images[:n] * 16).astype(np.uint8)[..., None]  # (n, 8, 8, 1), 0..255
    return images, digits.target[:n].astype(np.int64)


# -- tutorials/distribute/keras (distributed_training) ------------------------------------------


def test_distributed_training_input():
    strategy = mirrored(2)
    images, labels = mnist_like(200)
    mnist_train = distribute.data.Dataset.from_tensor_slices((images[:160], labels[:160]))  # was tfds.load(...)
    mnist_test = distribute.data.Dataset.from_tensor_slices((images[160:], labels[160:]))
    num_train_examples = 160
    BUFFER_SIZE = 10000
    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    def scale(image, label):
        image = image.astype(np.float32)  # was tf.cast(image, tf.float32)
        image /= 255
        return image, label

    train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

    assert BATCH_SIZE == 128 and train_dataset.cardinality() == 2 and eval_dataset.cardinality() == 1
    seen = np.concatenate([y for _, y in train_dataset])
    assert sorted(seen.tolist()) == sorted(labels[:160].tolist()) and len(seen) == num_train_examples
    first_x, _ = next(iter(train_dataset))
    assert first_x.dtype == np.float32 and first_x.shape == (128, 8, 8, 1) and 0.0 <= first_x.min() <= first_x.max() <= 1.0

    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    history = model.fit(train_dataset, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)
    assert np.isfinite(eval_loss) and 0.0 <= eval_acc <= 1.0


# -- tutorials/distribute/custom_training -----------------------------------------------------


def test_custom_training_input():
    strategy = mirrored(2)
    (train_images, train_labels), (test_images, test_labels) = (mnist_like(100), mnist_like(30))  # was fashion_mnist.load_data()
    train_images = train_images[..., 0][..., None]
    train_images = train_images / np.float32(255)
    test_images = test_images / np.float32(255)
    BUFFER_SIZE = len(train_images)
    BATCH_SIZE_PER_REPLICA = 16
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    train_dataset = distribute.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)
    test_dataset = distribute.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    rows = []
    for x in train_dist_dataset:
        _, labels = x
        rows.append([int(np.shape(v)[0]) for v in strategy.experimental_local_results(labels)])
    assert rows == [[16, 16]] * 3 + [[2, 2]]  # 100 = 3 x 32 + 4 -> the last batch of 4 split 2 | 2
    test_rows = [[int(np.shape(v)[0]) for v in strategy.experimental_local_results(x[1])] for x in test_dist_dataset]
    assert test_rows == [[15, 15]]


# -- multi_worker_with_keras -----------------------------------------------------------------


def test_multi_worker_with_keras_input():
    def mnist_dataset(batch_size):
        (x_train, y_train), _ = mnist_like(96), None  # was keras.datasets.mnist.load_data()
        x_train = x_train / np.float32(255)
        y_train = y_train.astype(np.int64)
        train_dataset = distribute.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
        return train_dataset

    strategy = distribute.MultiWorkerMirroredStrategy()  # one worker here; tests/test_multi_worker_input.py runs several
    per_worker_batch_size = 16
    num_workers = 1
    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_dataset(global_batch_size)
    assert multi_worker_dataset.cardinality() == distribute.data.INFINITE_CARDINALITY

    options = distribute.data.Options()
    options.experimental_distribute.auto_shard_policy = distribute.data.experimental.AutoShardPolicy.OFF
    dataset_no_auto_shard = multi_worker_dataset.with_options(options)
    assert dataset_no_auto_shard.options().experimental_distribute.auto_shard_policy == distribute.data.experimental.AutoShardPolicy.OFF

    with strategy.scope():
        multi_worker_model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
        multi_worker_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                   optimizer=keras.optimizers.SGD(learning_rate=0.001), metrics=["accuracy"])
    history = multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=5, verbose=0)
    assert len(history.history["loss"]) == 2


# -- multi_worker_with_ctl ---------------------------------------------------------------------


def test_multi_worker_with_ctl_input():
    def mnist_dataset():
        (x_train, y_train), _ = mnist_like(100), None  # was keras.datasets.mnist.load_data()
        x_train = x_train / np.float32(255)
        y_train = y_train.astype(np.int64)
        train_dataset = distribute.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000)
        return train_dataset

    def dataset_fn(global_batch_size, input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = mnist_dataset()
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        return dataset

    strategy = distribute.MultiWorkerMirroredStrategy()
    per_worker_batch_size = 32
    num_workers = 1
    global_batch_size = per_worker_batch_size * num_workers
    with strategy.scope():
        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context))
    iterator = iter(multi_worker_dataset)
    labels = []
    for _ in range(4):
        _, y = next(iterator)
        labels.extend(int(v) for part in strategy.experimental_local_results(y) for v in np.asarray(part))
    assert sorted(labels) == sorted(mnist_like(100)[1].tolist())
    with pytest.raises(StopIteration):
        next(iterator)


# -- guide: distributed_input ------------------------------------------------------------------


def test_distributed_input_guide_basic_loop():
    global_batch_size = 16
    mirrored_strategy = mirrored(2)
    dataset = distribute.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    losses = []
    for x in dist_dataset:
        loss = mirrored_strategy.run(train_step, args=(x,))
        losses.append([np.asarray(v).reshape(-1).tolist() for v in mirrored_strategy.experimental_local_results(loss)])
    assert len(losses) == 7  # 100 = 6 x 16 + 4
    np.testing.assert_allclose(losses[0], [[0.7] * 8, [0.7] * 8], rtol=1e-6)
    np.testing.assert_allclose(losses[-1], [[0.7] * 2, [0.7] * 2], rtol=1e-6)


def test_distributed_input_guide_options_and_from_function():
    global_batch_size = 16
    dataset = distribute.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
    options = distribute.data.Options()
    options.experimental_distribute.auto_shard_policy = distribute.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    assert dataset.options().experimental_distribute.auto_shard_policy == distribute.data.experimental.AutoShardPolicy.DATA

    mirrored_strategy = mirrored(2)

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = distribute.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        dataset = dataset.prefetch(2)  # This prefetches 2 batches per device.
        return dataset

    dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
    shapes = [[np.shape(v) for v in mirrored_strategy.experimental_local_results(x[0])] for x in dist_dataset]
    assert shapes == [[(4, 16, 1), (0, 16, 1)]]  # 4 batches of 16, batched by 8: one element, replica 2 gets none


def test_distributed_input_guide_iter_and_get_next_as_optional():
    global_batch_size = 4
    mirrored_strategy = mirrored(2)
    dataset = distribute.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    num_epochs, steps_per_epoch = 2, 5
    count = 0
    for epoch in range(num_epochs):
        dist_iterator = iter(dist_dataset)
        for step in range(steps_per_epoch):
            loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
            count += sum(np.size(v) for v in mirrored_strategy.experimental_local_results(loss))
    assert count == num_epochs * steps_per_epoch * global_batch_size

    steps_per_loop = 5
    strategy = mirrored(2)
    dataset = distribute.data.Dataset.range(9).batch(global_batch_size)
    distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))
    printed = []

    def train_fn(distributed_iterator):
        for _ in range(steps_per_loop):
            optional_data = distributed_iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            per_replica_results = strategy.run(lambda x: x, args=(optional_data.get_value(),))
            printed.append([np.asarray(v).tolist() for v in strategy.experimental_local_results(per_replica_results)])

    train_fn(distributed_iterator)
    assert printed == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]  # the guide's printed output


def test_distributed_input_guide_element_spec():
    global_batch_size = 16
    epochs = 2
    steps_per_epoch = 5
    mirrored_strategy = mirrored(2)
    dataset = distribute.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    spec = dist_dataset.element_spec
    assert repr(spec[0]) == ("PerReplicaSpec(TensorSpec(shape=(None, 1), dtype=float32, name=None), "
                             "TensorSpec(shape=(None, 1), dtype=float32, name=None))")

    def train_step(per_replica_inputs):  # was @tf.function(input_signature=[dist_dataset.element_spec])
        def step_fn(inputs):
            return 2 * inputs[0]

        return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))

    outputs = []
    for _ in range(epochs):
        iterator = iter(dist_dataset)
        for _ in range(steps_per_epoch):
            output = train_step(next(iterator))
            outputs.append(float(np.sum(mirrored_strategy.reduce("SUM", output, axis=0))))
    assert outputs == [32.0] * 10


def test_distributed_input_guide_enumerate_predict():
    mirrored_strategy = mirrored(2)
    dataset_size = 24
    batch_size = 6
    dataset = distribute.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    def predict(index, inputs):
        outputs = 2 * inputs
        return index, outputs

    result = {}
    for index, inputs in dist_dataset:
        output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
        indices = list(mirrored_strategy.experimental_local_results(output_index))
        rindices = []
        for a in indices:
            rindices.extend(np.asarray(a))  # the guide: a.numpy()
        outputs = list(mirrored_strategy.experimental_local_results(outputs))
        routputs = []
        for a in outputs:
            routputs.extend(np.asarray(a))  # the guide: a.numpy()
        for i, value in zip(rindices, routputs):
            result[int(i)] = int(value)
    assert result == {i: 2 * i for i in range(dataset_size)}


def test_distributed_input_guide_generator():
    mirrored_strategy = mirrored(2)
    rng = np.random.default_rng(0)

    def input_gen():
        while True:
            yield rng.random(4)

    dataset = distribute.data.Dataset.from_generator(
        input_gen, output_types=(np.float32), output_shapes=(4,))  # was tf.float32, tf.TensorShape([4])
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    iterator = iter(dist_dataset)
    for _ in range(4):
        result = mirrored_strategy.run(lambda x: x, args=(next(iterator),))
        parts = mirrored_strategy.experimental_local_results(result)
        assert [np.shape(p) for p in parts] == [(2,), (2,)]  # each element of 4 split 2 | 2, as TF


def test_readme_moving_a_tf_data_input_function_over_runs():
    import pathlib

    page = (pathlib.Path(__file__).parents[1] / "docs" / "guides" / "input.md").read_text()
    section = page[page.index("## Moving a tf.data input function over"):]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "input.md", "exec"), namespace)  # noqa: S102 - the page's own example
    assert namespace["steps"] == 4
    assert repr(namespace["dist"].element_spec[0]).startswith("PerReplicaSpec(TensorSpec(shape=(None, 2, 2), dtype=float32")
