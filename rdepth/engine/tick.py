"""The engine's seam between the host and the device: what a tick is handed and what it hands back.

:class:`~rdepth.engine.engine.Engine` runs ``schedule -> tick -> update``: the host's
:class:`~rdepth.engine.scheduler.Scheduler` (slots, admission, retirement, the host logs, token choice) makes a
:class:`TickInput`; one :class:`Tick` (the eager walk, :mod:`rdepth.engine.eager`, or the static and compiled
function, :mod:`rdepth.engine.static`) moves every occupied slot one loop step on and returns a
:class:`TickOutput`; the scheduler reads it back. A tick owns the device (the cache, the activations, the loop
states, the rule's memory) and is built from a :class:`TickPlan`; it reads nothing of the engine's.

A new tick is a class with ``name`` and ``__call__(TickInput) -> TickOutput``, registered in :data:`TICKS`
(``@register_tick``), with the engine's exactness tests run over it (``tests/test_engine*.py`` take every
registered tick).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import torch

from rdepth.engine.request import Request
from rdepth.errors import RdepthError
from rdepth.model.control import FixedController, RowController
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM


@dataclass(frozen=True)
class TickPlan:
    """What a tick is built for: the slots (``batch`` rows of ``capacity`` positions), the loop controller
    (``fixed``: a fixed budget, ``k_max`` the most steps per group), the key/value layout, warm start, and the
    dtype and device of the model's parameters."""

    batch: int
    capacity: int
    controller: RowController
    fixed: bool
    k_max: tuple[int, ...]
    kv_layout: str
    warm_start: bool
    dtype: torch.dtype
    device: torch.device
    # the exit rules a request may ask for by name (Request.depth), each a controller at the engine's caps
    rules: tuple[tuple[str, RowController], ...] = ()
    own_depths: bool = False  # whether requests may bring a depth of their own (Request.depth)
    # the most ticks one call of the tick may run before the host reads the device (a tick that runs ahead:
    # :class:`~rdepth.engine.static.StaticTick`; 1: the host reads after every tick)
    ahead: int = 1

    def route(self, request: Request) -> tuple[int, tuple[int, ...], float | None]:
        """Which controller a request's rows use (0: the engine's; 1: a fixed budget of its own ``loops``;
        2 + i: the i-th named rule), the loop steps each group may take at most, and its own threshold (None:
        the controller's)."""
        depth = request.depth
        if depth is None:
            return 0, self.k_max, None
        if depth.loops is not None:
            return 1, (depth.loops,) * len(self.k_max), None
        index = [name for name, _ in self.rules].index(depth.rule)
        caps = self.k_max if depth.k_max is None else tuple(min(depth.k_max, k) for k in self.k_max)
        return 2 + index, caps, depth.tau

    def controllers(self) -> list[RowController]:
        """Every controller a row may use, in :meth:`route`'s order (the fixed budget's at the engine's caps)."""
        return [self.controller, FixedController(self.k_max), *(controller for _, controller in self.rules)]

    @property
    def row_memory(self) -> bool:
        """Whether a controller a row may use keeps memory per row that a row's next token starts afresh (an
        exit rule says; a fixed budget keeps none; any other controller is asked every time)."""
        return any(_keeps_row_memory(controller)
                   for controller in (self.controllers() if self.own_depths else [self.controller]))


def _keeps_row_memory(controller: RowController) -> bool:
    policy = getattr(controller, "policy", None)
    if policy is not None:
        return policy(0).row_memory
    return not isinstance(controller, FixedController)


@dataclass
class TickInput:
    """The host's hand-over for one tick, each array over slots: ``retired`` (slots emptied since the last
    tick), ``admitted`` (slot, request: a new request's slot, its first token entering at position 0),
    ``entering`` (slots whose next token goes in at ``positions``: ``tokens``; a slot may appear more than once,
    its feeds in the order they were made: after a call that ran several ticks), ``live`` ``[B]`` (the occupied
    slots after these); ``greedy_only``: every occupied slot's request chooses its tokens by argmax (the device
    may enter its next tokens itself, several ticks on)."""

    live: np.ndarray
    retired: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    admitted: list[tuple[int, Request]] = field(default_factory=list)
    entering: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    greedy_only: bool = False
    # per admitted slot whose request samples: the generator its tokens are drawn from (the scheduler's own; a tick
    # that chooses tokens itself draws from it in the same order: loop speculation's rounds)
    generators: dict[int, torch.Generator] = field(default_factory=dict)


