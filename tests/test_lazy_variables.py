"""Variables created inside strategy.run on the first call, and experimental_local_results(variable).

The first part ports transformers' GradientAccumulator (src/transformers/optimization_tf.py,
Apache-2.0) and its two tests (tests/optimization/test_optimization_tf.py:
``testGradientAccumulator``, ``testGradientAccumulatorDistributionStrategy``) by
substitution: ``tf.Variable(..., synchronization=ON_READ, aggregation=ONLY_FIRST_REPLICA)``
-> ``keras.Variable(..., synchronization="on_read", aggregation="only_first_replica")``,
``v.value()`` -> ``v.value``, ``tf.function`` -> ``distribute.function``,
``tf.distribute`` -> ``distribute``, ``create_optimizer(5e-5, 10, 5)`` -> its WarmUp over
PolynomialDecay with Keras' Adam. Expected values are the tests' own; the extra ones were
printed by TF 2.21 running tests/parity/record_tf_lazy_variables.py (named at each use).
"""

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import distribute


class GradientAccumulator:
    """transformers' GradientAccumulator, ported by substitution (see the module docstring)."""

    def __init__(self):
        self._gradients = []
        self._accum_steps = None

    @property
    def step(self):
        if self._accum_steps is None:
            self._accum_steps = keras.Variable(
                keras.ops.convert_to_tensor(0, dtype="int64"), trainable=False,
                synchronization="on_read", aggregation="only_first_replica",
            )
        return self._accum_steps.value

    @property
    def gradients(self):
        if not self._gradients:
            raise ValueError("The accumulator should be called first to initialize the gradients")
        return [gradient.value if gradient is not None else gradient for gradient in self._gradients]

    def __call__(self, gradients):
        if not self._gradients:
            _ = self.step  # Create the step variable.
            self._gradients.extend([
                # Keras on JAX: keras.ops.zeros_like(keras.Variable) raises (np.result_type of a Variable),
                # so the gradient is converted first; TF's tf.zeros_like takes the variable.
                keras.Variable(keras.ops.zeros_like(keras.ops.convert_to_tensor(gradient)), trainable=False,
                               synchronization="on_read", aggregation="only_first_replica")
                if gradient is not None else gradient
                for gradient in gradients
            ])
        if len(gradients) != len(self._gradients):
            raise ValueError(f"Expected {len(self._gradients)} gradients, but got {len(gradients)}")
        for accum_gradient, gradient in zip(self._gradients, gradients):
            if accum_gradient is not None and gradient is not None:
                accum_gradient.assign_add(gradient)
        self._accum_steps.assign_add(1)

    def reset(self):
        if not self._gradients:
            return
        self._accum_steps.assign(0)
        for gradient in self._gradients:
            if gradient is not None:
                gradient.assign(keras.ops.zeros_like(keras.ops.convert_to_tensor(gradient)))


class WarmUp(keras.optimizers.schedules.LearningRateSchedule):
    """transformers' WarmUp (power 1) over a decay schedule, as create_optimizer builds it."""

    def __init__(self, initial_learning_rate, decay_schedule_fn, warmup_steps):
        self.initial_learning_rate = initial_learning_rate
        self.decay_schedule_fn = decay_schedule_fn
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup = self.initial_learning_rate * step / self.warmup_steps
        return keras.ops.where(step < self.warmup_steps, warmup, self.decay_schedule_fn(step - self.warmup_steps))


def create_optimizer(init_lr, num_train_steps, num_warmup_steps):
    """transformers' create_optimizer with its defaults (weight_decay_rate 0: Adam, epsilon 1e-8)."""
    decay = keras.optimizers.schedules.PolynomialDecay(init_lr, num_train_steps - num_warmup_steps, 0.0, power=1.0)
    schedule = WarmUp(init_lr, decay, num_warmup_steps)
    return keras.optimizers.Adam(learning_rate=schedule, beta_1=0.9, beta_2=0.999, epsilon=1e-8), schedule


def assert_list_almost_equal(list1, list2, tol):
    list1 = np.asarray(list1).tolist()
    assert len(list1) == len(list2)
    for a, b in zip(list1, list2):
        assert a == pytest.approx(b, abs=tol)


def test_gradient_accumulator():
    accumulator = GradientAccumulator()
    accumulator([jnp.array([1.0, 2.0])])
    accumulator([jnp.array([-2.0, 1.0])])
    accumulator([jnp.array([-1.0, 2.0])])
    with pytest.raises(ValueError):
        accumulator([jnp.array([1.0, 1.0]), jnp.array([2.0, 2.0])])
    assert accumulator.step == 3
    assert len(accumulator.gradients) == 1
    assert_list_almost_equal(accumulator.gradients[0], [-2.0, 5.0], tol=1e-2)
    accumulator.reset()
    assert accumulator.step == 0
    assert_list_almost_equal(accumulator.gradients[0], [0.0, 0.0], tol=1e-2)


