"""Record TensorFlow 2.21's answers for the ported guide cells and the tester's programs.

Run from the repository root with a virtualenv that has tensorflow-cpu==2.21.0:

    /work/tfvenv/bin/python tests/parity/record_tf_ports.py

Writes tests/parity/tf_2_21_ports.json (plain JSON, read without TensorFlow by
tests/test_port_distributed_training_guide.py and tests/test_port_user_programs.py).
The programs are TF's, from the guide "Distributed training with TensorFlow"
(site/en/guide/distributed_training.ipynb) with fixed initial weights, and small
user programs; each result is recorded, an exception as {"error": class, "msg": text}.
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["KERAS_BACKEND"] = "tensorflow"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

import keras  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_2_21_ports.json")
RESULTS = {"meta": {"tensorflow_version": tf.__version__, "keras_version": keras.__version__,
                    "command": "/work/tfvenv/bin/python tests/parity/record_tf_ports.py",
                    "devices": "3 logical CPU devices"}}
W0 = [np.array([[0.5]], np.float32), np.array([0.0], np.float32)]


SECTION = sys.argv[1] if len(sys.argv) > 1 else None


def case(name):
    def deco(fn):
        if SECTION is None or not name.startswith(SECTION):
            return fn
        try:
            RESULTS[name] = fn()
        except Exception as e:  # noqa: BLE001 - the error is the recorded answer
            RESULTS[name] = {"error": type(e).__name__, "msg": str(e)[:300]}
        return fn
    return deco


def jl(x):
    if isinstance(x, dict):
        return {k: jl(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jl(v) for v in x]
    return np.asarray(x).tolist()


mirrored_strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) if SECTION == "guide" else None


@case("guide_constructors")
def _():
    return {
        "gpu_devices_on_cpu_machine": tf.distribute.MirroredStrategy(devices=["/gpu:0", "/gpu:1"]).num_replicas_in_sync,
        "hierarchical_copy": tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()).num_replicas_in_sync,
        "one_device_gpu_on_cpu_machine": tf.distribute.OneDeviceStrategy(device="/gpu:0").num_replicas_in_sync,
        "default_reduce": float(tf.distribute.get_strategy().reduce("SUM", 1.0, axis=None)),
    }


@case("guide_keras")
def _():
    with mirrored_strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,),
                                                           kernel_regularizer=tf.keras.regularizers.L2(1e-4))])
        model.compile(loss="mse", optimizer="sgd")
    model.set_weights(W0)
    dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(10)
    fit_ds = model.fit(dataset, epochs=2, verbose=0).history["loss"]
    evaluate = model.evaluate(dataset, verbose=0)
    inputs, targets = np.ones((100, 1)), np.ones((100, 1))
    fit_np = model.fit(inputs, targets, epochs=2, batch_size=10, verbose=0).history["loss"]
    return {"fit_ds": fit_ds, "evaluate": evaluate, "fit_np": fit_np, "weights": jl(model.get_weights())}


@case("guide_custom_loop")
def _():
    global_batch_size = 5 * mirrored_strategy.num_replicas_in_sync
    with mirrored_strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,),
                                                           kernel_regularizer=tf.keras.regularizers.L2(1e-4))])
        optimizer = tf.keras.optimizers.SGD()
    model.set_weights(W0)
    dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(1000).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    loss_object = tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss)
        model_losses = model.losses
        if model_losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        return loss

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = compute_loss(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(dist_inputs):
        per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
        return mirrored_strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = [float(distributed_train_step(d)) for d in dist_dataset]
    iterator = iter(dist_dataset)
    losses2 = [float(distributed_train_step(next(iterator))) for _ in range(10)]
    return {"losses": losses, "losses2": losses2, "weights": jl(model.get_weights())}


# ---- the tester's programs (tests/test_port_user_programs.py) ----
S3 = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"]) if SECTION == "user" else None
_rng = np.random.default_rng(0)
X36 = _rng.normal(size=(36, 4)).astype(np.float32)
Y36 = (X36[:, 0] > 0).astype(np.int64) + (X36[:, 1] > 0).astype(np.int64)
WD = [np.full((4, 3), 0.1, np.float32) * np.arange(3, dtype=np.float32), np.zeros(3, np.float32)]


def _dense_model(metrics):
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics)
    model.set_weights(WD)
    return model


@case("user_metric_created_outside_scope")
def _():
    top2 = tf.keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")
    with S3.scope():
        model = _dense_model([top2])
    return model.fit(X36, Y36, batch_size=12, epochs=1, verbose=0, shuffle=False).history


@case("user_metric_created_in_scope")
def _():
    with S3.scope():
        model = _dense_model([tf.keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"), "accuracy"])
    history = model.fit(X36, Y36, batch_size=12, epochs=2, verbose=0, shuffle=False).history
    evaluate = model.evaluate(X36, Y36, batch_size=12, verbose=0, return_dict=True)
    return {"history": history, "evaluate": evaluate, "weights": jl(model.get_weights())}


@case("user_auc_precision_fit_evaluate")
def _():
    yb = (X36[:, 0] > 0).astype(np.float32)
    with S3.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[tf.keras.metrics.AUC(name="auc", from_logits=True), tf.keras.metrics.Precision(name="p")])
    model.set_weights([np.array([[0.3], [-0.2], [0.1], [0.05]], np.float32), np.zeros(1, np.float32)])
    history = model.fit(X36, yb, batch_size=12, epochs=2, verbose=0, shuffle=False).history
    return {"history": history, "evaluate": model.evaluate(X36, yb, batch_size=12, verbose=0, return_dict=True)}


@case("user_reduce_mean_axis0_uneven_ints")
def _():
    batch = next(iter(S3.experimental_distribute_dataset(tf.data.Dataset.range(7).map(lambda x: x * 2).batch(7))))
    return [jl(S3.experimental_local_results(batch)), float(S3.reduce("SUM", batch, axis=0)),
            float(S3.reduce("MEAN", batch, axis=0)), jl(S3.gather(batch, axis=0))]


@case("user_run_kwargs_dict")
def _():
    ds = tf.data.Dataset.from_tensor_slices({"a": np.arange(6, dtype=np.float32),
                                             "b": np.arange(6, dtype=np.float32) * 10}).batch(6)
    b = next(iter(S3.experimental_distribute_dataset(ds)))
    r = S3.run(lambda x, scale: {"s": x["a"] * scale + x["b"]}, args=(b,), kwargs={"scale": 2.0})
    return jl([S3.experimental_local_results(r["s"]), S3.reduce("SUM", r["s"], axis=0),
               S3.reduce("MEAN", r["s"], axis=0), S3.reduce("MEAN", r["s"], axis=None)])


@case("user_distribute_datasets_from_function_uneven")
def _():
    def fn(ctx):
        return tf.data.Dataset.range(10).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(
            ctx.get_per_replica_batch_size(6))
    return [jl(S3.experimental_local_results(b)) for b in S3.distribute_datasets_from_function(fn)]


@case("user_values_from_function")
def _():
    v = S3.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
    return jl([S3.experimental_local_results(v), S3.reduce("SUM", v, axis=None), S3.reduce("MEAN", v, axis=None)])


@case("user_input_api")
def _():
    it = iter(S3.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(3)))
    optionals = []
    for _ in range(3):
        opt = it.get_next_as_optional()
        has = bool(opt.has_value())
        optionals.append([has, jl(S3.experimental_local_results(opt.get_value())) if has else None])

    def branch(x):
        if tf.distribute.get_replica_context().replica_id_in_sync_group == 0:
            return x * 10
        return x

    batch = next(iter(S3.experimental_distribute_dataset(tf.data.Dataset.range(6).batch(6))))
    try:
        S3.experimental_distribute_dataset(tf.data.Dataset.range(6).batch(6), options=tf.distribute.InputOptions(
            experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA))
        per_replica = "no error"
    except Exception as e:  # noqa: BLE001
        per_replica = [type(e).__name__, str(e)]
    return {"get_next_as_optional": optionals,
            "python_branch": jl(S3.experimental_local_results(S3.run(branch, args=(batch,)))),
            "all_gather": jl(S3.experimental_local_results(S3.run(
                lambda x: tf.distribute.get_replica_context().all_gather(x, axis=0), args=(batch,)))),
            "all_reduce_nested": jl(S3.experimental_local_results(S3.run(
                lambda x: tf.distribute.get_replica_context().all_reduce("SUM", {"a": x, "b": (x * 2,)}), args=(batch,)))),
            "per_replica_on_experimental_distribute_dataset": per_replica,
            "reduce_mean_python_float": float(S3.reduce("MEAN", 3.0, axis=None))}


if __name__ == "__main__":
    if SECTION is not None:  # a child: one group of cases (TF's collectives do not mix strategies of 2 and 3 devices)
        print("RESULT " + json.dumps(RESULTS))
        sys.exit(0)
    for section in ("guide", "user"):
        out = subprocess.run([sys.executable, __file__, section], capture_output=True, text=True, check=True).stdout
        RESULTS.update(json.loads(out.split("RESULT ", 1)[1]))
    with open(OUT, "w") as f:
        json.dump(RESULTS, f, indent=1, sort_keys=True)
        f.write("\n")
    print(OUT)
