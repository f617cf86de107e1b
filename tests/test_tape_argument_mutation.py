"""A step that changes its own arguments inside (or before) a ``distribute.GradientTape`` block.

``tape.gradient`` runs the step function again from its start (``distribute/tape/_replay.py``); the
run again must see the arguments as the step received them, not as its first run left them. The
kind: orbit's ``StandardTrainer`` steps do ``inputs.pop("label")`` inside ``with tape:`` (the run
again raised ``KeyError: 'label'``); appending to a list argument or rewriting a nested dict's entry
gave silently wrong gradients (the run again saw the appended item / the rewritten value twice).

Expected values: the gradients in closed form, computed with numpy from each replica's rows (TF's
tape gives these: TF records the block once, so the first run's mutation is seen once).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import distribute
from helpers import mirrored

X = np.arange(14, dtype=np.float32).reshape(7, 2) / 10.0
LABEL = (np.arange(7, dtype=np.float32) + 1.0) / 4.0
W0 = np.array([0.5, -1.0], np.float32)


def _split(rows: int, num_replicas: int) -> list[slice]:
    share = -(-rows // num_replicas)
    return [slice(min(r * share, rows), min((r + 1) * share, rows)) for r in range(num_replicas)]


def _per_replica_grads(strategy, step, make_args, rows):
    """Runs ``step`` on the first ``rows`` rows, one global batch; returns each replica's gradient."""
    with strategy.scope():
        w = keras.Variable(W0)
    data = distribute.data.Dataset.from_tensor_slices({"x": X[:rows], "label": LABEL[:rows]}).batch(rows)
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    grads = strategy.run(step(w), args=(make_args(batch),))  # the step gets the structure itself
    return [np.asarray(g) for g in strategy.experimental_local_results(grads)]


def _pop_label(w):  # orbit's StandardTrainer step: the label popped inside the tape's block
    def step(inputs):
        with distribute.GradientTape() as tape:
            label = inputs.pop("label")
            loss = keras.ops.sum(keras.ops.matmul(inputs["x"], w) * label)
        return tape.gradient(loss, w)
    return step


def _append_to_list(w):
    def step(xs):
        xs.append(xs[0] * 2.0)  # before the block: the list then holds x and 2x
        with distribute.GradientTape() as tape:
            loss = sum(keras.ops.sum(keras.ops.matmul(x, w)) for x in xs)
        return tape.gradient(loss, w)
    return step


def _rewrite_nested(w):
    def step(inputs):
        with distribute.GradientTape() as tape:
            inputs["features"]["x"] = inputs["features"]["x"] * 2.0
            inputs["features"]["seen"].append(1)  # a list in the argument: the step saw it empty
            scale = float(len(inputs["features"]["seen"]))  # 1.0 when the step sees its own arguments
            loss = keras.ops.sum(keras.ops.matmul(inputs["features"]["x"], w)) * scale
        return tape.gradient(loss, w)
    return step


CASES = {
    # name: (step, the step's argument from the dataset's dict, the expected gradient from a replica's rows)
    "pop_from_a_dict": (_pop_label, dict, lambda x, label: (x * label[:, None]).sum(0)),
    "append_to_a_list": (_append_to_list, lambda inputs: [inputs["x"]], lambda x, label: 3.0 * x.sum(0)),
    "mutate_a_nested_dict": (_rewrite_nested, lambda inputs: {"features": {"x": inputs["x"], "seen": []}},
                             lambda x, label: 2.0 * x.sum(0)),
}


@pytest.mark.parametrize("rows", [4, 3], ids=["full_step", "uneven_step"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_run_again_sees_the_arguments_as_the_step_received_them(name, rows):
    step, make_args, expected = CASES[name]
    strategy = mirrored(2)
    grads = _per_replica_grads(strategy, step, make_args, rows)
    for grad, rows_of in zip(grads, _split(rows, 2)):
        np.testing.assert_allclose(grad, expected(X[rows_of], LABEL[rows_of]), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_distribute_function_outside_any_strategy(name):
    """One device: ``@distribute.function`` of the step, called with plain arrays (the default strategy)."""
    step, make_args, expected = CASES[name]
    w = keras.Variable(W0)
    inputs = {"x": X[:4], "label": LABEL[:4]}
    grad = distribute.function(step(w))(make_args(inputs))
    np.testing.assert_allclose(np.asarray(grad), expected(X[:4], LABEL[:4]), rtol=1e-6)


def test_second_order_replays_also_start_from_the_arguments_as_received():
    """Nested tapes: the inner gradient's run again runs inside the outer's; each starts afresh."""
    w = keras.Variable(np.float32(3.0))

    @distribute.function
    def step(inputs):
        with distribute.GradientTape() as outer:
            with distribute.GradientTape() as inner:
                x = inputs.pop("x")
                y = w * w * w * x
            dy = inner.gradient(y, w)  # 3 w^2 x
        return dy, outer.gradient(dy, w)  # 6 w x

    dy, d2y = step({"x": np.float32(2.0)})
    assert (float(dy), float(d2y)) == (54.0, 36.0)



def test_copy_structure_copies_every_container_keeps_leaves_and_aliasing():
    """The copy the run again starts from (_invocation.copy_structure): new containers at every depth,
    the same leaf objects, a container given twice copied once (as copy.deepcopy's memo)."""
    import collections

    from distribute._invocation import copy_structure

    model = keras.Sequential([keras.layers.Dense(1)])
    shared = {"x": np.ones(2, np.float32)}
    Pair = collections.namedtuple("Pair", "a b")
    original = ([shared, shared], {"pair": Pair([1], (2, [3])), "model": model, "set": {1}},
                collections.defaultdict(list, k=[4]))
    copied = copy_structure(original)
    assert copied[0][0] is copied[0][1] and copied[0][0] is not shared
    assert copied[0][0]["x"] is not shared["x"] and np.array_equal(copied[0][0]["x"], shared["x"])
    assert copied[1]["model"] is model  # an object that is not a container: the same object
    assert type(copied[1]["pair"]) is Pair and copied[1]["pair"].b[1] == [3]
    assert copied[1]["pair"].a is not original[1]["pair"].a and copied[1]["set"] is not original[1]["set"]
    assert copied[2].default_factory is list and copied[2]["k"] == [4] and copied[2]["k"] is not original[2]["k"]
    copied[0][0].pop("x")
    copied[1]["pair"].b[1].append(5)
    assert "x" in shared and original[1]["pair"].b[1] == [3]  # changing the copy leaves the original
