"""Print TF 2.21's answers for variables created inside strategy.run and for per-copy reads/assigns.

    /work/tfvenv/bin/python tests/parity/record_tf_lazy_variables.py

Two logical CPU devices, MirroredStrategy. The printed values are constants in
tests/test_lazy_variables.py (and one in tests/test_values_parity.py). The first part
runs transformers' GradientAccumulator tests (tests/optimization/test_optimization_tf.py,
``testGradientAccumulator`` and ``testGradientAccumulatorDistributionStrategy``) with
the accumulator of transformers/optimization_tf.py (Apache-2.0), and ``create_optimizer(5e-5, 10, 5)``
spelled out (WarmUp over PolynomialDecay, Adam), on tf_keras.
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

class GradientAccumulator(object):
    def __init__(self):
        self._gradients = []
        self._accum_steps = None
    @property
    def step(self):
        if self._accum_steps is None:
            self._accum_steps = tf.Variable(tf.constant(0, dtype=tf.int64), trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        return self._accum_steps.value()
    @property
    def gradients(self):
        if not self._gradients:
            raise ValueError("The accumulator should be called first to initialize the gradients")
        return [g.value() if g is not None else g for g in self._gradients]
    def __call__(self, gradients):
        if not self._gradients:
            _ = self.step
            self._gradients.extend([tf.Variable(tf.zeros_like(g), trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                if g is not None else g for g in gradients])
        if len(gradients) != len(self._gradients):
            raise ValueError(f"Expected {len(self._gradients)} gradients, but got {len(gradients)}")
        for a, g in zip(self._gradients, gradients):
            if a is not None and g is not None:
                a.assign_add(g)
        self._accum_steps.assign_add(1)
    def reset(self):
        if not self._gradients:
            return
        self._accum_steps.assign(0)
        for g in self._gradients:
            if g is not None:
                g.assign(tf.zeros_like(g))

acc = GradientAccumulator()
acc([tf.constant([1.0, 2.0])]); acc([tf.constant([-2.0, 1.0])]); acc([tf.constant([-1.0, 2.0])])
try:
    acc([tf.constant([1.0, 1.0]), tf.constant([2.0, 2.0])])
except ValueError as e:
    print("ValueError:", e)
print("single step", int(acc.step), "grads", acc.gradients[0].numpy().tolist())
acc.reset(); print("after reset", int(acc.step), acc.gradients[0].numpy().tolist())

devices = tf.config.list_logical_devices(device_type="CPU")
strategy = tf.distribute.MirroredStrategy(devices=devices[:2])
import tf_keras
with strategy.scope():
    accumulator = GradientAccumulator()
    variable = tf.Variable([4.0, 3.0])
    # create_optimizer(5e-5, 10, 5): WarmUp(PolynomialDecay) + Adam (weight_decay_rate 0)
    lr = tf_keras.optimizers.schedules.PolynomialDecay(5e-5, 5, 0.0, power=1.0)
    class WarmUp(tf_keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            s = tf.cast(step, tf.float32)
            return tf.cond(s < 5.0, lambda: 5e-5 * tf.math.pow(s / 5.0, 1.0), lambda: lr(step - 5))
    optimizer = tf_keras.optimizers.Adam(learning_rate=WarmUp(), beta_1=0.9, beta_2=0.999, epsilon=1e-8)
    gradient_placeholder = tf.Variable([0.0, 0.0], trainable=False)
print(type(gradient_placeholder).__name__)

def accumulate_on_replica(gradient):
    accumulator([gradient])
def apply_on_replica():
    optimizer.apply_gradients(list(zip(accumulator.gradients, [variable])))

@tf.function
def accumulate(grad1, grad2):
    with strategy.scope():
        lv = strategy.experimental_local_results(gradient_placeholder)
        lv[0].assign(grad1); lv[1].assign(grad2)
        strategy.run(accumulate_on_replica, args=(gradient_placeholder,))
@tf.function
def apply_grad():
    with strategy.scope():
        strategy.run(apply_on_replica)

def local(v):
    return [x.value().numpy().tolist() for x in strategy.experimental_local_results(v)]
accumulate([1.0, 2.0], [-1.0, 1.0])
print("placeholder components after first", local(gradient_placeholder), "read", gradient_placeholder.numpy().tolist())
accumulate([3.0, -1.0], [-1.0, -1.0])
accumulate([-2.0, 2.0], [3.0, -2.0])
print("step", int(accumulator.step), "local grads", local(accumulator._gradients[0]), "steps local", local(accumulator._accum_steps))
print("types", [type(x).__name__ for x in strategy.experimental_local_results(accumulator._gradients[0])], type(accumulator._gradients[0]).__name__)
print("cross replica read of acc", accumulator._gradients[0].numpy().tolist())
apply_grad()
print("variable", variable.numpy().tolist(), "iterations", int(optimizer.iterations.numpy()))
apply_grad()
print("variable after 2nd apply (lr at step1=1e-5)", variable.numpy().tolist())
accumulator.reset()
print("after reset", int(accumulator.step), local(accumulator._gradients[0]), local(accumulator._accum_steps))
s = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with s.scope():
    v = tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
def step():
    v.assign_add(1.0); return 0.0
s.run(step)
before = s.experimental_local_results(v)
s.run(step)
print("live after next step", [float(x) for x in before])
with s.scope():
    w = tf.Variable([0.0, 0.0], synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
c = s.experimental_local_results(w)
c[1].assign([1.0, -2.0])
print("sum read after copy 1 assign", w.numpy().tolist(), [x.numpy().tolist() for x in c])
c[0].assign_add([2.0, 2.0])
print("after copy 0 assign_add", w.numpy().tolist(), [x.numpy().tolist() for x in c])
with s.scope():
    o = tf.Variable(0, dtype=tf.int64, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    m = tf.Variable([4.0, 3.0])
s.experimental_local_results(o)[1].assign(7)
print("only_first after copy1=7", int(o.numpy()), [int(x.numpy()) for x in s.experimental_local_results(o)])
# lazily created, first replica's value
acc = []
def make(x):
    if not acc:
        acc.append(tf.Variable(x * 10.0))
        acc.append(tf.Variable(x * 10.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM))
    acc[1].assign_add(x)
    return acc[0].read_value()
pr = s.experimental_distribute_values_from_function(lambda ctx: tf.constant([1.0, 1.0]) * float(ctx.replica_id_in_sync_group + 1))
@tf.function
def go(p):
    return s.run(make, args=(p,))
out = go(pr)
print("lazy mirrored", type(acc[0]).__name__, [x.numpy().tolist() for x in s.experimental_local_results(acc[0])], [x.numpy().tolist() for x in s.experimental_local_results(out)])
print("lazy on_read sum", type(acc[1]).__name__, [x.numpy().tolist() for x in s.experimental_local_results(acc[1])], acc[1].numpy().tolist())
go(pr)
print("second call", len(acc), [x.numpy().tolist() for x in s.experimental_local_results(acc[1])])

# The port's one change to testGradientAccumulatorDistributionStrategy: gradient_placeholder
# is ON_READ (its copies are each replica's; a MirroredVariable's copies cannot diverge there).
with s.scope():
    acc2 = GradientAccumulator()
    ph2 = tf.Variable([0.0, 0.0], trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


@tf.function
def accumulate2(grad1, grad2):
    with s.scope():
        lv = s.experimental_local_results(ph2)
        lv[0].assign(grad1)
        lv[1].assign(grad2)
        s.run(lambda g: acc2([g]), args=(ph2,))


accumulate2([1.0, 2.0], [-1.0, 1.0])
accumulate2([3.0, -1.0], [-1.0, -1.0])
accumulate2([-2.0, 2.0], [3.0, -2.0])
print("on_read placeholder: step", int(acc2.step), "local grads", [x.numpy().tolist() for x in s.experimental_local_results(acc2._gradients[0])])
