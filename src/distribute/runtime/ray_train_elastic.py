"""RayTrainElasticState: an elastic Ray Train run keeps its committed training state in memory (beyond TF).

Under ``python -m distribute.launch --num-workers MIN:MAX`` the launcher is the
elastic agent: it holds, in its memory, the newest step the workers committed
and handed to it, and the next generation restores it instead of a disk backup.
Under Ray Train (``ray.train.v2.jax.JaxTrainer``) this callback plays that part:

- in Ray Train's controller, at the run's start, it creates one Ray actor for
  the run (named ``distribute-elastic-<run id>``, owned by the controller, so
  it ends with the run) that serves the same store as the launcher
  (``runtime/elastic_store.py``) on its node's address;
- in each worker, before the training function starts, it sets the three
  variables a worker of an elastic launch has (the store's address, the
  generation: one per worker group Ray Train starts, and the scheduler), so
  ``BackupAndRestore`` (``fit``) and ``PreemptionCheckpointHandler`` (custom
  loops) commit each step and restore the newest handed-over state exactly as
  under the launcher;
- when Ray Train's controller stops a worker group (a worker was lost, or the
  ``ElasticScalingPolicy`` resizes it), each worker still alive hands its
  newest complete commit to the store in ``before_worker_shutdown``.

Why a callback: Ray Train stops a group by calling each worker actor's
``shutdown`` (which runs only the ``WorkerCallback.before_worker_shutdown``
hooks), waiting at most 5 s, then ``ray.kill`` (Ray 2.60,
``train/v2/_internal/execution/worker_group/state.py``, ``_shutdown_workers``).
``ray.kill`` ends the process without any signal or Python hook, and the
training function runs in a thread of the actor, so a worker has no other
moment to hand off: on a resize its training thread is healthy, and after a
lost worker the survivors' training thread is blocked in (or failed out of) a
collective.  The callback types are Ray Train's ``DeveloperAPI``
(``ray.train.v2._internal.execution.callback``); ``RunConfig(callbacks=...)``
passes them to the controller and the workers.

Ray is imported with this module (``distribute.experimental`` imports it only
when the name is used).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerCallback, WorkerGroupCallback

import distribute.runtime.elastic as elastic
from distribute.runtime.elastic_store import StateStore

__all__ = ["RayTrainElasticState", "store_name"]

logger = logging.getLogger("distribute")

# Ray Train gives a worker's shutdown hooks 5 s before ray.kill; a commit still computing after this is passed over.
HAND_OFF_WAIT_SECONDS = 2.0
STORE_START_SECONDS = 120.0  # the run's store actor answers its address within this, or the run stops naming it


def store_name(run_id: str) -> str:
    """The name of the store actor of the Ray Train run ``run_id`` (``TrainRunContext.run_id``)."""
    return f"distribute-elastic-{run_id}"


class _Store:
    """The Ray actor of one training run: the elastic agent's store, served on this node's address."""

    def __init__(self) -> None:
        self._store = StateStore(ray.util.get_node_ip_address())

    def address(self) -> str:
        return self._store.address

    def step(self) -> int | None:
        return self._store.step()

    def num_handed_off(self) -> int:
        return self._store.num_handed_off


class RayTrainElasticState(ControllerCallback, WorkerGroupCallback, WorkerCallback):
    """Keeps an elastic Ray Train run's newest committed step in memory across worker groups (beyond TF).

    Add it to the run's callbacks; the training function is unchanged::

        from ray.train import RunConfig, ScalingConfig
        from ray.train.v2.jax import JaxTrainer

        trainer = JaxTrainer(
            train_loop, scaling_config=ScalingConfig(num_workers=(2, 3)),
            run_config=RunConfig(callbacks=[distribute.experimental.RayTrainElasticState()]))

    Then a worker group that Ray Train stops (a lost worker, or a resize by
    ``ScalingConfig(num_workers=(min, max))``) hands the newest step its workers
    completed to a Ray actor of the run, and the next group, of any size,
    restores it in ``BackupAndRestore`` / ``PreemptionCheckpointHandler``
    instead of reading the backup: only the steps after the handed-over one
    (those in flight when the group stopped) are computed again.
    Without the callback a new group resumes from the last backup on disk.

    Args:
        hand_off_wait_seconds: How long a stopping worker waits for the step in
            flight to complete before handing over the one before it (Ray
            Train kills a stopping worker 5 s after asking it to stop).

    Raises:
        ValueError: ``hand_off_wait_seconds`` outside [0, 4].
    """

    def __init__(self, hand_off_wait_seconds: float = HAND_OFF_WAIT_SECONDS) -> None:
        if not 0 <= hand_off_wait_seconds <= 4:
            raise ValueError(f"hand_off_wait_seconds={hand_off_wait_seconds!r}: give 0 to 4 s; Ray Train kills a "
                             "stopping worker 5 s after asking it to stop, and the hand-off must fit before.")
        self.hand_off_wait_seconds = float(hand_off_wait_seconds)
        self.address: str | None = None
        self.generation = -1
        self._store: Any = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_store"] = None  # the workers need the address only
        return state

    # -- in Ray Train's controller -----------------------------------------------------------------------------
    def after_controller_start(self, train_run_context: Any) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        actor = ray.remote(num_cpus=0)(_Store).options(name=store_name(train_run_context.run_id), get_if_exists=True,
                                                      scheduling_strategy=here)
        self._store = actor.remote()  # its process starts while the controller decides the first group's size

    def before_worker_group_start(self, worker_group_context: Any) -> None:
        if self.address is None and self._store is not None:
            try:
                self.address = ray.get(self._store.address.remote(), timeout=STORE_START_SECONDS)
            except ray.exceptions.GetTimeoutError as err:
                raise RuntimeError(f"RayTrainElasticState: the run's store actor ({self._store}) did not start within "
                                   f"{STORE_START_SECONDS} s; the Ray cluster cannot start a 0-CPU actor on the "
                                   "controller's node (see `ray status`).") from err
        self.generation += 1

    def after_controller_finish(self, result: Any) -> None:
        if self._store is not None:
            ray.kill(self._store)
            self._store = None

    # -- in each worker ----------------------------------------------------------------------------------------
    def after_init_train_context(self) -> None:
        if self.address is None:
            raise RuntimeError("RayTrainElasticState reached a worker without its store's address: pass it in "
                               "RunConfig(callbacks=[...]) of a Ray Train v2 trainer (its controller starts the store).")
        os.environ.update({elastic.AGENT_ENV: self.address, elastic.GENERATION_ENV: str(self.generation),
                           elastic.SCHEDULER_ENV: elastic.RAY_TRAIN})

    def before_worker_shutdown(self) -> None:
        try:
            elastic.hand_off("Ray Train stops the worker group", wait_seconds=self.hand_off_wait_seconds)
        except Exception as err:  # noqa: BLE001 - Ray kills the worker anyway; the next group finds no state
            logger.error("elastic: the hand-off to the store at %s failed: %s", self.address, err)
