"""The engine's eager tick: each tick computes what each row needs.

A tick walks the model's stages once (:attr:`RecurrentLM.stages`) and, per stage, makes one batched call over
the rows that are at it:

* a run of single-pass layers: those layers once, for every row at that stage;
* a recurrence group: rows arriving at it take the group's input half and their initial state (their own
  request's noise at their own position, or the state they handed on at the previous position with warm
  start) and begin their loop; then *one loop step* for every row in the group, each attending to its own
  cache row at its own step's slot (its key written through to the later slots: the latest-KV rule with
  nothing to settle at an exit); the exit rule decides per row; rows that stop hand their state on and move
  to the next stage, in the same tick. At a fixed budget with every row of the group at one step, the
  tick runs the group's remaining steps at once (the rows would move in lock-step anyway);
* after the last stage: the readout for the rows that got there (their argmax and whether their logits are
  finite: the tick's host read), handed back in the :class:`~rdepth.engine.tick.TickOutput`.

A row's computation is the batch-1 decoder's, whatever shares the batch: its initial states are keyed by
request and position (never by slot), it reads only its own cache row, and the rule's memory is per row.
The host reads, per tick, which rows stop in each group (nothing at a fixed budget: the host knows).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from rdepth.engine.slots import KV_LAYOUTS, SlotCache
from rdepth.engine.tick import TickInput, TickOutput, TickPlan, draw_initial, register_tick
from rdepth.model.loop import rows_leaving
from rdepth.model.recurrent import RecurrentLM
from rdepth.model.walk import StageWalk

FREE = -1  # stage of an empty slot


class _EagerWalk(StageWalk):
    """The eager tick's stage walk: a tick visits each stage once with the slots at it (the walk's ``x``: their
    indices on the host); a group's visit is one loop step of its rows (:meth:`EagerTick._loop`). Rows enter a
    group through :meth:`StageWalk.enter` (``arriving``: their slots and positions) and leave it through
    :meth:`StageWalk.leave`."""

    def __init__(self, tick: EagerTick):
        super().__init__(tick.model)
        self.tick = tick
        self.arriving: tuple[torch.Tensor, np.ndarray] | None = None
        self.entering = False  # (the static tick's rows entered by the host: up to the group's entry only)

    def single(self, layers, rows):
        self.tick._single(layers, rows)
        return rows

    def group(self, group, rows):
        if self.entering:
            self.tick._begin(group, rows)
            self.entering = False
        else:
            self.tick._loop(group, rows)
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
        return self.tick._start(group, *self.arriving)


@register_tick
class EagerTick:
    """The eager tick (see the module) over the device buffers it allocates for ``plan``."""

    name: ClassVar[str] = "eager"

    def __init__(self, model: RecurrentLM, plan: TickPlan):
        self.model, self.plan = model, plan
        self.controller, self.fixed, self.k_max = plan.controller, plan.fixed, list(plan.k_max)
        # every controller a row may use (Request.depth; the engine's own first), each slot's and its caps
        self.controllers = plan.controllers() if plan.own_depths else [plan.controller]
        self.choice = np.zeros(plan.batch, dtype=np.int64)
        self.caps = np.tile(np.asarray(plan.k_max, dtype=np.int64), (plan.batch, 1))
        self.dtype, self.device, self.batch, self.capacity = plan.dtype, plan.device, plan.batch, plan.capacity
        self.stages = model.stages
        self.walk = _EagerWalk(self)
        with torch.no_grad():
            self._allocate()
        self.stage = np.full(plan.batch, FREE, dtype=np.int64)  # the stage each slot's token is at
        self.step_count = np.zeros(plan.batch, dtype=np.int64)  # loop steps done in the current group
        self.position = np.zeros(plan.batch, dtype=np.int64)  # where the slot's token in flight writes
        self.current = np.zeros((plan.batch, model.n_groups), dtype=np.int64)  # loop steps of the token in flight
        self.loop_steps = [0] * model.n_groups  # this tick's, per group
        self._all_rows = torch.arange(plan.batch, device=self.device)
        self._row_tensors: dict[bytes, torch.Tensor] = {}  # slot sets seen lately, on the device (_rows)

    def _allocate(self) -> None:
        """The slots' device buffers: the cache, the activations and states, the initial states, the rule's
        per-row memory."""
        model, plan, n_groups = self.model, self.plan, self.model.n_groups
        d, batch, device = model.config.d_model, plan.batch, plan.device
        layout = KV_LAYOUTS[plan.kv_layout]()
        cache = model.new_cache(batch, plan.capacity, layout.kept(self.k_max), plan.dtype, device)
        # (a fixed budget never leaves a loop early: nothing to write through; a request's own depth may)
        self.slots = SlotCache(cache, layout, write_through=not plan.fixed or plan.own_depths)
        self.x = torch.zeros(batch, d, dtype=plan.dtype, device=device)  # activations between stages
        self.state = torch.zeros_like(self.x)  # each row's newest iterate in its group
        self.projected = torch.zeros_like(self.x)  # the group's input half W_e e
        # Per slot and group: the initial states of every position (its request's noise) and, warm, the
        # state handed on at the previous position.
        self.initial = {group: torch.zeros(batch, plan.capacity, d, dtype=plan.dtype, device=device)
                        for group in range(n_groups)} if model.config.init_state_scale != 0 else {}
        self.warm = {group: torch.zeros_like(self.x) for group in range(n_groups)} if plan.warm_start else {}
        for group in range(n_groups):  # the rule's per-row memory for every slot, once
            for controller in self.controllers:
                controller.begin(group, torch.zeros_like(self.x))
        if model.rotary is not None:
            model.rotary.table(device)

    def kv_bytes_per_token(self) -> int:
        return self.slots.bytes_per_token()

    # ------------------------------------------------------------------ the tick
    def __call__(self, tick_input: TickInput) -> TickOutput:
        self._apply(tick_input)
        return self._walk()

    def _walk(self) -> TickOutput:
        """Every occupied slot's token one stage walk on (the rows at each stage in one call), the rows that got
        through read out."""
        self.loop_steps = [0] * self.model.n_groups
        for index, stage in enumerate(self.stages):
            rows = np.flatnonzero(self.stage == index)
            if rows.size:
                self.walk.visit(stage, rows)  # its single-pass layers, or one loop step of its group
        ready = np.flatnonzero(self.stage == len(self.stages))
        if not ready.size:
            return TickOutput.nothing(self.model.n_groups, self.loop_steps)
        rows_t, every = self._rows(ready)
        logits = self.model.readout(self.x if every else self.x[rows_t])  # (E, V)
        # the tick's host read of the readout: each row's argmax, and -1 where its logits are not finite
        greedy = torch.where(torch.isfinite(logits).all(dim=-1), logits.argmax(dim=-1), -1).cpu().numpy()
        return TickOutput(ready, greedy, self.current[ready].copy(), logits, np.arange(ready.size), self.loop_steps)

    def _apply(self, tick_input: TickInput) -> None:
        """The host's hand-over: slots emptied, requests admitted (their initial states), tokens entering."""
        self.stage[tick_input.retired] = FREE
        self.step_count[tick_input.retired] = 0
        for row, request in tick_input.admitted:
            draw_initial(self.model, self.initial, row, request)
            self._route(row, request)
        if tick_input.entering.size:
            self._enter(tick_input.entering, tick_input.tokens, tick_input.positions)

    def _route(self, row: int, request) -> None:
        """Slot ``row``'s controller, caps and threshold: its request's depth (:meth:`TickPlan.route`)."""
        if len(self.controllers) == 1:
            return
        index, caps, tau = self.plan.route(request)
        self.choice[row] = index
        self.caps[row] = caps
        policy = getattr(self.controllers[index], "policy", None)  # (a named rule: its own tau unless given one)
        if policy is not None and index >= 2 and policy(0).uses_tau and policy(0).per_row_tau:
            rows = torch.tensor([row], device=self.device)
            self.controllers[index].set_row_tau(rows, policy(0).tau if tau is None else tau)

    def _decide(self, group: int, steps: np.ndarray, rows: np.ndarray, rows_t: torch.Tensor, prev: torch.Tensor,
                new: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """Which rows stop after this step and what each hands on, each row under its own controller (its
        request's depth) and within its caps: one call per controller among the rows."""
        choice = self.choice[rows]
        stopping = np.zeros(rows.size, dtype=bool)
        handoff = new.clone()
        for index in np.unique(choice).tolist():
            part = np.flatnonzero(choice == index)
            part_t = torch.from_numpy(part).to(self.device)
            values = np.unique(steps[part]).tolist()
            done, handed, _ = self.controllers[index].after_steps(
                group, torch.from_numpy(steps[part]).to(self.device), values, rows_t[part_t], prev[part_t],
                new[part_t])
            stopping[part] = done.cpu().numpy()  # (one host read per controller)
            handoff[part_t] = handed.to(handoff.dtype)
        return stopping | (steps >= self.caps[rows, group]), handoff

    def _enter(self, rows: np.ndarray, tokens: np.ndarray, positions: np.ndarray) -> None:
        """Tokens ``tokens`` go in at ``positions`` of the slots ``rows`` (stage 0)."""
        self.position[rows] = positions
        self._embed(rows, tokens)

    def _embed(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        if rows.size == self.batch and (rows == np.arange(self.batch)).all():  # every slot in order: no gathers
            embedded = self.model.embed(ids, positions=torch.from_numpy(self.position.copy()).to(self.device))
            self.x.copy_(embedded)
        else:
            rows_t, _ = self._rows(rows)
            positions = torch.from_numpy(self.position[rows]).to(self.device)
            self.x[rows_t] = self.model.embed(ids, positions=positions).to(self.dtype)
        self.stage[rows] = 0
        self.step_count[rows] = 0

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
        own = len(self.controllers) > 1 and bool((self.choice[rows] != 0).any())  # rows at depths of their own
        if self.fixed and low == high and not own:  # a fixed budget, every row at one step: its loop to the end
            k_max = self.k_max[group]
            new, ctx = prev, self._context(rows_t, rows, every, np.full_like(steps, low))
            for step in range(low, k_max + 1):
                ctx.store.set_step(step)
                new = model.loop_step(group, new, projected, ctx)
            steps = np.full_like(steps, k_max)
            handoff, stopping = new, np.ones(rows.size, dtype=bool)
            self.loop_steps[group] += int(rows.size) * (k_max - low + 1)
        else:
            new = model.loop_step(group, prev, projected, self._context(rows_t, rows, every, steps))
            self.loop_steps[group] += int(rows.size)
            if own:
                stopping, handoff = self._decide(group, steps, rows, rows_t, prev, new)
            elif self.fixed:  # known on the host: no call, no read of the device
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
        leaving, computed = rows_leaving(rows, steps, stopping)
        all_leave = bool(stopping.all())
        leaving_t = rows_t if all_leave else torch.from_numpy(leaving).to(self.device)
        handed = handoff if all_leave else handoff[torch.from_numpy(stopping).to(self.device)]
        if all_leave and every:
            self.x.copy_(self.walk.leave(group, handed))
        else:
            self.x[leaving_t] = self.walk.leave(group, handed)
        if self.plan.warm_start:
            self.warm[group][leaving_t] = handed
        self.current[leaving, group] = computed
        self.stage[leaving] += 1
        self.step_count[leaving] = 0

    def _begin(self, group: int, rows: np.ndarray) -> None:
        """Rows arriving at ``group``: the input half, the initial state (:meth:`_EagerWalk.start`), the rule's
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
        for controller in self.controllers:  # (every controller: a row's is among them)
            controller.begin_rows(group, rows_t, start)

    def _start(self, group: int, rows_t: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        """The initial states of the slots ``rows_t`` entering ``group`` at ``positions``: their request's own
        draw there, or (warm start, past position 0) the state each handed on at its previous position."""
        if group in self.initial:
            start = self.initial[group][rows_t, torch.from_numpy(positions).to(self.device)]
        else:  # init_state_scale 0: the loop starts from zeros
            start = torch.zeros(rows_t.shape[0], self.x.shape[1], dtype=self.dtype, device=self.device)
        if self.plan.warm_start:  # rows past position 0 start from what they handed on at the previous one
            later = torch.from_numpy(positions > 0).to(self.device)
            start = torch.where(later[:, None], self.warm[group][rows_t], start)
        return start