def test_gradient_accumulator_distribution_strategy():
    strategy = distribute.MirroredStrategy(devices=["cpu:0", "cpu:1"])

    with strategy.scope():
        accumulator = GradientAccumulator()
        variable = keras.Variable([4.0, 3.0])
        optimizer, _ = create_optimizer(5e-5, 10, 5)
        # The one change beyond substitution: TF's placeholder is a MirroredVariable whose two copies
        # the test assigns different values; here a MirroredVariable is one replicated value (its
        # copies refuse assign: test_mirrored_variable_copies_refuse_assign), so the placeholder is
        # on_read, whose copies are each replica's. TF 2.21 gives the same accumulated values with it
        # (record_tf_lazy_variables.py: "on_read placeholder: step 3 local grads [[2, 3], [1, -2]]").
        gradient_placeholder = keras.Variable([0.0, 0.0], trainable=False, synchronization="on_read",
                                              aggregation="only_first_replica")

    def accumulate_on_replica(gradient):
        accumulator([gradient])

    def apply_on_replica():
        optimizer.apply_gradients(list(zip(accumulator.gradients, [variable])))

    @distribute.function
    def accumulate(grad1, grad2):
        with strategy.scope():
            local_variables = strategy.experimental_local_results(gradient_placeholder)
            local_variables[0].assign(grad1)
            local_variables[1].assign(grad2)
            strategy.run(accumulate_on_replica, args=(gradient_placeholder,))

    @distribute.function
    def apply_grad():
        with strategy.scope():
            strategy.run(apply_on_replica)

    def _check_local_values(grad1, grad2):
        values = strategy.experimental_local_results(accumulator._gradients[0])
        assert_list_almost_equal(values[0].value, grad1, tol=1e-2)
        assert_list_almost_equal(values[1].value, grad2, tol=1e-2)

    accumulate([1.0, 2.0], [-1.0, 1.0])
    accumulate([3.0, -1.0], [-1.0, -1.0])
    accumulate([-2.0, 2.0], [3.0, -2.0])
    assert accumulator.step == 3
    _check_local_values([2.0, 3.0], [1.0, -2.0])
    # Created once, on the first call, as TF (one accumulator variable per gradient, one step variable).
    assert len(accumulator._gradients) == 1
    assert [int(x) for x in strategy.experimental_local_results(accumulator._accum_steps)] == [3, 3]  # TF 2.21: [3, 3]
    apply_grad()
    assert_list_almost_equal(variable.value, [4.0, 3.0], tol=1e-2)
    # Beyond the test: the learning rate of step 0 is 0, of step 1 is 1e-5; Adam's first nonzero move
    # is about lr per element. TF 2.21 (record_tf_lazy_variables.py, tf_keras Adam):
    # [3.9999899864196777, 2.9999899864196777] after a second apply.
    assert int(optimizer.iterations.numpy()) == 1
    apply_grad()
    np.testing.assert_allclose(np.asarray(variable.value), [3.9999899864196777, 2.9999899864196777], rtol=0, atol=1e-7)
    accumulator.reset()
    assert accumulator.step == 0
    _check_local_values([0.0, 0.0], [0.0, 0.0])


# -- variables created inside run, per-copy reads and assigns (TF 2.21: record_tf_lazy_variables.py) --
def _mirrored2():
    return distribute.MirroredStrategy(devices=["cpu:0", "cpu:1"])


def _local(strategy, value):
    return [np.asarray(x).tolist() for x in strategy.experimental_local_results(value)]


def test_variables_created_on_the_first_call_take_the_first_replicas_value():
    s = _mirrored2()
    acc = []

    def make(x):
        if not acc:
            acc.append(keras.Variable(x * 10.0))
            acc.append(keras.Variable(x * 10.0, synchronization="on_read", aggregation="sum"))
        acc[1].assign_add(x)
        return acc[0].value

    pr = s.experimental_distribute_values_from_function(
        lambda ctx: jnp.array([1.0, 1.0]) * float(ctx.replica_id_in_sync_group + 1))

    @distribute.function
    def go(p):
        return s.run(make, args=(p,))

    out = go(pr)
    # TF 2.21 ("lazy mirrored", "lazy on_read sum"): the MirroredVariable's copies and run's outputs
    # [[10, 10], [10, 10]] (replica 0's x * 10); the SUM SyncOnRead copies start at replica 0's value
    # too, then each adds its own x: [[11, 11], [12, 12]], read [23, 23].
    assert _local(s, acc[0]) == [[10.0, 10.0], [10.0, 10.0]] and _local(s, out) == [[10.0, 10.0], [10.0, 10.0]]
    assert _local(s, acc[1]) == [[11.0, 11.0], [12.0, 12.0]] and acc[1].numpy().tolist() == [23.0, 23.0]
    go(pr)
    # TF 2.21 ("second call"): created once; [[12, 12], [14, 14]].
    assert len(acc) == 2 and _local(s, acc[1]) == [[12.0, 12.0], [14.0, 14.0]]
    assert s.extended.variable_created_in_scope(acc[0]) and s.extended.variable_created_in_scope(acc[1])


