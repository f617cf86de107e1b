"""A ParameterServerStrategy program run by `python -m distribute.launch --num-workers 2 --num-ps 1` (test_ps_launch.py).

Written as TF's programs are: ps and worker tasks run a Server (the launcher runs
`python -m distribute.parameter_server.nodes` there, so this branch only runs
when the program is started on every task by hand); the chief is the coordinator.
Prints one line `RESULT {...}` with the trained values.
"""

import json
import os

import numpy as np

import distribute
from distribute.cluster_resolver import TFConfigClusterResolver

resolver = TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                      protocol=resolver.rpc_layer or "grpc").join()
    raise SystemExit(0)

import keras  # noqa: E402
import ray  # noqa: E402

from distribute.coordinator import ClusterCoordinator  # noqa: E402
from distribute.data import Dataset  # noqa: E402

strategy = distribute.ParameterServerStrategy(resolver)
coordinator = ClusterCoordinator(strategy)
result = {"num_workers": strategy.extended.num_workers, "num_ps": strategy.extended.num_ps,
          "task_resources": sorted(r for r in ray.cluster_resources() if r.startswith("distribute_"))}

# TF testAsyncScheduleAndJoin: 5 steps of v += 2 give exactly 10, whichever worker runs them.
with strategy.scope():
    v = keras.Variable(0, dtype="int32")
twos = iter(coordinator.create_per_worker_dataset(lambda: Dataset.from_tensor_slices(np.full(10, 2, np.int32))))


def add(iterator):
    v.assign_add(next(iterator))


for _ in range(5):
    coordinator.schedule(add, args=(twos,))
coordinator.join()
result["total"] = int(v.numpy())

# A linear model y = x @ [1, -2, 0.5, 3] + 0.7, trained asynchronously by both workers with SGD.
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype(np.float32)
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.7).astype(np.float32)
with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05)
data = iter(coordinator.create_per_worker_dataset(
    lambda: Dataset.from_tensor_slices((x, y)).repeat().batch(8, drop_remainder=True)))


def step(iterator):
    bx, by = next(iterator)
    loss, grads = distribute.compute_gradients(lambda: keras.ops.mean((model(bx, training=True) - by) ** 2),
                                               model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


losses = [coordinator.schedule(step, args=(data,)) for _ in range(300)]
coordinator.join()
kernel, bias = model.get_weights()
result.update(first_loss=float(losses[0].fetch()), last_loss=float(losses[-1].fetch()),
              kernel=kernel.ravel().tolist(), bias=bias.tolist(), iterations=int(optimizer.iterations.numpy()),
              devices=sorted({w.device for w in model.weights}), pid=os.getpid())
# Every Ray process of the cluster (head, ps and worker nodes, their agents and actors) listens on loopback only.
from distribute.parameter_server import loopback  # noqa: E402

listening = loopback.listeners(loopback.ray_pids())
result.update(listening=sorted({name for _, name, _, _ in listening}), off_loopback=loopback.non_loopback(listening))
print("RESULT " + json.dumps(result), flush=True)
