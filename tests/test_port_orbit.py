"""orbit's own tests (tensorflow/models orbit/), ported by substitution, under MirroredStrategy(2).

orbit itself imports TensorFlow; the pieces these tests use are ported in tests/orbit_port.py. Test
programs: orbit/standard_runner_test.py (TestTrainer, TestEvaluator,
TestEvaluatorWithOutputsAggregation), orbit/controller_test.py (TestRunner with
train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6), steps_per_loop=2) and
orbit/examples/single_task/single_task_trainer_test.py (SingleTaskTrainer: ``inputs.pop(label_key)``
inside the tape's block, which made distribute.GradientTape's run again raise KeyError before the
fix in _invocation.copy_structure). Substitutions: tf.distribute -> distribute, tf.data ->
distribute.data, tf.GradientTape -> distribute.GradientTape, tf.function -> distribute.function,
tf_keras -> keras (Keras 3: reset_states -> reset_state, losses.MSE -> losses.mean_squared_error),
tf.reduce_mean -> keras.ops.mean, tf.constant(n) -> n, ``.numpy()`` -> np.asarray. Changes beyond
substitution: TestEvaluatorWithOutputsAggregation converts its local results to numpy before
concatenating them (see there); each program
runs inside ``strategy.scope()`` of MirroredStrategy over 2 CPU devices (orbit's tests use the
default strategy); the models start from fixed weights (TF's are random); the single-task test reads
the UCI iris data from scikit-learn (the test reads tfds' iris; same 150 rows, sklearn's order).

Expected values: TF 2.21 running the real orbit (tf-models-no-deps 2.19.0) and tf_keras 2.21 with
the same programs, data and initial weights under tf.distribute.MirroredStrategy over 2 logical
CPUs, recorded by tests/parity/record_tf_orbit.py (constants TF_* below); and the same program
under the default strategy (one device) here.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import distribute
import orbit_port as orbit
from helpers import mirrored

# -- orbit/standard_runner_test.py -------------------------------------------------------------


def dataset_fn(input_context=None):
    del input_context
    return distribute.data.Dataset.range(1).repeat().map(lambda _: np.zeros((1, 1), np.float32))


class TestTrainer(orbit.StandardTrainer):
    __test__ = False

    def __init__(self, options=None):
        self.strategy = distribute.get_strategy()
        self.global_step = orbit.create_global_step()
        dataset = self.strategy.distribute_datasets_from_function(dataset_fn)
        super().__init__(train_dataset=dataset, options=options)

    def train_loop_begin(self):
        self.global_step.assign(0)

    def train_step(self, iterator):
        def replica_step(_):
            self.global_step.assign_add(1)
        self.strategy.run(replica_step, args=(next(iterator),))

    def train_loop_end(self):
        return self.global_step.numpy()


class TestEvaluator(orbit.StandardEvaluator):
    __test__ = False

    def __init__(self, options=None):
        self.strategy = distribute.get_strategy()
        self.global_step = orbit.create_global_step()
        dataset = self.strategy.distribute_datasets_from_function(dataset_fn)
        super().__init__(eval_dataset=dataset, options=options)

    def eval_begin(self):
        self.global_step.assign(0)

    def eval_step(self, iterator):
        def replica_step(_):
            self.global_step.assign_add(1)
        self.strategy.run(replica_step, args=(next(iterator),))

    def eval_end(self):
        return self.global_step.numpy()


class TestEvaluatorWithOutputsAggregation(orbit.StandardEvaluator):
    __test__ = False

    def __init__(self, options=None):
        self.strategy = distribute.get_strategy()
        dataset = self.strategy.distribute_datasets_from_function(lambda _: distribute.data.Dataset.range(10))
        super().__init__(eval_dataset=dataset, options=options)

    def eval_begin(self):
        return {"logits": np.zeros((1,), np.float32)}  # was tf.constant((0.0,))

    def eval_reduce(self, state, step_outputs):
        # was tf.concat([state["logits"], step_outputs], 0). The local results live on two devices (committed
        # jax.Arrays) and one JAX op on both raises "incompatible devices" where TF copies implicitly, a
        # deliberate difference (docs/tf_compat.md: "JAX never copies a committed array between devices
        # implicitly"): converted to numpy first.
        step_outputs = [np.asarray(x) for x in step_outputs]
        state["logits"] = keras.ops.concatenate([state["logits"], keras.ops.stack(step_outputs)], 0)
        return state

    def eval_step(self, iterator):
        def replica_step(x):
            x = keras.ops.cast(x, "float32")
            return keras.ops.sum(x)
        return self.strategy.experimental_local_results(self.strategy.run(replica_step, args=(next(iterator),)))

    def eval_end(self, outputs):
        return keras.ops.sum(outputs["logits"])


def _in(strategy):
    return strategy.scope() if strategy is not None else _nothing()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


STRATEGIES = {"mirrored_2": lambda: mirrored(2), "one_device": lambda: None}


@pytest.mark.parametrize("where", sorted(STRATEGIES))
def test_standard_runner_trainer_and_evaluator_count_steps(where):
    """test_default_trainer / test_default_evaluator: 10 steps counted once each (ONLY_FIRST_REPLICA)."""
    with _in(STRATEGIES[where]()):
        assert TestTrainer().train(10) == 10
        for use_tf_while_loop in (True, False):
            options = orbit.StandardEvaluatorOptions(use_tf_while_loop=use_tf_while_loop)
            assert TestEvaluator(options).evaluate(10) == 10


# TF 2.21, tests/parity/record_tf_orbit.py standard_runner: evaluate(10) on range(10), then evaluate(5) twice
# with and without a new iterator each time. Under 2 replicas each step takes 2 elements (one per
# replica), so 5 steps read all 10; TF ends the loop at the end of the data.
TF_AGGREGATION = {
    "mirrored_2": {"evaluate_10": 45.0, "recreate": [45.0, 45.0], "keep": [45.0, 0.0]},
    "one_device": {"evaluate_10": 45.0, "recreate": [10.0, 10.0], "keep": [10.0, 35.0]},
}


@pytest.mark.parametrize("where", sorted(STRATEGIES))
@pytest.mark.parametrize("use_tf_while_loop", [True, False], ids=["tf_while_loop", "python_loop"])
def test_standard_runner_evaluator_with_outputs_aggregation(where, use_tf_while_loop):
    expected = TF_AGGREGATION[where]
    with _in(STRATEGIES[where]()):
        options = orbit.StandardEvaluatorOptions(use_tf_while_loop=use_tf_while_loop)
        if use_tf_while_loop and where == "mirrored_2":  # TF 2.21: OutOfRangeError (no try in that loop)
            with pytest.raises(StopIteration):
                TestEvaluatorWithOutputsAggregation(options).evaluate(10)
        else:
            assert float(TestEvaluatorWithOutputsAggregation(options).evaluate(10)) == expected["evaluate_10"]
        for recreate, key in ((True, "recreate"), (False, "keep")):
            options = orbit.StandardEvaluatorOptions(recreate_iterator_for_each_eval=recreate)
            evaluator = TestEvaluatorWithOutputsAggregation(options)
            assert [float(evaluator.evaluate(5)), float(evaluator.evaluate(5))] == expected[key]


def initial_weights(shapes, seed):
    """Fixed initial weights (tests/parity/record_tf_orbit.py sets the same in TF)."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-0.5, 0.5, size=s).astype(np.float32) for s in shapes]


