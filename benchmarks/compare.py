"""Side-by-side training throughput: distribute vs hand-written JAX, Keras DataParallel, TensorFlow.

    python benchmarks/compare.py                      # mlp, replicas 1,2,4,8, 5 repeats, no TF
    python benchmarks/compare.py --tf-python /work/tfvenv/bin/python --replicas 1,2,8
    python benchmarks/compare.py --workloads seed,cnn --replicas 2 --steps-per-execution 8

Systems (each measurement is a fresh subprocess running benchmarks/_worker.py):

    dist_loop       (a) distribute custom loop: strategy.run + experimental_distribute_dataset,
                        compute_gradients, optimizer made in scope, strategy.reduce every step
    dist_loop_lazy  (a') the same loop, loss reduced once per epoch (opt-in via --systems)
    dist_fit        (b) distribute + Keras model.fit, model compiled in strategy.scope()
    jax             (c) hand-written JAX: jit + NamedSharding data parallel, optax Adam
    keras_dp        (d) Keras 3 keras.distribution.DataParallel + fit
    tf              (e) TensorFlow MirroredStrategy + Keras fit (needs --tf-python)

Systems are interleaved (their order rotates every repeat); medians, min-max and
ratios to (c) and (e) go to DIR/results.json and DIR/results.md.  Absolute numbers
drift on a shared machine; compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_worker.py"
ALL_SYSTEMS = ("dist_loop_base", "dist_loop", "dist_loop_lazy", "dist_fit_base", "dist_fit", "jax", "keras_dp", "tf")
DEFAULT_SYSTEMS = ("dist_loop", "dist_fit", "jax", "keras_dp", "tf")
FIT_SYSTEMS = ("dist_fit", "dist_fit_base", "keras_dp")  # get --steps-per-execution rows
LABELS = {
    "dist_loop_base": "(a0) distribute custom loop, --baseline-src",
    "dist_loop": "(a) distribute custom loop",
    "dist_loop_lazy": "(a') distribute custom loop, reduce per epoch",
    "dist_fit_base": "(b0) distribute model.fit, --baseline-src",
    "dist_fit": "(b) distribute model.fit",
    "jax": "(c) hand-written JAX",
    "keras_dp": "(d) Keras DataParallel fit",
    "tf": "(e) TF MirroredStrategy fit",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="mlp", help="comma list of mlp, seed, cnn (default: mlp)")
    p.add_argument("--replicas", default="1,2,4,8", help="comma list of replica counts (default: 1,2,4,8)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=5, help="measurements per row (default: 5)")
    p.add_argument("--steps-per-execution", type=int, default=1,
                   help="K > 1 adds rows with Keras steps_per_execution=K for dist_fit and keras_dp")
    p.add_argument("--tf-python", default=None, help="a Python interpreter with tensorflow-cpu; without it (e) is skipped")
    p.add_argument("--tf-replicas", default=None, help="replica counts for (e) (default: same as --replicas)")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: N virtual CPU devices per run; gpu: real GPUs (no forced CPU devices)")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs (default: per workload)")
    p.add_argument("--samples", type=int, default=None, help="override the workload's sample count")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is killed (default: 300)")
    p.add_argument("--retries", type=int, default=1, help="re-runs of a failed measurement (default: 1)")
    p.add_argument("--out", default=str(HERE / "results"), help="output directory (default: benchmarks/results/)")
    p.add_argument("--from-json", default=None, help="only re-render results.md (and targets) from this results.json")
    p.add_argument("--config", choices=("idealized", "user"), default="idealized",
                   help="idealized: no metrics, no shuffle, partial batch dropped; user: metrics=['accuracy'], "
                        "shuffle=True, partial last batch kept, hand JAX doing the same work (default: idealized)")
    p.add_argument("--verbose", type=int, default=0, help="Keras verbose for the fit systems' timed fit (default: 0)")
    p.add_argument("--baseline-src", default=None,
                   help="a src/ directory of another commit: adds systems dist_fit_base / dist_loop_base (its fit and "
                        "custom loop, beside dist_fit / dist_loop), interleaved with the others, for before/after ratios")
    p.add_argument("--python", default=sys.executable, help="interpreter for the JAX systems (default: this one)")
    args = p.parse_args(argv)
    args.workloads = _split(args.workloads, str)
    args.replicas = _split(args.replicas, int)
    args.systems = _split(args.systems, str)
    args.tf_replicas = _split(args.tf_replicas, int) if args.tf_replicas else list(args.replicas)
    for w in args.workloads:
        if w not in ("mlp", "seed", "cnn"):
            p.error(f"unknown workload {w!r}")
    for s in args.systems:
        if s not in ALL_SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(ALL_SYSTEMS)}")
    if args.repeats < 1 or args.steps_per_execution < 1 or any(r < 1 for r in args.replicas):
        p.error("--repeats, --steps-per-execution and replica counts must be >= 1")
    if args.baseline_src:
        for system in ("dist_fit", "dist_loop"):
            if system in args.systems and f"{system}_base" not in args.systems:
                args.systems.insert(0, f"{system}_base")
    if any(s.endswith("_base") for s in args.systems) and not args.baseline_src:
        p.error("systems dist_fit_base / dist_loop_base need --baseline-src DIR")
    if args.platform == "gpu" and "tf" in args.systems:
        args.systems.remove("tf")
    if args.config == "user":
        # The custom loop is measured idealized only (its own user-side work is the user's code).
        args.systems = [s for s in args.systems if s not in ("dist_loop", "dist_loop_lazy", "dist_loop_base")]
    return args


def _split(text: str, kind):
    return [kind(t.strip()) for t in text.split(",") if t.strip()]


# -- plan ---------------------------------------------------------------------------------
def variants(args) -> list[tuple[str, int | None]]:
    """(system, steps_per_execution) rows to measure for one (workload, replicas)."""
    out = []
    for s in args.systems:
        if s == "tf" and not args.tf_python:
            continue
        if s in FIT_SYSTEMS or s == "tf":
            out.append((s, 1))
            if s in FIT_SYSTEMS and args.steps_per_execution > 1:
                out.append((s, args.steps_per_execution))
        else:
            out.append((s, None))
    return out


def run_one(args, system: str, k: int | None, workload: str, replicas: int) -> dict:
    python = args.tf_python if system == "tf" else args.python
    worker_system = system.removesuffix("_base")
    cmd = [python, str(WORKER), worker_system, workload, str(replicas), "--platform", args.platform, "--config", args.config]
    if args.verbose and system not in ("jax", "dist_loop", "dist_loop_lazy"):
        cmd += ["--verbose", str(args.verbose)]
    if k is not None:
        cmd += ["--steps-per-execution", str(k)]
    if args.epochs:
        cmd += ["--epochs", str(args.epochs)]
    if args.samples:
        cmd += ["--samples", str(args.samples)]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets the device count itself
    if system.endswith("_base"):
        env["PYTHONPATH"] = os.pathsep.join([str(Path(args.baseline_src).resolve()), *[p for p in [env.get("PYTHONPATH")] if p]])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {args.timeout:.0f} s", "wall_seconds": args.timeout}
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            record = json.loads(line[len("RESULT "):])
            record.update(ok=True, wall_seconds=wall)
            return record
    tail = [l for l in (proc.stderr or "").splitlines() if l.strip() and not l.startswith("    @")][-3:]
    return {"ok": False, "error": f"exit {proc.returncode}: " + " | ".join(tail)[-400:], "wall_seconds": wall}


# -- summary ----------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for r in runs:
        key = (r["workload"], r["replicas"], r["system"], r["k"])
        row = rows.setdefault(key, {"workload": key[0], "replicas": key[1], "system": key[2],
                                    "steps_per_execution": key[3], "ok": [], "failed": []})
        (row["ok"] if r["result"]["ok"] else row["failed"]).append(r["result"])
    out = []
    for row in rows.values():
        ok = row.pop("ok")
        row["failures"] = [f["error"] for f in row.pop("failed")]
        row["runs_ok"] = len(ok)
        for field in ("examples_per_second", "first_step_seconds", "warmup_epoch_seconds", "peak_rss_mb", "baseline_rss_mb", "timed_seconds"):
            values = [r[field] for r in ok if r.get(field) is not None]
            row[field] = {
                "median": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "all": values,
            }
        out.append(row)
    order = {s: i for i, s in enumerate(ALL_SYSTEMS)}
    out.sort(key=lambda r: (r["workload"], r["replicas"], order[r["system"]], r["steps_per_execution"] or 0))
    for row in out:
        for ref in ("jax", "tf"):
            base = _find(out, row["workload"], row["replicas"], ref, 1 if ref == "tf" else None)
            row[f"ratio_to_{ref}"] = _ratio(row, base, "examples_per_second")
        row["rss_ratio_to_jax"] = _ratio(row, _find(out, row["workload"], row["replicas"], "jax", None), "peak_rss_mb")
    return out


def _find(rows, workload, replicas, system, k):
    for r in rows:
        if (r["workload"], r["replicas"], r["system"], r["steps_per_execution"]) == (workload, replicas, system, k):
            return r
    return None


def _ratio(row, base, field):
    if base is None or row[field]["median"] is None or not base[field]["median"]:
        return None
    return row[field]["median"] / base[field]["median"]


def check_targets(rows: list[dict], config: str = "idealized") -> list[dict]:
    """The project's targets, each with its measured value (None: not measured in this run)."""
    out = []
    if config == "user":
        return _user_targets(rows)

    def add(name, value, threshold, where, *rows_used):
        runs = min(r["runs_ok"] for r in rows_used)
        out.append({"target": name, "where": where, "value": value, "threshold": threshold, "runs": runs,
                    "holds": None if value is None else value >= threshold})

    for w in sorted({r["workload"] for r in rows}):
        for n in (2, 8):
            loop = _find(rows, w, n, "dist_loop", None)
            if loop and loop["ratio_to_jax"] is not None:
                add("custom loop >= 0.9x hand-written JAX", loop["ratio_to_jax"], 0.9, f"{w}, {n} replicas",
                    loop, _find(rows, w, n, "jax", None))
        for n in sorted({r["replicas"] for r in rows if r["workload"] == w}):
            for k in sorted({r["steps_per_execution"] for r in rows if r["system"] == "dist_fit"}):
                fit, dp = _find(rows, w, n, "dist_fit", k), _find(rows, w, n, "keras_dp", k)
                if fit and dp:
                    add("fit >= 1.0x Keras DataParallel", _ratio(fit, dp, "examples_per_second"), 1.0,
                        f"{w}, {n} replicas, steps_per_execution={k}", fit, dp)
    for system, name in (("dist_loop", "custom loop"), ("dist_fit", "fit")):
        row = _find(rows, "mlp", 2, system, None if system == "dist_loop" else 1)
        if row and row["ratio_to_tf"] is not None:
            add(f"{name} >= 4x TF MirroredStrategy", row["ratio_to_tf"], 4.0, "mlp, 2 replicas",
                row, _find(rows, "mlp", 2, "tf", 1))
    for r in rows:
        if r["system"] in ("dist_loop", "dist_fit") and r["rss_ratio_to_jax"] is not None:
            k = "" if r["steps_per_execution"] in (None, 1) else f", steps_per_execution={r['steps_per_execution']}"
            value = r["rss_ratio_to_jax"]
            out.append({"target": f"{LABELS[r['system']].split(' ', 1)[1]} peak memory <= 1.25x hand-written JAX",
                        "where": f"{r['workload']}, {r['replicas']} replicas{k}", "value": value,
                        "runs": min(r["runs_ok"], _find(rows, r["workload"], r["replicas"], "jax", None)["runs_ok"]),
                        "threshold": 1.25, "holds": value <= 1.25})
    return out


