"""The program tests/test_uneven_interrupt.py interrupts (``python tests/uneven_interrupt_job.py KIND``).

KIND ``eager``: a custom loop whose replica function cannot be one program per replica (an all_gather), so
its uneven steps run in one thread per replica; each replica first computes for a second or two inside XLA
(matrix products), so Ctrl-C finds the caller waiting for the replica threads, and those inside XLA.  KIND ``compile_ahead``: ``fit`` on 66 rows, batch 32
(32 + 32 + 2: the last batch splits evenly and is compiled ahead in a thread, slowed down by 3 s here), so
Ctrl-C finds the caller waiting for that thread.  KIND ``compiled``: ``fit`` on 63 rows (the compiled
uneven step).  Prints STEP after every step, forever.
"""

import faulthandler
import os
import signal
import sys
import time

# Ctrl-C as at a terminal: a job started in the background of a non-interactive shell (CI) inherits SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
# Every thread's stack on SIGUSR1: the test asks for it when a job outlives its Ctrl-C.
faulthandler.register(signal.SIGUSR1, all_threads=True)

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import distribute  # noqa: E402


def main(kind: str) -> None:
    strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rows = {"eager": 63, "compile_ahead": 66, "compiled": 63}[kind]
    rng = np.random.default_rng(0)
    x, y = rng.random((rows, 8), dtype=np.float32), rng.integers(0, 3, rows)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print("STEP", flush=True)

    if kind == "compile_ahead":
        compile_ = jax.stages.Lowered.compile

        def slow_compile(self, *args, **kwargs):
            if "compile-ahead" in __import__("threading").current_thread().name:
                time.sleep(3)
            return compile_(self, *args, **kwargs)

        jax.stages.Lowered.compile = slow_compile
    if kind != "eager":
        model.fit(x, y, batch_size=32, epochs=10**6, shuffle=False, verbose=0, callbacks=[Steps()])
        return
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(xb, yb):
        if not isinstance(xb, jax.core.Tracer):  # not while the step's variables are discovered
            z = jnp.ones((1024, 1024), jnp.float32)
            for _ in range(12):
                z = (z @ z) / 1024.0
                z.block_until_ready()
        loss, grads = distribute.compute_gradients(lambda: distribute.compute_average_loss(loss_object(yb, model(xb))), model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, distribute.get_replica_context().all_gather(yb, 0)

    dataset = strategy.experimental_distribute_dataset(distribute.data.Dataset.from_tensor_slices((x, y)).batch(63))
    while True:
        for xb, yb in dataset:
            strategy.run(step, args=(xb, yb))
            print("STEP", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