# -- orbit/controller_test.py ------------------------------------------------------------------


def create_model():
    x = keras.layers.Input(shape=(3,), name="input")
    y = keras.layers.Dense(4, name="dense")(x)
    return keras.Model(x, y)


def controller_dataset_fn(ctx):  # controller_test.py's dataset_fn
    del ctx
    inputs = np.zeros((10, 3), dtype=np.float32)
    targets = np.ones((10, 4), dtype=np.float32)
    dataset = distribute.data.Dataset.from_tensor_slices((inputs, targets))
    dataset = dataset.repeat(100)
    return dataset.batch(10, drop_remainder=True)


class TestRunner(orbit.StandardTrainer, orbit.StandardEvaluator):
    __test__ = False

    def __init__(self, return_numpy=False):
        self.strategy = distribute.get_strategy()
        self.model = create_model()
        self.optimizer = keras.optimizers.RMSprop(learning_rate=0.1)
        self.global_step = self.optimizer.iterations
        self.train_loss = keras.metrics.Mean("train_loss", dtype="float32")
        self.eval_loss = keras.metrics.Mean("eval_loss", dtype="float32")
        self.return_numpy = return_numpy
        train_dataset = self.strategy.distribute_datasets_from_function(controller_dataset_fn)
        eval_dataset = self.strategy.distribute_datasets_from_function(controller_dataset_fn)
        orbit.StandardTrainer.__init__(self, train_dataset)
        orbit.StandardEvaluator.__init__(self, eval_dataset)

    def train_step(self, iterator):
        def _replicated_step(inputs):
            inputs, targets = inputs
            with distribute.GradientTape() as tape:
                outputs = self.model(inputs)
                loss = keras.ops.mean(keras.losses.mean_squared_error(targets, outputs))
            grads = tape.gradient(loss, self.model.variables)
            self.optimizer.apply_gradients(zip(grads, self.model.variables))
            self.train_loss.update_state(loss)
        self.strategy.run(_replicated_step, args=(next(iterator),))

    def train_loop_end(self):
        train_loss = self.train_loss.result()
        return {"loss": np.asarray(train_loss) if self.return_numpy else train_loss}  # was .numpy()

    def eval_begin(self):
        self.eval_loss.reset_state()

    def eval_step(self, iterator):
        def _replicated_step(inputs):
            inputs, targets = inputs
            outputs = self.model(inputs)
            loss = keras.ops.mean(keras.losses.mean_squared_error(targets, outputs))
            self.eval_loss.update_state(loss)
        self.strategy.run(_replicated_step, args=(next(iterator),))

    def eval_end(self):
        eval_loss = self.eval_loss.result()
        return {"eval_loss": np.asarray(eval_loss) if self.return_numpy else eval_loss}  # was .numpy()


