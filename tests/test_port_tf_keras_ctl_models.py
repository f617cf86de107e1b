"""tf-keras' custom_training_loop_models_test.py, ported by substitution, with values asserted.

Source: keras-team/tf-keras tf_keras/distribute/custom_training_loop_models_test.py (KerasModelsTest).
Substitutions: tf.distribute -> distribute, tf.data -> distribute.data, tf_keras -> keras (Keras 3),
keras.optimizers.legacy.* -> keras.optimizers.*, tf.GradientTape -> distribute.GradientTape,
``for _ in tf.range(n)`` -> ``range(n)``, tf.reduce_mean -> keras.ops.mean,
``model.save_weights(".h5")`` -> ``".weights.h5"`` (Keras 3's rule), ``input_shape=`` ->
``keras.Input``, tf.nest.map_structure -> jax.tree_util.tree_map, @tf.function -> @distribute.function.
``all_strategies`` -> the default strategy, OneDeviceStrategy and MirroredStrategy over 2 CPU devices.

The TF tests only check that the programs run (their inputs and targets are zeros). Here the inputs
are random (seeded) and each program's result is asserted: the same program under the default
strategy (one device) gives the same weights, as tf.distribute promises for gradients summed across
replicas (``_get_dataset``: 31 rows in batches of 10, so the last step is uneven, 1 | 0 rows);
test_lstm's per-replica ``reduce_mean`` loss makes TF's summed gradient R times one device's mean
gradient, which is asserted; test_variable_run_argument is checked against its closed form.
Changes beyond substitution: most models are built before the step (Keras 3 builds on the first call;
the program as TF writes it, building inside the step, is test_model_built_inside_the_step_trains);
``nested_tf_functions`` gives model2 its own optimizer (a Keras 3 optimizer is bound to the variables
it first updates). The one-device references use distribute.compute_gradients.

Found by this port (fixed): every Keras RNN layer failed inside ``run`` and ``fit`` under any strategy
(keras_support/layers.py, lifting.py); ``compute_gradients`` refused a per-example loss vector and the
integer seed state in an LSTM's ``model.variables`` (tape.gradient sums the target and gives None).

Not ported: test_batch_norm_with_dynamic_batch (zeros in and out: per-replica batch statistics
are not observable), test_customized_tf_module_run (tf.Module), test_reduce_loss (Keras 3 gives NaN
for its zero logits on every strategy alike), the XLA/TPU class.
"""

from __future__ import annotations

import os

import jax
import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute
from distribute.data import Dataset

STRATEGIES = ["one_device", "mirrored_2"]


def make(name):
    if name == "default":
        return distribute.get_strategy()
    if name == "one_device":
        return distribute.OneDeviceStrategy("/cpu:0")
    return mirrored(int(name.rsplit("_", 1)[1]))


def _get_dataset():
    rng = np.random.default_rng(0)  # was np.zeros: values make the results observable
    inputs = rng.normal(size=(31, 3)).astype(np.float32)
    targets = rng.normal(size=(31, 4)).astype(np.float32)
    dataset = Dataset.from_tensor_slices((inputs, targets))
    dataset = dataset.batch(10)
    return dataset


def _get_model():
    keras.utils.set_random_seed(5)  # added: one initial model for every strategy
    x = keras.layers.Input(shape=(3,), name="input")
    y = keras.layers.Dense(4, name="dense")(x)
    model = keras.Model(x, y)
    return model


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def _assert_same(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def single_keras_layer_run(distribution):
    dataset = _get_dataset()
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset))

    with distribution.scope():
        keras.utils.set_random_seed(5)
        model = keras.layers.Dense(4, name="dense")
        model.build((None, 3))  # added: Keras 3 builds on the first call, inside the step

    @distribute.function
    def train_step(iterator):
        def step_fn(inputs):
            images, targets = inputs
            with distribute.GradientTape() as tape:
                outputs = model(images)
                loss = keras.losses.mean_squared_error(targets, outputs)

            grads = tape.gradient(loss, model.variables)
            return grads

        outputs = distribution.run(step_fn, args=(next(iterator),))
        return jax.tree_util.tree_map(distribution.experimental_local_results, outputs,
                                      is_leaf=lambda v: isinstance(v, distribute.DistributedValues))

    return train_step(input_iterator)


