"""README.md's own examples and claims, run as a first-time user reads them."""

from __future__ import annotations

import numpy as np
from helpers import mirrored

import distribute
from distribute import data as tfdata


def test_readme_tf_data_input_function_example():
    GLOBAL_BATCH = 8
    strategy = mirrored(2)

    def scale(image, label):
        return image.astype(np.float32) / 255.0, label

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
        images = np.arange(32 * 4, dtype=np.uint8).reshape(32, 2, 2)
        labels = np.arange(32, dtype=np.int64)
        ds = tfdata.Dataset.from_tensor_slices((images, labels))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.map(scale, num_parallel_calls=tfdata.AUTOTUNE).shuffle(32, seed=1).batch(batch).prefetch(2)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert str(dist.element_spec).startswith("(PerReplicaSpec(TensorSpec(shape=(None, 2, 2), dtype=float32")
    assert sum(1 for _ in dist) == 4  # "8 per-replica batches of 4 -> 4 steps"
    labels = sorted(int(v) for step in dist for part in strategy.experimental_local_results(step[1]) for v in np.asarray(part))
    assert labels == list(range(32))


def test_readme_partial_batches_claims():
    """README "Partial batches": [5, 6, 7] batched by 4 over 2 replicas -> [5, 6] | [7]: mean 5.5 and 7.0, size 2 and 1."""
    import keras

    strategy = mirrored(2)
    batch = next(iter(strategy.experimental_distribute_dataset(tfdata.Dataset.from_tensor_slices(np.array([5.0, 6.0, 7.0], np.float32)).batch(4))))
    assert [float(v) for v in strategy.experimental_local_results(strategy.run(keras.ops.mean, args=(batch,)))] == [5.5, 7.0]
    assert [int(v) for v in strategy.experimental_local_results(strategy.run(keras.ops.size, args=(batch,)))] == [2, 1]
    gathered = strategy.run(lambda x: distribute.get_replica_context().all_gather(x, 0), args=(batch,))
    assert [np.asarray(v).tolist() for v in strategy.experimental_local_results(gathered)] == [[5.0, 6.0, 7.0]] * 2
