"""The engine's static tick: every slot through one device function a tick, shapes fixed, rows predicated.

The eager tick (:mod:`rdepth.engine.eager`) computes only what each row needs: one loop step for the looping
rows, then, for the few rows whose rule fired, their readout, their next token's embedding and their entry
into the loop, each a gather, a small call and a scatter. On a small model every one of those calls costs
its launch more than its arithmetic, so a tick with an exit rule costs about three fixed-budget loop steps.

The static tick does the whole of it for every slot in one function of device tensors, for a model with
one looped group (the task models; single-pass layers before and after it too): one loop step (each row at
its own step and position, its key written through to the later step slots), the exit rule, and for every
row the hand-off, the layers after the group at its position, the readout, the next token (the prompt's
next while in the prompt, else the argmax), its embedding at the next position, the layers before the
group there, the group's input half and the initial state; ``torch.where`` keeps, per row, the new
token's start where the rule fired and the loop's new state where it did not. (A row that did not stop
writes keys of single-pass layers it will write again: after the group at its own position, before it at
the next, both rewritten in the tick it stops, before anything reads them.) The host reads, once,
which rows stopped, their argmax and the token entered; the scheduler's bookkeeping is the same as for the eager
tick (records, sampled tokens, retiring, admitting), and a token it feeds that the device did not enter (a sampled
one) is entered here through the eager walk. Fixed shapes make the function one graph for ``torch.compile``
(``Engine(..., tick="compiled")``): Inductor fuses its elementwise work, so a tick's cost barely depends
on how many rows stop in it.

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
from rdepth.model.recurrent import RecurrentLM
from rdepth.model.walk import StageWalk


def check_static(name: str, model: RecurrentLM, plan: TickPlan) -> None:
    """A one-line error unless tick ``name`` can run ``model`` under ``plan``."""
    if model.n_groups != 1:
        raise RdepthError(f"engine: tick {name!r} needs a model with one looped group (this one has "
                          f"{model.n_groups}); use tick='eager'")
    for field, wrong in (("kv_layout", plan.kv_layout != "exact"), ("warm_start", plan.warm_start)):
        if wrong:
            raise RdepthError(f"engine: tick {name!r} runs the exact layout without warm start; "
                              f"{field} asks otherwise (use tick='eager')")
    policy = getattr(plan.controller, "policy", None)
    if policy is not None and not policy(0).one_call:
        raise RdepthError(f"engine: tick {name!r} runs rules that decide rows at any steps in one call "
                          f"(such as step_norm_rel, kl, learned); {policy(0).name} does not (use tick='eager')")


class _StaticStore:
    """Keys/values of one static call: every slot writes its key at its position into its step's slot and
    the later ones (write-through, so a row that leaves its loop early leaves its last key in the later
    slots: the latest-KV rule) and reads its step's slot over the whole capacity (the mask does the rest)."""

    def __init__(self, cache, steps: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 slot_numbers: torch.Tensor):
        self.cache, self.steps, self.positions, self.rows = cache, steps, positions, rows
        self.through = slot_numbers >= steps.view(-1, 1, 1, 1)  # (B, K, 1, 1): slots s..K of row b
        self.read = (steps - 1) * rows.shape[0] + rows  # row b's step slot among the K * B blocks

    def update(self, layer, ctx, keys, values):
        out = []
        for tensor, new in zip(self.cache.looped[layer], (keys, values), strict=True):
            new = new.squeeze(2).to(tensor.dtype)  # (B, nh, hs)
            column = tensor[:, self.rows, :, self.positions]  # (B, K, nh, hs)
            tensor[:, self.rows, :, self.positions] = torch.where(self.through, new[:, None], column)
            out.append(tensor.view(-1, *tensor.shape[2:]).index_select(0, self.read))  # (B, nh, S, hs)
        return tuple(out)


class _SingleStore:
    """Keys/values of a single-pass layer in one static call: every slot writes at its position ``positions``
    and reads its whole row (the mask does the rest: a view, no gather)."""

    def __init__(self, cache, positions: torch.Tensor, rows: torch.Tensor):
        self.cache, self.positions, self.rows = cache, positions, rows

    def update(self, layer, ctx, keys, values):
        for tensor, new in zip(self.cache.single[layer], (keys, values), strict=True):
            tensor[self.rows, :, self.positions] = new.squeeze(2).to(tensor.dtype)  # (B, nh, hs)
        return self.cache.single[layer]


