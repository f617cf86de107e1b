"""Record TensorFlow 2.21's answers for distribute.GradientTape's tests (tests/test_gradient_tape.py).

Run from the repository root with a virtualenv that has tensorflow-cpu==2.21.0:

    /work/tfvenv/bin/python tests/parity/record_tf_tape.py

Writes tests/parity/tf_2_21_tape.json.  The programs of ``tape_cases.py`` run
eagerly with ``tf.GradientTape``; the strategy programs run in
``tf.distribute.MirroredStrategy`` over 2 of 3 logical CPU devices under
``tf.function``, as TF's tutorials write them.  An exception is recorded as
{"error": class, "msg": text}.
"""

import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["KERAS_BACKEND"] = "tensorflow"

import json
import types

import numpy as np
import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

import keras

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tape_cases import CASES

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_2_21_tape.json")
RESULTS = {"meta": {"tensorflow_version": tf.__version__, "keras_version": keras.__version__,
                    "command": "/work/tfvenv/bin/python tests/parity/record_tf_tape.py",
                    "devices": "3 logical CPU devices (MirroredStrategy on the first 2)"}}


def jl(x):
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: jl(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jl(v) for v in x]
    if isinstance(x, tf.distribute.DistributedValues):
        return [jl(v) for v in x.values]
    return np.asarray(x).tolist()


def record(name, fn):
    try:
        RESULTS[name] = jl(fn())
    except Exception as e:  # noqa: BLE001 - the error is the recorded answer
        RESULTS[name] = {"error": type(e).__name__, "msg": str(e)[:300]}


NS = types.SimpleNamespace(GT=tf.GradientTape, var=lambda x: tf.Variable(x, dtype=tf.float32),
                           const=lambda x: tf.constant(x, tf.float32), to_int=lambda x: tf.cast(x, tf.int32),
                           stop_gradient=tf.stop_gradient, square=tf.square)
for name, make in CASES.items():
    record(f"case/{name}", lambda: make(NS)())

S = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
W0 = np.array([[0.5], [-0.25]], np.float32)
X = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], np.float32)
Y = np.array([[1.0], [0.0], [2.0], [1.0]], np.float32)


def per_replica_gradients():
    """Each replica's gradient of its own loss; apply_gradients sums them."""
    with S.scope():
        w = tf.Variable(W0)
        opt = keras.optimizers.SGD(0.1)
    ds = S.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(4))

    @tf.function
    def train_step(inputs):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(tf.square(tf.matmul(x, w) - y)[:, 0], global_batch_size=4)
            grads = tape.gradient(loss, [w])
            opt.apply_gradients(zip(grads, [w]))
            return grads[0], loss
        return S.run(step_fn, args=inputs)

    grads, losses = train_step(next(iter(ds)))
    return {"grads": jl(grads), "losses": jl(losses), "w": w.numpy().tolist()}


def gan_step():
    """Two tapes over one block in a replica function (TF's DCGAN tutorial shape)."""
    with S.scope():
        gen = tf.Variable([[0.5, -0.5]], name="gen")
        disc = tf.Variable([[1.0], [0.25]], name="disc")
        g_opt, d_opt = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.2)
    noise = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    real = X
    ds = S.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((noise, real)).batch(4))

    @tf.function
    def train_step(inputs):
        def step_fn(z, r):
            with tf.GradientTape() as gen_tape, tf.GradientTape() as disc_tape:
                fake = tf.matmul(z, gen)
                fake_out, real_out = tf.matmul(fake, disc), tf.matmul(r, disc)
                g_loss = tf.nn.compute_average_loss(tf.square(fake_out - 1.0)[:, 0], global_batch_size=4)
                d_loss = tf.nn.compute_average_loss((tf.square(real_out - 1.0) + tf.square(fake_out))[:, 0], global_batch_size=4)
            g_grads = gen_tape.gradient(g_loss, [gen])
            d_grads = disc_tape.gradient(d_loss, [disc])
            g_opt.apply_gradients(zip(g_grads, [gen]))
            d_opt.apply_gradients(zip(d_grads, [disc]))
            return g_loss, d_loss
        return S.run(step_fn, args=inputs)

    losses = [jl(train_step(b)) for b in ds for _ in range(2)]
    return {"losses": losses, "gen": gen.numpy().tolist(), "disc": disc.numpy().tolist()}


