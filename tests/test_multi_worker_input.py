"""Distributed input across real worker processes on loopback: unseeded shuffles seen exactly once,
FILE sharding of files, string features, Keras fit agreeing on the shuffle seed.

One launch per cluster shape (2 workers x 1 device with a file case, 3 x 1);
each worker runs every case and writes one JSON file. The same file is the
worker program (``python tests/test_multi_worker_input.py OUT_DIR``).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
LAUNCH_TIMEOUT_SECONDS = 150
pytestmark = pytest.mark.multiprocess


def shuffle_cases() -> list[dict]:
    """Random pipelines (fixed seed, so every worker and the checker agree): sizes, batches, buffers, epochs."""
    rng = random.Random(20261201)
    cases = [{"n": 16, "batch": 4, "buffer": 16, "epochs": 2, "grain_path": False},  # the measured case
             {"n": 13, "batch": 4, "buffer": 5, "epochs": 2, "grain_path": True}]
    for _ in range(8):
        n = rng.randint(1, 40)
        cases.append({"n": n, "batch": rng.randint(1, 9), "buffer": rng.randint(1, n + 3),
                      "epochs": rng.randint(1, 3), "grain_path": rng.random() < 0.5})
    return cases


def _worker(out_dir: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    import keras

    import distribute
    from distribute.data import Dataset, TextLineDataset

    strategy = distribute.MultiWorkerMirroredStrategy()
    _, me = strategy.extended.input_policy.input_pipelines()
    out: dict = {"shuffle": []}
    for case in shuffle_cases():
        dataset = Dataset.range(case["n"])
        if case["grain_path"]:
            dataset = dataset.map(lambda x: x)
        dataset = dataset.shuffle(case["buffer"]).batch(case["batch"])  # no seed
        dist = strategy.experimental_distribute_dataset(dataset)
        epochs = []
        for _ in range(case["epochs"]):
            ids = []
            for batch in dist:
                for part in strategy.experimental_local_results(batch):
                    ids.extend(np.asarray(part).tolist())
            epochs.append(ids)
        out["shuffle"].append(epochs)

    # FILE sharding: 4 files, each worker reads its own (files written by worker 0 before a barrier).
    files_dir = pathlib.Path(os.environ["INPUT_FILES_DIR"])
    pattern = str(files_dir / "part-*.txt")
    lines = TextLineDataset(Dataset.list_files(pattern)).batch(2)  # an unseeded list_files shuffle, too
    seen = []
    for _ in range(2):
        epoch = []
        for batch in strategy.experimental_distribute_dataset(lines):
            epoch.extend(x.decode() for part in strategy.experimental_local_results(batch) for x in np.asarray(part).tolist())
        seen.append(epoch)
    out["file_lines"] = seen

    # A string feature under DATA sharding.
    names = [f"n{i}" for i in range(11)]
    text = Dataset.from_tensor_slices({"name": names, "x": np.arange(11, dtype=np.float32)}).batch(4)
    out["names"] = [[x.decode() for x in np.asarray(part).tolist()]
                    for batch in strategy.experimental_distribute_dataset(text)
                    for part in strategy.experimental_local_results(batch["name"])]

    # Keras fit on an unseeded shuffle: every worker trains on one order (identical weights).
    x = np.random.default_rng(3).normal(size=(24, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    fit_data = Dataset.from_tensor_slices((x, y)).shuffle(24).batch(6)
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(fit_data, epochs=2, verbose=0)
    out["fit_seed"] = fit_data._seeds[0].base
    out["fit_weights"] = [w.tolist() for w in model.get_weights()]
    out["agreement"] = _agreement_cases(strategy, me)
    pathlib.Path(out_dir, f"worker{me}.json").write_text(json.dumps(out))


def _agreement_cases(strategy, me: int) -> dict:
    """Coordination-service exchanges per pass, and every replica's rows, for three end-of-data cases."""
    import distribute
    from distribute.data import Dataset

    exchange = strategy.extended.input_policy._exchange
    gather = exchange.all_gather
    calls = []

    def counted(key, payload, what):
        calls.append(what)
        return gather(key, payload, what)

    exchange.all_gather = counted
    off = distribute.data.Options()
    off.experimental_distribute.auto_shard_policy = distribute.data.experimental.AutoShardPolicy.OFF
    cases = {
        # known, equal cardinality (DATA): one exchange per pass, uneven last batch (10 = 4 + 4 + 2 rows)
        "known": Dataset.range(10).batch(4),
        # unknown cardinality: the batch sizes are exchanged at every step (3 steps + the end)
        "unknown": Dataset.range(12).filter(lambda x: x % 2 == 0).batch(2),
        # cardinalities differ between workers: every step agreed; the shorter workers give no rows
        "different": Dataset.range(8 + 4 * me).batch(4),
        # AutoShardPolicy.OFF on a batched dataset: every worker reads it all, rebatched in order (TF's input_lib)
        "off_batched": Dataset.range(12).batch(8).with_options(off),
    }
    out = {}
    try:
        for name, dataset in cases.items():
            before = len(calls)
            steps = []
            for batch in strategy.experimental_distribute_dataset(dataset):
                steps.append([np.asarray(part).tolist() for part in strategy.experimental_local_results(batch)])
            out[name] = {"exchanges": len(calls) - before, "steps": steps}
    finally:
        exchange.all_gather = gather
    return out


