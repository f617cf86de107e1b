"""PreemptionCheckpointHandler and TerminationConfig: TF's failure_handler_test.py values, ported.

TF's test trains EPOCHS_TO_RUN=8 epochs of STEPS_PER_EPOCH=15 runs; every
replica adds 1 to a SUM variable per run, so it ends at num_replicas x 8 x 15;
after a SIGTERM and a relaunch the checkpoint directory holds ``ckpt-1`` (with a
grace period: ``ckpt-2``, two checkpoints).  Here the job also trains a small
model, whose final weights must equal an uninterrupted run's exactly.

In-process tests send SIGTERM to this process and give ``exit_fn`` a function
that raises, so the handler's choices are observed without a new process; the
subprocess tests run the real exit (status 42) and relaunch, on one worker (2
replicas) and on 2 workers through ``python -m distribute.launch``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np
import preemption_job as job
import pytest
from helpers import mirrored

import distribute
from distribute.experimental import PreemptionCheckpointHandler, TerminationConfig

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
NUM_RUNS = job.EPOCHS_TO_RUN * job.STEPS_PER_EPOCH  # 120
PROCESS_TIMEOUT_SECONDS = 120


class Exited(Exception):
    """Raised by the tests' exit_fn instead of leaving the process."""


def raise_exited() -> None:
    raise Exited()


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: MirroredStrategy over 2 replicas."""
    return job.train(mirrored(2), str(tmp_path_factory.mktemp("reference")))


def sigterm_at(run: int, seen: dict):
    def on_run(handler):
        seen["handler"] = handler
        if handler.total_run_calls == run:
            os.kill(os.getpid(), signal.SIGTERM)

    return on_run


def assert_same_result(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=key)


def saved_runs(directory: Path) -> dict[str, int]:
    """{checkpoint name: its checkpointed_runs}, read with the user's own orbax code."""
    import orbax.checkpoint as ocp

    out = {}
    for child in sorted(directory.iterdir()):
        tree = ocp.StandardCheckpointer().restore(child)
        out[child.name] = int(np.asarray(tree["checkpointed_runs"][0]))
    return out


# -- one process, in-process signals --------------------------------------------------------------


def test_reference_counter_is_tfs(reference):
    assert float(reference["v"]) == 2 * job.EPOCHS_TO_RUN * job.STEPS_PER_EPOCH == 240.0
    assert int(reference["total_run_calls"]) == NUM_RUNS


def test_sigterm_saves_after_the_next_run_and_the_resumed_run_ends_as_uninterrupted(tmp_path, reference):
    seen: dict = {}
    config = TerminationConfig(exit_fn=raise_exited)
    with pytest.raises(Exited):
        job.train(mirrored(2), str(tmp_path), config, on_run=sigterm_at(10, seen))
    # Notice after run 10: the next run (11) still runs, the checkpoint is saved at its end.
    assert seen["handler"].total_run_calls == 11
    assert saved_runs(tmp_path) == {"ckpt-1": 11}  # TF's test: checkpoint index 1
    resumed_at = {}
    result = job.train(mirrored(2), str(tmp_path), config,
                       on_run=lambda h: resumed_at.setdefault("first", h.total_run_calls))
    assert resumed_at["first"] == 12  # total_run_calls continued from the saved 11
    assert_same_result(result, reference)


def test_default_exit_is_sys_exit_42(tmp_path):
    seen: dict = {}
    with pytest.raises(SystemExit) as exited:
        job.train(mirrored(2), str(tmp_path), on_run=sigterm_at(3, seen))
    from distribute.checkpoint.preemption import EXIT_CODE_PREEMPTED

    assert exited.value.code == 42 == EXIT_CODE_PREEMPTED
    assert saved_runs(tmp_path) == {"ckpt-1": 4}


