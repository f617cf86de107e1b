"""The README's examples and the main job, run as a user runs them (subprocesses)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout=600, env_extra=None, env_drop=()):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND", *env_drop)}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def _main_in_process(args, tmp_path, monkeypatch, capsys):
    """``python -m distribute ARGS`` in this process (its 8 CPU devices): the job's own code without a new
    interpreter's imports; the README's commands themselves run as subprocesses above and below."""
    import jax  # noqa: F401 - loaded now with conftest's 8 devices; cli.main sets a count only before JAX loads

    from distribute import cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_keras_fit_example_trains(tmp_path):
    result = _run([str(ROOT / "examples" / "keras_fit.py"), "--epochs", "3"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Number of devices: 2" in result.stdout
    line = [l for l in result.stdout.splitlines() if l.startswith("final loss:")][-1]
    final, first = float(line.split()[2]), float(line.split()[-1].rstrip(")"))
    assert final < first / 10


def test_custom_loop_example_trains(tmp_path):
    result = _run([str(ROOT / "examples" / "custom_loop.py"), "--epochs", "3"], tmp_path)
    assert result.returncode == 0, result.stderr
    epochs = [l for l in result.stdout.splitlines() if l.startswith("Epoch ")]
    assert len(epochs) == 3
    losses = [float(l.split("Loss: ")[1].split(",")[0]) for l in epochs]
    assert losses[-1] < losses[0]
    assert float(epochs[-1].split("Test Accuracy: ")[1]) > 80.0


def _assert_epoch_lines_follow_the_bar(lines, epochs):
    """Our per-epoch summary lines stand on their own, each after Keras' header and its finished bar."""
    assert sum(l.startswith("epoch ") for l in lines) == epochs
    assert not any("epoch " in l and not l.startswith("epoch ") for l in lines), "\n".join(lines)
    for epoch in range(1, epochs + 1):
        at = lines.index(next(l for l in lines if l.startswith(f"epoch {epoch}/{epochs}: ")))
        assert f"Epoch {epoch}/{epochs}" in lines[:at]  # Keras' header, its finished bar, then our summary
        assert "val_accuracy" in lines[at - 1] and lines[at - 1].rstrip().endswith(tuple("0123456789")), repr(lines[at - 1])


# Replicas 1 and 2 (one device, and the all-reduce path that any larger count takes), fit and custom; the
# runs print Keras' progress (verbose 1: the bar, 2: a line per epoch) so the same runs check that our epoch
# lines are not inside it (custom at verbose 2: test_main_job_epoch_lines_are_not_inside_the_progress_bar).
@pytest.mark.parametrize("replicas,mode,verbose", [(1, "fit", 1), (2, "fit", 2), (2, "custom", 1)])
def test_main_job_reaches_095_on_digits(tmp_path, replicas, mode, verbose):
    out = tmp_path / "out"
    result = _run(
        ["-m", "distribute", "train", "--replicas", str(replicas), "--mode", mode, "--verbose", str(verbose), "--output", str(out)],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()  # the bar's redraws (\r) become lines of their own here
    _assert_epoch_lines_follow_the_bar(lines, 20)
    assert lines[0].startswith(f"strategy: MirroredStrategy, replicas: {replicas}")
    assert lines[-1].startswith("test accuracy: ")
    assert float(lines[-1].split(": ")[1]) >= 0.95
    assert sum(l.startswith("epoch ") and "examples/s" in l for l in lines) == 20
    history = json.loads((out / "history.json").read_text())
    assert len(history["history"]["loss"]) == 20
    assert history["history"]["loss"][-1] < history["history"]["loss"][0]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "model.keras").stat().st_size > 0


