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

STRATEGIES = ("mirrored", "one_device", "default", "multi_worker_mirrored", "parameter_server")


class _Parser(argparse.ArgumentParser):
    """Bad flags end the program with one line and exit status 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\n")


STRATEGY_HELP = (
    "how to spread training over devices (default: %(default)s). "
    "mirrored: one replica per local device, gradients summed across them; "
    "one_device: everything on the first device; "
    "default: no distribution (the default strategy); "
    "multi_worker_mirrored: mirrored across several processes or machines - "
    "run under python -m distribute.launch, or with TF_CONFIG set on each worker; "
    "parameter_server: asynchronous training on an embedded local Ray cluster of "
    "workers and parameter servers, sized by the two flags below"
)


def build_parser() -> argparse.ArgumentParser:
    from distribute import __version__

    parser = _Parser(prog="python -m distribute", description="tf.distribute on JAX: the main job.")
    parser.add_argument("--version", action="version", version=f"jax-distribute {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train a digit classifier under a strategy",
        description=(
            "Train a Keras MLP digit classifier under a distribution strategy and write "
            "model.keras, history.json and curves.png to --output. Without --data it uses "
            "scikit-learn's UCI handwritten digits (8x8 images, 80/20 split)."
        ),
    )
    train.add_argument("--strategy", choices=STRATEGIES, default="mirrored", help=STRATEGY_HELP)
    train.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="replicas for --strategy mirrored (default: 2 virtual CPU devices on CPU, all GPUs on GPU)")
    train.add_argument("--num-workers", type=int, default=None, metavar="N",
                       help="workers of the embedded cluster for --strategy parameter_server (default: 2)")
    train.add_argument("--num-ps", type=int, default=None, metavar="N",
                       help="parameter servers of the embedded cluster for --strategy parameter_server (default: 1)")
    train.add_argument("--epochs", type=int, default=20, metavar="N", help="passes over the training data (default: %(default)s)")
    train.add_argument("--global-batch-size", type=int, default=64, metavar="N",
                       help="examples per step, summed over all replicas (default: %(default)s)")
    train.add_argument("--learning-rate", type=float, default=1e-3, metavar="LR", help="Adam learning rate (default: %(default)s)")
    train.add_argument("--mode", choices=("fit", "custom"), default="fit",
                       help="fit: Keras model.fit; custom: a hand-written loop with strategy.run (default: %(default)s)")
    train.add_argument("--seed", type=int, default=0, help="seed for weights, shuffling and the train/test split (default: %(default)s)")
    train.add_argument("--data", default=None, metavar="FILE.npz",
                       help="a Keras-format MNIST .npz holding x_train, y_train, x_test, y_test "
                            "(integer labels 0..k-1); default: scikit-learn's UCI digits")
    train.add_argument("--output", default="out", metavar="DIR",
                       help="directory for model.keras, history.json, curves.png (default: %(default)s)")
    train.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                       help="0: only the per-epoch summary lines; 1: a progress bar per epoch; "
                            "2: one Keras log line per epoch (default: %(default)s)")
    parser.train_parser = train  # errors about train's flags are reported by (and prefixed with) train
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.replicas is not None and args.replicas < 1:
        parser.error(f"--replicas {args.replicas}: must be at least 1")
    launcher = ("python -m distribute.launch --num-workers N --devices-per-worker K -m distribute train "
                "--strategy multi_worker_mirrored")
    if args.strategy != "mirrored" and args.replicas not in (None, 1):
        if args.strategy == "multi_worker_mirrored":
            parser.error(f"--replicas {args.replicas}: multi_worker_mirrored takes its replicas from the cluster "
                         f"(workers x devices per worker); run it under the launcher: {launcher}")
        per = " per worker" if args.strategy == "parameter_server" else ""
        parser.error(f"--replicas {args.replicas} needs --strategy mirrored ({args.strategy} has one replica{per})")
    for flag, value in (("--num-workers", args.num_workers), ("--num-ps", args.num_ps)):
        if value is not None and args.strategy == "multi_worker_mirrored" and flag == "--num-workers":
            parser.error(f"--num-workers {value} is for --strategy parameter_server; multi_worker_mirrored "
                         f"gets its workers from the launcher: {launcher}")
        if value is not None and args.strategy != "parameter_server":
            parser.error(f"{flag} {value} needs --strategy parameter_server ({args.strategy} has no ps cluster)")
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: must be at least 1")
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: must be at least 1")
    if args.global_batch_size < 1:
        parser.error(f"--global-batch-size {args.global_batch_size}: must be at least 1")
    if not args.learning_rate > 0 or args.learning_rate == float("inf"):
        parser.error(f"--learning-rate {args.learning_rate}: must be a positive number")


def _configure_cpu_devices(count: int) -> None:
    """Asks XLA for ``count`` CPU devices; must run before JAX is imported."""
    if "jax" in sys.modules:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if args.command == "train":
        train_parser = parser.train_parser
        if extras:
            train_parser.error(f"unrecognized arguments: {' '.join(extras)}")
        _validate(train_parser, args)
        if args.strategy == "mirrored":
            _configure_cpu_devices(args.replicas or 2)
        from distribute.training import JobError, train

        try:
            train(args)
        except JobError as err:
            print(f"{train_parser.prog}: error: {err}", file=sys.stderr)
            return 1
        return 0
    if extras:  # pragma: no cover - argparse requires a command
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return 2  # pragma: no cover - argparse requires a command
