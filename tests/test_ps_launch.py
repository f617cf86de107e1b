"""The TF_CONFIG path of ParameterServerStrategy on one machine, through the launcher (`--num-ps`).

A subprocess test with its own timeout: `python -m distribute.launch --num-workers 2
--num-ps 1 ps_launch_job.py` gives the chief, the 2 workers and the ps their
TF_CONFIG; the chief starts the Ray head at its address, the ps and worker tasks
join it with `distribute.Server` and host their actors; all tasks exit when the
chief's program ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distribute.launch._ps as launch_module  # the ps host command is read there
from distribute.launch import build_ps_cluster, launch_parameter_server

pytestmark = pytest.mark.multiprocess

SRC = str(Path(launch_module.__file__).resolve().parents[2])
JOB = str(Path(__file__).with_name("ps_launch_job.py"))
CHILD_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
             "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def test_ps_cluster_has_tfs_jobs():
    cluster = build_ps_cluster(2, 1)
    assert list(cluster) == ["chief", "worker", "ps"]
    assert [len(cluster[j]) for j in cluster] == [1, 2, 1]
    addresses = [a for job in cluster.values() for a in job]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    with pytest.raises(ValueError, match="num_ps is 0; ParameterServerStrategy needs an integer >= 1"):
        launch_parameter_server(["job.py"], 2, 0)


def test_launcher_trains_with_two_workers_and_one_ps():
    proc = subprocess.run(
        [sys.executable, "-m", "distribute.launch", "--num-workers", "2", "--num-ps", "1", "--timeout-seconds", "400",
         JOB],
        capture_output=True, text=True, timeout=480, env={**os.environ, **CHILD_ENV},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "[launch] chief 0 exited with code 0; stopping the ps and worker tasks" in output
    # Every task ended (a Server returns at once when stopped; under heavy load the launcher may SIGKILL it).
    assert "[launch] exit codes: chief 0: 0, worker 0: " in output and "; exiting with 0" in output
    line = next(row for row in output.splitlines() if row.startswith("[chief 0] RESULT "))
    result = json.loads(line.removeprefix("[chief 0] RESULT "))
    # Each task's Ray node offers its own resource, and the actors were pinned to them.
    assert result["task_resources"] == ["distribute_chief", "distribute_ps_0", "distribute_worker_0",
                                        "distribute_worker_1"]
    assert (result["num_workers"], result["num_ps"]) == (2, 1)
    assert result["total"] == 10  # additive updates are exact under asynchrony
    assert result["iterations"] == 300  # every scheduled step applied exactly once
    assert result["devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"]
    assert result["last_loss"] < 1e-3 < result["first_loss"]
    np.testing.assert_allclose(result["kernel"], [1.0, -2.0, 0.5, 3.0], atol=0.02)
    np.testing.assert_allclose(result["bias"], [0.7], atol=0.02)
    for task in ("worker 0", "worker 1", "ps 0"):
        assert f"[{task}] distribute.Server: {task} joined the Ray head" in output
    # Every Ray node joined on loopback, and listens there only (loopback.py; ps and worker nodes included).
    assert {"gcs_server", "raylet", "ray::ParameterServer", "ray::Worker"} <= set(result["listening"]), result["listening"]
    assert result["off_loopback"] == []


def test_server_and_head_refuse_bad_setups_with_the_fix(monkeypatch):
    import distribute
    from distribute.parameter_server import nodes

    spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    with pytest.raises(ValueError, match="runs a Server on its 'ps' and 'worker' tasks only"):
        distribute.Server(spec, job_name="chief", task_index=0, start=False)
    with pytest.raises(ValueError, match="task_index=1 is not a task of job 'ps'"):
        distribute.Server(spec, job_name="ps", task_index=1, start=False)
    with pytest.raises(ValueError, match="has no 'chief' job; its address is the Ray head's"):
        distribute.Server({"worker": ["h:2"], "ps": ["h:3"]}, job_name="ps", task_index=0, start=False)
    server = distribute.Server(spec, job_name="worker", task_index=0, protocol="grpc", start=False)
    assert (server.target, server.protocol) == ("127.0.0.1:1", "grpc")
    assert nodes.node_resource("ps", 0) == "distribute_ps_0"
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ValueError, match="RAY_AUTH_MODE is unset. Set it in the environment of every task"):
        nodes.start_or_join_head("127.0.0.1:1")
    with pytest.raises(ValueError, match="is not 'host:port'"):
        nodes.start_or_join_head("nohost")


def test_strategy_reads_tf_config_only_when_it_has_ps(monkeypatch):
    from distribute.parameter_server import cluster

    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cluster.tf_config_resolver() is None  # embedded cluster
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 0}}))
    assert cluster.tf_config_resolver() is None  # a MultiWorkerMirroredStrategy cluster
    tf_config = {"cluster": {"chief": ["127.0.0.1:5"], "worker": ["h:1", "h:2"], "ps": ["h:3"]},
                 "task": {"type": "chief", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    resolver = cluster.tf_config_resolver()
    assert resolver.task_type == "chief"
    assert cluster._chief_address(resolver) == "127.0.0.1:5"  # the Ray head's address
    tf_config["task"] = {"type": "worker", "index": 1}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    assert cluster._chief_address(cluster.tf_config_resolver()) is None  # only the chief starts the head


def _fake_host(tmp_path, monkeypatch, body):
    """Stands in for the ps/worker Server (no Ray): the launcher's supervision alone."""
    host = tmp_path / "host.py"
    host.write_text(body)
    monkeypatch.setattr(launch_module, "PS_HOST_COMMAND", (str(host),))


def test_a_dying_ps_task_is_named_and_stops_the_job(tmp_path, monkeypatch):
    _fake_host(tmp_path, monkeypatch, "import json, os, sys, time\n"
               "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
               "time.sleep(0.5 if task['type'] == 'ps' else 60)\n"
               "sys.exit(3)\n")
    chief = tmp_path / "chief.py"
    chief.write_text("import time\ntime.sleep(60)\n")
    result = launch_parameter_server([str(chief)], 2, 1, env=CHILD_ENV, timeout_seconds=30, grace_seconds=2,
                                     echo=False)
    assert result.failed_task == "ps 0" and result.returncode == 3 and not result.timed_out
    assert "[launch] ps 0 exited with code 3 while the chief was running; stopping every task" in result.output
    assert result.exit_codes["ps 0"] == 3 and result.exit_codes["chief 0"] < 0


def test_every_task_ends_when_the_chief_ends_with_its_status(tmp_path, monkeypatch):
    _fake_host(tmp_path, monkeypatch, "import time\ntime.sleep(60)\n")
    chief = tmp_path / "chief.py"
    chief.write_text("import json, os, sys\nprint(sorted(json.loads(os.environ['TF_CONFIG'])['cluster']), "
                     "os.environ['RAY_AUTH_MODE'])\nsys.exit(5)\n")
    result = launch_parameter_server([str(chief)], 2, 1, env=CHILD_ENV, timeout_seconds=30, grace_seconds=2,
                                     echo=False)
    assert result.returncode == 5 and result.failed_task == "chief 0"
    assert [t.name for t in result.tasks] == ["chief 0", "worker 0", "worker 1", "ps 0"]
    assert "[chief 0] ['chief', 'ps', 'worker'] token" in result.output  # every task's Ray uses tokens
    assert "[launch] chief 0 exited with code 5; stopping the ps and worker tasks" in result.output
    assert all(t.exit_code != 0 for t in result.tasks[1:])  # stopped by the launcher (SIGTERM)