def test_grace_period_saves_twice_and_trains_on_until_it_ends(tmp_path, reference):
    """TF's test_grace_period_continue_training: two checkpoints (the manager keeps ckpt-2)."""
    seen: dict = {}
    config = TerminationConfig(exit_fn=raise_exited, grace_period=1.5)
    started = time.monotonic()
    with pytest.raises(Exited):
        job.train(mirrored(2), str(tmp_path), config, sleep_seconds=0.01, on_run=sigterm_at(5, seen))
    final_run = seen["handler"].total_run_calls
    assert saved_runs(tmp_path) == {"ckpt-2": final_run}
    # Trained on during the grace period, after the first save at run 6 (how many runs fit in the
    # grace period depends on the machine's speed: at least one).
    assert 6 < final_run < NUM_RUNS
    assert time.monotonic() - started < 30
    result = job.train(mirrored(2), str(tmp_path), config)
    assert_same_result(result, reference)


def test_termination_watcher_fn_is_the_notice(tmp_path, reference):
    notice = threading.Event()
    seen: dict = {}

    def on_run(handler):
        seen["handler"] = handler
        if handler.total_run_calls == 4:
            notice.set()

    config = TerminationConfig(termination_watcher_fn=notice.is_set, exit_fn=raise_exited)
    with pytest.raises(Exited):
        job.train(mirrored(2), str(tmp_path), config, sleep_seconds=0.02, on_run=on_run)
    saved = saved_runs(tmp_path)["ckpt-1"]
    assert 4 < saved < NUM_RUNS and seen["handler"].total_run_calls == saved
    assert signal.getsignal(signal.SIGTERM) is not seen["handler"]._sigterm_handler_fn  # SIGTERM left alone
    resumed = job.train(mirrored(2), str(tmp_path), TerminationConfig(exit_fn=raise_exited))
    assert_same_result(resumed, reference)


def small_model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
    return model


def test_save_checkpoint_if_preempted_with_a_manager_and_checkpoint_number(tmp_path):
    """TF's test with _save_checkpoint_if_preempted(checkpoint_number=total_run_calls): the index is the run count."""
    strategy = mirrored(2)
    model = small_model(strategy)
    checkpoint = distribute.Checkpoint(model=model)
    manager = distribute.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=1)
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, manager,
                                          termination_config=TerminationConfig(exit_fn=raise_exited))
    assert handler.total_run_calls == 0
    with pytest.raises(Exited):
        for run in range(20):
            handler.save_checkpoint_if_preempted(checkpoint_number=handler.total_run_calls)
            model.layers[0].kernel.assign(np.full((2, 1), run + 1.0, np.float32))
            if run == 6:
                os.kill(os.getpid(), signal.SIGTERM)
    assert handler.total_run_calls == 8
    assert manager.checkpoints == [str(tmp_path / "ckpt-8")]
    again = small_model(strategy)
    manager2 = distribute.CheckpointManager(distribute.Checkpoint(model=again), str(tmp_path), max_to_keep=1)
    handler2 = PreemptionCheckpointHandler(None, manager2, termination_config=TerminationConfig(exit_fn=raise_exited))
    assert handler2.total_run_calls == 8
    np.testing.assert_array_equal(np.asarray(again.layers[0].kernel), np.full((2, 1), 8.0, np.float32))


def test_save_fn_replaces_the_managers_save(tmp_path):
    strategy = mirrored(2)
    checkpoint = distribute.Checkpoint(model=small_model(strategy))
    calls = []

    def save_fn(*args, **kwargs):
        calls.append((args, kwargs))
        checkpoint.write(str(tmp_path / "mine"))

    handler = PreemptionCheckpointHandler(None, checkpoint, str(tmp_path / "dir"),
                                          TerminationConfig(exit_fn=raise_exited, save_fn=save_fn))
    handler.run(lambda: None)
    os.kill(os.getpid(), signal.SIGTERM)
    handler.run(lambda: None)
    with pytest.raises(Exited):
        handler.save_checkpoint_if_preempted("a", key=1)
    assert calls == [(("a",), {"key": 1})]
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "dir").exists()


