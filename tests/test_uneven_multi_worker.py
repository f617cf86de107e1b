"""Uneven steps across workers: 2 workers (one device each) under ``distribute.launch``.

One launch of tests/uneven_workers_job.py: custom loops whose workers' pipelines
(``distribute_datasets_from_function``) hold different numbers of examples, as TF takes them: synchronized
steps, the last ones partial or empty on one worker (5 and 3 rows, batch 2: 2|2, 2|1, 1|0 rows per step; 6
and 4 rows: 3 and 2 batches, the last step empty on worker 1), equal to one process whose 2 replicas are fed
the same pipelines; and TF's custom_training tutorial (every section) with a global batch of 63 (32 | 31
rows on the 2 workers, the compiled uneven step across workers), equal to one device.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

import test_port_custom_training as tutorial
import uneven_workers_job as job
from helpers import mirrored

HERE = pathlib.Path(__file__).resolve()
LAUNCH_TIMEOUT_SECONDS = 600
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> list[dict]:
    from distribute.launch import launch

    out = tmp_path_factory.mktemp("uneven_mw")
    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    result = launch([str(HERE.parent / "uneven_workers_job.py"), str(out), "workers"], 2, 1, env=env,
                    timeout_seconds=LAUNCH_TIMEOUT_SECONDS, echo=False)
    assert result.returncode == 0, result.output[-6000:]
    return [json.loads((out / f"worker{w}.json").read_text()) for w in range(2)]


@pytest.mark.parametrize("case, rows", [
    ("rows", [[2, 2], [2, 1], [1, 0]] * 2),      # 5 and 3 rows
    ("batches", [[2, 2], [2, 2], [2, 0]] * 2),   # 3 and 2 batches
])
def test_workers_with_different_amounts_of_data_take_tf_steps_and_equal_one_process(workers, case, rows):
    one = job.custom_loop(mirrored(2), case, per_replica_input=True)
    assert one["rows"] == rows
    for w, got in enumerate(workers):
        assert [r[0] for r in got[case]["rows"]] == [r[w] for r in rows]  # each worker's replica: its pipeline's rows
        np.testing.assert_allclose(got[case]["losses"], one["losses"], rtol=1e-6)
        for a, e in zip(got[case]["weights"], one["weights"]):
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def test_custom_training_tutorial_on_two_workers_equals_one_device(workers, tmp_path_factory):
    one = tutorial.result(1, tmp_path_factory, global_batch=63)
    for got in workers:
        got = got["tutorial"]
        got["weights"] = [np.asarray(w, np.float32) for w in got["weights"]]
        tutorial._assert_equal_runs(got, one)
    assert workers[0]["tutorial"]["history"] == workers[1]["tutorial"]["history"]
