"""Input-pipeline benchmark: in-memory arrays, a map-heavy pipeline, and files.

Usage::

    KERAS_BACKEND=jax PYTHONPATH=src /work/venv/bin/python benchmarks/input_pipeline.py [--out DIR] [--repeats N]
    # with tf.data rows beside ours (an interpreter that has tensorflow-cpu and the project's deps):
    KERAS_BACKEND=jax PYTHONPATH=src /work/tfvenv/bin/python benchmarks/input_pipeline.py --out DIR

Each row times one full pass (best of ``--repeats``, after one warm-up pass)
and reports seconds and elements (or batches) per second. Writes
``results.json`` and ``results.md`` to ``--out`` (default
``benchmarks/results/input``).

Cases:

* ``arrays``: 60,000 x 784 float32 + labels, ``shuffle(60_000, seed).batch(128)``:
  the vectorised plan (``distribute.data`` default), the same pipeline forced
  onto the grain element path (an identity ``map`` first), tf.data, and the
  plan through ``experimental_distribute_dataset`` over 2 replicas (placement included).
* ``map_heavy``: 64 elements that each wait 5 ms (I/O-like), then 64 that each
  ``np.sort`` 400,000 random floats (compute): ``map`` sequential, ``num_parallel_calls=2``, ``AUTOTUNE``,
  grain's ``MapDataset.map(...).to_iter_dataset(ReadOptions(num_threads=...))``, tf.data.
* ``files``: 8 ``.npy`` shards of 7,500 x 784 float32: ``NumpyFileDataset(list_files).batch(128)``,
  and 8 text files of 20,000 lines through ``TextLineDataset``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np

HEAVY_ELEMENTS, HEAVY_SIZE = 64, 400_000


def timed(make_iterable, repeats: int) -> tuple[float, int]:
    """Best seconds of a full pass, and the number of items a pass yields."""
    count = sum(1 for _ in make_iterable())  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in make_iterable():
            pass
        best = min(best, time.perf_counter() - start)
    return best, count


def heavy(x):
    return np.sort(np.random.default_rng(int(x)).random(HEAVY_SIZE))[:4]


def io_like(x):
    time.sleep(0.005)  # a read or a decode that waits: 5 ms per element
    return np.full(4, x, np.float64)


def arrays_cases(tf):
    from distribute import MirroredStrategy
    from distribute.data import Dataset

    rng = np.random.default_rng(0)
    x = rng.random((60_000, 784), dtype=np.float32)
    y = rng.integers(0, 10, 60_000).astype(np.int32)
    cases = {
        "plan (from_tensor_slices.shuffle.batch)": lambda: Dataset.from_tensor_slices((x, y)).shuffle(60_000, seed=1).batch(128),
        "grain element path (identity map first)": lambda: Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a, b)).shuffle(60_000, seed=1).batch(128),
    }
    strategy = MirroredStrategy(["/cpu:0", "/cpu:1"])
    cases["plan + experimental_distribute_dataset, 2 replicas"] = lambda: strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).shuffle(60_000, seed=1).batch(128))
    if tf is not None:
        cases["tf.data (from_tensor_slices.shuffle.batch)"] = lambda: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(60_000, seed=1).batch(128)
    return cases, "batches"


def map_cases(tf):
    import grain

    from distribute.data import AUTOTUNE, Dataset

    cases = {
        "io-like (5 ms wait) map sequential": lambda: Dataset.range(HEAVY_ELEMENTS).map(io_like),
        "io-like map num_parallel_calls=8": lambda: Dataset.range(HEAVY_ELEMENTS).map(io_like, num_parallel_calls=8),
        "io-like map AUTOTUNE": lambda: Dataset.range(HEAVY_ELEMENTS).map(io_like, num_parallel_calls=AUTOTUNE),
        "io-like grain ReadOptions(num_threads=8)": lambda: grain.MapDataset.range(HEAVY_ELEMENTS).map(io_like).to_iter_dataset(
            grain.ReadOptions(num_threads=8, prefetch_buffer_size=16)),
        "map sequential": lambda: Dataset.range(HEAVY_ELEMENTS).map(heavy),
        "map num_parallel_calls=2": lambda: Dataset.range(HEAVY_ELEMENTS).map(heavy, num_parallel_calls=2),
        "map num_parallel_calls=AUTOTUNE": lambda: Dataset.range(HEAVY_ELEMENTS).map(heavy, num_parallel_calls=AUTOTUNE),
        "map AUTOTUNE, deterministic=False": lambda: Dataset.range(HEAVY_ELEMENTS).map(heavy, num_parallel_calls=AUTOTUNE, deterministic=False),
        "grain MapDataset.map, ReadOptions(num_threads=2)": lambda: grain.MapDataset.range(HEAVY_ELEMENTS).map(heavy).to_iter_dataset(
            grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)),
    }
    if tf is not None:
        cases["tf.data map(py_function), AUTOTUNE"] = lambda: tf.data.Dataset.range(HEAVY_ELEMENTS).map(
            lambda v: tf.py_function(heavy, [v], tf.float64), num_parallel_calls=tf.data.AUTOTUNE)
    return cases, "elements"


def file_cases(root: pathlib.Path, tf):
    from distribute.data import Dataset, NumpyFileDataset, TextLineDataset

    rng = np.random.default_rng(1)
    for f in range(8):
        np.save(root / f"x-{f}.npy", rng.random((7_500, 784), dtype=np.float32))
        (root / f"t-{f}.txt").write_text("".join(f"line {f} {i} some words here\n" for i in range(20_000)))
    cases = {
        "NumpyFileDataset(8 .npy).batch(128)": lambda: NumpyFileDataset(Dataset.list_files(str(root / "x-*.npy"), shuffle=False)).batch(128),
        "TextLineDataset(8 files).batch(128)": lambda: TextLineDataset(Dataset.list_files(str(root / "t-*.txt"), shuffle=False)).batch(128),
    }
    if tf is not None:
        cases["tf.data TextLineDataset(8 files).batch(128)"] = lambda: tf.data.TextLineDataset(
            sorted(str(p) for p in root.glob("t-*.txt"))).batch(128)
    return cases, "batches"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "input"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    try:
        import tensorflow as tf
    except ImportError:
        tf = None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for group, (cases, unit) in {"arrays": arrays_cases(tf), "map_heavy": map_cases(tf),
                                     "files": file_cases(pathlib.Path(tmp), tf)}.items():
            for name, make in cases.items():
                seconds, count = timed(make, args.repeats)
                rows.append({"group": group, "case": name, "seconds": seconds, "items": count, "unit": unit,
                             "per_second": count / seconds})
                print(f"{group:10s} {name:55s} {seconds:8.3f} s  {count / seconds:10.1f} {unit}/s", flush=True)
    import grain
    import jax

    meta = {"python": platform.python_version(), "jax": jax.__version__, "grain": getattr(grain, "__version__", "?"),
            "tensorflow": None if tf is None else tf.__version__, "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": args.repeats,
            "command": " ".join([sys.executable, *sys.argv])}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| group | case | seconds (best) | items | per second |", "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['group']} | {r['case']} | {r['seconds']:.3f} | {r['items']} {r['unit']} | {r['per_second']:.1f} |" for r in rows]
    title = (f"Input pipeline benchmark, {meta['date']}, {meta['cpu_count']} CPUs, load {meta['load_average'][0]:.1f}, "
             f"jax {meta['jax']}, tensorflow {meta['tensorflow']}")
    title = (f"Input pipeline benchmark, {meta['date']}, {meta['cpu_count']} CPUs, load {meta['load_average'][0]:.1f}, "
             f"jax {meta['jax']}, tensorflow {meta['tensorflow']}")
    (out / "results.md").write_text("\n".join([title, "", *lines, ""]))


if __name__ == "__main__":
    main()