def test_exit_fn_that_returns_lets_training_go_on(tmp_path):
    strategy = mirrored(2)
    handler = PreemptionCheckpointHandler(None, distribute.Checkpoint(model=small_model(strategy)), str(tmp_path),
                                          TerminationConfig(exit_fn=lambda: None))
    results = [handler.run(lambda i: i * 2, i) for i in range(3)]
    os.kill(os.getpid(), signal.SIGTERM)
    results += [handler.run(lambda i: i * 2, i) for i in range(3, 6)]
    assert results == [0, 2, 4, 6, 8, 10]  # run returns the function's result
    assert handler.total_run_calls == 6
    assert saved_runs(tmp_path) == {"ckpt-1": 4}
    with handler.watch_preemption_scope():
        assert handler.run(lambda: "inside") == "inside"


def test_checkpoint_tracks_assigned_attributes_as_tf(tmp_path):
    strategy = mirrored(2)
    checkpoint = distribute.Checkpoint(model=small_model(strategy))
    checkpoint.epoch = keras.Variable(3, dtype="int64", name="epoch")
    path = checkpoint.save(str(tmp_path / "c"))
    checkpoint.epoch.assign(0)
    checkpoint.restore(path)
    assert int(checkpoint.epoch.numpy()) == 3
    with pytest.raises(ValueError, match="holds no Keras variables"):
        checkpoint.not_a_variable = 5


def test_bad_arguments_are_named():
    strategy = mirrored(2)
    checkpoint = distribute.Checkpoint(model=small_model(strategy))
    with pytest.raises(ValueError, match="a checkpoint_dir must be passed as well"):
        PreemptionCheckpointHandler(None, checkpoint)
    with pytest.raises(TypeError, match="must be a distribute.Checkpoint or distribute.CheckpointManager"):
        PreemptionCheckpointHandler(None, object(), "d")
    with pytest.raises(TypeError, match="termination_config must be"):
        PreemptionCheckpointHandler(None, checkpoint, "d", termination_config={"grace_period": 1})
    with pytest.raises(ValueError, match=r"grace_period=-1\): it must be >= 0"):
        TerminationConfig(grace_period=-1)
    with pytest.raises(TypeError, match="exit_fn=42"):
        TerminationConfig(exit_fn=42)
    ps = distribute.cluster_resolver.SimpleClusterResolver(
        distribute.cluster_resolver.ClusterSpec({"worker": ["a:1"], "ps": ["b:2"]}), task_type="worker", task_id=0)
    with pytest.raises(NotImplementedError, match="ParameterServerStrategy"):
        PreemptionCheckpointHandler(ps, checkpoint, "d")
    two = distribute.cluster_resolver.SimpleClusterResolver(
        distribute.cluster_resolver.ClusterSpec({"worker": ["a:1", "b:2"]}), task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="names 2 worker"):
        PreemptionCheckpointHandler(two, checkpoint, "d")


def test_created_outside_the_main_thread_needs_a_watcher_fn(tmp_path):
    checkpoint = distribute.Checkpoint(model=small_model(mirrored(2)))
    errors = []

    def create():
        try:
            PreemptionCheckpointHandler(None, checkpoint, str(tmp_path))
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=create)
    thread.start()
    thread.join(30)
    assert errors and "termination_watcher_fn" in errors[0]


# -- real processes ------------------------------------------------------------------------------


