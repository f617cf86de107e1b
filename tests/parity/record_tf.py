"""Record tf.distribute reference values from TensorFlow 2.21 into tf_2_21.json.

Run from the repository root with a virtualenv that has tensorflow-cpu==2.21.0:

    python3 -m venv /work/tfvenv
    /work/tfvenv/bin/pip install tensorflow-cpu==2.21.0 numpy
    /work/tfvenv/bin/python tests/parity/record_tf.py
    /work/tfvenv/bin/python tests/parity/record_tf.py --only data   # one section, merged in

The output is plain JSON (nested lists of numbers, per replica where distributed),
so the test suite reads it without TensorFlow. Every case runs in its own child
process (see the task registry below) and a failure is recorded as
{"error": class, "message": ...} instead of stopping the run.
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
# The JAX project sets KERAS_BACKEND=jax in its tests; this script needs TF.
os.environ["KERAS_BACKEND"] = "tensorflow"

import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# 8 logical CPU devices, before anything else touches the runtime.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
CPU_NAMES = [d.name for d in tf.config.list_logical_devices("CPU")]
assert len(CPU_NAMES) == 8, CPU_NAMES

import keras  # noqa: E402  (tf.keras is Keras 3 on the TF backend in 2.21)

tf.random.set_seed(0)
np.random.seed(0)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_2_21.json")


# ---------------------------------------------------------------- helpers ---

def mirrored(n):
    return tf.distribute.MirroredStrategy(devices=CPU_NAMES[:n])


def py(x):
    """Tensor / ndarray / scalar / nest -> JSON-able Python."""
    if isinstance(x, (list, tuple)):
        return [py(v) for v in x]
    if isinstance(x, dict):
        return {k: py(v) for k, v in x.items()}
    if isinstance(x, (tf.Tensor, tf.Variable)) or hasattr(x, "numpy"):
        x = x.numpy()
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "SO":
            return py(x.tolist())
        return x.tolist()
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, bytes):
        return x.decode()
    return x


def local(strategy, x):
    """Per-replica lists of a (possibly) distributed value."""
    return [py(v) for v in strategy.experimental_local_results(x)]


def guarded(fn):
    """Run fn; on an exception return its record instead of raising."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recording, not handling
        return _record_error(e)


# ------------------------------------------------------------ task registry ---
#
# Every case is a "task" run in its own child process. TF's collective ops keep
# process-wide state: two MirroredStrategy objects in one process reuse the same
# collective instance keys, so a gather on the second strategy can fail with a
# bogus "Shape mismatch in the collective instance 100" error, and one aborted
# collective poisons every later one ("Restart your program to reset"). One
# process per task keeps each recorded value independent of the others.

TASKS = []  # (path tuple, zero-arg function returning JSON-able data)
VALUES = []  # (path tuple, constant JSON-able data, recorded without TF work)


def task(*path):
    def deco(fn):
        TASKS.append((path, fn))
        return fn
    return deco


def add_task(path, fn):
    TASKS.append((tuple(path), fn))


def add_value(path, value):
    VALUES.append((tuple(path), value))


def run_in(strategy, fn, mode, args=()):
    """strategy.run(fn) eagerly or inside tf.function; per-replica lists."""
    f = lambda: strategy.run(fn, args=args)  # noqa: E731
    if mode == "tf_function":
        f = tf.function(f)
    return local(strategy, f())


# ----------------------------------------------------------------- case 1 ---
# experimental_local_results of each element of experimental_distribute_dataset.

def _batch_split(n, size, batch):
    s = mirrored(n)
    ds = tf.data.Dataset.range(size).batch(batch)
    return {"num_replicas": n, "dataset": f"range({size}).batch({batch})",
            "steps": [local(s, el) for el in s.experimental_distribute_dataset(ds)]}


for _n, _pairs in {2: [(7, 7), (6, 4), (5, 4)],
                   3: [(10, 4), (10, 8), (1, 4)],
                   4: [(10, 4), (10, 8), (1, 4)]}.items():
    for _size, _batch in _pairs:
        add_task(("batch_split", f"n{_n}_range{_size}_batch{_batch}"),
                 lambda n=_n, size=_size, batch=_batch: _batch_split(n, size, batch))


# ----------------------------------------------------------------- case 2 ---
# gather / reduce(SUM|MEAN, axis=0) of distributed input elements, N=2, with
# partial final batches, before and after strategy.run(v * 2).

