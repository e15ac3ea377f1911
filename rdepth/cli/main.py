"""The ``rdepth`` command: one subcommand per module in this package.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` (called with the parsed namespace). Heavy imports happen
inside ``func`` so that ``rdepth --help`` stays fast.

User errors (:class:`rdepth.errors.RdepthError`, a bad flag, a missing file)
print one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys

from rdepth.errors import RdepthError, lost_peer
from rdepth.io import exclusive

# Subcommand modules, in the order ``rdepth --help`` lists them.
SUBCOMMANDS = [
    "prepare",
    "train",
    "consolidate",
    "eval",
    "generate",
    "serve",
    "analyze",
    "sweep",
    "calibrate",
    "gate",
    "surrogate",
    "export",
    "import_hf",
    "retrofit",
    "lmeval",
    "demo",
    "reproduce",
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
    for command in subparsers.choices.values():  # `rdepth demo --verbose` as well as `rdepth -v demo`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="debug logging, and every stage's own log lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    # Building the parser imports torch (seconds). A KeyboardInterrupt raised inside torch's native import
    # (Python code called back from C++) can abort the process (pybind11's error_already_set, SIGABRT), so a
    # Ctrl-C meanwhile only sets a flag; the command line then ends with one line, status 130.
    with deferred_interrupt() as interrupted:
        parser = build_parser()
        args = parser.parse_args(argv)
    if interrupted:
        print("rdepth: interrupted", file=sys.stderr)
        return 130
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command(f"rdepth {args.command}", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    _plan_threads(args)
    out = _output_folder(args) if args.command in LOCKED_COMMANDS else None
    with exclusive(out, args.command) if out else contextlib.nullcontext():
        return args.func(args)


def run_command(label: str, call) -> int:
    """``call()``'s exit status, with the command line's handling of what goes wrong: a user error
    (:class:`RdepthError`), a full or read-only disk, out of memory, a lost peer rank: ``LABEL: error: ...``,
    one line, status 2; Ctrl-C: one line, 130; SIGTERM (raised like Ctrl-C so every ``finally`` runs): one
    line, 143. The bench scripts end the same way (``run_command("bench/NAME.py", ...)``)."""
    previous = _terminate_like_interrupt()
    try:
        result = call()
    except RdepthError as exc:
        print(f"{label}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"{label}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a read-only or full disk, a path that is a file: the system's words, one line
        logging.getLogger(__name__).debug("%s", exc, exc_info=True)
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"{label}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{label}: error: out of memory (choose smaller sizes)", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # torch's allocators raise RuntimeError, not MemoryError; so do collectives
        if lost_peer(exc):  # another rank died: gloo's ~28-line traceback folded into one line
            print(f"{label}: error: {lost_peer(exc)}", file=sys.stderr)
            return 2
        if not is_out_of_memory(exc):
            raise
        print(f"{label}: error: out of memory ({_one_line(exc)[:160]}; choose smaller sizes)", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return int(result or 0)


# Commands whose --out folder is locked here, for the whole command (one writer per folder);
# train and prepare lock inside their writers (the trainer, the shard writer), for library callers too.
LOCKED_COMMANDS = ("analyze", "sweep", "surrogate", "demo")
# Where the default --out of a command's config lives (flags default to None).
_CONFIG_MODULES = {"SurrogateRunConfig": "rdepth.surrogate.config", "DemoConfig": "rdepth.demo.run"}


def _output_folder(args: argparse.Namespace) -> str | None:
    """The ``--out`` folder a command will write: the flag's value, else its config's default."""
    import dataclasses

    for key, value in vars(args).items():
        if not key.endswith(".out"):
            continue
        if value is not None:
            return str(value)
        class_name = key.split(".", 1)[0]
        if class_name in _CONFIG_MODULES:
            cls = getattr(importlib.import_module(_CONFIG_MODULES[class_name]), class_name)
            default = next((f.default for f in dataclasses.fields(cls) if f.name == "out"), None)
            return str(default) if isinstance(default, (str, os.PathLike)) and str(default) else None
    return None


# Commands that plan their own threads (the demo runs processes side by side at a fixed count).
OWN_THREAD_PLAN = ("demo",)


def _plan_threads(args: argparse.Namespace) -> None:
    """Torch's threads for a compute command typed without ``--threads``: from the cores free at start
    (:mod:`rdepth.threads`), shared with the other ranks of a ``torchrun`` launch on this machine."""
    keys = [key for key in vars(args) if key.endswith(".threads")]
    if not keys or args.command in OWN_THREAD_PLAN or any(getattr(args, key) for key in keys):
        return
    from rdepth.threads import apply_plan, describe, machine

    at = machine()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    threads = apply_plan(0, max(1, ranks), at)
    logging.getLogger(__name__).debug("torch threads: %d (%s, %d process%s)", threads, describe(at), ranks,
                                      "es" if ranks != 1 else "")


@contextlib.contextmanager
def deferred_interrupt():
    """Within the block, SIGINT (Ctrl-C) raises nothing: it is recorded in the yielded list, which the caller
    reads after the block. A KeyboardInterrupt raised in the block anyway (the handler was not ours, e.g. off
    the main thread) is recorded too. The previous handler is restored on leaving."""
    import threading

    received: list[int] = []
    ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not \
        signal.SIG_IGN  # (a process started with Ctrl-C ignored keeps ignoring it)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum)) if ours else None
    try:
        yield received
    except KeyboardInterrupt:
        received.append(signal.SIGINT)
    finally:
        if ours:  # (None: a handler not set from Python; Python's own is the one to go on with)
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every ``finally`` (temporary files, locks) runs."""


def _terminate_like_interrupt():
    """Make SIGTERM behave like SIGINT (main thread only); returns the previous handler."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, handler)


# What torch's CPU and CUDA allocators say when an allocation fails.
OUT_OF_MEMORY_TEXT = ("can't allocate memory", "out of memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocator's failure (torch raises RuntimeError or its subclass OutOfMemoryError)."""
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or any(words in text for words in OUT_OF_MEMORY_TEXT)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
