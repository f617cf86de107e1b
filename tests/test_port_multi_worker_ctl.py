"""TF tutorial "Custom training loop with Keras and MultiWorkerMirroredStrategy", ported by substitution only.

Source: tensorflow/docs site/en/tutorials/distribute/multi_worker_with_ctl.ipynb, its ``mnist.py`` and
the "Complete code at a glance" ``main.py``, run through the launcher as the README says.
Substitutions: tf.distribute -> distribute, tf.data -> distribute.data, tf.keras -> keras,
tf.GradientTape -> distribute.GradientTape, tf.nn.compute_average_loss /
scale_regularization_loss -> distribute.*, tf.add_n -> sum, tf.Variable(initial_value=tf.constant(0,
dtype=int64)) -> keras.Variable(initializer=np.int64(0)), tf.train.Checkpoint / CheckpointManager /
latest_checkpoint -> distribute.*, tf.train.ClusterSpec -> distribute.cluster_resolver.ClusterSpec,
tf.io.gfile.makedirs / rmtree -> os.makedirs / shutil.rmtree, ``train_accuracy.reset_states()`` ->
``reset_state()`` (Keras 3), ``util.get_temp_dir()`` -> the test's OUT dir, @tf.function -> @distribute.function.
MNIST -> 256 synthetic 28x28 images; the CNN has 4 filters and 16 units (was 32 and 128);
num_steps_per_epoch 70 -> 3, per-worker batch 64 -> 8; the shuffle gets a seed and the model a Keras
seed; ``num_epochs`` comes from argv so the second launch resumes; results are written to JSON.

Launch A: 2 workers (worker 0 is the chief), num_epochs=2. Launch B: ``--chief`` plus 1 worker
(``_is_chief``'s other branches: task_type 'chief', and a worker 0 that is not chief because 'chief' is
in the cluster spec), num_epochs=3, on the same OUT dir: it restores A's checkpoint. The tutorial
saves before ``epoch.assign_add(1); step_in_epoch.assign(0)``, so the checkpoint holds epoch 1 and
step_in_epoch 3 and the restored loop divides by zero batches: TF's program fails the same way.

Asserted: A exits 0 and its tasks print the same per-epoch losses and accuracies and end with the same
weights; A's losses and accuracies equal those of one device fed each step's two worker batches
concatenated (the README's equivalence; the tutorial's losses are SUM-reduced per-replica averages,
so they equal the one-device mean); B's tasks both restore ckpt-2 with epoch 1, step_in_epoch 3 and
A's final weights, then B fails with ZeroDivisionError, as TF, without hanging; the chief's ``ckpt``
dir holds one checkpoint (max_to_keep=1) and the non-chief's ``workertemp_1/ckpt`` is gone.

Found by this port (fixed in distribute/checkpoint/_storage.py): a program whose last line is
``checkpoint_manager.save()`` lost that checkpoint (the asynchronous commit ran after Python had
shut its thread pools) and, with 2 workers, hung until the launcher's timeout.
"""

from __future__ import annotations

import importlib.util
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
PER_WORKER_BATCH = 8
STEPS_PER_EPOCH = 3

MNIST = textwrap.dedent('''
    import os
    import distribute
    import keras
    import numpy as np

    def mnist_dataset(batch_size):
      rng = np.random.default_rng(0)                      # was keras.datasets.mnist.load_data()
      x_train = rng.integers(0, 256, (256, 28, 28)).astype(np.uint8)
      y_train = ((x_train[:, :14].mean(axis=(1, 2)) > 127.5) * 5 + x_train[:, 0, 0] % 5).astype(np.int64)
      # The `x` arrays are in uint8 and have values in the range [0, 255].
      # You need to convert them to float32 with values in the range [0, 1]
      x_train = x_train / np.float32(255)
      y_train = y_train.astype(np.int64)
      train_dataset = distribute.data.Dataset.from_tensor_slices(
          (x_train, y_train)).shuffle(60000, seed=7)
      return train_dataset

    def dataset_fn(global_batch_size, input_context):
      batch_size = input_context.get_per_replica_batch_size(global_batch_size)
      dataset = mnist_dataset(batch_size)
      dataset = dataset.shard(input_context.num_input_pipelines,
                              input_context.input_pipeline_id)
      dataset = dataset.batch(batch_size)
      return dataset

    def build_cnn_model():
      keras.utils.set_random_seed(3)                      # added: runs compare
      regularizer = keras.regularizers.L2(1e-5)
      return keras.Sequential([
          keras.Input(shape=(28, 28)),
          keras.layers.Reshape(target_shape=(28, 28, 1)),
          keras.layers.Conv2D(4, 3,
                              activation='relu',
                              kernel_regularizer=regularizer),
          keras.layers.Flatten(),
          keras.layers.Dense(16,
                             activation='relu',
                             kernel_regularizer=regularizer),
          keras.layers.Dense(10, kernel_regularizer=regularizer)
      ])
''')

