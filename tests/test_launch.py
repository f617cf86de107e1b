"""The local multi-worker launcher: TF_CONFIG per task, output prefixes, supervision.

Every test bounds its wait: `timeout_seconds` on `launch`, `timeout=` on subprocess waits.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import distribute.launch as launch_module
from distribute.cluster import TFConfigClusterResolver, coordinator_address, worker_index
from distribute.launch import launch, task_environment

pytestmark = pytest.mark.multiprocess

SRC = str(Path(launch_module.__file__).resolve().parents[2])
CHILD_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}


def script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(argv, num_workers=2, timeout_seconds=20, **kwargs):
    kwargs.setdefault("env", CHILD_ENV)
    return launch(argv, num_workers, timeout_seconds=timeout_seconds, echo=False, **kwargs)


def cli(args, timeout=30, env=None):
    return subprocess.run([sys.executable, "-m", "distribute.launch", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **CHILD_ENV, **(env or {})})


def test_each_task_gets_its_tf_config_and_prefixed_output(tmp_path):
    path = script(tmp_path, """
        import os, sys
        print("TF_CONFIG=" + os.environ["TF_CONFIG"])
        print("to stderr", file=sys.stderr)
    """)
    result = run([path], num_workers=2, chief=True)
    assert result.returncode == 0, result.output
    assert result.exit_codes == {"chief 0": 0, "worker 0": 0, "worker 1": 0}
    assert result.failed_task is None and not result.timed_out
    expected = {("chief", 0): (True, 0), ("worker", 0): (False, 1), ("worker", 1): (False, 2)}
    clusters = []
    for (task_type, task_id), (chief, index) in expected.items():
        output = result.task_output(task_type, task_id)
        prefix = f"[{task_type} {task_id}] "
        assert all(row.startswith(prefix) for row in output.splitlines()), output
        assert f"{prefix}to stderr\n" in output
        text = next(r for r in output.splitlines() if "TF_CONFIG=" in r).split("TF_CONFIG=", 1)[1]
        resolver = TFConfigClusterResolver.from_tf_config(text)
        assert (resolver.task_type, resolver.task_id) == (task_type, task_id)
        assert resolver.is_chief is chief
        assert worker_index(task_type, task_id, resolver.cluster_spec()) == index
        clusters.append(resolver.cluster_spec())
    assert clusters[0] == clusters[1] == clusters[2]
    assert coordinator_address(clusters[0]) == clusters[0].task_address("chief", 0)
    addresses = [a for job in ("chief", "worker") for a in clusters[0].job_tasks(job)]
    assert len(addresses) == 3 == len(set(addresses))
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    assert "[worker 1] to stderr\n" in result.output


def test_arguments_reach_the_script_and_exit_zero_needs_all(tmp_path):
    path = script(tmp_path, """
        import sys
        print("args", sys.argv[1:])
    """)
    result = run([path, "--lr", "0.1", "x y"], num_workers=3)
    assert result.returncode == 0
    for i in range(3):
        assert f"[worker {i}] args ['--lr', '0.1', 'x y']\n" in result.output


def test_devices_per_worker_sets_xla_flags_and_cpu(tmp_path):
    env = task_environment({"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8",
                            "JAX_NUM_CPU_DEVICES": "8"}, {"worker": ["127.0.0.1:1"]}, "worker", 0, 3)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_NUM_CPU_DEVICES"] == "3"
    assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": ["127.0.0.1:1"]},
                                             "task": {"type": "worker", "index": 0}}
    assert "JAX_PLATFORMS" not in task_environment({}, {"worker": ["127.0.0.1:1"]}, "worker", 0)

    path = script(tmp_path, """
        import jax
        print("devices", len(jax.local_devices()), jax.local_devices()[0].platform)
    """)
    result = run([path], num_workers=2, devices_per_worker=3, timeout_seconds=60)
    assert result.returncode == 0, result.output
    assert "[worker 0] devices 3 cpu\n" in result.output
    assert "[worker 1] devices 3 cpu\n" in result.output


def test_failing_task_stops_the_others_quickly_and_is_named(tmp_path):
    path = script(tmp_path, """
        import json, os, sys, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        if task["type"] == "worker" and task["index"] == 1:
            sys.exit(3)
        print("waiting", flush=True)
        time.sleep(60)
    """)
    start = time.monotonic()
    result = run([path], num_workers=3, chief=True, grace_seconds=2.0)
    assert time.monotonic() - start < 10
    assert result.returncode == 3
    assert result.failed_task == "worker 1"
    assert result.exit_codes["worker 1"] == 3
    assert all(result.exit_codes[t] == -signal.SIGTERM for t in ("chief 0", "worker 0", "worker 2"))
    assert "[launch] worker 1 exited with code 3; stopping" in result.output


def test_a_worker_that_stopped_for_a_lost_peer_is_not_blamed(tmp_path):
    # Worker 1 fails; worker 0 sees it and stops with status 75 (EXIT_WORKER_LOST) a moment later. When
    # both have ended by the launcher's next look, the cause is worker 1, whatever their order in the list.
    path = script(tmp_path, f"""
        import json, os, sys, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        marker = {str(tmp_path / "worker1_failed")!r}
        if task["index"] == 1:
            open(marker, "w").close()
            sys.exit(3)
        while not os.path.exists(marker):
            time.sleep(0.001)
        sys.exit(75)
    """)
    result = run([path], num_workers=2, grace_seconds=2.0)
    assert result.returncode == 3 and result.failed_task == "worker 1", result.output
    assert result.exit_codes == {"worker 0": 75, "worker 1": 3}


def test_task_ignoring_sigterm_is_killed_after_grace(tmp_path):
    path = script(tmp_path, """
        import json, os, signal, sys, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        if task["index"] == 1:
            time.sleep(0.5)
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """)
    start = time.monotonic()
    result = run([path], num_workers=2, grace_seconds=0.5)
    assert time.monotonic() - start < 10
    assert result.returncode == 1 and result.failed_task == "worker 1"
    assert result.exit_codes["worker 0"] == -signal.SIGKILL


def test_timeout_stops_every_task(tmp_path):
    path = script(tmp_path, "import time\ntime.sleep(60)\n")
    start = time.monotonic()
    result = run([path], num_workers=2, timeout_seconds=1.0, grace_seconds=1.0)
    assert time.monotonic() - start < 10
    assert result.timed_out and result.returncode == 124
    assert "[launch] timed out after 1.0 s; stopping worker 0, worker 1" in result.output
    assert all(code == -signal.SIGTERM for code in result.exit_codes.values())


def test_launch_validates_arguments():
    with pytest.raises(ValueError, match="num_workers is 0; it must be an integer >= 1"):
        launch(["x.py"], 0)
    with pytest.raises(ValueError, match="devices_per_worker is 0"):
        launch(["x.py"], 1, devices_per_worker=0)
    with pytest.raises(ValueError, match="argv_or_command is empty"):
        launch([], 1)


def test_split_argv_keeps_program_arguments():
    from distribute.launch._cli import _split_argv as split
    assert split(["--num-workers", "2", "-m", "pkg.mod", "--num-workers", "5"]) == (
        ["--num-workers", "2"], ["-m", "pkg.mod", "--num-workers", "5"])
    assert split(["--num-workers=2", "--chief", "train.py", "-v"]) == (
        ["--num-workers=2", "--chief"], ["train.py", "-v"])


def test_cli_script_success(tmp_path):
    ok = script(tmp_path, "import sys\nprint('hello', sys.argv[1])\n", "ok.py")
    done = cli(["--num-workers", "2", "--chief", ok, "there"])
    assert done.returncode == 0, done.stderr
    for task in ("chief 0", "worker 0", "worker 1"):
        assert f"[{task}] hello there\n" in done.stdout


def test_main_failure_names_the_task(tmp_path, capsys):
    bad = script(tmp_path, """
        import json, os, sys, time
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
            sys.exit(7)
        time.sleep(60)
    """, "bad.py")
    start = time.monotonic()
    assert launch_module.main(["--num-workers", "2", "--timeout-seconds", "20", bad]) == 7
    assert time.monotonic() - start < 10
    assert "[launch] worker 0 exited with code 7" in capsys.readouterr().err


def test_main_module_and_timeout(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymod.py").write_text("import os, sys\nprint('module', sys.argv[1:], os.environ['JAX_PLATFORMS'])\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), CHILD_ENV["PYTHONPATH"]]))
    assert launch_module.main(["--num-workers", "2", "--devices-per-worker", "2", "-m", "mymod", "--flag"]) == 0
    assert "[worker 1] module ['--flag'] cpu\n" in capsys.readouterr().out

    slow = script(tmp_path, "import time\ntime.sleep(60)\n", "slow.py")
    assert launch_module.main(["--num-workers", "1", "--timeout-seconds", "0.5", slow]) == 124
    assert "timed out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch_module.main(["--num-workers", "2"])
    assert "give the program to run" in capsys.readouterr().err


def test_ctrl_c_is_forwarded_to_every_task(tmp_path):
    path = script(tmp_path, """
        import time
        print("ready", flush=True)
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "distribute.launch", "--num-workers", "2", path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **CHILD_ENV})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + 20
        while sum("ready" in line for line in seen) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            try:
                seen.append(lines.get(timeout=0.1))
            except queue.Empty:
                pass
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get_nowait())
    text = "".join(seen)
    assert "[worker 0] interrupted" in text and "[worker 1] interrupted" in text
    assert "got SIGINT; forwarding it to every task" in text


