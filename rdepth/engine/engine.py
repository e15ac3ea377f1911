"""Continuous depth batching: many requests decoded at once, each row at its own position and loop step.

The lock-step :class:`~rdepth.model.decoder.Decoder` runs a batch's rows through every loop step until the
last row stops, so a batch pays for its slowest token at every position. The loop's weights are the same at
every step, so rows at different steps (and positions) can share one batched call instead. :class:`Engine`
holds ``batch_size`` slots; each :meth:`Engine.step` (a *tick*) is three calls over data objects:

* **schedule** (:class:`~rdepth.engine.scheduler.Scheduler`, the host): free slots filled from the queue, and
  a :class:`~rdepth.engine.tick.TickInput`: the slots emptied, the requests admitted, the tokens entering;
* **tick** (a :class:`~rdepth.engine.tick.Tick` from the registry, :data:`~rdepth.engine.tick.TICKS`, which
  owns the device: the cache, the activations, the loop states, the rule's per-row memory): every occupied
  slot one loop step on, the rows whose loop ended handed on through the layers after it and read out; a
  :class:`~rdepth.engine.tick.TickOutput` back: ``eager`` (:mod:`rdepth.engine.eager`: each stage's rows in
  one call; ``token``: every loop to its exit within the tick, :mod:`rdepth.engine.token`), ``static`` and
  ``compiled`` (:mod:`rdepth.engine.static`: every slot through one device function),
  ``graph`` and ``compiled-graph`` (:mod:`rdepth.engine.graph`: that function replayed as a CUDA graph);
* **update** (the scheduler again): each row read out recorded, its next token chosen, the request retired
  or its token fed.

A row's computation is the batch-1 decoder's, whatever shares the batch: its initial states are keyed by
request and position (never by slot), it reads only its own cache row, and the rule's memory is per row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from rdepth.engine.eager import EagerTick
from rdepth.engine.graph import CompiledGraphTick, GraphTick
from rdepth.engine.request import Finished, Request
from rdepth.engine.scheduler import EngineStats, Scheduler
from rdepth.engine.slots import KV_LAYOUTS
from rdepth.engine.speculation import Speculation, count_speculation, speculating_tick
from rdepth.engine.static import CompiledTick, StaticTick
from rdepth.engine.tick import TICKS, TickPlan, make_tick, runs_ahead
from rdepth.engine.token import TokenTick
from rdepth.errors import RdepthError
from rdepth.model.budget import resolve_budget
from rdepth.model.control import FixedController, RowController
from rdepth.model.recurrent import RecurrentLM

__all__ = ["Engine", "EngineBase", "EngineStats"]

_BUILT_IN = (EagerTick, TokenTick, StaticTick, CompiledTick, GraphTick, CompiledGraphTick)  # (each registers itself in TICKS as its module is imported)


def _make_controller(model: RecurrentLM, loop_counts, controller_factory) -> tuple[RowController, bool]:
    """The engine's one loop controller and whether it is a fixed budget; refuses one that cannot serve rows
    at different steps."""
    budget = resolve_budget(model, loop_counts, controller_factory)  # the one decoder's reading of the two
    controller = FixedController(budget.counts) if budget.fixed else budget.controller_factory()
    if not isinstance(controller, RowController):
        missing = [name for name in ("max_steps", "begin", "begin_rows", "after_steps") if not hasattr(controller, name)]
        raise RdepthError(f"engine: the loop controller {type(controller).__name__} has no "
                          f"{', '.join(f'{name}()' for name in missing)} (rows that loop at different steps need it)")
    return controller, budget.fixed


def _named_rules(rules, model: RecurrentLM, k_max: list[int]) -> tuple[tuple[str, RowController], ...]:
    """The exit rules requests may ask for by name, each built once (its factory called) and checked: it serves
    rows at different steps, at the engine's caps."""
    named = []
    for name, factory in (rules or {}).items():
        controller = factory()
        if not isinstance(controller, RowController):
            raise RdepthError(f"engine: the rule {name!r} is not a loop controller that serves rows at different steps")
        caps = [int(controller.max_steps(group)) for group in range(model.n_groups)]
        if caps != list(k_max):
            raise RdepthError(f"engine: the rule {name!r} caps its loops at {caps}; the engine's are {k_max} (a "
                              "request's own k_max caps it lower)")
        named.append((str(name), controller))
    return tuple(named)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RdepthError(f"engine: {name} must be an integer >= 1, got {value!r}")


