"""A custom loop under PreemptionCheckpointHandler (TF's failure_handler_test and handler docs, ported).

Imported by tests/test_preemption.py (the uninterrupted reference, in process)
and run as a program (single worker, or every worker through the launcher):

    python preemption_job.py CHECKPOINT_DIR OUT.npz [--strategy mirrored|multi_worker] [--sleep S]

Each run prints ``pid N`` then ``run K`` after every ``handler.run``; the chief
writes the final weights, the TF test's counter and ``total_run_calls`` to OUT.npz.
The batches are a function of the run count, so a resumed run sees exactly the
batches an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

EPOCHS_TO_RUN = 8  # TF failure_handler_test.py
STEPS_PER_EPOCH = 15
GLOBAL_BATCH_SIZE = 8


def batches() -> tuple[np.ndarray, np.ndarray]:
    """(x, y): (EPOCHS_TO_RUN * STEPS_PER_EPOCH, GLOBAL_BATCH_SIZE, 4) float32 and (..., 1) float32."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EPOCHS_TO_RUN * STEPS_PER_EPOCH, GLOBAL_BATCH_SIZE, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def train(strategy, checkpoint_dir: str, termination_config=None, sleep_seconds: float = 0.0,
          on_run=None) -> dict[str, np.ndarray]:
    """Trains to the end (resuming from checkpoint_dir); returns the final weights, counter and run count."""
    import keras

    import distribute

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        # TF's test model: a SUM variable every replica adds 1 to at each step.
        v = keras.Variable(0.0, name="v", aggregation="sum")
    checkpoint = distribute.Checkpoint(model=model, optimizer=optimizer, v=v)
    handler = distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, checkpoint_dir, termination_config)
    x_all, y_all = batches()
    # The tutorial's input, resumed where the saved run count says (the batches follow the run count).
    dataset = distribute.data.Dataset.from_tensor_slices((x_all.reshape(-1, 4), y_all.reshape(-1, 1)))
    iterator = iter(strategy.experimental_distribute_dataset(
        dataset.batch(GLOBAL_BATCH_SIZE).skip(handler.total_run_calls)))

    def step_fn(x, y):
        def loss_fn():
            return distribute.compute_average_loss(keras.ops.square(model(x) - y)[:, 0])

        loss, grads = distribute.compute_gradients(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        v.assign_add(1.0)
        return loss

    def distributed_train_step(inputs):
        return strategy.reduce("SUM", strategy.run(step_fn, args=inputs), axis=None)

    for epoch in range(handler.total_run_calls // STEPS_PER_EPOCH, EPOCHS_TO_RUN):
        for step in range(handler.total_run_calls % STEPS_PER_EPOCH, STEPS_PER_EPOCH):
            handler.run(distributed_train_step, next(iterator))
            print(f"run {handler.total_run_calls}", flush=True)
            if on_run is not None:
                on_run(handler)
            if sleep_seconds:
                time.sleep(sleep_seconds)
    weights = [np.asarray(w) for w in model.get_weights()]
    return {**{f"w{i}": w for i, w in enumerate(weights)}, "v": np.asarray(v.numpy()),
            "total_run_calls": np.asarray(handler.total_run_calls)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out")
    parser.add_argument("--strategy", default="mirrored", choices=["mirrored", "multi_worker"])
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    import distribute

    strategy = distribute.MultiWorkerMirroredStrategy() if args.strategy == "multi_worker" else distribute.MirroredStrategy()
    print(f"pid {os.getpid()} replicas {strategy.num_replicas_in_sync}", flush=True)
    result = train(strategy, args.checkpoint_dir, sleep_seconds=args.sleep)
    if strategy.extended.should_checkpoint:
        np.savez(args.out, **result)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
