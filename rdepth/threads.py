"""How many torch CPU threads a process takes: from the cores it may use, the processes it runs
side by side, and how busy the machine is when it starts.

Torch's default is one OpenMP thread per core, whatever else runs. OpenMP threads spin while they
wait for each other, so two such processes on a 2-core machine (or one beside another job) take
turns on the cores and each step waits for the slowest thread: the demo's training ran 30x slower
per step that way. :func:`thread_plan` is the rule, a pure function; :func:`machine` reads its
inputs; :func:`apply_plan` sets torch's thread count from them (``--threads N`` always wins).

Results depend on the thread count: a matrix product split over more threads adds its partial sums
in another order, and after a few dozen training steps the rounding differences show in the
losses. A job that must reproduce its numbers on any machine fixes its thread count instead
(:data:`REPRODUCIBLE_THREADS`, the demo's training) and gets its speed from running its
independent parts side by side.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The intra-op thread count of work whose numbers must not depend on the machine (the demo's runs).
REPRODUCIBLE_THREADS = 1
THREADS_HELP = "torch CPU threads per process (0: from the cores free when it starts; see rdepth.threads)"


def thread_plan(cores: int, parallel_processes: int = 1, load: float = 0.0) -> int:
    """Torch threads for each of ``parallel_processes`` processes started together on ``cores`` usable
    cores while other work keeps ``load`` cores busy (the 1-minute load average, before they start).

    The cores left free (rounded to the nearest whole core) are shared out evenly; never fewer than
    one thread. A machine busier than its core count gives one thread per process.
    """
    if cores < 1 or parallel_processes < 1 or load < 0:
        raise ValueError(f"thread_plan: cores {cores} and parallel_processes {parallel_processes} must be >= 1, "
                         f"load {load} >= 0")
    if load > cores:
        return 1
    free = min(cores, int(cores - load + 0.5))
    return max(1, free // parallel_processes)


@dataclass(frozen=True)
class Machine:
    """The inputs of :func:`thread_plan` as read at start."""

    cores: int  # the cores this process may run on (its CPU affinity)
    load: float  # the 1-minute load average (runnable processes), 0 where the system gives none


def machine() -> Machine:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return Machine(cores=max(1, cores), load=max(0.0, load))


def apply_plan(requested: int | None = 0, parallel_processes: int = 1, at: Machine | None = None) -> int:
    """Set torch's intra-op threads: ``requested`` when given (> 0), else :func:`thread_plan` on this
    machine. Returns the count set."""
    import torch

    if requested:
        threads = requested
    else:
        at = at or machine()
        threads = thread_plan(at.cores, parallel_processes, at.load)
    torch.set_num_threads(threads)
    return threads


def describe(at: Machine) -> str:
    return f"{at.cores} usable core{'s' if at.cores != 1 else ''}, load {at.load:.1f}"