def _check_arguments(batch_size, tick, ahead, kv_layout, both_budgets: bool) -> None:
    """One-line errors for the engine's arguments that need no model."""
    _positive("batch_size", batch_size)
    if tick not in TICKS:
        raise RdepthError(f"engine: tick must be one of {', '.join(TICKS)}, got {tick!r}")
    _positive("ahead", ahead)
    if ahead > 1 and not runs_ahead(tick):
        ahead_ticks = ", ".join(name for name in TICKS if runs_ahead(name))
        raise RdepthError(f"engine: tick {tick!r} reads the device after every tick (ahead > 1 needs one of "
                          f"{ahead_ticks})")
    if kv_layout not in KV_LAYOUTS:
        raise RdepthError(f"engine: kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    if both_budgets:
        raise RdepthError("engine: give loop_counts or controller_factory, not both")


class EngineBase:
    """The client side of an engine (the queue, cancellation, ticks, the finished requests) over a
    :class:`~rdepth.engine.scheduler.Scheduler` and a :class:`~rdepth.engine.tick.Tick`: :class:`Engine` builds
    them for rdepth's model, :class:`rdepth.looped.engine.LoopedEngine` for a looped ``transformers`` model."""

    def __init__(self, scheduler: Scheduler, tick, batch: int, capacity: int, kv_layout: str = "exact"):
        self.scheduler, self.tick = scheduler, tick
        self.batch, self.capacity, self.kv_layout = batch, capacity, kv_layout

    # ------------------------------------------------------------------ clients
    def add_request(self, request: Request) -> int:
        """Queue ``request``; returns its id (the order of arrival). A depth the engine cannot serve (a rule it
        was not built with, more steps than its caps, a threshold the rule refuses) is a one-line error."""
        if not isinstance(request, Request):
            raise RdepthError(f"engine: add_request takes a Request, got {type(request).__name__}")
        if request.depth is not None:
            self._check_depth(request.depth)
        return self.scheduler.add(request)

    def _check_depth(self, depth) -> None:
        raise RdepthError("engine: a request brings a depth of its own; this engine runs its own budget only")

    def pending(self) -> bool:
        """Whether a request is queued or in flight."""
        return self.scheduler.pending()

    def cancel(self, request_id: int) -> None:
        """End request ``request_id`` (queued or in flight) at the start of the next tick, ``finish_reason``
        "cancelled" (a client gone, or a stop string matched outside the engine): its slot goes to a waiting
        request in that tick; unknown or finished ids are ignored."""
        self.scheduler.cancelled.add(int(request_id))

    def in_flight(self) -> int:
        return self.scheduler.in_flight()

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def live(self) -> list:
        return self.scheduler.live

    @property
    def queue(self):
        return self.scheduler.queue

    @property
    def listener(self):
        """The per-token callback (see the class); a server sets it after building the engine."""
        return self.scheduler.listener

    @listener.setter
    def listener(self, listener) -> None:
        self.scheduler.listener = listener

    def run(self) -> Iterator[Finished]:
        """Tick until every queued request has finished, yielding each as it finishes."""
        while self.pending():
            yield from self.step()

    def kv_bytes_per_token(self) -> int:
        """Key/value bytes one position of one request takes (every layer, every kept loop step)."""
        return self.tick.kv_bytes_per_token()

    # ------------------------------------------------------------------ a tick
    def step(self) -> list[Finished]:
        """One tick: schedule, tick, update (see the module); returns the requests that finished in it.

        The tick runs in inference mode (no autograd bookkeeping on any kernel: about a fifth of a small
        model's tick on the CPU); what it hands back (kept logits) is copied out of it, so a client may
        use it anywhere."""
        scheduler = self.scheduler
        with torch.inference_mode():
            finished = scheduler.admit() if scheduler.queue or scheduler.cancelled else []
            occupied = scheduler.in_flight()
            if occupied:
                scheduler.count_tick(occupied)
                output = self.tick(scheduler.schedule())
                if output.speculation is not None:  # (rounds: their later readouts follow, in the same tick)
                    count_speculation(scheduler.stats, output.speculation)
                    scheduler.count_rounds(output.speculation)  # (each request's own, before any retires)
                finished += scheduler.update(output)
                for later in output.following:  # (a call that ran ahead: each later tick read in turn)
                    if output.speculation is None:
                        scheduler.count_tick(occupied)
                    finished += scheduler.update(later)
        for result in finished:
            if result.logits is not None:
                result.logits = result.logits.clone()  # outside inference mode: an ordinary tensor
        return finished


class Engine(EngineBase):
    """Continuous depth batching over ``batch_size`` slots (see the module).

    Args:
        model: the model (left as it is; run in eval mode).
        batch_size: slots B (rows decoded together).
        loop_counts: a fixed budget per group (default: the model's eval loops), or
        controller_factory: ``() -> RowController`` (an exit policy's
            :class:`~rdepth.exits.controller.PolicyController`, or :class:`FixedController`); one controller
            serves every slot, its memory per row.
        capacity: positions each slot holds (default: the block size); a request needs its prompt and the
            tokens fed back to fit.
        kv_layout: a name in :data:`~rdepth.engine.slots.KV_LAYOUTS` (``"exact"``, the default, or ``"shared"``).
        warm_start: each group's loop starts from the state the row handed on at its previous position.
        clock: the time source of the latency figures.
        listener: ``listener(request_id, token, steps, rules, logprob)`` called for every new token as it is
            chosen (``steps``/``rules``: the loop steps and stop reason per group of the position that chose it;
            ``logprob``: its :class:`~rdepth.engine.request.TokenLogprob` where the request asks for logprobs,
            else None; streaming servers); it must not call the engine.
        tick: a name in :data:`~rdepth.engine.tick.TICKS`: ``"eager"`` (default: each tick computes what each
            row needs), ``"token"`` (the eager tick with every loop run to its exit within the tick: each row a
            whole token a tick, :mod:`rdepth.engine.token`), ``"static"`` (every slot through one device function a tick, rows predicated: a model
            with any looped groups, a rule that decides rows at any steps in one call), ``"compiled"`` (that
            function through ``torch.compile``), ``"graph"`` or ``"compiled-graph"`` (either function recorded
            as a CUDA graph when the engine is built and replayed every tick: a card only,
            :mod:`rdepth.engine.graph`).
        rules: the exit rules a request may ask for by name (``Request(depth=Depth(rule=NAME, tau=X, k_max=N))``),
            ``name -> () -> RowController`` at the engine's caps; each row then runs its own request's budget or
            rule, in the same batch.
        own_depths: requests may bring a depth of their own (``Depth(loops=N)``, or a rule of ``rules``, which
            turns it on); off, the ticks run the engine's controller alone (no per-row choice to pay for).
        ahead: the most ticks one call of a static or compiled tick runs before the host reads the device
            (default 1). Above 1 the device chooses and enters every row's next token itself for that many
            ticks, and the host reads their outputs in one go: it runs ahead only while every request in a slot
            decodes greedily and no rule keeps per-row memory (else one tick a call); a request that ends in
            the first of those ticks leaves its slot idle until the call returns (its later outputs dropped).
        speculate: loop speculation (:mod:`rdepth.engine.speculation`, the eager tick): K drafts a round at
            ``draft_loops`` loop steps per group (or the exit rule capped there), verified at the engine's budget
            in one pass on the slot's own cache row, for a greedy request past its prompt while at most
            ``speculate_at_most`` slots are occupied (default 1: a request alone); otherwise plain ticks.
    """

    def __init__(self, model: RecurrentLM, batch_size: int, *, loop_counts: Sequence[int] | str | int | None = None,
                 controller_factory: Callable[[], RowController] | None = None, capacity: int | None = None,
                 kv_layout: str = "exact", warm_start: bool = False, clock: Callable[[], float] = time.perf_counter,
                 listener: Callable[..., None] | None = None, tick: str = "eager",
                 rules: Mapping[str, Callable[[], RowController]] | None = None, own_depths: bool = False,
                 ahead: int = 1, speculate: int | None = None, draft_loops: Sequence[int] | int | str = 1,
                 speculate_at_most: int = 1):
        _check_arguments(batch_size, tick, ahead, kv_layout, loop_counts is not None and controller_factory is not None)
        config = model.config
        parameter = next(model.parameters())
        self.model = model
        capacity = capacity or config.block_size
        if not 1 <= capacity <= config.block_size:
            raise RdepthError(f"engine: capacity must be 1..{config.block_size} (the block size), got {capacity}")
        controller, fixed = _make_controller(model, loop_counts, controller_factory)
        self.k_max = [int(controller.max_steps(group)) for group in range(model.n_groups)]
        if any(k < 1 for k in self.k_max):
            raise RdepthError(f"engine: every group needs at least one loop step, got {self.k_max}")
        named = _named_rules(rules, model, self.k_max)
        self.plan = TickPlan(batch_size, capacity, controller, fixed, tuple(self.k_max), kv_layout,
                             bool(warm_start), parameter.dtype, parameter.device, named, bool(own_depths or named),
                             ahead)
        scheduler = Scheduler(batch_size, capacity, model.n_groups, self.k_max, fixed, parameter.device, clock,
                              listener)
        # (loop speculation's settings; None: no rounds, and every result counts none)
        self.speculation = None if speculate is None else Speculation(speculate, draft_loops, speculate_at_most)
        if self.speculation is None:
            made = make_tick(tick, model, self.plan)
        else:  # (validated there: the eager tick and layout, no warm start, a draft below the engine's budget)
            made = speculating_tick(model, self.plan, tick, self.speculation, loop_counts, controller_factory)
        super().__init__(scheduler, made, batch_size, capacity, kv_layout)

    @property
    def controller(self) -> RowController:
        return self.plan.controller

    def _check_depth(self, depth) -> None:
        if not self.plan.own_depths:
            raise RdepthError("engine: a request brings a depth of its own; this engine runs its own budget only "
                              "(build it with own_depths=True, or rules=...)")
        most = min(self.k_max)
        asked = depth.loops if depth.loops is not None else depth.k_max
        if asked is not None and asked > most:
            raise RdepthError(f"engine: a request's depth asks for {asked} loop steps; this engine holds at most "
                              f"{most} (its caps {self.k_max})")
        if depth.rule is None:
            return
        names = [name for name, _ in self.plan.rules]
        if depth.rule not in names:
            raise RdepthError(f"engine: a request's depth asks for the exit rule {depth.rule!r}; this engine serves "
                              f"{', '.join(names) or 'no rule by name'}")
        policy = getattr(dict(self.plan.rules)[depth.rule], "policy", None)
        if depth.tau is not None and policy is not None:
            if not (policy(0).uses_tau and policy(0).per_row_tau):
                raise RdepthError(f"engine: the exit rule {depth.rule} takes no threshold per request")
            policy(0).checked_tau(depth.tau)
