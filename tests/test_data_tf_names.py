"""tf.data's names on distribute.data.Dataset, asserted against TensorFlow 2.21 values (tests/parity/tf_2_21.json, "data").

Every case builds the same pipeline as tests/parity/record_tf_data.py with
``tf.data`` replaced by ``distribute.data`` (numpy in place of tf ops) and
compares elements, cardinality and element_spec.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tf_fixture

from distribute.data import AUTOTUNE, TensorSpec
from distribute.data import Dataset as D

TF = tf_fixture()["data"]


def plain(x):
    """An element as JSON-like Python (bytes -> str), like the recorder's ``py``."""
    if isinstance(x, (tuple, list)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    x = np.asarray(x)
    if x.dtype.kind == "S":
        return np.char.decode(x, "utf-8").tolist() if x.ndim else x.item().decode()
    return x.tolist()


def spec_json(spec):
    if isinstance(spec, dict):
        return {k: spec_json(v) for k, v in spec.items()}
    if isinstance(spec, (tuple, list)):
        return [spec_json(v) for v in spec]
    assert isinstance(spec, TensorSpec), spec
    name = "string" if spec.dtype.kind == "S" else spec.dtype.name
    return {"shape": None if spec.shape is None else list(spec.shape), "dtype": name}


def tf_spec(recorded):
    """The recorded spec without its repr."""
    if isinstance(recorded, list):
        return [tf_spec(v) for v in recorded]
    if "shape" in recorded and "dtype" in recorded:
        return {"shape": recorded["shape"], "dtype": recorded["dtype"]}
    return {k: tf_spec(v) for k, v in recorded.items()}


def _fill(x):
    return np.full([int(x)], x)


def _letters(n):
    start = int(n) * (int(n) - 1) // 2
    return np.array([b"abcdef"[k:k + 1] for k in range(start, start + int(n))])


def _pairs():
    for i in range(1, 4):
        yield i, [1.5] * i


X83 = np.arange(24, dtype=np.float32).reshape(8, 3)
Y8 = np.arange(8, dtype=np.int32)

CASES = {
    "from_tensors_list": lambda: D.from_tensors([1, 2, 3]),
    "from_tensors_tuple": lambda: D.from_tensors((np.array([1.0, 2.0], np.float32), "a")),
    "from_tensors_dict_repeat2": lambda: D.from_tensors({"x": 1, "y": [1.5, 2.5]}).repeat(2),
    "zip_two": lambda: D.zip(D.range(3), D.range(10, 15)),
    "zip_tuple_arg_nested": lambda: D.zip((D.range(3), (D.range(10, 13), D.range(20, 22)))),
    "zip_dict": lambda: D.zip({"a": D.range(2), "b": D.from_tensor_slices([1.5, 2.5, 3.5])}),
    "zip_datasets_kwarg": lambda: D.zip(datasets=(D.range(2), D.range(5, 7))),
    "concatenate": lambda: D.range(3).concatenate(D.range(10, 12)),
    "concatenate_tuples": lambda: D.from_tensor_slices(([1, 2], [3.0, 4.0])).concatenate(D.from_tensor_slices(([5], [6.0]))),
    "enumerate": lambda: D.range(10, 13).enumerate(),
    "enumerate_start5_tuple": lambda: D.from_tensor_slices(([1, 2], ["a", "b"])).enumerate(start=5),
    "padded_batch_default": lambda: D.range(1, 6).map(_fill).padded_batch(2),
    "padded_batch_shape6_value_minus1": lambda: D.range(1, 6).map(_fill).padded_batch(2, padded_shapes=[6], padding_values=np.int64(-1)),
    "padded_batch_drop_remainder": lambda: D.range(1, 6).map(_fill).padded_batch(2, drop_remainder=True),
    # TF: from_tensor_slices(ragged [["a"], ["b", "c"], ["d", "e", "f"]]); here the rows are made by map.
    "padded_batch_tuple_strings": lambda: D.range(1, 4).map(_letters).map(lambda s: (s, np.int32(s.size))).padded_batch(2),
    "padded_batch_2d_none_none": lambda: D.from_generator(
        lambda: iter([np.ones((2, 3), np.float32), 2 * np.ones((3, 1), np.float32)]),
        output_signature=TensorSpec((None, None), np.float32)).padded_batch(2, padded_shapes=(None, 4)),
    "unbatch": lambda: D.range(7).batch(3).unbatch(),
    "unbatch_tuple": lambda: D.from_tensor_slices(([[1, 2], [3, 4]], [[5, 6], [7, 8]])).unbatch(),
    "unbatch_drop_remainder_batch": lambda: D.range(7).batch(3, drop_remainder=True).unbatch(),
    "flat_map": lambda: D.range(3).flat_map(lambda x: D.from_tensors(x).repeat(int(x) + 1)),
    "flat_map_tensor_slices": lambda: D.from_tensor_slices([[1, 2, 3], [4, 5, 6]]).flat_map(D.from_tensor_slices),
    "interleave_cycle2_block2": lambda: D.range(1, 6).interleave(lambda x: D.from_tensors(x).repeat(4), cycle_length=2, block_length=2),
    "interleave_cycle3_block1": lambda: D.range(1, 4).interleave(lambda x: D.range(10 * x, 10 * x + x), cycle_length=3, block_length=1),
    "interleave_cycle1": lambda: D.range(1, 4).interleave(lambda x: D.range(x), cycle_length=1),
    "apply_filter": lambda: D.range(6).apply(lambda ds: ds.filter(lambda x: x % 2 == 0)),
    "as_numpy_strings_dict": lambda: D.from_tensor_slices({"s": ["ab", "c"], "n": [1, 2]}),
    "from_generator_types_shapes": lambda: D.from_generator(_pairs, output_types=(np.int64, np.float32), output_shapes=((), (None,))),
    "from_generator_types_only": lambda: D.from_generator(_pairs, output_types=(np.int32, np.float32)),
    "from_generator_args": lambda: D.from_generator(
        lambda n, s: ((int(i) * 10, s.decode() + str(i)) for i in range(n)), output_types=(np.int64, bytes), args=(3, "k")),
    "from_generator_signature": lambda: D.from_generator(
        _pairs, output_signature=(TensorSpec((), np.int64), TensorSpec((None,), np.float32))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_elements_cardinality_and_spec_match_tf(name):
    expected = TF[name]
    dataset = CASES[name]()
    assert [plain(e) for e in dataset] == expected["elements"]
    assert [plain(e) for e in dataset.as_numpy_iterator()] == expected["elements"]  # a second pass
    assert dataset.cardinality() == expected["cardinality"]
    assert spec_json(dataset.element_spec) == tf_spec(expected["element_spec"])


ELEMENT_SPEC = {
    "range_batch2": lambda: D.range(5).batch(2),
    "range_batch2_drop": lambda: D.range(5).batch(2, drop_remainder=True),
    "slices_tuple_batch4": lambda: D.from_tensor_slices((X83, Y8)).batch(4),
    "slices_dict": lambda: D.from_tensor_slices({"a": X83, "b": Y8}),
    "map_scale_cast": lambda: D.from_tensor_slices((X83, Y8)).batch(4).map(lambda a, b: (a / 255.0, b.astype(np.float32))),
    "map_reshape": lambda: D.from_tensor_slices(X83).map(lambda a: a.reshape(3, 1)),
    "repeat_shuffle_batch": lambda: D.from_tensor_slices(X83).repeat().shuffle(4).batch(2),
    "strings": lambda: D.from_tensor_slices(["a", "bc"]),
    "range_int32": lambda: D.range(3, output_type=np.int32),
}


@pytest.mark.parametrize("name", sorted(ELEMENT_SPEC))
def test_element_spec_matches_tf(name):
    assert spec_json(ELEMENT_SPEC[name]().element_spec) == tf_spec(TF["element_spec"][name])


def test_tensor_spec_repr_like_tf():
    spec = D.range(5).batch(2).element_spec
    assert repr(spec) == TF["element_spec"]["range_batch2"]["repr"].replace("tf.", "")
    assert spec == TensorSpec((None,), np.int64)
    assert spec.is_compatible_with(np.zeros(3, np.int64)) and not spec.is_compatible_with(np.zeros((3, 1), np.int64))


@pytest.mark.parametrize("name, state, fn", [
    ("reduce_sum", np.int64(0), lambda s, x: s + x),
    ("reduce_tuple_state", (np.int64(0), np.int64(1)), lambda s, x: (s[0] + x, s[1] * x)),
])
def test_reduce_matches_tf(name, state, fn):
    start = 0 if name == "reduce_sum" else 1
    assert plain(D.range(start, 5).reduce(state, fn)) == TF[name]


def test_reduce_of_empty_dataset_is_the_initial_state():
    assert plain(D.range(0).reduce(np.int64(7), lambda s, x: s + x)) == TF["reduce_empty"]


def test_from_generator_args_converted_like_tf():
    # TF passes ints as numpy int32 scalars, floats as float32, strings as bytes.
    def gen(a, b, c):
        yield [f"{type(a).__name__}:{np.asarray(a).dtype}", f"{type(b).__name__}:{np.asarray(b).dtype}",
               f"{type(c).__name__}:{np.asarray(c).dtype}"]

    (got,) = list(D.from_generator(gen, output_types=bytes, args=(3, 2.5, "s")))
    assert plain(got) == TF["from_generator_args_types"]


def test_errors_like_tf():
    assert TF["concatenate_incompatible_types"]["error"] == "TypeError"
    with pytest.raises(TypeError, match="incompatible dataset elements"):
        D.range(3).concatenate(D.from_tensor_slices([1.0]))
    # TF: DataLossError "Attempted to pad to a smaller size than the input element".
    assert "smaller size" in TF["padded_batch_too_small"]["message"]
    with pytest.raises(ValueError, match="larger than padded_shapes"):
        list(D.range(1, 6).map(_fill).padded_batch(2, padded_shapes=[3]))
    # TF raises for a shape that does not match output_shapes while iterating; so do we.
    assert TF["from_generator_shapes_mismatch"]["error"] == "InvalidArgumentError"
    with pytest.raises(ValueError, match="not compatible with output_signature shape"):
        list(D.from_generator(_pairs, output_types=(np.int64, np.float32), output_shapes=((), (2,))))
    with pytest.raises(TypeError, match="either output_signature or output_types"):
        D.from_generator(_pairs, output_types=np.int64, output_signature=TensorSpec((), np.int64))
    with pytest.raises(ValueError, match="rank >= 1"):
        D.range(3).unbatch()


def test_from_generator_without_types_is_an_extension():
    # TF 2.21 raises TypeError without output_types/output_signature; here values convert like slices.
    assert TF["from_generator_no_types"]["error"] == "TypeError"
    dataset = D.from_generator(_pairs)
    assert [plain(e) for e in dataset] == [[1, [1.5]], [2, [1.5, 1.5]], [3, [1.5, 1.5, 1.5]]]
    assert spec_json(dataset.element_spec) == [{"shape": [], "dtype": "int32"}, {"shape": [1], "dtype": "float32"}]


def test_map_spec_error_names_the_function_failure():
    dataset = D.range(3).map(lambda x: {"a": x}[int(x) - 1])
    with pytest.raises(ValueError, match="element_spec after map"):
        _ = dataset.element_spec
    assert [plain(e) for e in dataset.take(0)] == []


@pytest.mark.parametrize("threads", [2, 4, AUTOTUNE])
def test_parallel_map_keeps_order_and_values(threads):
    expected = [plain(e) for e in D.range(50).map(lambda x: (x, x * x))]
    got = [plain(e) for e in D.range(50).map(lambda x: (x, x * x), num_parallel_calls=threads)]
    assert got == expected


def test_parallel_map_not_deterministic_yields_every_element_once():
    import time

    def slow_first(x):
        if x == 0:
            time.sleep(0.2)
        return x

    got = [int(e) for e in D.range(8).map(slow_first, num_parallel_calls=4, deterministic=False)]
    assert sorted(got) == list(range(8)) and got[0] != 0  # element 0 no longer holds the others back


def test_parallel_map_error_surfaces_on_iteration():
    def bad(x):
        raise RuntimeError(f"bad element {int(x)}")

    with pytest.raises(RuntimeError, match="bad element 0"):
        list(D.range(4).map(bad, num_parallel_calls=2))


@pytest.mark.parametrize("buffer_size", [1, 3, 7, 100])
def test_one_shuffle_order_per_seed_on_both_engines(buffer_size):
    plan = D.range(20).shuffle(buffer_size, seed=3)
    grain_path = D.range(20).map(lambda x: x).shuffle(buffer_size, seed=3)
    assert [int(x) for x in plan] == [int(x) for x in grain_path]
    assert [plain(b) for b in D.range(20).batch(3).shuffle(buffer_size, seed=5)] == [
        plain(b) for b in D.range(20).map(lambda x: x).batch(3).shuffle(buffer_size, seed=5)]


def test_batched_tuple_holding_a_dict_keeps_its_structure():
    # Regression: a (dict, array) element with two leaves lost its dict when batched on the array path.
    batch = next(iter(D.from_tensor_slices(({"word": ["a", "b"]}, [1.0, 2.0])).batch(2)))
    assert plain(batch) == [{"word": ["a", "b"]}, [1.0, 2.0]]
