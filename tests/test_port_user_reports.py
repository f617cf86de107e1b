"""Public tf.distribute bug reports, turned into user programs with the expected behaviour.

Each program is the report's code by substitution (tf.distribute -> distribute, tf.data ->
distribute.data, tf.keras -> keras, tf.Variable -> keras.Variable, tf ops -> jnp / keras.ops,
tf.nn.compute_average_loss -> distribute.compute_average_loss). The expected values are TF 2.21's,
recorded by tests/parity/record_tf_reports.py into tests/parity/tf_2_21_reports.json on 2 logical CPU
devices (MirroredStrategy(["/cpu:0", "/cpu:1"])), unless the README documents a deliberate difference
or the case says why it differs. Reports:

- tensorflow/tensorflow#45026 "Reduce on MirroredVariable": all_reduce(SUM) of a MirroredVariable
  in ``run`` (TF 2.4 gave 1s; TF 2.21 gives 2s on 2 replicas).
- tensorflow/tensorflow#33388: ``strategy.reduce`` called without ``axis``.
- tensorflow/tensorflow#31852 "A non-DistributedValues value 8 cannot be reduced".
- tensorflow/tensorflow#61231 "Support for empty GPU batches" (and #44348): a replica with an empty
  batch in the last step.
- tensorflow/tensorflow#30847 "DistributedDataset iteration fails with data of type string" (partial
  last batch).
- tensorflow/tensorflow#32076 "distribute_datasets_from_function() does not respect end of iteration"
  (a ``from_generator`` pipeline that ends).
- tensorflow/tensorflow#33651 (the custom-training tutorial with a per-pixel loss): a per-example
  loss of rank 2 in ``compute_average_loss``.
- tensorflow/tensorflow#58434 "Worker nodes exit early in MultiWorkerMirroredStrategy, causing error
  task reported on chief node" and #35878 (hangs): 2 workers through the launcher, a last batch
  that leaves worker 1 empty, and a chief that works on after worker 1 has finished.
- found by the multi_worker_with_ctl port: a program whose last line is ``manager.save()``.
- tensorflow/tensorflow#30513 and #33884: LSTM / GRU models under MirroredStrategy.
- keras-team/tf-keras collective_all_reduce_strategy_test.py (testFitWithoutStepsPerEpochPartialBatch),
  run in the 2-worker program above.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute

SRC = str(Path(__file__).resolve().parents[1] / "src")
# TF 2.21's answers, recorded by tests/parity/record_tf_reports.py (2 logical CPU devices)
TF = json.loads((Path(__file__).parent / "parity" / "tf_2_21_reports.json").read_text())


def lr(s, x):
    return [np.asarray(t).tolist() for t in s.experimental_local_results(x)]


def test_45026_all_reduce_of_a_mirrored_variable_sums_the_replicas():
    s = mirrored(2)
    with s.scope():
        v = keras.Variable(jnp.ones((5,)))

    def fn(value):
        ctx = distribute.get_replica_context()
        return ctx.all_reduce(distribute.ReduceOp.SUM, value)

    tf = TF["all_reduce_mirrored_variable"]
    assert lr(s, s.run(fn, args=(v,))) == tf["sum"] == tf["sum_tf_function"] == [[2.0] * 5, [2.0] * 5]
    mean = s.run(lambda value: distribute.get_replica_context().all_reduce("MEAN", value), args=(v,))
    assert lr(s, mean) == tf["mean"] == [[1.0] * 5, [1.0] * 5]
    np.testing.assert_array_equal(np.asarray(v.value), np.ones(5))  # the variable is untouched


def test_33388_reduce_without_axis():
    """TF 2.21: TypeError "reduce() missing 1 required positional argument: 'axis'". Here axis
    defaults to None (TF 1.x's signature), so a TF program never reaches this; the value is the
    axis=None one."""
    assert TF["reduce_without_axis"]["error"] == "TypeError"
    s = mirrored(2)
    pr = s.run(lambda: jnp.asarray([1., 2.]))
    np.testing.assert_array_equal(np.asarray(s.reduce(distribute.ReduceOp.SUM, pr)), [2., 4.])
    np.testing.assert_array_equal(np.asarray(s.reduce(distribute.ReduceOp.SUM, pr, axis=None)), [2., 4.])


def test_31852_sum_of_a_non_distributed_value_raises_as_tf():
    assert TF["reduce_python_int"]["error"] == "ValueError"
    s = mirrored(2)
    with pytest.raises(ValueError, match="non-DistributedValues value 8 cannot be reduced"):
        s.reduce(distribute.ReduceOp.SUM, 8, axis=None)


def test_61231_a_replica_with_an_empty_last_batch():
    s = mirrored(2)
    ds = s.experimental_distribute_dataset(distribute.data.Dataset.range(5).batch(4))

    def total(t):
        return jnp.sum(t)

    def mean(t):
        return keras.ops.mean(keras.ops.cast(t, "float32"))

    def average_loss(t):
        return distribute.compute_average_loss(keras.ops.cast(t, "float32"))

    steps = []
    for x in ds:
        steps.append({"rows": lr(s, x), "sum": lr(s, s.run(total, args=(x,))), "mean": lr(s, s.run(mean, args=(x,))),
                      "cal": lr(s, s.run(average_loss, args=(x,))),
                      "reduce_sum": float(s.reduce("SUM", x, axis=0)), "reduce_mean": float(s.reduce("MEAN", x, axis=0))})
    assert len(steps) == 2
    first, last = steps
    tf_first, tf_last = TF["empty_replica"]
    for key in ("rows", "sum", "reduce_sum", "reduce_mean"):
        assert first[key] == tf_first[key] and last[key] == tf_last[key], key
    assert first["mean"] == tf_first["mean"] and first["cal"] == tf_first["average_loss"]
    assert tf_last["mean"] == [4.0, None]  # NaN, recorded as null
    assert tf_last["average_loss"] == [2.0, 0.0]
    # TF 2.21's values
    assert first["rows"] == [[0, 1], [2, 3]] and last["rows"] == [[4], []]
    assert first["sum"] == [1, 5] and last["sum"] == [4, 0]
    assert first["mean"] == [0.5, 2.5]
    assert last["mean"][0] == 4.0 and np.isnan(last["mean"][1])  # the mean of no rows is NaN, as TF
    assert (first["reduce_sum"], first["reduce_mean"]) == (6.0, 1.5)
    assert (last["reduce_sum"], last["reduce_mean"]) == (4.0, 4.0)
    assert first["cal"] == [0.25, 1.25]
    # README "Deliberate differences": TF divides by local_batch * replicas (2.0, 0.0); here by the
    # real global batch size, so the replicas' sum is the true mean of [4]
    assert last["cal"] == [4.0, 0.0]


def test_30847_string_features_with_a_partial_last_batch():
    s = mirrored(2)
    ds = distribute.data.Dataset.from_tensor_slices((["a", "b", "c", "d", "e"], [0, 1, 2, 3, 4])).batch(4)
    steps = []
    for text, num in s.experimental_distribute_dataset(ds):
        steps.append(([[t if isinstance(t, str) else t.decode() for t in r] for r in lr(s, text)], lr(s, num)))
    assert steps == [(step["text"], step["num"]) for step in TF["strings_partial_batch"]]
    assert steps == [([["a", "b"], ["c", "d"]], [[0, 1], [2, 3]]), ([["e"], []], [[4], []])]


def test_32076_distribute_datasets_from_function_ends_with_its_generator():
    s = mirrored(2)

    def gen():
        for i in range(5):
            yield np.full((2,), i, np.int64)

    def dataset_fn(input_context):
        ds = distribute.data.Dataset.from_generator(gen, output_signature=distribute.data.TensorSpec((2,), "int64"))
        return ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    steps = [lr(s, x) for x in s.distribute_datasets_from_function(dataset_fn)]
    # TF 2.21: each replica takes the pipeline's next element; the 5th has no partner and is dropped
    assert steps == TF["from_generator_end"] == [[[0, 0], [1, 1]], [[2, 2], [3, 3]]]


def test_33651_rank_2_per_example_loss_in_compute_average_loss():
    s = mirrored(2)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    batch = next(iter(s.experimental_distribute_dataset(distribute.data.Dataset.from_tensor_slices(x).batch(4))))

    def step(t):
        return distribute.compute_average_loss(t)

    per_replica = s.run(step, args=(batch,))
    # TF 2.21: the sum of all elements / global batch 4
    assert lr(s, per_replica) == TF["rank2_average_loss"]["per_replica"] == [3.75, 12.75]
    assert float(s.reduce("SUM", per_replica, axis=None)) == TF["rank2_average_loss"]["sum"] == 16.5


EXIT_AFTER_SAVE = textwrap.dedent('''
    import sys
    import distribute
    import keras
    v = keras.Variable(3.0)
    manager = distribute.CheckpointManager(distribute.Checkpoint(v=v), sys.argv[1], max_to_keep=1)
    manager.save()
''')


def test_a_save_on_the_last_line_is_committed(tmp_path):
    """The asynchronous save used to run after Python shut its thread pools: the checkpoint stayed an
    ``ckpt-1.orbax-checkpoint-tmp`` directory and was lost (TF's save is synchronous)."""
    (tmp_path / "prog.py").write_text(EXIT_AFTER_SAVE)
    env = {**os.environ, "PYTHONPATH": SRC, "KERAS_BACKEND": "jax"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(tmp_path / "prog.py"), str(tmp_path / "ckpt")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "did not finish" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-1"]
    v = keras.Variable(0.0)
    distribute.Checkpoint(v=v).restore(distribute.latest_checkpoint(tmp_path / "ckpt"))
    assert float(np.asarray(v.value)) == 3.0


MULTI_WORKER = textwrap.dedent('''
    import json, os, sys, time
    import distribute, keras
    import jax.numpy as jnp
    import numpy as np

    out = sys.argv[1]
    strategy = distribute.MultiWorkerMirroredStrategy()
    ds = strategy.experimental_distribute_dataset(distribute.data.Dataset.range(5).batch(2))

    def step(x):
        return jnp.sum(x)

    sums = [float(strategy.reduce("SUM", strategy.run(step, args=(x,)), axis=None)) for x in ds]
    gathered = [np.asarray(strategy.gather(x, axis=0)).tolist() for x in ds]
    local = [[np.asarray(t).tolist() for t in strategy.experimental_local_results(x)] for x in ds]
    with strategy.scope():
        v = keras.Variable(jnp.ones((3,)))

    def fn(value):
        return distribute.get_replica_context().all_reduce(distribute.ReduceOp.SUM, value)

    all_reduce = [np.asarray(t).tolist() for t in strategy.experimental_local_results(strategy.run(fn, args=(v,)))]

    # tf-keras collective_all_reduce_strategy_test.testFitWithoutStepsPerEpochPartialBatch
    def _model_fn():
        keras.utils.set_random_seed(2)                   # added: compares with one device
        x = keras.layers.Input(shape=(1,), name="input")
        y = keras.layers.Dense(1, name="dense")(x)
        model = keras.Model(x, y)
        return model

    def _get_dataset():
        inputs = jnp.expand_dims(jnp.asarray(range(10)), axis=1)
        targets = jnp.expand_dims(jnp.asarray(range(10)), axis=1)
        # Make global batch size 12 for 2 replicas and a non-repeated
        # dataset with 10 elements so that we have partial batch
        dataset = distribute.data.Dataset.from_tensor_slices(
            (np.asarray(inputs), np.asarray(targets))).batch(12, drop_remainder=False)
        return dataset

    with strategy.scope():
        optimizer_fn = keras.optimizers.SGD
        optimizer = optimizer_fn(0.001)
        model = _model_fn()
        loss = "mse"
        metrics = ["mae"]
        model.compile(optimizer, loss, metrics=metrics)
    dataset = _get_dataset()
    kernel_before = float(model.get_weights()[0][0][0])
    history = model.fit(dataset, epochs=10, verbose=0).history
    kernel_after = float(model.get_weights()[0][0][0])

    task_id = strategy.cluster_resolver.task_id
    if task_id == 0:
        time.sleep(3)  # the chief works on (writes a summary) after worker 1 has finished
    with open(os.path.join(out, "r%d.json" % task_id), "w") as f:
        json.dump({"sums": sums, "gathered": gathered, "local": local, "all_reduce": all_reduce,
                   "kernel": [kernel_before, kernel_after], "history": history}, f)
''')


@pytest.mark.multiprocess
def test_58434_workers_finishing_apart_exit_cleanly_with_uneven_data(tmp_path):
    (tmp_path / "prog.py").write_text(MULTI_WORKER)
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("XLA_FLAGS", None)
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "distribute.launch", "--num-workers", "2", "--timeout-seconds", "90",
                           str(tmp_path / "prog.py"), str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lost worker" not in proc.stdout + proc.stderr
    w0, w1 = (json.loads((tmp_path / f"r{i}.json").read_text()) for i in (0, 1))
    # TF's split of the global batches [0, 1], [2, 3], [4] over 2 workers x 1 replica
    assert w0["sums"] == w1["sums"] == [1.0, 5.0, 4.0]
    assert w0["gathered"] == w1["gathered"] == [[0, 1], [2, 3], [4]]
    assert w0["local"] == [[[0]], [[2]], [[4]]] and w1["local"] == [[[1]], [[3]], [[]]]
    assert w0["all_reduce"] == w1["all_reduce"] == [[2.0, 2.0, 2.0]]  # #45026 across workers
    # testFitWithoutStepsPerEpochPartialBatch: the kernel moves towards 1 (tf-keras' assertions) and the
    # 2 workers' fit on the partial batch (6 | 4 rows) equals one device's
    kernel_before, kernel_after = w0["kernel"]
    assert kernel_before != kernel_after
    assert abs(kernel_before - 1) > abs(kernel_after - 1)
    assert w0["history"] == w1["history"] and w0["kernel"] == w1["kernel"]
    keras.utils.set_random_seed(2)
    x = keras.layers.Input(shape=(1,), name="input")
    model = keras.Model(x, keras.layers.Dense(1, name="dense")(x))
    model.compile(keras.optimizers.SGD(0.001), "mse", metrics=["mae"])
    data = np.arange(10)[:, None]
    ref = model.fit(data, data, batch_size=12, epochs=10, shuffle=False, verbose=0).history
    np.testing.assert_allclose(w0["history"]["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(w0["history"]["mae"], ref["mae"], rtol=1e-5)
    np.testing.assert_allclose(kernel_after, float(model.get_weights()[0][0][0]), rtol=1e-5)


def _rnn_fit(strategy, make_layer, x, y, loss, batch_size, epochs=2):
    def build():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input(x.shape[1:]), make_layer(), keras.layers.Dense(3, activation="sigmoid")])
        model.compile(loss=loss, optimizer=keras.optimizers.Adam(0.01))
        return model

    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history["loss"]
    return history, _weights_of(model)


def _weights_of(model):
    return [np.asarray(w) for w in model.get_weights()]


RNN_LAYERS = {"LSTM": lambda: keras.layers.LSTM(6), "GRU": lambda: keras.layers.GRU(6)}  # SimpleRNN: as LSTM


@pytest.mark.parametrize("layer", sorted(RNN_LAYERS))
def test_30513_recurrent_model_fit_under_mirrored_strategy_equals_one_device(layer):
    """#30513 "tf.distribute cause crash when using RNN model" (LSTM(64) + Dense, fit on batches of 12;
    here 62 rows of (10, 4) and LSTM/GRU/SimpleRNN(6), so the last batch, 2 rows, splits 1 | 1).

    Every recurrent layer failed here in fit and run under any strategy ("scan body function carry
    input and carry output must have equal types"; GRU: "Context mesh ... should match the mesh of
    sharding"), fixed in keras_support/layers.py and lifting.py."""
    rng = np.random.default_rng(0)
    x = (rng.integers(100, size=(62, 10, 4)) / 100).astype(np.float32)
    y = rng.integers(2, size=(62,)).astype(np.int32)
    got = _rnn_fit(mirrored(2), RNN_LAYERS[layer], x, y, "sparse_categorical_crossentropy", 12)
    ref = _rnn_fit(None, RNN_LAYERS[layer], x, y, "sparse_categorical_crossentropy", 12)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_33884_gru_with_uneven_batches_equals_one_device():
    """#33884 "GRU layer fails on single GPU when using MirroredStrategy" (batches of 3): on 2 replicas every
    batch of 3 splits 2 | 1 (the exact uneven step; the report's one-replica case is the SPMD program,
    covered by test_30513 above)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 4, 1)).astype(np.float32)
    y = rng.random((6, 3)).astype(np.float32)
    ref = _rnn_fit(None, lambda: keras.layers.GRU(5), x, y, "mse", 3, epochs=1)
    got = _rnn_fit(mirrored(2), lambda: keras.layers.GRU(5), x, y, "mse", 3, epochs=1)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("synchronized", [False, True])
def test_batch_normalization_in_run_normalizes_per_replica_unless_synchronized(synchronized):
    """A user's BatchNormalization(training=True) step on 2 replicas whose rows differ: [0, 0] | [2, 2].

    TF 2.21 (recorded, Keras 3 as tf.keras): unsynchronized, each replica normalizes by its own
    moments (outputs 0); synchronized, by the global ones (-0.9995 / 0.9995); moving variance 0.5
    and 1.0. The moving mean differs from TF 2.21 + Keras 3 when unsynchronized: TF keeps replica 0's
    update (0.0), here the replicas' updates are averaged (0.5, tf-keras' MEAN aggregation and the
    README's "BatchNorm statistics averaged"); synchronized both give 0.5."""
    s = mirrored(2)
    x = np.array([[0.], [0.], [2.], [2.]], np.float32)
    with s.scope():
        bn = keras.layers.BatchNormalization(momentum=0.5, epsilon=0.001, synchronized=synchronized)
        bn.build((None, 1))
    batch = next(iter(s.experimental_distribute_dataset(distribute.data.Dataset.from_tensor_slices(x).batch(4))))

    def step(t):
        return bn(t, training=True)

    out = lr(s, s.run(step, args=(batch,)))
    tf = TF["batch_normalization"]["synchronized" if synchronized else "unsynchronized"]
    np.testing.assert_allclose(out, tf["out"], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(bn.moving_variance.value), tf["moving_variance"], rtol=1e-6)
    assert tf["moving_mean"] == ([0.5] if synchronized else [0.0])
    if synchronized:
        np.testing.assert_allclose(out, [[[-0.9995004], [-0.9995004]], [[0.9995004], [0.9995004]]], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(bn.moving_variance.value), [1.0], rtol=1e-6)
    else:
        assert out == [[[0.0], [0.0]], [[0.0], [0.0]]]
        np.testing.assert_allclose(np.asarray(bn.moving_variance.value), [0.5], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(bn.moving_mean.value), [0.5], rtol=1e-6)


def test_dropout_masks_differ_between_replicas():
    """Dropout(0.5) on the same rows on 2 replicas: the masks differ here (tf-keras' behaviour: each
    replica draws its own numbers). TF 2.21 with Keras 3 as tf.keras gives both replicas one mask
    (recorded), since Keras 3's seed state is one mirrored variable there."""
    s = mirrored(2)
    with s.scope():
        drop = keras.layers.Dropout(0.5)
    ones = s.experimental_distribute_dataset(distribute.data.Dataset.from_tensor_slices(np.ones((2, 64), np.float32)).batch(2))

    def step(t):
        return drop(t, training=True)

    first, second = lr(s, s.run(step, args=(next(iter(ones)),)))
    assert TF["dropout_masks_differ"] is False  # TF 2.21 + Keras 3: one mask
    assert first != second
    for out in (np.asarray(first), np.asarray(second)):
        assert set(np.unique(out).tolist()) <= {0.0, 2.0} and 0 < (out == 0).sum() < out.size


def test_learning_rate_callbacks_under_mirrored_strategy_equal_one_device():
    """A user's fit with LearningRateScheduler, ReduceLROnPlateau and EarlyStopping (each assigns the
    optimizer's learning rate between epochs, in cross-replica context): the compiled steps see every
    change, so 2 replicas give one device's history, learning rates and weights (40 rows, batches of 16:
    the last one uneven, 4 | 4)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = (x @ np.array([[1.], [-2.], [0.5]], np.float32)).astype(np.float32)

    def program(strategy):
        def build():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), metrics=["mae"])
            return model

        if strategy is None:
            model = build()
        else:
            with strategy.scope():
                model = build()
        callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5 if epoch >= 1 else lr),
                     keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.1, patience=0, min_delta=10.0),
                     keras.callbacks.EarlyStopping(monitor="loss", patience=10)]
        history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=callbacks).history
        return history, _weights_of(model), float(np.asarray(model.optimizer.learning_rate))

    got, ref = program(mirrored(2)), program(None)
    np.testing.assert_allclose(got[0]["learning_rate"], [0.1, 0.05, 0.0025, 0.000125], rtol=1e-5)
    for key in ("loss", "mae", "learning_rate"):
        np.testing.assert_allclose(got[0][key], ref[0][key], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert got[2] == pytest.approx(ref[2]) == pytest.approx(1.25e-5)
