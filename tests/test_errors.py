"""Bad input and wrong context: each a clear error naming the value and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from helpers import mirrored, tf_fixture

ERRORS = tf_fixture()["errors"]


def test_unbatched_dataset_raises_value_error_with_fix():
    # TF 2.21 fails with IndexError on 2 replicas (and silently accepts it on 1); ours is a clear ValueError.
    for n in (1, 2):
        with pytest.raises(ValueError, match=r"unbatched.*\.batch\("):
            mirrored(n).experimental_distribute_dataset(Dataset.range(5))


def test_non_dataset_input_raises_type_error():
    with pytest.raises(TypeError, match="distribute.data.Dataset"):
        mirrored(2).experimental_distribute_dataset([np.arange(4)])


@pytest.mark.parametrize(
    "args",
    [np.float32(1.0), jnp.array([1.0, 2.0]), 3.0, {"a": 1.0}],
    ids=["scalar_array", "1d_array", "python_float", "dict"],
)
def test_run_args_must_be_tuple_or_list(args):
    assert ERRORS["run_args_dict"]["error"] == "ValueError"
    with pytest.raises(ValueError, match=r"args must be a tuple or list.*args=\(x,\)") as info:
        mirrored(2).run(lambda *a: 1.0, args=args)
    assert type(args).__name__ in str(info.value)


def test_run_args_list_is_fine():
    s = mirrored(2)
    out = s.run(lambda v: v * 2.0, args=[np.float32(1.0)])
    assert [float(v) for v in s.experimental_local_results(out)] == ERRORS["run_args_list_ok"]["no_error_result"]


def test_input_context_indivisible_batch_size():
    assert ERRORS["input_context_get_per_replica_batch_size_64_over_3"]["error"] == "ValueError"
    with pytest.raises(ValueError, match=r"`global_batch_size` 64 is not divisible by `num_replicas_in_sync` 3"):
        distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=3).get_per_replica_batch_size(64)


def test_duplicate_devices():
    # TF raises AssertionError; ours is a ValueError naming the device.
    with pytest.raises(ValueError, match=r"'/cpu:0'.*twice"):
        distribute.MirroredStrategy(["/cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match="twice"):
        distribute.MirroredStrategy(["/cpu:1", "/device:CPU:1"])


@pytest.mark.parametrize("device", ["/cpu:99", "/gpu:0"])
def test_unknown_devices(device):
    with pytest.raises(ValueError, match=r"Available: .*/cpu:0") as info:
        distribute.MirroredStrategy(["/cpu:0", device])
    assert device in str(info.value)


def test_unknown_device_name_format():
    with pytest.raises(ValueError, match="not understood"):
        distribute.MirroredStrategy(["banana"])


@pytest.mark.parametrize("op", ["PROD", "MAX"])
def test_unknown_reduce_op(op):
    assert ERRORS[f"reduce_op_{op}"]["error"] == "ValueError"
    s = mirrored(2)
    v = s.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    with pytest.raises(ValueError, match=rf"'{op}'.*SUM.*MEAN"):
        s.reduce(op, v, axis=None)


def test_unknown_reduce_op_in_all_reduce():
    s = mirrored(2)
    with pytest.raises(ValueError, match="PROD"):
        s.run(lambda: distribute.get_replica_context().all_reduce("PROD", 1.0))


@pytest.mark.parametrize(
    "what, call",
    [
        ("gather", lambda s, x: s.gather(x, axis=0)),
        ("reduce", lambda s, x: s.reduce("SUM", x, axis=None)),
        ("run", lambda s, x: s.run(lambda v: v, args=(x,))),
    ],
)
def test_cross_replica_methods_inside_run_raise_runtime_error(what, call):
    assert ERRORS[f"{what}_inside_run_eager"]["error"] == "RuntimeError"
    s = mirrored(2)
    x = s.experimental_distribute_values_from_function(lambda ctx: np.ones((2,), np.float32))
    with pytest.raises(RuntimeError, match="inside"):
        s.run(lambda v: call(s, v), args=(x,))


def test_mixing_strategies_raises_runtime_error():
    assert ERRORS["second_strategy_scope_inside_first"]["error"] == "RuntimeError"
    with mirrored(2).scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            with mirrored(4).scope():
                pass


def test_per_replica_of_another_strategy_in_run():
    a, b = mirrored(2), mirrored(4)
    x = a.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    with pytest.raises(ValueError, match="distribute the input with this strategy"):
        b.run(lambda v: v, args=(x,))


# -- objects created outside the scope ---------------------------------------------------------
def _assert_outside_message(message: str, name: str):
    assert "outside" in message and "strategy.scope()" in message and name in message, message


def test_optimizer_created_outside_scope_used_in_run():
    s = mirrored(2)
    optimizer = keras.optimizers.SGD(0.1, name="outside_sgd")
    with s.scope():
        layer = keras.layers.Dense(1)
        layer.build((None, 2))
    x = np.ones((4, 2), np.float32)

    def step():
        _, grads = distribute.compute_gradients(lambda: jnp.sum(layer(x)), layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return jnp.float32(0.0)

    with pytest.raises(ValueError) as info:
        s.run(step)
    _assert_outside_message(str(info.value), "SGD")


def test_model_created_outside_scope_used_in_run():
    s = mirrored(2)
    layer = keras.layers.Dense(1, name="outside_dense")
    layer.build((None, 2))
    with pytest.raises(ValueError) as info:
        s.run(lambda: layer(np.ones((1, 2), np.float32)))
    _assert_outside_message(str(info.value), "outside_dense")


def test_metric_created_outside_scope_used_in_run():
    s = mirrored(2)
    metric = keras.metrics.Mean(name="outside_mean")
    with pytest.raises(ValueError) as info:
        s.run(lambda: metric.update_state(jnp.ones((2,))) or jnp.float32(0.0))
    _assert_outside_message(str(info.value), "Mean")


def test_fit_with_optimizer_created_outside_scope():
    s = mirrored(2)
    optimizer = keras.optimizers.Adam(0.01)
    with s.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError) as info:
        model.fit(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32), batch_size=4, epochs=1, verbose=0)
    _assert_outside_message(str(info.value), "Adam")


# -- Keras backend --------------------------------------------------------------------------------
def _python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)


def test_keras_loaded_with_another_backend_is_refused():
    result = _python("import os; os.environ['KERAS_BACKEND']='numpy'; import keras; import distribute")
    assert result.returncode != 0
    assert "KERAS_BACKEND=jax" in result.stderr
    assert "numpy" in result.stderr.splitlines()[-1]


def test_keras_backend_env_other_than_jax_is_refused():
    result = _python("import distribute", KERAS_BACKEND="torch")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "KERAS_BACKEND" in last and "torch" in last and "jax" in last


def test_import_sets_jax_backend_without_loading_keras():
    result = _python("import os, sys, distribute; print(os.environ['KERAS_BACKEND'], 'keras' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["jax", "False"]