MAIN = textwrap.dedent('''
    import os
    import json
    import shutil
    import sys
    import distribute
    import keras
    import numpy as np
    import mnist

    out = sys.argv[1]                                     # was util.get_temp_dir()
    per_worker_batch_size = int(sys.argv[2])
    tf_config = json.loads(os.environ['TF_CONFIG'])
    num_workers = len(tf_config['cluster']['worker'])
    num_workers += len(tf_config['cluster'].get('chief', []))  # added: the chief is a worker too
    global_batch_size = per_worker_batch_size * num_workers

    num_epochs = int(sys.argv[3])
    num_steps_per_epoch = int(sys.argv[4])

    def _dump(path, value):                               # added: what the test reads, written whole or not
      with open(path + '.tmp', 'w') as f:                 # at all (a task that fails makes the launcher stop
        json.dump(value, f)                               # the others, maybe while one writes)
      os.replace(path + '.tmp', path)

    # Checkpoint saving and restoring
    def _is_chief(task_type, task_id, cluster_spec):
      return (task_type is None
              or task_type == 'chief'
              or (task_type == 'worker'
                  and task_id == 0
                  and 'chief' not in cluster_spec.as_dict()))

    def _get_temp_dir(dirpath, task_id):
      base_dirpath = 'workertemp_' + str(task_id)
      temp_dir = os.path.join(dirpath, base_dirpath)
      os.makedirs(temp_dir, exist_ok=True)              # was tf.io.gfile.makedirs
      return temp_dir

    def write_filepath(filepath, task_type, task_id, cluster_spec):
      dirpath = os.path.dirname(filepath)
      base = os.path.basename(filepath)
      if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
      return os.path.join(dirpath, base)

    checkpoint_dir = os.path.join(out, 'ckpt')

    # Define Strategy
    strategy = distribute.MultiWorkerMirroredStrategy()

    with strategy.scope():
      # Model building/compiling need to be within `tf.distribute.Strategy.scope`.
      multi_worker_model = mnist.build_cnn_model()

      multi_worker_dataset = strategy.distribute_datasets_from_function(
          lambda input_context: mnist.dataset_fn(global_batch_size, input_context))
      optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
      train_accuracy = keras.metrics.SparseCategoricalAccuracy(
          name='train_accuracy')

    @distribute.function
    def train_step(iterator):
      """Training step function."""

      def step_fn(inputs):
        """Per-Replica step function."""
        x, y = inputs
        with distribute.GradientTape() as tape:
          predictions = multi_worker_model(x, training=True)
          per_example_loss = keras.losses.SparseCategoricalCrossentropy(
              from_logits=True,
              reduction=None)(y, predictions)
          loss = distribute.compute_average_loss(per_example_loss)
          model_losses = multi_worker_model.losses
          if model_losses:
            loss += distribute.scale_regularization_loss(sum(model_losses))

        grads = tape.gradient(loss, multi_worker_model.trainable_variables)
        optimizer.apply_gradients(
            zip(grads, multi_worker_model.trainable_variables))
        train_accuracy.update_state(y, predictions)

        return loss

      per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
      return strategy.reduce(
          distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    epoch = keras.Variable(
        initializer=np.int64(0), name='epoch')
    step_in_epoch = keras.Variable(
        initializer=np.int64(0),
        name='step_in_epoch')

    task_type, task_id, cluster_spec = (strategy.cluster_resolver.task_type,
                                        strategy.cluster_resolver.task_id,
                                        strategy.cluster_resolver.cluster_spec())

    checkpoint = distribute.Checkpoint(
        model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)

    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                          cluster_spec)
    checkpoint_manager = distribute.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

    # Restoring the checkpoint
    latest_checkpoint = distribute.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
      checkpoint.restore(latest_checkpoint)
    restored = {'latest': latest_checkpoint and os.path.basename(latest_checkpoint),
                'epoch': int(epoch.numpy()), 'step_in_epoch': int(step_in_epoch.numpy()),
                'weights': [w.tolist() for w in multi_worker_model.get_weights()],
                'is_chief': _is_chief(task_type, task_id, cluster_spec), 'write_checkpoint_dir': write_checkpoint_dir}
    _dump(os.path.join(out, 'restored_%s_%d_%d.json' % (task_type, task_id, num_epochs)), restored)
    log = []

    # Resume our CTL training
    while epoch.numpy() < num_epochs:
      iterator = iter(multi_worker_dataset)
      total_loss = 0.0
      num_batches = 0

      while step_in_epoch.numpy() < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch.assign_add(1)

      train_loss = total_loss / num_batches
      print('Epoch: %d, accuracy: %f, train_loss: %f.'
                    %(epoch.numpy(), train_accuracy.result(), train_loss))
      log.append([int(epoch.numpy()), float(train_accuracy.result()), float(train_loss)])

      train_accuracy.reset_state()

      checkpoint_manager.save()
      if not _is_chief(task_type, task_id, cluster_spec):
        shutil.rmtree(write_checkpoint_dir)              # was tf.io.gfile.rmtree

      epoch.assign_add(1)
      step_in_epoch.assign(0)

    _dump(os.path.join(out, 'result_%s_%d_%d.json' % (task_type, task_id, num_epochs)),
          {'restored': restored, 'log': log, 'is_chief': restored['is_chief'],
           'write_checkpoint_dir': write_checkpoint_dir, 'epoch': int(epoch.numpy()),
           'replicas': strategy.num_replicas_in_sync,
           'weights': [w.tolist() for w in multi_worker_model.get_weights()]})
''')


