"""The one token-by-token decoder: every path that extends a sequence a token at a time drives it.

``rdepth generate``, self-speculative decoding, the exported model's ``generate()`` and cached
``forward``, teacher-forced warm start, lm-eval's ``generate_until`` and the sweep's decode latencies run
:class:`Decoder`. It drives the model's pieces (``embed``, ``run_layers``, ``group_input`` once per
group, ``loop_step`` per step, ``readout``) over the one cache (:class:`~rdepth.model.kv.KVCache`, made
by the model), exact against teacher-forced evaluation (cached = teacher-forced = batch-of-one).

* **A plan per budget** (fixed counts per group, or a loop controller: per-token exits), built once and
  replayed for every token: pieces (``run``) and host checks (``check``). Each group's loop runs under
  the one loop routine (:class:`~rdepth.model.loop.LoopRows`), predicated: every row computes every step
  of a chunk of ``check_every`` steps, a stopped row keeps its hand-off, and the host reads one flag per
  chunk (none with ``check_every=None``, the default on CUDA). A budget below the cache's steps settles
  the keys it did not compute (the latest-KV rule, :meth:`KVCache.settle`).
* **An executor** (:mod:`rdepth.model.executors`, applied with :meth:`Decoder.use`) decides how the
  pieces run: eager reading the written prefix of the cache, the product's; the GPU benchmarks apply
  their own (masked whole-cache reads, Inductor-compiled pieces, CUDA graphs: ``bench/gpu/executors/``).
* **Several tokens at once** (:meth:`Decoder.extend`, ``T > 1`` at a fixed budget) run in lock-step
  under a causal mask, as the teacher-forced forward does; with warm start one by one, and with exits one
  by one unless asked for ``lockstep``: then the T positions loop together as packed rows, each stopping on
  its own, its key written through to the later step slots as it is computed (the latest-KV rule as it goes,
  :class:`~rdepth.model.kv.ThroughKV`), so that a verification under an exit rule is one pass
  (:mod:`rdepth.model.loop_speculation`).
* **Rollback** sets the cache length back; **warm start** starts each group's loop at position p from
  the state it handed on at p - 1 (kept per position: rollback keeps it right).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.budget import Budget, resolve_budget
from rdepth.model.control import FixedController, LoopController
from rdepth.model.executors.eager import Executor
from rdepth.model.kv import AttentionContext, ChunkKV, KVCache, ThroughKV
from rdepth.model.loop import LoopRows, run_fixed
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM
from rdepth.model.sampling import choose_tokens
from rdepth.model.walk import StageWalk

_Run = Callable[[], None]


@dataclass
class Plan:
    """One budget's token: its controller, the loop steps per group, its ``pieces`` (``("run", fn)`` or
    ``("check", skip_to)``) and per group the loop routine over the decoder's buffers."""

    budget: Budget
    controller: LoopController
    steps: tuple[int, ...]
    pieces: list[tuple[str, object]] = field(default_factory=list)
    loops: dict[int, LoopRows] = field(default_factory=dict)


