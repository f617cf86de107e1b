"""SlurmClusterResolver: the cluster from the Slurm workload manager's environment.

Matches tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver.py
(TF 2.x): same environment variables, host list expansion, port and GPU
assignment, and errors.
"""

from __future__ import annotations

import itertools
import re
import subprocess
from collections.abc import Mapping, MutableMapping

import distribute.cluster._env as _env
import distribute.cluster.roles as roles
from distribute.cluster.cluster_spec import ClusterSpec
from distribute.cluster.resolver import ClusterResolver, format_master_url

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node", "get_num_gpus"]

_RANGE_PART = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_PART = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_outside_brackets(text: str) -> list[str]:
    parts, current, depth = [], "", 0
    for c in text:
        if c == "[":
            if depth:
                raise ValueError("nested '['")
            depth = 1
        elif c == "]":
            if not depth:
                raise ValueError("']' without '['")
            depth = 0
        elif c == "," and not depth:
            if not current:
                raise ValueError("empty host name")
            parts.append(current)
            current = ""
            continue
        current += c
    if depth:
        raise ValueError("'[' without ']'")
    if current:
        parts.append(current)
    return parts


def _expand_range(expression: str) -> list[str]:
    values = []
    for part in expression.split(","):
        m = _RANGE_PART.match(part.strip())
        if m is None:
            raise ValueError(f"bad range {part!r}")
        first, last = m.group(1), m.group(2) or m.group(1)
        if int(last) < int(first):
            raise ValueError(f"range {part!r} runs backwards")
        values.extend(str(i).zfill(len(first)) for i in range(int(first), int(last) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm host list, as TF's `expand_hostlist`.

    Order is kept and duplicates are not removed; zero padding follows the
    range's first number. Beyond TF, a suffix after the brackets and several
    bracket groups (`"rack[1-2]-n[01-02]"`) expand as Slurm does.

    Example: `"n[1-2],m5,o[3-4,6,7-9]"` -> `['n1', 'n2', 'm5', 'o3', 'o4', 'o6',
    'o7', 'o8', 'o9']`; `"n[0001-0002]"` -> `['n0001', 'n0002']`.

    Args:
        hostlist: A value such as SLURM_STEP_NODELIST.

    Returns:
        The host names.

    Raises:
        ValueError: If `hostlist` is malformed (as TF).
    """
    hosts: list[str] = []
    try:
        for part in _split_outside_brackets(hostlist):
            pieces = re.split(r"\[([^\]]*)\]", part)  # text, range, text, range, ..., text
            choices = [[p] if i % 2 == 0 else _expand_range(p) for i, p in enumerate(pieces)]
            hosts.extend("".join(combo) for combo in itertools.product(*choices))
    except ValueError as e:
        raise ValueError(
            f"Invalid hostlist format {hostlist!r}: {e}; expected e.g. 'n[1-3,5],m7'."
        ) from None
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands Slurm's tasks-per-node expression, as TF's `expand_tasks_per_node`.

    Example: `"3(x2),2,1"` -> `[3, 3, 2, 1]`.

    Raises:
        ValueError: If the expression is malformed (as TF).
    """
    result: list[int] = []
    for part in tasks_per_node.split(","):
        m = _TASKS_PART.match(part.strip())
        if m is None:
            raise ValueError(
                f"Invalid tasks-per-node list format {tasks_per_node!r}: bad part {part!r}; "
                "expected e.g. '3(x2),2,1'."
            )
        result.extend([int(m.group(1))] * int(m.group(2) or 1))
    return result


def _slurm_var(name: str, environ: Mapping[str, str] | None) -> str:
    value = _env.read("SLURM_" + name, environ)
    if value is None:
        raise RuntimeError(
            f"SLURM_{name} not found in environment. Not running inside a SLURM step? "
            "Start the program with srun, or use TFConfigClusterResolver/SimpleClusterResolver."
        )
    return value


def _slurm_int(name: str, environ: Mapping[str, str] | None) -> int:
    value = _slurm_var(name, environ)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"SLURM_{name} is {value!r}, which is not an integer.") from None


def get_num_gpus(environ: Mapping[str, str] | None = None) -> int:
    """Returns the number of NVIDIA GPUs on this node, as TF's `get_num_gpus`.

    Counts the entries of CUDA_VISIBLE_DEVICES when it is set, else the GPUs
    `nvidia-smi --list-gpus` lists. Unlike TF, an empty CUDA_VISIBLE_DEVICES
    counts 0 GPUs (TF counts 1), and a node without nvidia-smi has 0 GPUs (TF
    raises), so CPU-only nodes work.

    Raises:
        RuntimeError: If nvidia-smi exists but fails (as TF).
    """
    visible = _env.read("CUDA_VISIBLE_DEVICES", environ)
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        output = subprocess.check_output(["nvidia-smi", "--list-gpus"], encoding="utf-8", timeout=30)
    except FileNotFoundError:
        return 0
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(
            f"Could not get number of GPUs from nvidia-smi ({e}); pass gpus_per_node= "
            "to SlurmClusterResolver."
        ) from None
    return sum(line.startswith("GPU ") for line in output.strip().split("\n"))


class SlurmClusterResolver(ClusterResolver):
    """Builds the cluster from Slurm's environment, as TF's `SlurmClusterResolver`.

    Reads SLURM_PROCID (this task's rank) and, when the matching argument is
    not given, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and
    SLURM_STEP_TASKS_PER_NODE. Hosts are taken in sorted order; the tasks of a
    host get ports `port_base`, `port_base + 1`, ...; ranks fill the jobs in
    sorted job-name order. With `srun -N2 --ntasks-per-node=2` on nodes n1, n2
    and the default jobs: worker 0 = n1:8888, worker 1 = n1:8889,
    worker 2 = n2:8888, worker 3 = n2:8889.

    Args:
        jobs: Job name -> number of tasks; defaults to `{'worker': SLURM_STEP_NUM_TASKS}`.
        port_base: The first port used on each node.
        gpus_per_node: GPUs on each node; defaults to `get_num_gpus()`.
        gpus_per_task: GPUs for each task; defaults to gpus_per_node divided
            by the largest number of tasks on one node.
        tasks_per_node: An int (the same on every node), a dict host -> count,
            or None to read SLURM_STEP_TASKS_PER_NODE.
        auto_set_gpu: Whether `cluster_spec()` sets CUDA_VISIBLE_DEVICES to this
            task's GPUs (as TF).
        rpc_layer: The protocol used by `master()`.
        env: Beyond TF: a mapping to read (and write CUDA_VISIBLE_DEVICES into)
            instead of `os.environ`.

    Raises:
        RuntimeError: If a needed SLURM_* variable is missing, more GPUs per node
            are requested than exist, or the jobs ask for a different number of
            tasks than Slurm started (as TF).
        ValueError: If a job is not a known task type, or a Slurm value is malformed.
    """

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int = 8888,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: int | Mapping[str, int] | None = None,
                 auto_set_gpu: bool = True, rpc_layer: str | None = "grpc", *,
                 env: MutableMapping[str, str] | None = None):
        self._env = env
        self._rank = _slurm_int("PROCID", env)
        if jobs is None:
            jobs = {roles.WORKER: _slurm_int("STEP_NUM_TASKS", env)}
        for job in jobs:
            if job not in roles.TASK_TYPES:
                raise ValueError(
                    f"jobs has a job {job!r}, which is not a task type; use "
                    f"{', '.join(map(repr, roles.TASK_TYPES))}."
                )
        self._jobs = dict(jobs)
        self._port_base = port_base
        self._task_configuration = self._resolve_task_configuration(tasks_per_node)
        if not self._task_configuration or max(self._task_configuration.values()) < 1:
            raise RuntimeError(
                f"No tasks per node were resolved ({self._task_configuration}); pass "
                "tasks_per_node= or run inside an srun step."
            )
        max_tasks_per_node = max(self._task_configuration.values())
        num_tasks = sum(self._task_configuration.values())
        if gpus_per_node is None:
            gpus_per_node = get_num_gpus(env)
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks_per_node
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._auto_set_gpu = auto_set_gpu
        self._rpc_layer = rpc_layer
        if max_tasks_per_node * gpus_per_task > gpus_per_node:
            raise RuntimeError(
                f"Requested more GPUs per node than available: {max_tasks_per_node} tasks "
                f"x {gpus_per_task} GPUs per task > {gpus_per_node} GPUs per node; lower "
                "gpus_per_task or the tasks per node."
            )
        if sum(self._jobs.values()) != num_tasks:
            raise RuntimeError(
                f"Requested {sum(self._jobs.values())} tasks (jobs={self._jobs}) but only "
                f"{num_tasks} were assigned by Slurm; make the job sizes add up to {num_tasks}."
            )
        if not 0 <= self._rank < num_tasks:
            raise RuntimeError(
                f"SLURM_PROCID is {self._rank}, outside the {num_tasks} tasks of this step."
            )
        self._spec, self._gpu_allocation, self._task_type, self._task_id = self._allocate()

    def _resolve_task_configuration(
            self, tasks_per_node: int | Mapping[str, int] | None) -> dict[str, int]:
        if isinstance(tasks_per_node, Mapping):
            return dict(tasks_per_node)
        hostlist = expand_hostlist(_slurm_var("STEP_NODELIST", self._env))
        if tasks_per_node is not None:
            return {host: int(tasks_per_node) for host in hostlist}
        counts = expand_tasks_per_node(_slurm_var("STEP_TASKS_PER_NODE", self._env))
        if len(counts) != len(hostlist):
            raise ValueError(
                f"SLURM_STEP_TASKS_PER_NODE gives {len(counts)} node(s) but "
                f"SLURM_STEP_NODELIST lists {len(hostlist)}; pass tasks_per_node= explicitly."
            )
        return dict(zip(hostlist, counts))

    def _allocate(self) -> tuple[ClusterSpec, list[str], str | None, int | None]:
        task_list: list[str] = []
        gpu_allocation: list[str] = []
        for host, num_tasks in sorted(self._task_configuration.items()):
            for offset in range(num_tasks):
                task_list.append(f"{host}:{self._port_base + offset}")
                first = offset * self._gpus_per_task
                gpu_allocation.append(",".join(str(g) for g in range(first, first + self._gpus_per_task)))
        cluster: dict[str, list[str]] = {}
        task_type, task_id, start = None, None, 0
        for job, num_tasks in sorted(self._jobs.items()):
            cluster[job] = task_list[start:start + num_tasks]
            if start <= self._rank < start + num_tasks:
                task_type, task_id = job, self._rank - start
            start += num_tasks
        return ClusterSpec(cluster), gpu_allocation, task_type, task_id

    def cluster_spec(self) -> ClusterSpec:
        """Returns the cluster; sets CUDA_VISIBLE_DEVICES when `auto_set_gpu` (as TF).

        Example: SLURM_STEP_NODELIST='t02n13,t02n41,t02n43', one task per node,
        `jobs={'ps': 1, 'worker': 2}` -> `{'ps': ['t02n13:8888'],
        'worker': ['t02n41:8888', 't02n43:8888']}`.
        """
        if self._auto_set_gpu:
            _env.write("CUDA_VISIBLE_DEVICES", self._gpu_allocation[self._rank], self._env)
        return self._spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """Returns (`task_type`, `task_id`) of this process (as TF)."""
        return self.task_type, self.task_id

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """Returns `rpc_layer://address` of the given task, default this one (as TF)."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is not None and task_id is not None:
            return format_master_url(self._spec.task_address(task_type, task_id),
                                     rpc_layer or self.rpc_layer)
        return ""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: object = None) -> dict[str, int]:
        """Returns `{'GPU': gpus_per_task}` (as TF)."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task}