def watch_input_per_replica():
    """tape.watch of the replica's input (an adversarial example's gradient), per replica."""
    with S.scope():
        w = tf.Variable(W0)
    ds = S.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(4))

    @tf.function
    def step(inputs):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.square(tf.matmul(x, w) - y))
            return tape.gradient(loss, x)
        return S.run(step_fn, args=inputs)

    return jl(step(next(iter(ds))))


def all_reduce_in_block():
    """The gradient of an all-reduced loss, in a full and an uneven step."""
    with S.scope():
        w = tf.Variable([2.0])

    @tf.function
    def step(x):
        def step_fn(x):
            ctx = tf.distribute.get_replica_context()
            with tf.GradientTape() as tape:
                total = ctx.all_reduce("SUM", tf.reduce_sum(x * w))
            return tape.gradient(total, w)
        return S.run(step_fn, args=(x,))

    ds = tf.data.Dataset.from_tensor_slices(np.array([1.0, 2.0, 3.0], np.float32)).batch(2)
    return [jl(step(x)) for x in S.experimental_distribute_dataset(ds)]


def merge_calls():
    """ReplicaContext.merge_call's answers, eager and under tf.function, in a full and an uneven step."""
    def replica_value():
        ctx = tf.distribute.get_replica_context()
        return ctx, tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)

    def reduce_sum():
        ctx, v = replica_value()
        return ctx.merge_call(lambda s, value: s.reduce("SUM", value, axis=None), args=(v,))

    def local_results():
        ctx, v = replica_value()
        out = ctx.merge_call(lambda s, value: s.experimental_local_results(value), args=(v,))
        return out[0] * 10 + out[1], len(out)

    def identity():
        ctx, v = replica_value()
        return ctx.merge_call(lambda s, value: value, args=(v,))

    def keyword():
        ctx, v = replica_value()
        return ctx.merge_call(lambda s, a, b=None: s.reduce("MEAN", a, axis=None) + b, args=(v,), kwargs={"b": 10.0})

    def pair():
        ctx, v = replica_value()
        return ctx.merge_call(lambda s, value: (s.reduce("SUM", value, axis=None), value), args=(v,))

    def context():
        ctx = tf.distribute.get_replica_context()
        return ctx.merge_call(lambda s: (tf.distribute.in_cross_replica_context(),
                                         tf.distribute.get_replica_context() is None, s is S))

    out = {}
    for name, fn in [("reduce_sum", reduce_sum), ("local_results", local_results), ("identity", identity),
                     ("keyword", keyword), ("pair", pair)]:
        out[name] = jl(S.run(fn))
        out[name + "_tf_function"] = jl(tf.function(lambda: S.run(fn))())
    out["context"] = list(S.run(context))
    out["default_strategy"] = float(tf.distribute.get_replica_context().merge_call(
        lambda s, x: s.reduce("SUM", x, axis=None) * 2, args=(tf.constant(3.0),)))

    def uneven(x):
        ctx = tf.distribute.get_replica_context()
        return ctx.merge_call(lambda s, value: s.reduce("SUM", value, axis=0), args=(x,))

    ds = tf.data.Dataset.from_tensor_slices(np.array([1.0, 2.0, 3.0], np.float32)).batch(3)
    out["uneven_reduce_axis0"] = [jl(S.run(uneven, args=(x,))) for x in S.experimental_distribute_dataset(ds)]
    return out


