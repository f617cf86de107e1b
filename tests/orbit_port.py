"""The pieces of orbit (tensorflow/models, orbit/) that orbit's own tests use, ported by substitution.

orbit imports TensorFlow, so the parts that its tests and examples need are rewritten here with
``tf.distribute`` -> ``distribute``, ``tf.function`` -> ``distribute.function``, ``tf.range`` ->
``range`` (``distribute.function`` applies no autograph: the loop runs as Python, each
``strategy.run`` one compiled program), ``tf.nest.map_structure(iter, ...)`` -> ``_map(iter, ...)``,
``tf.convert_to_tensor(n, tf.int32)`` -> ``np.int32(n)``, ``tf.keras`` -> ``keras``. Summaries,
checkpoint managers, actions and the TPU summary optimization are left out (the ported tests pass
none). Sources (Apache-2.0, The Orbit Authors): orbit/standard_runner.py, orbit/utils/loop_fns.py,
orbit/utils/common.py (create_global_step), orbit/controller.py,
orbit/examples/single_task/single_task_trainer.py, as shipped in tf-models-no-deps 2.19.0.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional

import keras
import numpy as np

import distribute


def _map(fn, structure):  # tf.nest.map_structure over a dict of datasets or one dataset
    if isinstance(structure, dict):
        return {k: _map(fn, v) for k, v in structure.items()}
    return fn(structure)


def create_global_step() -> keras.Variable:  # orbit/utils/common.py
    return keras.Variable(0, dtype="int64", name="global_step", trainable=False,
                          aggregation="only_first_replica")


# -- orbit/utils/loop_fns.py -------------------------------------------------------------------
def create_loop_fn(step_fn):
    def loop_fn(iterator, num_steps, state=None, reduce_fn=None):
        try:
            step = 0
            while num_steps == -1 or step < num_steps:
                outputs = step_fn(iterator)
                if reduce_fn is not None:
                    state = reduce_fn(state, outputs)
                step += 1
            return state
        except StopIteration:  # was (StopIteration, tf.errors.OutOfRangeError)
            return state
    return loop_fn


def create_tf_while_loop_fn(step_fn):
    def loop_fn(iterator, num_steps):
        for _ in range(num_steps):  # was tf.range(num_steps)
            step_fn(iterator)
    return loop_fn


def create_tf_while_loop_fn_with_state(step_fn):
    def loop_fn(iterator, num_steps, state, reduce_fn):
        for _ in range(num_steps):  # was tf.range(num_steps), with shape invariants for the state
            outputs = step_fn(iterator)
            state = reduce_fn(state, outputs)
        return state
    return loop_fn


# -- orbit/standard_runner.py ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StandardTrainerOptions:
    use_tf_function: bool = True
    use_tf_while_loop: bool = True
    use_tpu_summary_optimization: bool = False


class StandardTrainer(metaclass=abc.ABCMeta):
    def __init__(self, train_dataset, options: Optional[StandardTrainerOptions] = None):
        options = options or StandardTrainerOptions()
        if options.use_tf_while_loop and not options.use_tf_function:
            raise ValueError("`use_tf_while_loop=True` and `use_tf_function=False` is not supported")
        self._train_options = options
        self._train_dataset = train_dataset
        self._train_iter = None
        self._train_loop_fn = None

    def create_train_loop_fn(self):
        train_step_fn = self.train_step
        if self._train_options.use_tf_while_loop:
            loop_fn = distribute.function(create_tf_while_loop_fn(train_step_fn))
        else:
            if self._train_options.use_tf_function:
                train_step_fn = distribute.function(train_step_fn)
            loop_fn = create_loop_fn(train_step_fn)
        return loop_fn

    def train(self, num_steps):
        self.train_loop_begin()
        if self._train_loop_fn is None:
            self._train_loop_fn = self.create_train_loop_fn()
        if self._train_iter is None:
            self._train_iter = _map(iter, self.train_dataset)
        self._train_loop_fn(self._train_iter, num_steps)
        return self.train_loop_end()

    def train_loop_begin(self):
        pass

    @abc.abstractmethod
    def train_step(self, iterator):
        pass

    def train_loop_end(self):
        pass

    @property
    def train_dataset(self):
        return self._train_dataset


@dataclasses.dataclass(frozen=True)
class StandardEvaluatorOptions:
    use_tf_function: bool = True
    use_tf_while_loop: bool = False
    recreate_iterator_for_each_eval: bool = True


class StandardEvaluator(metaclass=abc.ABCMeta):
    def __init__(self, eval_dataset, options: Optional[StandardEvaluatorOptions] = None):
        options = options or StandardEvaluatorOptions()
        if options.use_tf_while_loop and not options.use_tf_function:
            raise ValueError("`use_tf_while_loop=True` and `use_tf_function=False` is not supported")
        self._eval_options = options
        self._eval_dataset = eval_dataset
        self._eval_iter = None
        self._eval_loop_fn = None

    def create_eval_loop_fn(self, has_state: bool):
        eval_step_fn = self.eval_step
        if self._eval_options.use_tf_while_loop:
            if has_state:
                loop_fn = create_tf_while_loop_fn_with_state(eval_step_fn)
            else:
                loop_fn = create_tf_while_loop_fn(eval_step_fn)
            loop_fn = distribute.function(loop_fn)
        else:
            if self._eval_options.use_tf_function:
                eval_step_fn = distribute.function(eval_step_fn)
            loop_fn = create_loop_fn(eval_step_fn)
        return loop_fn

    def evaluate(self, num_steps):
        if self._eval_options.use_tf_while_loop and num_steps == -1:
            raise ValueError("Looping until exhausted is not supported if `options.use_tf_while_loop` is `True`")
        outputs = self.eval_begin()
        has_state = outputs is not None
        if self._eval_loop_fn is None:
            self._eval_loop_fn = self.create_eval_loop_fn(has_state)
        if self._eval_iter is None:
            eval_iter = _map(iter, self.eval_dataset)
            if not self._eval_options.recreate_iterator_for_each_eval:
                self._eval_iter = eval_iter
        else:
            eval_iter = self._eval_iter
        if self._eval_options.use_tf_while_loop and not has_state:
            self._eval_loop_fn(eval_iter, num_steps)
        else:
            outputs = self._eval_loop_fn(eval_iter, num_steps, state=outputs, reduce_fn=self.eval_reduce)
        if outputs is None:
            return self.eval_end()
        return self.eval_end(outputs)

    def eval_begin(self) -> Any:
        pass

    @abc.abstractmethod
    def eval_step(self, iterator) -> Any:
        pass

    def eval_end(self, *args):
        pass

    def eval_reduce(self, state=None, step_outputs=None) -> Any:
        pass

    @property
    def eval_dataset(self):
        return self._eval_dataset


# -- orbit/controller.py (no summaries, checkpoints or actions) ---------------------------------
def _get_value(x):  # orbit.utils.get_value
    return np.asarray(x) if hasattr(x, "shape") or hasattr(x, "numpy") else x


class Controller:
    def __init__(self, *, global_step, trainer=None, evaluator=None, strategy=None, steps_per_loop=None):
        if trainer is None and evaluator is None:
            raise ValueError("`trainer` and `evaluator` should not both be `None`.")
        if trainer is not None and (not isinstance(steps_per_loop, int) or steps_per_loop < 1):
            raise ValueError(f"`steps_per_loop` ({steps_per_loop}) must be a positive integer.")
        self.trainer = trainer
        self.evaluator = evaluator
        self.strategy = strategy or distribute.get_strategy()
        self.global_step = global_step
        self.steps_per_loop = steps_per_loop
        self.train_outputs: list = []  # what the original logs: (step, train output) per inner loop
        self.eval_outputs: list = []

    def train(self, steps: int, checkpoint_at_completion: bool = True):
        current_step = self.global_step.numpy()
        while current_step < steps:
            num_steps = min(steps - current_step, self.steps_per_loop)
            self._train_n_steps(num_steps)
            current_step = self.global_step.numpy()

    def evaluate(self, steps: int = -1):
        if steps <= 0 and steps != -1:
            raise ValueError(f"`steps` ({steps}) should be > 0, or == -1.")
        eval_output = self.evaluator.evaluate(np.int32(steps)) or {}
        eval_output = _map_dict(_get_value, eval_output)
        self.eval_outputs.append((int(self.global_step.numpy()), eval_output))
        return eval_output

    def train_and_evaluate(self, train_steps: int, eval_steps: int = -1, eval_interval: Optional[int] = None):
        current_step = self.global_step.numpy()
        eval_interval = eval_interval or (train_steps - current_step)
        while current_step < train_steps:
            interval = min(train_steps - current_step, eval_interval)
            num_steps = current_step + interval
            self.train(steps=num_steps, checkpoint_at_completion=False)
            self.evaluate(steps=eval_steps)
            current_step = self.global_step.numpy()

    def _train_n_steps(self, num_steps: int):
        current_step = self.global_step.numpy()
        train_output = self.trainer.train(np.int32(num_steps))
        expected_step = current_step + num_steps
        if self.global_step.numpy() != expected_step:
            raise RuntimeError(f"`trainer.train({num_steps})` did not update `global_step` by {num_steps}: "
                               f"{current_step} -> {self.global_step.numpy()}")  # orbit logs a warning
        self.train_outputs.append((int(self.global_step.numpy()), _map_dict(_get_value, train_output or {})))


def _map_dict(fn, output):
    return {k: _map_dict(fn, v) if isinstance(v, dict) else fn(v) for k, v in output.items()}


# -- orbit/examples/single_task/single_task_trainer.py -----------------------------------------
class SingleTaskTrainer(StandardTrainer):
    def __init__(self, train_dataset, label_key, model, loss_fn, optimizer, metrics=None, trainer_options=None):
        self.label_key = label_key
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.strategy = distribute.get_strategy()
        self.train_loss = keras.metrics.Mean("training_loss", dtype="float32")
        if metrics is None:
            self.metrics = []
        elif isinstance(metrics, list):
            self.metrics = metrics
        else:
            self.metrics = [metrics]
        super().__init__(train_dataset=train_dataset, options=trainer_options)

    def train_loop_begin(self):
        self.train_loss.reset_state()  # Keras 3: reset_states -> reset_state
        for metric in self.metrics:
            metric.reset_state()

    def train_step(self, iterator):
        def train_fn(inputs):
            with distribute.GradientTape() as tape:
                # Extract the target value and delete it from the input dict, so that the model never sees it.
                target = inputs.pop(self.label_key)
                output = self.model(inputs, training=True)
                loss = keras.ops.mean(self.loss_fn(target, output))  # was tf.reduce_mean
                scaled_loss = loss / self.strategy.num_replicas_in_sync
                gradients = tape.gradient(scaled_loss, self.model.trainable_variables)
                self.optimizer.apply_gradients(list(zip(gradients, self.model.trainable_variables)))
                self.train_loss.update_state(loss)
                for metric in self.metrics:
                    metric.update_state(target, output)
        self.strategy.run(train_fn, args=(next(iterator),))

    def train_loop_end(self):
        with self.strategy.scope():
            metrics = {metric.name: metric.result() for metric in self.metrics}
            metrics[self.train_loss.name] = self.train_loss.result()
        return metrics
