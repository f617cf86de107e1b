"""The launcher's command line (`python -m distribute.launch`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


from distribute.launch._ps import launch_parameter_server
from distribute.launch._tasks import LaunchResult, launch


_VALUE_OPTIONS = ("--num-workers", "--num-ps", "--devices-per-worker", "--timeout-seconds", "--grace-seconds")


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
        usage="%(prog)s --num-workers N [--num-ps P] [--devices-per-worker K] [--chief] "
              "[--timeout-seconds S] [--grace-seconds S] (SCRIPT | -m MODULE) [ARGS...]",
        description="Run a program as every worker of a local (127.0.0.1) cluster, each with its TF_CONFIG.",
    )
    parser.add_argument("--num-workers", type=int, required=True, help="number of 'worker' tasks")
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
        if args.num_ps is not None:
            result = _main_parameter_server(args, program)
        else:
            result = launch([sys.executable, "-u", *program], args.num_workers, args.devices_per_worker,
                            args.chief, timeout_seconds=args.timeout_seconds, grace_seconds=args.grace_seconds)
    except ValueError as e:
        parser.error(str(e))
    return result.returncode


def _main_parameter_server(args: argparse.Namespace, program: list[str]) -> LaunchResult:
    if args.devices_per_worker is not None or args.chief:
        raise ValueError("--num-ps cannot be combined with --devices-per-worker or --chief (a ps cluster always has "
                         "one chief, and each worker runs one replica).")
    return launch_parameter_server([sys.executable, "-u", *program], args.num_workers, args.num_ps,
                                   timeout_seconds=args.timeout_seconds, grace_seconds=max(args.grace_seconds, 10.0))
