"""Data-parallel training on one machine without ``torchrun``: N spawned processes, one DDP rank each.

The demo trains every run this way at a fixed rank count and one torch thread per rank, so its
numbers depend on that count only, never on the machine's cores or load, and both cores of a small
machine work on one run. Each rank gets the environment torchrun would give it (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so :func:`rdepth.train.distributed.init_distributed` joins a
gloo group and the trainer splits every batch as under torchrun: rank r takes rows
[r * B/N, (r + 1) * B/N) of the global batch, all ranks draw the same loop counts, and a row's
initial-state noise is keyed by its place in the global batch.

Rank 0 logs to this process's terminal (its progress bar included); the other ranks write their
lines to a log file. The ranks fail as one: when any rank exits with an error the others are
stopped and the first rank's one-line error is raised here. They also die with the process that
started them, even when it is killed with SIGKILL (which runs no ``finally``): on Linux each rank asks
for SIGTERM at its parent's death (``prctl(PR_SET_PDEATHSIG)``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

from rdepth.errors import RdepthError, lost_peer

POLL_SECONDS = 0.2


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun sets for one local rank of a single-node group."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this process when ``parent`` (the process that started it) dies, however it dies;
    if it is gone already (it died before this call), exit now. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(143)


def _rank_main(model_dict: dict, train_dict: dict, rank: int, world_size: int, port: int, log_level: int,
               log_path: str | None, errors, parent: int) -> None:
    """One rank, in a spawned process: the torchrun environment, logging, then train (or reuse) the run."""
    die_with_parent(parent)
    os.environ.update(rank_environment(rank, world_size, port))
    handle = None
    if log_path is not None:  # a rank other than 0: its lines go to a file, no progress bar
        os.environ["TQDM_DISABLE"] = "1"
        handle = open(log_path, "a")  # noqa: SIM115 (the rank's stdout for the rest of the process)
        sys.stdout = sys.stderr = handle
    logging.basicConfig(level=log_level, stream=handle or sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from rdepth.config import ModelConfig
    from rdepth.train.config import TrainConfig
    from rdepth.train.launch import train_or_reuse

    try:
        train_or_reuse(ModelConfig.from_dict(model_dict), TrainConfig.from_dict(train_dict))
    except RdepthError as exc:
        errors.put((rank, str(exc)))
        raise SystemExit(2) from None
    except RuntimeError as exc:  # another rank died mid-collective: one line, not gloo's traceback
        reason = lost_peer(exc)
        if reason is None:
            raise
        errors.put((rank, reason))
        print(f"rank {rank}: error: {reason}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def train_ranks(model_config, train_config, world_size: int, log_folder: str | Path) -> Path:
    """Train (or reuse, or resume) ``train_config.out`` with ``world_size`` DDP ranks on this machine;
    returns the run folder. With one rank it trains in this process, as ``rdepth train`` does."""
    from rdepth.train.launch import train_or_reuse

    if world_size == 1:
        return train_or_reuse(model_config, train_config)
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    level = logging.getLogger().getEffectiveLevel()
    folder = Path(log_folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = Path(train_config.out).name
    processes = []
    for rank in range(world_size):
        log_path = None if rank == 0 else str(folder / f"{name}.rank{rank}.log")
        processes.append(context.Process(
            target=_rank_main, args=(model_config.to_dict(), train_config.to_dict(), rank, world_size, port, level,
                                     log_path, errors, os.getpid()), daemon=False))
    try:
        for process in processes:
            process.start()
        _watch(processes, errors, name)
    finally:
        for process in processes:  # an error or an interrupt here: no rank keeps training
            if process.is_alive():
                process.terminate()
            process.join()
    return Path(train_config.out)


def _watch(processes, errors, name: str) -> None:
    """Wait for every rank; raise the error of the first that fails (the caller stops the rest)."""
    while True:
        codes = [process.exitcode for process in processes]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:  # the caller stops the other ranks; a failed rank has flushed its error already
            rank, code = failed[0]
            if code == 130:
                raise KeyboardInterrupt
            message = None
            while not errors.empty():
                failed_rank, text = errors.get()
                message = message or f"training {name} (rank {failed_rank}): {text}"
            raise RdepthError(message or f"training {name} failed: rank {rank} exited with status {code}")
        if all(code == 0 for code in codes):
            return
        time.sleep(POLL_SECONDS)