class Decoder:
    """Decode ``batch_size`` rows a token at a time (see the module).

    Args:
        model: the model (left as it is).
        batch_size: rows B decoded together (prompts of equal length).
        loop_counts: the fixed budget per group (default: the model's eval counts).
        controller_factory: ``() -> LoopController`` for per-token exits (an exit policy's
            :class:`~rdepth.exits.controller.PolicyController`); a fresh controller per plan. Its
            decisions must be per row and free of host syncs (every built-in rule's are).
        noise: the initial loop states (:class:`StateNoise`, one id per row); default
            ``StateNoise(0, range(B))``.
        capacity: positions the cache holds (default: the block size).
        keep_steps: loop steps per group the cache keeps (default: the budget's); other budgets
            (:meth:`extend`'s ``loop_counts`` / ``controller_factory``) must fit under them.
        warm_start: each group's loop starts from the state it handed on at the previous position.
    """

    def __init__(self, model: RecurrentLM, batch_size: int, *, loop_counts: Sequence[int] | str | int | None = None,
                 controller_factory: Callable[[], LoopController] | None = None, noise: StateNoise | None = None,
                 capacity: int | None = None, keep_steps: int | Sequence[int] | None = None,
                 warm_start: bool = False):
        config = model.config
        parameter = next(model.parameters())
        self.model = model
        self.dtype, self.device = parameter.dtype, parameter.device
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RdepthError(f"decoder: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.capacity = capacity or config.block_size
        if not 1 <= self.capacity <= config.block_size:
            raise RdepthError(f"decoder: capacity must be 1..{config.block_size} (the block size), "
                              f"got {self.capacity}")
        self.budget = resolve_budget(model, loop_counts, controller_factory)
        self.steps = _kept_steps(model, self.budget, keep_steps)
        self.warm_start = bool(warm_start)
        if noise is None:
            noise = StateNoise(0, range(batch_size))
        if not isinstance(noise, StateNoise):
            raise RdepthError("decoder: noise must be a StateNoise (one sequence id per row)")
        if len(noise.sequence_ids) != batch_size:
            raise RdepthError(f"decoder: noise holds {len(noise.sequence_ids)} sequence ids for {batch_size} rows")
        self.noise = noise
        self.length = 0  # positions filled; the host counts them, never reads the device
        self.prompt_computed = self.prompt_used = None  # [G, B, T]: steps and hand-off of the last extend
        # How the pieces run (rdepth.model.executors): eager; a host check per step on the CPU, none on CUDA.
        self.executor = Executor(check_every=None if self.device.type == "cuda" else 1)
        with torch.no_grad():
            self.cache = model.new_cache(batch_size, self.capacity, self.steps, self.dtype, self.device)
            self._allocate()
            if model.rotary is not None:  # the angle table on the device now, never first inside a graph capture
                model.rotary.table(self.device)
        self.walk = _TokenWalk(self)  # a token's way through the stages, over the buffers
        self._plans: dict[Budget, Plan] = {}
        self._packed: dict[Budget, LoopController] = {}  # lock-step passes' controllers (exits)
        self.plan = self._plan_for(self.budget)

    def use(self, executor: Executor) -> Decoder:
        """Run the pieces through ``executor`` from now on (:mod:`rdepth.model.executors`): the plans are
        made again where its host checks differ. Returns the decoder."""
        changed = executor.check_every != self.executor.check_every
        self.executor = executor
        if changed:
            self._plans.clear()
            self.plan = self._plan_for(self.budget)
        executor.attach(self)
        return self

    # ---------------------------------------------------------------- buffers
    def _allocate(self) -> None:
        """Every tensor a token reads or hands between plan pieces, at a fixed address."""
        model, batch, device, d = self.model, self.batch_size, self.device, self.model.config.d_model
        n_groups = model.n_groups
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # input of step()
        self.logits = torch.zeros(batch, model.config.vocab_size, dtype=self.dtype, device=device)
        self.computed = torch.zeros(n_groups, batch, dtype=torch.long, device=device)  # last token's steps
        self.used = torch.zeros(n_groups, batch, dtype=torch.long, device=device)  # iterate handed on
        self._x = torch.zeros(batch, d, dtype=self.dtype, device=device)  # activations between pieces
        self.inputs = torch.zeros_like(self._x)  # the group's input half W_e e
        self._state = torch.zeros_like(self._x)  # each row's newest iterate
        self._handed = torch.zeros_like(self._x)  # the state each stopped row hands on
        self._active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.rows = torch.arange(batch, device=device)
        self.contexts = self.attention_contexts()  # per loop step (0: single-pass layers)
        # Each group's initial states for every position, [B, S, d] (the teacher-forced path's draws).
        self._initial: dict[int, torch.Tensor] = {}
        if n_groups and model.config.init_state_scale != 0:
            blank = torch.zeros(batch, self.capacity, d, dtype=self.dtype, device=device)
            for group in range(n_groups):
                self._initial[group] = model.init_state(group, blank, self.noise, 0)
        # Warm start: the state each group handed on at every position, [B, S, d].
        self._warm = {group: torch.zeros(batch, self.capacity, d, dtype=self.dtype, device=device)
                      for group in range(n_groups)} if self.warm_start else {}

    def attention_contexts(self, mask: torch.Tensor | None = None) -> dict[int, AttentionContext]:
        """Per loop step (0: single-pass layers), a token's attention over the cache: one query per row at
        the current position, reading what :attr:`KVCache.limit` leaves (``mask``: an additive mask
        ``[B, 1, 1, S]`` over those S positions, for an executor that reads more than is written)."""
        return {step: AttentionContext(self.cache, step, self.rows, self.cache.position.expand(self.batch_size),
                                       torch.zeros_like(self.rows), 1, self.batch_size, mask, one_per_row=True)
                for step in range(max(self.steps, default=0) + 1)}

    # ------------------------------------------------------------- the plans
    def _plan_for(self, budget: Budget) -> Plan:
        if budget not in self._plans:
            controller = FixedController(budget.counts) if budget.fixed else budget.controller_factory()
            steps = tuple(controller.max_steps(group) for group in range(self.model.n_groups))
            for group, (n, cap) in enumerate(zip(steps, self.steps, strict=True)):
                if not 1 <= n <= cap:
                    raise RdepthError(f"decoder: group {group} would run {n} loop steps; the cache keeps {cap}")
            plan = Plan(budget, controller, steps)
            plan.pieces = self._build_pieces(plan)
            self._plans[budget] = plan
        return self._plans[budget]

    def _build_pieces(self, plan: Plan) -> list[tuple[str, object]]:
        """A token as ``("run", fn)`` pieces and ``("check", skip_to)`` points (one host read each, skipping
        the group's remaining chunks when no row loops): the stage walk run once, at plan time."""
        made = _PlanWalk(self, plan)(_Pieces([], [self._begin_token]))
        made.pending.append(self._end_token)
        made.pieces.append(("run", _sequence(made.pending)))
        return made.pieces

    # ------------------------------------------------------------- the pieces
    def _begin_token(self) -> None:
        x = self.model.embed(self.tokens, positions=self.cache.position)  # (B, 1, d), the position on the device
        self._x.copy_(x.view(self.batch_size, -1))
        self.executor.begin_token(self)

    def _begin_group(self, plan: Plan, group: int) -> None:
        """The group's input half and each row's initial state (:class:`_TokenWalk`); the loop routine starts."""
        state, projected = self.walk.enter(group, self._x)
        self.inputs.copy_(projected)
        plan.loops[group].begin(state)

    def _steps(self, plan: Plan, group: int, steps: range) -> None:
        """Loop steps ``steps`` of ``group`` for every row, predicated on ``active`` (the loop routine's
        bookkeeping after each, :meth:`LoopRows.step_all`; inside the executor's step for a compiled one)."""
        state, loop, last = self._state, plan.loops[group], plan.steps[group]
        for step in steps:
            if plan.budget.fixed and step < last:  # a fixed budget: no row stops before its last step
                state = self.executor.loop_step(self, group, state, step)
            else:
                state = self.executor.exit_step(self, loop, step, state)
        self._state.copy_(state)

    def _end_group(self, plan: Plan, group: int) -> None:
        if not plan.budget.fixed or plan.steps[group] < self.steps[group]:
            self.cache.settle(group, self.computed[group])  # the latest-KV rule for the steps not run
        self._x.copy_(self.walk.leave(group, self._handed))
        if self.warm_start:
            self._warm[group].index_copy_(1, self.cache.position, self._handed.unsqueeze(1))

    def _end_token(self) -> None:
        self.logits.copy_(self.model.readout(self._x))
        self.cache.position.add_(1)

    def run_pieces(self, plan: Plan, graphs: list | None = None) -> None:
        """Run ``plan``'s pieces for one token (``graphs``: a CUDA graph per piece to replay instead)."""
        pieces, index = plan.pieces, 0
        while index < len(pieces):
            kind, item = pieces[index]
            if kind == "run":
                item() if graphs is None else graphs[index].replay()
                index += 1
            else:
                index = index + 1 if bool(self._active.any()) else item  # the one host read of a chunk

    # ------------------------------------------------------------- decoding
    def reset(self) -> None:
        """Start a new sequence (the cache's contents are overwritten as positions are written)."""
        self.rollback(0)

    def rollback(self, length: int) -> None:
        """Forget positions ``length`` and later: the next token is written at ``length``."""
        if not 0 <= length <= self.length:
            raise RdepthError(f"decoder: cannot roll back to {length}; {self.length} positions are filled")
        self.length = length
        self.cache.position.fill_(length)

    def attach(self, cache: KVCache, initial: dict[int, torch.Tensor], length: int) -> None:
        """Decode on ``cache`` from position ``length`` on (its positions before it written at the budgets this
        decoder runs), with the initial loop states ``initial`` (per group ``[B, capacity, d]``; none where the
        model starts its loops from zeros): a cache of this decoder's rows, capacity and steps whose tensors
        live elsewhere, such as one slot of the engine's (:meth:`KVCache.row`, the engine's speculation)."""
        if (cache.batch_size, cache.capacity, cache.steps) != (self.batch_size, self.capacity, self.steps):
            raise RdepthError(f"decoder: a cache of {cache.batch_size} rows, {cache.capacity} positions and steps "
                              f"{cache.steps} does not fit this decoder's {self.batch_size}, {self.capacity}, "
                              f"{self.steps}")
        if self.warm_start or set(initial) != set(self._initial):
            raise RdepthError("decoder: attach takes the initial states of every group the model draws (no warm "
                              "start)")
        self.cache, self._initial = cache, dict(initial)
        self.contexts = self.attention_contexts()
        self.length = length
        cache.position.fill_(length)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Start a new sequence with ``prompt`` ``[B, T]``; returns its logits ``[B, T, V]``."""
        self.reset()
        return self.extend(prompt)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, loop_counts: Sequence[int] | str | int | None = None,
               controller_factory: Callable[[], LoopController] | None = None, *, budget: Budget | None = None,
               lockstep: bool = False) -> torch.Tensor:
        """Append ``tokens`` ``[B, T]`` at the next positions; returns their logits ``[B, T, V]``.

        The budget is the decoder's own, or ``loop_counts`` / ``controller_factory`` (or a resolved
        ``budget``) for this call (at most the cache's steps per group). At a fixed budget without warm
        start the T positions run in lock-step in one pass; under exits too with ``lockstep`` (packed rows,
        each position's own exits: the same decisions, keys and logits as one at a time, to rounding);
        otherwise one at a time. ``computed``/``used`` ``[G, B]`` then hold the last position's loop steps
        and hand-off index, ``prompt_computed`` / ``prompt_used`` ``[G, B, T]`` every position's."""
        if budget is None:
            budget = resolve_budget(self.model, loop_counts, controller_factory, self.budget)
        elif loop_counts is not None or controller_factory is not None:
            raise RdepthError("decoder: give a budget or loop_counts / controller_factory, not both")
        tokens = tokens.to(self.device)
        batch, length = tokens.shape
        if batch != self.batch_size:
            raise RdepthError(f"decoder holds {self.batch_size} rows; the input has {batch}")
        if length < 1:
            raise RdepthError("decoder: nothing to extend with (0 tokens)")
        if self.length + length > self.capacity:
            raise RdepthError(f"decoder: {self.length} + {length} positions exceed the capacity {self.capacity} "
                              "(the model's context)")
        if length == 1 or not (budget.fixed or lockstep) or self.warm_start:
            logits, computed, used = [], [], []
            for t in range(length):
                self._advance(tokens[:, t:t + 1], budget)
                logits.append(self.logits.clone())
                computed.append(self.computed.clone())
                used.append(self.used.clone())
            self.prompt_computed, self.prompt_used = torch.stack(computed, dim=2), torch.stack(used, dim=2)
            return torch.stack(logits, dim=1)
        return self._extend_parallel(tokens, budget)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, budget: Budget | None = None) -> torch.Tensor:
        """Decode ``tokens`` ``[B, 1]`` at the next position at the decoder's budget (or ``budget``, within the
        cache's steps); returns logits ``[B, V]`` (a copy). ``computed``/``used`` ``[G, B]`` hold each row's
        steps and hand-off index."""
        self._advance(tokens, budget or self.budget)
        return self.logits.clone()

    @torch.no_grad()
    def _advance(self, tokens: torch.Tensor, budget: Budget | None = None) -> None:
        """One position for every row: ``tokens`` ``[B, 1]``; the logits land in ``logits``."""
        if self.length >= self.capacity:
            raise RdepthError(f"decoder: the cache is full ({self.capacity} positions)")
        plan = self._plan_for(budget or self.budget)
        self.tokens.copy_(tokens)
        self.executor.run_token(self, plan)
        self.length += 1

    def _extend_parallel(self, tokens: torch.Tensor, budget: Budget) -> torch.Tensor:
        """T positions in lock-step (the teacher-forced computation over the cache): at a fixed budget, or
        under the budget's plan's controller as packed rows."""
        batch, length = tokens.shape
        start, end = self.length, self.length + length
        x = self.model.embed(tokens, start).reshape(batch * length, -1).to(self.dtype)  # rows by batch then time
        controller = None if budget.fixed else self._packed_controller(budget)
        walk = _PromptWalk(self, start, end, budget.counts, controller)
        x = walk(x)
        logits = self.model.readout(x).view(batch, length, -1)
        self.logits.copy_(logits[:, -1])
        self.length = end
        self.cache.position.fill_(end)
        if controller is None:
            self.prompt_computed = self.prompt_used = self.computed[:, :, None].expand(-1, -1, length).clone()
        else:
            self.prompt_computed, self.prompt_used = torch.stack(walk.computed), torch.stack(walk.used)
        return logits

    def _packed_controller(self, budget: Budget) -> LoopController:
        """The controller of lock-step passes under an exit budget: made once per budget, apart from the
        plan's (whose per-row memory an executor's captured pieces may hold)."""
        if budget not in self._packed:
            self._plan_for(budget)  # its steps checked against the cache's
            self._packed[budget] = budget.controller_factory()
        return self._packed[budget]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, rng: torch.Generator | None = None) -> torch.Tensor:
        """``prompt`` ``[B, T0]`` extended by up to ``max_new_tokens`` tokens (fewer where the capacity
        ends), chosen by :func:`choose_tokens` on the device (sampling from ``rng``); ``[B, T0 + n]``."""
        prompt = prompt.to(self.device)
        if max_new_tokens < 1:
            return prompt
        logits = self.prefill(prompt)[:, -1]
        chosen = [choose_tokens(logits, temperature, top_k, rng)]
        for _ in range(max_new_tokens - 1):
            if self.length >= self.capacity:
                break
            self._advance(chosen[-1])
            chosen.append(choose_tokens(self.logits, temperature, top_k, rng))
        return torch.cat([prompt, *chosen], dim=1)


