"""Keras' TensorBoard callback under MultiWorkerMirroredStrategy: the chief writes, as TF's.

TF's (tf-keras') TensorBoard gives a non-chief worker ``log_dir/workertemp_N``
(``distributed_file_utils.write_dirpath``) and deletes it at the end of training
(``remove_temp_dirpath``).  Keras 3's callback writes through ``tf.summary``, so
it needs TensorFlow (and its ``tensorboard`` package); without it Keras raises
its own ``ModuleNotFoundError``, which the patch leaves as it is.

The launcher test needs TensorFlow in this interpreter; run it with a Python
that has ``tensorflow-cpu`` and ``tensorboard``:
``PYTHONPATH=src /path/to/tf/python -m pytest tests/test_tensorboard_multi_worker.py``.
This file is also the worker program (``python tests/test_tensorboard_multi_worker.py OUT_DIR``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
HAS_TF = importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("tensorboard") is not None
NEEDS_TF = "Keras 3's TensorBoard callback writes through tf.summary: needs tensorflow-cpu and tensorboard installed"
EPOCHS = 2


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 5)).astype(np.float32), rng.normal(size=(32, 2)).astype(np.float32)


def _fit(strategy, callbacks):
    import keras

    x, y = _data()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=(x[:16], y[:16]),
                        callbacks=callbacks)
    return history.history


class _Seen:
    """Records, at each epoch's end, which entries ``pattern`` matches under a directory."""

    def __init__(self, directory: pathlib.Path, pattern: str = "*/*"):
        import keras

        seen = self.seen = []

        class Record(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                seen.append(sorted(str(p.relative_to(directory)) for p in directory.glob(pattern)))

        self.callback = Record()


def _worker(out_dir: str) -> None:
    import keras

    import distribute
    from distribute.multi_worker import CommunicationOptions

    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=60))
    chief, me = strategy.extended.should_checkpoint, strategy.extended.input_policy.input_pipelines()[1]
    out = {}
    for case in ("all", "chief"):
        log_dir = pathlib.Path(out_dir, case)
        callbacks = []
        seen = _Seen(log_dir, "workertemp_*/*")  # the chief's own files are there too (one file system)
        if case == "all" or chief:
            callbacks = [keras.callbacks.TensorBoard(str(log_dir), write_graph=True), seen.callback]
        out[case] = {"history": _fit(strategy, callbacks), "seen": seen.seen}
    pathlib.Path(out_dir, f"worker{me}.json").write_text(json.dumps(out))


def _scalars(directory: pathlib.Path) -> dict[str, list[float]]:
    import tensorflow as tf

    files = sorted(directory.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer: the chief's
    out: dict[str, list[float]] = {}
    for event in tf.compat.v1.train.summary_iterator(str(files[0])):
        for value in event.summary.value:
            if value.tag.startswith("epoch_"):
                out.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return out


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_TF, reason=NEEDS_TF)
def test_tensorboard_on_every_worker_or_the_chief_only_writes_the_chiefs_logs(tmp_path):
    from distribute.launch import launch

    env = {"KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    result = launch([str(HERE), str(tmp_path)], 2, 1, env=env, timeout_seconds=240, echo=False)
    assert result.returncode == 0, result.output[-6000:]
    workers = [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in range(2)]
    for case in ("all", "chief"):
        history = workers[0][case]["history"]
        np.testing.assert_allclose(workers[1][case]["history"]["loss"], history["loss"], rtol=1e-6)
        log_dir = tmp_path / case
        assert sorted(p.name for p in log_dir.iterdir()) == ["train", "validation"]  # no workertemp_1 left
        train, validation = _scalars(log_dir / "train"), _scalars(log_dir / "validation")
        np.testing.assert_allclose(train["epoch_loss"], history["loss"], rtol=1e-6)
        np.testing.assert_allclose(validation["epoch_loss"], history["val_loss"], rtol=1e-6)
    # On every worker the non-chief wrote beside, into workertemp_1, while it trained; on the chief only, not at all.
    assert workers[1]["all"]["seen"] == [["workertemp_1/train", "workertemp_1/validation"]] * EPOCHS
    assert workers[1]["chief"]["seen"] == []


@dataclasses.dataclass(frozen=True)
class _FakeCluster:
    num_workers: int = 2
    worker_id: int = 1
    is_chief: bool = False


def test_a_non_chief_tensorboard_writes_a_temporary_dir_and_deletes_it(tmp_path, monkeypatch):
    """One process standing for worker 1 of 2: with TensorFlow its logs go to ``workertemp_1`` and are deleted at the
    end of fit; without, Keras' own error comes through unchanged and no directory is left."""
    import keras

    import distribute
    from distribute.keras_support import patches, saving

    patches.install_multi_worker()
    monkeypatch.setattr(saving, "_cluster_of", lambda model: _FakeCluster())
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    seen = _Seen(log_dir)
    callback = keras.callbacks.TensorBoard(str(log_dir))
    if HAS_TF:
        _fit(distribute.get_strategy(), [callback, seen.callback])
        assert seen.seen == [["workertemp_1/train", "workertemp_1/validation"]] * EPOCHS
        assert list(log_dir.iterdir()) == []
        assert callback.log_dir == str(log_dir)
    else:
        with pytest.raises(ModuleNotFoundError, match="No module named 'tensorflow'") as ours:
            _fit(distribute.get_strategy(), [callback])
        monkeypatch.setattr(saving, "_cluster_of", lambda model: None)  # the chief: Keras' callback as it is
        with pytest.raises(ModuleNotFoundError) as keras_own:
            _fit(distribute.get_strategy(), [keras.callbacks.TensorBoard(str(log_dir))])
        assert str(ours.value) == str(keras_own.value)
        assert list(log_dir.iterdir()) == [] and callback.log_dir == str(log_dir)


if __name__ == "__main__":
    _worker(sys.argv[1])