@pytest.mark.parametrize("name", STRATEGIES)
def test_single_keras_layer_run(name):
    got = single_keras_layer_run(make(name))
    ref = single_keras_layer_run(distribute.get_strategy())
    # each replica's gradient is its rows' (5 of the first batch's 10); they sum to one device's
    summed = [sum(np.asarray(r) for r in per_replica) for per_replica in got]
    _assert_same(summed, [np.asarray(r[0]) for r in ref])
    if name == "mirrored_2":
        assert len(got[0]) == 2 and not np.allclose(np.asarray(got[0][0]), np.asarray(got[0][1]))


def keras_model_optimizer_run(distribution, subclass=False, loop=False):
    def get_subclass_model():
        class KerasSubclassModel(keras.Model):
            def __init__(self):
                super().__init__()
                self.l = keras.layers.Dense(4, name="dense")

            def call(self, x):
                return self.l(x)

        keras.utils.set_random_seed(5)
        model = KerasSubclassModel()
        model(np.zeros((1, 3), np.float32))  # added: see test_lazily_built_model_trains
        return model

    dataset = _get_dataset()
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset))

    with distribution.scope():
        model = get_subclass_model() if subclass else _get_model()
        optimizer = keras.optimizers.RMSprop()

    def step_fn(inputs):
        images, targets = inputs
        with distribute.GradientTape() as tape:
            outputs = model(images)
            loss = keras.losses.mean_squared_error(targets, outputs)

        grads = tape.gradient(loss, model.variables)
        optimizer.apply_gradients(zip(grads, model.variables))
        return loss

    @distribute.function
    def train_step(replicated_inputs):
        outputs = distribution.run(step_fn, args=(replicated_inputs,))
        return jax.tree_util.tree_map(distribution.experimental_local_results, outputs,
                                      is_leaf=lambda v: isinstance(v, distribute.DistributedValues))

    if subclass:  # test_keras_subclass_model_optimizer_run: one step
        train_step(next(input_iterator))
    elif loop:  # test_keras_model_optimizer_run_loop: for _ in tf.range(4)
        for _ in range(4):
            distribution.run(step_fn, args=(next(input_iterator),))
    else:  # test_keras_model_optimizer_run: every batch, the last one uneven
        for x in input_iterator:
            train_step(x)
    return _weights(model)


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("variant", ["run", "subclass", "loop"])
def test_keras_model_optimizer_run(name, variant):
    kwargs = {"subclass": variant == "subclass", "loop": variant == "loop"}
    got = keras_model_optimizer_run(make(name), **kwargs)
    ref = keras_model_optimizer_run(distribute.get_strategy(), **kwargs)
    _assert_same(got, ref)


def lstm(distribution):
    batch_size = 32

    def create_lstm_model():
        keras.utils.set_random_seed(9)
        model = keras.models.Sequential()
        # We only have LSTM variables so we can detect no gradient issues
        # more easily.
        model.add(keras.Input((10, 1)))
        model.add(keras.layers.LSTM(1, return_sequences=False))
        return model

    def create_lstm_data():
        seq_length = 10
        rng = np.random.default_rng(1)  # was np.random.rand
        x_train = rng.random((batch_size, seq_length, 1)).astype("float32")
        y_train = rng.random((batch_size, 1)).astype("float32")
        return x_train, y_train

    x, y = create_lstm_data()
    dataset = Dataset.from_tensor_slices((x, y))
    dataset = dataset.batch(batch_size)
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset))

    with distribution.scope():
        model = create_lstm_model()
        optimizer = keras.optimizers.SGD()

    @distribute.function
    def train_step(input_iterator):
        def step_fn(inputs):
            inps, targ = inputs
            with distribute.GradientTape() as tape:
                output = model(inps)
                loss = keras.ops.mean(keras.losses.binary_crossentropy(y_true=targ, y_pred=output, from_logits=False))

            grads = tape.gradient(loss, model.variables)
            optimizer.apply_gradients(zip(grads, model.variables))
            return loss

        outputs = distribution.run(step_fn, args=(next(input_iterator),))
        return distribution.experimental_local_results(outputs)

    losses = train_step(input_iterator)
    return [float(v) for v in losses], _weights(model), x, y


