"""The engine's static tick: every slot through one device function a tick, shapes fixed, rows predicated.

The eager tick (:mod:`rdepth.engine.eager`) computes only what each row needs: one loop step for the looping
rows, then, for the few rows whose rule fired, their readout, their next token's embedding and their entry
into the loop, each a gather, a small call and a scatter. On a small model every one of those calls costs
its launch more than its arithmetic, so a tick with an exit rule costs about three fixed-budget loop steps.

The static tick does the whole of it for every slot in one function of device tensors, for a model with any
number of looped groups and single-pass layers before, between and after them: for each group, one loop step
of every slot at its own step and position (only the slots looping in that group write their keys, written
through to the later step slots), the exit rule; a slot whose rule fired in a group that is not the last goes
through the layers between (their keys written for the slots that go on only) and enters the next group (its
input half and initial state), looping there from the next tick; a slot whose rule fired in the last group
hands on through the layers after it, reads out, takes its next token (the prompt's next while in the prompt,
else the argmax), its embedding at the next position, the layers before the first group there and that group's
entry. ``torch.where`` keeps, per slot, what applies to it. (A slot that did not stop writes keys of the layers
after the last group at its own position and before the first at the next: both rewritten in the tick it
stops, before anything reads them.) Every slot pays a loop step of every group a tick: with several groups the
tick costs their sum, however the rows spread. The host reads, once, which rows stopped, their argmax and the
token entered; the scheduler's bookkeeping is the same as for the eager tick (records, sampled tokens,
retiring, admitting); a token it feeds that the device did not enter (a sampled one) is entered here through
the eager walk, and a rule's per-row memory starts afresh (``begin_rows``) for the rows that entered a group in
the tick. Fixed shapes make the function one graph for ``torch.compile`` (``Engine(..., tick="compiled")``):
Inductor fuses its elementwise work, so a tick's cost barely depends on how many rows stop in it.

A row computes what it computes in the eager tick (the same loop step, the same rule, the same readout),
so its tokens are the batch-1 decoder's; compiled, the arithmetic is fused in another order (float
rounding, not the model), which can move a decision that sits on its threshold.
"""

from __future__ import annotations

import shutil
import types
from typing import ClassVar

import numpy as np
import torch

from rdepth.engine.eager import EagerTick
from rdepth.engine.tick import TickInput, TickOutput, TickPlan, draw_initial, register_tick
from rdepth.errors import RdepthError
from rdepth.model.kv import AttentionContext
from rdepth.model.loop import next_steps
from rdepth.model.recurrent import RecurrentLM
from rdepth.model.walk import StageWalk


def check_static(name: str, model: RecurrentLM, plan: TickPlan) -> None:
    """A one-line error unless tick ``name`` can run ``model`` under ``plan``."""
    if model.n_groups < 1:
        raise RdepthError(f"engine: tick {name!r} needs a model with a looped group; use tick='eager'")
    for field, wrong in (("kv_layout", plan.kv_layout != "exact"), ("warm_start", plan.warm_start)):
        if wrong:
            raise RdepthError(f"engine: tick {name!r} runs the exact layout without warm start; "
                              f"{field} asks otherwise (use tick='eager')")
    for controller in (plan.controller, *(controller for _, controller in plan.rules)):
        policy = getattr(controller, "policy", None)
        if policy is not None and not policy(0).one_call:
            raise RdepthError(f"engine: tick {name!r} runs rules that decide rows at any steps in one call "
                              f"(such as step_norm_rel, kl, learned); {policy(0).name} does not (use tick='eager')")


class _StaticStore:
    """Keys/values of one static call of group ``g``'s loop step: every slot at ``g`` (``at``; None: every slot)
    writes its key at its position into its step's slot and the later ones (:meth:`KVCache.write_latest`: a row
    that leaves its loop early leaves its last key in the later slots) and reads its step's slot over the whole
    capacity (the mask does the rest). A slot at another group writes nothing and reads garbage that nothing
    keeps."""

    def __init__(self, cache, steps: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, kept: int,
                 at: torch.Tensor | None):
        self.cache, self.steps, self.positions, self.rows, self.at = cache, steps, positions, rows, at
        if at is not None:
            steps = steps.clamp(max=kept)  # (a slot at another group may be past this group's slots)
        self.read = (steps - 1) * rows.shape[0] + rows  # row b's step slot among the K * B blocks

    def update(self, layer, ctx, keys, values):
        out = []
        for tensor, new in zip(self.cache.looped[layer], (keys, values), strict=True):
            self.cache.write_latest(tensor, new.squeeze(2), self.steps, self.rows, self.positions, self.at)
            out.append(tensor.view(-1, *tensor.shape[2:]).index_select(0, self.read))  # (B, nh, S, hs)
        return _masked(out, ctx)


