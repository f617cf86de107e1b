"""Local multi-worker launcher: start N workers on loopback, each with its TF_CONFIG.

Usage::

    python -m distribute.launch --num-workers 2 [--devices-per-worker 4] [--chief]
        [--timeout-seconds 600] [--grace-seconds 3] train.py [ARGS...]
    python -m distribute.launch --num-workers 2 -m my_package.train [ARGS...]
    python -m distribute.launch --num-workers 2 --num-ps 1 train.py [ARGS...]

Every worker is the same Python program; each gets a TF_CONFIG naming the
whole cluster (free 127.0.0.1 ports) and its own task, as
`tf.distribute.cluster_resolver.TFConfigClusterResolver` expects. With
`--devices-per-worker K` each worker sees K CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=K`, `JAX_PLATFORMS=cpu`).
Output lines are prefixed with the task (`[worker 1] ...`). If one task
exits non-zero the others get a grace period to stop by themselves (a
MultiWorkerMirroredStrategy worker then names the lost one), then are stopped
(SIGTERM, then SIGKILL after the grace period) and the launcher exits non-zero naming it; Ctrl-C and SIGTERM are
forwarded to every task (a PreemptionCheckpointHandler then saves and exits;
give it `--grace-seconds` longer than a step plus a save). The exit status is
0 only when every task exits 0.

With `--num-ps N` the cluster is ParameterServerStrategy's (see
`launch_parameter_server`): a chief runs the program as the coordinator; N ps
and the workers run `distribute.Server` (`python -m distribute.parameter_server.nodes`),
which hosts their Ray actors; every task ends when the chief's program ends.

Standard library only (POSIX: tasks run in their own process groups); it never
imports JAX. `launch()` is the same launcher as a function, for tests.
"""


from distribute.launch._cli import main
from distribute.launch._ps import PS_HOST_COMMAND, build_ps_cluster, launch_parameter_server
from distribute.launch._tasks import (
    EXIT_TIMEOUT,
    LaunchResult,
    TaskResult,
    build_cluster,
    free_ports,
    launch,
    task_environment,
)

__all__ = ["EXIT_TIMEOUT", "PS_HOST_COMMAND", "LaunchResult", "TaskResult", "build_cluster", "build_ps_cluster",
           "free_ports", "launch", "launch_parameter_server", "main", "task_environment"]