def central_storage():
    """CentralStorageStrategy over 2 compute devices (logical CPUs 1 and 2) with the variables on CPU 0."""
    cs = tf.distribute.experimental.CentralStorageStrategy(compute_devices=["/cpu:1", "/cpu:2"], parameter_device="/cpu:0")
    out = {"num_replicas_in_sync": cs.num_replicas_in_sync, "parameter_devices": list(cs.extended.parameter_devices)}
    with cs.scope():
        v = tf.Variable(1.0)
        vs = tf.Variable(1.0, aggregation=tf.VariableAggregation.SUM)
        vm = tf.Variable(1.0, aggregation=tf.VariableAggregation.MEAN)
    out["variable_device"] = v.device

    def fn():
        ctx = tf.distribute.get_replica_context()
        r = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
        vs.assign_add(r)
        vm.assign(r * 10)
        return r

    steps = []
    for _ in range(2):
        cs.run(fn)
        steps.append([float(vs.numpy()), float(vm.numpy())])
    out["aggregated_variables"] = steps
    x = np.arange(16, dtype=np.float32).reshape(8, 2) / 10
    y = np.arange(8, dtype=np.float32).reshape(8, 1) / 10
    with cs.scope():
        m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        m.set_weights([np.array([[0.5], [-0.25]], np.float32), np.array([0.1], np.float32)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = m.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history
    out["fit"] = {"loss": history["loss"], "weights": jl(m.get_weights()), "evaluate": m.evaluate(x, y, verbose=0)}
    with cs.scope():
        w = tf.Variable(W0)
        opt = keras.optimizers.SGD(0.1)
    ds = cs.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(2))

    @tf.function
    def train_step(inputs):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(tf.square(tf.matmul(x, w) - y)[:, 0], global_batch_size=2)
            grads = tape.gradient(loss, [w])
            opt.apply_gradients(zip(grads, [w]))
            return loss
        return cs.reduce("SUM", cs.run(step_fn, args=inputs), axis=None)

    out["custom_loop"] = {"losses": [float(train_step(b)) for b in ds], "w": w.numpy().tolist()}
    return out


def parity_gaps():
    """Issue 18's part 4: extended.update per copy, variable validation, InputOptions, fit's sample_weight,
    Checkpoint.restore(None), the minimize-loss test of tensorflow/python/distribute/strategy_test_lib.py."""
    out = {}

    def local(x):
        return [np.asarray(v).tolist() for v in S.experimental_local_results(x)]

    def per_replica_values():
        return S.experimental_distribute_values_from_function(lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group + 1)))

    def guarded(fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the error is the recorded answer
            return {"error": type(e).__name__, "msg": str(e)[:300]}

    def sum_on_read_assign():
        with S.scope():
            v = tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
        S.extended.update(v, lambda var, x: var.assign(x), args=(5.0,))
        return [float(v.numpy()), local(v)]

    def mean_on_read_assign():
        with S.scope():
            v = tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.MEAN)
        S.extended.update(v, lambda var, x: var.assign(x), args=(5.0,))
        return [float(v.numpy()), local(v)]

    def on_read_per_replica():
        with S.scope():
            v = tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
        S.extended.update(v, lambda var, x: var.assign_add(x), args=(per_replica_values(),))
        return [float(v.numpy()), local(v)]

    def mirrored_plain():
        with S.scope():
            v = tf.Variable(1.0)
        result = S.extended.update(v, lambda var, x: var.assign_add(x), args=(2.0,))
        return [float(v.numpy()), local(v), type(result).__name__, local(result)]

    def mirrored_per_replica():
        with S.scope():
            v = tf.Variable(1.0)
        S.extended.update(v, lambda var, x: var.assign_add(x), args=(per_replica_values(),))
        return [float(v.numpy()), local(v)]

    def merge_fn_update():
        with S.scope():
            v = tf.Variable(1.0)

        def fn():
            ctx = tf.distribute.get_replica_context()
            g = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)

            def merge_fn(strategy, grad):
                total = strategy.extended.reduce_to("SUM", grad, destinations=v)
                return strategy.extended.update(v, lambda var, t: var.assign_sub(0.5 * t), args=(total,))
            ctx.merge_call(merge_fn, args=(g,))
            return v.read_value()
        return [local(S.run(fn)), float(v.numpy())]

    def minimize_loss():
        with S.scope():
            kernel = tf.Variable([[0.5]], name="kernel")

        def loss(x):
            y = tf.reshape(tf.matmul(x, kernel), []) - tf.identity(1.0)
            return y * y

        def grad_fn(x):
            with tf.GradientTape() as tape:
                value = loss(x)
            return tape.gradient(value, kernel)

        one = tf.identity([[1.0]])
        history = []
        for _ in range(10):
            g = S.run(grad_fn, args=(one,))
            before = float(kernel.numpy()[0, 0])
            g = S.extended.reduce_to(tf.distribute.ReduceOp.SUM, g, destinations=kernel)
            S.extended.update(kernel, lambda v, g: v.assign_sub(0.2 * g), args=(g,), group=False)
            history.append([before, float(kernel.numpy()[0, 0])])
        return history

    def sync_none():
        with S.scope():
            keras.Variable(1.0, synchronization="none")

    def fit_sample_weight(strategy):
        with strategy.scope():
            m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
            m.compile("sgd", "mse")
        m.fit(tf.data.Dataset.from_tensor_slices((np.ones((4, 1)), np.ones((4, 1)))).batch(2), sample_weight=np.ones(4), verbose=0)

    def options(**kwargs):
        S.distribute_datasets_from_function(lambda ctx: tf.data.Dataset.range(4).batch(2), tf.distribute.InputOptions(**kwargs))
        return "accepted"

    def restore_none():
        status = tf.train.Checkpoint(v=tf.Variable(1.0)).restore(None)
        result = [type(status).__name__]
        for name in ("assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match", "expect_partial"):
            result.append([name, guarded(lambda: getattr(status, name)() and "ok")])
        return result

    def sync_on_read_checkpoint():
        import tempfile

        with S.scope():
            v = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
        S.run(lambda: v.assign_add(tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)))
        before = [float(v.numpy()), local(v)]
        path = tf.train.Checkpoint(v=v).save(os.path.join(tempfile.mkdtemp(), "c"))
        with S.scope():
            w = tf.Variable(5.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
        tf.train.Checkpoint(v=w).restore(path)
        with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
            u = tf.Variable(5.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
        tf.train.Checkpoint(v=u).restore(path)
        return {"before": before, "restored": [float(w.numpy()), local(w)], "one_device": float(u.numpy())}

    out["sync_on_read_checkpoint"] = guarded(sync_on_read_checkpoint)
    out["update/sum_on_read_assign"] = guarded(sum_on_read_assign)
    out["update/mean_on_read_assign"] = guarded(mean_on_read_assign)
    out["update/on_read_per_replica"] = guarded(on_read_per_replica)
    out["update/mirrored_plain"] = guarded(mirrored_plain)
    out["update/mirrored_per_replica"] = guarded(mirrored_per_replica)
    out["update/in_merge_fn"] = guarded(merge_fn_update)
    out["minimize_loss"] = guarded(minimize_loss)
    out["synchronization_none"] = guarded(sync_none)
    out["fit_sample_weight/no_strategy"] = guarded(lambda: fit_sample_weight(tf.distribute.get_strategy()))
    out["fit_sample_weight/mirrored"] = guarded(lambda: fit_sample_weight(S))
    out["options/place_per_worker"] = guarded(lambda: options(experimental_place_dataset_on_device=True))
    out["options/place_per_replica_fetch"] = guarded(lambda: options(
        experimental_place_dataset_on_device=True, experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA))
    out["options/place_per_replica_no_fetch"] = guarded(lambda: options(
        experimental_place_dataset_on_device=True, experimental_fetch_to_device=False,
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA))
    out["restore_none"] = guarded(restore_none)
    return out


record("parity_gaps", parity_gaps)
record("central_storage", central_storage)
record("merge_call", merge_calls)
record("mirrored/all_reduce_in_block", all_reduce_in_block)
record("mirrored/per_replica_gradients", per_replica_gradients)
record("mirrored/gan_step", gan_step)
record("mirrored/watch_input_per_replica", watch_input_per_replica)

if __name__ == "__main__":
    with open(OUT, "w") as f:
        json.dump(RESULTS, f, indent=1, sort_keys=True)
    print(f"wrote {OUT}: {len(RESULTS) - 1} cases")