def _launch(num_workers: int, tmp_path: pathlib.Path) -> list[dict]:
    from distribute.launch import launch

    files = tmp_path / "files"
    files.mkdir()
    for f in range(4):
        (files / f"part-{f}.txt").write_text("".join(f"f{f}-l{i}\n" for i in range(f + 1)))
    env = {"KERAS_BACKEND": "jax", "INPUT_FILES_DIR": str(files),
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    result = launch([str(HERE), str(tmp_path)], num_workers, 1, env=env, timeout_seconds=LAUNCH_TIMEOUT_SECONDS, echo=False)
    assert result.returncode == 0, result.output[-6000:]
    return [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in range(num_workers)]


@pytest.fixture(scope="module", params=[2, 3], ids=["2_workers", "3_workers"])
def workers(request, tmp_path_factory):
    return _launch(request.param, tmp_path_factory.mktemp(f"mwin{request.param}"))


def test_unseeded_shuffle_every_example_exactly_once_per_epoch(workers):
    for case, per_case in zip(shuffle_cases(), zip(*[w["shuffle"] for w in workers])):
        for epoch in range(case["epochs"]):
            ids = [i for worker in per_case for i in worker[epoch]]
            assert sorted(ids) == list(range(case["n"])), (case, epoch, [w[epoch] for w in per_case])
    first = shuffle_cases()[0]
    orders = [[i for w in zip(*[w["shuffle"][0][e] for w in workers]) for i in w] for e in range(first["epochs"])]
    assert orders[0] != list(range(first["n"]))  # it did shuffle


def test_file_sharding_each_worker_reads_its_files_once(workers):
    expected = sorted(f"f{f}-l{i}" for f in range(4) for i in range(f + 1))
    for epoch in range(2):
        lines = [line for w in workers for line in w["file_lines"][epoch]]
        assert sorted(lines) == expected
        files_per_worker = [{line.split("-")[0] for line in w["file_lines"][epoch]} for w in workers]
        assert sum(len(f) for f in files_per_worker) == 4  # each file read by exactly one worker
        if len(workers) == 2:
            assert [len(f) for f in files_per_worker] == [2, 2]


def test_string_feature_split_between_workers(workers):
    assert sorted(n for w in workers for part in w["names"] for n in part) == sorted(f"n{i}" for i in range(11))


def test_fit_on_unseeded_shuffle_agrees_between_workers(workers):
    assert len({w["fit_seed"] for w in workers}) == 1
    for w in workers[1:]:
        for got, want in zip(w["fit_weights"], workers[0]["fit_weights"]):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_end_of_data_agreed_once_per_pass_when_cardinality_is_known(workers):
    n = len(workers)
    known = [w["agreement"]["known"] for w in workers]
    assert [k["exchanges"] for k in known] == [1] * n  # not one per step
    # 3 steps on every worker; every example once: the same rows as agreeing at every step
    assert [len(k["steps"]) for k in known] == [3] * n
    assert sorted(i for k in known for step in k["steps"] for part in step for i in part) == list(range(10))
    unknown = [w["agreement"]["unknown"] for w in workers]
    assert [u["exchanges"] for u in unknown] == [1 + 3 + 1] * n  # the plan, 3 steps, the end
    assert sorted(i for u in unknown for step in u["steps"] for part in step for i in part) == list(range(0, 12, 2))
    different = [w["agreement"]["different"] for w in workers]
    # Worker w reads range(8 + 4w) in batches of 4 and keeps its replica's share (TF's split rule);
    # steps run while any worker has rows.
    from distribute.input.splitting import split_counts

    own = [[int(split_counts(len(b), n)[w]) for b in np.array_split(np.arange(8 + 4 * w), range(4, 8 + 4 * w, 4))] for w in range(n)]
    longest = max(max((i + 1 for i, rows in enumerate(o) if rows), default=0) for o in own)
    assert longest > 2  # the longer workers' data outlasts worker 0's 2 batches
    assert [len(d["steps"]) for d in different] == [longest] * n  # every worker takes the same steps
    for w, d in enumerate(different):
        assert [len(step[0]) for step in d["steps"]] == (own[w] + [0] * longest)[:longest]
    assert [d["exchanges"] for d in different] == [1 + longest + 1] * n



def test_off_sharding_of_a_batched_dataset_rebatches_in_order_as_tf(workers):
    """TF's input_lib test: range(12).batch(8), AutoShardPolicy.OFF, 2 workers x 1 replica: every worker takes
    3 steps of 4 rows (the global batch of 8 rebatched to 4 per replica, the last batch of 4 not split again)."""
    steps = [w["agreement"]["off_batched"]["steps"] for w in workers]
    if len(workers) == 2:
        assert steps == [[[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]]] * 2
    for worker_steps in steps:  # every worker reads every example once, in order, no step empty
        assert [i for step in worker_steps for part in step for i in part] == list(range(12))

if __name__ == "__main__":
    _worker(sys.argv[1])