def test_main_job_fit_gives_the_same_answer_on_1_and_2_replicas(tmp_path, monkeypatch, capsys):
    losses = []
    for replicas in (1, 2):
        out = tmp_path / f"out{replicas}"
        code, stdout, err = _main_in_process(["train", "--replicas", str(replicas), "--epochs", "3", "--verbose", "0", "--output", str(out)],
                                             tmp_path, monkeypatch, capsys)
        assert code == 0, err
        assert stdout.startswith(f"strategy: MirroredStrategy, replicas: {replicas}")
        losses.append(json.loads((out / "history.json").read_text())["history"]["loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4)


def test_main_job_reads_an_mnist_npz(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, (300, 28, 28), dtype=np.uint8)
    y_train = rng.integers(0, 10, 300).astype(np.uint8)
    np.savez(tmp_path / "mnist.npz", x_train=x_train, y_train=y_train, x_test=x_train[:50], y_test=y_train[:50])
    code, out, err = _main_in_process(["train", "--data", "mnist.npz", "--epochs", "1", "--verbose", "0", "--output", "o"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "300 train / 50 test examples, 784 features" in out
    assert out.strip().splitlines()[-1].startswith("test accuracy: ")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--replicas", "0"], "--replicas 0"),
        (["--strategy", "nope"], "invalid choice: 'nope'"),
        (["--epochs", "-1"], "--epochs -1"),
        (["--strategy", "one_device", "--replicas", "2"], "needs --strategy mirrored"),
        (["--global-batch-size", "x"], "invalid int value: 'x'"),
        (["--learning-rate", "nan"], "--learning-rate nan"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--num-workers", "2"], "--num-workers 2 needs --strategy parameter_server"),
        (["--strategy", "parameter_server", "--mode", "custom", "--num-ps", "0"], "--num-ps 0: must be at least 1"),
        (["--strategy", "parameter_server", "--replicas", "2"], "(parameter_server has one replica per worker)"),
    ],
)
def test_main_job_bad_flags_exit_2_with_one_line(tmp_path, args, needle):
    result = _run(["-m", "distribute", "train", *args], tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("python -m distribute train: error: ")
    assert needle in result.stderr


def test_main_job_help_documents_every_flag(tmp_path):
    result = _run(["-m", "distribute", "train", "--help"], tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    options = text.split("options:")[1]
    flags = ["--strategy", "--replicas", "--num-workers", "--num-ps", "--epochs", "--global-batch-size", "--learning-rate", "--mode", "--seed",
             "--data", "--output", "--verbose"]
    for flag, following in zip(flags, flags[1:] + [None]):
        section = options.split(flag, 1)[1]
        section = section.split(following, 1)[0] if following else section
        assert len(section.split()) > 4, (flag, section)  # a help text, not just the metavar
    assert "multi_worker_mirrored: " in text
    assert "python -m distribute.launch, or with TF_CONFIG set" in text
    assert "parameter_server: asynchronous training on an embedded local Ray cluster" in text


@pytest.mark.parametrize(
    "content,needle",
    [(None, "No such file"), (b"not an npz", "cannot read --data"), ("missing", "missing arrays")],
)
def test_main_job_unreadable_data_exits_1_with_one_line(tmp_path, content, needle):
    path = tmp_path / "data.npz"
    if content == "missing":
        np.savez(path, x_train=np.zeros((3, 4)))
    elif content is not None:
        path.write_bytes(content)
    result = _run(["-m", "distribute", "train", "--data", str(path), "--output", "o"], tmp_path, timeout=120)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert needle in result.stderr
    assert not (tmp_path / "o" / "model.keras").exists()


def _write_bad_data(path, kind):
    rng = np.random.default_rng(0)
    x = rng.random((40, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    arrays = dict(x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
    if kind == "empty npz":
        arrays.update(x_train=np.zeros((0, 28, 28)), y_train=np.zeros(0), x_test=np.zeros((0, 28, 28)), y_test=np.zeros(0))
    elif kind == "corrupt zip":
        np.savez(path, **arrays)
        path.write_bytes(path.read_bytes()[:300])
        return
    elif kind == "npy":
        with open(path, "wb") as file:
            np.save(file, x)
        return
    elif kind == "text":
        path.write_text("hello world\n1,2,3\n")
        return
    elif kind == "negative labels":
        arrays["y_train"] = y - 1
    elif kind == "fractional labels":
        arrays["y_train"] = y + 0.5
    elif kind == "one-hot labels":
        arrays["y_train"] = np.eye(3)[y]
    elif kind == "one class":
        arrays.update(y_train=np.zeros(40, int), y_test=np.zeros(10, int))
    elif kind == "nan x":
        arrays["x_test"] = np.where(np.arange(10)[:, None, None] == 3, np.nan, x[:10])
    elif kind == "inf x":
        arrays["x_train"] = np.where(np.arange(40)[:, None, None] == 5, np.inf, x)
    elif kind == "unknown test labels":
        arrays["y_test"] = np.full(10, 7)
    elif kind == "sizes":
        arrays["y_train"] = y[:39]
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("empty npz", "x_train is empty"),
        ("corrupt zip", "corrupt .npz archive"),
        ("npy", "not an .npz archive"),
        ("text", "not an .npz archive"),
        ("negative labels", "y_train has negative labels"),
        ("fractional labels", "y_train must be integer class labels, got non-integral values such as 1.5"),
        ("one-hot labels", "y_train must be integer class labels of shape (n,), got shape (40, 3)"),
        ("one class", "at least 2 classes"),
        ("nan x", "x_test has 64 non-finite values"),
        ("inf x", "x_train has 64 non-finite values"),
        ("unknown test labels", "y_test has labels outside the training classes 0..2: 7"),
        ("sizes", "x_train has 40 examples but y_train has 39 labels"),
    ],
)
def test_main_job_invalid_data_exits_1_with_one_line(tmp_path, kind, needle):
    path = tmp_path / "data.npz"
    _write_bad_data(path, kind)
    result = _run(["-m", "distribute", "train", "--data", str(path), "--output", "o"], tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("python -m distribute train: error: "), result.stderr
    assert str(path) in result.stderr and needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_main_job_accepts_float_and_column_labels(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(0)
    x = rng.random((60, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, 60)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y.astype(np.float64), x_test=x[:20], y_test=y[:20, None])
    code, out, err = _main_in_process(["train", "--data", "d.npz", "--epochs", "1", "--verbose", "0", "--output", "o"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "60 train / 20 test examples, 16 features, 3 classes" in out


def test_main_job_epoch_lines_are_not_inside_the_progress_bar(tmp_path):
    # Custom mode at verbose 2; fit at 1 and 2 and custom at 1 are checked by test_main_job_reaches_095_on_digits.
    result = _run(
        ["-m", "distribute", "train", "--mode", "custom", "--epochs", "2", "--verbose", "2", "--output", "o"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    _assert_epoch_lines_follow_the_bar(result.stdout.splitlines(), 2)  # the bar's redraws (\r) become lines here


def test_readme_quick_start_matches_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/python -m pytest"
    assert test_command in readme
    # CI runs the same steps (quietly; the docs extra too), with the lint gates and the docs build before the tests.
    for step in ("python3 -m venv .venv", ".venv/bin/pip install --quiet '.[test,docs]'", ".venv/bin/python -m pytest"):
        assert step in ci
    assert ci.index("pip install") < ci.index("ruff check") < ci.index("lint-imports") < ci.index("mkdocs build --strict") < ci.index("-m pytest")


_ALARMING = ("os.fork()", "deadlock", "Token authentication", "core_worker.cc", "restart will fail", "Traceback",
             "Warning", "WARNING", "Error")


@pytest.mark.multiprocess
@pytest.mark.xdist_group("ray")  # starts an embedded Ray cluster (tests/conftest.py)
@pytest.mark.parametrize("mode", ["fit", "custom"])
def test_main_job_parameter_server_reaches_093_on_digits(tmp_path, mode):
    # The defaults: an embedded Ray cluster of 2 workers and 1 ps; Keras fit (the default mode) or TF's custom
    # PS loop. The saved model gives the printed accuracy; fit counts every scheduled step once.
    # 10 epochs: both modes pass 0.95 test accuracy from epoch 9 on (20 and 12 epochs before; the curves are in
    # the epoch lines, the cluster's start and the compiles are most of the run).
    out, epochs = tmp_path / "out", 10
    result = _run(
        ["-m", "distribute", "train", "--strategy", "parameter_server", *(["--mode", mode] if mode == "custom" else []),
         "--epochs", str(epochs), "--verbose", "0", "--output", str(out)],
        tmp_path, timeout=240, env_drop=("RAY_ADDRESS", "RAY_AUTH_MODE"),  # its own embedded Ray, not the suite's
    )
    assert result.returncode == 0, result.stderr
    # The embedded cluster starts and stops quietly (issue 16).  Before: every start printed Ray's token
    # notice, JAX's ``RuntimeWarning: os.fork() was called ... will likely lead to a deadlock`` (Ray forked its
    # processes with a ``preexec_fn``, Python running in the child of a multithreaded process) and Ray's
    # ``core_worker.cc ... the actor restart will fail`` for the workers (their constructor arguments were in
    # the object store).  Now the local Ray head is a child spawned without Python between fork and exec, the
    # token mode is chosen explicitly, and workers get plain constructor arguments.
    noisy = [line for line in result.stderr.splitlines() if any(word in line for word in _ALARMING)]
    assert not noisy, "\n".join(noisy)
    lines = [l for l in result.stdout.strip().splitlines() if not l.startswith("(")]  # Ray's worker log lines
    assert lines[0] == "strategy: ParameterServerStrategy, workers: 2, ps: 1, ps devices: /job:ps/replica:0/task:0/device:CPU:0"
    assert lines[1].endswith(f"global batch 64, mode {mode}")
    accuracy = float(lines[-1].split("test accuracy: ")[1])
    assert accuracy >= 0.93
    epoch_lines = [l for l in lines if l.startswith("epoch ") and "examples/s" in l]
    assert len(epoch_lines) == epochs
    history = json.loads((out / "history.json").read_text())["history"]
    assert sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert len(history["loss"]) == epochs and history["loss"][-1] < history["loss"][0] / 5
    assert history["val_accuracy"][-1] == pytest.approx(accuracy, abs=1e-4)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import keras

    from distribute.training import load_data

    _, _, x, y, _ = load_data(None, 0)
    saved = keras.saving.load_model(out / "model.keras")  # outside any scope: a plain model
    assert float((np.asarray(saved(x)).argmax(1) == y).mean()) == pytest.approx(accuracy, abs=1e-4)
    iterations = int(saved.optimizer.iterations.numpy())
    assert int(iterations) == epochs * (1437 // 64)  # every step of every epoch applied once
