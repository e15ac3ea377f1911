"""Continuous depth batching: many requests decoded at once, each row at its own position and loop step.

The lock-step :class:`~rdepth.model.decoder.Decoder` runs a batch's rows through every loop step until the
last row stops, so a batch pays for its slowest token at every position. The loop's weights are the same at
every step, so rows at different steps (and positions) can share one batched call instead. :class:`Engine`
holds ``batch_size`` slots; each :meth:`Engine.step` (a *tick*) walks the model's stages once
(:attr:`RecurrentLM.stages`) and, per stage, makes one batched call over the rows that are at it:

* a run of single-pass layers: those layers once, for every row at that stage;
* a recurrence group: rows arriving at it take the group's input half and their initial state (their own
  request's noise at their own position, or the state they handed on at the previous position with warm
  start) and begin their loop; then *one loop step* for every row in the group, each attending to its own
  cache row at its own step's slot (its key written through to the later slots: the latest-KV rule with
  nothing to settle at an exit); the exit rule decides per row; rows that stop hand their state on and move
  to the next stage, in the same tick. At a fixed budget with every row of the group at one step, the
  tick runs the group's remaining steps at once (the rows would move in lock-step anyway);
* after the last stage: the readout for the rows that got there, the next token (the prompt's next, or
  one chosen greedy or sampled with the request's own generator), finished requests retired and their
  slots refilled from the queue.

A row's computation is the batch-1 decoder's, whatever shares the batch: its initial states are keyed by
request and position (never by slot), it reads only its own cache row, and the rule's memory is per row.
The host reads, per tick, which rows stop in each group (nothing at a fixed budget: the host knows) and, at
the readout, each finished row's argmax and whether its logits are finite (a row that is not fails alone).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rdepth.engine.request import Finished, Request
from rdepth.engine.slots import KV_LAYOUTS, SlotCache
from rdepth.engine.static import TICKS, StaticTick
from rdepth.errors import RdepthError
from rdepth.model.control import FixedController, LoopController
from rdepth.model.decoder import resolve_budget
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM
from rdepth.model.sampling import choose_tokens
from rdepth.model.walk import StageWalk

FREE = -1  # stage of an empty slot


@dataclass
class EngineStats:
    """Counters over the engine's life: ticks, row-steps per group (loop steps computed, summed over rows),
    positions decoded, occupied slot-ticks (occupancy = that over ticks * batch)."""

    ticks: int = 0
    positions: int = 0
    occupied: int = 0
    loop_steps: list[int] | None = None
    requests: int = 0
    failed: int = 0

    def as_dict(self, batch: int) -> dict:
        steps = self.loop_steps or []
        return {"ticks": self.ticks, "positions": self.positions, "requests": self.requests,
                "failed": self.failed, "loop_steps": list(steps),
                "mean_loop_steps": [s / self.positions if self.positions else 0.0 for s in steps],
                "occupancy": self.occupied / (self.ticks * batch) if self.ticks else 0.0}


class _Live:
    """A request in a slot: what it has chosen so far (its loop steps and predictions per position are in the
    engine's host logs, :class:`_Logs`, until it retires)."""

    def __init__(self, request_id: int, request: Request, result: Finished, device: torch.device):
        self.id, self.request, self.result = request_id, request, result
        self.generator = None
        if request.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(int(request.seed))
        self.logits: list[torch.Tensor] = []


class _Logs:
    """Per slot, on the host: the prompt, the loop steps per group of the token in flight and of every position
    read out, and the argmax after each; one vectorized write per readout for all its rows, turned into the
    result's lists once, when the request retires."""

    def __init__(self, batch: int, capacity: int, n_groups: int, k_max: list[int], fixed: bool):
        # (int32: token ids and loop steps fit, and a long context's slots take half the host memory)
        self.prompt = np.zeros((batch, capacity), dtype=np.int32)  # the prompt (then zeros)
        self.prompt_length = np.zeros(batch, dtype=np.int64)
        self.keeps = np.zeros(batch, dtype=bool)  # whether the slot's request keeps its logits
        self.current = np.zeros((batch, n_groups), dtype=np.int32)  # loop steps of the token in flight
        self.steps = np.zeros((batch, capacity, n_groups), dtype=np.int32)  # per position read out
        self.predicted = np.zeros((batch, capacity), dtype=np.int32)  # the argmax after each position
        self.k_max = np.asarray(k_max, dtype=np.int64)
        self.fixed = fixed

    def admit(self, row: int, request: Request) -> None:
        self.prompt[row, :len(request.prompt)] = request.prompt
        self.prompt_length[row] = len(request.prompt)
        self.keeps[row] = request.keep_logits

    def record(self, rows: np.ndarray, positions: np.ndarray, greedy: np.ndarray) -> None:
        """Rows ``rows`` read out position ``positions`` with argmax ``greedy`` (all ``[E]``)."""
        self.steps[rows, positions] = self.current[rows]
        self.predicted[rows, positions] = greedy

    def rules(self, steps: np.ndarray) -> list:
        """Why each loop ended, for loop steps ``steps`` ``[..., G]``: "budget" (a fixed budget or the cap) or
        "rule"."""
        return np.where(self.fixed | (steps == self.k_max), "budget", "rule").tolist()

    def fill(self, result: Finished, row: int, read: int) -> None:
        """The result's steps, rules and predictions of the ``read`` positions row ``row`` read out."""
        steps = self.steps[row, :read]
        result.steps = steps.tolist()
        result.rules = self.rules(steps)
        result.predicted = self.predicted[row, :min(read, int(self.prompt_length[row]))].tolist()


def _make_controller(model: RecurrentLM, loop_counts, controller_factory) -> tuple[LoopController, bool]:
    """The engine's one loop controller and whether it is a fixed budget; refuses one that cannot serve rows
    at different steps."""
    budget = resolve_budget(model, loop_counts, controller_factory)  # the one decoder's reading of the two
    fixed = budget.fixed
    controller = FixedController(budget.counts) if fixed else budget.controller_factory()
    for method in ("begin_rows", "after_steps"):
        if not hasattr(controller, method):
            raise RdepthError(f"engine: the loop controller {type(controller).__name__} has no {method}() "
                              "(rows that loop at different steps need it)")
    return controller, fixed


class _EngineWalk(StageWalk):
    """The engine's stage walk: a tick visits each stage once with the slots at it (the walk's ``x``: their
    indices on the host); a group's visit is one loop step of its rows (:meth:`Engine._loop`). Rows enter a
    group through :meth:`StageWalk.enter` (``arriving``: their slots and positions) and leave it through
    :meth:`StageWalk.leave`."""

    def __init__(self, engine: Engine):
        super().__init__(engine.model)
        self.engine = engine
        self.arriving: tuple[torch.Tensor, np.ndarray] | None = None
        self.entering = False  # (the static tick's rows entered by the host: up to the group's entry only)

    def single(self, layers, rows):
        self.engine._single(layers, rows)
        return rows

    def group(self, group, rows):
        if self.entering:
            self.engine._begin(group, rows)
            self.entering = False
        else:
            self.engine._loop(group, rows)
        return rows

    def enter_rows(self, rows: np.ndarray) -> None:
        """Rows whose token is embedded (stage 0): the layers before the first group, then its entry (the
        static tick runs them on from there)."""
        self.entering = True
        for stage in self.stages:
            self.visit(stage, rows)
            if not self.entering:
                return

    def start(self, group, inputs):
        return self.engine._start(group, *self.arriving)


class Engine:
    """Continuous depth batching over ``batch_size`` slots (see the module).

    Args:
        model: the model (left as it is; run in eval mode).
        batch_size: slots B (rows decoded together).
        loop_counts: a fixed budget per group (default: the model's eval loops), or
        controller_factory: ``() -> LoopController`` with ``begin_rows``/``after_steps`` (an exit policy's
            :class:`~rdepth.exits.controller.PolicyController`, or :class:`FixedController`); one controller
            serves every slot, its memory per row.
        capacity: positions each slot holds (default: the block size); a request needs its prompt and the
            tokens fed back to fit.
        kv_layout: ``"exact"`` (default) or ``"shared"`` (:mod:`rdepth.engine.slots`).
        warm_start: each group's loop starts from the state the row handed on at its previous position.
        clock: the time source of the latency figures.
        listener: ``listener(request_id, token, steps, rules)`` called for every new token as it is chosen
            (``steps``/``rules``: the loop steps and stop reason per group of the position that chose it;
            streaming servers); it must not call the engine.
        tick: ``"eager"`` (default: each tick computes what each row needs), ``"static"`` (every slot through
            one device function a tick, rows predicated: :mod:`rdepth.engine.static`; a model with one looped
            group, a rule that decides rows at any steps in one call) or ``"compiled"`` (that function
            through ``torch.compile``).
    """

    def __init__(self, model: RecurrentLM, batch_size: int, *, loop_counts: Sequence[int] | str | int | None = None,
                 controller_factory: Callable[[], LoopController] | None = None, capacity: int | None = None,
                 kv_layout: str = "exact", warm_start: bool = False, clock: Callable[[], float] = time.perf_counter,
                 listener: Callable[[int, int, list[int], list[str]], None] | None = None, tick: str = "eager"):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RdepthError(f"engine: batch_size must be an integer >= 1, got {batch_size!r}")
        if tick not in TICKS:
            raise RdepthError(f"engine: tick must be one of {', '.join(TICKS)}, got {tick!r}")
        if kv_layout not in KV_LAYOUTS:
            raise RdepthError(f"engine: kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
        if loop_counts is not None and controller_factory is not None:
            raise RdepthError("engine: give loop_counts or controller_factory, not both")
        config = model.config
        parameter = next(model.parameters())
        self.model, self.dtype, self.device = model, parameter.dtype, parameter.device
        self.batch = batch_size
        self.capacity = capacity or config.block_size
        if not 1 <= self.capacity <= config.block_size:
            raise RdepthError(f"engine: capacity must be 1..{config.block_size} (the block size), got {self.capacity}")
        self.controller, self.fixed = _make_controller(model, loop_counts, controller_factory)
        self.k_max = [int(self.controller.max_steps(group)) for group in range(model.n_groups)]
        if any(k < 1 for k in self.k_max):
            raise RdepthError(f"engine: every group needs at least one loop step, got {self.k_max}")
        self.kv_layout = kv_layout
        self.warm_start = bool(warm_start)
        self.clock = clock
        self.listener = listener
        self._cancelled: set[int] = set()
        self.stages = model.stages
        self.walk = _EngineWalk(self)
        with torch.no_grad():
            self._allocate()
        self.stage = np.full(batch_size, FREE, dtype=np.int64)  # host: the stage each slot's token is at
        self.step_count = np.zeros(batch_size, dtype=np.int64)  # loop steps done in the current group
        self.position = np.zeros(batch_size, dtype=np.int64)  # where the slot's token in flight writes
        self.live: list[_Live | None] = [None] * batch_size
        self.queue: deque[tuple[int, Request, float, int]] = deque()
        self.next_id = 0
        self.stats = EngineStats(loop_steps=[0] * model.n_groups)
        self._all_rows = torch.arange(batch_size, device=self.device)
        self._row_tensors: dict[bytes, torch.Tensor] = {}  # slot sets seen lately, on the device (_rows)
        self.logs = _Logs(batch_size, self.capacity, model.n_groups, self.k_max, self.fixed)
        self.tick = tick
        self.static = None if tick == "eager" else StaticTick(self, compile=tick == "compiled")
        self._entered = np.zeros(batch_size, dtype=np.int64)  # static tick: the token it entered per slot
        # whether the controller keeps memory per row to start afresh (an exit rule says; another controller
        # than a fixed budget is asked every time)
        policy = getattr(self.controller, "policy", None)
        self._row_memory = policy(0).row_memory if policy is not None else not self.fixed

    def _allocate(self) -> None:
        """The slots' device buffers: the cache, the activations and states, the initial states, the rule's
        per-row memory."""
        model, config, n_groups = self.model, self.model.config, self.model.n_groups
        d, batch, device = config.d_model, self.batch, self.device
        kept = self.k_max if self.kv_layout == "exact" else [1] * n_groups
        self.slots = SlotCache(model.new_cache(batch, self.capacity, kept, self.dtype, device), self.kv_layout,
                               write_through=not self.fixed)
        self.x = torch.zeros(batch, d, dtype=self.dtype, device=device)  # activations between stages
        self.state = torch.zeros_like(self.x)  # each row's newest iterate in its group
        self.projected = torch.zeros_like(self.x)  # the group's input half W_e e
        # Per slot and group: the initial states of every position (its request's noise) and, warm, the
        # state handed on at the previous position.
        self.initial = {group: torch.zeros(batch, self.capacity, d, dtype=self.dtype, device=device)
                        for group in range(n_groups)} if config.init_state_scale != 0 else {}
        self.warm = {group: torch.zeros_like(self.x) for group in range(n_groups)} if self.warm_start else {}
        for group in range(n_groups):  # the rule's per-row memory for every slot, once
            self.controller.begin(group, torch.zeros_like(self.x))
        if model.rotary is not None:
            model.rotary.table(device)

    # ------------------------------------------------------------------ clients
    def add_request(self, request: Request) -> int:
        """Queue ``request``; returns its id (the order of arrival)."""
        if not isinstance(request, Request):
            raise RdepthError(f"engine: add_request takes a Request, got {type(request).__name__}")
        request_id = self.next_id
        self.next_id += 1
        self.queue.append((request_id, request, self.clock(), self.stats.ticks))
        return request_id

    def pending(self) -> bool:
        """Whether a request is queued or in flight."""
        return bool(self.queue) or bool((self.stage != FREE).any())

    def cancel(self, request_id: int) -> None:
        """End request ``request_id`` (queued or in flight) at its next token, ``finish_reason`` "cancelled"
        (a client gone, or a stop string matched outside the engine); unknown or finished ids are ignored."""
        self._cancelled.add(int(request_id))

    def in_flight(self) -> int:
        return int((self.stage != FREE).sum())

    def run(self) -> Iterator[Finished]:
        """Tick until every queued request has finished, yielding each as it finishes."""
        while self.pending():
            yield from self.step()

    def kv_bytes_per_token(self) -> int:
        """Key/value bytes one position of one request takes (every layer, every kept loop step)."""
        return self.slots.bytes_per_token()

    # ------------------------------------------------------------------ a tick
    def step(self) -> list[Finished]:
        """One tick (see the module); returns the requests that finished in it.

        The tick runs in inference mode (no autograd bookkeeping on any kernel: about a fifth of a small
        model's tick on the CPU); what it hands back (kept logits) is copied out of it, so a client may
        use it anywhere."""
        with torch.inference_mode():
            finished = self._tick()
        for result in finished:
            if result.logits is not None:
                result.logits = result.logits.clone()  # outside inference mode: an ordinary tensor
        return finished

    def _tick(self) -> list[Finished]:
        if self.static is not None:
            return self._static_tick()
        finished = self._admit() if self.queue else []
        occupied = int((self.stage != FREE).sum())
        if not occupied:
            return finished
        self.stats.ticks += 1
        self.stats.occupied += occupied
        for index, stage in enumerate(self.stages):
            rows = np.flatnonzero(self.stage == index)
            if rows.size:
                self.walk.visit(stage, rows)  # its single-pass layers, or one loop step of its group
        ready = np.flatnonzero(self.stage == len(self.stages))
        if ready.size:
            finished += self._read_out(ready)
        return finished

    def _static_tick(self) -> list[Finished]:
        """A tick through :class:`~rdepth.engine.static.StaticTick`: every slot's loop step, rule, readout and
        next token on the device; here, which rows stopped, and the same bookkeeping as the eager tick's."""
        finished = self._admit() if self.queue else []
        live = self.stage != FREE
        occupied = int(live.sum())
        if not occupied:
            return finished
        self.stats.ticks += 1
        self.stats.occupied += occupied
        self.stats.loop_steps[0] += occupied
        decisions, logits = self.static()
        decisions = decisions.cpu().numpy()  # the tick's one host read: which rows stopped, argmax, token entered
        self.step_count[live] += 1
        rows = np.flatnonzero(live & (decisions[0] == 1))
        if not rows.size:
            return finished
        self.logs.current[rows, 0] = self.step_count[rows]
        self.step_count[rows] = 0
        self._entered[rows] = decisions[2][rows]  # the token the device entered for each (_feed compares)
        return finished + self._read_out(rows, (logits, decisions[1][rows]))

    def _rows(self, rows: np.ndarray) -> tuple[torch.Tensor, bool]:
        """Slot indices on the device, and whether they are every slot in order (views, no gathers). A set of
        slots seen lately is not copied to the device again (the same rows tick after tick)."""
        if rows.size == self.batch:
            return self._all_rows, True
        key = rows.tobytes()
        rows_t = self._row_tensors.get(key)
        if rows_t is None:
            if len(self._row_tensors) >= 64:
                self._row_tensors.clear()
            rows_t = self._row_tensors[key] = torch.from_numpy(rows.copy()).to(self.device)
        return rows_t, False

    def _context(self, rows_t, rows, every, steps=None):
        return self.slots.context(rows_t, rows, self.position[rows], every, steps)

    def _single(self, layers: tuple[int, ...], rows: np.ndarray) -> None:
        rows_t, every = self._rows(rows)
        ctx = self._context(rows_t, rows, every)
        if every:
            self.x.copy_(self.model.run_layers(layers, self.x, ctx))
        else:
            self.x[rows_t] = self.model.run_layers(layers, self.x[rows_t], ctx)
        self.stage[rows] += 1

    def _loop(self, group: int, rows: np.ndarray) -> None:
        model = self.model
        entering = rows[self.step_count[rows] == 0]
        if entering.size:
            self._begin(group, entering)
        rows_t, every = self._rows(rows)
        steps = (self.step_count if every else self.step_count[rows]) + 1
        low, high = int(steps.min()), int(steps.max())
        prev = self.state if every else self.state[rows_t]
        projected = self.projected if every else self.projected[rows_t]
        if self.fixed and low == high:  # a fixed budget, every row at one step: its loop to the end at once
            k_max = self.k_max[group]
            new, ctx = prev, self._context(rows_t, rows, every, np.full_like(steps, low))
            for step in range(low, k_max + 1):
                ctx.store.set_step(step)
                new = model.loop_step(group, new, projected, ctx)
            steps = np.full_like(steps, k_max)
            handoff, stopping = new, np.ones(rows.size, dtype=bool)
            self.stats.loop_steps[group] += int(rows.size) * (k_max - low + 1)
        else:
            new = model.loop_step(group, prev, projected, self._context(rows_t, rows, every, steps))
            self.stats.loop_steps[group] += int(rows.size)
            if self.fixed:  # known on the host: no call, no read of the device
                handoff, stopping = new, steps >= self.k_max[group]
            else:
                values = [low] if low == high else np.unique(steps).tolist()
                done, handoff, _ = self.controller.after_steps(group, torch.from_numpy(steps).to(self.device), values,
                                                               rows_t, prev, new)
                stopping = done.cpu().numpy()  # the tick's one host read for this group
        if every:
            self.state.copy_(new)
        else:
            self.state[rows_t] = new
        self.step_count[rows] = steps
        if not stopping.any():
            return
        # (the keys of a row leaving early are settled already: the cache is written through, engine/slots.py)
        leaving = rows[stopping]
        all_leave = bool(stopping.all())
        leaving_t = rows_t if all_leave else torch.from_numpy(leaving).to(self.device)
        computed = steps[stopping]
        handed = handoff if all_leave else handoff[torch.from_numpy(stopping).to(self.device)]
        if all_leave and every:
            self.x.copy_(self.walk.leave(group, handed))
        else:
            self.x[leaving_t] = self.walk.leave(group, handed)
        if self.warm_start:
            self.warm[group][leaving_t] = handed
        self.logs.current[leaving, group] = computed
        self.stage[leaving] += 1
        self.step_count[leaving] = 0

    def _begin(self, group: int, rows: np.ndarray) -> None:
        """Rows arriving at ``group``: the input half, the initial state (:meth:`_EngineWalk.start`), the rule's
        memory."""
        rows_t, every = self._rows(rows)
        self.walk.arriving = (rows_t, self.position[rows])
        start, projected = self.walk.enter(group, self.x if every else self.x[rows_t])
        if every:
            self.projected.copy_(projected)
            self.state.copy_(start)
        else:
            self.projected[rows_t] = projected
            self.state[rows_t] = start
        self.controller.begin_rows(group, rows_t, start)

    def _start(self, group: int, rows_t: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        """The initial states of the slots ``rows_t`` entering ``group`` at ``positions``: their request's own
        draw there, or (warm start, past position 0) the state each handed on at its previous position."""
        if group in self.initial:
            start = self.initial[group][rows_t, torch.from_numpy(positions).to(self.device)]
        else:  # init_state_scale 0: the loop starts from zeros
            start = torch.zeros(rows_t.shape[0], self.x.shape[1], dtype=self.dtype, device=self.device)
        if self.warm_start:  # rows past position 0 start from what they handed on at the previous one
            later = torch.from_numpy(positions > 0).to(self.device)
            start = torch.where(later[:, None], self.warm[group][rows_t], start)
        return start

    # ------------------------------------------------------------------ tokens
    def _read_out(self, rows: np.ndarray, read: tuple[torch.Tensor, np.ndarray] | None = None) -> list[Finished]:
        """Rows whose token went through every stage: logits, the next token, retire or go on (``read``: the
        static tick's logits of every slot and these rows' argmax, already computed).

        Rows still in their prompt (the argmax recorded, the prompt's next token fed) are handled for all of
        them at once on the host; a row that generates, keeps its logits or fails goes through :meth:`_choose`."""
        every = rows.size == self.batch
        if read is None:
            rows_t, _ = self._rows(rows)
            logits = self.model.readout(self.x if every else self.x[rows_t])  # (E, V)
            # the tick's host read of the readout: each row's argmax, and -1 where its logits are not finite
            greedy = torch.where(torch.isfinite(logits).all(dim=-1), logits.argmax(dim=-1), -1).cpu().numpy()
            index_of = np.arange(rows.size)  # row ``rows[i]``'s logits: ``logits[index_of[i]]``
        else:
            logits, greedy = read  # every slot's logits
            index_of = rows
        logs = self.logs
        positions = self.position[rows]
        finite = greedy >= 0
        if finite.all():
            logs.record(rows, positions, greedy)
            read = rows.size
        else:
            logs.record(rows[finite], positions[finite], greedy[finite])
            read = int(finite.sum())
        self.stats.positions += read
        in_prompt = finite & (positions + 1 < logs.prompt_length[rows])
        keeps = logs.keeps[rows]
        if in_prompt.all() and not keeps.any():  # every row in its prompt, none keeping logits: nothing per row
            self._feed(rows, logs.prompt[rows, positions + 1], every)
            return []
        feed = in_prompt.copy()
        tokens = logs.prompt[rows, np.minimum(positions + 1, self.capacity - 1)]  # the prompt's next (in it)
        finished = []
        for index in np.flatnonzero(~in_prompt | keeps).tolist():
            token = self._choose(int(rows[index]), int(positions[index]), int(greedy[index]), logits,
                                 int(index_of[index]), bool(in_prompt[index]), finished)
            if token is not None:
                feed[index], tokens[index] = True, token
        if feed.all():
            self._feed(rows, tokens, every)
        elif feed.any():
            self._feed(rows[feed], tokens[feed], False)
        return finished

    def _choose(self, row: int, position: int, greedy: int, logits: torch.Tensor, index: int, in_prompt: bool,
                finished: list[Finished]) -> int | None:
        """One row's readout beyond the prompt's bookkeeping: its logits kept, its new token chosen (and
        handed to the listener), its end; returns the token to feed next, or None (retired, or still in
        the prompt: the caller feeds the prompt's next)."""
        live = self.live[row]
        result, request = live.result, live.request
        if greedy < 0:
            finished.append(self._fail(row, f"the model's output is not finite at position {position}"))
            return None
        if request.keep_logits:
            kept = logits[index].detach().to("cpu")
            live.logits.append(kept.float() if kept.dtype in (torch.float16, torch.bfloat16) else kept)
        if in_prompt:
            return None
        token = greedy if live.generator is None else int(choose_tokens(
            logits[index:index + 1], request.temperature, request.top_k, live.generator, request.top_p))
        result.tokens.append(token)
        if self.listener is not None:
            steps = self.logs.steps[row, position]
            self.listener(live.id, token, steps.tolist(), self.logs.rules(steps))
        reason = None
        if live.id in self._cancelled:
            self._cancelled.discard(live.id)
            reason = "cancelled"
        elif token in request.stop:
            reason = "stop"
        elif len(result.tokens) >= request.max_tokens:
            reason = "length"
        elif position + 1 >= self.capacity:
            reason = "context"
        if reason is not None:
            finished.append(self._retire(row, reason))
            return None
        return token

    def _feed(self, rows: np.ndarray, tokens: np.ndarray, every: bool = False) -> None:
        """The next token of each row goes in at the row's next position (stage 0); ``every``: ``rows`` is
        every slot in order. (The static tick entered the prompt's next token or the argmax already: only
        another token, a sampled one, is entered here; the rule's memory of every fed row starts afresh.)"""
        self.position[rows] += 1
        if self.static is None:
            self._embed(rows, tokens, every)
            return
        other = tokens != self._entered[rows]
        if other.any():
            self._embed(rows[other], tokens[other])
            self.walk.enter_rows(rows[other])
        if self._row_memory:
            rows_t, _ = self._rows(rows)
            self.controller.begin_rows(0, rows_t, self.state[rows_t])

    def _embed(self, rows: np.ndarray, tokens: np.ndarray, every: bool = False) -> None:
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        if every:  # every slot in order: no gathers, no scatter
            embedded = self.model.embed(ids, positions=torch.from_numpy(self.position.copy()).to(self.device))
            self.x.copy_(embedded)
        else:
            rows_t, _ = self._rows(rows)
            positions = torch.from_numpy(self.position[rows]).to(self.device)
            self.x[rows_t] = self.model.embed(ids, positions=positions).to(self.dtype)
        self.stage[rows] = 0
        self.step_count[rows] = 0

    # ------------------------------------------------------------------ slots
    def _admit(self) -> list[Finished]:
        """Fill free slots from the queue; a request that cannot run finishes at once with its error."""
        finished = []
        free = np.flatnonzero(self.stage == FREE).tolist()
        admitted_rows, first_tokens = [], []
        while free and self.queue:
            request_id, request, submitted, tick = self.queue.popleft()
            result = Finished(request_id, request, submitted_tick=tick, submitted_s=submitted)
            self.stats.requests += 1
            if len(request.prompt) > self.capacity:
                result.finish_reason, result.error = "error", (
                    f"a prompt of {len(request.prompt)} tokens exceeds the engine's capacity {self.capacity} "
                    "(the model's context)")
                self.stats.failed += 1
                result.finished_tick, result.finished_s = self.stats.ticks, self.clock()
                finished.append(result)
                continue
            row = free.pop(0)
            self.live[row] = _Live(request_id, request, result, self.device)
            self.logs.admit(row, request)
            self.position[row] = 0
            noise = StateNoise(request.noise_seed, [request.sequence_id])
            for group, table in self.initial.items():
                blank = torch.zeros(1, self.capacity, table.shape[-1], dtype=self.dtype, device=self.device)
                table[row] = self.model.init_state(group, blank, noise, 0)[0]
            admitted_rows.append(row)
            first_tokens.append(request.prompt[0])
        if admitted_rows:
            rows = np.asarray(admitted_rows, dtype=np.int64)
            self._embed(rows, np.asarray(first_tokens, dtype=np.int64), rows.size == self.batch)
            if self.static is not None:  # its first token enters the loop here; the device runs it on
                for row in admitted_rows:
                    self.static.admit(row, self.live[row].request.prompt)
                self.walk.enter_rows(rows)
        return finished

    def _retire(self, row: int, reason: str, error: str | None = None) -> Finished:
        """Slot ``row``'s request ends (``error``: at its current position, which did not read out; else
        after it)."""
        live = self.live[row]
        result = live.result
        self.logs.fill(result, row, int(self.position[row]) + (error is None))
        result.finish_reason, result.error = reason, error
        if live.logits:
            result.logits = torch.stack(live.logits)
        result.finished_tick, result.finished_s = self.stats.ticks, self.clock()
        self.live[row] = None
        self.stage[row] = FREE
        self.step_count[row] = 0
        return result

    def _fail(self, row: int, why: str) -> Finished:
        self.stats.failed += 1
        return self._retire(row, "error", why)
