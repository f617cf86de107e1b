"""tf.data reference cases for record_tf.py (section "data"): Dataset names, element_spec, distributed input.

``register(add_task, helpers)`` adds every case; each runs in its own child process
like the other cases. Values are plain JSON: elements as nested lists (bytes as str),
specs as {"shape": [...], "dtype": "int64"} (None for unknown dims).
"""

import os
import tempfile

import numpy as np
import tensorflow as tf


def _spec(spec):
    """A (nested) tf.TypeSpec as JSON: TensorSpec -> {"shape", "dtype"}; PerReplicaSpec -> {"per_replica": [...]}."""
    if isinstance(spec, dict):
        return {k: _spec(v) for k, v in spec.items()}
    if isinstance(spec, (tuple, list)):
        return [_spec(v) for v in spec]
    if isinstance(spec, tf.TensorSpec):
        return {"shape": spec.shape.as_list() if spec.shape.rank is not None else None,
                "dtype": spec.dtype.name, "repr": repr(spec)}
    components = getattr(spec, "_component_specs", None)
    if components is not None:
        return {"type": type(spec).__name__, "per_replica": [_spec(c) for c in components]}
    return {"type": type(spec).__name__, "repr": repr(spec)}


def register(add_task, py, local, mirrored, guarded):
    D = tf.data.Dataset

    def elements(ds):
        return [py(e) for e in ds.as_numpy_iterator()]

    def case(name, make):
        def run():
            ds = make()
            return {"elements": elements(ds), "cardinality": int(ds.cardinality()), "element_spec": _spec(ds.element_spec)}
        add_task(("data", name), lambda: guarded(run))

    case("from_tensors_list", lambda: D.from_tensors([1, 2, 3]))
    case("from_tensors_tuple", lambda: D.from_tensors((np.array([1.0, 2.0], np.float32), "a")))
    case("from_tensors_dict_repeat2", lambda: D.from_tensors({"x": 1, "y": [1.5, 2.5]}).repeat(2))
    case("zip_two", lambda: D.zip(D.range(3), D.range(10, 15)))
    case("zip_tuple_arg_nested", lambda: D.zip((D.range(3), (D.range(10, 13), D.range(20, 22)))))
    case("zip_dict", lambda: D.zip({"a": D.range(2), "b": D.from_tensor_slices([1.5, 2.5, 3.5])}))
    case("zip_datasets_kwarg", lambda: D.zip(datasets=(D.range(2), D.range(5, 7))))
    case("concatenate", lambda: D.range(3).concatenate(D.range(10, 12)))
    case("concatenate_tuples", lambda: D.from_tensor_slices(([1, 2], [3.0, 4.0])).concatenate(
        D.from_tensor_slices(([5], [6.0]))))
    add_task(("data", "concatenate_incompatible_types"),
             lambda: guarded(lambda: {"no_error": elements(D.range(3).concatenate(D.from_tensor_slices([1.0])))}))
    case("enumerate", lambda: D.range(10, 13).enumerate())
    case("enumerate_start5_tuple", lambda: D.from_tensor_slices(([1, 2], ["a", "b"])).enumerate(start=5))
    case("padded_batch_default", lambda: D.range(1, 6).map(lambda x: tf.fill([x], x)).padded_batch(2))
    case("padded_batch_shape6_value_minus1",
         lambda: D.range(1, 6).map(lambda x: tf.fill([x], x)).padded_batch(2, padded_shapes=[6], padding_values=np.int64(-1)))
    case("padded_batch_drop_remainder", lambda: D.range(1, 6).map(lambda x: tf.fill([x], x)).padded_batch(2, drop_remainder=True))
    case("padded_batch_tuple_strings", lambda: D.from_tensor_slices(tf.ragged.constant([["a"], ["b", "c"], ["d", "e", "f"]])).map(
        lambda s: (s, tf.size(s))).padded_batch(2))
    case("padded_batch_2d_none_none", lambda: D.from_generator(
        lambda: iter([np.ones((2, 3), np.float32), 2 * np.ones((3, 1), np.float32)]),
        output_signature=tf.TensorSpec((None, None), tf.float32)).padded_batch(2, padded_shapes=(None, 4)))
    add_task(("data", "padded_batch_too_small"), lambda: guarded(lambda: {"no_error": elements(
        D.range(1, 6).map(lambda x: tf.fill([x], x)).padded_batch(2, padded_shapes=[3]))}))
    case("unbatch", lambda: D.range(7).batch(3).unbatch())
    case("unbatch_tuple", lambda: D.from_tensor_slices(([[1, 2], [3, 4]], [[5, 6], [7, 8]])).unbatch())
    case("unbatch_drop_remainder_batch", lambda: D.range(7).batch(3, drop_remainder=True).unbatch())
    case("flat_map", lambda: D.range(3).flat_map(lambda x: D.from_tensors(x).repeat(x + 1)))
    case("flat_map_tensor_slices", lambda: D.from_tensor_slices([[1, 2, 3], [4, 5, 6]]).flat_map(D.from_tensor_slices))
    case("interleave_cycle2_block2", lambda: D.range(1, 6).interleave(
        lambda x: D.from_tensors(x).repeat(4), cycle_length=2, block_length=2))
    case("interleave_cycle3_block1", lambda: D.range(1, 4).interleave(
        lambda x: D.range(10 * x, 10 * x + x), cycle_length=3, block_length=1))
    case("interleave_cycle1", lambda: D.range(1, 4).interleave(lambda x: D.range(x), cycle_length=1))
    add_task(("data", "reduce_sum"), lambda: py(D.range(5).reduce(np.int64(0), lambda s, x: s + x)))
    add_task(("data", "reduce_tuple_state"), lambda: py(D.range(1, 5).reduce(
        (np.int64(0), np.int64(1)), lambda s, x: (s[0] + x, s[1] * x))))
    add_task(("data", "reduce_empty"), lambda: py(D.range(0).reduce(np.int64(7), lambda s, x: s + x)))
    case("apply_filter", lambda: D.range(6).apply(lambda ds: ds.filter(lambda x: x % 2 == 0)))
    case("as_numpy_strings_dict", lambda: D.from_tensor_slices({"s": ["ab", "c"], "n": [1, 2]}))

    # element_spec
    x83 = np.arange(24, dtype=np.float32).reshape(8, 3)
    y8 = np.arange(8, dtype=np.int32)
    for name, make in {
        "range_batch2": lambda: D.range(5).batch(2),
        "range_batch2_drop": lambda: D.range(5).batch(2, drop_remainder=True),
        "slices_tuple_batch4": lambda: D.from_tensor_slices((x83, y8)).batch(4),
        "slices_dict": lambda: D.from_tensor_slices({"a": x83, "b": y8}),
        "map_scale_cast": lambda: D.from_tensor_slices((x83, y8)).batch(4).map(lambda a, b: (a / 255.0, tf.cast(b, tf.float32))),
        "map_reshape": lambda: D.from_tensor_slices(x83).map(lambda a: tf.reshape(a, (3, 1))),
        "repeat_shuffle_batch": lambda: D.from_tensor_slices(x83).repeat().shuffle(4).batch(2),
        "strings": lambda: D.from_tensor_slices(["a", "bc"]),
        "range_int32": lambda: D.range(3, output_type=tf.int32),
    }.items():
        add_task(("data", "element_spec", name), lambda make=make: _spec(make().element_spec))

    # from_generator with output_types / output_shapes / args
    def gen_pairs():
        for i in range(1, 4):
            yield i, [1.5] * i

    case("from_generator_types_shapes", lambda: D.from_generator(
        gen_pairs, output_types=(tf.int64, tf.float32), output_shapes=((), (None,))))
    case("from_generator_types_only", lambda: D.from_generator(gen_pairs, output_types=(tf.int32, tf.float32)))
    case("from_generator_args", lambda: D.from_generator(
        lambda n, s: ((int(i) * 10, s.decode() + str(i)) for i in range(n)), output_types=(tf.int64, tf.string), args=(3, "k")))
    add_task(("data", "from_generator_args_types"), lambda: py(next(D.from_generator(
        lambda a, b, c: iter([[type(a).__name__ + ":" + str(np.asarray(a).dtype), type(b).__name__ + ":" + str(np.asarray(b).dtype),
                               type(c).__name__ + ":" + str(np.asarray(c).dtype)]]),
        output_types=tf.string, args=(3, 2.5, "s")).as_numpy_iterator())))
    case("from_generator_signature", lambda: D.from_generator(
        gen_pairs, output_signature=(tf.TensorSpec((), tf.int64), tf.TensorSpec((None,), tf.float32))))
    add_task(("data", "from_generator_no_types"), lambda: guarded(lambda: {"no_error": elements(D.from_generator(gen_pairs))}))
    add_task(("data", "from_generator_shapes_mismatch"), lambda: guarded(lambda: {"no_error": elements(D.from_generator(
        gen_pairs, output_types=(tf.int64, tf.float32), output_shapes=((), (2,))))}))

    # distributed input
    def dist_spec(n, drop):
        s = mirrored(n)
        ds = D.from_tensor_slices((x83, y8)).batch(4, drop_remainder=drop)
        return _spec(s.experimental_distribute_dataset(ds).element_spec)

    for n in (1, 2):
        for drop in (False, True):
            add_task(("data", "distributed_element_spec", f"n{n}_drop{drop}"), lambda n=n, drop=drop: guarded(lambda: dist_spec(n, drop)))

    def from_function_unbatched(values):
        s = mirrored(2)
        dist = s.distribute_datasets_from_function(lambda ctx: D.from_tensor_slices(values))
        return {"steps": [local(s, e) for e in dist], "element_spec": _spec(dist.element_spec)}

    add_task(("data", "from_function_unbatched_n2_4"), lambda: guarded(lambda: from_function_unbatched([5.0, 6.0, 7.0, 8.0])))
    add_task(("data", "from_function_unbatched_n2_3"), lambda: guarded(lambda: from_function_unbatched([5.0, 6.0, 7.0])))

    def padded_images():
        # Images of 4x4 and 5x5 batched with padded_shapes=(None, None, 1): both replicas see 5x5.
        s = mirrored(2)
        images = [np.ones((4, 4, 1), np.float32), 2 * np.ones((5, 5, 1), np.float32)]
        ds = D.from_generator(lambda: iter(images), output_signature=tf.TensorSpec((None, None, 1), tf.float32))
        ds = ds.padded_batch(2, padded_shapes=(None, None, 1))
        return [[np.asarray(v).shape for v in s.experimental_local_results(e)] for e in s.experimental_distribute_dataset(ds)] + [
            [py(np.asarray(v)[..., 0]) for v in s.experimental_local_results(e)] for e in s.experimental_distribute_dataset(ds)]

    add_task(("data", "padded_images_n2"), lambda: guarded(padded_images))

    def strings_distributed():
        # 32 rows, a string column, batch 6, 3 replicas.
        s = mirrored(3)
        names = [f"n{i}" for i in range(32)]
        ds = D.from_tensor_slices({"name": names, "x": np.arange(32, dtype=np.float32)}).batch(6)
        steps = []
        for e in s.experimental_distribute_dataset(ds):
            steps.append({"name": local(s, e["name"]), "x": local(s, e["x"])})
        return steps

    add_task(("data", "strings_batch6_n3"), lambda: guarded(strings_distributed))

    def strings_in_run():
        s = mirrored(2)
        ds = D.from_tensor_slices({"name": ["a", "b", "c", "d"], "x": [1.0, 2.0, 3.0, 4.0]}).batch(4)
        e = next(iter(s.experimental_distribute_dataset(ds)))
        return {"no_error_result": local(s, s.run(tf.function(lambda d: tf.strings.length(d["name"])), args=(e,)))}

    add_task(("data", "strings_in_run_n2"), lambda: guarded(strings_in_run))

    # Files: list_files order, TextLineDataset, and FILE auto-sharding (TF's own rewrite).
    def files_case():
        from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset

        root = tempfile.mkdtemp(prefix="record_tf_files_")
        for f in range(4):
            with open(os.path.join(root, f"part-{f}.txt"), "w") as fh:
                fh.write("".join(f"f{f}-l{i}\n" for i in range(f + 1)))
        pattern = os.path.join(root, "part-*.txt")
        listed = [os.path.basename(p.decode()) for p in D.list_files(pattern, shuffle=False).as_numpy_iterator()]
        lines = [py(e) for e in tf.data.TextLineDataset(sorted(tf.io.gfile.glob(pattern))).as_numpy_iterator()]
        per_worker = {}
        for w in range(2):
            ds = D.list_files(pattern, shuffle=False).interleave(tf.data.TextLineDataset, cycle_length=1)
            opts = tf.data.Options()
            opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
            ds = _AutoShardDataset(ds.with_options(opts), 2, w, 2)
            per_worker[str(w)] = [py(e) for e in ds.as_numpy_iterator()]
        return {"list_files": listed, "text_lines": lines, "file_shard_2_workers": per_worker,
                "list_files_cardinality": int(D.list_files(pattern, shuffle=False).cardinality()),
                "list_files_spec": _spec(D.list_files(pattern).element_spec)}

    add_task(("data", "files"), lambda: guarded(files_case))
