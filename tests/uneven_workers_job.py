"""The worker program of tests/test_uneven_multi_worker.py (``python tests/uneven_workers_job.py OUT_DIR MODE``).

MODE ``workers``: run under ``distribute.launch`` (MultiWorkerMirroredStrategy, one device per worker):
(1) custom loops whose workers' ``distribute_datasets_from_function`` pipelines hold different numbers of
examples (5 and 3 rows, batch 2; 6 and 4 rows: 3 and 2 batches), (2) TF's custom_training tutorial
(tests/test_port_custom_training.py) with a global batch of 63 (every step but an epoch's last is uneven:
32 | 31 rows). MODE ``one``: the pipelines' custom loops in one process with 2 devices, each replica fed
one worker's pipeline (InputReplicationMode.PER_REPLICA), the reference. Results go to OUT_DIR as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

SIZES = {"rows": [5, 3], "batches": [6, 4]}  # per input pipeline (worker), batched by 2


def pipeline(case: str, pipeline_id: int):
    import distribute

    n = SIZES[case][pipeline_id]
    x = (np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 100 * pipeline_id) / 50.0
    y = x.sum(axis=1, keepdims=True) * 0.5
    return distribute.data.Dataset.from_tensor_slices((x, y)).batch(2)


def custom_loop(strategy, case: str, per_replica_input: bool) -> dict:
    import keras

    import distribute

    mode = distribute.InputReplicationMode.PER_REPLICA if per_replica_input else distribute.InputReplicationMode.PER_WORKER
    dist = strategy.distribute_datasets_from_function(lambda ctx: pipeline(case, ctx.input_pipeline_id),
                                                      distribute.InputOptions(experimental_replication_mode=mode))
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="tanh"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
        mse = keras.losses.MeanSquaredError(reduction="none")

    def step(x, y):
        loss, grads = distribute.compute_gradients(lambda: distribute.compute_average_loss(mse(y, model(x))), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses, rows = [], []
    for _ in range(2):
        for x, y in dist:
            rows.append([int(np.shape(p)[0]) for p in strategy.experimental_local_results(x)])
            losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)))
    return {"losses": losses, "rows": rows, "weights": [w.tolist() for w in model.get_weights()]}


def main(out_dir: str, mode: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    if mode == "one":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import distribute

        strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        out = {case: custom_loop(strategy, case, True) for case in SIZES}
        name = "one"
    else:
        import distribute
        from test_port_custom_training import run_tutorial

        strategy = distribute.MultiWorkerMirroredStrategy()
        out = {case: custom_loop(strategy, case, False) for case in SIZES}
        tutorial = run_tutorial(strategy, os.path.join(out_dir, "checkpoints"), GLOBAL_BATCH_SIZE=63)
        out["tutorial"] = {k: ([np.asarray(w).tolist() for w in v] if k == "weights" else v) for k, v in tutorial.items()}
        name = f"worker{strategy.extended.input_policy.input_pipelines()[1]}"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
