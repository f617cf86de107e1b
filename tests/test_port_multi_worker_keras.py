"""TF tutorial "Multi-worker training with Keras", ported by substitution only, run through the launcher.

Source: tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb (its
``mnist_setup.py`` and ``main.py``, then the fault-tolerance cells: model saving with
``write_filepath``, the checkpoint cells, ``BackupAndRestore``, the AutoShardPolicy.OFF cell).
Substitutions: tf.distribute -> distribute, tf.data -> distribute.data, tf.keras -> keras,
tf.train.Checkpoint/CheckpointManager/latest_checkpoint -> distribute.*, tf.io.gfile.makedirs /
rmtree -> os.makedirs / shutil.rmtree, tf.keras.callbacks.BackupAndRestore ->
distribute.BackupAndRestore (README). MNIST -> 256 synthetic 28x28 images; steps_per_epoch 70 -> 6
(20 -> 3), a 4-filter CNN; the shuffle gets a seed and the model a Keras seed so the run compares
with one process. Paths are under the test's tmp dir.

Run as ``python -m distribute.launch --num-workers 2 main.py OUT PER_WORKER_BATCH`` (the README's
launcher; global batch 16); the same fits run in the test process under MirroredStrategy over 2
devices: the README says a 2-worker job gives the answers of one process with as many replicas.

Asserted: both launches exit 0 and both workers finish with the same history; the loss decreases
over the 3 epochs; the 2-worker history and final weights equal the 2-device process's; the chief's model
file and checkpoint exist, no workertemp_1 is left, the saved model loads to the trained weights;
the checkpoint restores and training goes on; BackupAndRestore's fit runs to the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess

SRC = str(Path(__file__).resolve().parents[1] / "src")
LAUNCH_TIMEOUT_SECONDS = 100

MNIST_SETUP = textwrap.dedent('''
    import os
    import numpy as np
    import distribute
    import keras

    def mnist_dataset(batch_size):
      rng = np.random.default_rng(0)                      # was keras.datasets.mnist.load_data()
      x_train = rng.integers(0, 256, (256, 28, 28)).astype(np.uint8)
      y_train = ((x_train[:, :14].mean(axis=(1, 2)) > 127.5) * 5 + x_train[:, 0, 0] % 5).astype(np.int64)
      # The `x` arrays are in uint8 and have values in the [0, 255] range.
      # You need to convert them to float32 with values in the [0, 1] range.
      x_train = x_train / np.float32(255)
      y_train = y_train.astype(np.int64)
      train_dataset = distribute.data.Dataset.from_tensor_slices(
          (x_train, y_train)).shuffle(60000, seed=7).repeat().batch(batch_size)
      return train_dataset

    def build_and_compile_cnn_model():
      keras.utils.set_random_seed(3)
      model = keras.Sequential([
          keras.layers.InputLayer(shape=(28, 28)),
          keras.layers.Reshape(target_shape=(28, 28, 1)),
          keras.layers.Conv2D(4, 3, activation='relu'),
          keras.layers.Flatten(),
          keras.layers.Dense(16, activation='relu'),
          keras.layers.Dense(10)
      ])
      model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    optimizer=keras.optimizers.SGD(learning_rate=0.01),
                    metrics=['accuracy'])
      return model
''')

MAIN = textwrap.dedent('''
    import json
    import os
    import shutil
    import sys

    import distribute
    import keras
    import numpy as np
    import mnist_setup

    out = sys.argv[1]
    per_worker_batch_size = int(sys.argv[2])
    tf_config = json.loads(os.environ['TF_CONFIG'])
    num_workers = len(tf_config['cluster']['worker'])

    strategy = distribute.MultiWorkerMirroredStrategy()

    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

    with strategy.scope():
      # Model building/compiling need to be within `strategy.scope()`.
      multi_worker_model = mnist_setup.build_and_compile_cnn_model()

    history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=6, verbose=0)
    trained = [w.tolist() for w in multi_worker_model.get_weights()]

    # --- Model saving and loading (the tutorial's write_filepath) ---
    model_path = os.path.join(out, 'keras-model.keras')

    def _is_chief(task_type, task_id):
      # Note: there are two possible `TF_CONFIG` configurations.
      #   1) In addition to `worker` tasks, a `chief` task type is use;
      #      in this case, this function should be modified to
      #      `return task_type == 'chief'`.
      #   2) Only `worker` task type is used; in this case, worker 0 is
      #      regarded as the chief. The implementation demonstrated here
      #      is for this case.
      # For the purpose of this Colab section, the `task_type` is `None` case
      # is added because it is effectively run with only a single worker.
      return (task_type == 'worker' and task_id == 0) or task_type is None

    def _get_temp_dir(dirpath, task_id):
      base_dirpath = 'workertemp_' + str(task_id)
      temp_dir = os.path.join(dirpath, base_dirpath)
      os.makedirs(temp_dir, exist_ok=True)              # was tf.io.gfile.makedirs
      return temp_dir

    def write_filepath(filepath, task_type, task_id):
      dirpath = os.path.dirname(filepath)
      base = os.path.basename(filepath)
      if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
      return os.path.join(dirpath, base)

    task_type, task_id = (strategy.cluster_resolver.task_type,
                          strategy.cluster_resolver.task_id)
    write_model_path = write_filepath(model_path, task_type, task_id)
    multi_worker_model.save(write_model_path)
    if not _is_chief(task_type, task_id):
      shutil.rmtree(os.path.dirname(write_model_path))  # was tf.io.gfile.rmtree

    # --- Checkpoint saving and restoring ---
    checkpoint_dir = os.path.join(out, 'ckpt')
    checkpoint = distribute.Checkpoint(model=multi_worker_model)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    checkpoint_manager = distribute.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id):
      shutil.rmtree(write_checkpoint_dir)
    latest_checkpoint = distribute.latest_checkpoint(checkpoint_dir)
    checkpoint.restore(latest_checkpoint)
    restored_equal = all(np.array_equal(a, np.asarray(b)) for a, b in zip(multi_worker_model.get_weights(), trained))
    more = multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=3, verbose=0)

    # --- BackupAndRestore ---
    callbacks = [distribute.BackupAndRestore(backup_dir=os.path.join(out, 'backup'))]
    with strategy.scope():
      multi_worker_model = mnist_setup.build_and_compile_cnn_model()
    backup = multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=3,
                                    callbacks=callbacks, verbose=0)

    # --- Dataset sharding OFF ---
    options = distribute.data.Options()
    options.experimental_distribute.auto_shard_policy = distribute.data.experimental.AutoShardPolicy.OFF
    dataset_no_auto_shard = multi_worker_dataset.with_options(options)
    with strategy.scope():
      off_model = mnist_setup.build_and_compile_cnn_model()
    off = off_model.fit(dataset_no_auto_shard, epochs=1, steps_per_epoch=2, verbose=0)

    with open(os.path.join(out, 'result_%s_%d.json' % (task_type, task_id)), 'w') as f:
      json.dump({'history': history.history, 'weights': trained, 'restored_equal': restored_equal,
                 'more': more.history, 'backup': backup.history, 'off': off.history,
                 'replicas': strategy.num_replicas_in_sync}, f)
''')


def _launch(tmp: Path, num_workers: int, devices: int, per_worker_batch: int) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / f"out_{num_workers}x{devices}"
    out.mkdir()
    (tmp / "mnist_setup.py").write_text(MNIST_SETUP)
    (tmp / "main.py").write_text(MAIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(tmp)])}
    env.pop("XLA_FLAGS", None)
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "distribute.launch", "--num-workers", str(num_workers), "--devices-per-worker",
         str(devices), "--timeout-seconds", str(LAUNCH_TIMEOUT_SECONDS), str(tmp / "main.py"), str(out),
         str(per_worker_batch)],
        capture_output=True, text=True, env=env, cwd=tmp, timeout=LAUNCH_TIMEOUT_SECONDS + 30)
    return proc, out


def _one_process_two_devices(tmp: Path) -> dict:
    """The same fits in this process under MirroredStrategy over 2 devices (the README's equivalence)."""
    import importlib.util

    import distribute
    from helpers import mirrored

    spec = importlib.util.spec_from_file_location("mnist_setup_reference", tmp / "mnist_setup.py")
    mnist_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mnist_setup)
    strategy = mirrored(2)
    dataset = mnist_setup.mnist_dataset(16)
    with strategy.scope():
        model = mnist_setup.build_and_compile_cnn_model()
    history = model.fit(dataset, epochs=3, steps_per_epoch=6, verbose=0).history
    weights = [w.tolist() for w in model.get_weights()]
    more = model.fit(dataset, epochs=2, steps_per_epoch=3, verbose=0).history
    with strategy.scope():
        model = mnist_setup.build_and_compile_cnn_model()
    backup = model.fit(dataset, epochs=2, steps_per_epoch=3, verbose=0).history
    options = distribute.data.Options()
    options.experimental_distribute.auto_shard_policy = distribute.data.experimental.AutoShardPolicy.OFF
    with strategy.scope():
        model = mnist_setup.build_and_compile_cnn_model()
    off = model.fit(dataset.with_options(options), epochs=1, steps_per_epoch=2, verbose=0).history
    return {"history": history, "weights": weights, "more": more, "backup": backup, "off": off, "replicas": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mwk")
    two, two_out = _launch(tmp, 2, 1, 8)
    return two, two_out, _one_process_two_devices(tmp)


def _result(out, task_id):
    return json.loads((out / f"result_worker_{task_id}.json").read_text())


def test_both_workers_finish_with_one_history(runs):
    two, two_out, _ = runs
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    w0, w1 = _result(two_out, 0), _result(two_out, 1)
    assert w0["replicas"] == w1["replicas"] == 2
    assert w0["history"] == w1["history"]
    assert w0["weights"] == w1["weights"]
    loss = w0["history"]["loss"]
    assert loss[2] < loss[0], loss


def test_two_workers_equal_one_process_with_two_devices(runs):
    _, two_out, ref = runs
    w0 = _result(two_out, 0)
    assert ref["replicas"] == 2
    np.testing.assert_allclose(w0["history"]["loss"], ref["history"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(w0["history"]["accuracy"], ref["history"]["accuracy"], rtol=1e-6)
    for a, b in zip(w0["weights"], ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for key in ("more", "backup", "off"):
        np.testing.assert_allclose(w0[key]["loss"], ref[key]["loss"], rtol=1e-4)


def test_chief_saved_model_and_checkpoint(runs):
    import keras

    _, two_out, _ = runs
    w0 = _result(two_out, 0)
    assert (two_out / "keras-model.keras").is_file()
    # As in TF: write_filepath(checkpoint_dir) is OUT/workertemp_1/ckpt for worker 1 and the
    # tutorial removes only that, so an empty OUT/workertemp_1 stays (the model's temp dir is gone).
    assert [p for p in (two_out / "workertemp_1").rglob("*")] == []
    assert [p.name for p in (two_out / "ckpt").iterdir() if p.name.startswith("ckpt-")] == ["ckpt-1"]
    loaded_model = keras.models.load_model(two_out / "keras-model.keras")
    for a, b in zip(loaded_model.get_weights(), w0["weights"]):
        np.testing.assert_array_equal(a, np.asarray(b, dtype=a.dtype))
    assert w0["restored_equal"] and _result(two_out, 1)["restored_equal"]
    assert len(w0["more"]["loss"]) == 2 and len(w0["backup"]["loss"]) == 2
    # BackupAndRestore deletes its backup when fit ends (delete_checkpoint=True)
    assert not any((two_out / "backup").glob("**/*.orbax*"))