@dataclass
class _Pieces:
    """A plan's pieces as the plan walk makes them: ``pieces`` done, ``pending`` runs not yet in a piece."""

    pieces: list[tuple[str, object]]
    pending: list[_Run]


class _TokenWalk(StageWalk):
    """One token of every row over the decoder's buffers: rows enter a group at the cache's position with
    their own request's initial state there (warm start: the state handed on at the previous position)."""

    def __init__(self, decoder: Decoder):
        super().__init__(decoder.model)
        self.decoder = decoder

    def start(self, group, inputs):
        decoder = self.decoder
        state, position = decoder._state, decoder.cache.position
        if decoder.warm_start and decoder.length > 0:
            state.copy_(decoder._warm[group].index_select(1, position - 1).squeeze(1))
        elif group in decoder._initial:
            state.copy_(decoder._initial[group].index_select(1, position).squeeze(1))
        else:
            state.zero_()
        return state


class _PlanWalk(StageWalk):
    """The walk a plan is made by, once: visiting a stage appends the pieces that run it for a token (the
    walk's ``x`` is the :class:`_Pieces` made so far). A group is entered, looped in chunks of
    ``check_every`` steps with a host check between them, and left."""

    def __init__(self, decoder: Decoder, plan: Plan):
        super().__init__(decoder.model)
        self.decoder, self.plan = decoder, plan

    def single(self, layers, made: _Pieces) -> _Pieces:
        decoder = self.decoder
        made.pending.append(lambda: decoder._x.copy_(decoder.executor.run_layers(decoder, layers, decoder._x)))
        return made

    def group(self, group, made: _Pieces) -> _Pieces:
        decoder, plan = self.decoder, self.plan
        last = plan.steps[group]
        plan.loops[group] = LoopRows(plan.controller, group, decoder._state,
                                     (decoder._handed, decoder.computed[group], decoder.used[group], decoder._active))
        made.pending.append(lambda: decoder._begin_group(plan, group))
        every = last if plan.budget.fixed else (decoder.executor.check_every or last)
        chunks = [range(first, min(first + every, last + 1)) for first in range(1, last + 1, every)]
        pieces = made.pieces
        pieces.append(("run", _sequence(made.pending)))
        checks = []
        for number, chunk in enumerate(chunks):
            pieces.append(("run", lambda chunk=chunk: decoder._steps(plan, group, chunk)))
            if number < len(chunks) - 1:
                checks.append(len(pieces))
                pieces.append(("check", None))
        for index in checks:
            pieces[index] = ("check", len(pieces))
        made.pending = [lambda: decoder._end_group(plan, group)]
        return made