@dataclass
class TickOutput:
    """What one tick did: the slots ``rows`` ``[E]`` whose token went through every stage (read out), each
    one's argmax (``greedy``, -1 where its logits are not finite) and loop steps per group (``steps``
    ``[E, G]``); ``logits`` with row ``rows[i]``'s at ``logits[index[i]]``; ``loop_steps``: loop steps
    computed per group, summed over rows; ``entered``: per row, the token the tick itself entered at the row's
    next position (the static tick: the prompt's next, else the argmax), which the scheduler then does not feed
    again unless it chose another (None: the tick enters nothing itself); ``following``: the outputs of the ticks the same call ran after this
    one, in order (a tick that runs ahead; the scheduler reads each as if it were a tick of its own, dropping
    the rows of requests that ended in an earlier one)."""

    rows: np.ndarray
    greedy: np.ndarray
    steps: np.ndarray
    logits: torch.Tensor | None
    index: np.ndarray
    loop_steps: list[int]
    following: list[TickOutput] = field(default_factory=list)
    entered: np.ndarray | None = None  # per row: the token the tick entered at its next position (None: none)
    # [R, 3] (row, drafts made, drafts kept) a round, where the tick ran loop-speculation rounds
    # (rdepth.engine.speculation): its ``following`` are then the rounds' later readouts, not ticks of their own
    speculation: np.ndarray | None = None
    # per row: whether ``greedy`` is the token chosen already (a sampled request's speculation round drew it), which
    # the scheduler then takes instead of drawing one (None: it chooses every row's)
    decided: np.ndarray | None = None

    @classmethod
    def nothing(cls, groups: int, loop_steps: list[int]) -> TickOutput:
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, np.zeros((0, groups), dtype=np.int64), None, empty, loop_steps)


class Tick(Protocol):
    """One tick over the slots (see the module)."""

    name: ClassVar[str]

    def __call__(self, tick_input: TickInput) -> TickOutput: ...

    def kv_bytes_per_token(self) -> int: ...


TICKS: dict[str, Callable[[RecurrentLM, TickPlan], Tick]] = {}


def register_tick(cls):
    """Class decorator: the tick ``cls`` under ``cls.name`` in :data:`TICKS`."""
    TICKS[cls.name] = cls
    return cls


def runs_ahead(name: str) -> bool:
    """Whether the registered tick ``name`` can run several ticks a call (``Engine(ahead=N)``)."""
    return bool(getattr(TICKS[name], "runs_ahead", False))


def make_tick(name: str, model: RecurrentLM, plan: TickPlan) -> Tick:
    """The registered tick ``name`` for ``model`` and ``plan`` (:mod:`rdepth.engine.engine` imports the ticks,
    which register themselves); a one-line error names the registered ones."""
    if name not in TICKS:
        raise RdepthError(f"engine: tick must be one of {', '.join(TICKS)}, got {name!r}")
    return TICKS[name](model, plan)


def draw_initial(model: RecurrentLM, tables: dict[int, torch.Tensor], row: int, request: Request) -> None:
    """Slot ``row``'s initial loop states at every position, per group (``tables[g]`` ``[B, capacity, d]``): its
    request's own draw, ``StateNoise(noise_seed, [sequence_id])`` (never keyed by slot)."""
    noise = StateNoise(request.noise_seed, [request.sequence_id])
    for group, table in tables.items():
        blank = torch.zeros(1, table.shape[1], table.shape[-1], dtype=table.dtype, device=table.device)
        table[row] = model.init_state(group, blank, noise, 0)[0]