class _StaticWalk(StageWalk):
    """The static tick's walk, taken twice a tick (:attr:`finishing`): first for the tokens in flight, whose
    pass starts at the group (the layers before it are skipped): one loop step, the rule, the hand-off, the
    layers after the group at their positions; then for the next tokens, whose pass ends entering the group
    (the layers after it are skipped): the layers before the group at the next positions, the input half and
    the initial states (:attr:`entered`)."""

    def __init__(self, tick: StaticTick, initial: torch.Tensor | None):
        super().__init__(tick.model)
        self.tick = tick
        self.initial = initial  # (B, capacity, d): each slot's request's initial states, or None (zeros)
        self.finishing = True
        self.passed = False  # whether this pass visited the group yet
        self.next_positions: torch.Tensor | None = None
        self.entered: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, finishing: bool, x):
        self.finishing, self.passed = finishing, False
        return self(x)

    def single(self, layers, x):
        if self.finishing != self.passed:  # the other token's layers
            return x
        positions = self.tick.positions if self.finishing else self.next_positions
        return self.model.run_layers(layers, x, self.tick.single_context(positions))

    def group(self, group, x):
        self.passed = True
        if self.finishing:
            return self.leave(group, self.tick.loop_step())
        self.entered = self.enter(group, x)
        return x

    def start(self, group, inputs):
        if self.initial is None:
            return torch.zeros_like(inputs)
        return self.initial[torch.arange(inputs.shape[0], device=inputs.device), self.next_positions]