@pytest.mark.parametrize("name", STRATEGIES)
def test_lstm(name):
    distribution = make(name)
    losses, got, x, y = lstm(distribution)
    # one device, gradient of R x the mean loss: each replica's mean-loss gradient is summed
    replicas = distribution.num_replicas_in_sync
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((10, 1)), keras.layers.LSTM(1, return_sequences=False)])
    optimizer = keras.optimizers.SGD()
    loss, grads = distribute.compute_gradients(
        lambda: replicas * keras.ops.mean(keras.losses.binary_crossentropy(y, model(x))), model.variables)
    optimizer.apply_gradients(zip(grads, model.variables))
    _assert_same(got, _weights(model))
    np.testing.assert_allclose(np.mean(losses), float(loss) / replicas, rtol=1e-5)


@pytest.mark.parametrize("name", STRATEGIES)
def test_nested_tf_functions(name, tmp_path):
    distribution = make(name)
    rng = np.random.default_rng(2)
    inputs = rng.random((10, 3)).astype(np.float32)
    host_inputs = inputs
    targets = np.ones((10, 4), dtype=np.float32)
    dataset = Dataset.from_tensor_slices((inputs, targets)).repeat()
    dataset = dataset.batch(10)
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset))

    def get_model():
        x = keras.layers.Input(shape=(3,), name="input")
        y = keras.layers.Dense(4, name="dense")(x)
        model = keras.Model(x, y)
        return model

    with distribution.scope():
        model = get_model()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.01)
        weights_file = os.path.join(str(tmp_path), ".weights.h5")
        model.save_weights(weights_file)
        model2 = get_model()
        model2.load_weights(weights_file)
        # added: a Keras 3 optimizer is bound to the variables it first updates
        optimizer2 = keras.optimizers.SGD(0.1, momentum=0.01)

    # Make sure model and model2 variables are in sync when initialized.
    for model_v, model2_v in zip(model.variables, model2.variables):
        np.testing.assert_allclose(model_v.numpy(), model2_v.numpy())
    initial = _weights(model)

    def compute_loss(images, targets):
        outputs = model(images)
        return keras.losses.mean_squared_error(targets, outputs)

    @distribute.function
    def train_step_without_nested_tf_function(inputs):
        def step_fn(inputs):
            images, targets = inputs
            with distribute.GradientTape() as tape:
                loss = compute_loss(images, targets)
            grads = tape.gradient(loss, model.variables)
            optimizer.apply_gradients(zip(grads, model.variables))

        distribution.run(step_fn, args=(inputs,))

    @distribute.function
    def compute_loss2(images, targets):
        outputs = model2(images)
        return keras.losses.mean_squared_error(targets, outputs)

    @distribute.function
    def train_step_with_nested_tf_function(inputs):
        def step_fn(inputs):
            images, targets = inputs
            with distribute.GradientTape() as tape:
                loss = compute_loss2(images, targets)
            grads = tape.gradient(loss, model2.variables)
            optimizer2.apply_gradients(zip(grads, model2.variables))

        distribution.run(step_fn, args=(inputs,))

    inputs = next(input_iterator)

    train_step_without_nested_tf_function(inputs)
    train_step_with_nested_tf_function(inputs)

    # Make sure model and model2 variables are still in sync.
    for model_v, model2_v in zip(model.variables, model2.variables):
        np.testing.assert_allclose(model_v.numpy(), model2_v.numpy())
    # added: they moved by SGD's first step on the summed gradient (momentum starts at 0)
    ref = get_model()
    ref.set_weights(initial)
    _, grads = distribute.compute_gradients(lambda: keras.losses.mean_squared_error(targets, ref(host_inputs)),
                                            ref.variables)
    _assert_same(_weights(model), [w - 0.1 * np.asarray(g) for w, g in zip(initial, grads)])