def _gather_reduce(size, batch, shape):
    s = mirrored(2)
    ds = tf.data.Dataset.range(size).batch(batch).map(lambda v: tf.cast(v, tf.float32))
    if shape == "(n,1)":
        ds = ds.map(lambda v: tf.reshape(v, (-1, 1)))
    steps = []
    for x in s.experimental_distribute_dataset(ds):
        x2 = s.run(lambda v: v * 2.0, args=(x,))
        step = {}
        for tag, val in [("x", x), ("x_times_2", x2)]:
            step[tag] = {
                "per_replica": local(s, val),
                "gather_axis0": guarded(lambda val=val: py(s.gather(val, axis=0))),
                "reduce_sum_axis0": guarded(lambda val=val: py(s.reduce("SUM", val, axis=0))),
                "reduce_mean_axis0": guarded(lambda val=val: py(s.reduce("MEAN", val, axis=0))),
            }
        steps.append(step)
    return {"num_replicas": 2, "dataset": f"range({size}).batch({batch}) cast float32",
            "element_shape": shape, "steps": steps}


for _size in (6, 5):
    for _shape, _tag in (("(n,1)", "n_by_1"), ("(n,)", "1d")):
        add_task(("gather_reduce_partial_batches", f"n2_range{_size}_batch4_{_tag}"),
                 lambda size=_size, shape=_shape: _gather_reduce(size, 4, shape))


# ----------------------------------------------------------------- case 3 ---

def _from_fn(s, values):
    return s.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(values[ctx.replica_id_in_sync_group], dtype=tf.float32))


_OPS = {
    "sum_axis_none": lambda s, x: s.reduce("SUM", x, axis=None),
    "mean_axis_none": lambda s, x: s.reduce("MEAN", x, axis=None),
    "sum_axis0": lambda s, x: s.reduce("SUM", x, axis=0),
    "mean_axis0": lambda s, x: s.reduce("MEAN", x, axis=0),
    "gather_axis0": lambda s, x: s.gather(x, axis=0),
}

add_value(("reduce", "even_values_from_function_n2", "per_replica_input"), [[1.0, 2.0], [3.0, 4.0]])
add_value(("reduce", "uneven_values_from_function_n2", "per_replica_input"), [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0]])
for _case, _vals in (("even_values_from_function_n2", [[1.0, 2.0], [3.0, 4.0]]),
                     ("uneven_values_from_function_n2", [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0]])):
    for _op, _f in _OPS.items():
        add_task(("reduce", _case, _op),
                 lambda vals=_vals, f=_f: (lambda s: py(f(s, _from_fn(s, vals))))(mirrored(2)))


def _uneven_from_dataset(size):
    # range(6).batch(4) -> step 2 is [4],[5]; range(5).batch(4) -> step 2 is [4],[].
    s = mirrored(2)
    ds = tf.data.Dataset.range(size).batch(4).map(lambda v: tf.cast(v, tf.float32))
    steps = []
    for x in s.experimental_distribute_dataset(ds):
        step = {"per_replica": local(s, x)}
        for op in ("sum_axis0", "mean_axis0", "gather_axis0", "sum_axis_none", "mean_axis_none"):
            step[op] = guarded(lambda x=x, op=op: py(_OPS[op](s, x)))
        steps.append(step)
    return steps


for _size in (5, 6):
    add_task(("reduce", "uneven_from_dataset_n2", f"range{_size}_batch4"),
             lambda size=_size: _uneven_from_dataset(size))

# reduce / gather of a non-distributed value (a plain tensor / Python float).
add_value(("reduce", "non_distributed", "value"), [1.0, 2.0])
for _n in (1, 2):
    for _op in ("MEAN", "SUM"):
        for _axis in (None, 0):
            add_task(("reduce", "non_distributed", f"n{_n}_{_op.lower()}_axis_{_axis if _axis is not None else 'none'}"),
                     lambda n=_n, op=_op, axis=_axis: py(mirrored(n).reduce(op, tf.constant([1.0, 2.0]), axis=axis)))
    add_task(("reduce", "non_distributed", f"n{_n}_gather_axis0"),
             lambda n=_n: py(mirrored(n).gather(tf.constant([1.0, 2.0]), axis=0)))
for _op in ("MEAN", "SUM"):
    add_task(("reduce", "non_distributed", f"n2_{_op.lower()}_python_float_3.0"),
             lambda op=_op: py(mirrored(2).reduce(op, 3.0, axis=None)))


