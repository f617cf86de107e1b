"""Record TensorFlow 2.21's answers for the tester's ports of bug reports and TF / tf-keras tests.

Run from the repository root with a virtualenv that has tensorflow-cpu==2.21.0:

    /work/tfvenv/bin/python tests/parity/record_tf_reports.py

Writes tests/parity/tf_2_21_reports.json (plain JSON, read without TensorFlow by
tests/test_port_user_reports.py, tests/test_port_ctl_tests.py and tests/test_port_tf_keras_tests.py).
2 logical CPU devices, MirroredStrategy(["/cpu:0", "/cpu:1"]), eager ``run`` unless a case says
``tf.function``; Keras 3 is ``tf.keras``. Each result is recorded; an exception as
{"error": class, "msg": text}.
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["KERAS_BACKEND"] = "tensorflow"

import json  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from tensorflow.python.distribute import values as tf_values  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_2_21_reports.json")
RESULTS = {"meta": {"tensorflow_version": tf.__version__, "keras_version": keras.__version__,
                    "command": "/work/tfvenv/bin/python tests/parity/record_tf_reports.py",
                    "devices": "2 logical CPU devices"}}
S = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def case(name):
    def deco(fn):
        try:
            RESULTS[name] = fn()
        except Exception as e:  # noqa: BLE001 - the error is the recorded answer
            RESULTS[name] = {"error": type(e).__name__, "msg": str(e)[:300]}
        return fn
    return deco


def lr(x):
    return [np.asarray(t).tolist() for t in S.experimental_local_results(x)]


@case("all_reduce_mirrored_variable")  # tensorflow/tensorflow#45026
def _():
    with S.scope():
        v = tf.Variable(tf.ones((5,)))

    def fn(value):
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)

    mean = S.run(lambda value: tf.distribute.get_replica_context().all_reduce("MEAN", value), args=(v,))
    return {"sum": lr(S.run(fn, args=(v,))), "sum_tf_function": lr(tf.function(lambda: S.run(fn, args=(v,)))()),
            "mean": lr(mean)}


@case("reduce_without_axis")  # tensorflow/tensorflow#33388
def _():
    return S.reduce(tf.distribute.ReduceOp.SUM, S.run(lambda: tf.constant([1., 2.])))


@case("reduce_python_int")  # tensorflow/tensorflow#31852
def _():
    return S.reduce(tf.distribute.ReduceOp.SUM, 8, axis=None)


@case("empty_replica")  # tensorflow/tensorflow#61231
def _():
    out = []
    for x in S.experimental_distribute_dataset(tf.data.Dataset.range(5).batch(4)):
        xf = S.run(lambda t: tf.cast(t, tf.float32), args=(x,))
        out.append({"rows": lr(x), "sum": lr(S.run(tf.reduce_sum, args=(x,))),
                    "mean": [None if np.isnan(m) else m for m in lr(S.run(tf.reduce_mean, args=(xf,)))],
                    "average_loss": lr(S.run(tf.nn.compute_average_loss, args=(xf,))),
                    "reduce_sum": float(S.reduce("SUM", x, axis=0)), "reduce_mean": float(S.reduce("MEAN", x, axis=0))})
    return out


@case("strings_partial_batch")  # tensorflow/tensorflow#30847
def _():
    ds = tf.data.Dataset.from_tensor_slices((["a", "b", "c", "d", "e"], [0, 1, 2, 3, 4])).batch(4)
    return [{"text": [[t.decode() for t in r] for r in lr(text)], "num": lr(num)}
            for text, num in S.experimental_distribute_dataset(ds)]


@case("from_generator_end")  # tensorflow/tensorflow#32076
def _():
    def gen():
        for i in range(5):
            yield np.full((2,), i, np.int64)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_generator(gen, output_signature=tf.TensorSpec((2,), tf.int64))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)

    return [lr(x) for x in S.distribute_datasets_from_function(dataset_fn)]


@case("rank2_average_loss")  # tensorflow/tensorflow#33651
def _():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    batch = next(iter(S.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(4))))
    per = S.run(tf.nn.compute_average_loss, args=(batch,))
    return {"per_replica": lr(per), "sum": float(S.reduce("SUM", per, axis=None))}


@case("scale_regularization_loss")
def _():
    def on_replicas(losses):
        return lr(S.run(lambda: tf.nn.scale_regularization_loss(losses)))

    return {"list": on_replicas([tf.constant(0.4), tf.constant(0.2)]),
            "tuple_of_array": on_replicas((tf.constant([0.4, 0.2]),)), "empty": on_replicas([]),
            "array": on_replicas(tf.constant([0.4, 0.2])),
            "default_list": float(tf.nn.scale_regularization_loss([tf.constant(0.4), tf.constant(0.2)]))}


@case("batch_normalization")
def _():
    x = np.array([[0.], [0.], [2.], [2.]], np.float32)
    out = {}
    for sync in (False, True):
        with S.scope():
            bn = keras.layers.BatchNormalization(momentum=0.5, epsilon=0.001, synchronized=sync)
            bn.build((None, 1))
        batch = next(iter(S.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(4))))
        result = S.run(tf.function(lambda t: bn(t, training=True)), args=(batch,))
        out["synchronized" if sync else "unsynchronized"] = {
            "out": lr(result), "moving_mean": bn.moving_mean.numpy().tolist(),
            "moving_variance": bn.moving_variance.numpy().tolist()}
    return out


@case("dropout_masks_differ")
def _():
    with S.scope():
        drop = keras.layers.Dropout(0.5)
    ones = S.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(np.ones((2, 64), np.float32)).batch(2))
    first, second = lr(S.run(lambda t: drop(t, training=True), args=(next(iter(ones)),)))
    return first != second


@case("optimizer_unequal_input")  # tf-keras keras_optimizer_v2_test.testKerasOptimizerWithUnequalInput
def _():
    out = {}
    for name, aggregation in [("sum", tf.VariableAggregation.SUM), ("mean", tf.VariableAggregation.MEAN),
                              ("none", tf.VariableAggregation.NONE)]:
        with S.scope():
            var = tf.Variable(2.0, name="var", aggregation=aggregation)
            optimizer = keras.optimizers.Adam(learning_rate=0.01, beta_1=0.2, beta_2=0.2)

        def model_fn():
            replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf.GradientTape() as tape:
                loss = tf.cast(replica_id + 1, tf.float32) * 0.5 * var
            optimizer.apply_gradients(zip(tape.gradient(loss, [var]), [var]))

        steps = []
        for _ in range(2):
            S.run(model_fn)
            steps.append([var.numpy().item()] + [v.numpy().item() for v in optimizer.variables[2:]])
        out[name] = steps  # [var, m, v] after each step
    return out


@case("custom_aggregation")  # custom_training_loop_optimizer_test, Keras 3's apply_gradients
def _():
    out = {}
    for flag in (None, True, False):
        with S.scope():
            v = tf.Variable([0., 0.])
            optimizer = keras.optimizers.SGD(0.1)

        @tf.function
        def optimize():
            grads = tf_values.PerReplica([tf.convert_to_tensor([1., 1.]), tf.convert_to_tensor([2., 2.])])

            def step_fn(grads):
                if flag is None:
                    optimizer.apply_gradients([(grads, v)])
                else:
                    optimizer.apply_gradients([(grads, v)], experimental_aggregate_gradients=flag)
                return v.read_value()

            return S.experimental_local_results(S.run(step_fn, args=(grads,)))

        try:
            out[str(flag)] = [t.numpy().tolist() for t in optimize()]
        except Exception as e:  # noqa: BLE001
            out[str(flag)] = {"error": type(e).__name__, "msg": str(e)[:200]}
    return out


def _json(x):
    if isinstance(x, dict):
        return {k: _json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json(v) for v in x]
    if isinstance(x, (bool, str, type(None))):
        return x
    return np.asarray(x).tolist()


with open(OUT, "w") as f:
    json.dump(_json(RESULTS), f, indent=1, sort_keys=True)
print(f"wrote {OUT}: {len(RESULTS) - 1} cases")
