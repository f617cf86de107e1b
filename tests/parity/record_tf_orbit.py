"""Records TF 2.21's answers for tests/test_port_orbit.py and tests/test_port_bert_training_loop.py.

Runs the real orbit and Model Garden code under TensorFlow 2.21 (MirroredStrategy over 2 logical
CPUs, and the default strategy), with the inputs and initial weights the ports use, and prints JSON:

    /work/tfvenv/bin/pip install tensorflow-cpu==2.21.0 tf_keras==2.21.0 scikit-learn
    /work/tfvenv/bin/pip install --no-deps tf-models-no-deps==2.19.0   # orbit + official/ (no deps)
    /work/tfvenv/bin/python tests/parity/record_tf_orbit.py [standard_runner|controller|single_task|bert]

The tests keep the printed values as constants. orbit's own test modules (orbit/standard_runner_test.py,
orbit/controller_test.py) are imported as shipped; tf.keras is tf_keras (TF_USE_LEGACY_KERAS=1), as
orbit's examples need (``metric.reset_states()``).
"""

import contextlib
import json
import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import orbit  # noqa: E402
from orbit import controller_test, standard_runner, standard_runner_test  # noqa: E402
from orbit.examples.single_task import single_task_trainer  # noqa: E402

SECTION = sys.argv[1] if len(sys.argv) > 1 else None
RESULTS = {"meta": {"tensorflow_version": tf.__version__, "tf_keras_version": tf_keras.__version__,
                    "command": "/work/tfvenv/bin/python tests/parity/record_tf_orbit.py"}}


def strategies():
    return {"mirrored_2": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
            "one_device": tf.distribute.get_strategy()}