def _user_targets(rows: list[dict]) -> list[dict]:
    """Issue 11: fit as users run it (metrics, shuffle, partial last batch) at 2 and 8 replicas."""
    out = []
    for w in sorted({r["workload"] for r in rows}):
        for n in sorted({r["replicas"] for r in rows if r["workload"] == w}):
            fit = _find(rows, w, n, "dist_fit", 1)
            if fit is None:
                continue
            for ref, k, threshold, name in (("jax", None, 0.8, "hand-written JAX (same work)"),
                                            ("tf", 1, 5.0, "TF MirroredStrategy"),
                                            ("keras_dp", 1, 1.1, "Keras DataParallel")):
                base = _find(rows, w, n, ref, k)
                if base is None:
                    continue
                value = _ratio(fit, base, "examples_per_second")
                out.append({"target": f"user fit >= {threshold}x {name}", "where": f"{w}, {n} replicas", "value": value,
                            "threshold": threshold, "runs": min(fit["runs_ok"], base["runs_ok"]),
                            "holds": None if value is None else value >= threshold})
            base = _find(rows, w, n, "jax", None)
            if base is not None and fit["rss_ratio_to_jax"] is not None:
                value = fit["rss_ratio_to_jax"]
                out.append({"target": "user fit peak memory <= 1.1x hand-written JAX", "where": f"{w}, {n} replicas",
                            "value": value, "threshold": 1.1, "runs": min(fit["runs_ok"], base["runs_ok"]),
                            "holds": value <= 1.1})
    return out


