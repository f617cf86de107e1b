"""The cost of the exact uneven step: fit epochs with and without an uneven last batch, and a custom loop's uneven step.

    python benchmarks/uneven_step_cost.py   # 2 virtual CPU devices
"""
import os, time
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=2"
import distribute, keras, numpy as np
from distribute.data import Dataset
s = distribute.MirroredStrategy()
rng = np.random.default_rng(0)
def data(n):
    return rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n)
def build():
    with s.scope():
        m = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m
for n in (60032, 60033):
    x, y = data(n); m = build()
    times = []
    for e in range(3):
        t = time.perf_counter(); m.fit(x, y, batch_size=128, epochs=1, verbose=0, shuffle=True); times.append(time.perf_counter() - t)
    print(f"fit n={n} (last batch {n % 128 or 128}): epoch seconds", [round(t, 3) for t in times])
# one uneven step alone, custom loop
with s.scope():
    m = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    opt = keras.optimizers.Adam(); loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
def step(xb, yb):
    loss, grads = distribute.compute_gradients(lambda: distribute.compute_average_loss(loss_obj(yb, m(xb, training=True))), m.trainable_variables)
    opt.apply_gradients(zip(grads, m.trainable_variables)); return loss
x, y = data(128 * 3 + 97)
for epoch in range(3):
    ts = []
    for xb, yb in s.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(128)):
        t = time.perf_counter(); float(s.reduce("SUM", s.run(step, args=(xb, yb)), axis=None)); ts.append(time.perf_counter() - t)
    print(f"custom loop epoch {epoch}: full steps {[round(t,4) for t in ts[:-1]]}, uneven step {ts[-1]:.3f} s")
