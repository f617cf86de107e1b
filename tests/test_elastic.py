"""Elastic launches (``--num-workers MIN:MAX``): a job that shrinks 3 -> 2 and grows 2 -> 3 ends as if it had not.

Each scenario is one launch of tests/elastic_job.py (see there): worker 1 is
SIGKILLed mid-epoch at 3 workers after the hosts command was made to list 2
slots and the backup directory was removed (no disk read can help); the job
goes on at 2 workers from the step the survivors committed in memory, then
grows back to 3 when the hosts command lists 3 again.  Expected values: an
uninterrupted run in this process on a 3-replica MirroredStrategy with the same
global batch (what 3 workers x 1 device compute; rtol 1e-5).
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import elastic_job  # noqa: E402

LAUNCH_TIMEOUT_SECONDS = 240


def _reference(mode: str, tmp_path) -> tuple[list[np.ndarray], list[float]]:
    from helpers import mirrored

    train = elastic_job.train_loop if mode == "loop" else elastic_job.train_fit
    return train(mirrored(3), str(tmp_path / "reference_backup"))


def _launch(mode: str, tmp_path) -> tuple[int, str, tuple[list[np.ndarray], list[float]]]:
    """Runs the elastic launch; computes the uninterrupted reference in this process meanwhile (it mostly waits)."""
    import subprocess

    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:3\n")
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    backup = tmp_path / "backup"
    env = {**os.environ, "KERAS_BACKEND": "jax",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "distribute.launch", "--num-workers", "2:3", "--max-restarts", "1",
               "--hosts-command", str(script), "--devices-per-worker", "1", "--timeout-seconds",
               str(LAUNCH_TIMEOUT_SECONDS), str(HERE.parent / "elastic_job.py"), mode, str(hosts), str(backup),
               str(tmp_path)]
    log = tmp_path / "launch.log"  # a file, not a pipe: the launch never waits for this process to read
    with open(log, "w") as out, subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT) as launch:
        try:
            reference = _reference(mode, tmp_path)
            launch.wait(timeout=LAUNCH_TIMEOUT_SECONDS + 30)
        finally:
            if launch.poll() is None:
                launch.kill()
    return launch.returncode, log.read_text(), reference


def _check(mode: str, tmp_path) -> None:
    returncode, output, (weights, losses) = _launch(mode, tmp_path)
    tail = output[-8000:]
    assert returncode == 0, tail
    # Generations: 3 workers, then 2 after the kill (a restart), then 3 again (a regroup, not a restart).
    sizes = [int(n) for n in re.findall(r"\[launch\] generation \d+: (\d+) worker", output)]
    assert sizes == [3, 2, 3], tail
    assert "gen 0 worker 1 kills itself after step %d" % elastic_job.KILL_STEP in output, tail
    assert "was killed by SIGKILL; restart 1 of 1" in output, tail
    assert "slots available (generation 1 has 2): asking the workers to stop" in output, tail
    # Each generation starts where the previous one's committed state stopped: at most one step redone, none lost.
    starts = {int(g): int(s) for g, s in re.findall(r"gen (\d) worker 0 starts at step (\d+)", output)}
    applied: dict[int, set[int]] = {}
    for g, s in re.findall(r"gen (\d) worker \d applied step (\d+)", output):
        applied.setdefault(int(g), set()).add(int(s))
    assert starts[0] == 0 and starts[1] >= elastic_job.KILL_STEP - 1 and starts[2] == elastic_job.GROW_STEP, (starts, tail)
    for g in (1, 2):
        # Reported but not kept: the step a peer died in; under fit also the one after it (Keras calls
        # on_train_batch_end once a step is dispatched, and JAX runs a step ahead of the host's last commit).
        redone = [s for s in applied[g - 1] if s > starts[g]]
        assert len(redone) <= (1 if mode == "loop" else 2), (g, redone, starts)
        # Restored from a step the previous generation completed and reported (a commit is made before the
        # next step, after the program's own code for the last one).
        assert starts[g] <= max(applied[g - 1]), (g, starts)
    assert starts[1] % elastic_job.STEPS_PER_EPOCH != 0  # mid-epoch: the disk backup (epoch ends) was not the source
    assert "restored step %d from the agent's memory" % starts[1] in output, tail
    assert max(applied[2]) == elastic_job.EPOCHS * elastic_job.STEPS_PER_EPOCH
    # The result: the uninterrupted 3-replica run's weights and per-epoch losses.
    with np.load(tmp_path / "weights.npz") as got:
        for i, want in enumerate(weights):
            np.testing.assert_allclose(got[f"arr_{i}"], want, rtol=1e-5, atol=1e-6)
    logged = {int(e): float(v) for e, v in re.findall(r"gen \d worker 0 epoch (\d) loss (\S+)", output)}
    assert len(re.findall(r"gen \d worker 0 epoch \d loss", output)) == elastic_job.EPOCHS, tail  # each epoch once
    assert sorted(logged) == list(range(elastic_job.EPOCHS)), tail
    np.testing.assert_allclose([logged[e] for e in range(elastic_job.EPOCHS)], losses, rtol=1e-5)


@pytest.mark.multiprocess
def test_custom_loop_shrinks_and_grows_without_disk(tmp_path):
    _check("loop", tmp_path)


@pytest.mark.multiprocess
def test_keras_fit_shrinks_and_grows_without_disk(tmp_path):
    _check("fit", tmp_path)


def test_bad_flags_are_clear_errors(capsys):
    from distribute.launch import main

    cases = [
        (["--num-workers", "3:2", "x.py"], "MIN 3 is above MAX 2"),
        (["--num-workers", "0:2", "x.py"], "1 <= MIN <= MAX"),
        (["--num-workers", "2:", "x.py"], "give N"),
        (["--num-workers", "two", "x.py"], "give N"),
        (["--num-workers", "2", "--max-restarts", "1", "x.py"], "need an elastic launch"),
        (["--num-workers", "2", "--hosts-command", "cat h", "x.py"], "need an elastic launch"),
        (["--num-workers", "2:3", "--max-restarts", "-1", "x.py"], "--max-restarts is -1"),
        (["--num-workers", "2:3", "--num-ps", "1", "x.py"], "cannot be combined with --num-ps"),
        (["--num-workers", "2:3", "--hosts-command", " ", "x.py"], "--hosts-command is empty"),
        (["--num-workers", "2:3", "--hosts-command", "echo otherhost:2", "x.py"], "this machine only"),
        (["--num-workers", "2:3", "--hosts-command", "echo localhost:two", "x.py"], "HOST:SLOTS"),
        (["--num-workers", "2:3", "--hosts-command", "exit 3", "x.py"], "exited with status 3"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    # Below MIN: the launcher waits, then names what it waited for.
    import distribute.launch._elastic as elastic

    config = elastic.ElasticConfig(2, 3, hosts_command="echo localhost", wait_seconds=0.1)
    with pytest.raises(TimeoutError, match=r"waited 0.1 s for 2 worker slots \(--num-workers 2:3\); "
                                           r"--hosts-command 'echo localhost' lists 1"):
        elastic.launch_elastic(["x.py"], config, echo=False)