@pytest.mark.parametrize("name", STRATEGIES)
def test_nested_tf_functions_with_control_flow(name):
    def program(distribution):
        rng = np.random.default_rng(3)
        inputs = rng.random((10, 3)).astype(np.float32)
        targets = np.ones((10, 4), dtype=np.float32)
        dataset = Dataset.from_tensor_slices((inputs, targets)).repeat()
        dataset = dataset.batch(10)
        input_iterator = iter(distribution.experimental_distribute_dataset(dataset))

        with distribution.scope():
            model = _get_model()
            optimizer = keras.optimizers.SGD(0.1, momentum=0.01)

        def step_fn(inputs):
            images, targets = inputs
            with distribute.GradientTape() as tape:
                outputs = model(images)
                loss = keras.losses.mean_squared_error(targets, outputs)

            grads = tape.gradient(loss, model.variables)
            optimizer.apply_gradients(zip(grads, model.variables))

        @distribute.function
        def train_step(iterator):
            distribution.run(step_fn, args=(next(iterator),))

        @distribute.function
        def train_steps(iterator):
            for _ in range(10):
                train_step(iterator)

        train_steps(input_iterator)
        return _weights(model)

    _assert_same(program(make(name)), program(distribute.get_strategy()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", STRATEGIES)
def test_variable_run_argument(name):
    # Test that variables passed to run() remain variables. Previous
    # behavior in TPUStrategy was to cast to Tensor.
    distribution = make(name)
    with distribution.scope():
        optimizer = keras.optimizers.SGD(0.1)
        net = keras.layers.Dense(1, trainable=True)
        net.build((None, 1))  # added: Keras 3 builds on the first call
    (k0,), (b0,) = [np.asarray(w).reshape(-1) for w in net.get_weights()]
    dataset = Dataset.from_tensors([[1.0]])
    dataset = dataset.repeat()
    dataset = dataset.batch(2, drop_remainder=True)

    def replica_step(trainable_variables, features):
        with distribute.GradientTape() as tape:
            net_out = net(features[0], training=True)
            loss = (net_out - 1.0) * (net_out - 1.0)
        gradients = tape.gradient(loss, trainable_variables)
        optimizer.apply_gradients(zip(gradients, trainable_variables))
        return loss

    @distribute.function
    def step(features):
        per_replica_losses = distribution.run(replica_step, (net.trainable_variables, features))
        loss = distribution.reduce(distribute.ReduceOp.SUM, per_replica_losses, axis=None)
        return loss

    loss = step(next(iter(distribution.experimental_distribute_dataset(dataset))))
    # every replica sees features[0] = [[1.0]]: loss (k + b - 1)^2 each, gradients summed over R
    replicas = distribution.num_replicas_in_sync
    residual = k0 + b0 - 1.0
    np.testing.assert_allclose(np.asarray(loss).reshape(-1), [replicas * residual ** 2], rtol=1e-6)
    k1, b1 = [np.asarray(w).reshape(-1)[0] for w in net.get_weights()]
    np.testing.assert_allclose([k1, b1], [k0 - 0.1 * replicas * 2 * residual, b0 - 0.1 * replicas * 2 * residual],
                               rtol=1e-6)


def model_built_inside_the_step(distribution):
    class KerasSubclassModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.l = keras.layers.Dense(4, name="dense")

        def call(self, x):
            return self.l(x)

    with distribution.scope():
        keras.utils.set_random_seed(5)
        model = KerasSubclassModel()
        optimizer = keras.optimizers.RMSprop()

    def step_fn(inputs):
        images, targets = inputs
        with distribute.GradientTape() as tape:
            outputs = model(images)
            loss = keras.losses.mean_squared_error(targets, outputs)

        grads = tape.gradient(loss, model.variables)
        optimizer.apply_gradients(zip(grads, model.variables))
        return loss

    for inputs in distribution.experimental_distribute_dataset(_get_dataset()):
        distribution.run(step_fn, args=(inputs,))
    return _weights(model)


@pytest.mark.parametrize("name", STRATEGIES)
def test_model_built_inside_the_step_trains(name):
    """tf-keras' program as written: the model is built by its first call, inside the tape's block; the
    weights after every batch (the last one uneven) are one device's, as TF's."""
    got = model_built_inside_the_step(make(name))
    assert len(got) == 2
    _assert_same(got, model_built_inside_the_step(distribute.get_strategy()))
