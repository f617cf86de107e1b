"""Charts of the benchmark results for the documentation's performance page.

Reads the results files that the benchmark scripts write (``benchmarks/results/*/results.json``)
and draws one PNG per chart: medians as bars, the min-max over the repeats as error bars.
It measures nothing itself; rerun it after a benchmark run to refresh the figures.

    python benchmarks/plot_results.py                       # -> docs/images/performance/*.png
    python benchmarks/plot_results.py --out /tmp/charts     # elsewhere

Needs matplotlib (the ``examples`` extra).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

LABELS = {
    "dist_loop": "distribute custom loop",
    "dist_loop_lazy": "custom loop, reduce per epoch",
    "dist_fit": "distribute fit",
    "dist_fit_base": "distribute fit (before)",
    "jax": "hand-written JAX",
    "keras_dp": "Keras DataParallel",
    "tf": "TF MirroredStrategy",
}
COLORS = {
    "dist_loop": "#1f77b4", "dist_loop_lazy": "#aec7e8", "dist_fit": "#2ca02c", "dist_fit_base": "#98df8a",
    "jax": "#7f7f7f", "keras_dp": "#ff7f0e", "tf": "#d62728",
}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name / "results.json").read_text())


def _grouped_bars(ax, groups: list[str], series: dict[str, dict[str, tuple[float, float, float]]],
                  colors: dict[str, str], labels: dict[str, str]) -> None:
    """Bars per group (x) and series (colour); values are (median, min, max)."""
    width = 0.8 / max(len(series), 1)
    for k, (key, values) in enumerate(series.items()):
        xs, heights, low, high = [], [], [], []
        for g, group in enumerate(groups):
            if group in values:
                median, lo, hi = values[group]
                xs.append(g - 0.4 + width * (k + 0.5))
                heights.append(median)
                low.append(median - lo)
                high.append(hi - median)
        ax.bar(xs, heights, width, yerr=[low, high], capsize=2, color=colors.get(key), label=labels.get(key, key))
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _compare_py_chart(results: str, title: str) -> Callable:
    def draw(ax) -> str:
        data = _load(results)
        rows = [r for r in data["rows"] if r["workload"] == "mlp" and r["runs_ok"]]
        groups = [f"{n} replica{'s' if n > 1 else ''}" for n in sorted({r["replicas"] for r in rows})]
        series: dict[str, dict] = {}
        for r in rows:
            e = r["examples_per_second"]
            group = f"{r['replicas']} replica{'s' if r['replicas'] > 1 else ''}"
            series.setdefault(r["system"], {})[group] = (e["median"] / 1e3, e["min"] / 1e3, e["max"] / 1e3)
        series = {k: series[k] for k in LABELS if k in series}
        _grouped_bars(ax, groups, series, COLORS, LABELS)
        ax.set_ylabel("thousand examples/s (higher is better)")
        env = data["environment"]
        ax.set_title(f"{title}\n{env['cpu_count']} CPU cores, {env['date'][:10]}, commit {data['git_at_start']}; "
                     "median and min-max of the repeats", fontsize=9)
        return "examples/s"
    return draw


def _ps_chart(ax) -> str:
    data = _load("ps/channel")
    labels = {"ours": "distribute (Ray + direct channel)", "base": "distribute, before the channel", "tf": "TF ParameterServerStrategy"}
    colors = {"ours": "#2ca02c", "base": "#98df8a", "tf": "#d62728"}
    series: dict[str, dict] = {}
    groups = [f"{n} worker{'s' if n > 1 else ''}" for n in sorted({r["workers"] for r in data["rows"]})]
    for r in data["rows"]:
        group = f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}"
        series.setdefault(r["system"], {})[group] = (r["median"] / 1e3, r["min"] / 1e3, r["max"] / 1e3)
    _grouped_bars(ax, groups, {k: series[k] for k in labels if k in series}, colors, labels)
    ax.set_ylabel("thousand examples/s (higher is better)")
    meta = data["meta"]
    ax.set_title(f"ParameterServerStrategy, MLP 784-64-10, 1 ps, batch 64 per worker\n{meta['date']}, commit "
                 f"{meta['commit']}; median and min-max of {meta['repeats']} interleaved repeats", fontsize=9)
    return "examples/s"


def _multi_worker_chart(ax) -> str:
    data = _load("multi_worker")
    labels = {
        "single": "one process, 2 devices",
        "2x1": "2 workers x 1 device",
        "jax step 2x1": "hand-written JAX, 2 processes",
        "jax psum 2x1": "its all-reduce alone",
    }
    rows = {r["kind"]: r for r in data["rows"]}
    kinds = [k for k in labels if k in rows]
    medians = [rows[k]["step_ms"]["median"] for k in kinds]
    low = [m - rows[k]["step_ms"]["min"] for m, k in zip(medians, kinds)]
    high = [rows[k]["step_ms"]["max"] - m for m, k in zip(medians, kinds)]
    ax.barh(range(len(kinds)), medians, xerr=[low, high], capsize=3,
            color=["#1f77b4", "#2ca02c", "#7f7f7f", "#c7c7c7"][: len(kinds)])
    ax.set_yticks(range(len(kinds)), [labels[k] for k in kinds])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (lower is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    env = data["environment"]
    ax.set_title(f"MultiWorkerMirroredStrategy on CPU (gloo, loopback), MLP loop, global batch 128\n"
                 f"{env['cpu_count']} CPU cores, {env['date'][:10]}; median and min-max", fontsize=9)
    return "ms/step"


# file name -> (drawing function, figure size); the performance page shows each file.
CHARTS: dict[str, tuple[Callable, tuple[float, float]]] = {
    "mlp_throughput.png": (_compare_py_chart("mlp", "MLP 784-64-10, Adam, per-replica batch 64 (idealized: no metrics, no shuffle)"), (9, 4.5)),
    "fit_as_users_run_it.png": (_compare_py_chart("user", "fit as users run it: metrics, shuffle, partial last batch (MLP 784-64-10)"), (9, 4.5)),
    "parameter_server.png": (_ps_chart, (8, 4.2)),
    "multi_worker.png": (_multi_worker_chart, (8, 3.6)),
}


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "images" / "performance",
                        help="directory for the PNG files (default: docs/images/performance)")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (draw, size) in CHARTS.items():
        fig, ax = plt.subplots(figsize=size)
        draw(ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4, frameon=False)
        fig.tight_layout()
        path = args.out / name
        fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        written.append(path)
        print(path)
    return written


if __name__ == "__main__":
    main()
