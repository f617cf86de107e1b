"""distribute.GradientTape against distribute.compute_gradients: the same compiled step written both ways.

    python benchmarks/tape_vs_compute_gradients.py [--steps 200] [--replicas 2]

For each model (the project's MLP 784-64-10; a small CNN with BatchNormalization
and Dropout; a GAN step with two tapes against two compute_gradients calls):
the first call's seconds (tracing, discovery, XLA compilation), the median
step seconds over interleaved rounds (tape and compute_gradients alternate, so
machine load hits both alike), the ratio, and the compiled programs' count of
dot/convolution operations (one forward pass for both when XLA merged the
tape's replayed forward).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--replicas", type=int, default=2)
parser.add_argument("--models", default="mlp,cnn,gan")
ARGS = parser.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.replicas}"

import distribute  # noqa: E402  (before keras: makes Keras use JAX)
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

STRATEGY = distribute.MirroredStrategy()


def mlp():
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    return model, (128, 784)


def cnn():
    model = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.BatchNormalization(),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dropout(0.3), keras.layers.Dense(10)])
    return model, (64, 28, 28, 1)


def classifier_steps(build):
    with STRATEGY.scope():
        model, shape = build()
        optimizer = keras.optimizers.Adam()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def tape_step(x, y):
        with distribute.GradientTape() as tape:
            loss = distribute.compute_average_loss(loss_object(y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def cg_step(x, y):
        loss, grads = distribute.compute_gradients(
            lambda: distribute.compute_average_loss(loss_object(y, model(x, training=True))), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    x = rng.random(shape, dtype=np.float32)
    y = rng.integers(0, 10, shape[0])
    data = distribute.data.Dataset.from_tensor_slices((x, y)).batch(shape[0])
    batch = next(iter(STRATEGY.experimental_distribute_dataset(data)))
    return tape_step, cg_step, batch


def gan_steps():
    with STRATEGY.scope():
        gen = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(32)])
        disc = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
        g_opt, d_opt = keras.optimizers.Adam(1e-4), keras.optimizers.Adam(1e-4)
        bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")

    def losses(noise, real):
        fake = gen(noise, training=True)
        real_out, fake_out = disc(real, training=True), disc(fake, training=True)
        g_loss = distribute.compute_average_loss(bce(keras.ops.ones_like(fake_out), fake_out))
        d_loss = distribute.compute_average_loss(bce(keras.ops.ones_like(real_out), real_out) + bce(keras.ops.zeros_like(fake_out), fake_out))
        return g_loss, d_loss

    def tape_step(noise, real):
        with distribute.GradientTape() as gen_tape, distribute.GradientTape() as disc_tape:
            g_loss, d_loss = losses(noise, real)
        g_grads = gen_tape.gradient(g_loss, gen.trainable_variables)
        d_grads = disc_tape.gradient(d_loss, disc.trainable_variables)
        g_opt.apply_gradients(zip(g_grads, gen.trainable_variables))
        d_opt.apply_gradients(zip(d_grads, disc.trainable_variables))
        return g_loss

    def cg_step(noise, real):
        g_loss, g_grads = distribute.compute_gradients(lambda: losses(noise, real)[0], gen.trainable_variables)
        d_loss, d_grads = distribute.compute_gradients(lambda: losses(noise, real)[1], disc.trainable_variables)
        g_opt.apply_gradients(zip(g_grads, gen.trainable_variables))
        d_opt.apply_gradients(zip(d_grads, disc.trainable_variables))
        return g_loss

    rng = np.random.default_rng(0)
    data = distribute.data.Dataset.from_tensor_slices(
        (rng.random((128, 16), dtype=np.float32), rng.random((128, 32), dtype=np.float32))).batch(128)
    return tape_step, cg_step, next(iter(STRATEGY.experimental_distribute_dataset(data)))


def dots(step) -> int:
    for key, program in STRATEGY.extended.programs.items():
        if key[0] is step and getattr(program, "compiled", None) is not None:
            text = program.compiled.as_text()
            return text.count(" dot(") + text.count(" convolution(")
    return -1


def measure(name, tape_step, cg_step, batch):
    first = {}
    for label, step in (("tape", tape_step), ("compute_gradients", cg_step)):
        start = time.perf_counter()
        jax.block_until_ready(STRATEGY.run(step, args=batch).values)
        first[label] = time.perf_counter() - start
    times = {"tape": [], "compute_gradients": []}
    rounds = 10
    for _ in range(rounds):
        for label, step in (("tape", tape_step), ("compute_gradients", cg_step)):
            start = time.perf_counter()
            for _ in range(ARGS.steps // rounds):
                out = STRATEGY.run(step, args=batch)
            jax.block_until_ready(out.values)
            times[label].append((time.perf_counter() - start) / (ARGS.steps // rounds))
    tape_s, cg_s = statistics.median(times["tape"]), statistics.median(times["compute_gradients"])
    print(f"{name}: step tape {tape_s * 1e3:.3f} ms, compute_gradients {cg_s * 1e3:.3f} ms, ratio {tape_s / cg_s:.3f}; "
          f"first call tape {first['tape']:.2f} s, compute_gradients {first['compute_gradients']:.2f} s, "
          f"ratio {first['tape'] / first['compute_gradients']:.2f}; dot/conv ops tape {dots(tape_step)}, "
          f"compute_gradients {dots(cg_step)}", flush=True)


if __name__ == "__main__":
    print(f"{ARGS.replicas} replicas, {ARGS.steps} steps, load {os.getloadavg()[0]:.1f}, python {sys.version.split()[0]}, "
          f"jax {jax.__version__}", flush=True)
    for model in ARGS.models.split(","):
        if model == "gan":
            measure("gan", *gan_steps())
        else:
            measure(model, *classifier_steps({"mlp": mlp, "cnn": cnn}[model]))