def _env() -> dict:
    return {**os.environ, "KERAS_BACKEND": "jax", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")])}


class Process:
    """A subprocess whose output lines are collected by a thread, waited on with timeouts."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = PROCESS_TIMEOUT_SECONDS) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text, re.MULTILINE)
            if found:
                return found
            assert self.proc.poll() is None, f"ended with {self.proc.returncode} before {pattern!r}:\n{self.text[-4000:]}"
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text[-4000:]}")

    def wait(self, timeout: float = PROCESS_TIMEOUT_SECONDS) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return code


@pytest.mark.multiprocess
def test_single_worker_process_sigterm_exit_42_and_relaunch(tmp_path, reference):
    command = [sys.executable, str(HERE / "preemption_job.py"), str(tmp_path / "ckpt"), str(tmp_path / "out.npz")]
    env = {**_env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    first = Process([*command, "--sleep", "0.02"], env)
    first.wait_for(r"^run 10$")
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait() == 42, first.text[-4000:]
    saved = saved_runs(tmp_path / "ckpt")["ckpt-1"]
    assert 10 < saved < NUM_RUNS and f"run {saved}\n" in first.text and f"run {saved + 1}\n" not in first.text
    second = Process(command, env)
    assert second.wait() == 0, second.text[-4000:]
    assert re.search(rf"^run {saved + 1}$", second.text, re.MULTILINE) and "run 1\n" not in second.text
    assert_same_result(dict(np.load(tmp_path / "out.npz")), reference)


@pytest.mark.multiprocess
def test_two_workers_sigterm_to_one_worker_through_the_launcher(tmp_path, reference):
    """SIGTERM to worker 1 only: both workers save at the same run and exit 42; relaunched, the result is exact."""
    launcher = [sys.executable, "-m", "distribute.launch", "--num-workers", "2", "--devices-per-worker", "1",
                "--grace-seconds", "30", "--timeout-seconds", str(PROCESS_TIMEOUT_SECONDS)]
    program = [str(HERE / "preemption_job.py"), str(tmp_path / "ckpt"), str(tmp_path / "out.npz"), "--strategy", "multi_worker"]
    first = Process([*launcher, *program, "--sleep", "0.02"], _env())
    pid = int(first.wait_for(r"^\[worker 1\] pid (\d+)").group(1))
    first.wait_for(r"^\[worker 1\] run 10$")
    os.kill(pid, signal.SIGTERM)
    assert first.wait() == 42, first.text[-4000:]
    assert "exit codes: worker 0: 42, worker 1: 42; exiting with 42" in first.text, first.text[-4000:]
    saved = saved_runs(tmp_path / "ckpt")["ckpt-1"]
    for worker in (0, 1):
        assert f"[worker {worker}] run {saved}\n" in first.text and f"[worker {worker}] run {saved + 1}\n" not in first.text
    assert "lost" not in first.text and "Terminating process" not in first.text
    second = Process([*launcher, *program], _env())
    assert second.wait() == 0, second.text[-4000:]
    assert f"[worker 1] run {saved + 1}\n" in second.text and "[worker 0] run 1\n" not in second.text
    assert_same_result(dict(np.load(tmp_path / "out.npz")), reference)


def test_readme_preemption_example_runs_and_resumes(tmp_path):
    """The preemption loop of docs/guides/fault_tolerance.md, as written there (tests/test_docs.py names this test)."""
    page = (HERE.parent / "docs" / "guides" / "fault_tolerance.md").read_text()
    section = page[page.index("## Preemption"):]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    x = np.arange(48, dtype=np.float32).reshape(12, 4) / 48
    prelude = {
        "distribute": distribute, "keras": keras, "EPOCHS": 2, "STEPS_PER_EPOCH": 3, "checkpoint_dir": str(tmp_path),
        "make_model": lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
        "dataset": distribute.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(2),
    }

    def distributed_train_step(inputs):
        ns = namespace

        def step_fn(features, labels):
            def loss_fn():
                return distribute.compute_average_loss(keras.ops.square(ns["model"](features) - labels)[:, 0])

            loss, grads = distribute.compute_gradients(loss_fn, ns["model"].trainable_variables)
            ns["optimizer"].apply_gradients(zip(grads, ns["model"].trainable_variables))
            return loss

        if ns.get("stop_at") == ns["handler"].total_run_calls:
            os.kill(os.getpid(), signal.SIGTERM)
        return ns["strategy"].reduce("SUM", ns["strategy"].run(step_fn, args=inputs), axis=None)

    namespace = {**prelude, "distributed_train_step": distributed_train_step, "stop_at": 2}
    with pytest.raises(SystemExit) as exited:
        exec(compile(code, "fault_tolerance.md", "exec"), namespace)  # noqa: S102 - the page's own example
    assert exited.value.code == 42 and namespace["handler"].total_run_calls == 4
    namespace = {**prelude, "distributed_train_step": distributed_train_step}
    exec(compile(code, "fault_tolerance.md", "exec"), namespace)  # noqa: S102
    assert namespace["handler"].total_run_calls == 6 and float(namespace["loss"]) >= 0
