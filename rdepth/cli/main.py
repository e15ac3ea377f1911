"""The ``rdepth`` command: one subcommand per module in this package.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` (called with the parsed namespace). Heavy imports happen
inside ``func`` so that ``rdepth --help`` stays fast.

User errors (:class:`rdepth.errors.RdepthError`, a bad flag, a missing file)
print one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from rdepth.errors import RdepthError

# Subcommand modules, in the order ``rdepth --help`` lists them.
SUBCOMMANDS = [
    "prepare",
    "train",
    "eval",
    "generate",
    "analyze",
    "sweep",
    "surrogate",
    "demo",
]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="rdepth",
        description="Recurrent-depth transformers: train looped models, inspect their "
        "loop geometry, exit early, and fit block-recurrent surrogates.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"rdepth.cli.{name}")
        except ModuleNotFoundError as exc:  # a subcommand not built yet
            if exc.name == f"rdepth.cli.{name}":
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except RdepthError as exc:
        print(f"rdepth {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rdepth {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