def _reduce_mirrored_variable():
    # A MirroredVariable (identical on every replica) is a DistributedValues.
    s = mirrored(2)
    with s.scope():
        v = tf.Variable([1.0, 2.0])
    return {op: guarded(lambda op=op: py(s.reduce(op, v, axis=None))) for op in ("SUM", "MEAN")}


add_task(("reduce", "mirrored_variable_n2_axis_none"), _reduce_mirrored_variable)


# ----------------------------------------------------------------- case 4 ---

_LOSS = [1.0, 2.0, 3.0, 4.0]
_SW = [1.0, 0.0, 1.0, 0.0]
add_value(("losses", "inputs"), {"per_example_loss": _LOSS, "sample_weight": _SW})


def _mixed_empty():
    # replica 0 has [1,2,3,4], replica 1 an empty loss vector
    rid = tf.distribute.get_replica_context().replica_id_in_sync_group
    n = tf.where(tf.equal(rid, 0), 4, 0)
    return tf.nn.compute_average_loss(tf.constant(_LOSS)[:n])


_LOSS_FNS = {
    "default": lambda: tf.nn.compute_average_loss(tf.constant(_LOSS)),
    "sample_weight_1010": lambda: tf.nn.compute_average_loss(tf.constant(_LOSS), sample_weight=tf.constant(_SW)),
    "global_batch_size_8": lambda: tf.nn.compute_average_loss(tf.constant(_LOSS), global_batch_size=8),
    "empty": lambda: tf.nn.compute_average_loss(tf.zeros((0,), tf.float32)),
    "empty_global_batch_size_8": lambda: tf.nn.compute_average_loss(tf.zeros((0,), tf.float32), global_batch_size=8),
    "scale_regularization_loss_0.4": lambda: tf.nn.scale_regularization_loss(tf.constant(0.4)),
}

for _mode in ("eager", "tf_function"):
    def _losses_in_run(mode=_mode):
        s = mirrored(2)
        out = {k: guarded(lambda f=f: run_in(s, f, mode)) for k, f in _LOSS_FNS.items()}
        out["replica0_4_replica1_empty"] = guarded(lambda: run_in(s, _mixed_empty, mode))
        return out
    add_task(("losses", f"in_run_n2_{_mode}"), _losses_in_run)


def _losses_outside():
    out = {k: guarded(lambda f=f: py(f())) for k, f in _LOSS_FNS.items()}
    out["num_replicas_in_sync_default_strategy"] = tf.distribute.get_strategy().num_replicas_in_sync
    return out


add_task(("losses", "outside_strategy"), _losses_outside)


def _losses_in_scope():
    s = mirrored(2)
    with s.scope():
        return {k: guarded(lambda f=f: py(f())) for k, f in _LOSS_FNS.items()}


add_task(("losses", "in_scope_cross_replica_n2"), _losses_in_scope)


# ----------------------------------------------------------------- case 5 ---

def _rc_sum_id():
    ctx = tf.distribute.get_replica_context()
    return ctx.all_reduce("SUM", ctx.replica_id_in_sync_group)


def _rc_mean_float_id():
    ctx = tf.distribute.get_replica_context()
    return ctx.all_reduce("MEAN", tf.cast(ctx.replica_id_in_sync_group, tf.float32))


def _rc_gather_const():
    return tf.distribute.get_replica_context().all_gather(tf.constant([1, 2, 3]), axis=0)


def _rc_matrix():
    r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
    return tf.constant([[0.0, 1.0], [2.0, 3.0]]) + 4.0 * r


def _rc_gather_matrix(axis):
    return lambda: tf.distribute.get_replica_context().all_gather(_rc_matrix(), axis=axis)


def _rc_replica_id():
    return tf.identity(tf.distribute.get_replica_context().replica_id_in_sync_group)


_RC_FNS = {
    "replica_id_in_sync_group": _rc_replica_id,
    "all_reduce_sum_replica_id": _rc_sum_id,
    "all_reduce_mean_float_replica_id": _rc_mean_float_id,
    "all_gather_const_123_axis0": _rc_gather_const,
    "all_gather_matrix_axis1": _rc_gather_matrix(1),
    "all_gather_matrix_axis0": _rc_gather_matrix(0),
}


def _replica_context(n, mode):
    s = mirrored(n)
    out = {}
    for k, f in _RC_FNS.items():
        def one(f=f):
            fn = lambda: s.run(f)  # noqa: E731
            if mode == "tf_function":
                fn = tf.function(fn)
            res = fn()
            return {"per_replica": local(s, res),
                    "dtype": s.experimental_local_results(res)[0].dtype.name}
        out[k] = guarded(one)
    out["matrix_per_replica_input"] = [[[4.0 * r, 4.0 * r + 1], [4.0 * r + 2, 4.0 * r + 3]] for r in range(n)]
    return out


