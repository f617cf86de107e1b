"""Sharded state (``sharding=``: ZeRO stages 1-3 behind MirroredStrategy, MultiWorkerMirroredStrategy, TPUStrategy).

Every level gives ``NONE``'s results (rtol 1e-5) in fit and custom loops, with
the state split over the replicas as asserted from the arrays' shards; reads in
cross-replica context give whole values; checkpoints restore across levels and
replica counts. The model has two kernels that are split (2048 elements, along
different dims) and small variables that stay replicated. The file is also the
worker program of the multi-worker test (``python tests/test_sharding.py OUT_DIR``).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import warnings

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
LEVELS = ("optimizer_state", "gradients", "full")
N, BATCH, RTOL, ATOL = 37, 8, 1e-5, 1e-6  # 37 rows, batch 8: the last step has 5 rows (uneven on 2 and 4 replicas)


# -- shared by the tests and the worker program -----------------------------------------------------
def data(n=N):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 32)).astype(np.float32)
    return x, (x[:, :4] * 0.5 + rng.normal(size=(n, 4)) * 0.1).astype(np.float32)


def build_model(bn=True, dropout=True, constraint=None):
    import keras

    keras.utils.set_random_seed(3)
    layers = [keras.Input((32,)), keras.layers.Dense(64, activation="relu", kernel_constraint=constraint)]
    layers += [keras.layers.BatchNormalization()] if bn else []
    layers += [keras.layers.Dropout(0.25, seed=1)] if dropout else []
    layers += [keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    return keras.Sequential(layers)


def fit_results(strategy, make_optimizer, n=32, epochs=1, steps_per_execution=1, wrap=None, evaluate=False, **model_kwargs):
    """Weights, optimizer variables and history of a short fit (and evaluate and predict)."""
    x, y = data(n)
    model_kwargs = {"bn": False, "dropout": False, **model_kwargs}
    with strategy.scope():
        model = build_model(**model_kwargs)
        optimizer = make_optimizer()
        model.compile(optimizer=wrap(optimizer) if wrap else optimizer, loss="mse", metrics=["mae"], steps_per_execution=steps_per_execution)
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    out = {
        "weights": model.get_weights(),
        "optimizer": [np.asarray(v) for v in model.optimizer.variables],
        "history": [history.history["loss"], history.history["mae"]],
    }
    if evaluate:
        out["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0)
        out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    return model, out


def custom_loop(strategy, make_optimizer, epochs=1, n=N):
    """A TF-style custom loop (compute_gradients, apply_gradients, compute_average_loss) with an uneven last batch."""
    import keras

    import distribute
    from distribute.data import Dataset

    x, y = data(n)
    with strategy.scope():
        model = build_model(dropout=False)
        optimizer = make_optimizer()
    dataset = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(BATCH))

    def step(features, labels):
        kernel = model.layers[0].kernel
        assert tuple(kernel.shape) == (32, 64)  # whole-shaped inside the step, at every level

        def loss_fn():
            per_row = keras.ops.mean((model(features, training=True) - labels) ** 2, axis=-1)
            return distribute.compute_average_loss(per_row)

        loss, grads = distribute.compute_gradients(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, keras.ops.sum(kernel.value)  # the value read is the whole kernel

    losses, sums = [], []
    for _ in range(epochs):
        for features, labels in dataset:
            loss, total = strategy.run(step, args=(features, labels))
            losses.append(float(strategy.reduce("SUM", loss, axis=None)))
            sums.append(float(strategy.experimental_local_results(total)[0]))
    return model, optimizer, {"weights": model.get_weights(), "optimizer": [np.asarray(v) for v in optimizer.variables],
                              "losses": losses, "sums": sums}


def assert_same(got, want, rtol=RTOL, atol=ATOL):
    import jax

    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol)


def mirrored(num_replicas, sharding=None):
    import jax

    import distribute

    return distribute.MirroredStrategy(jax.devices()[:num_replicas], sharding=sharding)


# -- API ----------------------------------------------------------------------------------------------
def test_sharding_keyword_levels_and_bad_values():
    import jax

    import distribute
    from distribute.experimental import Sharding
    from distribute.tpu import TPUStrategy

    assert [m.value for m in Sharding] == ["none", "optimizer_state", "gradients", "full"]
    assert distribute.MirroredStrategy(jax.devices()[:2]).extended.sharding is Sharding.NONE  # TF's behaviour by default
    for value, level in [(Sharding.FULL, Sharding.FULL), ("optimizer_state", Sharding.OPTIMIZER_STATE), ("gradients", Sharding.GRADIENTS),
                         ("none", Sharding.NONE), (None, Sharding.NONE)]:
        assert distribute.MirroredStrategy(jax.devices()[:2], sharding=value).extended.sharding is level
    assert TPUStrategy._for_testing(jax.devices()[:2], sharding="full").extended.sharding is Sharding.FULL
    assert distribute.MultiWorkerMirroredStrategy(sharding="gradients").extended.sharding is Sharding.GRADIENTS
    for bad in ("FULL", "zero3", 3, True):
        with pytest.raises(ValueError, match=r"sharding=.* is not a sharding level; use one of distribute\.experimental\.Sharding\.NONE \('none'\), .*OPTIMIZER_STATE.*GRADIENTS.*FULL \('full'\)"):
            distribute.MirroredStrategy(jax.devices()[:2], sharding=bad)
    with pytest.raises(TypeError):
        distribute.MirroredStrategy(jax.devices()[:2], None, "full")  # keyword only


def test_state_is_split_over_replicas_bytes_per_device():
    """8 replicas, Adam: slots split (OPTIMIZER_STATE, GRADIENTS), variables too (FULL); small state stays replicated."""
    import jax
    import keras

    devices = jax.devices()[:8]
    x, y = data(16)
    shards = {}
    for level in ("none",) + LEVELS:
        strategy = mirrored(8, level)
        with strategy.scope():
            model = build_model()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
            model.optimizer.build(model.trainable_variables)
        if level == "full":
            model.train_on_batch(x, y)  # a step keeps the state split (no whole copies left behind)
        kernel1, kernel2 = model.layers[0].kernel, model.layers[-2].kernel
        adam = model.optimizer
        m1, v2 = adam._momentums[adam._get_variable_index(kernel1)], adam._velocities[adam._get_variable_index(kernel2)]
        shards[level] = {name: [s.data.shape for s in var._value.addressable_shards]
                         for name, var in [("k1", kernel1), ("k2", kernel2), ("m1", m1), ("v2", v2), ("bias", model.layers[0].bias),
                                           ("bn_mean", model.layers[1].moving_mean), ("k_out", model.layers[-1].kernel)]}
        state = model.trainable_variables + model.non_trainable_variables + model.optimizer.variables
        shards[level]["bytes"] = sum(s.data.nbytes for v in state for s in v._value.addressable_shards if s.device == devices[3])
    for level in ("none",) + LEVELS:
        got = shards[level]
        split_slots, split_vars = level != "none", level == "full"
        assert got["k1"] == [(32, 8)] * 8 if split_vars else [(32, 64)] * 8  # (32, 64): split along dim 1, the largest
        assert got["k2"] == [(8, 32)] * 8 if split_vars else [(64, 32)] * 8  # (64, 32): along dim 0
        assert got["m1"] == ([(32, 8)] if split_slots else [(32, 64)]) * 8
        assert got["v2"] == ([(8, 32)] if split_slots else [(64, 32)]) * 8
        assert got["bias"] == [(64,)] * 8 and got["bn_mean"] == [(64,)] * 8 and got["k_out"] == [(32, 4)] * 8  # small: replicated
    whole = shards["none"]["bytes"]
    split = (32 * 64 + 64 * 32) * 4  # bytes of one copy of the two split kernels
    assert shards["optimizer_state"]["bytes"] == whole - 2 * split * 7 // 8  # two Adam slots per kernel, 1/8 of each kept
    assert shards["gradients"]["bytes"] == shards["optimizer_state"]["bytes"]
    assert shards["full"]["bytes"] == whole - 3 * split * 7 // 8  # the kernels too


# -- exactness: fit ---------------------------------------------------------------------------------
def _optimizers():
    import keras

    return {
        "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        "adam": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),  # the norm over every replica's slice
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
        "adagrad": lambda: keras.optimizers.Adagrad(0.1, clipnorm=0.2),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    }


def test_optimizer_state_sends_what_gradients_sends(monkeypatch):
    """ZeRO-1 reduce-scatters the split gradients as ZeRO-2 does (DeepSpeed's stage 1 sends what stage 2 sends):
    the collectives traced into the fit step are the same at both levels, none a whole split gradient's psum.
    It all-reduced them and kept a slice: the most bytes of any level, 0.80x NONE's speed at 8 replicas."""
    import collections

    import jax
    import keras

    traced: list = []
    for name in ("psum", "psum_scatter", "all_gather"):
        def counting(x, *args, _name=name, _original=getattr(jax.lax, name), **kwargs):
            traced.extend((_name, tuple(leaf.shape)) for leaf in jax.tree_util.tree_leaves(x))
            return _original(x, *args, **kwargs)

        monkeypatch.setattr(jax.lax, name, counting)
    by_level = {}
    for level in ("optimizer_state", "gradients"):
        traced.clear()
        fit_results(mirrored(2, level), lambda: keras.optimizers.Adam(0.01))
        by_level[level] = collections.Counter(traced)
    kernels = [("psum_scatter", (32, 64)), ("psum_scatter", (64, 32))]  # the two split kernels' gradients
    assert all(by_level["optimizer_state"][k] for k in kernels)
    assert not [k for k in by_level["optimizer_state"] if k[0] == "psum" and k[1] in ((32, 64), (64, 32))]
    assert by_level["optimizer_state"] == by_level["gradients"]


@pytest.mark.parametrize("name,level", [("sgd", "optimizer_state"), ("adam", "gradients"), ("adamw", "full"), ("adagrad", "gradients"),
                                        ("rmsprop", "optimizer_state")])
def test_optimizers_equal_none(name, level):
    make = _optimizers()[name]
    _, want = fit_results(mirrored(2), make)
    model, got = fit_results(mirrored(2, level), make)
    assert_same(got, want)
    split = [v for v in model.optimizer.variables if not v._value.is_fully_replicated]
    assert len(split) == {"sgd": 2, "adam": 4, "adamw": 4, "adagrad": 2, "rmsprop": 6}[name]  # the two big kernels' slots


def test_fit_equals_none_with_batch_norm_dropout_uneven_batches_steps_per_execution():
    """BatchNorm, Dropout, an uneven last batch (5 rows: 3 | 2), steps_per_execution=2, evaluate, predict: NONE's numbers."""
    make = _optimizers()["adam"]
    kwargs = dict(n=N, epochs=2, steps_per_execution=2, evaluate=True, bn=True, dropout=True)
    _, want = fit_results(mirrored(2), make, **kwargs)
    model, got = fit_results(mirrored(2, "full"), make, **kwargs)
    assert_same(got, want)
    assert [s.data.shape for s in model.layers[0].kernel._value.addressable_shards] == [(32, 32)] * 2


def test_fit_full_equals_one_device():
    import distribute

    make = _optimizers()["adam"]
    _, one = fit_results(distribute.OneDeviceStrategy("/cpu:0"), make)
    _, got = fit_results(mirrored(2, "full"), make)
    assert_same(got, one, rtol=2e-5, atol=2e-6)


def test_fit_mixed_precision_loss_scale_and_gradient_accumulation():
    import keras

    from distribute.keras_support import sharded_update

    keras.config.set_dtype_policy("mixed_float16")
    try:
        adam = _optimizers()["adam"]
        _, want = fit_results(mirrored(2), adam, wrap=keras.optimizers.LossScaleOptimizer)
        model, got = fit_results(mirrored(2, "gradients"), adam, wrap=keras.optimizers.LossScaleOptimizer)
    finally:
        keras.config.set_dtype_policy("float32")
    assert_same(got, want)
    assert sharded_update.why_whole(model.optimizer) is None  # sliced: the scale's decision is every replica's

    def accumulating():
        return keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)

    _, want = fit_results(mirrored(2), accumulating)
    sharded_update._WARNED.clear()
    with pytest.warns(UserWarning, match="'Adam' accumulates gradients .*runs on whole values.*exact"):
        model, got = fit_results(mirrored(2, "full"), accumulating)
    assert_same(got, want)
    accumulators = model.optimizer._accumulated_gradients
    assert sum(not v._value.is_fully_replicated for v in accumulators) == 2  # stored split all the same


