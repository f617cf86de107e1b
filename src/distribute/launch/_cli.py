"""The launcher's command line (`python -m distribute.launch`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


from distribute.launch._elastic import ElasticConfig, launch_elastic, parse_num_workers
from distribute.launch._ps import launch_parameter_server
from distribute.launch._tasks import LaunchResult, launch


_VALUE_OPTIONS = ("--num-workers", "--num-ps", "--devices-per-worker", "--timeout-seconds", "--grace-seconds",
                  "--max-restarts", "--hosts-command", "--elastic-timeout-seconds")


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the launcher's options and the program (SCRIPT... or -m MODULE...)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if token == "-m":
            return list(argv[:i]), list(argv[i:])
        if token in _VALUE_OPTIONS:
            i += 2
        elif token.startswith("-"):
            i += 1
        else:
            return list(argv[:i]), list(argv[i:])
    return list(argv), []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distribute.launch",
        usage="%(prog)s --num-workers N|MIN:MAX [--max-restarts K] [--hosts-command CMD] [--num-ps P] "
              "[--devices-per-worker K] [--chief] [--timeout-seconds S] [--grace-seconds S] (SCRIPT | -m MODULE) [ARGS...]",
        description="Run a program as every worker of a local (127.0.0.1) cluster, each with its TF_CONFIG.",
    )
    parser.add_argument("--num-workers", required=True,
                        help="number of 'worker' tasks, or MIN:MAX for an elastic launch: a lost worker's job goes "
                             "on with the workers available (at least MIN) and grows back up to MAX")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="elastic launch: how many failures the job survives (default 3; growing is not counted)")
    parser.add_argument("--hosts-command", default=None,
                        help="elastic launch: a command printing one available worker slot per line (HOST or "
                             "HOST:SLOTS, local hosts only), polled every second; default: MAX local slots")
    parser.add_argument("--elastic-timeout-seconds", type=float, default=None,
                        help="elastic launch: how long to wait for MIN slots before giving up (default 600)")
    parser.add_argument("--num-ps", type=int, default=None,
                        help="ParameterServerStrategy: P 'ps' tasks and a chief (the coordinator, which alone runs "
                             "the program); ps and workers host their Ray actors; stopped tasks get at least 10 s")
    parser.add_argument("--devices-per-worker", type=int, default=None,
                        help="CPU devices per task (sets XLA_FLAGS and JAX_PLATFORMS=cpu)")
    parser.add_argument("--chief", action="store_true", help="add one 'chief' task besides the workers")
    parser.add_argument("--timeout-seconds", type=float, default=None,
                        help="stop every task after this many seconds (exit status 124)")
    parser.add_argument("--grace-seconds", type=float, default=3.0,
                        help="how long stopped tasks get between SIGTERM (or a forwarded signal) and SIGKILL "
                             "(default 3; a preemption checkpoint needs a step plus a save)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see `LaunchResult.returncode`)."""
    options, program = _split_argv(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(options)
    if not program or program == ["-m"]:
        parser.error("give the program to run: SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    try:
        if args.grace_seconds < 0:
            raise ValueError(f"--grace-seconds is {args.grace_seconds!r}; it must be >= 0.")
        num_workers = parse_num_workers(args.num_workers)
        if isinstance(num_workers, tuple):
            result = _main_elastic(args, num_workers, program)
        elif args.max_restarts is not None or args.hosts_command is not None or args.elastic_timeout_seconds is not None:
            raise ValueError("--max-restarts, --hosts-command and --elastic-timeout-seconds need an elastic launch: "
                             f"--num-workers MIN:MAX (e.g. {num_workers}:{num_workers} restarts at a fixed size).")
        elif args.num_ps is not None:
            args.num_workers = num_workers
            result = _main_parameter_server(args, program)
        else:
            result = launch([sys.executable, "-u", *program], num_workers, args.devices_per_worker,
                            args.chief, timeout_seconds=args.timeout_seconds, grace_seconds=args.grace_seconds)
    except ValueError as e:
        parser.error(str(e))
    except TimeoutError as e:  # an elastic launch waited too long for MIN worker slots
        parser.exit(1, f"[launch] {e}\n")
    return result.returncode


def _main_parameter_server(args: argparse.Namespace, program: list[str]) -> LaunchResult:
    if args.devices_per_worker is not None or args.chief:
        raise ValueError("--num-ps cannot be combined with --devices-per-worker or --chief (a ps cluster always has "
                         "one chief, and each worker runs one replica).")
    return launch_parameter_server([sys.executable, "-u", *program], args.num_workers, args.num_ps,
                                   timeout_seconds=args.timeout_seconds, grace_seconds=max(args.grace_seconds, 10.0))


def _main_elastic(args: argparse.Namespace, sizes: tuple[int, int], program: list[str]) -> LaunchResult:
    if args.num_ps is not None or args.chief:
        raise ValueError(f"--num-workers {args.num_workers} (elastic) cannot be combined with --num-ps or --chief: "
                         "an elastic launch runs MultiWorkerMirroredStrategy workers only.")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ValueError(f"--max-restarts is {args.max_restarts}; it must be >= 0 (default 3).")
    if args.hosts_command is not None and not args.hosts_command.strip():
        raise ValueError("--hosts-command is empty; give a command that prints one slot per line, e.g. 'cat hosts.txt'.")
    config = ElasticConfig(sizes[0], sizes[1], 3 if args.max_restarts is None else args.max_restarts,
                           args.hosts_command, 600.0 if args.elastic_timeout_seconds is None else args.elastic_timeout_seconds)
    return launch_elastic([sys.executable, "-u", *program], config, args.devices_per_worker,
                          timeout_seconds=args.timeout_seconds, grace_seconds=args.grace_seconds)