def test_sigterm_is_forwarded_and_ends_multi_worker_strategy_workers_at_once(tmp_path):
    """SIGTERM to the launcher reaches every worker, and a MultiWorkerMirroredStrategy worker ends on it
    (jaxlib's preemption notifier would otherwise swallow it and the workers would train on until SIGKILL);
    a checkpoint save in flight is committed first (test_backup_restore's lost-worker test needs it)."""
    path = script(tmp_path, """
        import os, signal, time
        import distribute
        strategy = distribute.MultiWorkerMirroredStrategy()
        print("ready", strategy.num_replicas_in_sync, flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, **CHILD_ENV, "KERAS_BACKEND": "jax"}
    proc = subprocess.Popen([sys.executable, "-m", "distribute.launch", "--num-workers", "2", "--devices-per-worker", "1",
                             "--grace-seconds", "30", path],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + 60
        while sum("ready" in line for line in seen) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            try:
                seen.append(lines.get(timeout=0.1))
            except queue.Empty:
                pass
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=25) == 128 + signal.SIGTERM
        assert time.monotonic() - signalled < 15  # well inside the 30 s grace: nobody needed SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get_nowait())
    text = "".join(seen)
    assert "[worker 0] ready 2" in text and "[worker 1] ready 2" in text
    assert "got SIGTERM; forwarding it to every task" in text
    assert "exit codes: worker 0: -15, worker 1: -15; exiting with 143" in text, text[-3000:]


def test_grace_seconds_option_is_validated():
    result = cli(["--num-workers", "1", "--grace-seconds", "-1", "x.py"])
    assert result.returncode == 2 and "--grace-seconds is -1.0; it must be >= 0" in result.stderr


def test_free_ports_are_outside_the_range_the_kernel_hands_out(monkeypatch, tmp_path):
    # A task binds its port seconds after the launcher chose it; a port from the ephemeral range could be taken
    # meanwhile by any bind to port 0 or outgoing connection (seen in CI: "another process listens on it").
    import socket

    from distribute.cluster import ports

    monkeypatch.setattr(ports, "_RESERVATIONS", str(tmp_path / "reserved"))

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(v) for v in f.read().split())
    held = []
    try:
        for _ in range(20):  # ports the kernel hands out right now, held while free_ports chooses
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        chosen = ports.free_ports(50)
    finally:
        for s in held:
            s.close()
    assert len(set(chosen)) == 50 and not set(chosen) & taken, chosen
    assert all(ports._FIRST_PORT <= p < low for p in chosen), (chosen, low, high)
    for p in chosen[:5]:  # free: a task can bind them
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
    # No room below the ephemeral range: the kernel's choice, as before.
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports._FIRST_PORT + 10)
    assert len(set(ports.free_ports(3))) == 3


def test_free_ports_are_not_handed_out_twice_while_reserved(monkeypatch, tmp_path):
    # Two launchers at once (CI: the suite's two processes) drew the same port; the second job's worker 1 then
    # joined the first job's cluster ("1 unexpectedly tried to connect with a different incarnation").
    from distribute.cluster import ports

    monkeypatch.setattr(ports, "_RESERVATIONS", str(tmp_path / "reserved"))
    monkeypatch.setattr(ports, "_FIRST_PORT", 21000)
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 22000)  # 1000 ports to draw from
    first = ports.free_ports(600)
    second = ports.free_ports(400)  # the other 400: none of the first's, though all are free again
    assert len(set(first)) == 600 and len(set(second)) == 400 and not set(first) & set(second)
    assert len(set(ports.free_ports(5))) == 5  # none left below the range: the kernel's choice
    old = time.time() - ports.RESERVE_SECONDS - 1
    for port in first[:3]:  # reservations older than RESERVE_SECONDS lapse
        os.utime(tmp_path / "reserved" / str(port), (old, old))
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 22000)
    assert sorted(p for p in ports.free_ports(3) if 21000 <= p < 22000) == sorted(first[:3])
    # A directory that cannot be written (here: under a file) reserves nothing, and ports are still drawn there.
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(ports, "_RESERVATIONS", str(tmp_path / "a_file" / "reserved"))
    assert all(21000 <= p < 22000 for p in ports.free_ports(3))