# -- environment -----------------------------------------------------------------------------
def git_state() -> str | None:
    """``<commit>`` or ``<commit>+dirty`` of the checkout benchmarks/ sits in (src/ is what is measured)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=HERE.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment(args) -> dict:
    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "jax": version("jax"), "jaxlib": version("jaxlib"), "keras": version("keras"),
        "optax": version("optax"), "grain": version("grain"), "distribute": version("jax-distribute"),
        "cpu_model": cpu, "cpu_count": os.cpu_count(), "platform": args.platform,
        "host": platform.node(), "loadavg_at_start": os.getloadavg(),
    }
    if args.tf_python:
        probe = ("from importlib import metadata as m\n"
                 "for name in ('tensorflow-cpu', 'tensorflow'):\n"
                 "    try:\n        print(m.version(name)); break\n"
                 "    except m.PackageNotFoundError:\n        pass\n")
        try:
            out = subprocess.run([args.tf_python, "-c", probe], capture_output=True, text=True, timeout=60)
            env["tensorflow"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["tensorflow"] = None
    return env


# -- report -------------------------------------------------------------------------------------
def _fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def markdown(meta: dict, rows: list[dict], targets: list[dict]) -> str:
    env, cfg = meta["environment"], meta["config"]
    lines = [
        "# Benchmark results",
        "",
        f"- date: {env['date']}; host CPU: {env['cpu_model']} ({env['cpu_count']} cores), platform {env['platform']}",
        f"- jax {env['jax']}, jaxlib {env['jaxlib']}, keras {env['keras']}, optax {env['optax']}, "
        f"tensorflow {env.get('tensorflow') or 'not run'}, python {env['python']}",
        f"- command: `{cfg['command']}`",
        f"- source: git {meta.get('git_at_start')} at start, {meta.get('git_at_end')} at end"
        + ("" if meta.get("git_at_start") == meta.get("git_at_end") else " (**the code changed during the run**)"),
        f"- workload config: {cfg.get('config', 'idealized')}"
        + (" (metrics=['accuracy'], shuffle=True, partial last batch kept; hand JAX: per-epoch permutation, "
           "loss and accuracy summed on device every step, at most 2 steps in flight)" if cfg.get("config") == "user" else
           " (no metrics, no shuffle, partial batch dropped)")
        + (f"; fit verbose={cfg['verbose']}" if cfg.get("verbose") else ""),
        f"- repeats per row: {cfg['repeats']}, systems interleaved (order rotated each repeat); "
        f"devices per run = replicas ({'virtual CPU devices' if env['platform'] == 'cpu' else 'GPUs'})",
        f"- total wall time: {meta['wall_seconds']:.0f} s; load average at start: "
        + ", ".join(f"{x:.2f}" for x in env["loadavg_at_start"]),
        "",
        "examples/s = examples in the timed epochs / their wall seconds (median of the runs, min-max beside it). "
        "first step = tracing + compilation + the first step, to its result being ready. "
        "first epoch = the first full epoch after that (fit: the first with the partial last batch, so it includes "
        "that batch's compile unless it was compiled ahead). "
        "peak RSS = ru_maxrss of the run's process (includes the data set and framework imports). "
        "Ratios are of medians. Absolute numbers drift on a shared machine: only compare within one run.",
        "",
        "| workload | replicas | system | K | examples/s | min-max | x (c) JAX | x (e) TF | first step s | first epoch s | peak RSS MB | RSS x (c) | ok |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        eps = r["examples_per_second"]
        lines.append(
            f"| {r['workload']} | {r['replicas']} | {LABELS[r['system']]} | {r['steps_per_execution'] or '-'} "
            f"| {_fmt(eps['median'])} | {_fmt(eps['min'])}-{_fmt(eps['max'])} "
            f"| {_fmt(r['ratio_to_jax'], '.2f')} | {_fmt(r['ratio_to_tf'], '.2f')} "
            f"| {_fmt(r['first_step_seconds']['median'], '.2f')} "
            f"| {_fmt((r.get('warmup_epoch_seconds') or {}).get('median'), '.2f')} | {_fmt(r['peak_rss_mb']['median'], '.0f')} "
            f"| {_fmt(r['rss_ratio_to_jax'], '.2f')} | {r['runs_ok']}/{r['runs_ok'] + len(r['failures'])} |"
        )
    skipped = meta.get("skipped")
    if skipped:
        lines += ["", f"Skipped: {skipped}"]
    failed_rows = [r for r in rows if r["failures"]]
    if failed_rows:
        lines += ["", "Failed runs (each failed measurement is re-run up to --retries times; medians use the "
                  "successful runs only; full messages in results.json):", ""]
        for r in failed_rows:
            first = r["failures"][0]
            lines.append(f"- {r['workload']}, {r['replicas']} replicas, {r['system']} K={r['steps_per_execution'] or '-'}: "
                         f"{len(r['failures'])} failed, e.g. {first[:230]}")
    if targets:
        lines += ["", "## Project targets", "",
                  "ok runs = the fewer successful runs of the rows compared; below 3 the ratio is weak evidence.", "",
                  "| target | where | measured | holds | ok runs |", "| --- | --- | ---: | --- | ---: |"]
        for t in targets:
            verdict = "not measured" if t["holds"] is None else ("yes" if t["holds"] else "NO")
            lines.append(f"| {t['target']} | {t['where']} | {_fmt(t['value'], '.2f')} | {verdict} | {t.get('runs', '-')} |")
    return "\n".join(lines) + "\n"


# -- main -----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        rows = data["rows"]
        targets = check_targets(rows, data["config"].get("config", "idealized"))
        text = markdown(data, rows, targets)
        data["targets"] = targets
        Path(args.from_json).write_text(json.dumps(data, indent=1))
        Path(args.from_json).with_name("results.md").write_text(text)
        print(text)
        return 0
    start = time.perf_counter()
    skipped = None
    if "tf" in args.systems and not args.tf_python:
        skipped = "(e) TF MirroredStrategy: no --tf-python given (an interpreter with tensorflow-cpu)"
        print(f"skipping {skipped}", flush=True)
    git_at_start = git_state()
    base = variants(args)
    runs: list[dict] = []
    plan = [(w, n) for w in args.workloads for n in args.replicas]
    total = sum(len([v for v in base if v[0] != "tf" or n in args.tf_replicas]) for _, n in plan) * args.repeats
    done = 0
    for repeat in range(args.repeats):
        for w, n in plan:
            todo = [v for v in base if v[0] != "tf" or n in args.tf_replicas]
            shift = repeat % max(len(todo), 1)
            for system, k in todo[shift:] + todo[:shift]:
                for attempt in range(1 + args.retries):
                    result = run_one(args, system, k, w, n)
                    runs.append({"workload": w, "replicas": n, "system": system, "k": k,
                                 "repeat": repeat, "attempt": attempt, "result": result})
                    if result["ok"]:
                        break
                done += 1
                eps = f"{result['examples_per_second']:,.0f} ex/s" if result["ok"] else "FAILED " + result["error"][:160]
                print(f"[{done}/{total}] {w} x{n} {system}{'' if k is None else f' K={k}'} "
                      f"(repeat {repeat + 1}): {eps}  ({result['wall_seconds']:.1f} s)", flush=True)
    rows = summarize(runs)
    targets = check_targets(rows, args.config)
    meta = {
        "config": {"command": " ".join(["python", "benchmarks/compare.py", *(argv if argv is not None else sys.argv[1:])]),
                   **{k: v for k, v in vars(args).items()}},
        "environment": environment(args),
        "wall_seconds": time.perf_counter() - start,
        "skipped": skipped,
        "git_at_start": git_at_start,
        "git_at_end": git_state(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows, "targets": targets, "runs": runs}, indent=1))
    text = markdown(meta, rows, targets)
    (out / "results.md").write_text(text)
    print()
    print(text)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