def _launch(tmp: Path, out: Path, num_epochs: int, chief: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(tmp)])}
    env.pop("XLA_FLAGS", None)
    env.pop("TF_CONFIG", None)
    command = [sys.executable, "-m", "distribute.launch", "--num-workers", "1" if chief else "2",
               "--timeout-seconds", str(LAUNCH_TIMEOUT_SECONDS)]
    if chief:
        command.append("--chief")
    command += [str(tmp / "main.py"), str(out), str(PER_WORKER_BATCH), str(num_epochs), str(STEPS_PER_EPOCH)]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp,
                          timeout=LAUNCH_TIMEOUT_SECONDS + 30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mwctl")
    (tmp / "mnist.py").write_text(MNIST)
    (tmp / "main.py").write_text(MAIN)
    out = tmp / "out"
    out.mkdir()
    a = _launch(tmp, out, 2, chief=False)
    b = _launch(tmp, out, 3, chief=True) if a.returncode == 0 else None
    return tmp, out, a, b


def _result(out, task_type, task_id, num_epochs):
    return json.loads((out / f"result_{task_type}_{task_id}_{num_epochs}.json").read_text())


def _one_device_reference(tmp: Path) -> list:
    """One device fed, each step, worker 0's and worker 1's batches concatenated (the same examples)."""
    import keras

    import distribute

    spec = importlib.util.spec_from_file_location("mnist_ctl_reference", tmp / "mnist.py")
    mnist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mnist)
    global_batch = 2 * PER_WORKER_BATCH
    pipelines = [mnist.dataset_fn(global_batch, distribute.InputContext(2, i, 2)) for i in range(2)]
    model = mnist.build_cnn_model()
    optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    log = []
    for epoch in range(2):
        iterators = [iter(p) for p in pipelines]
        losses = []
        for _ in range(STEPS_PER_EPOCH):
            parts = [next(it) for it in iterators]
            x = np.concatenate([p[0] for p in parts])
            y = np.concatenate([p[1] for p in parts])

            def loss_fn():
                predictions = model(x, training=True)
                loss = keras.ops.mean(loss_object(y, predictions)) + sum(model.losses)
                return loss, predictions

            (loss, predictions), grads = distribute.compute_gradients(loss_fn, model.trainable_variables, has_aux=True)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(y, predictions)
            losses.append(float(loss))
        log.append([epoch, float(accuracy.result()), sum(losses) / len(losses)])
        accuracy.reset_state()
    return log