for _n in (2, 3):
    for _mode in ("eager", "tf_function"):
        add_task(("replica_context", f"n{_n}_{_mode}"), lambda n=_n, mode=_mode: _replica_context(n, mode))


# ------------------------------------------------------------- case 6, 7 ---

def keras_data():
    i = np.arange(64 * 4, dtype=np.float64)
    x = np.sin(i * 0.37).reshape(64, 4)
    y = np.cos(np.arange(64, dtype=np.float64) * 0.21) + 0.5 * x[:, 0]
    return x.astype(np.float32), y.reshape(64, 1).astype(np.float32)


def keras_init_weights():
    return [
        np.linspace(-0.5, 0.6, 12).reshape(4, 3).astype(np.float32),   # dense kernel
        np.linspace(0.05, 0.15, 3).astype(np.float32),                   # dense bias
        np.linspace(-0.4, 0.7, 3).reshape(3, 1).astype(np.float32),      # dense_1 kernel
        np.array([0.1], dtype=np.float32),                               # dense_1 bias
    ]


def build_model():
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(3, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.set_weights(keras_init_weights())
    return model


def make_strategy(kind):
    if kind == "no_strategy":
        return None
    if kind == "one_device":
        return tf.distribute.OneDeviceStrategy(CPU_NAMES[0])
    return mirrored(int(kind.split("_")[1]))


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _keras_fit(opt_name, kind):
    x, y = keras_data()
    s = make_strategy(kind)
    with (s.scope() if s is not None else _Null()):
        model = build_model()
        opt = keras.optimizers.SGD(0.1) if opt_name == "sgd_0.1" else keras.optimizers.Adam(0.01)
        model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    hist = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    ev = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    pred = model.predict(x[:5], verbose=0)
    return {
        "history": {k: [float(v) for v in vs] for k, vs in hist.history.items()},
        "final_weights": py(model.get_weights()),
        "evaluate": {k: float(v) for k, v in ev.items()},
        "predict_first5": py(pred),
        "num_replicas_in_sync": s.num_replicas_in_sync if s is not None else 1,
    }


def _keras_inputs():
    x, y = keras_data()
    return {"x": py(x), "y": py(y), "initial_weights": py(keras_init_weights()),
            "weight_order": ["dense.kernel (4,3)", "dense.bias (3,)", "dense_1.kernel (3,1)", "dense_1.bias (1,)"],
            "x_formula": "np.sin(np.arange(256, float64) * 0.37).reshape(64, 4) -> float32",
            "y_formula": "(np.cos(np.arange(64, float64) * 0.21) + 0.5 * x64[:, 0]).reshape(64, 1) -> float32",
            "model": "Sequential([Input((4,)), Dense(3, relu), Dense(1)]); compile(loss='mse', metrics=['mae'])",
            "fit": "fit(x, y, batch_size=16, epochs=1, shuffle=False); evaluate(x, y, batch_size=16); predict(x[:5])"}


add_task(("keras_fit", "inputs"), _keras_inputs)
for _opt in ("sgd_0.1", "adam_0.01"):
    for _kind in ("mirrored_2", "mirrored_1", "one_device", "no_strategy"):
        add_task(("keras_fit", f"{_opt}_{_kind}"), lambda opt=_opt, kind=_kind: _keras_fit(opt, kind))


def _custom_loop(kind):
    x, y = keras_data()
    s = make_strategy(kind)
    with s.scope():
        model = build_model()
        opt = keras.optimizers.SGD(0.1)
        loss_obj = keras.losses.MeanSquaredError(reduction="none")
    dist = s.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_obj(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=16)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(xb, yb):
        per_replica = s.run(step_fn, args=(xb, yb))
        return s.reduce("SUM", per_replica, axis=None), per_replica

    losses, per_replica_losses = [], []
    for xb, yb in dist:
        total, pr = train_step(xb, yb)
        losses.append(float(total.numpy()))
        per_replica_losses.append(local(s, pr))
    return {"step_losses": losses, "per_replica_step_losses": per_replica_losses,
            "final_weights": py(model.get_weights())}


add_value(("custom_loop", "inputs"),
          "x, y, initial_weights as keras_fit.inputs; SGD(0.1); MeanSquaredError(reduction='none') + "
          "tf.nn.compute_average_loss(per_example, global_batch_size=16); tf.function train step; "
          "experimental_distribute_dataset(from_tensor_slices((x, y)).batch(16)); "
          "step loss = strategy.reduce(SUM, per_replica_loss, axis=None)")
for _kind in ("mirrored_2", "mirrored_1"):
    add_task(("custom_loop", f"sgd_0.1_{_kind}"), lambda kind=_kind: _custom_loop(kind))


# ----------------------------------------------------------------- case 8 ---
# Each returns {"no_error": ...} when TF does not raise; errors are recorded by
# the task runner as {"error", "error_module", "message", ...}.

def _distribute_unbatched(n):
    s = mirrored(n)
    dist = s.experimental_distribute_dataset(tf.data.Dataset.range(5))
    return {"no_error_steps": [local(s, el) for el in dist]}


add_task(("errors", "distribute_unbatched_dataset_n2"), lambda: _distribute_unbatched(2))
add_task(("errors", "distribute_unbatched_dataset_n1"), lambda: _distribute_unbatched(1))


def _reduce_op(op):
    s = mirrored(2)
    x = _from_fn(s, [[1.0, 2.0], [3.0, 4.0]])
    return {"no_error_result": py(s.reduce(op, x, axis=None))}


for _op in ("PROD", "MAX", "sum", "Mean"):
    add_task(("errors", f"reduce_op_{_op}"), lambda op=_op: _reduce_op(op))

add_task(("errors", "duplicate_devices_cpu0_cpu0"), lambda: {
    "no_error_devices": list(tf.distribute.MirroredStrategy(devices=["/cpu:0", "/cpu:0"]).extended.worker_devices)})
for _g, _r in ((64, 3), (64, 4), (0, 3)):
    add_task(("errors", f"input_context_get_per_replica_batch_size_{_g}_over_{_r}"),
             lambda g=_g, r=_r: {"no_error_result": tf.distribute.InputContext(
                 num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=r).get_per_replica_batch_size(g)})

_IN_RUN = {
    "reduce_inside_run": lambda s: s.reduce("SUM", tf.constant([1.0, 2.0]), axis=None),
    "gather_inside_run": lambda s: s.gather(tf.constant([1.0, 2.0]), axis=0),
    "run_inside_run": lambda s: s.run(lambda: tf.constant(1.0)),
    "experimental_distribute_dataset_inside_run":
        lambda s: (s.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2)), tf.constant(1.0))[1],
}
for _name, _f in _IN_RUN.items():
    for _mode in ("eager", "tf_function"):
        add_task(("errors", f"{_name}_{_mode}"), lambda f=_f, mode=_mode: (
            lambda s: {"no_error_result": run_in(s, lambda: f(s), mode)})(mirrored(2)))


