"""Distributed input beyond numeric batches: element_spec, unbatched per-replica datasets, padded batches,
string features, grain pipelines, files with FILE sharding, and Keras fit with no strategy.

TF 2.21 values come from tests/parity/tf_2_21.json ("data").
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import mirrored, tf_fixture
from test_data_tf_names import plain, spec_json, tf_spec

import distribute
from distribute.data import (
    AutoShardPolicy,
    Dataset,
    NumpyFileDataset,
    Options,
    TensorSpec,
    TextLineDataset,
)
from distribute.data._files import shard_by_files
from distribute.input.specs import PerReplicaSpec

TF = tf_fixture()["data"]
X83 = np.arange(24, dtype=np.float32).reshape(8, 3)
Y8 = np.arange(8, dtype=np.int32)


def dist_spec_json(spec):
    if isinstance(spec, (tuple, list)):
        return [dist_spec_json(s) for s in spec]
    if isinstance(spec, PerReplicaSpec):
        return {"type": "PerReplicaSpec", "per_replica": [spec_json(s) for s in spec._component_specs]}
    return spec_json(spec)


def strip_repr(recorded):
    if isinstance(recorded, list):
        return [strip_repr(r) for r in recorded]
    if "per_replica" in recorded:
        return {"type": recorded["type"], "per_replica": [tf_spec(s) for s in recorded["per_replica"]]}
    return tf_spec(recorded)


@pytest.mark.parametrize("n, drop", [(1, False), (1, True), (2, False), (2, True)])
def test_distributed_element_spec_matches_tf(n, drop):
    dist = mirrored(n).experimental_distribute_dataset(Dataset.from_tensor_slices((X83, Y8)).batch(4, drop_remainder=drop))
    expected = strip_repr(TF["distributed_element_spec"][f"n{n}_drop{drop}"])
    assert dist_spec_json(dist.element_spec) == expected
    assert dist_spec_json(iter(dist).element_spec) == expected


@pytest.mark.parametrize("values, name", [([5.0, 6.0, 7.0, 8.0], "from_function_unbatched_n2_4"),
                                          ([5.0, 6.0, 7.0], "from_function_unbatched_n2_3")])
def test_unbatched_per_replica_dataset_from_function_matches_tf(values, name):
    s = mirrored(2)
    dist = s.distribute_datasets_from_function(lambda ctx: Dataset.from_tensor_slices(values))
    steps = [[float(v) for v in s.experimental_local_results(e)] for e in dist]
    assert steps == TF[name]["steps"]  # 3 values: the incomplete second step is dropped, as TF
    assert dist_spec_json(dist.element_spec) == strip_repr(TF[name]["element_spec"])
    doubled = s.run(lambda v: v * 2.0, args=(next(iter(dist)),))
    assert [float(v) for v in s.experimental_local_results(doubled)] == [10.0, 12.0]


def test_unbatched_dataset_to_experimental_distribute_dataset():
    # TF 2.21 hands scalar elements through on one replica and fails (IndexError) on two; ours is a ValueError
    # whose message says both, and points to the fixes.
    assert tf_fixture()["errors"]["distribute_unbatched_dataset_n1"]["no_error_steps"] == [[0], [1], [2], [3], [4]]
    assert tf_fixture()["errors"]["distribute_unbatched_dataset_n2"]["error"] == "IndexError"
    for n in (1, 2):
        with pytest.raises(ValueError, match="unbatched dataset.*batch\\(global_batch_size\\).*distribute_datasets_from_function.*"
                                             "IndexError on several replicas and hands each element through on one"):
            mirrored(n).experimental_distribute_dataset(Dataset.range(5))


def test_padded_images_give_both_replicas_5x5():
    s = mirrored(2)
    images = [np.ones((4, 4, 1), np.float32), 2 * np.ones((5, 5, 1), np.float32)]
    ds = Dataset.from_generator(lambda: iter(images), output_signature=TensorSpec((None, None, 1), np.float32))
    ds = ds.padded_batch(2, padded_shapes=(None, None, 1))
    shapes = [[list(np.shape(v)) for v in s.experimental_local_results(e)] for e in s.experimental_distribute_dataset(ds)]
    pixels = [[np.asarray(v)[..., 0].tolist() for v in s.experimental_local_results(e)] for e in s.experimental_distribute_dataset(ds)]
    assert shapes + pixels == TF["padded_images_n2"]


def test_string_feature_distributes_with_tf_layout():
    s = mirrored(3)
    names = [f"n{i}" for i in range(32)]
    ds = Dataset.from_tensor_slices({"name": names, "x": np.arange(32, dtype=np.float32)}).batch(6)
    steps = []
    for e in s.experimental_distribute_dataset(ds):
        steps.append({"name": [plain(v) for v in s.experimental_local_results(e["name"])],
                      "x": [np.asarray(v).tolist() for v in s.experimental_local_results(e["x"])]})
    assert steps == TF["strings_batch6_n3"]
    assert len(steps) == 6 and sum(len(n) for step in steps for n in step["name"]) == 32


def test_string_feature_into_run_raises_type_error_naming_it():
    s = mirrored(2)
    ds = Dataset.from_tensor_slices({"name": ["a", "b", "c", "d"], "x": [1.0, 2.0, 3.0, 4.0]}).batch(4)
    element = next(iter(s.experimental_distribute_dataset(ds)))
    with pytest.raises(TypeError, match=r"\['name'\] holds non-numeric values.*map"):
        s.run(lambda d: d["x"] * 2.0, args=(element,))
    # the numeric feature of the same element still runs
    assert [np.asarray(v).tolist() for v in s.experimental_local_results(s.run(lambda v: v * 2.0, args=(element["x"],)))] == [
        [2.0, 4.0], [6.0, 8.0]]


def test_strings_from_function_and_mapped_to_ids():
    s = mirrored(2)
    vocab = {b"a": 0, b"b": 1, b"c": 2}
    ds = Dataset.from_tensor_slices(["a", "b", "c", "a"]).map(lambda w: np.int32(vocab[bytes(w)])).batch(2)
    dist = s.distribute_datasets_from_function(lambda ctx: ds)
    assert [[np.asarray(v).tolist() for v in s.experimental_local_results(e)] for e in dist] == [[[0, 1], [2, 0]]]
    raw = s.distribute_datasets_from_function(lambda ctx: Dataset.from_tensor_slices(["a", "b", "c"]).batch(1))
    assert [[plain(v) for v in s.experimental_local_results(e)] for e in raw] == [[["a"], ["b"]], [["c"], []]]


def test_grain_pipeline_distributes_like_a_dataset():
    import grain

    s = mirrored(2)
    source = grain.MapDataset.source(list(range(10))).map(lambda v: np.float32(v)).batch(4)
    got = [[np.asarray(v).tolist() for v in s.experimental_local_results(e)] for e in s.experimental_distribute_dataset(source)]
    ours = Dataset.range(10).map(lambda v: np.float32(v)).batch(4)
    want = [[np.asarray(v).tolist() for v in s.experimental_local_results(e)] for e in s.experimental_distribute_dataset(ours)]
    assert got == want == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]], [[8.0], [9.0]]]
    iter_ds = grain.MapDataset.source(list(range(6))).to_iter_dataset().batch(3)
    dist = s.distribute_datasets_from_function(lambda ctx: iter_ds)
    assert [[np.asarray(v).tolist() for v in s.experimental_local_results(e)] for e in dist] == [[[0, 1, 2], [3, 4, 5]]]


def test_fit_evaluate_predict_on_a_dataset_with_no_strategy():
    x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)

    def trained(data):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(data, epochs=2, verbose=0)
        return model, history.history["loss"]

    with_dataset, losses = trained(Dataset.from_tensor_slices((x, y)).batch(4))
    keras.utils.set_random_seed(1)
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref_losses = reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(with_dataset.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(with_dataset.evaluate(Dataset.from_tensor_slices((x, y)).batch(4), verbose=0),
                               reference.evaluate(x, y, batch_size=4, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(with_dataset.predict(Dataset.from_tensor_slices(x).batch(4), verbose=0),
                               reference.predict(x, batch_size=4, verbose=0), rtol=1e-6)


def test_fit_with_a_string_feature_names_it():
    s = mirrored(2)
    with s.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    ds = Dataset.from_tensor_slices(({"word": ["a", "b"]}, [1.0, 2.0])).batch(2)
    with pytest.raises(TypeError, match=r"non-numeric input feature \[0\]\['word'\]"):
        model.fit(ds, epochs=1, verbose=0)


def _write_text_files(root, num_files):
    for f in range(num_files):
        (root / f"part-{f}.txt").write_text("".join(f"f{f}-l{i}\n" for i in range(f + 1)))
    return str(root / "part-*.txt")


def test_list_files_and_text_lines_match_tf(tmp_path):
    pattern = _write_text_files(tmp_path, 4)
    expected = TF["files"]
    import os

    listed = Dataset.list_files(pattern, shuffle=False)
    assert [os.path.basename(bytes(p).decode()) for p in listed] == expected["list_files"]
    assert listed.cardinality() == expected["list_files_cardinality"]
    assert spec_json(Dataset.list_files(pattern).element_spec) == tf_spec(expected["list_files_spec"])
    assert [plain(e) for e in TextLineDataset(sorted(str(p) for p in tmp_path.glob("part-*.txt")))] == expected["text_lines"]
    shuffled = Dataset.list_files(pattern, seed=4)
    assert sorted(bytes(p) for p in shuffled) == sorted(bytes(p) for p in listed)
    with pytest.raises(ValueError, match="no files match"):
        Dataset.list_files(str(tmp_path / "missing-*.txt"))


def test_file_sharding_gives_each_worker_its_files_as_tf(tmp_path):
    # TF 2.21's own FILE auto-shard rewrite, 2 workers, 4 files: worker 0 reads files 0 and 2.
    pattern = _write_text_files(tmp_path, 4)
    dataset = Dataset.list_files(pattern, shuffle=False).interleave(TextLineDataset, cycle_length=1)
    for worker in (0, 1):
        assert [plain(e) for e in shard_by_files(dataset, 2, worker)] == TF["files"]["file_shard_2_workers"][str(worker)]
    with pytest.raises(ValueError, match="reads 4 files, fewer than the 5 workers"):
        shard_by_files(dataset, 5, 0)
    assert shard_by_files(Dataset.range(4), 2, 0) is None


def test_file_sharding_replays_the_whole_pipeline(tmp_path):
    pattern = _write_text_files(tmp_path, 4)
    dataset = (Dataset.list_files(pattern, shuffle=False).interleave(TextLineDataset, cycle_length=2)
               .map(lambda line: line + b"!").batch(2))
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    dataset = dataset.with_options(options)
    parts = [[plain(b) for b in shard_by_files(dataset, 2, w)] for w in (0, 1)]
    assert parts[0] == [["f0-l0!", "f2-l0!"], ["f2-l1!", "f2-l2!"]]
    assert sorted(line for part in parts for batch in part for line in batch) == sorted(
        line + "!" for line in TF["files"]["text_lines"])
    assert shard_by_files(dataset, 2, 1).options().experimental_distribute.auto_shard_policy == AutoShardPolicy.FILE


def test_numpy_files_npy_and_npz(tmp_path):
    for f in range(3):
        np.save(tmp_path / f"x-{f}.npy", np.arange(4 * f, 4 * f + 4, dtype=np.float32).reshape(2, 2))
        np.savez(tmp_path / f"d-{f}.npz", a=np.full((2,), f, np.int64), b=np.arange(2, dtype=np.float32) + f)
    rows = NumpyFileDataset(Dataset.list_files(str(tmp_path / "x-*.npy"), shuffle=False))
    assert [plain(r) for r in rows] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
    assert spec_json(rows.element_spec) == {"shape": [2], "dtype": "float32"}
    assert [plain(r) for r in shard_by_files(rows, 2, 1)] == [[4.0, 5.0], [6.0, 7.0]]
    dicts = NumpyFileDataset(sorted(str(p) for p in tmp_path.glob("d-*.npz")))
    assert [plain(r) for r in dicts.batch(3)] == [{"a": [0, 0, 1], "b": [0.0, 1.0, 1.0]}, {"a": [1, 2, 2], "b": [2.0, 2.0, 3.0]}]


def test_array_record_files(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    from distribute.data import ArrayRecordDataset

    paths = []
    for f in range(2):
        path = str(tmp_path / f"r-{f}.array_record")
        writer = ArrayRecordWriter(path, "group_size:1")
        for i in range(3):
            writer.write(f"file{f}-rec{i}".encode())
        writer.close()
        paths.append(path)
    records = ArrayRecordDataset(paths)
    assert [plain(r) for r in records] == [f"file{f}-rec{i}" for f in range(2) for i in range(3)]
    assert [plain(r) for r in shard_by_files(records, 2, 1)] == ["file1-rec0", "file1-rec1", "file1-rec2"]


def test_one_worker_file_policy_reads_everything(tmp_path):
    # FILE with a single worker reads all files (MultiWorkerMirroredStrategy with no cluster).
    pattern = _write_text_files(tmp_path, 2)
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    dataset = TextLineDataset(Dataset.list_files(pattern, shuffle=False)).batch(2).with_options(options)
    s = distribute.MultiWorkerMirroredStrategy()
    got = [plain(v) for e in s.experimental_distribute_dataset(dataset) for v in s.experimental_local_results(e)]
    assert sorted(x for part in got for x in part) == ["f0-l0", "f1-l0", "f1-l1"]


def test_fit_on_a_grain_pipeline_equals_fit_on_arrays():
    import grain

    x = np.random.default_rng(2).normal(size=(20, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    s = mirrored(2)

    def train(data, **kwargs):
        with s.scope():
            keras.utils.set_random_seed(4)
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        losses = model.fit(data, epochs=2, verbose=0, **kwargs).history["loss"]
        return model.get_weights(), losses

    pipeline = grain.MapDataset.source(list(range(20))).map(lambda i: (x[i], y[i])).batch(8)
    got_weights, got_losses = train(pipeline)
    want_weights, want_losses = train(x, y=y, batch_size=8, shuffle=False)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    for a, b in zip(got_weights, want_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_agree_seeds_covers_every_unseeded_shuffle_upstream(tmp_path):
    from types import SimpleNamespace

    from distribute.input.distributed_dataset import agree_seeds

    pattern = _write_text_files(tmp_path, 2)
    seeded = Dataset.range(4).shuffle(4, seed=9)
    unseeded = Dataset.range(4).shuffle(4)
    files = TextLineDataset(Dataset.list_files(pattern))  # list_files shuffles without a seed
    combined = Dataset.zip((seeded, unseeded.map(lambda v: v * 2))).concatenate(
        Dataset.zip((Dataset.range(2), Dataset.range(2).shuffle(2)))).take(5)
    asked = []

    def agree(bases):  # worker 0's values, as MultiWorkerMirroredStrategy's exchange returns them
        asked.append(list(bases))
        return [1000 + i for i in range(len(bases))]

    strategy = SimpleNamespace(extended=SimpleNamespace(input_policy=SimpleNamespace(agree_on_seeds=agree)))
    agree_seeds(strategy, combined)
    agree_seeds(strategy, files)
    agree_seeds(strategy, combined)  # already agreed: not asked again
    assert [len(a) for a in asked] == [2, 1]
    assert [s.base for s in combined._seeds] == [1000, 1001] and files._seeds[0].base == 1000
    assert seeded._seeds == ()  # a seeded shuffle keeps its own seed
    # two workers' unseeded shuffles, once agreed, give one order per pass (and a new one each pass)
    a, b = Dataset.range(50).shuffle(50), Dataset.range(50).map(lambda v: v).shuffle(50)
    a._seeds[0].agree(5)
    b._seeds[0].agree(5)
    first_a, first_b = [int(v) for v in a], [int(v) for v in b]
    assert first_a == first_b and sorted(first_a) == list(range(50))
    second_a, second_b = [int(v) for v in a], [int(v) for v in b]
    assert second_a == second_b != first_a
