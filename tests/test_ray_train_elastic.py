"""Elastic Ray Train: a JaxTrainer of 2 to 3 workers shrinks after a SIGKILL and grows back, from memory.

``ScalingConfig(num_workers=(2, 3))`` with ``distribute.experimental.RayTrainElasticState``
in the run's callbacks, Keras ``fit`` with ``distribute.BackupAndRestore``, the
model and data of tests/elastic_job.py.  Ray Train's ElasticScalingPolicy sizes
each worker group from the resources Ray's AutoscalingCoordinator reserves to
the run; the test changes them the way another tenant of the cluster would: it
registers its own request (higher in the coordinator's order: same priority,
earlier) for CPU bundles, so the run is left room for 3, 1 or 2 workers.

1. The group of 3 trains; after step KILL_STEP (mid-epoch) world rank 1 removes
   the backup directory (no disk read can help) and waits; the test leaves room
   for 1 worker (below MIN: Ray Train neither resizes the healthy group nor, after
   the kill, starts a group from an answer older than the kill), SIGKILLs it,
   then leaves room for 2.
2. Ray Train stops the group; the survivors hand their commit to the run's store
   (``before_worker_shutdown``); a group of 2 restores it and trains on.
3. At the end of epoch GROW_STEP // STEPS_PER_EPOCH (after the commit of step
   GROW_STEP) the group of 2 waits; the test gives the room back; Ray Train resizes
   to 3: the workers hand off as they stop, and a group of 3 restores step
   GROW_STEP and finishes.

Expected values: the uninterrupted 3-replica run in this process (what 3
workers x 1 device compute on the same global batch; rtol 1e-5).
The workers import this file (``train_loop``).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import sys
import threading
import time

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import elastic_job  # noqa: E402

STEPS, KILL_STEP, GROW_STEP = elastic_job.STEPS_PER_EPOCH, elastic_job.KILL_STEP, elastic_job.GROW_STEP
CPU_PER_WORKER = 0.25  # Ray does not enforce it; small, so that 3 fit beside whatever else the suite runs
WAIT_SECONDS = 120  # a worker waiting for the test (the kill) or for Ray Train (the resize) gives up after this
FIT_TIMEOUT_SECONDS = 300
TENANT = "distribute-test-tenant"


# -- the Ray Train workers --------------------------------------------------------------------------------------
def train_loop(config: dict) -> None:
    import ray.train

    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    generation = int(os.environ["DISTRIBUTE_ELASTIC_GENERATION"])  # set by RayTrainElasticState
    out = pathlib.Path(config["out"])

    def say(event: str, **fields) -> None:
        with open(out / f"events-{os.getpid()}.txt", "a") as f:
            f.write(json.dumps({"event": event, "generation": generation, "rank": rank, "size": size,
                                "time": time.time(), **fields}) + "\n")

    say("enter")
    import distribute
    from distribute.multi_worker import CommunicationOptions

    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=20))
    say("joined")
    import keras

    def wait_for(what: str, done=lambda: False) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} of generation {generation} waited {WAIT_SECONDS} s for {what}")
            time.sleep(0.05)

    model = elastic_job.build(strategy)
    x, y = elastic_job.data()
    backup = distribute.BackupAndRestore(config["backup"])

    class Events(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = backup.resumed_step or 0  # set only when restored from the store's memory
            say("start", step=self.start, from_memory=backup.resumed_step is not None)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):  # after BackupAndRestore committed the steps before
            if size == 2 and self.epoch * STEPS + batch == GROW_STEP:
                if rank == 0:
                    (out / "grow").write_text(str(generation))
                say("waits", step=GROW_STEP)
                wait_for("Ray Train to resize the group")  # it stops this process

        def on_train_batch_end(self, batch, logs=None):
            step = self.epoch * STEPS + batch + 1
            if step <= self.start:
                return  # an earlier group applied it; fit only reads past its batch
            say("applied", step=step)
            if size == 3 and rank == 1 and step == KILL_STEP and not (out / "kill").exists():
                shutil.rmtree(config["backup"], ignore_errors=True)
                (out / "kill").write_text(str(os.getpid()))
                wait_for("the test's SIGKILL")

        def on_epoch_end(self, epoch, logs=None):
            if rank == 0:
                say("epoch", epoch=epoch, loss=float(logs["loss"]))

    model.fit(x, y, batch_size=elastic_job.GLOBAL_BATCH, epochs=elastic_job.EPOCHS, shuffle=False, verbose=0,
              callbacks=[backup, Events()])
    if rank == 0:
        np.savez(out / "weights.npz", *[np.asarray(w) for w in model.get_weights()])


# -- the callback's worker side, in this process ---------------------------------------------------------------------
class _Computing:
    """A device value whose step never completes (its collective waits for a lost worker)."""

    def is_ready(self):
        return False

    def __array__(self, dtype=None, copy=None):
        time.sleep(10)  # reading it blocks (a real one: until Ray kills the process)
        raise RuntimeError("the step's collective failed")


def test_a_stopping_worker_hands_over_its_newest_complete_commit(monkeypatch):
    import http.client
    import pickle

    import distribute
    import distribute.runtime.elastic as elastic
    from distribute.runtime.elastic_store import StateStore

    store = StateStore()
    try:
        state = distribute.experimental.RayTrainElasticState(hand_off_wait_seconds=0.2)
        state._store = object()  # the controller's actor handle: not sent to the workers
        state.address, state.generation = store.address, 1  # as the controller sets them
        state = pickle.loads(pickle.dumps(state))
        assert state._store is None
        for name in (elastic.AGENT_ENV, elastic.GENERATION_ENV, elastic.SCHEDULER_ENV):
            monkeypatch.setenv(name, "")  # restored after the test
        state.after_init_train_context()  # in each worker, before the training function
        assert (elastic.agent_address(), elastic.generation(), elastic.scheduler()) == (store.address, 1, "ray-train")
        elastic.ready()  # under Ray Train: no signal handler (the training runs in a thread), nothing sent
        assert store.ready == set()

        monkeypatch.setattr(elastic._Commit, "states", [])
        monkeypatch.setattr(elastic._Commit, "handed_off", False)
        elastic.commit({"step": 3}, [np.arange(4.0)])
        elastic.commit({"step": 4}, [_Computing()])
        begin = time.monotonic()
        state.before_worker_shutdown()  # Ray Train's controller stops the group; it kills the worker 5 s later
        assert time.monotonic() - begin < 2  # the step in flight was passed over after 0.2 s, not read
        assert store.step() == 3
        meta, arrays = elastic.fetch()
        assert (meta["step"], meta["generation"]) == (3, 1)
        np.testing.assert_array_equal(arrays[0], np.arange(4.0))

        # The launcher's lost-peer hand-off (before exit 75) passes over a step blocked in a collective the same way.
        monkeypatch.setattr(elastic._Commit, "handed_off", False)
        monkeypatch.setattr(elastic, "LOST_PEER_WAIT_SECONDS", 0.2)
        elastic.commit({"step": 5}, [np.arange(4.0) + 1])
        elastic.commit({"step": 6}, [_Computing()])
        begin = time.monotonic()
        elastic._hand_off_for_lost_peer()
        assert time.monotonic() - begin < 2 and store.step() == 5

        # A sender killed mid-message leaves the last whole state in place.
        host, port = store.address.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        connection.putrequest("PUT", "/state")
        connection.putheader("Content-Length", "1000")
        connection.endheaders()
        connection.send(b"".join(bytes(p) for p in elastic.encode({"step": 9}, [np.zeros(2)])))
        connection.sock.shutdown(1)  # no more bytes: the 1000 announced never all arrive
        assert connection.getresponse().status == 400
        connection.close()
        assert store.step() == 5
    finally:
        store.close()

    with pytest.raises(ValueError, match=r"hand_off_wait_seconds=5: give 0 to 4 s; Ray Train kills a stopping worker 5 s"):
        distribute.experimental.RayTrainElasticState(hand_off_wait_seconds=5)


# -- the test -----------------------------------------------------------------------------------------------------
class _Tenant:
    """Another requester of the cluster's AutoscalingCoordinator (Ray Data's and Ray Train's shared reservations)."""

    def __init__(self):
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        import ray

        self._ray = ray
        self._coordinator = get_or_create_autoscaling_coordinator()
        self.total = sum(n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"])
        self.leave(3)  # registered before the run's own request: reserved first

    def leave(self, workers: int) -> None:
        """Holds every CPU bundle but those of ``workers`` workers."""
        from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import ResourceRequestPriority

        held = int((self.total - workers * CPU_PER_WORKER) // CPU_PER_WORKER)
        self._ray.get(self._coordinator.request_resources.remote(
            requester_id=TENANT, resources=[{"CPU": CPU_PER_WORKER}] * held, expire_after_s=600,
            priority=ResourceRequestPriority.HIGH))

    def close(self) -> None:
        self._ray.get(self._coordinator.cancel_request.remote(requester_id=TENANT))


def _events(out: pathlib.Path) -> list[dict]:
    events = [json.loads(line) for path in out.glob("events-*.txt") for line in path.read_text().splitlines()]
    return sorted(events, key=lambda e: e["time"])


def _wait_for_file(path: pathlib.Path, fit: threading.Thread, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert fit.is_alive() and time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)
    time.sleep(0.05)  # written whole by now
    return path.read_text()


@pytest.mark.multiprocess
@pytest.mark.xdist_group("ray")
def test_jax_trainer_shrinks_after_a_sigkill_and_grows_back_from_memory(ray_instance, tmp_path, monkeypatch):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    import distribute
    from helpers import mirrored

    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    tenant = _Tenant()
    assert tenant.total >= 3 * CPU_PER_WORKER, f"the suite's Ray has {tenant.total} CPUs; 3 workers need {3 * CPU_PER_WORKER}"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # the driver's value reaches the controller
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # node drains: not tested; one process less per group
    path = os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parent)])
    env = {"PYTHONPATH": path, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),  # each group compiles its size once
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    trainer = JaxTrainer(
        train_loop, train_loop_config={"out": str(out), "backup": str(backup)},
        scaling_config=ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": CPU_PER_WORKER},
                                     elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name="distribute-elastic-test", storage_path=str(tmp_path / "ray_results"),
                             failure_config=FailureConfig(max_failures=1), worker_runtime_env={"env_vars": env},
                             callbacks=[distribute.experimental.RayTrainElasticState()]))
    def stores():
        return [a for a in ray_instance.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("distribute-elastic-")]

    result: dict = {}
    begin = time.time()
    fit = threading.Thread(target=lambda: result.update(value=trainer.fit()), daemon=True)
    fit.start()
    timings = {}
    try:
        # The uninterrupted 3-replica run, while Ray starts the first group (its controller and actors mostly wait).
        weights, losses = elastic_job.train_fit(mirrored(3), str(tmp_path / "reference_backup"))
        timings["reference"] = time.time() - begin
        pid = int(_wait_for_file(out / "kill", fit, FIT_TIMEOUT_SECONDS))
        timings["kill"] = time.time() - begin
        assert len(stores()) == 1, stores()  # the run's store actor, started by its controller
        tenant.leave(1)  # below MIN: no resize of the healthy group, and no restart at 3 from an old answer
        time.sleep(1.5)  # the policy asks the coordinator at most once a second
        os.kill(pid, signal.SIGKILL)
        tenant.leave(2)
        _wait_for_file(out / "grow", fit, FIT_TIMEOUT_SECONDS)
        timings["grow"] = time.time() - begin
        tenant.leave(3)
        fit.join(FIT_TIMEOUT_SECONDS)
    finally:
        tenant.close()
    timings["end"] = time.time() - begin
    for event in _events(out):  # where the time goes: each group's start (fit restored) and first step
        if event["rank"] == 0 and event["event"] in ("enter", "joined", "start", "applied"):
            timings.setdefault(f"group {event['generation']} {event['event']}", round(event["time"] - begin, 1))
    print("seconds from JaxTrainer.fit:", {k: round(v, 1) for k, v in sorted(timings.items(), key=lambda kv: kv[1])})
    assert not fit.is_alive(), f"JaxTrainer.fit did not end within {FIT_TIMEOUT_SECONDS} s"
    assert result["value"].error is None, result["value"].error
    deadline = time.monotonic() + 30  # the run's store ends with the run
    while stores():
        assert time.monotonic() < deadline, stores()
        time.sleep(0.1)

    events = _events(out)
    starts = [e for e in events if e["event"] == "start" and e["rank"] == 0]
    assert [(s["size"], s["from_memory"]) for s in starts] == [(3, False), (2, True), (3, True)], starts
    generations = [s["generation"] for s in starts]
    assert generations == sorted(generations)
    applied = {g: {e["step"] for e in events if e["event"] == "applied" and e["generation"] == g} for g in generations}
    second, third = starts[1]["step"], starts[2]["step"]
    # Group 2 restored the survivors' commit of the last step every worker completed, mid-epoch (the backup
    # directory was gone: nothing on disk to read). Reported but not kept: steps the survivors dispatched after
    # it, which never completed (their collectives waited for the killed worker; Keras calls on_train_batch_end
    # once a step is dispatched).
    assert second == KILL_STEP and second % STEPS != 0, starts
    assert len({s for s in applied[generations[0]] if s > second}) <= 2, applied
    # Group 3 restored the commit group 2 made before the step it waited at: nothing redone.
    assert third == GROW_STEP and max(applied[generations[1]]) == GROW_STEP, (starts, applied)
    assert max(applied[generations[2]]) == elastic_job.EPOCHS * STEPS
    # Every worker of a group started, at the same step.
    group_starts = [[e for e in events if e["event"] == "start" and e["generation"] == g] for g in generations]
    assert [sorted(e["rank"] for e in group) for group in group_starts] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    assert [len({e["step"] for e in group}) for group in group_starts] == [1, 1, 1]
    # The result: the uninterrupted 3-replica run's weights and per-epoch losses, each epoch logged once.
    with np.load(out / "weights.npz") as got:
        for i, want in enumerate(weights):
            np.testing.assert_allclose(got[f"arr_{i}"], want, rtol=1e-5, atol=1e-6)
    logged = [(e["epoch"], e["loss"]) for e in events if e["event"] == "epoch"]
    assert [epoch for epoch, _ in logged] == list(range(elastic_job.EPOCHS)), logged
    np.testing.assert_allclose([loss for _, loss in logged], losses, rtol=1e-5)
