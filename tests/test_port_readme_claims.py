"""README.md's own examples and claims, run as a first-time user reads them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
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


@pytest.mark.xfail(strict=True, raises=AttributeError, reason="README 'Partial batches' documents ReplicaContext.example_mask (and padding masks), which the code no longer has: the section is stale")
def test_readme_example_mask():
    strategy = mirrored(2)
    batch = next(iter(strategy.experimental_distribute_dataset(tfdata.Dataset.range(3).batch(3))))

    def f(x):
        mask = distribute.get_replica_context().example_mask
        return jnp.zeros(()) if mask is None else jnp.sum(mask)

    assert [float(v) for v in strategy.experimental_local_results(strategy.run(f, args=(batch,)))] == [2.0, 1.0]