# TF 2.21, tests/parity/record_tf_orbit.py controller: TestRunner(return_numpy=True) from the weights
# initial_weights([(3, 4), (4,)], 0), Controller(steps_per_loop=2).train_and_evaluate(10, 2, 6); the
# train loss after each inner loop of 2 steps (train_actions), the eval loss after steps 6 and 10.
TF_CONTROLLER = {
    "mirrored_2": {
        "train_loss": [0.9453234076499939, 0.6466351747512817, 0.48469653725624084, 0.3826267123222351,
                       0.31313470005989075],
        "eval_loss": [0.09066411852836609, 0.018503038212656975],
        "bias": [0.999758243560791, 0.7729976177215576, 0.9968071579933167, 0.8500939607620239]},
    "one_device": {
        "train_loss": [0.9453237056732178, 0.6466355323791504, 0.4846968650817871, 0.3826269805431366,
                       0.31313490867614746],
        "eval_loss": [0.09066426753997803, 0.018503088504076004],
        "bias": [0.999758243560791, 0.7729973793029785, 0.9968070387840271, 0.8500936627388]},
}


def _controller_run(strategy):
    with _in(strategy):
        runner = TestRunner(return_numpy=True)
        runner.model.set_weights(initial_weights([(3, 4), (4,)], 0))
        controller = orbit.Controller(trainer=runner, evaluator=runner, global_step=runner.global_step,
                                      steps_per_loop=2)
        controller.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
    return runner, controller


@pytest.mark.parametrize("where", sorted(STRATEGIES))
def test_controller_train_and_evaluate_gives_tf_values(where):
    """test_no_checkpoint_and_summaries: global_step reaches 10; the losses and weights are TF 2.21's."""
    runner, controller = _controller_run(STRATEGIES[where]())
    expected = TF_CONTROLLER[where]
    assert int(runner.global_step.numpy()) == 10
    assert [s for s, _ in controller.train_outputs] == [2, 4, 6, 8, 10]
    assert [s for s, _ in controller.eval_outputs] == [6, 10]
    np.testing.assert_allclose([float(o["loss"]) for _, o in controller.train_outputs], expected["train_loss"], rtol=2e-6)
    np.testing.assert_allclose([float(o["eval_loss"]) for _, o in controller.eval_outputs], expected["eval_loss"],
                               rtol=1e-5)
    kernel, bias = runner.model.get_weights()
    np.testing.assert_array_equal(kernel, initial_weights([(3, 4), (4,)], 0)[0])  # zero inputs: no kernel gradient
    np.testing.assert_allclose(bias, expected["bias"], rtol=1e-6)