def jl(x):
    if isinstance(x, dict):
        return {k: jl(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jl(v) for v in x]
    return np.asarray(x).tolist()


def guarded(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the error is the recorded answer
        return {"error": type(e).__name__, "msg": str(e).splitlines()[0][:200]}


def initial_weights(shapes, seed):
    """The ports' initial weights (the same function is in the tests)."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-0.5, 0.5, size=s).astype(np.float32) for s in shapes]


def record_standard_runner():
    out = {}
    for where, strategy in strategies().items():
        with strategy.scope():
            r = {"trainer_10": guarded(lambda: int(standard_runner_test.TestTrainer().train(tf.constant(10))))}
            for loop in (True, False):
                options = standard_runner.StandardEvaluatorOptions(use_tf_while_loop=loop)
                r[f"evaluator_10_while_{loop}"] = guarded(
                    lambda: int(standard_runner_test.TestEvaluator(options).evaluate(tf.constant(10))))
                r[f"aggregation_10_while_{loop}"] = guarded(lambda: float(
                    standard_runner_test.TestEvaluatorWithOutputsAggregation(options).evaluate(tf.constant(10))))
            for recreate in (True, False):
                options = standard_runner.StandardEvaluatorOptions(recreate_iterator_for_each_eval=recreate)

                def twice():
                    evaluator = standard_runner_test.TestEvaluatorWithOutputsAggregation(options)
                    return [float(evaluator.evaluate(tf.constant(5))), float(evaluator.evaluate(tf.constant(5)))]
                r[f"repeat_recreate_{recreate}"] = guarded(twice)
        out[where] = r
    return out


def record_controller():
    out = {}
    for where, strategy in strategies().items():
        with strategy.scope():
            runner = controller_test.TestRunner(return_numpy=True)
            runner.model.set_weights(initial_weights([(3, 4), (4,)], 0))
            train_out, eval_out = [], []
            ctl = orbit.Controller(trainer=runner, evaluator=runner, global_step=runner.global_step,
                                   steps_per_loop=2,
                                   train_actions=[lambda o: train_out.append(float(o["loss"]))],
                                   eval_actions=[lambda o: eval_out.append(float(o["eval_loss"]))])
            ctl.train_and_evaluate(train_steps=10, eval_steps=2, eval_interval=6)
            out[where] = {"global_step": int(runner.global_step.numpy()), "train_loss": train_out,
                          "eval_loss": eval_out, "weights": jl(runner.model.get_weights())}
    return out


def iris():
    from sklearn.datasets import load_iris

    data = load_iris()
    return {"features": data.data.astype(np.float32), "label": data.target.astype(np.int64)}


def record_single_task():
    out = {}
    for where, strategy in strategies().items():
        for distributed in (False, True):
            with strategy.scope():
                train_ds = tf.data.Dataset.from_tensor_slices(iris()).batch(32).repeat()
                if distributed:
                    train_ds = strategy.experimental_distribute_dataset(train_ds)
                model = tf_keras.Sequential([
                    tf_keras.Input(shape=(4,), name="features"),
                    tf_keras.layers.Dense(10, activation=tf.nn.relu),
                    tf_keras.layers.Dense(10, activation=tf.nn.relu),
                    tf_keras.layers.Dense(3),
                    tf_keras.layers.Softmax(),
                ])
                model.set_weights(initial_weights([(4, 10), (10,), (10, 10), (10,), (10, 3), (3,)], 1))
                trainer = single_task_trainer.SingleTaskTrainer(
                    train_ds, label_key="label", model=model,
                    loss_fn=tf_keras.losses.sparse_categorical_crossentropy,
                    optimizer=tf_keras.optimizers.SGD(learning_rate=0.01))
                controller = orbit.Controller(trainer=trainer, steps_per_loop=100,
                                              global_step=trainer.optimizer.iterations)
                controller.train(1)
                start_loss = float(trainer.train_loss.result().numpy())
                controller.train(500)
                end_loss = float(trainer.train_loss.result().numpy())
            out[f"{where}_distributed_{distributed}"] = {"start_loss": start_loss, "end_loss": end_loss,
                                                         "weights": jl(model.get_weights())}
    return out


SECTIONS = {"standard_runner": record_standard_runner, "controller": record_controller,
            "single_task": record_single_task}

# -- official/legacy/bert/model_training_utils_test.py --------------------------------------------
def record_bert():
    import tempfile

    from official.legacy.bert import model_training_utils, model_training_utils_test as mtu_test

    out = {}
    for where, strategy in strategies().items():
        for scalar_loss in (False, True):
            np.random.seed(0)  # the test's np.random data, made in each _dataset_fn call
            built = {}

            def model_fn():
                model, sub_model = mtu_test.create_model_fn(input_shape=[128], num_classes=3)()
                model.set_weights(initial_weights([(128, 3), (3,), (3, 3), (3,)], 2))
                built["model"] = model
                return model, sub_model

            def input_fn(input_context=None):  # the test's, without shuffle(64) (its order is TF's RNG)
                local_batch_size = input_context.get_per_replica_batch_size(8)
                features = np.random.rand(64, 128)
                labels = np.random.randint(2, size=[64, 3])
                dataset = tf.data.Dataset.from_tensor_slices((features, labels))
                dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
                dataset = dataset.map(lambda f, l: (tf.cast(f, tf.float32), tf.cast(l, tf.float32)))
                return dataset.repeat().batch(local_batch_size, drop_remainder=True).prefetch(64)

            def loss_fn(labels, outputs):
                # tf.identity: tf_keras' categorical_crossentropy would read the softmax's logits off the
                # output tensor (unclipped); Keras 3's, which the port uses, clips the probabilities.
                loss = tf_keras.losses.categorical_crossentropy(labels, tf.identity(outputs))
                return tf.reduce_mean(loss) if scalar_loss else loss

            callback = mtu_test.RecordingCallback()
            model_dir = tempfile.mkdtemp()
            model_training_utils.run_customized_training_loop(
                strategy=strategy, model_fn=model_fn, loss_fn=loss_fn, model_dir=model_dir,
                steps_per_epoch=20, num_eval_per_epoch=4, steps_per_loop=10, epochs=2,
                train_input_fn=input_fn, eval_input_fn=input_fn, eval_steps=10, init_checkpoint=None,
                metric_fn=mtu_test.metric_fn, custom_callbacks=[callback], run_eagerly=False)
            with open(os.path.join(model_dir, "summaries", "training_summary.txt")) as f:
                summary = json.load(f)
            out[f"{where}_scalar_loss_{scalar_loss}"] = {
                "summary": summary,
                "batch_end": [[int(b), {k: float(v) for k, v in logs.items()}] for b, logs in callback.batch_end],
                "epoch_end": [[int(e), {k: float(v) for k, v in logs.items()}] for e, logs in callback.epoch_end],
                "weights": jl(built["model"].get_weights())}
    return out


SECTIONS["bert"] = record_bert


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):  # orbit's Controller prints its log lines
        for name, fn in SECTIONS.items():
            if SECTION in (None, name):
                RESULTS[name] = fn()
    print(json.dumps(RESULTS))