@register_tick
class StaticTick(EagerTick):
    """The static tick (see the module): the slots' steps, positions and prompts on the device, and the one
    function a tick runs (``compiled``: through ``torch.compile``, :class:`CompiledTick`). Rows the host enters
    (admitted, or fed a token the device did not enter) go through the eager tick's walk up to the group."""

    name: ClassVar[str] = "static"
    compiled: ClassVar[bool] = False

    def __init__(self, model: RecurrentLM, plan: TickPlan):
        check_static(self.name, model, plan)
        if self.compiled and plan.device.type == "cpu" and not _cpu_compiler():
            raise RdepthError("engine: tick 'compiled' on the CPU needs a C++ compiler (g++ or the one "
                              "torch._inductor.config.cpp.cxx names); use tick='static' or 'eager'")
        super().__init__(model, plan)
        batch, device = plan.batch, plan.device
        self.rows = torch.arange(batch, device=device)
        self.steps = torch.ones(batch, dtype=torch.long, device=device)  # the step each row computes next
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.prompt = torch.zeros(batch, plan.capacity, dtype=torch.long, device=device)
        self.prompt_length = torch.zeros(batch, dtype=torch.long, device=device)
        kept = plan.k_max[0]
        self.slot_numbers = torch.arange(1, kept + 1, device=device).view(1, kept, 1, 1)
        cap = plan.capacity
        where = torch.arange(cap, device=device)
        self.masks = (where[None, :] <= where[:, None]).view(cap, 1, 1, cap)
        self.static_walk = _StaticWalk(self, self.initial.get(0))
        self.values = [1, kept]  # (more than one distinct step: the rule's one call for rows at any step)
        with torch.inference_mode():  # the tick's inputs as every later tick's are (no recompile at tick 2)
            self.state, self.projected = self.state.clone(), self.projected.clone()
        self.live = np.zeros(batch, dtype=bool)  # host: the occupied slots
        self.entered = np.zeros(batch, dtype=np.int64)  # host: the token the device entered per slot
        self.row_memory = plan.row_memory
        # inside a tick: its inputs, the loop's new states and which rows stopped (None between ticks)
        self._in_state = self._in_projected = self.new = self.done = None
        # (a code object of its own: dynamo's graphs, guards and recompile count are this tick's alone)
        self.code = _own_code(self._tick)
        self.function = torch.compile(self.code, dynamic=False) if self.compiled else self._tick

    def __call__(self, tick_input: TickInput) -> TickOutput:
        self._apply(tick_input)
        live = self.live
        occupied = int(live.sum())
        state, projected, decisions, logits = self.function(self.state, self.projected)
        self.state, self.projected = state, projected
        decisions = decisions.cpu().numpy()  # the tick's one host read: which rows stopped, argmax, token entered
        self.step_count[live] += 1
        rows = np.flatnonzero(live & (decisions[0] == 1))
        if not rows.size:
            return TickOutput.nothing(1, [occupied])
        self.current[rows, 0] = self.step_count[rows]
        self.step_count[rows] = 0
        self.entered[rows] = decisions[2][rows]  # the token the device entered for each (_apply compares)
        self.position[rows] += 1  # (the device moved them on; the host's next hand-over says the same)
        return TickOutput(rows, decisions[1][rows], self.current[rows].copy(), logits, rows, [occupied])

    def _apply(self, tick_input: TickInput) -> None:
        """The host's hand-over: slots emptied; requests admitted (their prompt on the device, their first
        token entered); tokens fed that the device did not enter itself (sampled ones) entered here, and the
        rule's memory of every fed row started afresh."""
        self.live[tick_input.retired] = False
        admitted = np.asarray([row for row, _ in tick_input.admitted], dtype=np.int64)
        for row, request in tick_input.admitted:
            draw_initial(self.model, self.initial, row, request)
            self.admit(row, request.prompt)
            self.live[row] = True
            self.entered[row] = -1  # (its first token: never the device's)
        rows, tokens, positions = tick_input.entering, tick_input.tokens, tick_input.positions
        if not rows.size:
            return
        other = tokens != self.entered[rows]
        if other.any():
            self._enter(rows[other], tokens[other], positions[other])
            self.walk.enter_rows(rows[other])
        fed = rows[~np.isin(rows, admitted)]
        if self.row_memory and fed.size:
            rows_t, _ = self._rows(fed)
            self.controller.begin_rows(0, rows_t, self.state[rows_t])

    def admit(self, row: int, prompt: list[int]) -> None:
        """Slot ``row`` takes a new request: its prompt, step 1, position 0."""
        self.prompt[row].zero_()
        self.prompt[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.prompt_length[row] = len(prompt)
        self.steps[row] = 1
        self.positions[row] = 0

    def single_context(self, positions: torch.Tensor) -> AttentionContext:
        """The context of a single-pass layer's call over every slot at ``positions``."""
        store = _SingleStore(self.slots.cache, positions, self.rows)
        return AttentionContext(store, 0, self.rows, positions, self.rows, 1, self.rows.shape[0],
                                self.masks.index_select(0, positions), one_per_row=True, elementwise=self.compiled)

    def loop_step(self) -> torch.Tensor:
        """One loop step of every slot at its step and position, and the rule; sets :attr:`new` (the loop's new
        states) and :attr:`done`; returns the states to hand on."""
        steps, positions, rows = self.steps, self.positions, self.rows
        store = _StaticStore(self.slots.cache, steps, positions, rows, self.slot_numbers)
        ctx = AttentionContext(store, 0, rows, positions, rows, 1, rows.shape[0],
                               self.masks.index_select(0, positions), one_per_row=True, elementwise=self.compiled)
        self.new = self.model.loop_step(0, self._in_state, self._in_projected, ctx)
        self.done, handoff, _ = self.controller.after_steps(0, steps, self.values, rows, self._in_state, self.new)
        return handoff

    def _tick(self, state: torch.Tensor, projected: torch.Tensor):
        model = self.model
        steps, positions = self.steps, self.positions
        self._in_state, self._in_projected = state, projected
        logits = model.readout(self.static_walk.run(True, None))
        done = self.done
        finite = torch.isfinite(logits).all(dim=-1)
        greedy = logits.argmax(dim=-1)
        following = (positions + 1).clamp(max=self.capacity - 1)  # (a free slot's garbage stays in range)
        in_prompt = positions + 1 < self.prompt_length
        token = torch.where(in_prompt, self.prompt.gather(1, following[:, None]).squeeze(1),
                            torch.where(finite, greedy, 0))
        self.static_walk.next_positions = following
        self.static_walk.run(False, model.embed(token, positions=following).to(state.dtype))
        start, entered = self.static_walk.entered
        stopped = done[:, None]
        self.steps.copy_(torch.where(done, 1, steps + 1))
        self.positions.copy_(torch.where(done, following, positions))
        decisions = torch.stack([done.long(), torch.where(finite, greedy, -1), token])
        new = self.new
        self._in_state = self._in_projected = self.new = self.done = None
        return torch.where(stopped, start, new), torch.where(stopped, entered, projected), decisions, logits


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