def test_controller_two_replicas_equal_one_device():
    """The gradients summed over 2 replicas are 2x one device's (each replica's loss is its own mean, as
    TF); RMSprop divides by their RMS, so the weights and losses match one device's up to its epsilon
    and float32 rounding (TF 2.21's two runs above differ by up to 2.7e-6 relative too)."""
    two, two_ctl = _controller_run(mirrored(2))
    one, one_ctl = _controller_run(None)
    for (_, a), (_, b) in zip(two_ctl.train_outputs + two_ctl.eval_outputs, one_ctl.train_outputs + one_ctl.eval_outputs):
        for key in a:
            np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=1e-5)  # TF's own 2-vs-1: 2.7e-6
    for a, b in zip(two.model.get_weights(), one.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# -- orbit/examples/single_task/single_task_trainer_test.py -----------------------------------
# TF 2.21, tests/parity/record_tf_orbit.py single_task: the train loss after controller.train(1) and
# after controller.train(500), and the last layer's bias, with the plain dataset (every replica gets
# the whole batch, as TF's strategy.run with a non-distributed input) and with
# strategy.experimental_distribute_dataset(train_ds) (16 rows per replica; 11 | 11 at each epoch's end).
TF_SINGLE_TASK = {
    "plain": {"start_loss": 1.1086153984069824, "end_loss": 0.33734074234962463,
              "last_bias": [0.38716375827789307, 0.19790209829807281, -0.28601598739624023]},
    "distributed": {"start_loss": 1.1086153984069824, "end_loss": 0.33734065294265747,
                    "last_bias": [0.38716375827789307, 0.19790209829807281, -0.286016047000885]},
}


def _iris():
    from sklearn.datasets import load_iris

    data = load_iris()
    return {"features": data.data.astype(np.float32), "label": data.target.astype(np.int32)}


def _single_task(strategy, distributed):
    with _in(strategy):
        train_ds = distribute.data.Dataset.from_tensor_slices(_iris()).batch(32).repeat()
        if distributed:
            train_ds = distribute.get_strategy().experimental_distribute_dataset(train_ds)
        model = keras.Sequential([
            keras.Input(shape=(4,), name="features"),
            keras.layers.Dense(10, activation="relu"),  # was tf.nn.relu
            keras.layers.Dense(10, activation="relu"),
            keras.layers.Dense(3),
            keras.layers.Softmax(),
        ])
        model.set_weights(initial_weights([(4, 10), (10,), (10, 10), (10,), (10, 3), (3,)], 1))
        trainer = orbit.SingleTaskTrainer(
            train_ds, label_key="label", model=model,
            loss_fn=keras.losses.sparse_categorical_crossentropy,
            optimizer=keras.optimizers.SGD(learning_rate=0.01))
        controller = orbit.Controller(trainer=trainer, steps_per_loop=100, global_step=trainer.optimizer.iterations)
        controller.train(1)
        start_loss = float(trainer.train_loss.result())
        controller.train(500)
        end_loss = float(trainer.train_loss.result())
    return start_loss, end_loss, model.get_weights()


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_single_task_trainer_pops_the_label_in_the_tape_block_and_gives_tf_values(distributed):
    """The trainer's ``inputs.pop(self.label_key)`` inside ``with tape:`` (KeyError before the fix), 501
    steps under MirroredStrategy(2): TF 2.21's losses and last bias; distributed, also one device's weights."""
    start_loss, end_loss, weights = _single_task(mirrored(2), distributed)
    assert end_loss < start_loss / 2  # the test's own assertion
    expected = TF_SINGLE_TASK["distributed" if distributed else "plain"]
    np.testing.assert_allclose([start_loss, end_loss], [expected["start_loss"], expected["end_loss"]], rtol=1e-5)
    np.testing.assert_allclose(weights[-1], expected["last_bias"], rtol=1e-4, atol=1e-6)
    if not distributed:
        return  # TF's one-device run equals this one bit for bit; the distributed variant checks one device
    one = _single_task(None, distributed)
    np.testing.assert_allclose([start_loss, end_loss], one[:2], rtol=1e-5)
    for a, b in zip(weights, one[2]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