class _SingleStore:
    """Keys/values of a single-pass layer in one static call: the slots ``writing`` (None: every slot) write at
    their positions ``positions``; every slot reads its whole row (the mask does the rest: a view, no gather)."""

    def __init__(self, cache, positions: torch.Tensor, rows: torch.Tensor, writing: torch.Tensor | None):
        self.cache, self.positions, self.rows, self.writing = cache, positions, rows, writing

    def update(self, layer, ctx, keys, values):
        for tensor, new in zip(self.cache.single[layer], (keys, values), strict=True):
            new = new.squeeze(2).to(tensor.dtype)  # (B, nh, hs)
            if self.writing is not None:
                new = torch.where(self.writing[:, None, None], new, tensor[self.rows, :, self.positions])
            tensor[self.rows, :, self.positions] = new
        return _masked(self.cache.single[layer], ctx)


def _masked(pair, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``(B, nh, S, hs)`` read over a slot's whole capacity, zero where ``ctx.mask`` hides them:
    what lies there (a former request's keys, or what the tick wrote running ahead past its request's end) may
    not be finite (a model whose output was not finite there), and a masked value that is not finite is not
    masked (0 x inf is NaN, and so is a NaN key plus the mask's -inf). Zero where the mask keeps nothing changes
    no weight: the same sums. Compiled, the attention's own sums leave the masked positions out
    (:func:`rdepth.model.layers._attend_elementwise`), inside the reads they fuse with."""
    if ctx.elementwise:  # (its sums take the masked positions' products out themselves)
        return tuple(pair)
    keep = ctx.mask.view(ctx.mask.shape[0], 1, -1, 1)  # (B, 1, S, 1)
    return tuple(torch.where(keep, tensor, 0) for tensor in pair)


class _Segment(StageWalk):
    """One piece of a slot's way through the model, over a run of stages, as the static tick takes it for every
    slot: it leaves group ``leaving`` (its first stage, given the hand-off state) and/or enters group
    ``entering`` (its last stage: the input half and the initial states, :attr:`entered`), through the
    single-pass layers between at ``positions``, writing their keys for the slots ``writing`` only (None:
    every slot, where a slot that does not go on rewrites them before anything reads them)."""

    def __init__(self, tick: StaticTick, stages, leaving: int | None, entering: int | None, masked: bool):
        super().__init__(tick.model, stages)
        self.tick, self.leaving, self.entering, self.masked = tick, leaving, entering, masked
        self.positions: torch.Tensor | None = None
        self.writing: torch.Tensor | None = None
        self.entered: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, x, positions: torch.Tensor, writing: torch.Tensor):
        self.positions, self.writing = positions, writing if self.masked else None
        x = self(x)
        self.positions = self.writing = None
        return x

    def single(self, layers, x):
        return self.model.run_layers(layers, x, self.tick.single_context(self.positions, self.writing))

    def group(self, group, x):
        if group == self.leaving:
            return self.leave(group, x)
        self.entered = self.enter(group, x)
        return x

    def start(self, group, inputs):
        initial = self.tick.initial.get(group)
        if initial is None:
            return torch.zeros_like(inputs)
        return initial[torch.arange(inputs.shape[0], device=inputs.device), self.positions]


@register_tick
class StaticTick(EagerTick):
    """The static tick (see the module): the slots' groups, steps, positions and prompts on the device, and
    the one function a tick runs (``compiled``: through ``torch.compile``, :class:`CompiledTick`). Rows the host
    enters (admitted, or fed a token the device did not enter) go through the eager tick's walk up to the
    first group."""

    name: ClassVar[str] = "static"
    compiled: ClassVar[bool] = False
    runs_ahead: ClassVar[bool] = True  # (Engine(ahead=N): several ticks a call, see __call__)

    def __init__(self, model: RecurrentLM, plan: TickPlan):
        check_static(self.name, model, plan)
        if self.compiled and plan.device.type == "cpu" and not _cpu_compiler():
            raise RdepthError("engine: tick 'compiled' on the CPU needs a C++ compiler (g++ or the one "
                              "torch._inductor.config.cpp.cxx names); use tick='static' or 'eager'")
        super().__init__(model, plan)
        batch, device, groups = plan.batch, plan.device, model.n_groups
        self.groups = groups
        self.rows = torch.arange(batch, device=device)
        self.group = torch.zeros(batch, dtype=torch.long, device=device)  # the group each slot loops in
        self.steps = torch.ones(batch, dtype=torch.long, device=device)  # the step each row computes next
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.prompt = torch.zeros(batch, plan.capacity, dtype=torch.long, device=device)
        self.prompt_length = torch.zeros(batch, dtype=torch.long, device=device)
        cap = plan.capacity
        where = torch.arange(cap, device=device)
        self.masks = (where[None, :] <= where[:, None]).view(cap, 1, 1, cap)
        stages = model.stages
        at = {stage.group: index for index, stage in enumerate(stages) if stage.group is not None}
        # the ways between: group g to g + 1 (writes masked: a slot past g keeps its keys there); after the last
        # group to the readout; the next token to the first group (every slot writes: see _Segment)
        self.between = [_Segment(self, stages[at[g]:at[g + 1] + 1], g, g + 1, True) for g in range(groups - 1)]
        self.finish = _Segment(self, stages[at[groups - 1]:], groups - 1, None, False)
        self.begin_next = _Segment(self, stages[:at[0] + 1], None, 0, False)
        self.values = [[1, kept] for kept in plan.k_max]  # (distinct steps: the rule's one call for rows at any)
        self.choice_t = torch.zeros(batch, dtype=torch.long, device=device)  # each slot's controller (its depth)
        self.caps_t = torch.tensor(self.caps, dtype=torch.long, device=device)
        with torch.inference_mode():  # the tick's inputs as every later tick's are (no recompile at tick 2)
            self.state, self.projected = self.state.clone(), self.projected.clone()
        self.live = np.zeros(batch, dtype=bool)  # host: the occupied slots
        self.host_group = np.zeros(batch, dtype=np.int64)  # host: the group each slot loops in
        self.entered = np.zeros(batch, dtype=np.int64)  # host: the token the device entered per slot
        self.row_memory = plan.row_memory
        # (a code object of its own: dynamo's graphs, guards and recompile count are this tick's alone)
        self.code = _own_code(self._tick)
        self.function = self._compile(self.code)
        # several ticks a call (Engine(ahead=N)) where the device can choose every row's next token itself and
        # no rule keeps per-row memory the host would have to restart between them
        self.ahead = 1 if self.row_memory else plan.ahead
        self.function_ahead = self._compile(_own_code(self._ticks)) if self.ahead > 1 else None

    def _compile(self, function):
        """``function`` through ``torch.compile`` for the compiled tick (as it is for the static one). On the
        CPU Inductor writes the call's wrapper in C++ (``cpp_wrapper``): the Python wrapper's per-call work
        (its buffer allocations and size checks) was about a tenth of a small model's tick."""
        if not self.compiled:
            return function
        options = {"cpp_wrapper": True} if self.device.type == "cpu" else None
        return torch.compile(function, dynamic=False, options=options)

    def __call__(self, tick_input: TickInput) -> TickOutput:
        self._apply(tick_input)
        live = self.live.copy()
        if self.function_ahead is not None and tick_input.greedy_only:
            # ahead: the device chooses and enters every row's next token for self.ahead ticks; one host read
            decisions, logits = self._launch(True)
            decisions = decisions.cpu().numpy()  # (N, 3, B)
            stops = (decisions[:, 0] == 1) & live  # (the call's ticks at once: (N, B))
            outputs = [self._read(live, decisions[i], logits[i], stops[i]) for i in range(self.ahead)]
            outputs[0].following = outputs[1:]
            return outputs[0]
        decisions, logits = self._launch(False)
        decisions = decisions.cpu().numpy()  # the tick's one host read
        return self._read(live, decisions, logits, (decisions[0] == 1) & live)

    def _launch(self, ahead: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tick's function over the slots (``ahead``: the call of several ticks), its new loop states and
        input halves the slots' from now on; returns its decisions and logits (:meth:`_tick`, :meth:`_ticks`).
        (The graph tick replays the function recorded instead: :mod:`rdepth.engine.graph`.)"""
        function = self.function_ahead if ahead else self.function
        self.state, self.projected, decisions, logits = function(self.state, self.projected)
        return decisions, logits

    def _read(self, live: np.ndarray, decisions: np.ndarray, logits: torch.Tensor, stops: np.ndarray) -> TickOutput:
        """One tick's output from its decisions ``[3, B]`` (which rows stopped, argmax, token entered), the
        live rows that stopped (``stops`` ``[B]``) and the logits ``[B, V]``: the host's per-slot bookkeeping of
        the rows that stopped."""
        self.step_count += live
        if self.groups == 1:
            loop_steps = [int(np.count_nonzero(live))]
        else:
            loop_steps = np.bincount(self.host_group[live], minlength=self.groups).tolist()
        stopped = np.flatnonzero(stops)
        if not stopped.size:
            return TickOutput.nothing(self.groups, loop_steps)
        if self.groups == 1:  # (every row that stopped read out)
            rows = stopped
            self.current[rows, 0] = self.step_count[rows]
        else:
            groups = self.host_group[stopped]
            self.current[stopped, groups] = self.step_count[stopped]
            last = groups == self.groups - 1
            moved, rows = stopped[~last], stopped[last]
            if moved.size:  # on to the next group (the device entered them): the rule's memory there starts afresh
                self.host_group[moved] += 1
                self._restart(moved)
            self.host_group[rows] = 0
        self.step_count[stopped] = 0
        if not rows.size:
            return TickOutput.nothing(self.groups, loop_steps)
        entered = decisions[2][rows]
        self.entered[rows] = entered  # the token the device entered for each (_apply compares a token fed)
        self.position[rows] += 1  # (the device moved them on; the host's next hand-over says the same)
        self._restart(rows)  # (their next token's loop, entered by the device: the rule's memory afresh)
        return TickOutput(rows, decisions[1][rows], self.current[rows].copy(), logits, rows, loop_steps,
                          entered=entered)

    def _restart(self, rows: np.ndarray) -> None:
        """The rule's memory of ``rows`` in the group each now loops in starts afresh (their start states)."""
        if not self.row_memory:
            return
        for group in np.unique(self.host_group[rows]).tolist():
            chosen = rows[self.host_group[rows] == group]
            rows_t, _ = self._rows(chosen)
            for controller in self.controllers:
                controller.begin_rows(group, rows_t, self.state[rows_t])

    def _apply(self, tick_input: TickInput) -> None:
        """The host's hand-over: slots emptied; requests admitted (their prompt on the device, their first
        token entered); tokens fed that the device did not enter itself (sampled ones) entered here (the rule's
        memory of a row the device entered started afresh when the tick was read, :meth:`_read`)."""
        self.live[tick_input.retired] = False
        for row, request in tick_input.admitted:
            draw_initial(self.model, self.initial, row, request)
            self.admit(row, request.prompt)
            self._route(row, request)
            if len(self.controllers) > 1:
                self.choice_t[row] = int(self.choice[row])
                self.caps_t[row] = torch.from_numpy(self.caps[row])
            self.live[row] = True
            self.host_group[row] = 0
            self.entered[row] = -1  # (its first token: never the device's)
        rows, tokens, positions = tick_input.entering, tick_input.tokens, tick_input.positions
        if not rows.size:
            return
        if rows.size > 1 and (rows[1:] == rows[:-1]).any():  # after a call that ran ahead: each slot's last feed
            last = np.append(rows[1:] != rows[:-1], True)  # (the earlier ones are the device's own: greedy)
            rows, tokens, positions = rows[last], tokens[last], positions[last]
        other = tokens != self.entered[rows]  # (the scheduler feeds what the device did not enter: all of them)
        if other.any():
            self._enter(rows[other], tokens[other], positions[other])
            self.walk.enter_rows(rows[other])

    def admit(self, row: int, prompt: list[int]) -> None:
        """Slot ``row`` takes a new request: its prompt, the first group, step 1, position 0."""
        self.prompt[row].zero_()
        self.prompt[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.prompt_length[row] = len(prompt)
        self.group[row] = 0
        self.steps[row] = 1
        self.positions[row] = 0

    def single_context(self, positions: torch.Tensor, writing: torch.Tensor | None) -> AttentionContext:
        """The context of a single-pass layer's call over every slot at ``positions`` (keys written for the
        slots ``writing``; None: every slot)."""
        store = _SingleStore(self.slots.cache, positions, self.rows, writing)
        return AttentionContext(store, 0, self.rows, positions, self.rows, 1, self.rows.shape[0],
                                self.masks.index_select(0, positions), one_per_row=True, elementwise=self.compiled)

    def loop_step(self, group: int, state: torch.Tensor, projected: torch.Tensor, at: torch.Tensor | None):
        """One loop step of ``group`` for every slot at its step and position (the slots ``at`` it count; None:
        every slot), and the rule; returns the new states, which rows stopped and the states they hand on."""
        steps, positions, rows = self.steps, self.positions, self.rows
        store = _StaticStore(self.slots.cache, steps, positions, rows, self.k_max[group], at)
        ctx = AttentionContext(store, 0, rows, positions, rows, 1, rows.shape[0],
                               self.masks.index_select(0, positions), one_per_row=True, elementwise=self.compiled)
        new = self.model.loop_step(group, state, projected, ctx)
        done, handoff, _ = self.controller.after_steps(group, steps, self.values[group], rows, state, new)
        if len(self.controllers) > 1:  # each row under its own request's controller, within its caps
            for index, controller in enumerate(self.controllers[1:], start=1):
                mine = self.choice_t == index
                own, handed, _ = controller.after_steps(group, steps, self.values[group], rows, state, new)
                done = torch.where(mine, own, done)
                handoff = torch.where(mine[:, None], handed, handoff)
            done = done | (steps >= self.caps_t[:, group])
        return new, (done if at is None else done & at), handoff

    def _ticks(self, state: torch.Tensor, projected: torch.Tensor):
        """:meth:`_tick` ``self.ahead`` times: the new loop states and input halves, the decisions ``[N, 3, B]``
        and the logits ``[N, B, V]`` of each."""
        decisions, logits = [], []
        for _ in range(self.ahead):
            state, projected, decided, read = self._tick(state, projected)
            decisions.append(decided)
            logits.append(read)
        return state, projected, torch.stack(decisions), torch.stack(logits)

    def _tick(self, state: torch.Tensor, projected: torch.Tensor):
        """Every slot one loop step on in its group; a slot whose rule fired goes on to the next group (entered
        there), or after the last one reads out, chooses its next token and enters the first group at the
        next position. Returns the new loop states and input halves, ``[3, B]`` (stopped, argmax or -1 where
        the logits are not finite, the token entered) and the logits ``[B, V]``."""
        model, positions, steps = self.model, self.positions, self.steps
        groups, one = self.groups, self.groups == 1
        next_state, next_projected, next_group = state, projected, self.group
        stopped = torch.zeros_like(self.group, dtype=torch.bool)
        for group in range(groups):
            at = None if one else self.group == group
            new, done, handoff = self.loop_step(group, state, projected, at)
            going = new if one else torch.where(at[:, None], new, next_state)
            if group < groups - 1:
                segment = self.between[group]
                segment.run(handoff, positions, done)
                start, entered = segment.entered
                next_state = torch.where(done[:, None], start, going)
                next_projected = torch.where(done[:, None], entered, next_projected)
                next_group = torch.where(done, group + 1, next_group)
            else:
                last, last_new = done, going  # (last_new: every slot's state but the ones ending here)
            stopped = stopped | done
        logits = model.readout(self.finish.run(handoff, positions, last))
        finite = torch.isfinite(logits).all(dim=-1)
        greedy = logits.argmax(dim=-1)
        following = (positions + 1).clamp(max=self.capacity - 1)  # (a free slot's garbage stays in range)
        in_prompt = positions + 1 < self.prompt_length
        token = torch.where(in_prompt, self.prompt.gather(1, following[:, None]).squeeze(1),
                            torch.where(finite, greedy, 0))
        self.begin_next.run(model.embed(token, positions=following).to(state.dtype), following, last)
        start, entered = self.begin_next.entered
        ends = last[:, None]
        new_state = torch.where(ends, start, last_new)
        new_projected = torch.where(ends, entered, next_projected)
        self.group.copy_(torch.where(last, 0, next_group))
        self.steps.copy_(next_steps(steps, stopped))
        self.positions.copy_(torch.where(last, following, positions))
        decisions = torch.stack([stopped.long(), torch.where(finite, greedy, -1), token])
        return new_state, new_projected, decisions, logits


@register_tick
class CompiledTick(StaticTick):
    """The static tick's function through ``torch.compile`` (one graph per tick object)."""

    name: ClassVar[str] = "compiled"
    compiled: ClassVar[bool] = True


def _own_code(method):
    """``method`` (bound) with a code object of its own: dynamo keeps its compiled graphs, their guards and its
    recompile count per code object, so each engine's tick is looked up among its own graphs only (each failing
    guard set checked first costs the tick time), and many engines in one process (a benchmark's widths and
    rules) never reach dynamo's recompile limit (8) together."""
    function = method.__func__
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


def _cpu_compiler() -> bool:
    """Whether Inductor finds a C++ compiler for CPU kernels (the ones its config names, then g++)."""
    from torch._inductor import config

    names = config.cpp.cxx if isinstance(config.cpp.cxx, tuple) else (config.cpp.cxx,)
    return any(name and shutil.which(name) for name in (*names, "g++"))
