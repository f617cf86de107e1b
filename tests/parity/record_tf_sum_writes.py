"""Print TensorFlow 2.21's answers for hand gradient accumulation in a SUM MirroredVariable.

    /work/tfvenv/bin/python tests/parity/record_tf_sum_writes.py

MirroredStrategy over 2 logical CPU devices; ``w`` and an ``aggregation=SUM`` accumulator
made in scope; two micro-steps of 4 rows (global batch 8), each a ``tf.function`` under
``strategy.run`` that adds its gradient (``assign_add(g)``, or ``assign(acc + g)``) and
returns the accumulator it reads right after; then Keras 3 ``SGD(0.1)`` applies the
accumulator (in cross-replica context, or inside the run of the last micro-step). Prints one
JSON object; ``tests/test_tf_parity_gaps.py`` keeps the values (``TF_MICRO_READS``, ``TF_MICRO_W``).
"""

import json
import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def program(strategy, write, apply_in_last_run):
    x = np.arange(1, 9, dtype=np.float32).reshape(8, 1)
    with strategy.scope():
        w = tf.Variable([0.0])
        accum = tf.Variable([0.0], aggregation=tf.VariableAggregation.SUM, trainable=False)
        opt = keras.optimizers.SGD(0.1)
        opt.build([w])

    def micro(xb, last):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss((w * xb - 1.0)[:, 0] ** 2 / 2, global_batch_size=8)
        g = tape.gradient(loss, w)
        accum.assign_add(g) if write == "assign_add" else accum.assign(accum + g)
        read = tf.convert_to_tensor(accum)
        if apply_in_last_run and last:
            opt.apply_gradients([(tf.convert_to_tensor(accum), w)])
            accum.assign(tf.zeros_like(accum))
        return read

    reads = []
    for start in (0, 4):
        for xb in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x[start:start + 4]).batch(4)):
            out = strategy.run(tf.function(micro), args=(xb, start == 4))
            reads.append([v.numpy().tolist() for v in strategy.experimental_local_results(out)])
    if not apply_in_last_run:
        opt.apply_gradients([(tf.convert_to_tensor(accum), w)])
    return {"reads": reads, "w": w.numpy().tolist()}


def main():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    result = {f"{write}/apply_in_last_run={last}": program(strategy, write, last)
              for write in ("assign_add", "assign") for last in (False, True)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