def test_optimizer_without_elementwise_update_is_exact_and_named():
    """Lamb's trust ratio reads whole-variable norms: its update runs on whole values (warned), exactly."""
    import keras

    from distribute.keras_support import sharded_update

    make = lambda: keras.optimizers.Lamb(0.01)  # noqa: E731
    _, want = fit_results(mirrored(2), make)
    sharded_update._WARNED.clear()
    with pytest.warns(UserWarning, match="Optimizer 'Lamb' is not known to update each element.*distribute_elementwise_update = True"):
        model, got = fit_results(mirrored(2, "optimizer_state"), make)
    assert_same(got, want)
    assert any(not v._value.is_fully_replicated for v in model.optimizer.variables)  # its slots are still stored split

    class Declared(keras.optimizers.SGD):  # a custom elementwise update, declared so: sliced
        distribute_elementwise_update = True

        def update_step(self, gradient, variable, learning_rate):
            self.assign_sub(variable, learning_rate * gradient * 0.5)

    assert sharded_update.why_whole(Declared(0.01)) is None
    assert sharded_update.why_whole(type("Undeclared", (keras.optimizers.SGD,), {"update_step": Declared.update_step})(0.01)) is not None
    assert sharded_update.why_whole(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())) is None


# -- exactness: custom loops ---------------------------------------------------------------------------
_NONE_LOOP: dict = {}