def test_first_launch_trains_and_the_workers_agree(runs):
    _, out, a, _ = runs
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    w0, w1 = _result(out, "worker", 0, 2), _result(out, "worker", 1, 2)
    assert w0["replicas"] == w1["replicas"] == 2
    assert w0["restored"]["latest"] is None and w0["restored"]["epoch"] == 0
    assert [e for e, _, _ in w0["log"]] == [0, 1]
    assert w0["log"] == w1["log"]
    assert w0["weights"] == w1["weights"]
    assert (w0["is_chief"], w1["is_chief"]) == (True, False)
    assert w0["epoch"] == w1["epoch"] == 2
    assert "Epoch: 0, accuracy: " in a.stdout and "Epoch: 1, accuracy: " in a.stdout


def test_first_launch_equals_one_device_on_the_same_examples(runs):
    tmp, out, a, _ = runs
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    w0 = _result(out, "worker", 0, 2)
    ref = _one_device_reference(tmp)
    np.testing.assert_allclose([loss for _, _, loss in w0["log"]], [loss for _, _, loss in ref], rtol=1e-5)
    np.testing.assert_allclose([acc for _, acc, _ in w0["log"]], [acc for _, acc, _ in ref], rtol=1e-6)


def test_second_launch_restores_on_every_task_then_fails_as_tf(runs):
    """The tutorial saves before ``epoch.assign_add(1); step_in_epoch.assign(0)``: the checkpoint holds
    epoch 1 and step_in_epoch 3 (= num_steps_per_epoch). Restored, the inner loop runs no step and
    ``total_loss / num_batches`` raises ZeroDivisionError: TF's program does the same (its variables
    are saved by value when ``save()`` is called). So every task restores those values and A's
    weights, then fails with that error, and the launcher reports it (no hang)."""
    _, out, a, b = runs
    assert b is not None, "launch A failed"
    assert b.returncode == 1, b.stdout[-3000:] + b.stderr[-3000:]
    assert "ZeroDivisionError" in b.stdout + b.stderr
    first = _result(out, "worker", 0, 2)
    chief = json.loads((out / "restored_chief_0_3.json").read_text())
    worker = json.loads((out / "restored_worker_0_3.json").read_text())
    assert (chief["is_chief"], worker["is_chief"]) == (True, False)  # 'chief' in cluster_spec: worker 0 is not
    for task in (chief, worker):
        assert task["latest"] == "ckpt-2"
        assert (task["epoch"], task["step_in_epoch"]) == (1, STEPS_PER_EPOCH)
        assert task["weights"] == first["weights"]


def test_checkpoints_only_in_the_chief_directory(runs):
    _, out, a, b = runs
    assert a.returncode == 0 and b is not None
    # max_to_keep=1: A's second save (ckpt-2) leaves only itself; B fails before it saves
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["ckpt-2"]
    # the non-chief's write_filepath dir OUT/workertemp_1/ckpt (A) was removed; B's worker 0 made its own
    assert not (out / "workertemp_1" / "ckpt").exists()
    assert _result(out, "worker", 1, 2)["write_checkpoint_dir"] == str(out / "workertemp_1" / "ckpt")
    worker = json.loads((out / "restored_worker_0_3.json").read_text())
    assert worker["write_checkpoint_dir"] == str(out / "workertemp_0" / "ckpt")