class _PromptWalk(StageWalk):
    """Positions ``start..end - 1`` of every row at fixed ``counts`` in lock-step over the cache, under a
    causal mask (the decoder's prompt: the teacher-forced computation); rows by batch then time. With a
    ``controller`` each group's loop runs the loop routine over the rows still looping (packed: a stopped
    row computes nothing more), their keys written through to the later step slots (:class:`ThroughKV`);
    ``computed`` / ``used`` then hold per group ``[B, T]``."""

    def __init__(self, decoder: Decoder, start: int, end: int, counts: tuple[int, ...] | None,
                 controller: LoopController | None = None):
        super().__init__(decoder.model)
        self.decoder, self.span, self.counts, self.controller = decoder, slice(start, end), counts, controller
        self.through = None if controller is None else ThroughKV(decoder.cache, end)
        self.computed: list[torch.Tensor] = []
        self.used: list[torch.Tensor] = []
        batch, length, device = decoder.batch_size, end - start, decoder.device
        self.store = ChunkKV(decoder.cache, start, end)
        self.batch_index = torch.arange(batch, device=device).repeat_interleave(length)
        self.slot_index = torch.arange(length, device=device).repeat(batch)
        self.position = start + self.slot_index
        key_positions = torch.arange(end, device=device)
        self.mask = (key_positions[None, :] <= torch.arange(start, end, device=device)[:, None]).view(
            1, 1, length, end)
        self.length, self.batch = length, batch

    def context(self, step):
        return AttentionContext(self.store, step, self.batch_index, self.position, self.slot_index, self.length,
                                self.batch, self.mask)

    def start(self, group, inputs):
        initial = self.decoder._initial
        return initial[group][:, self.span].reshape(inputs.shape) if group in initial else torch.zeros_like(inputs)

    def loop(self, group, state, projected):
        if self.controller is not None:
            return self._loop_rows(group, state, projected)
        decoder, count = self.decoder, self.counts[group]
        state = run_fixed(state, count, lambda state, step: self.model.loop_step(group, state, projected,
                                                                                 self.context(step)))
        if count < decoder.steps[group]:
            decoder.cache.settle_all(group, count, self.span)
        decoder.computed[group].fill_(count)
        decoder.used[group].fill_(count)
        return state

    def _loop_rows(self, group, state, projected):
        """The group's loop under the controller, each step over the rows still looping."""
        loop = LoopRows(self.controller, group, state)

        def step_fn(prev, step, rows):
            ctx = AttentionContext.build(self.through, step, self.batch_index[rows], self.position[rows])
            return self.model.loop_step(group, prev, projected[rows], ctx)

        loop.run(state, step_fn)
        computed, used = loop.computed.view(self.batch, self.length), loop.used.view(self.batch, self.length)
        self.computed.append(computed)
        self.used.append(used)
        self.decoder.computed[group].copy_(computed[:, -1])
        self.decoder.used[group].copy_(used[:, -1])
        return loop.handed_on


def _sequence(pieces: list[_Run]) -> _Run:
    """One plan piece running ``pieces`` in order."""
    pieces = list(pieces)

    def run() -> None:
        for piece in pieces:
            piece()

    return run


def _kept_steps(model: RecurrentLM, budget: Budget, keep_steps) -> tuple[int, ...]:
    """The loop steps the cache keeps per group: ``keep_steps``, at least the budget's (its default)."""
    controller = budget.controller_factory() if not budget.fixed else FixedController(budget.counts)
    steps = tuple(controller.max_steps(group) for group in range(model.n_groups))
    if keep_steps is None:
        return steps
    keep = parse_loop_counts(keep_steps, model.n_groups) if model.n_groups else ()
    if any(k < n for k, n in zip(keep, steps, strict=True)):
        raise RdepthError(f"decoder: keep_steps {keep} is below the budget's steps {steps}")
    return tuple(keep)