def test_initial_value_from_a_variable_read_in_the_same_call():
    s = _mirrored2()
    with s.scope():
        w = keras.Variable([1.0, 2.0])
    made = []

    def step():
        if not made:
            made.append(keras.Variable(w * 3.0 + 1.0, trainable=False))
        made[0].assign_add(w)
        return made[0].value

    out = s.run(step)
    # One device's answer: w * 3 + 1 = [4, 7] at creation (w read for the first time in this very
    # call: its real value, not a placeholder), then + w.
    assert made[0].numpy().tolist() == [5.0, 9.0] and _local(s, out) == [[5.0, 9.0], [5.0, 9.0]]


def test_creation_after_reading_variables_that_have_no_value_yet_is_refused():
    s = _mirrored2()
    with s.scope():
        dense = keras.layers.Dense(2)  # built by its first call, inside run
    made = []

    def step(x):
        y = dense(x)
        if not made:
            made.append(keras.Variable(y * 2.0))
        return y

    with pytest.raises(NotImplementedError, match="Build the model .* before the first step"):
        s.run(step, args=(jnp.ones((1, 3)),))


def test_sync_on_read_copies_are_assigned_one_by_one():
    s = _mirrored2()
    with s.scope():
        w = keras.Variable([0.0, 0.0], synchronization="on_read", aggregation="sum")
        o = keras.Variable(0, dtype="int32", synchronization="on_read", aggregation="only_first_replica")
    copies = s.experimental_local_results(w)
    copies[1].assign([1.0, -2.0])
    # TF 2.21 ("sum read after copy 1 assign"): read [1, -2], copies [[0, 0], [1, -2]].
    assert w.numpy().tolist() == [1.0, -2.0] and _local(s, w) == [[0.0, 0.0], [1.0, -2.0]]
    copies[0].assign_add([2.0, 2.0])
    # TF 2.21 ("after copy 0 assign_add"): read [3, 0], copies [[2, 2], [1, -2]].
    assert w.numpy().tolist() == [3.0, 0.0] and _local(s, w) == [[2.0, 2.0], [1.0, -2.0]]
    assert [c.numpy().tolist() for c in copies] == [[2.0, 2.0], [1.0, -2.0]]  # live, as TF's components
    s.experimental_local_results(o)[1].assign(7)
    # TF 2.21 ("only_first after copy1=7"): read 0, copies [0, 7].
    assert int(o.numpy()) == 0 and _local(s, o) == [0, 7]
    with pytest.raises(ValueError, match=r"has shape \(2,\); got a value of shape \(3,\)"):
        copies[0].assign([1.0, 2.0, 3.0])


def test_mirrored_variable_copies_read_and_refuse_assign():
    s = _mirrored2()
    with s.scope():
        m = keras.Variable([4.0, 3.0])
    copies = s.experimental_local_results(m)
    assert [c.numpy().tolist() for c in copies] == [[4.0, 3.0], [4.0, 3.0]]
    assert [next(iter(c.devices())) for c in copies] == list(s.extended.replica_mesh.local_devices)
    assert float(copies[1][0]) == 4.0 and (copies[0] + 1.0).tolist() == [5.0, 4.0]
    # TF lets a MirroredVariable's copies diverge (record_tf_lazy_variables.py: "placeholder components
    # after first [[1, 2], [-1, 1]]"; tensorflow/python/distribute/tpu_strategy_test.py,
    # test_variables_mismatched_device_assignment: local_results(v)[1].assign(42.) gives [1., 42.]);
    # here it is one replicated value: a clear error naming the fix, and the copies stay equal.
    with pytest.raises(NotImplementedError, match="synchronization='on_read'"):
        copies[1].assign([1.0, 2.0])
    assert [c.numpy().tolist() for c in copies] == [[4.0, 3.0], [4.0, 3.0]]
    m.assign([1.0, 1.0])
    assert [c.numpy().tolist() for c in copies] == [[1.0, 1.0], [1.0, 1.0]]


def test_creation_inside_compute_gradients_loss_function_names_where_to_create_it():
    s = _mirrored2()
    with s.scope():
        w = keras.Variable([1.0, 2.0])
    made = []

    def step():
        def loss_fn():
            if not made:
                made.append(keras.Variable(w * 2.0))
            return keras.ops.sum(w * w)

        return distribute.compute_gradients(loss_fn, [w])[1][0]

    with pytest.raises(ValueError, match="Create it in the replica function itself"):
        s.run(step)


def test_creation_inside_a_tape_block_on_the_first_call():
    s = _mirrored2()
    with s.scope():
        w = keras.Variable([1.0, 2.0])
    made = []

    def step():
        with distribute.GradientTape() as tape:
            if not made:
                made.append(keras.Variable(w * 2.0, trainable=False))
            loss = keras.ops.sum(w * made[0])
        return tape.gradient(loss, [w])[0]

    out = s.run(step)
    # One device's answer: made = 2 * w = [2, 4], and d(sum(w * made))/dw = made on each replica.
    assert made[0].numpy().tolist() == [2.0, 4.0] and _local(s, out) == [[2.0, 4.0], [2.0, 4.0]]
