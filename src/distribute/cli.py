"""The main job: ``python -m distribute train`` (console script ``jax-distribute``).

Trains a Keras MLP classifier on the UCI handwritten digits that scikit-learn
ships (or a Keras-format MNIST ``.npz`` given with ``--data``) under a chosen
strategy, with Keras ``fit`` or a custom loop, and writes the model, the history
and a loss/accuracy plot.  Command-line parsing happens before JAX is imported,
so ``--replicas N`` can create N virtual CPU devices.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

STRATEGIES = ("mirrored", "one_device", "default", "multi_worker_mirrored")


class _Parser(argparse.ArgumentParser):
    """Bad flags end the program with one line and exit status 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m distribute", description="tf.distribute on JAX: the main job.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser("train", help="train a digit classifier under a strategy")
    train.add_argument("--strategy", choices=STRATEGIES, default="mirrored")
    train.add_argument("--replicas", type=int, default=None, help="replicas for mirrored (default: 2 on CPU, all GPUs)")
    train.add_argument("--epochs", type=int, default=20)
    train.add_argument("--global-batch-size", type=int, default=64)
    train.add_argument("--learning-rate", type=float, default=1e-3)
    train.add_argument("--mode", choices=("fit", "custom"), default="fit")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--data", default=None, help="a Keras-format MNIST .npz (x_train, y_train, x_test, y_test)")
    train.add_argument("--output", default="out", help="directory for model.keras, history.json, curves.png")
    train.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1, help="Keras progress bar style")
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.replicas is not None and args.replicas < 1:
        parser.error(f"--replicas {args.replicas}: must be at least 1")
    if args.strategy != "mirrored" and args.replicas not in (None, 1):
        parser.error(f"--replicas {args.replicas} needs --strategy mirrored ({args.strategy} has one replica)")
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: must be at least 1")
    if args.global_batch_size < 1:
        parser.error(f"--global-batch-size {args.global_batch_size}: must be at least 1")
    if args.learning_rate <= 0:
        parser.error(f"--learning-rate {args.learning_rate}: must be positive")


def _configure_cpu_devices(count: int) -> None:
    """Asks XLA for ``count`` CPU devices; must run before JAX is imported."""
    if "jax" in sys.modules:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        _validate(parser, args)
        if args.strategy == "mirrored":
            _configure_cpu_devices(args.replicas or 2)
        from distribute.training import JobError, train

        try:
            train(args)
        except JobError as err:
            print(f"python -m distribute train: error: {err}", file=sys.stderr)
            return 1
        return 0
    return 2  # pragma: no cover - argparse requires a command