def _nested_scopes(same):
    s1 = mirrored(2)
    s2 = s1 if same else mirrored(2)
    with s1.scope():
        with s2.scope():
            return {"no_error": True}


add_task(("errors", "second_strategy_scope_inside_first"), lambda: _nested_scopes(False))
add_task(("errors", "same_strategy_scope_nested"), lambda: _nested_scopes(True))


def _default_then_mirrored_scope():
    s = mirrored(2)
    with tf.distribute.get_strategy().scope():
        with s.scope():
            return {"no_error": True}


add_task(("errors", "mirrored_scope_inside_default_strategy_scope"), _default_then_mirrored_scope)

_RUN_ARGS = {
    "run_args_scalar_tensor": (lambda v: v * 2.0, lambda: tf.constant(1.0)),
    "run_args_1d_tensor_len2_fn_one_param": (lambda v: v * 2.0, lambda: tf.constant([1.0, 2.0])),
    "run_args_1d_tensor_len2_fn_two_params": (lambda a, b: a + 10.0 * b, lambda: tf.constant([1.0, 2.0])),
    "run_args_python_float": (lambda v: v * 2.0, lambda: 3.0),
    "run_args_dict": (lambda v: v * 2.0, lambda: {"v": tf.constant(1.0)}),
    "run_args_list_ok": (lambda v: v * 2.0, lambda: [tf.constant(1.0)]),
}
for _name, (_fn, _args) in _RUN_ARGS.items():
    add_task(("errors", _name), lambda fn=_fn, args=_args: (
        lambda s: {"no_error_result": local(s, s.run(fn, args=args()))})(mirrored(2)))


