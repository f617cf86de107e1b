"""Uneven-batch reference cases for record_tf.py (section "uneven"): what each replica sees.

TF runs every replica on exactly its rows; these cases record what arbitrary replica
code returns on an uneven batch (inputs [5., 6., 7.] batched by 4 over 2 replicas:
[5, 6] | [7]; and 1 row over 2 replicas: [x] | []), and BatchNorm statistics.
"""

import numpy as np
import tensorflow as tf


def register(add_task, py, local, mirrored, guarded):
    def first_batch(s, values, batch):
        ds = tf.data.Dataset.from_tensor_slices(np.asarray(values, np.float32)).batch(batch)
        return next(iter(s.experimental_distribute_dataset(ds)))

    def run_case(name, fn, values=(5.0, 6.0, 7.0), batch=4, n=2):
        def run():
            s = mirrored(n)
            x = first_batch(s, values, batch)
            return {"eager": local(s, s.run(fn, args=(x,))),
                    "tf_function": local(s, tf.function(lambda v: s.run(fn, args=(v,)))(x))}
        add_task(("uneven", name), lambda: guarded(run))

    ctx = tf.distribute.get_replica_context
    run_case("mean", lambda v: tf.reduce_mean(v))
    run_case("size", lambda v: tf.size(v))
    run_case("softmax_rows", lambda v: tf.nn.softmax(v))
    run_case("row_sum_axis0", lambda v: tf.reduce_sum(tf.stack([v, 2 * v], axis=1), axis=0))
    run_case("all_reduce_mean_of_mean", lambda v: ctx().all_reduce("MEAN", tf.reduce_mean(v)))
    run_case("all_reduce_sum_of_sum", lambda v: ctx().all_reduce("SUM", tf.reduce_sum(v)))
    run_case("all_gather_rows", lambda v: ctx().all_gather(v, 0))
    run_case("shape0", lambda v: tf.shape(v)[0])
    run_case("empty_replica_sum", lambda v: tf.reduce_sum(v), values=(3.0,), batch=4)
    run_case("empty_replica_shape", lambda v: tf.shape(v)[0], values=(3.0,), batch=4)
    run_case("three_replicas_mean", lambda v: tf.reduce_mean(v), values=(1.0, 2.0, 3.0, 4.0, 5.0), batch=6, n=3)

    def batch_norm(mode):
        # The case: rows arange(18).reshape(9, 2), Dense(3, ones) -> BN(momentum=0.5) -> Dense(1),
        # SGD(0.0) so only the statistics move, batch 4; the last step is [row 8] | [].
        import keras

        x = np.arange(18, dtype=np.float32).reshape(9, 2)
        y = np.zeros((9, 1), np.float32)

        def build():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, kernel_initializer="ones"),
                                      keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
            return model

        if mode == "one_device":
            model = build()
        else:
            with mirrored(2).scope():
                model = build()
        model.fit(x, y, batch_size=4, shuffle=False, epochs=1, verbose=0)
        bn = model.layers[1]
        return {"moving_mean": py(bn.moving_mean), "moving_variance": py(bn.moving_variance)}

    for mode in ("one_device", "mirrored2"):
        add_task(("uneven", f"batch_norm_fit_{mode}"), lambda mode=mode: guarded(lambda: batch_norm(mode)))
