"""A real tf.data pipeline through distribute: experimental_distribute_dataset, distribute_datasets_from_function,
Keras fit, element_spec, strings and TF's own FILE auto-sharding.

Runs where ``import tensorflow`` works (TensorFlow is never a dependency of
the package); elsewhere the module is skipped with the reason shown by
``pytest -rs``. Run it with a virtualenv that has tensorflow-cpu and the
project's dependencies, e.g.::

    PYTHONPATH=src /work/tfvenv/bin/python -m pytest tests/test_tf_data_interop.py
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed: the tf.data interop test needs tensorflow-cpu")

import keras
from helpers import mirrored
from test_input_pipelines import dist_spec_json

import distribute
from distribute.data import Dataset

X = np.arange(30, dtype=np.float32).reshape(10, 3)
Y = np.arange(10, dtype=np.int64)


def local(s, value):
    return [np.asarray(v).tolist() for v in s.experimental_local_results(value)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tf_pipeline_splits_like_a_distribute_dataset(n):
    s = mirrored(n)
    tf_ds = tf.data.Dataset.from_tensor_slices((X, Y)).map(lambda a, b: (a * 2.0, b + 1)).batch(4)
    ours = Dataset.from_tensor_slices((X, Y)).map(lambda a, b: (a * 2.0, b + 1)).batch(4)
    got = [(local(s, a), local(s, b)) for a, b in s.experimental_distribute_dataset(tf_ds)]
    want = [(local(s, a), local(s, b)) for a, b in s.experimental_distribute_dataset(ours)]
    assert got == want and len(got) == 3
    assert s.experimental_distribute_dataset(tf_ds).cardinality() == 3


def test_tf_pipeline_element_spec_and_cardinality():
    tf_ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4, drop_remainder=True)
    wrapped = distribute.data._foreign.wrap(tf_ds)
    assert wrapped.cardinality() == 2 and wrapped._batch_info == (4, True)
    dist = mirrored(2).experimental_distribute_dataset(tf_ds)
    assert dist_spec_json(dist.element_spec) == [
        {"type": "PerReplicaSpec", "per_replica": [{"shape": [2, 3], "dtype": "float32"}] * 2},
        {"type": "PerReplicaSpec", "per_replica": [{"shape": [2], "dtype": "int64"}] * 2}]


def test_tf_pipeline_from_function_and_run():
    s = mirrored(2)

    def dataset_fn(ctx):
        batch = ctx.get_per_replica_batch_size(4)
        return tf.data.Dataset.from_tensor_slices(X[:, 0]).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch)

    steps = [local(s, s.run(lambda v: v + 1.0, args=(e,))) for e in s.distribute_datasets_from_function(dataset_fn)]
    assert steps == [[[1.0, 4.0], [7.0, 10.0]], [[13.0, 16.0], [19.0, 22.0]], [[25.0, 28.0], []]]


def test_tf_strings_stay_on_the_host():
    s = mirrored(2)
    tf_ds = tf.data.Dataset.from_tensor_slices({"w": ["a", "bb", "c"], "x": [1.0, 2.0, 3.0]}).batch(3)
    element = next(iter(s.experimental_distribute_dataset(tf_ds)))
    assert [[bytes(v) for v in part] for part in s.experimental_local_results(element["w"])] == [[b"a", b"bb"], [b"c"]]
    with pytest.raises(TypeError, match=r"\['w'\] holds non-numeric"):
        s.run(lambda d: d["x"], args=(element,))


def test_keras_fit_on_tf_pipeline_equals_fit_on_arrays():
    x = np.random.default_rng(1).normal(size=(20, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    s = mirrored(2)

    def train(data, **kwargs):
        with s.scope():
            keras.utils.set_random_seed(4)
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(data, epochs=2, verbose=0, **kwargs)
        return model.get_weights(), history.history["loss"]

    tf_weights, tf_losses = train(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    ref_weights, ref_losses = train(x, y=y, batch_size=8, shuffle=False)
    np.testing.assert_allclose(tf_losses, ref_losses, rtol=1e-6)
    for a, b in zip(tf_weights, ref_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_tf_file_sharding_uses_tfs_rewrite(tmp_path):
    for f in range(4):
        (tmp_path / f"part-{f}.txt").write_text("".join(f"f{f}-l{i}\n" for i in range(f + 1)))
    pattern = str(tmp_path / "part-*.txt")
    tf_ds = tf.data.Dataset.list_files(pattern, shuffle=False).interleave(tf.data.TextLineDataset, cycle_length=1)
    from distribute.data._foreign import tf_shard_by_files, wrap

    parts = [[bytes(x).decode() for x in tf_shard_by_files(wrap(tf_ds), 2, w, 2)] for w in (0, 1)]
    assert parts == [["f0-l0", "f2-l0", "f2-l1", "f2-l2"], ["f1-l0", "f1-l1", "f3-l0", "f3-l1", "f3-l2", "f3-l3"]]
