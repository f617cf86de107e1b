"""distribute.BackupAndRestore: fit resumes after a lost worker, ending where an uninterrupted run ends.

The multi-process test kills worker 1 (SIGKILL) in the third epoch of a
2-worker job started by the launcher, relaunches the same job, and checks that
it resumes at the third epoch and ends with the weights of an uninterrupted run.
The file is also the worker program (``python tests/test_backup_restore.py OUT_DIR BACKUP_DIR``).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
EPOCHS, KILL_EPOCH, KILL_BATCH, BATCH = 5, 2, 2, 8
LAUNCH_TIMEOUT_SECONDS = 120


# -- shared by the tests and the worker program -------------------------------------------------
def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    return x, (x @ rng.normal(size=(5, 2))).astype(np.float32)


def build(strategy):
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def fit(strategy, backup_dir, extra_callbacks=()):
    import distribute

    x, y = data()
    model = build(strategy)
    callbacks = [distribute.BackupAndRestore(backup_dir), *extra_callbacks]
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return model, history


def _interrupter(action):
    import keras

    class Interrupt(keras.callbacks.Callback):
        """Calls ``action`` at batch KILL_BATCH of epoch KILL_EPOCH (zero-based: the third epoch)."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == KILL_EPOCH and batch == KILL_BATCH:
                action()

    return Interrupt()


@pytest.fixture(scope="module")
def reference():
    """An uninterrupted run on 2 replicas (what 2 workers x 1 device compute)."""
    from helpers import mirrored

    model = build(mirrored(2))
    x, y = data()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], history.history["loss"]


# -- single process ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_mirrored_fit_resumes_from_backup(tmp_path, reference, num_replicas):
    from helpers import mirrored

    strategy = mirrored(num_replicas)
    backup = tmp_path / "backup"

    def crash():
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        fit(strategy, backup, [_interrupter(crash)])
    import distribute

    assert distribute.latest_checkpoint(backup, "backup") == str(backup / f"backup-{KILL_EPOCH}")  # waits for the save
    assert os.listdir(backup) == [f"backup-{KILL_EPOCH}"]  # one backup per finished epoch, the last kept

    model, history = fit(strategy, backup)
    assert history.epoch == list(range(KILL_EPOCH, EPOCHS))
    assert not backup.exists()  # delete_checkpoint=True
    weights, losses = reference
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], losses[KILL_EPOCH:], rtol=1e-5)


def test_keeps_backup_and_falls_back_to_previous(tmp_path, reference):
    from helpers import mirrored

    import distribute

    strategy = mirrored(2)
    backup = tmp_path / "backup"
    x, y = data()
    model = build(strategy)
    callback = distribute.BackupAndRestore(backup, double_checkpoint=True, delete_checkpoint=False)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[callback])
    assert sorted(os.listdir(backup)) == ["backup-2", "backup-3"]
    (backup / "backup-3" / "_CHECKPOINT_METADATA").write_text("{trunc")  # the latest is unreadable: resume after epoch 2
    model = build(strategy)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[distribute.BackupAndRestore(backup, double_checkpoint=True)])
    assert history.epoch == [2, 3, 4]
    for got, want in zip(model.get_weights(), reference[0]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="backup_dir"):
        distribute.BackupAndRestore("")


# -- multi-process ------------------------------------------------------------------------------
def _worker(out_dir: str, backup_dir: str) -> None:
    import distribute
    from distribute.multi_worker import CommunicationOptions

    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=30))
    me = strategy.extended.input_policy.input_pipelines()[1]
    extra = []
    if me == 1 and os.environ.get("BACKUP_TEST_KILL") == "1":
        def die():
            print(f"worker 1 kills itself in epoch {KILL_EPOCH}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        extra.append(_interrupter(die))
    model, history = fit(strategy, backup_dir, extra)
    out = {"epochs": history.epoch, "loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()],
           "replicas": strategy.num_replicas_in_sync}
    pathlib.Path(out_dir, f"worker{me}.json").write_text(json.dumps(out))


@pytest.mark.multiprocess
def test_lost_worker_then_relaunch_resumes(tmp_path, reference):
    from distribute.launch import launch

    backup = tmp_path / "backup"
    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [str(HERE), str(tmp_path), str(backup)]

    first = launch(command, 2, 1, env={**env, "BACKUP_TEST_KILL": "1"}, timeout_seconds=LAUNCH_TIMEOUT_SECONDS, echo=False)
    assert first.returncode != 0 and not first.timed_out, first.output[-4000:]
    assert first.failed_task == "worker 1" and first.exit_codes["worker 1"] == -signal.SIGKILL, first.output[-4000:]
    assert "worker 1 kills itself" in first.task_output("worker", 1)
    assert not list(tmp_path.glob("worker*.json"))
    import distribute

    # Backups after epochs 1 and 2; the older one is deleted once the newer is known to be committed.
    assert distribute.latest_checkpoint(backup, "backup") == str(backup / f"backup-{KILL_EPOCH}")
    assert set(os.listdir(backup)) <= {f"backup-{KILL_EPOCH - 1}", f"backup-{KILL_EPOCH}"}

    second = launch(command, 2, 1, env=env, timeout_seconds=LAUNCH_TIMEOUT_SECONDS, echo=False)
    assert second.returncode == 0, second.output[-6000:]
    workers = [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in range(2)]
    weights, losses = reference
    for worker in workers:
        assert worker["replicas"] == 2
        assert worker["epochs"] == list(range(KILL_EPOCH, EPOCHS))  # resumed, not from epoch 0
        for got, want in zip(worker["weights"], weights):
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(worker["loss"], losses[KILL_EPOCH:], rtol=1e-5)
    assert not backup.exists()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
