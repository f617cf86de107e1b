"""Keras saving under MultiWorkerMirroredStrategy, through the launcher (2 workers x 1 device).

``ModelCheckpoint`` on every worker (TF's tutorial) and on the chief only,
``model.save`` and ``save_weights`` called by every worker or by the chief only:
the job exits 0, the chief's file exists, no worker-temporary directory is left,
and the file loads to the final weights.  One launch runs every case; the file is
also the worker program (``python tests/test_keras_saving_multi_worker.py OUT_DIR``).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
LAUNCH_TIMEOUT_SECONDS = 150
CASES = ("checkpoint_all", "checkpoint_chief", "save_all", "save_chief", "weights_all", "weights_chief")

pytestmark = pytest.mark.multiprocess


def _worker(out_dir: str) -> None:
    import keras
    from keras.src.saving import saving_lib

    import distribute
    from distribute.multi_worker import CommunicationOptions

    written = []
    real_save = saving_lib.save_model
    saving_lib.save_model = lambda model, filepath, *a, **k: (written.append(str(filepath)), real_save(model, filepath, *a, **k))[1]
    real_weights = saving_lib.save_weights_only
    saving_lib.save_weights_only = lambda model, filepath, *a, **k: (written.append(str(filepath)), real_weights(model, filepath, *a, **k))[1]

    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=30))
    chief, me = strategy.extended.should_checkpoint, strategy.extended.input_policy.input_pipelines()[1]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 5)).astype(np.float32), rng.normal(size=(32, 2)).astype(np.float32)
    out = {"written": written, "weights": {}}
    for case in CASES:
        directory = pathlib.Path(out_dir, case)
        directory.mkdir(exist_ok=True)  # Keras' model.save does not create directories (ModelCheckpoint does)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
            model.compile(optimizer="adam", loss="mse")
        callbacks = []
        on_this_worker = case.endswith("_all") or chief
        if case.startswith("checkpoint") and on_this_worker:
            callbacks.append(keras.callbacks.ModelCheckpoint(str(directory / "model-{epoch}.keras")))
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        if case.startswith("save") and on_this_worker:
            model.save(str(directory / "model.keras"))
        if case.startswith("weights") and on_this_worker:
            model.save_weights(str(directory / "model.weights.h5"))
        out["weights"][case] = [w.tolist() for w in model.get_weights()]
    pathlib.Path(out_dir, f"worker{me}.json").write_text(json.dumps(out))


def test_keras_saving_on_every_worker_and_on_the_chief_only(tmp_path):
    import keras

    from distribute.launch import launch

    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    result = launch([str(HERE), str(tmp_path)], 2, 1, env=env, timeout_seconds=LAUNCH_TIMEOUT_SECONDS, echo=False)
    assert result.returncode == 0, result.output[-6000:]
    workers = [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in range(2)]
    files = {"checkpoint_all": ["model-1.keras", "model-2.keras"], "checkpoint_chief": ["model-1.keras", "model-2.keras"],
             "save_all": ["model.keras"], "save_chief": ["model.keras"],
             "weights_all": ["model.weights.h5"], "weights_chief": ["model.weights.h5"]}
    for case in CASES:
        assert sorted(os.listdir(tmp_path / case)) == files[case], case  # no workertemp_1 left behind
        final = workers[0]["weights"][case]
        for a, b in zip(final, workers[1]["weights"][case]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        path = tmp_path / case / files[case][-1]
        if case.startswith("weights"):
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
            model.load_weights(path)
        else:
            model = keras.saving.load_model(path)
        for got, want in zip(model.get_weights(), final):
            np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=0, atol=0)
    chief_paths, other_paths = workers[0]["written"], workers[1]["written"]
    assert all("workertemp" not in p for p in chief_paths) and len(chief_paths) == 2 + 2 + 1 + 1 + 1 + 1
    # The other worker wrote only where it was asked to, into its temporary directory (then deleted).
    assert other_paths == [str(tmp_path / case / "workertemp_1" / name) for case in ("checkpoint_all", "save_all", "weights_all")
                           for name in files[case]]


if __name__ == "__main__":
    _worker(sys.argv[1])
