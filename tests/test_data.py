"""Tests for distribute.data: tf.data semantics (TensorFlow 2.21) over grain."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distribute.data import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    AutoShardPolicy,
    Dataset,
    Options,
)


def values(dataset: Dataset) -> list:
    """Elements as plain Python values (lists for arrays, tuples/dicts kept)."""
    def plain(x):
        if isinstance(x, tuple):
            return tuple(plain(v) for v in x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return np.asarray(x).tolist()
    return [plain(e) for e in dataset]


def as_general(dataset: Dataset) -> Dataset:
    """The same elements through the grain path (an identity map leaves the vectorised plan)."""
    return dataset.map(lambda *x: x[0] if len(x) == 1 else x)


# ---------------------------------------------------------------- sources


def test_constants():
    assert AUTOTUNE == -1 and INFINITE_CARDINALITY == -1 and UNKNOWN_CARDINALITY == -2


def test_range_like_python_range_with_int64_elements():
    assert values(Dataset.range(5)) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(2, 5)) == [2, 3, 4]
    assert values(Dataset.range(10, 0, -3)) == [10, 7, 4, 1]
    assert values(Dataset.range(0)) == []
    element = next(iter(Dataset.range(3)))
    assert isinstance(element, np.int64)
    assert Dataset.range(1, 10, 2).cardinality() == 5


def test_range_output_type():
    batch = next(iter(Dataset.range(4, output_type=np.int32).batch(4)))
    assert batch.dtype == np.int32 and batch.tolist() == [0, 1, 2, 3]


def test_from_tensor_slices_array_tuple_dict():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6)
    first = next(iter(Dataset.from_tensor_slices(x)))
    assert isinstance(first, np.ndarray) and first.dtype == np.float32 and first.tolist() == [0.0, 1.0]
    pairs = list(Dataset.from_tensor_slices((x, y)))
    assert len(pairs) == 6 and isinstance(pairs[2], tuple)
    assert pairs[2][0].tolist() == [4.0, 5.0] and pairs[2][1] == 2 and isinstance(pairs[2][1], np.int64)
    dicts = list(Dataset.from_tensor_slices({"x": x, "y": y}))
    assert isinstance(dicts[5], dict) and dicts[5]["x"].tolist() == [10.0, 11.0] and dicts[5]["y"] == 5


def test_from_tensor_slices_python_values_like_tf_constant():
    assert next(iter(Dataset.from_tensor_slices([1.5, 2.5]))).dtype == np.float32
    assert next(iter(Dataset.from_tensor_slices([1, 2]))).dtype == np.int32
    assert values(Dataset.from_tensor_slices(["a", "b"])) == [b"a", b"b"]
    assert values(Dataset.from_tensor_slices([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]


def test_from_tensor_slices_nested_and_namedtuple():
    Point = collections.namedtuple("Point", "x y")
    ds = Dataset.from_tensor_slices(Point(np.arange(3), {"a": np.arange(3) * 10}))
    last = list(ds)[-1]
    assert isinstance(last, Point) and last.x == 2 and last.y["a"] == 20


def test_yielded_arrays_are_copies():
    x = np.zeros((4, 2))
    row = next(iter(Dataset.from_tensor_slices(x)))
    row += 1
    batch = next(iter(Dataset.from_tensor_slices(x).batch(2)))
    batch += 1
    assert x.sum() == 0


def test_from_tensor_slices_mismatched_lengths_names_components():
    with pytest.raises(ValueError, match=r"\['x'\]: 3.*\['y'\]: 2"):
        Dataset.from_tensor_slices({"x": np.zeros(3), "y": np.zeros(2)})
    with pytest.raises(ValueError, match=r"\[0\]: 3, \[1\]: 4"):
        Dataset.from_tensor_slices((np.zeros(3), np.zeros(4)))


def test_from_tensor_slices_bad_input():
    with pytest.raises(ValueError, match="scalar"):
        Dataset.from_tensor_slices(np.float32(3))
    with pytest.raises(ValueError, match="empty structure"):
        Dataset.from_tensor_slices(())
    with pytest.raises(ValueError, match="rectangular"):
        Dataset.from_tensor_slices([[1, 2], [3]])


def test_from_generator_recalled_each_iteration():
    calls = []

    def gen():
        calls.append(1)
        yield from [(1, np.array([1.0, 2.0])), (2, np.array([3.0, 4.0]))]

    ds = Dataset.from_generator(gen)
    assert ds.cardinality() == UNKNOWN_CARDINALITY
    assert values(ds) == [(1, [1.0, 2.0]), (2, [3.0, 4.0])]
    assert values(ds.repeat(2).map(lambda i, v: i)) == [1, 2, 1, 2]
    assert len(calls) == 3


def test_from_generator_output_signature_casts_and_checks():
    @dataclasses.dataclass
    class Spec:  # duck-types tf.TensorSpec
        shape: tuple
        dtype: type

    signature = (Spec((), np.int64), Spec((None,), np.float32))
    ds = Dataset.from_generator(lambda: iter([(1, [1, 2, 3]), (2, [4])]), output_signature=signature)
    first = next(iter(ds))
    assert first[0].dtype == np.int64 and first[1].dtype == np.float32 and first[1].tolist() == [1, 2, 3]
    bad = Dataset.from_generator(lambda: iter([(1, [[1.0]])]), output_signature=signature)
    with pytest.raises(ValueError, match="not compatible with output_signature"):
        list(bad)
    wrong_structure = Dataset.from_generator(lambda: iter([1]), output_signature=signature)
    with pytest.raises(TypeError, match="does not match output_signature"):
        list(wrong_structure)


def test_from_generator_rejects_generator_object():
    def gen():
        yield 1
    with pytest.raises(TypeError, match=r"from_generator\(gen\) rather than"):
        Dataset.from_generator(gen())


def test_dataset_cannot_be_constructed_directly():
    with pytest.raises(TypeError, match="from_tensor_slices"):
        Dataset()


# ---------------------------------------------------------------- batch


@pytest.mark.parametrize("general", [False, True])
def test_batch_keeps_partial_last_batch(general):
    ds = Dataset.range(7)
    ds = as_general(ds) if general else ds
    assert values(ds.batch(3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert values(ds.batch(3, drop_remainder=True)) == [[0, 1, 2], [3, 4, 5]]
    assert ds.batch(3).cardinality() == 3 and ds.batch(3, drop_remainder=True).cardinality() == 2
    assert all(isinstance(b, np.ndarray) and b.dtype == np.int64 for b in ds.batch(3))


@pytest.mark.parametrize("general", [False, True])
def test_batch_tuple_and_dict_structure(general):
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    ds = Dataset.from_tensor_slices({"x": x, "y": np.arange(5)})
    ds = ds.map(lambda d: d) if general else ds
    batches = list(ds.batch(2))
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert batches[0]["x"].shape == (2, 2) and batches[0]["x"].dtype == np.float32
    pairs = list(Dataset.from_tensor_slices((x, np.arange(5))).batch(4))
    assert pairs[1][0].tolist() == [[8.0, 9.0]] and pairs[1][1].tolist() == [4]


def test_batch_of_batches_and_batch_across_repeat():
    assert values(Dataset.range(8).batch(2).batch(2)) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert values(Dataset.range(3).repeat(2).batch(4)) == [[0, 1, 2, 0], [1, 2]]
    assert values(Dataset.range(3).batch(2).repeat(2)) == [[0, 1], [2], [0, 1], [2]]


def test_batch_unequal_shapes_error():
    ds = Dataset.from_generator(lambda: iter([np.zeros(3), np.zeros(2)])).batch(2)
    with pytest.raises(ValueError, match=r"different shapes in component 0.*\(3,\).*\(2,\)"):
        list(ds)


# ---------------------------------------------------------------- shuffle


@pytest.mark.parametrize("general", [False, True])
@pytest.mark.parametrize("buffer_size", [1, 4, 100])
def test_shuffle_keeps_every_element_and_is_deterministic_with_seed(general, buffer_size):
    def make():
        ds = as_general(Dataset.range(50)) if general else Dataset.range(50)
        return ds.shuffle(buffer_size, seed=7)
    first = values(make())
    assert sorted(first) == list(range(50))
    assert values(make()) == first
    if buffer_size == 1:
        assert first == list(range(50))
    if buffer_size == 4:  # a window shuffle never moves an element further than one window
        assert all(abs(v - i) < 4 for i, v in enumerate(first))


@pytest.mark.parametrize("general", [False, True])
def test_reshuffle_each_iteration(general):
    ds = as_general(Dataset.range(30)) if general else Dataset.range(30)
    reshuffled = ds.shuffle(30, seed=3)
    epoch1, epoch2 = values(reshuffled), values(reshuffled)
    assert sorted(epoch1) == sorted(epoch2) == list(range(30)) and epoch1 != epoch2
    assert values(ds.shuffle(30, seed=3)) == epoch1  # a rebuilt dataset replays the same sequence
    fixed = ds.shuffle(30, seed=3, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)
    assert values(fixed.repeat(2))[:30] == values(fixed.repeat(2))[30:]


@pytest.mark.parametrize("general", [False, True])
def test_reshuffle_across_repeat_epochs(general):
    ds = as_general(Dataset.range(20)) if general else Dataset.range(20)
    both = values(ds.shuffle(20, seed=5).repeat(2))
    assert sorted(both[:20]) == sorted(both[20:]) == list(range(20)) and both[:20] != both[20:]


def test_shuffle_without_seed_still_a_permutation():
    assert sorted(values(Dataset.range(40).shuffle(8))) == list(range(40))


def test_shuffle_of_batches_keeps_batches_whole():
    batches = values(Dataset.range(12).batch(3).shuffle(4, seed=1))
    assert sorted(batches) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_shuffled_batches_match_shuffled_elements():
    x = np.arange(40).reshape(20, 2)
    elements = values(Dataset.from_tensor_slices(x).shuffle(20, seed=9))
    batches = values(Dataset.from_tensor_slices(x).shuffle(20, seed=9).batch(6))
    assert [row for batch in batches for row in batch] == elements


# ---------------------------------------------------------------- take / skip / shard / repeat


@pytest.mark.parametrize("general", [False, True])
def test_take_skip_repeat(general):
    ds = as_general(Dataset.range(5)) if general else Dataset.range(5)
    assert values(ds.take(3)) == [0, 1, 2] and values(ds.take(0)) == [] and values(ds.take(-1)) == [0, 1, 2, 3, 4]
    assert values(ds.take(9)) == [0, 1, 2, 3, 4]
    assert values(ds.skip(3)) == [3, 4] and values(ds.skip(9)) == [] and values(ds.skip(-1)) == []
    assert values(ds.skip(0)) == [0, 1, 2, 3, 4]
    assert values(ds.repeat(2)) == [0, 1, 2, 3, 4] * 2 and values(ds.repeat(0)) == []
    assert values(ds.repeat().take(12)) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert values(ds.repeat(-1).skip(4).take(3)) == [4, 0, 1]
    assert values(ds.take(0).repeat()) == []  # repeating an empty dataset ends instead of hanging


@pytest.mark.parametrize("general", [False, True])
def test_shard_element_i_goes_to_shard_i_mod_n(general):
    ds = as_general(Dataset.range(10)) if general else Dataset.range(10)
    assert values(ds.shard(3, 0)) == [0, 3, 6, 9]
    assert values(ds.shard(3, 1)) == [1, 4, 7]
    assert values(ds.shard(3, 2)) == [2, 5, 8]
    assert values(ds.shard(1, 0)) == list(range(10))
    assert values(ds.batch(2).shard(2, 1)) == [[2, 3], [6, 7]]


def test_shard_errors():
    with pytest.raises(ValueError, match=r"index=3 must be in \[0, num_shards=3\)"):
        Dataset.range(9).shard(3, 3)
    with pytest.raises(ValueError, match="index=-1"):
        Dataset.range(9).shard(3, -1)
    with pytest.raises(ValueError, match="num_shards=0 must be >= 1"):
        Dataset.range(9).shard(0, 0)


# ---------------------------------------------------------------- cardinality


def test_cardinality_rules():
    ds = Dataset.range(10)
    assert ds.cardinality() == 10 and len(ds) == 10
    assert ds.batch(3).cardinality() == 4 and ds.batch(3, drop_remainder=True).cardinality() == 3
    assert ds.shuffle(4).cardinality() == 10 and ds.map(lambda x: x).cardinality() == 10
    assert ds.prefetch(AUTOTUNE).cardinality() == 10 and ds.cache().cardinality() == 10
    assert ds.take(3).cardinality() == 3 and ds.take(30).cardinality() == 10 and ds.take(-1).cardinality() == 10
    assert ds.skip(3).cardinality() == 7 and ds.skip(30).cardinality() == 0 and ds.skip(-1).cardinality() == 0
    assert ds.shard(3, 0).cardinality() == 4 and ds.shard(3, 2).cardinality() == 3
    assert ds.repeat(3).cardinality() == 30 and ds.repeat(0).cardinality() == 0
    assert ds.repeat().cardinality() == INFINITE_CARDINALITY
    assert ds.take(0).repeat().cardinality() == 0
    assert ds.repeat().take(5).cardinality() == 5 and ds.repeat().batch(2).cardinality() == INFINITE_CARDINALITY
    assert ds.repeat().skip(4).cardinality() == INFINITE_CARDINALITY
    assert ds.filter(lambda x: x > 2).cardinality() == UNKNOWN_CARDINALITY
    unknown = ds.filter(lambda x: x > 2)
    assert unknown.take(3).cardinality() == UNKNOWN_CARDINALITY and unknown.batch(2).cardinality() == UNKNOWN_CARDINALITY
    assert unknown.repeat().cardinality() == INFINITE_CARDINALITY and unknown.repeat(2).cardinality() == UNKNOWN_CARDINALITY
    assert all(isinstance(d.cardinality(), int) for d in (ds, unknown, ds.repeat()))


def test_len_raises_type_error_when_infinite_or_unknown():
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(3).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(Dataset.range(3).filter(lambda x: x > 0))
    assert bool(Dataset.range(3).repeat())


# ---------------------------------------------------------------- map / filter


def test_map_unpacks_tuples_and_passes_dicts_whole():
    x, y = np.arange(4.0), np.arange(4)
    assert values(Dataset.from_tensor_slices((x, y)).map(lambda a, b: a + b)) == [0.0, 2.0, 4.0, 6.0]
    ds = Dataset.from_tensor_slices({"a": x, "b": y}).map(lambda d: {"sum": d["a"] + d["b"], "b": d["b"]})
    assert values(ds) == [{"sum": 2.0 * i, "b": i} for i in range(4)]
    assert values(Dataset.range(3).map(lambda v: [v, v * 2])) == [(0, 0), (1, 2), (2, 4)]  # list -> tuple


def test_map_output_converted_to_numpy():
    import jax.numpy as jnp
    first = next(iter(Dataset.range(3).map(lambda v: (1.5, jnp.ones(2) * v))))
    assert first[0].dtype == np.float32 and isinstance(first[1], np.ndarray) and first[1].tolist() == [0.0, 0.0]


def test_map_after_batch_sees_whole_batches():
    ds = Dataset.range(6).batch(4).map(lambda b: b.sum())
    assert values(ds) == [6, 9]


def test_filter():
    assert values(Dataset.range(10).filter(lambda v: v % 3 == 0)) == [0, 3, 6, 9]
    pairs = Dataset.from_tensor_slices((np.arange(6), np.arange(6) * 10)).filter(lambda a, b: b > 25)
    assert values(pairs) == [(3, 30), (4, 40), (5, 50)]
    assert values(Dataset.range(10).filter(lambda v: v > 100)) == []
    with pytest.raises(TypeError, match="scalar bool"):
        list(Dataset.range(3).filter(lambda v: v))


def test_filter_then_batch_batches_survivors():
    assert values(Dataset.range(10).filter(lambda v: v % 2 == 1).batch(2)) == [[1, 3], [5, 7], [9]]


def test_prefetch_and_cache():
    ds = Dataset.range(10).map(lambda v: v * 2).prefetch(AUTOTUNE)
    assert values(ds) == list(range(0, 20, 2)) and values(ds.prefetch(0)) == values(ds)
    calls = []
    cached = Dataset.range(4).map(lambda v: calls.append(1) or v).shuffle(4, seed=2).cache()
    first = values(cached)
    assert values(cached) == first and len(calls) == 4  # replayed, not recomputed, not reshuffled
    batched = Dataset.range(10).shuffle(10, seed=1).batch(3).cache()
    assert values(batched) == values(batched)
    with pytest.raises(NotImplementedError, match="without a filename"):
        Dataset.range(3).cache("/tmp/cache")


def test_partial_iteration_does_not_fill_cache():
    calls = []
    cached = Dataset.range(5).map(lambda v: calls.append(1) or v).cache()
    iterator = iter(cached)
    next(iterator)
    assert values(cached) == [0, 1, 2, 3, 4] and values(cached) == [0, 1, 2, 3, 4]
    assert len(calls) == 1 + 5


def test_iterator_protocol():
    iterator = Dataset.range(2).as_numpy_iterator()
    assert iterator.get_next() == 0 and next(iterator) == 1
    with pytest.raises(StopIteration):
        next(iterator)
    iterator.close()


# ---------------------------------------------------------------- options


def test_options_defaults_and_merge():
    options = Options()
    assert options.experimental_distribute.auto_shard_policy == AutoShardPolicy.AUTO
    assert options.deterministic is None and options.experimental_deterministic is None
    assert [p.value for p in AutoShardPolicy] == [-1, 0, 1, 2, 3]
    first = Options()
    first.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    first.deterministic = False
    second = Options()
    second.experimental_deterministic = True
    ds = Dataset.range(3).with_options(first).with_options(second)
    merged = ds.options()
    assert merged.experimental_distribute.auto_shard_policy == AutoShardPolicy.DATA  # kept: unset in second
    assert merged.deterministic is True  # set later wins
    third = Options()
    third.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    assert ds.with_options(third).options().experimental_distribute.auto_shard_policy == AutoShardPolicy.OFF
    assert ds.map(lambda v: v).batch(2).options() == merged  # carried through transformations
    merged.deterministic = False
    assert ds.options().deterministic is True  # options() returns a copy
    assert values(ds) == [0, 1, 2]


def test_options_errors():
    with pytest.raises(AttributeError, match="Cannot set the property 'bogus'"):
        Options().bogus = 1
    with pytest.raises(ValueError, match="auto_shard_policy=7"):
        Options().experimental_distribute.auto_shard_policy = 7
    with pytest.raises(TypeError, match="Options"):
        Dataset.range(3).with_options({"deterministic": True})


# ---------------------------------------------------------------- _batch_info


def test_batch_info_contract():
    ds = Dataset.range(10)
    assert ds._batch_info is None and ds.map(lambda v: v).repeat()._batch_info is None
    batched = ds.batch(4)
    assert batched._batch_info == (4, False)
    assert ds.batch(4, drop_remainder=True)._batch_info == (4, True)
    carried = [batched.map(lambda b: b), batched.prefetch(AUTOTUNE), batched.repeat(), batched.take(1),
               batched.skip(1), batched.shard(2, 0), batched.cache(), batched.with_options(Options()),
               batched.shuffle(3), batched.filter(lambda b: True), batched.repeat(2).prefetch(1).map(lambda b: b)]
    assert all(d._batch_info == (4, False) for d in carried)
    assert batched.batch(2)._batch_info == (2, False)  # the last batch() applied
    assert as_general(ds).batch(3, drop_remainder=True).map(lambda b: b)._batch_info == (3, True)


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize("call, error, pattern", [
    (lambda ds: ds.batch(0), ValueError, "batch_size=0 must be >= 1"),
    (lambda ds: ds.batch(-2), ValueError, "batch_size=-2"),
    (lambda ds: ds.batch(2.5), TypeError, "batch_size=2.5 must be an int"),
    (lambda ds: ds.batch(2, drop_remainder="yes"), TypeError, "drop_remainder"),
    (lambda ds: ds.shuffle(0), ValueError, "buffer_size=0 must be >= 1"),
    (lambda ds: ds.shuffle(4, seed="a"), TypeError, "seed='a'"),
    (lambda ds: ds.prefetch(-2), ValueError, r"buffer_size=-2 must be >= 0 or AUTOTUNE"),
    (lambda ds: ds.map(3), TypeError, "map_func must be callable"),
    (lambda ds: ds.map(lambda v: v, num_parallel_calls=0), ValueError, "num_parallel_calls=0"),
    (lambda ds: ds.filter(None), TypeError, "predicate must be callable"),
    (lambda ds: ds.take(-2), ValueError, "count=-2 must be >= 0, or -1"),
    (lambda ds: ds.skip(-3), ValueError, "count=-3"),
    (lambda ds: ds.repeat(-5), ValueError, "count=-5"),
    (lambda ds: ds.cache(3), TypeError, "filename=3"),
    (lambda ds: Dataset.range(1, 5, 0), ValueError, "step=0"),
    (lambda ds: Dataset.range(), TypeError, "1 to 3 ints"),
])
def test_bad_arguments(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(Dataset.range(10))


def test_accepted_compat_arguments():
    ds = Dataset.range(6).map(lambda v: v + 1, num_parallel_calls=AUTOTUNE, deterministic=False)
    assert values(ds.batch(3, num_parallel_calls=2, deterministic=True)) == [[1, 2, 3], [4, 5, 6]]
    assert values(Dataset.range(3).shuffle(np.int64(3), seed=np.int32(1))) != []


# ---------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(num_elements=st.integers(0, 60), batch_size=st.integers(1, 9), num_shards=st.integers(1, 5),
       drop_remainder=st.booleans(), shuffle=st.booleans(), general=st.booleans())
def test_every_element_seen_once_across_shards(num_elements, batch_size, num_shards, drop_remainder,
                                               shuffle, general):
    def worker_dataset(index):  # built per worker, as each worker process would
        base = Dataset.range(num_elements)
        if general:
            base = as_general(base)
        if shuffle:
            base = base.shuffle(7, seed=num_elements)
        return base.shard(num_shards, index).batch(batch_size, drop_remainder=drop_remainder)

    seen = []
    for index in range(num_shards):
        shard = worker_dataset(index)
        batches = values(shard)
        assert len(batches) == shard.cardinality()
        assert all(len(b) == batch_size for b in batches[:-1])
        if drop_remainder:
            assert all(len(b) == batch_size for b in batches)
        seen.extend(v for b in batches for v in b)
    if drop_remainder:
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(num_elements))
        expected = sum((len(range(i, num_elements, num_shards)) // batch_size) * batch_size
                       for i in range(num_shards))
        assert len(seen) == expected
    else:
        assert sorted(seen) == list(range(num_elements))


@settings(max_examples=40, deadline=None)
@given(num_elements=st.integers(1, 50), buffer_size=st.integers(1, 60), epochs=st.integers(1, 3),
       batch_size=st.integers(1, 8), seed=st.integers(0, 2**40))
def test_shuffle_repeat_batch_each_epoch_is_a_permutation(num_elements, buffer_size, epochs, batch_size, seed):
    x = np.arange(num_elements * 2).reshape(num_elements, 2)
    ds = Dataset.from_tensor_slices((x, np.arange(num_elements))).shuffle(buffer_size, seed=seed)
    ds = ds.repeat(epochs).batch(batch_size)
    rows, labels = [], []
    for batch_x, batch_labels in ds:
        rows.extend(batch_x.tolist())
        labels.extend(batch_labels.tolist())
    assert len(labels) == num_elements * epochs
    for epoch in range(epochs):
        assert sorted(labels[epoch * num_elements:(epoch + 1) * num_elements]) == list(range(num_elements))
    assert rows == [[2 * label, 2 * label + 1] for label in labels]  # features stay with their label


_OPS = st.one_of(
    st.tuples(st.just("take"), st.integers(-1, 12)),
    st.tuples(st.just("skip"), st.integers(-1, 12)),
    st.tuples(st.just("shard"), st.integers(1, 4), st.integers(0, 3)),
    st.tuples(st.just("repeat"), st.integers(0, 3)),
    st.tuples(st.just("batch"), st.integers(1, 5), st.booleans()),
)


def _reference(elements: list, op: tuple) -> list:
    """tf.data's semantics on a Python list."""
    name, *args = op
    if name == "take":
        return elements if args[0] == -1 else elements[:args[0]]
    if name == "skip":
        return [] if args[0] == -1 else elements[args[0]:]
    if name == "shard":
        return elements[args[1] % args[0]::args[0]]
    if name == "repeat":
        return elements * args[0]
    size, drop = args
    batches = [elements[i:i + size] for i in range(0, len(elements), size)]
    batches = [b for b in batches if len(b) == size] if drop else batches
    if any(np.shape(e) != np.shape(b[0]) for b in batches for e in b):
        raise ValueError("Cannot batch tensors with different shapes")  # as tf.data
    return batches