def _two_strategies_collective_reuse():
    # Documented TF quirk, not behaviour to copy: a second MirroredStrategy in the
    # same process reuses collective instance keys of the first.
    s1 = mirrored(2)
    a = py(s1.gather(_from_fn(s1, [[[1.0]], [[2.0]]]), axis=0))
    s2 = mirrored(2)
    b = guarded(lambda: py(s2.gather(_from_fn(s2, [[1.0, 2.0], [3.0, 4.0]]), axis=0)))
    return {"first_strategy_gather_2x1": a, "second_strategy_gather_1d": b}


add_task(("tf_quirks", "two_mirrored_strategies_one_process_gather"), _two_strategies_collective_reuse)

# ------------------------------------------------------------------- data ---
# tf.data names, element_spec, from_generator, distributed input (record_tf_data.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record_tf_data  # noqa: E402

record_tf_data.register(add_task, py, local, mirrored, guarded)

# What replica code sees on uneven batches (record_tf_uneven.py).
import record_tf_uneven  # noqa: E402

record_tf_uneven.register(add_task, py, local, mirrored, guarded)

# ----------------------------------------------------------------- values ---
# SyncOnRead variables, regrouping, reduce_to, cross_device_ops (record_tf_values.py).
import record_tf_values  # noqa: E402

record_tf_values.register(add_task, py, local, mirrored, guarded)


# ------------------------------------------------------------------- main ---

def _record_error(e):
    msg = str(e)
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    return {
        "error": type(e).__name__,
        "error_module": type(e).__module__,
        "message": msg,
        # tf.function wraps messages in "in user code: ..." with file/line noise;
        # the last line is the original message.
        "message_last_line": lines[-1].strip() if lines else "",
    }


def _child(index, out_path):
    path, fn = TASKS[index]
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - recording, not handling
        res = _record_error(e)
    with open(out_path, "w") as f:
        json.dump(res, f, allow_nan=True)


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def main(only=None):
    """Records every task; with ``only`` (a section name, e.g. "data") re-records that section into the existing file."""
    import concurrent.futures
    import subprocess
    import tempfile

    started = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "meta": {
            "tensorflow_version": tf.__version__,
            "keras_version": keras.__version__,
            "numpy_version": np.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "date_utc": started.isoformat(timespec="seconds"),
            "command": "/work/tfvenv/bin/python tests/parity/record_tf.py",
            "logical_cpu_devices": CPU_NAMES,
            "strategy": "tf.distribute.MirroredStrategy(devices=logical_cpu_devices[:N]) unless stated; "
                        "each case runs in a fresh process",
            "error_format": "{error: class name, error_module, message, message_last_line}",
            "no_error_format": "cases expected to fail but that did not return {no_error...: result}",
        },
    }
    order = ["batch_split", "gather_reduce_partial_batches", "reduce", "losses", "replica_context",
             "keras_fit", "custom_loop", "errors", "tf_quirks", "data", "uneven", "values"]
    if only is not None:
        with open(OUT) as f:
            previous = json.load(f)
        previous["meta"] = result["meta"]
        previous[only] = {}
        result = previous
    else:
        for k in order:
            result[k] = {}
    for path, value in VALUES:
        if only is None or path[0] == only:
            _set(result, path, value)

    tmp = tempfile.mkdtemp(prefix="record_tf_")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")

    def run_child(i):
        out = os.path.join(tmp, f"{i}.json")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--task", str(i), out],
                           env=env, capture_output=True, text=True, timeout=600)
        if p.returncode != 0 or not os.path.exists(out):
            return {"error": "ChildProcessFailed", "returncode": p.returncode,
                    "stderr_tail": p.stderr[-2000:]}
        with open(out) as f:
            return json.load(f)

    workers = max(1, min(8, (os.cpu_count() or 2)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        chosen = [i for i, (path, _) in enumerate(TASKS) if only is None or path[0] == only]
        futures = [pool.submit(run_child, i) for i in chosen]
        results = []
        for (path, _), fut in zip([TASKS[i] for i in chosen], futures):
            results.append((path, fut.result()))
            print("done", "/".join(path), flush=True)
    # Insert in registration order so the JSON layout is stable.
    for path, res in results:
        _set(result, path, res)

    text = json.dumps(result, indent=1, allow_nan=True)
    with open(OUT, "w") as f:
        f.write(text + "\n")
    print(f"wrote {OUT} ({len(TASKS)} tasks)")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--task":
        _child(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) >= 3 and sys.argv[1] == "--only":
        main(sys.argv[2])
    else:
        main()