@pytest.mark.parametrize("level", ["gradients", "full"])
def test_custom_loop_equals_none(level):
    import keras

    def make():
        return keras.optimizers.Adam(0.02, clipnorm=0.3)

    if "adam" not in _NONE_LOOP:
        _NONE_LOOP["adam"] = custom_loop(mirrored(2), make)[2]
    _, optimizer, got = custom_loop(mirrored(2, level), make)
    assert_same(got, _NONE_LOOP["adam"])
    assert sum(not v._value.is_fully_replicated for v in optimizer.variables) == 4


def test_custom_loop_loss_scale_optimizer_mixed_precision():
    """A LossScaleOptimizer in strategy.run, the uneven last step too (Keras' stateless update: its apply assigns inside
    lax.cond branches, which no traced step can take on JAX)."""
    import keras

    keras.config.set_dtype_policy("mixed_float16")
    try:
        make = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.02))  # noqa: E731
        _, want_opt, want = custom_loop(mirrored(2), make)
        _, got_opt, got = custom_loop(mirrored(2, "full"), make)
    finally:
        keras.config.set_dtype_policy("float32")
    assert_same(got, want)
    assert float(got_opt.iterations.numpy()) == 5 and float(got_opt.dynamic_scale.numpy()) == float(want_opt.dynamic_scale.numpy())