def _apply(dataset: Dataset, op: tuple) -> Dataset:
    name, *args = op
    if name == "shard":
        return dataset.shard(args[0], args[1] % args[0])
    if name == "batch":
        return dataset.batch(args[0], drop_remainder=args[1])
    return getattr(dataset, name)(*args)


@settings(max_examples=80, deadline=None)
@given(num_elements=st.integers(0, 20), ops=st.lists(_OPS, max_size=5))
def test_random_pipelines_match_reference_on_both_paths(num_elements, ops):
    expected = list(range(num_elements))
    plan_ds, general_ds = Dataset.range(num_elements), as_general(Dataset.range(num_elements))
    for op in ops:
        plan_ds, general_ds = _apply(plan_ds, op), _apply(general_ds, op)
        try:
            expected = _reference(expected, op)
        except ValueError:
            # A batch of unequal batches: tf.data refuses it, and so must both paths.
            for dataset in (plan_ds, general_ds):
                with pytest.raises(ValueError, match="different shapes"):
                    values(dataset)
            return
    assert values(plan_ds) == expected
    assert values(general_ds) == expected
    assert plan_ds.cardinality() == general_ds.cardinality() == len(expected)


def test_fixed_order_shuffle_shards_partition_in_one_process():
    ds = Dataset.range(23).shuffle(23, seed=4, reshuffle_each_iteration=False)
    shards = [values(ds.shard(3, i)) for i in range(3)]
    assert sorted(v for shard in shards for v in shard) == list(range(23))
