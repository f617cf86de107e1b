"""The program of tests/test_elastic.py: trains under an elastic launch, shrinking 3 -> 2 and growing 2 -> 3.

Run by every worker of ``python -m distribute.launch --num-workers 2:3 --hosts-command HOSTS_SCRIPT``:

    python elastic_job.py loop|fit HOSTS_FILE BACKUP_DIR OUT_DIR

Generation 0 (3 workers): worker 1, after step KILL_STEP, makes the hosts file
list 2 slots, removes BACKUP_DIR (so nothing can be restored from disk) and
SIGKILLs itself.  Generation 1 (2 workers) restores from the launcher's memory;
its worker 0, after step GROW_STEP (an epoch's last step), makes the hosts
file list 3 slots, and every worker waits there until the launcher has asked
the generation to regroup, so the generation stops at the boundary between two
epochs (after the loop's or fit's epoch-end code).  Generation 2 (3 workers)
restores and finishes.

Each worker prints ``gen G worker W starts at step S`` and ``gen G worker W
applied step S`` (S counts completed steps); worker 0 prints ``epoch E loss L``
at the end of each epoch and writes the final weights to OUT_DIR/weights.npz.
The same functions compute the uninterrupted reference in the test's process.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import numpy as np

EPOCHS, ROWS, GLOBAL_BATCH = 4, 48, 12
STEPS_PER_EPOCH = ROWS // GLOBAL_BATCH
KILL_STEP, GROW_STEP, REGROUP_WAIT_SECONDS = 6, 8, 60


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 5)).astype(np.float32)
    return x, (x @ rng.normal(size=(5, 2))).astype(np.float32)


def build(strategy):
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def train_loop(strategy, checkpoint_dir: str, on_step=None) -> tuple[list[np.ndarray], list[float]]:
    """A custom loop under PreemptionCheckpointHandler; the input is a seeded shuffle, repeated, resumed by skip."""
    import keras

    import distribute

    model = build(strategy)
    with strategy.scope():
        loss_sum = keras.Variable(0.0, name="loss_sum", aggregation="sum")
    checkpoint = distribute.Checkpoint(model=model, optimizer=model.optimizer, loss_sum=loss_sum)
    handler = distribute.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, checkpoint_dir)
    start = handler.total_run_calls
    _say(strategy, f"starts at step {start}")
    x, y = data()
    dataset = (distribute.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=7).batch(GLOBAL_BATCH)
               .repeat(EPOCHS).skip(start))
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def step_fn(features, labels):
        def loss_fn():
            predictions = model(features, training=True)
            return distribute.compute_average_loss(keras.ops.mean(keras.ops.square(predictions - labels), axis=1),
                                                   global_batch_size=GLOBAL_BATCH)

        loss, grads = distribute.compute_gradients(loss_fn, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        loss_sum.assign_add(loss)
        return loss

    def distributed_step(inputs):
        return strategy.reduce("SUM", strategy.run(step_fn, args=inputs), axis=None)

    losses = []
    for step in range(start, EPOCHS * STEPS_PER_EPOCH):
        handler.run(distributed_step, next(iterator))
        _say(strategy, f"applied step {step + 1}")
        if (step + 1) % STEPS_PER_EPOCH == 0:
            losses.append(float(np.asarray(loss_sum.numpy())) / STEPS_PER_EPOCH)
            _say(strategy, f"epoch {(step + 1) // STEPS_PER_EPOCH - 1} loss {losses[-1]!r}", chief_only=True)
            loss_sum.assign(0.0)
        if on_step is not None:
            on_step(step + 1)
    return [np.asarray(w) for w in model.get_weights()], losses


def train_fit(strategy, backup_dir: str, on_step=None) -> tuple[list[np.ndarray], list[float]]:
    """Keras fit with distribute.BackupAndRestore (the global batch is fit's batch_size at every worker count)."""
    import keras

    import distribute

    model = build(strategy)
    x, y = data()

    backup = distribute.BackupAndRestore(backup_dir)

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = backup.resumed_step or 0  # an elastic generation resumes mid-epoch
            _say(strategy, f"starts at step {self.start}")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            step = self.epoch * STEPS_PER_EPOCH + batch + 1
            if step <= self.start:
                return  # applied by an earlier generation; fit only reads past its batch
            _say(strategy, f"applied step {step}")
            if on_step is not None:
                on_step(step)

        def on_epoch_end(self, epoch, logs=None):
            _say(strategy, f"epoch {epoch} loss {float(logs['loss'])!r} mae {float(logs['mae'])!r}", chief_only=True)

    callbacks = [backup, Report()]
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return [np.asarray(w) for w in model.get_weights()], [float(v) for v in history.history["loss"]]


def _say(strategy, text: str, chief_only: bool = False) -> None:
    resolver = strategy.cluster_resolver
    worker = resolver.task_id if resolver is not None else 0
    if chief_only and worker != 0:
        return
    print(f"gen {os.environ.get('DISTRIBUTE_ELASTIC_GENERATION', '0')} worker {worker} {text}", flush=True)


def _membership_changes(hosts_file: str, backup_dir: str, worker: int):
    generation = int(os.environ["DISTRIBUTE_ELASTIC_GENERATION"])

    def on_step(step: int) -> None:
        if generation == 0 and worker == 1 and step == KILL_STEP:
            with open(hosts_file, "w") as f:
                f.write("localhost\nlocalhost\n")
            shutil.rmtree(backup_dir, ignore_errors=True)
            print(f"gen 0 worker 1 kills itself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if generation == 1 and step == GROW_STEP:
            from distribute.runtime import elastic

            if worker == 0:
                with open(hosts_file, "w") as f:
                    f.write("localhost:3\n")
            deadline = time.monotonic() + REGROUP_WAIT_SECONDS  # the launcher polls the hosts command every second
            while not elastic.regroup_requested():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the launcher did not ask generation 1 to regroup in {REGROUP_WAIT_SECONDS} s")
                time.sleep(0.05)

    return on_step


def main(argv: list[str]) -> int:
    mode, hosts_file, backup_dir, out_dir = argv
    import distribute
    from distribute.multi_worker import CommunicationOptions

    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=20))
    worker = strategy.cluster_resolver.task_id
    on_step = _membership_changes(hosts_file, backup_dir, worker)
    train = train_loop if mode == "loop" else train_fit
    weights, _ = train(strategy, backup_dir, on_step)
    if worker == 0:
        np.savez(os.path.join(out_dir, "weights.npz"), *weights)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
