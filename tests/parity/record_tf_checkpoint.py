"""Record tf.train checkpoint behaviour from TensorFlow 2.21 into tf_2_21_checkpoint.json.

    /work/tfvenv/bin/python tests/parity/record_tf_checkpoint.py

Kept apart from record_tf.py (one small process, no strategies): CheckpointManager's
numbering and max_to_keep (as tensorflow/python/checkpoint/checkpoint_management_test.py),
latest_checkpoint, the int64 round trip, deferred restoration into an unbuilt Keras model.
"""

import json
import os
import tempfile

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["KERAS_BACKEND"] = "tensorflow"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_2_21_checkpoint.json")


def base(paths):
    return [os.path.basename(p) for p in paths]


def manager_case():
    d = tempfile.mkdtemp()
    v = tf.Variable(1.0)
    ckpt = tf.train.Checkpoint(v=v)
    m = tf.train.CheckpointManager(ckpt, d, max_to_keep=2)
    out = {"latest_before": m.latest_checkpoint, "saves": []}
    for i in range(3):
        v.assign(float(i + 10))
        out["saves"].append(os.path.basename(m.save()))
    out["checkpoints"] = base(m.checkpoints)
    out["latest"] = os.path.basename(m.latest_checkpoint)
    out["save_number_10"] = os.path.basename(m.save(checkpoint_number=10))
    out["checkpoints_after_10"] = base(m.checkpoints)
    out["tf_latest_checkpoint"] = os.path.basename(tf.train.latest_checkpoint(d))
    # a relaunched job: a fresh manager on the same directory
    v2 = tf.Variable(0.0)
    ckpt2 = tf.train.Checkpoint(v=v2)
    m2 = tf.train.CheckpointManager(ckpt2, d, max_to_keep=2)
    out["fresh_checkpoints"] = base(m2.checkpoints)
    out["restore_or_initialize"] = os.path.basename(m2.restore_or_initialize())
    out["restored_value"] = float(v2.numpy())
    out["restored_save_counter"] = int(ckpt2.save_counter.numpy())
    out["fresh_save"] = os.path.basename(m2.save())
    # keep every checkpoint
    d2 = tempfile.mkdtemp()
    m3 = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), d2, max_to_keep=None)
    out["keep_all"] = [os.path.basename(m3.save()) for _ in range(4)]
    out["keep_all_checkpoints"] = base(m3.checkpoints)
    out["latest_of_missing_dir"] = tf.train.latest_checkpoint(os.path.join(d2, "nothing"))
    out["latest_of_empty_dir"] = tf.train.latest_checkpoint(tempfile.mkdtemp())
    empty = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), tempfile.mkdtemp(), max_to_keep=1)
    out["restore_or_initialize_empty"] = empty.restore_or_initialize()
    return out


def int64_case():
    d = tempfile.mkdtemp()
    v = keras.Variable(initializer=7, shape=(), dtype="int64")
    path = tf.train.Checkpoint(step=v).save(os.path.join(d, "c"))
    w = keras.Variable(initializer=0, shape=(), dtype="int64")
    tf.train.Checkpoint(step=w).restore(path).assert_consumed()
    return {"value": int(w.numpy()), "dtype": str(w.dtype), "path": os.path.basename(path)}


def deferred_case():
    d = tempfile.mkdtemp()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    path = tf.train.Checkpoint(model=model).save(os.path.join(d, "c"))
    saved = [w.tolist() for w in model.get_weights()]
    keras.utils.set_random_seed(2)
    fresh = keras.Sequential([keras.layers.Dense(2)])
    out = {"saved": saved}
    try:
        status = tf.train.Checkpoint(model=fresh).restore(path)
        try:
            status.assert_consumed()
            out["assert_consumed_before_build"] = "passed"
        except AssertionError as err:
            out["assert_consumed_before_build"] = "AssertionError"
            out["message"] = str(err)[:200]
        fresh.build((None, 3))
        out["after_build"] = [w.tolist() for w in fresh.get_weights()]
        out["equal_after_build"] = all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), model.get_weights()))
    except Exception as err:  # noqa: BLE001
        out["error"] = f"{type(err).__name__}: {err}"[:300]
    return out


if __name__ == "__main__":
    result = {"meta": {"tensorflow_version": tf.__version__, "keras_version": keras.__version__,
                       "command": "/work/tfvenv/bin/python tests/parity/record_tf_checkpoint.py"},
              "manager": manager_case(), "int64": int64_case(), "deferred": deferred_case()}
    with open(OUT, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
