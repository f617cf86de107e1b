"""One benchmark measurement in a fresh process; prints one JSON line.

    python benchmarks/_worker.py SYSTEM WORKLOAD REPLICAS [--platform cpu|gpu]
        [--steps-per-execution K] [--epochs T] [--samples N] [--seed S]

SYSTEM is one of:

    dist_loop        distribute custom loop: strategy.run(train_step) over
                     experimental_distribute_dataset, compute_gradients, an
                     optimizer made in scope, strategy.reduce of the loss each step
    dist_loop_lazy   the same loop, but the loss is reduced once per epoch
    dist_fit         distribute + Keras model.fit (model compiled in strategy.scope())
    jax              hand-written JAX: jit + NamedSharding data parallel, optax Adam
    keras_dp         Keras 3 keras.distribution.DataParallel + model.fit
    tf               TensorFlow MirroredStrategy + Keras fit (run with a Python that
                     has tensorflow; logical CPU devices)

Every system trains the same model on the same synthetic data (numpy, fixed
seed), with global batch 64 x REPLICAS, no shuffling, the last partial batch
dropped (Keras DataParallel cannot split one), one warm-up epoch, then T timed
epochs.  Each timed epoch ends by waiting for the result (block_until_ready on
the weights / reading the loss), so asynchronous dispatch flatters nobody.

Device count must be chosen before JAX (or TensorFlow) starts, hence one
process per measurement.  The JSON line has: examples_per_second,
timed_seconds, first_step_seconds (tracing + compilation + the first step, to
its result being ready), peak_rss_mb (ru_maxrss of this process),
baseline_rss_mb (after imports and data, before the model), final_loss, ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

PROCESS_START = time.perf_counter()

SYSTEMS = ("dist_loop", "dist_loop_lazy", "dist_fit", "jax", "keras_dp", "tf")
CONFIGS = ("idealized", "user")
PER_REPLICA_BATCH = 64
LEARNING_RATE = 1e-3
MAX_IN_FLIGHT = 2  # hand-written JAX: steps dispatched ahead of the one last waited for

# name: (samples, input shape, classes (0: regression), timed epochs)
WORKLOADS = {
    "mlp": (60_000, (784,), 10, 2),
    "seed": (4_096, (20,), 0, 30),
    "cnn": (6_144, (28, 28, 1), 10, 2),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("system", choices=SYSTEMS)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("replicas", type=int)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs (default: per workload)")
    parser.add_argument("--samples", type=int, default=None, help="examples in the data set (default: per workload)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=None, help="write a cProfile of the timed epochs to this file")
    parser.add_argument("--config", choices=CONFIGS, default="idealized",
                        help="idealized: no metrics, no shuffle, partial batch dropped; user: metrics=['accuracy'], "
                             "shuffle=True, the partial last batch kept (what users run)")
    parser.add_argument("--verbose", type=int, default=0, help="fit systems: Keras verbose for the timed fit (default 0)")
    return parser.parse_args(argv)


# -- environment (before any framework import) ---------------------------------------------
def configure_environment(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.system == "tf":
        os.environ["KERAS_BACKEND"] = "tensorflow"
        if args.platform == "gpu":
            raise SystemExit("the tf system runs on CPU only in this harness")
        return
    os.environ["KERAS_BACKEND"] = "jax"
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={args.replicas}")
        # A stuck all-reduce between virtual CPU devices aborts after 10 s instead of 40 s.
        if not any(f.startswith("--xla_cpu_collective_call_terminate_timeout_seconds") for f in flags):
            flags.append("--xla_cpu_collective_call_terminate_timeout_seconds=10")
        os.environ["XLA_FLAGS"] = " ".join(flags)
    else:
        os.environ["JAX_PLATFORMS"] = "cuda"
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def rss_mb() -> float:
    """Peak resident set of this process so far, MiB (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


# -- data ---------------------------------------------------------------------------------
def make_data(workload: str, samples: int | None, global_batch: int, seed: int, keep_partial: bool = False):
    import numpy as np

    n, shape, classes, _ = WORKLOADS[workload]
    n = samples or n
    if not keep_partial:
        n = (n // global_batch) * global_batch  # drop the partial batch: every system sees the same steps
    if n == 0:
        raise SystemExit(f"{workload}: fewer samples than one global batch ({global_batch})")
    rng = np.random.default_rng(seed)
    x = rng.random((n, *shape), dtype=np.float32)  # float32 directly: no float64 peak
    if classes:
        y = rng.integers(0, classes, size=(n,), dtype=np.int32)
    else:
        w = rng.standard_normal((shape[0], 1), dtype=np.float32)
        y = x @ w + 0.1 * rng.standard_normal((n, 1), dtype=np.float32)
    return x, y


# -- Keras models (shared by dist_*, keras_dp and tf) ---------------------------------------
def keras_model(workload: str):
    import keras

    _, shape, classes, _ = WORKLOADS[workload]
    if workload == "mlp":
        layers = [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    elif workload == "seed":
        layers = [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)]
    else:
        layers = [
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    return keras.Sequential([keras.Input(shape), *layers])


def keras_loss(workload: str, reduction: str = "sum_over_batch_size"):
    import keras

    if WORKLOADS[workload][2]:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    return keras.losses.MeanSquaredError(reduction=reduction)


class Timer:
    """Epoch timings; ``mark_ready`` is called once the epoch's result is on the host."""

    def __init__(self):
        self.epoch_seconds: list[float] = []
        self._start = 0.0

    def begin(self) -> None:
        self._start = time.perf_counter()

    def end(self) -> None:
        self.epoch_seconds.append(time.perf_counter() - self._start)


def maybe_profile(args):
    if not args.profile:
        return None
    import cProfile

    return cProfile.Profile()


# -- systems ----------------------------------------------------------------------------------
def run_dist_loop(args, x, y, timed_epochs, lazy: bool) -> dict:
    import jax
    import keras

    import distribute
    from distribute.data import Dataset

    keras.utils.set_random_seed(args.seed)
    devices = jax.devices()[: args.replicas]
    strategy = distribute.MirroredStrategy(devices)
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    with strategy.scope():
        model = keras_model(args.workload)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        loss_object = keras_loss(args.workload, reduction="none")

    def train_step(xb, yb):
        def loss_fn():
            return distribute.compute_average_loss(loss_object(yb, model(xb, training=True)))

        loss, grads = distribute.compute_gradients(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    first_step = None
    timer = Timer()
    profile = None
    losses = []
    for epoch in range(1 + timed_epochs):
        if epoch == 1:
            profile = maybe_profile(args)
            if profile:
                profile.enable()
        timer.begin()
        total, steps, per_replica = 0.0, 0, None
        for xb, yb in dist_dataset:
            if first_step is None:
                t0 = time.perf_counter()
                loss = strategy.reduce("SUM", strategy.run(train_step, args=(xb, yb)), axis=None)
                float(loss)
                first_step = time.perf_counter() - t0
                total, steps = total + loss, steps + 1
                continue
            per_replica = strategy.run(train_step, args=(xb, yb))
            if not lazy:
                # What TF users write: reduce every step, accumulate on device.
                total = total + strategy.reduce("SUM", per_replica, axis=None)
            steps += 1
        if lazy and per_replica is not None:
            total = strategy.reduce("SUM", per_replica, axis=None) * steps
        value = float(total) / max(steps, 1)  # waits for the epoch's last step
        jax.block_until_ready([v.value for v in model.trainable_variables])
        timer.end()
        losses.append(value)
    if profile:
        profile.disable()
        profile.dump_stats(args.profile)
    return {"first_step_seconds": first_step, "epoch_seconds": timer.epoch_seconds, "final_loss": losses[-1]}


def compile_kwargs(args) -> dict:
    """What ``model.compile`` gets besides optimizer and loss: the user config adds accuracy."""
    out = {"steps_per_execution": args.steps_per_execution}
    if args.config == "user" and WORKLOADS[args.workload][2]:
        out["metrics"] = ["accuracy"]
    return out


def fit_measure(args, model, x, y, global_batch, timed_epochs, block) -> dict:
    """First step: a fit over exactly one execution (K batches); then warm-up + timed epochs.

    The warm-up epoch is the first full epoch (with the user config: the first
    one with the partial last batch), reported as ``warmup_epoch_seconds``.
    """
    import keras

    k = max(args.steps_per_execution, 1)
    shuffle = args.config == "user"
    t0 = time.perf_counter()
    model.fit(x[: k * global_batch], y[: k * global_batch], batch_size=global_batch, epochs=1, shuffle=False, verbose=0)
    block(model)
    first_step = time.perf_counter() - t0

    timer = Timer()
    losses: list[float] = []

    class EpochTimer(keras.callbacks.Callback):
        # Epoch-level hooks only: batch-level hooks would make Keras sync every step.
        def on_epoch_begin(self, epoch, logs=None):
            timer.begin()

        def on_epoch_end(self, epoch, logs=None):
            block(self.model)
            losses.append(float(logs["loss"]))
            timer.end()

    def fit(epochs):
        model.fit(x, y, batch_size=global_batch, epochs=epochs, shuffle=shuffle, verbose=args.verbose,
                  callbacks=[EpochTimer()])

    profile = None
    if args.profile:
        fit(1)  # warm-up epoch first, unprofiled
        profile = maybe_profile(args)
        profile.enable()
        fit(timed_epochs)
        profile.disable()
        profile.dump_stats(args.profile)
    else:
        fit(1 + timed_epochs)
    return {"first_step_seconds": first_step, "epoch_seconds": timer.epoch_seconds, "final_loss": losses[-1]}


def jax_block(model) -> None:
    import jax

    jax.block_until_ready([v.value for v in model.trainable_variables])


def run_dist_fit(args, x, y, timed_epochs) -> dict:
    import jax
    import keras

    import distribute

    keras.utils.set_random_seed(args.seed)
    strategy = distribute.MirroredStrategy(jax.devices()[: args.replicas])
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    with strategy.scope():
        model = keras_model(args.workload)
        model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss=keras_loss(args.workload),
                      **compile_kwargs(args))
    return fit_measure(args, model, x, y, global_batch, timed_epochs, jax_block)


def run_keras_dp(args, x, y, timed_epochs) -> dict:
    import jax
    import keras

    keras.utils.set_random_seed(args.seed)
    devices = jax.devices()[: args.replicas]
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    global_batch = PER_REPLICA_BATCH * len(devices)
    model = keras_model(args.workload)
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss=keras_loss(args.workload),
                  **compile_kwargs(args))
    return fit_measure(args, model, x, y, global_batch, timed_epochs, jax_block)


def run_tf(args, x, y, timed_epochs) -> dict:
    import keras
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    logical = tf.config.list_logical_devices("CPU")
    strategy = tf.distribute.MirroredStrategy([d.name for d in logical[: args.replicas]])
    keras.utils.set_random_seed(args.seed)
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    with strategy.scope():
        model = keras_model(args.workload)
        model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss=keras_loss(args.workload),
                      **compile_kwargs(args))

    def block(m):
        m.trainable_variables[0].numpy()

    out = fit_measure(args, model, x, y, global_batch, timed_epochs, block)
    out["tensorflow"] = tf.__version__
    return out


# -- hand-written JAX ---------------------------------------------------------------------------
def run_jax(args, x, y, timed_epochs) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()[: args.replicas]
    mesh = Mesh(np.array(devices), ("batch",))
    batch_sharding = NamedSharding(mesh, P("batch"))
    replicated = NamedSharding(mesh, P())
    global_batch = PER_REPLICA_BATCH * len(devices)
    _, shape, classes, _ = WORKLOADS[args.workload]

    key = jax.random.PRNGKey(args.seed)

    def glorot(key, shape_, fan_in, fan_out):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return jax.random.uniform(key, shape_, jnp.float32, -limit, limit)

    keys = jax.random.split(key, 4)
    if args.workload in ("mlp", "seed"):
        out_dim = 10 if args.workload == "mlp" else 1
        params = {
            "w1": glorot(keys[0], (shape[0], 64), shape[0], 64), "b1": jnp.zeros((64,)),
            "w2": glorot(keys[1], (64, out_dim), 64, out_dim), "b2": jnp.zeros((out_dim,)),
        }

        def forward(p, xb):
            h = jax.nn.relu(xb @ p["w1"] + p["b1"])
            return h @ p["w2"] + p["b2"]
    else:
        params = {
            "c1": glorot(keys[0], (3, 3, 1, 16), 9 * 1, 9 * 16), "cb1": jnp.zeros((16,)),
            "c2": glorot(keys[1], (3, 3, 16, 32), 9 * 16, 9 * 32), "cb2": jnp.zeros((32,)),
            "w": glorot(keys[2], (32, 10), 32, 10), "b": jnp.zeros((10,)),
        }
        dn = ("NHWC", "HWIO", "NHWC")

        def forward(p, xb):
            h = jax.lax.conv_general_dilated(xb, p["c1"], (1, 1), "VALID", dimension_numbers=dn) + p["cb1"]
            h = jax.nn.relu(h)
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
            h = jax.lax.conv_general_dilated(h, p["c2"], (1, 1), "VALID", dimension_numbers=dn) + p["cb2"]
            h = jax.nn.relu(h)
            h = h.mean(axis=(1, 2))
            return h @ p["w"] + p["b"]

    def loss_fn(p, xb, yb):
        out = forward(p, xb)
        if classes:
            return optax.softmax_cross_entropy_with_integer_labels(out, yb).mean()
        return jnp.mean((out - yb) ** 2)

    optimizer = optax.adam(LEARNING_RATE)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)

    user = args.config == "user"

    def step(p, s, acc, xb, yb):
        if classes:
            def with_logits(p_):
                out = forward(p_, xb)
                return optax.softmax_cross_entropy_with_integer_labels(out, yb).mean(), out

            (loss, out), grads = jax.value_and_grad(with_logits, has_aux=True)(p)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(p, xb, yb)
        updates, s = optimizer.update(grads, s, p)
        if user:
            # What fit's loss tracker and accuracy metric do: sums over the epoch, on device, every step.
            rows = jnp.float32(xb.shape[0])
            correct = jnp.sum(jnp.argmax(out, axis=-1) == yb).astype(jnp.float32) if classes else jnp.float32(0)
            acc = acc + jnp.stack([loss * rows, correct, rows])
        return optax.apply_updates(p, updates), s, acc, loss

    step = jax.jit(
        step,
        in_shardings=(replicated, replicated, replicated, batch_sharding, batch_sharding),
        out_shardings=(replicated, replicated, replicated, replicated),
        donate_argnums=(0, 1),
    )
    # The user config keeps the partial last batch (its own compile, as jit does for a new shape).
    steps = -(-len(x) // global_batch) if user else len(x) // global_batch
    order_rng = np.random.default_rng(args.seed)

    first_step = None
    timer = Timer()
    profile = None
    losses = []
    for epoch in range(1 + timed_epochs):
        if epoch == 1:
            profile = maybe_profile(args)
            if profile:
                profile.enable()
        timer.begin()
        loss, in_flight = None, []
        acc = jax.device_put(np.zeros(3, np.float32), replicated)
        order = order_rng.permutation(len(x)) if user else None  # fit's shuffle=True: a new order each epoch
        for i in range(steps):
            lo = i * global_batch
            if user:
                index = order[lo : lo + global_batch]
                xh, yh = x[index], y[index]
            else:
                xh, yh = x[lo : lo + global_batch], y[lo : lo + global_batch]
            xb = jax.device_put(xh, batch_sharding)
            yb = jax.device_put(yh, batch_sharding)
            if first_step is None:
                t0 = time.perf_counter()
                params, opt_state, acc, loss = step(params, opt_state, acc, xb, yb)
                float(loss)
                first_step = time.perf_counter() - t0
                continue
            params, opt_state, acc, loss = step(params, opt_state, acc, xb, yb)
            # At most MAX_IN_FLIGHT steps queued: with unbounded async dispatch, XLA:CPU's
            # all-reduce rendezvous between virtual devices deadlocks on this 2-core
            # machine (seen with jax 0.10.2); waiting on step i-2 keeps the pipeline full.
            in_flight.append(loss)
            if len(in_flight) > MAX_IN_FLIGHT:
                in_flight.pop(0).block_until_ready()
        if user:
            total = np.asarray(acc)  # the epoch's logs: mean loss and accuracy, read once
            losses.append(float(total[0] / total[2]))
        else:
            losses.append(float(loss))
        jax.block_until_ready(params)
        timer.end()
    if profile:
        profile.disable()
        profile.dump_stats(args.profile)
    return {"first_step_seconds": first_step, "epoch_seconds": timer.epoch_seconds, "final_loss": losses[-1]}


# -- main ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    configure_environment(args)
    if args.replicas < 1:
        raise SystemExit("replicas must be >= 1")
    if args.system != "tf":
        import jax

        found = jax.devices()
        want = "cpu" if args.platform == "cpu" else "gpu"
        if found[0].platform != want:
            raise SystemExit(f"asked for platform {want}, JAX found {found[0].platform}")
        if len(found) < args.replicas:
            raise SystemExit(f"{args.replicas} replicas asked, JAX has {len(found)} {want} device(s)")
        import keras  # noqa: F401  (imports count in baseline memory for every Keras-based system)

        if args.system == "jax":
            import optax  # noqa: F401
    else:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    timed_epochs = args.epochs or WORKLOADS[args.workload][3]
    if args.config == "user" and args.system in ("dist_loop", "dist_loop_lazy"):
        raise SystemExit("the user config is measured for fit systems and hand-written JAX; the custom loop runs idealized")
    x, y = make_data(args.workload, args.samples, PER_REPLICA_BATCH * args.replicas, args.seed,
                     keep_partial=args.config == "user")
    baseline = current_rss_mb()
    device_kind = "cpu"
    if args.system != "tf":
        import jax

        device_kind = jax.devices()[0].device_kind
    imports_seconds = time.perf_counter() - PROCESS_START

    runner = {
        "dist_loop": lambda: run_dist_loop(args, x, y, timed_epochs, lazy=False),
        "dist_loop_lazy": lambda: run_dist_loop(args, x, y, timed_epochs, lazy=True),
        "dist_fit": lambda: run_dist_fit(args, x, y, timed_epochs),
        "jax": lambda: run_jax(args, x, y, timed_epochs),
        "keras_dp": lambda: run_keras_dp(args, x, y, timed_epochs),
        "tf": lambda: run_tf(args, x, y, timed_epochs),
    }[args.system]
    result = runner()
    timed = result["epoch_seconds"][1:]
    timed_seconds = sum(timed)
    examples = len(x) * len(timed)
    record = {
        "system": args.system,
        "workload": args.workload,
        "config": args.config,
        "verbose": args.verbose,
        "replicas": args.replicas,
        "platform": args.platform,
        "device_kind": device_kind,
        "steps_per_execution": args.steps_per_execution if args.system in ("dist_fit", "keras_dp", "tf") else None,
        "examples_per_epoch": len(x),
        "global_batch": PER_REPLICA_BATCH * args.replicas,
        "timed_epochs": len(timed),
        "timed_seconds": timed_seconds,
        "examples_per_second": examples / timed_seconds,
        "warmup_epoch_seconds": result["epoch_seconds"][0],
        "first_step_seconds": result["first_step_seconds"],
        "imports_and_data_seconds": imports_seconds,
        "baseline_rss_mb": baseline,
        "peak_rss_mb": rss_mb(),
        "final_loss": result["final_loss"],
        "python": platform.python_version(),
    }
    if args.platform == "gpu":
        try:
            import jax

            stats = jax.devices()[0].memory_stats() or {}
            record["device_peak_mb"] = stats.get("peak_bytes_in_use", 0) / 2**20
        except Exception:  # memory_stats is optional in PJRT plugins
            pass
    if "tensorflow" in result:
        record["tensorflow"] = result["tensorflow"]
    print("RESULT " + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (framework thread pools take seconds to wind down);
    # the measurement is complete and printed.
    os._exit(code)
