"""ParameterServerStrategy's one call per ps per step and 2 closures in flight per worker keep TF's semantics.

A step reads its worker's previous update and everything the coordinator observed
before scheduling it (finished closures, its own writes), whether it reads a push's
read-back or pulls; a closure sent while its predecessor on the same worker was in
flight does not run when that one raised (cancelled, as a queued closure in TF).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.data import Dataset
from distribute.parameter_server.errors import CancelledError, OutOfRangeError

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def one_worker(ray_instance):
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=1)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


@pytest.fixture(scope="module")
def two_workers(ray_instance):
    strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=1)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


def _read_then_add(v):
    def step():
        before = v + 0.0  # the value this step read
        v.assign_add(1.0)
        return before

    return step


def _num_reads(strategy, ray_instance):
    return ray_instance.get(strategy.extended._cluster.ps[0].num_reads.remote())


def test_each_step_reads_the_update_before_it_and_coordinator_writes(one_worker, ray_instance):
    # 1 worker: steps run in order, so step i reads exactly i (TF: the same). After the first
    # pull every step reads the previous push's read-back (no read call), until the coordinator
    # writes: then the next step pulls the written value.
    strategy, coordinator = one_worker
    with strategy.scope():
        v = keras.Variable(0.0)
    step = _read_then_add(v)
    reads = _num_reads(strategy, ray_instance)
    results = [coordinator.schedule(step) for _ in range(10)]
    coordinator.join()
    assert [float(r.fetch()) for r in results] == [float(i) for i in range(10)]
    assert float(v.numpy()) == 10.0
    assert _num_reads(strategy, ray_instance) == reads + 1
    v.assign(100.0)
    results = [coordinator.schedule(step) for _ in range(3)]
    coordinator.join()
    assert [float(r.fetch()) for r in results] == [100.0, 101.0, 102.0]
    assert _num_reads(strategy, ray_instance) == reads + 2


def test_a_step_sees_every_update_the_coordinator_observed(two_workers):
    # 2 workers: each result is fetched before the next step is scheduled, so whichever worker runs
    # it (and whatever read-back it kept from its own last step), it must read every earlier update.
    strategy, coordinator = two_workers
    with strategy.scope():
        v = keras.Variable(0.0)
    step = _read_then_add(v)
    seen = [float(coordinator.schedule(step).fetch()) for _ in range(24)]
    assert seen == [float(i) for i in range(24)]
    # Interleaved with coordinator writes, asynchronously scheduled batches, and joins.
    for k in range(3):
        v.assign(1000.0 * (k + 1))
        results = [coordinator.schedule(step) for _ in range(6)]
        coordinator.join()
        # Two steps may read the same value (asynchrony, as TF), but none reads one from before the write.
        assert all(1000.0 * (k + 1) <= float(r.fetch()) <= 1000.0 * (k + 1) + 5 for r in results)
        assert float(v.numpy()) == 1000.0 * (k + 1) + 6


def test_a_closure_sent_behind_a_failing_one_does_not_run(one_worker):
    # TF testAsyncScheduleWithErrors-like, 1 worker: the closure scheduled right after a failing one is
    # cancelled (or schedule itself raises, if the error came first); it never runs, also when it was
    # already sent to the worker behind the failing one.
    strategy, coordinator = one_worker
    with strategy.scope():
        v = keras.Variable(0.0)
    one = iter(coordinator.create_per_worker_dataset(lambda: Dataset.from_tensor_slices(np.ones(1, np.float32))))

    def take(iterator):
        v.assign_add(next(iterator))

    def add_ten():
        v.assign_add(10.0)

    coordinator.schedule(take, args=(one,))  # the one element
    coordinator.join()
    for _ in range(5):  # then every take fails
        scheduled = []
        with pytest.raises(OutOfRangeError, match="End of sequence"):
            scheduled.append(coordinator.schedule(take, args=(one,)))
            scheduled.append(coordinator.schedule(add_ten))
            coordinator.join()
        for r in scheduled[1:]:
            with pytest.raises(CancelledError):
                r.fetch()
    coordinator.join()
    assert float(v.numpy()) == 1.0  # the one element, once; no add_ten ran
    coordinator.schedule(add_ten)
    coordinator.join()
    assert float(v.numpy()) == 11.0