# -- reads, checkpoints, saving ----------------------------------------------------------------------
def test_cross_replica_reads_give_whole_values():
    import jax
    import keras

    strategy = mirrored(4, "full")
    with strategy.scope():
        model = build_model()
    kernel = model.layers[0].kernel
    whole = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    kernel.assign(whole)
    assert [s.data.shape for s in kernel._value.addressable_shards] == [(32, 16)] * 4  # stored split
    np.testing.assert_array_equal(kernel.numpy(), whole)
    assert kernel.value.shape == (32, 64) and len(kernel.value.devices()) == 1  # one device's whole value, as TF's read
    np.testing.assert_array_equal(model.get_weights()[0], whole)
    local = strategy.experimental_local_results(kernel)
    assert len(local) == 4 and all(np.array_equal(np.asarray(v), whole) for v in local)
    assert [next(iter(v.devices())) for v in local] == jax.devices()[:4]
    np.testing.assert_array_equal(strategy.reduce("SUM", kernel, axis=None), whole * 4)
    kernel.assign_add(np.ones((32, 64), np.float32))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(kernel), whole + 1)
    assert not kernel._value.is_fully_replicated


def test_checkpoint_saves_slices_and_restores_across_levels_and_replica_counts(tmp_path, monkeypatch):
    import jax
    import keras

    import distribute
    from distribute.checkpoint import _storage

    x, y = data(32)
    saver = mirrored(4, "full")
    with saver.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    written = {}
    save = _storage._Writer.save

    def spy(self, path, tree, record, *args, **kwargs):
        written.update(tree)
        return save(self, path, tree, record, *args, **kwargs)

    monkeypatch.setattr(_storage._Writer, "save", spy)
    path = distribute.Checkpoint(model=model, optimizer=model.optimizer).save(tmp_path / "ckpt")
    distribute.Checkpoint(model=model).wait_until_finished()
    # Split values go to orbax as their shards on their devices: never whole on one device.
    split = [a for a in written["model"] + written["optimizer"] if isinstance(a, jax.Array)]
    assert len(split) == 6 and all(len(a.sharding.device_set) == 4 and not a.is_fully_replicated for a in split)
    want = [np.asarray(v) for v in model.weights + model.optimizer.variables]
    for target in (mirrored(2), mirrored(8, "optimizer_state"), distribute.OneDeviceStrategy("/cpu:0"), mirrored(2, "gradients")):
        with target.scope():
            other = build_model()
            other.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        distribute.Checkpoint(model=other, optimizer=other.optimizer).restore(path)  # builds the optimizer's slots
        assert_same([np.asarray(v) for v in other.weights + other.optimizer.variables], want, rtol=0, atol=0)
    other.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # and trains on
    assert [s.data.shape for s in other.layers[0].kernel._value.addressable_shards] == [(32, 64)] * 2


def test_keras_save_load_and_backup_and_restore(tmp_path):
    import keras

    import distribute

    x, y = data(32)
    strategy = mirrored(2, "full")
    with strategy.scope():
        model = build_model(dropout=False)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")  # outside any scope
    assert_same(loaded.get_weights(), model.get_weights(), rtol=0, atol=0)
    assert_same([np.asarray(v) for v in loaded.optimizer.variables], [np.asarray(v) for v in model.optimizer.variables], rtol=0, atol=0)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)

    # BackupAndRestore: interrupted in epoch 2, resumed, ends where an uninterrupted NONE run ends.
    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    def run(strategy, callbacks):
        with strategy.scope():
            model = build_model(dropout=False)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
        return model, history

    want, want_history = run(mirrored(2), [])
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        run(mirrored(2, "full"), [distribute.BackupAndRestore(backup), Crash()])
    got, history = run(mirrored(2, "full"), [distribute.BackupAndRestore(backup)])
    assert history.epoch == [2]
    assert_same(got.get_weights(), want.get_weights())
    np.testing.assert_allclose(history.history["loss"], want_history.history["loss"][2:], rtol=RTOL)


# -- several workers ---------------------------------------------------------------------------------
def _loop_optimizer():
    """The uneven last step runs eagerly across workers; SGD keeps its float rounding within RTOL (Adam's
    normalization magnifies it on tiny gradients, with or without sharding)."""
    import keras

    return keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.3)


def _worker(out_dir: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    import keras

    import distribute
    from distribute.multi_worker import CommunicationOptions

    level = os.environ.get("TEST_SHARDING_LEVEL", "full")
    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=60), sharding=level)
    me = strategy.cluster_resolver.task_id
    model, fit = fit_results(strategy, lambda: keras.optimizers.Adam(0.01), evaluate=True)
    _, optimizer, loop = custom_loop(strategy, _loop_optimizer)
    local = [[s.data.shape for s in v._value.addressable_shards] for v in model.trainable_variables]
    out = {"fit": fit, "loop": loop, "local_shards": local}
    pathlib.Path(out_dir, f"worker{me}.json").write_text(json.dumps(out, default=lambda a: np.asarray(a).tolist()))


@pytest.mark.multiprocess
def test_multi_worker_two_by_two_equals_four_devices(tmp_path):
    import keras

    from distribute.launch import launch

    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    result = launch([str(HERE), str(tmp_path)], 2, 2, env=env, timeout_seconds=240, echo=False)
    assert result.returncode == 0, result.output[-6000:]
    workers = [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in range(2)]
    _, fit = fit_results(mirrored(4, "full"), lambda: keras.optimizers.Adam(0.01), evaluate=True)
    _, _, loop = custom_loop(mirrored(4, "full"), _loop_optimizer)
    want = json.loads(json.dumps({"fit": fit, "loop": loop}, default=lambda a: np.asarray(a).tolist()))
    for worker in workers:
        assert worker["local_shards"][0] == [[32, 16], [32, 16]]  # each worker holds its 2 replicas' slices
        for part in ("fit", "loop"):
            for key in want[part]:
                assert_same(worker[part][key], want[part][key])


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _worker(sys.argv[1])
