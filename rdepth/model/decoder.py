"""The one token-by-token decoder: every path that extends a sequence a token at a time drives it.

``rdepth generate`` (sampling, greedy, exits, exit profiles, warm start), self-speculative decoding
(drafts, a verifying pass, rollback), the exported Hugging Face model's ``generate()``, lm-eval's
``generate_until``, and the decode latencies of the sweep and the benchmarks all run
:class:`Decoder`. It drives the model's pieces (``wte``/``wpe`` as :meth:`~RecurrentLM.embed`,
:meth:`~RecurrentLM.run_layers`, :meth:`~RecurrentLM.group_input` once per group and
:meth:`~RecurrentLM.loop_step` per loop step, :meth:`~RecurrentLM.readout`) over a preallocated
key/value cache (:class:`~rdepth.model.static_decode.StaticKV`), so that it is exact against
teacher-forced evaluation (cached = teacher-forced = batch-of-one, with exits and warm start) and
needs no second forward pass.

How a token runs:

* **A plan per budget.** A budget is a fixed loop count per group, or a loop controller (per-token
  exits, :mod:`rdepth.exits`). Each budget the decoder is asked for gets a plan: a list of pieces
  (``run``), compacted chunks (``compact``) and checks (``check``), built once and replayed for every
  token. A fixed budget below the cache's steps settles the keys it did not compute (the latest-KV
  rule, :meth:`StaticKV.settle`).
* **Exits.** At batch 1 with ``check_every=1`` (the default on the CPU), a group's loop asks the
  host after each step whether the row stopped (one read per step, no predication) and breaks:
  the steps it saves are wall time. Otherwise exits are predicated: every row computes every step
  of a chunk of ``check_every`` steps, a stopped row keeps its hand-off, and the host reads one flag
  per chunk (``check_every=None``: none at all). With ``compact``, the chunks after the first run
  on the rows still looping only (the active count read at the check): their keys/values are
  written in place in the cache by row index and attention reads the whole store, each query
  packed into its own row (no per-layer copies of any row's keys); under a third of the batch,
  copies of the rows' keys move fewer bytes than reading every row, and are read instead.
* **Prefix-only attention.** Eager, a token attends to the positions written so far only (a view of
  the cache's first ``length + 1`` positions, no mask): the work grows with the position, not the
  capacity. Captured as CUDA graphs or compiled, shapes must not change, so the whole cache is read
  under an additive mask made once per token.
* **Several tokens at once** (:meth:`Decoder.extend` with ``T > 1`` at a fixed budget: a prompt, a
  speculative verification): the T positions run in lock-step through the same pieces with a
  causal mask, as the teacher-forced forward does. With exits or warm start they run one by one.
* **Rollback** (:meth:`Decoder.rollback`): the cache length goes back; later positions are
  overwritten before anything reads them.
* **Warm start**: each group's loop at position p starts from the state it handed on at position
  p - 1 of the same row (kept per position, so rollback keeps it right); position 0 from noise.
* **Sampling** stays on the device (:func:`choose_tokens`: greedy, temperature, top-k).

The caller's model is left as it was found: its mode is not changed, and a ``dtype`` other than the
model's decodes a converted copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rdepth.config import COMPILE_MODES, parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.control import FixedController, LoopController
from rdepth.model.kv import AttentionContext
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM, StageKind
from rdepth.model.static_decode import GivenKV, StaticKV, StaticRows

# Graphs dynamo may compile per compiled function (its default is 8): with ``compile``, a decoder's
# pieces compile a few graphs per group and single-pass stage, and each decoder in a process adds its own.
RECOMPILE_LIMIT = 64

_Run = Callable[[], None]


def choose_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token per row, ``[B, 1]`` long, on the logits' device: the argmax when ``temperature``
    <= 0, else a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


@dataclass(frozen=True)
class Budget:
    """How long each group loops: ``counts`` (fixed) or a ``controller_factory`` (exits)."""

    counts: tuple[int, ...] | None = None
    controller_factory: Callable[[], LoopController] | None = None

    @property
    def fixed(self) -> bool:
        return self.controller_factory is None


class _Plan:
    """One budget's token: its pieces, its controller (exits) and the loop steps per group."""

    def __init__(self, budget: Budget, controller: LoopController, steps: tuple[int, ...]):
        self.budget = budget
        self.controller = controller
        self.steps = steps
        self.pieces: list[tuple[str, object]] = []
        self.host_exits = False


def cuda_conditional_nodes() -> bool:
    """Whether this torch can capture a CUDA-graph conditional node (``CUDAGraph.begin_capture_to_if_node``),
    which ``Decoder(conditional=True)`` needs on CUDA. No released torch had it up to 2.13 (checked on 2.11
    with CUDA and 2.13 on a CPU): the option raises there, and its CUDA tests skip."""
    return all(hasattr(torch.cuda.CUDAGraph, name)
               for name in ("get_currently_capturing_graph", "begin_capture_to_if_node"))


class Decoder:
    """Decode ``batch_size`` rows a token at a time (see the module).

    Args:
        model: the model (left as it is; see ``dtype``).
        batch_size: rows B decoded together (prompts of equal length).
        k_max: the most loop steps of each group (one value or one per group): a cap on the budget, and
            the budget when neither ``loop_counts`` nor ``controller_factory`` is given.
        dtype: weights and keys/values (e.g. ``torch.bfloat16``); a dtype other than the model's decodes
            a converted copy of it. None keeps the model's.
        loop_counts: the fixed budget per group (default: ``k_max``, else the model's eval counts).
        controller_factory: ``() -> LoopController`` for per-token exits (an exit policy's
            :class:`~rdepth.exits.controller.PolicyController`); a fresh controller per plan. Its
            decisions must be per row and free of host syncs (every built-in rule's are).
        noise: the initial loop states (:class:`StateNoise`, one id per row); default
            ``StateNoise(0, range(B))``.
        check_every: with exits, loop steps between two host checks whether a row still loops. At
            batch 1 with 1 (the default on the CPU), a row's loop breaks at its exit; None: never
            checked, every step predicated (no host read at all; the default on CUDA).
        capacity: positions the cache holds (default: the block size).
        keep_steps: loop steps per group the cache keeps (default: the budget's); other budgets
            (:meth:`extend`'s ``loop_counts`` / ``controller_factory``) must fit under them.
        warm_start: each group's loop starts from the state it handed on at the previous position.
        compact: with exits and ``check_every``, run each chunk after the first on the rows that still
            loop only (their states gathered and scattered back; their keys/values written in place in the
            cache by row index, read in place or, under a third of the batch, as copies); results are
            unchanged.
        buckets: with ``compact``, the row counts of a chunk: powers of two (True), exact (False), or
            powers of two once captured (None).
        compile: run the loop step with its exit rule, and each run of single-pass layers, through
            Inductor (``torch.compile(fullgraph=True)``): one compiled call per loop step.
        conditional: with exits, each loop step of a predicated chunk after a group's first runs only while
            some row still loops: once captured, a CUDA-graph conditional node decides on the device, so a
            batch stops at its slowest row's exit without a host check (``check_every=None``); eager on a
            CPU a host read per step decides; the same numbers as without it.
        span_buckets: read the cache's written span only, in fixed sizes, also when captured: attention
            reads the first ``n`` positions (under the mask) for the smallest ``n`` in ``span_buckets``,
            twice that, ... up to the capacity that holds the positions written so far; ``capture()``
            records one set of graphs per size that holds the next position (a shorter one, reached by a
            rollback, runs eagerly). None: graphs read the whole cache. Not with ``compile``
            (its pieces are compiled for the whole cache) nor ``prefix_attention``.
        compile_mode: Inductor's mode with ``compile``: ``default``, or ``max-autotune-no-cudagraphs``
            (matmul templates benchmarked while compiling, with elementwise work fused into their epilogues
            where that wins: fewer kernels per layer on a GPU, minutes of compiling).
        prefix_attention: read only the written positions (no mask); default: when eager (not ``compile``).
            False reads the whole cache under the additive mask, as captured graphs do (capture() switches
            to that).
        batch_quantile: with exits, q in (0, 1]: a group's loop stops for the whole batch once at most
            ``floor((1 - q) * B)`` of its rows still loop; those stragglers stop at that step and hand on
            their newest state (used index = the step). Opt-in (None: each row runs to its own exit);
            1.0 is the per-row behaviour. Rows then depend on their batch: no batch-of-one equality.
    """

    def __init__(self, model: RecurrentLM, batch_size: int, k_max: int | Sequence[int] | None = None,
                 dtype: torch.dtype | None = None, *, loop_counts: Sequence[int] | str | int | None = None,
                 controller_factory: Callable[[], LoopController] | None = None,
                 noise: StateNoise | None = None, check_every: int | None | str = "auto",
                 capacity: int | None = None, keep_steps: int | Sequence[int] | None = None,
                 warm_start: bool = False, compact: bool = False,
                 buckets: bool | None = None, compile: bool = False, prefix_attention: bool | None = None,
                 batch_quantile: float | None = None, compile_mode: str = "default", conditional: bool = False,
                 span_buckets: int | None = None):
        config = model.config
        parameter = next(model.parameters())
        if dtype is not None and dtype != parameter.dtype:
            model = copy.deepcopy(model).to(dtype)  # the caller's model stays as it was
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
        self.budget, first_steps, self.steps = _resolve_budget(model, k_max, loop_counts, controller_factory,
                                                               keep_steps)
        if check_every == "auto":
            check_every = 1 if self.device.type == "cpu" else None
        _check_options(controller_factory is not None, check_every, compact, compile, batch_quantile,
                       prefix_attention)
        if compile_mode not in COMPILE_MODES:
            raise RdepthError(f"decoder: compile_mode must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
        self.compile_mode = compile_mode
        if conditional and controller_factory is None:
            raise RdepthError("decoder: conditional=True needs exits (controller_factory)")
        if conditional and self.device.type == "cuda" and not cuda_conditional_nodes():
            raise RdepthError(f"decoder: conditional=True needs CUDA graph conditional nodes, which torch "
                              f"{torch.__version__} lacks")
        self.conditional = bool(conditional)
        if span_buckets is not None:
            if isinstance(span_buckets, bool) or not isinstance(span_buckets, int) or span_buckets < 1:
                raise RdepthError(f"decoder: span_buckets must be an int >= 1, got {span_buckets!r}")
            if compile or prefix_attention:
                raise RdepthError("decoder: span_buckets reads fixed spans under the mask; not with compile "
                                  "(pieces compiled for the whole cache) nor prefix_attention")
        self.span_buckets = span_buckets
        self.check_every = check_every
        self.compact = compact
        self.batch_quantile = batch_quantile
        # rows that may still loop once the others stopped (a host int: the threshold is fixed per decoder)
        self._stragglers = (int(math.floor((1 - batch_quantile) * batch_size + 1e-9))
                            if batch_quantile is not None else 0)
        self.buckets = buckets
        self.warm_start = bool(warm_start)
        self._count = batch_size  # rows still looping, as read at the last check (compact)
        self._counts_of: _Plan | None = None  # the fixed plan whose counts computed/used hold
        if noise is None:
            noise = StateNoise(0, range(batch_size))
        if not isinstance(noise, StateNoise):
            raise RdepthError("decoder: noise must be a StateNoise (one sequence id per row)")
        if len(noise.sequence_ids) != batch_size:
            raise RdepthError(f"decoder: noise holds {len(noise.sequence_ids)} sequence ids for {batch_size} rows")
        self.noise = noise
        self.length = 0  # positions filled; the host counts them, never reads the device
        self.prompt_computed: torch.Tensor | None = None  # [G, B, T] loop steps of the last extend's tokens
        # Eager decoding reads the written prefix of the cache only; graphs and compiled pieces need
        # fixed shapes (the whole cache under a mask).
        self._prefix = (not compile and span_buckets is None) if prefix_attention is None else bool(prefix_attention)
        self._span: int | None = None  # positions the attention reads now (None: the whole cache)
        self._span_contexts: dict[int | None, dict[int, AttentionContext]] = {}
        self._span_graphs: dict[int | None, list] = {}  # span_buckets: graphs per span
        with torch.no_grad():
            self.cache = StaticKV(model, batch_size, self.capacity, self.steps, self.dtype, self.device)
            self._allocate()
        self._compiled = self._compile() if compile else None
        self._plans: dict[Budget, _Plan] = {}
        self._plan = self._plan_for(self.budget)
        # per plan piece of the main budget: its graph ({rows: graph} for a compacted chunk)
        self._graphs: list | None = None

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
        self._inputs = torch.zeros_like(self._x)  # the group's input half W_e e
        self._state = torch.zeros_like(self._x)  # each row's newest iterate
        self._handed = torch.zeros_like(self._x)  # the state each stopped row hands on
        self._active = torch.zeros(batch, dtype=torch.bool, device=device)
        self._rows = torch.arange(batch, device=device)
        self._order = torch.arange(batch, device=device)  # compaction: looping rows first
        self._row_contexts: dict[tuple[int, int, int | None], AttentionContext] = {}
        self._key_positions = torch.arange(self.capacity, device=device)
        # The additive attention mask [B, 1, 1, S] (0: read, -inf: not yet written), refilled per token
        # when the whole cache is read (graphs, compiled pieces, compaction).
        self._mask = torch.zeros(batch, 1, 1, self.capacity, dtype=self.dtype, device=device)
        self._mask_open = torch.zeros((), dtype=self.dtype, device=device)
        self._mask_shut = torch.full((), float("-inf"), dtype=self.dtype, device=device)
        self._make_contexts()
        # Each group's initial states for every position, [B, S, d] (the teacher-forced path's draws).
        self._initial: dict[int, torch.Tensor] = {}
        if n_groups and model.config.init_state_scale != 0:
            blank = torch.zeros(batch, self.capacity, d, dtype=self.dtype, device=device)
            for group in range(n_groups):
                self._initial[group] = model.init_state(group, blank, self.noise, 0)
        # Warm start: the state each group handed on at every position, [B, S, d].
        self._warm = {group: torch.zeros(batch, self.capacity, d, dtype=self.dtype, device=device)
                      for group in range(n_groups)} if self.warm_start else {}

    def _make_contexts(self) -> None:
        """One attention context per loop step (0: single-pass layers), over every row, reading the whole
        cache (or, eager, its written prefix)."""
        self._span_contexts.clear()
        self._span = -1  # none yet
        self._use_span(None)

    def _use_span(self, span: int | None) -> None:
        """Attention reads the cache's first ``span`` positions (None: all) under the mask's same span."""
        if span == self._span:
            return
        self._span = span
        self.cache.limit = span
        if span not in self._span_contexts:
            batch = self.batch_size
            mask = None if self._prefix else self._span_mask()
            self._span_contexts[span] = {
                step: AttentionContext(self.cache, step, self._rows, self.cache.position.expand(batch),
                                       torch.zeros_like(self._rows), 1, batch, mask, one_per_row=True)
                for step in range(max(self.steps, default=0) + 1)
            }
        self._contexts = self._span_contexts[span]

    def _span_mask(self) -> torch.Tensor:
        """The additive mask over the positions read now (a view of ``_mask``)."""
        return self._mask if self._span is None else self._mask.narrow(3, 0, self._span)

    def _span_for(self, length: int) -> int | None:
        """The read span of a token at ``length`` positions written (itself included): the smallest
        bucket (``span_buckets`` doubled) that holds them, at most the capacity; None without buckets."""
        if self.span_buckets is None:
            return None
        span = self.span_buckets
        while span < length:
            span *= 2
        return min(span, self.capacity)

    def _spans(self) -> list[int | None]:
        """Every read span a token can take (``[None]`` without buckets)."""
        if self.span_buckets is None:
            return [None]
        spans, span = [], self.span_buckets
        while span < self.capacity:
            spans.append(span)
            span *= 2
        return spans + [self.capacity]

    # ------------------------------------------------------------- the plans
    def _plan_for(self, budget: Budget) -> _Plan:
        if budget not in self._plans:
            if budget.fixed:
                controller: LoopController = FixedController(budget.counts)
                steps = budget.counts
            else:
                controller = budget.controller_factory()
                steps = tuple(controller.max_steps(group) for group in range(self.model.n_groups))
            for group, (n, cap) in enumerate(zip(steps, self.steps)):
                if not 1 <= n <= cap:
                    raise RdepthError(f"decoder: group {group} would run {n} loop steps; the cache keeps {cap}")
            plan = _Plan(budget, controller, tuple(steps))
            plan.host_exits = (not budget.fixed and self.batch_size == 1 and self.check_every == 1
                               and not self.compact)
            plan.pieces = self._build_pieces(plan)
            self._plans[budget] = plan
        return self._plans[budget]

    def _build_pieces(self, plan: _Plan) -> list[tuple[str, object]]:
        """A token as ``("run", fn)`` pieces, ``("compact", fn(rows))`` chunks and ``("check", (group,
        skip_to))`` points (one host read each)."""
        pieces: list[tuple[str, object]] = []
        pending: list[_Run] = [self._begin_token]
        for stage in self.model.stages:
            if stage.kind is StageKind.SINGLE:
                pending.append(lambda layers=stage.layers: self._run_single(layers))
                continue
            group = stage.group
            if plan.budget.fixed:
                pending.append(lambda group=group: self._fixed_loop(plan, group))
                continue
            if plan.host_exits:
                pending.append(lambda group=group: self._host_loop(plan, group))
                continue
            pending.append(lambda group=group: self._begin_group(plan, group))
            pieces.append(("run", _sequence(pending)))
            last = plan.steps[group]
            every = self.check_every or last
            chunks = [range(first, min(first + every, last + 1)) for first in range(1, last + 1, every)]
            checks = []
            for number, chunk in enumerate(chunks):
                order = self.compact and number < len(chunks) - 1  # the next check compacts
                if self.compact and number > 0:  # every row loops in the first chunk
                    pieces.append(("compact", lambda rows, group=group, chunk=chunk, order=order:
                                   self._compact_steps(plan, group, chunk, rows, order)))
                else:
                    pieces.append(("run", lambda group=group, chunk=chunk, order=order:
                                   self._exit_steps(plan, group, chunk, order)))
                if number < len(chunks) - 1:
                    checks.append(len(pieces))
                    pieces.append(("check", None))
            for index in checks:  # a check skips the group's remaining chunks
                pieces[index] = ("check", (group, len(pieces)))
            pending = [lambda group=group: self._end_group(group)]
        pending.append(self._end_token)
        pieces.append(("run", _sequence(pending)))
        return pieces

    # ------------------------------------------------------------- the pieces
    def _begin_token(self) -> None:
        x = self.model.embed(self.tokens, positions=self.cache.position)  # (B, 1, d), the position on the device
        self._x.copy_(x.view(self.batch_size, -1))
        if not self._prefix:
            self._refresh_mask()

    def _refresh_mask(self) -> None:
        """``_mask`` for the current position, in place: 0 at the keys written so far and this token's,
        -inf after (what SDPA would make of the boolean mask ``key <= position``, at every call)."""
        readable = (self._key_positions <= self.cache.position).view(1, 1, 1, -1)  # (1, 1, 1, S)
        torch.where(readable.expand(self._mask.shape), self._mask_open, self._mask_shut, out=self._mask)

    def _run_single(self, layers: tuple[int, ...]) -> None:
        if self._compiled is None:
            self._x.copy_(self.model.run_layers(layers, self._x, self._contexts[0]))
        else:
            self._x.copy_(self._compiled["layers"](layers, self._x, *self._kv[layers, 0]))

    def _initial_state(self, group: int) -> torch.Tensor:
        """``[B, d]``: each row's initial state of ``group`` at the current position (warm: the state
        handed on at the previous position)."""
        if self.warm_start and self.length > 0:
            return self._warm[group].index_select(1, self.cache.position - 1).squeeze(1)
        if group not in self._initial:
            return torch.zeros_like(self._x)
        return self._initial[group].index_select(1, self.cache.position).squeeze(1)

    def _here(self) -> slice:
        """The current position as a host slice (eager pieces only: the host's count of the position)."""
        return slice(self.length, self.length + 1)

    def _hand_on(self, group: int, state: torch.Tensor) -> None:
        """``state`` ``[B, d]`` leaves the group: the next stage's input (and the warm start's memory)."""
        self._x.copy_(state)
        if self.warm_start:
            self._warm[group].index_copy_(1, self.cache.position, state.unsqueeze(1))

    def _loop_step(self, group: int, state: torch.Tensor, step: int) -> torch.Tensor:
        """Loop step ``step`` of ``group`` for every row: ``[B, d]`` -> ``[B, d]`` (compiled or eager)."""
        if self._compiled is None:
            return self.model.loop_step(group, state, self._inputs, self._contexts[step])
        return self._compiled["step"](group, state, self._inputs, *self._kv[self.model.group_layers[group], step])

    def _stepper(self, group: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """``(state, step) -> new`` for this token's loop of ``group``, its input half computed once
        (kept local when eager; in the static ``_inputs`` buffer for the compiled step)."""
        if self._compiled is None:
            projected = self.model.group_input(group, self._x)
            return lambda state, step: self.model.loop_step(group, state, projected, self._contexts[step])
        self._inputs.copy_(self.model.group_input(group, self._x))
        return lambda state, step: self._loop_step(group, state, step)

    def _fixed_loop(self, plan: _Plan, group: int) -> None:
        """Every row runs the budget's steps; the slots of steps it did not run take its last key.
        (``computed``/``used`` are set when the plan starts: they are the same for every token.)"""
        step_fn = self._stepper(group)
        state = self._initial_state(group)
        steps = plan.steps[group]
        for step in range(1, steps + 1):
            state = step_fn(state, step)
        if steps < self.steps[group]:
            self.cache.settle_all(group, steps, self._here())
        self._hand_on(group, state)

    def _host_loop(self, plan: _Plan, group: int) -> None:
        """Batch 1, eager: the loop breaks at the row's exit (one host read per step, nothing predicated)."""
        controller = plan.controller
        step_fn = self._stepper(group)
        state = self._initial_state(group)
        controller.begin(group, state)
        last = plan.steps[group]
        for step in range(1, last + 1):
            new = step_fn(state, step)
            done, handoff, used_now = controller.after_step(group, step, self._rows, state, new)
            if step == last or bool(done):  # the one host read of a step
                break
            state = new
        self.computed[group].fill_(step)
        self.used[group].copy_(used_now)
        if step < self.steps[group]:
            self.cache.settle_all(group, step, self._here())
        self._hand_on(group, handoff)

    def _begin_group(self, plan: _Plan, group: int) -> None:
        self._inputs.copy_(self.model.group_input(group, self._x))
        self._state.copy_(self._initial_state(group))
        self._handed.copy_(self._state)
        self._active.fill_(True)
        plan.controller.begin(group, self._state)

    def _exit_steps(self, plan: _Plan, group: int, steps: range, order: bool = False) -> None:
        """Loop steps ``steps`` of ``group`` for every row, predicated on ``active``: a stopped row keeps
        its hand-off, step count and used index; its later iterates and keys are never read. With
        ``conditional``, each step after the group's first runs only while some row still loops
        (:meth:`_while_looping`), its iterate written in place to ``_state``."""
        state = self._state
        for step in steps:
            if self.conditional and step > 1:
                if state is not self._state:
                    self._state.copy_(state)
                    state = self._state
                self._while_looping(lambda step=step: self._state.copy_(
                    self._exit_step(plan, group, step, self._state)))
            else:
                state = self._exit_step(plan, group, step, state)
        if state is not self._state:
            self._state.copy_(state)
        if order:
            self._order_rows()

    def _exit_step(self, plan: _Plan, group: int, step: int, state: torch.Tensor) -> torch.Tensor:
        """One predicated loop step of ``group`` with its exit rule; returns the new iterate ``[B, d]``."""
        if self._compiled is None or plan is not self._plan:
            new = self._loop_step(group, state, step)
            self._after_step(plan, group, step, state, new)
            return new
        # the step and the rule in one compiled call
        return self._compiled["step_check"](group, step, state, self._inputs,
                                            *self._kv[self.model.group_layers[group], step])

    def _while_looping(self, body: Callable[[], object]) -> None:
        """``body`` (a predicated loop step) only while some row still loops. Being captured into a CUDA
        graph: a conditional node whose predicate, ``active.any()``, the device evaluates at each replay
        (no host read). Eager on a card: ``body`` always runs (predicated, it changes nothing once every
        row stopped; a host read would cost more). Eager on a CPU: one host read decides."""
        looping = self._active.any()
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
                graph.begin_capture_to_if_node(looping)
                try:
                    body()
                finally:
                    graph.end_capture_to_conditional_node()
            else:
                body()
        elif bool(looping):
            body()

    def _after_step(self, plan: _Plan, group: int, step: int, state: torch.Tensor, new: torch.Tensor) -> None:
        """The exit rule after loop step ``step`` (``state`` -> ``new``, ``[B, d]``) and its predicated
        bookkeeping, in place: hand-off, used index and step count of the rows stopping now, ``active``."""
        computed, used, active, handed = self.computed[group], self.used[group], self._active, self._handed
        done, handoff, used_now = plan.controller.after_step(group, step, self._rows, state, new)
        done, handoff, used_now = self._quantile_stop(active, done, handoff, used_now, new, step)
        stopping = active if step == plan.steps[group] else active & done  # all stop at the last step
        torch.where(stopping[:, None], handoff.to(self.dtype), handed, out=handed)
        torch.where(stopping, used_now, used, out=used)
        computed.masked_fill_(active, step)
        active.masked_fill_(done, False)

    def _quantile_stop(self, active: torch.Tensor, done: torch.Tensor, handoff: torch.Tensor,
                       used_now: torch.Tensor, new: torch.Tensor, step: int):
        """The batch-quantile exit (``batch_quantile``): when at most ``_stragglers`` of the rows (``[R]``, every
        looping row among them) would loop on after this step, they stop too, handing on ``new`` (used index
        ``step``). On the device, no host read; without the option, the rule's decision as it is."""
        if self.batch_quantile is None or self._stragglers == 0:  # 0: only when none loops on (per row)
            return done, handoff, used_now
        still = active & ~done  # [R]: rows the rule keeps looping
        cut = still & (still.sum() <= self._stragglers)  # all of them, or none
        handoff = torch.where(cut[:, None], new.to(handoff.dtype), handoff)
        used_now = torch.where(cut, torch.full_like(used_now, step), used_now)
        return done | cut, handoff, used_now

    def _end_group(self, group: int) -> None:
        self.cache.settle(group, self.computed[group])
        self._hand_on(group, self._handed)

    def _end_token(self) -> None:
        self.logits.copy_(self.model.readout(self._x))
        self.cache.position.add_(1)

    # ------------------------------------------------------------ compaction
    def _order_rows(self) -> None:
        """``_order``: the rows still looping in row order, then the stopped ones (on the device)."""
        stopped = (~self._active).to(torch.uint8)  # 0 sorts first; stable: in row order
        self._order.copy_(torch.sort(stopped, stable=True).indices)

    def _rows_context(self, rows: int, step: int) -> AttentionContext:
        """The attention context of loop step ``step`` over the first ``rows`` rows of ``_order``, their
        keys/values written in place by row index. Attention reads whichever moves fewer bytes
        (:class:`StaticRows`): the whole store, each query packed into its own cache row (no copies;
        B rows read), or, when 3 * rows < B, copies of the rows (3 * rows read and written)."""
        key = (rows, step, self._span)
        if key not in self._row_contexts:
            picked = self._order[:rows]
            index = torch.arange(rows, device=self.device)
            mask = None if self._prefix else self._span_mask()
            if 3 * rows < self.batch_size:  # gathered: one query per row of the copies
                self._row_contexts[key] = AttentionContext(
                    StaticRows(self.cache, picked, gather=True), step, index, self.cache.position.expand(rows),
                    torch.zeros_like(index), 1, rows, None if mask is None else mask[:rows], one_per_row=True)
            else:  # indexed: the queries packed into their rows of the whole store
                self._row_contexts[key] = AttentionContext(
                    StaticRows(self.cache, picked), step, picked, self.cache.position.expand(rows),
                    torch.zeros_like(index), 1, self.batch_size, mask)
        return self._row_contexts[key]

    def _compact_steps(self, plan: _Plan, group: int, steps: range, rows: int, order: bool) -> None:
        """:meth:`_exit_steps` on the first ``rows`` rows of ``_order`` only (every looping row, then
        stopped rows as padding, which compute as predication has them compute): gather, run, scatter."""
        if rows == self.batch_size:
            self._exit_steps(plan, group, steps, order)
            return
        picked = self._order[:rows]
        computed, used = self.computed[group], self.used[group]
        state = self._state.index_select(0, picked)
        inputs = self._inputs.index_select(0, picked)
        handed = self._handed.index_select(0, picked)
        active = self._active.index_select(0, picked)
        row_computed, row_used = computed.index_select(0, picked), used.index_select(0, picked)
        last = plan.steps[group]
        for step in steps:
            new = self.model.loop_step(group, state, inputs, self._rows_context(rows, step))
            done, handoff, used_now = plan.controller.after_step(group, step, picked, state, new)
            done, handoff, used_now = self._quantile_stop(active, done, handoff, used_now, new, step)
            stopping = active if step == last else active & done
            handed = torch.where(stopping[:, None], handoff.to(self.dtype), handed)
            row_used = torch.where(stopping, used_now, row_used)
            row_computed = row_computed.masked_fill(active, step)
            active = active & ~done
            state = new
        self._state.index_copy_(0, picked, state)
        self._handed.index_copy_(0, picked, handed)
        self._active.index_copy_(0, picked, active)
        computed.index_copy_(0, picked, row_computed)
        used.index_copy_(0, picked, row_used)
        if order:
            self._order_rows()

    def _chunk_rows(self) -> int:
        """Rows the next compacted chunk runs on: the active count, or its power-of-two bucket."""
        count = self._count
        if self.buckets or (self.buckets is None and self._graphs is not None):
            return min(1 << (count - 1).bit_length(), self.batch_size)
        return count

    # ------------------------------------------------------------ compiling
    def _compile(self) -> dict[str, Callable]:
        """The compiled pieces and, per (layers, step), the key/value slots they are handed (``_kv``)."""
        self._kv: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, ...]] = {}
        for stage in self.model.stages:
            steps = [0] if stage.kind is StageKind.SINGLE else range(1, self.steps[stage.group] + 1)
            for step in steps:
                self._kv[stage.layers, step] = tuple(
                    tensor for layer in stage.layers for tensor in self.cache.read(layer, step))
        mode = {} if self.compile_mode == "default" else {"mode": self.compile_mode}
        fixed = {"fullgraph": True, "dynamic": False, **mode}
        # The exit rule's step number varies (some rules branch on it): automatic dynamic makes it
        # symbolic after its first change; the tensors' shapes never change, so they stay static.
        return {"layers": torch.compile(self._layers_given, **fixed),
                "step": torch.compile(self._step_given, **fixed),
                "step_check": torch.compile(self._step_check_given, fullgraph=True, **mode)}

    def _given_context(self, layers: Sequence[int], kv: Sequence[torch.Tensor]) -> AttentionContext:
        position = self.cache.position
        return AttentionContext(GivenKV(layers, kv, position), 0, self._rows, position.expand(self.batch_size),
                                self._contexts[0].slot_index, 1, self.batch_size, self._mask, one_per_row=True)

    def _layers_given(self, layers: tuple[int, ...], x: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        return self.model.run_layers(layers, x, self._given_context(layers, kv))

    def _step_given(self, group: int, state: torch.Tensor, projected: torch.Tensor,
                    *kv: torch.Tensor) -> torch.Tensor:
        return self.model.loop_step(group, state, projected,
                                    self._given_context(self.model.group_layers[group], kv))

    def _step_check_given(self, group: int, step: int, state: torch.Tensor, projected: torch.Tensor,
                          *kv: torch.Tensor) -> torch.Tensor:
        """A loop step and its exit rule with the bookkeeping, as one compiled region."""
        new = self._step_given(group, state, projected, *kv)
        self._after_step(self._plan, group, step, state, new)
        return new

    def _compile_scope(self):
        if self._compiled is None:
            return contextlib.nullcontext()
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        return torch._dynamo.config.patch(recompile_limit=limit)

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

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Start a new sequence with ``prompt`` ``[B, T]``; returns its logits ``[B, T, V]``."""
        self.reset()
        return self.extend(prompt)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, loop_counts: Sequence[int] | str | int | None = None,
               controller_factory: Callable[[], LoopController] | None = None) -> torch.Tensor:
        """Append ``tokens`` ``[B, T]`` at the next positions; returns their logits ``[B, T, V]``.

        The budget is the decoder's own, or ``loop_counts`` / ``controller_factory`` for this call
        (at most the cache's steps per group). At a fixed budget without warm start the T positions
        run in lock-step in one pass; otherwise one at a time. ``computed``/``used`` ``[G, B]`` then
        hold the last position's loop steps and hand-off index, ``prompt_computed`` ``[G, B, T]`` every
        position's steps."""
        budget = self._budget(loop_counts, controller_factory)
        tokens = tokens.to(self.device)
        batch, length = tokens.shape
        if batch != self.batch_size:
            raise RdepthError(f"decoder holds {self.batch_size} rows; the input has {batch}")
        if length < 1:
            raise RdepthError("decoder: nothing to extend with (0 tokens)")
        if self.length + length > self.capacity:
            raise RdepthError(f"decoder: {self.length} + {length} positions exceed the capacity {self.capacity} "
                              "(the model's context)")
        if length == 1 or not budget.fixed or self.warm_start:
            logits, computed = [], []
            for t in range(length):
                self._advance(tokens[:, t:t + 1], budget)
                logits.append(self.logits.clone())
                computed.append(self.computed.clone())
            self.prompt_computed = torch.stack(computed, dim=2)
            return torch.stack(logits, dim=1)
        logits = self._extend_parallel(tokens, budget.counts)
        self.prompt_computed = self.computed[:, :, None].expand(-1, -1, length).clone()
        return logits

    def _budget(self, loop_counts, controller_factory) -> Budget:
        if loop_counts is not None and controller_factory is not None:
            raise RdepthError("decoder: give loop_counts or controller_factory, not both")
        if controller_factory is not None:
            return Budget(controller_factory=controller_factory)
        if loop_counts is not None:
            return Budget(counts=parse_loop_counts(loop_counts, self.model.n_groups))
        return self.budget

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decode ``tokens`` ``[B, 1]`` at the next position at the decoder's budget; returns logits
        ``[B, V]`` (a copy). ``computed``/``used`` ``[G, B]`` hold each row's steps and hand-off index."""
        self._advance(tokens, self.budget)
        return self.logits.clone()

    @torch.no_grad()
    def _advance(self, tokens: torch.Tensor, budget: Budget | None = None, replay: bool = True) -> None:
        """One position for every row: ``tokens`` ``[B, 1]``; the logits land in ``logits``.
        ``replay=False``: a captured decoder runs the pieces its graphs were recorded from, eagerly."""
        if self.length >= self.capacity:
            raise RdepthError(f"decoder: the cache is full ({self.capacity} positions)")
        plan = self._plan_for(budget or self.budget)
        if plan.budget.fixed and self._counts_of is not plan:  # a fixed budget's counts, once per change
            for group, n in enumerate(plan.steps):  # fills from host ints: no host-to-device copy, no sync
                self.computed[group].fill_(n)
                self.used[group].fill_(n)
        self._counts_of = plan if plan.budget.fixed else None
        self.tokens.copy_(tokens)
        if self._prefix:
            self.cache.limit = self.length + 1
        elif self.span_buckets is not None:
            self._use_span(self._span_for(self.length + 1))
            if self._span_graphs:  # a span shorter than the one captured at (after a rollback): eager
                self._graphs = self._span_graphs.get(self._span)
        graphs = self._graphs if (replay and plan is self._plan) else None
        with self._compile_scope() if graphs is None else contextlib.nullcontext():
            self._run_plan(plan, graphs)
        self.length += 1

    def _run_plan(self, plan: _Plan, graphs: list | None) -> None:
        pieces = plan.pieces
        index = 0
        while index < len(pieces):
            kind, item = pieces[index]
            if kind == "run":
                item() if graphs is None else graphs[index].replay()
                index += 1
            elif kind == "compact":
                rows = self._chunk_rows()
                item(rows) if graphs is None else graphs[index][rows].replay()
                index += 1
            else:
                group, skip_to = item
                if self.compact:
                    self._count = int(self._active.sum())  # the one host read of a chunk
                    looping = self._count > 0
                else:
                    looping = bool(self._active.any())  # the one host read of a chunk
                index = index + 1 if looping else skip_to

    def _extend_parallel(self, tokens: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """T positions at a fixed budget in lock-step (the teacher-forced computation over the cache)."""
        model, batch, (_, length) = self.model, self.batch_size, tokens.shape
        start, end = self.length, self.length + tokens.shape[1]
        device = self.device
        store = _ChunkKV(self.cache, start, end)
        rows = batch * length
        batch_index = torch.arange(batch, device=device).repeat_interleave(length)
        slot_index = torch.arange(length, device=device).repeat(batch)
        position = start + slot_index
        key_positions = torch.arange(end, device=device)
        mask = (key_positions[None, :] <= torch.arange(start, end, device=device)[:, None]).view(1, 1, length, end)

        def context(step: int) -> AttentionContext:
            return AttentionContext(store, step, batch_index, position, slot_index, length, batch, mask)

        x = model.embed(tokens, start).reshape(rows, -1).to(self.dtype)  # (B*T, d), rows by batch then time
        for stage in model.stages:
            if stage.kind is StageKind.SINGLE:
                x = model.run_layers(stage.layers, x, context(0))
                continue
            group = stage.group
            projected = model.group_input(group, x)
            if group in self._initial:
                state = self._initial[group][:, start:end].reshape(rows, -1)
            else:
                state = torch.zeros_like(x)
            for step in range(1, counts[group] + 1):
                state = model.loop_step(group, state, projected, context(step))
            if counts[group] < self.steps[group]:
                self.cache.settle_all(group, counts[group], slice(start, end))
            self.computed[group].fill_(counts[group])
            self.used[group].fill_(counts[group])
            x = state
        self._counts_of = None
        logits = model.readout(x).view(batch, length, -1)
        self.logits.copy_(logits[:, -1])
        self.length = end
        self.cache.position.fill_(end)
        return logits

    @torch.no_grad()
    def greedy(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: ``prompt`` ``[B, T0]`` extended by up to ``max_new_tokens`` tokens (fewer at
        the capacity)."""
        return self.generate(prompt, max_new_tokens)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``prompt`` ``[B, T0]`` extended by up to ``max_new_tokens`` tokens (fewer where the capacity
        ends), chosen by :func:`choose_tokens` on the device; ``[B, T0 + n]``."""
        prompt = prompt.to(self.device)
        if max_new_tokens < 1:
            return prompt
        logits = self.prefill(prompt)[:, -1]
        chosen = [choose_tokens(logits, temperature, top_k, generator)]
        for _ in range(max_new_tokens - 1):
            if self.length >= self.capacity:
                break
            self._advance(chosen[-1])
            chosen.append(choose_tokens(self.logits, temperature, top_k, generator))
        return torch.cat([prompt, *chosen], dim=1)

    # ---------------------------------------------------------- CUDA graphs
    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Record the main budget's pieces as CUDA graphs; :meth:`step` replays them from now on.

        A fixed budget is one graph per token; with exits, one graph per chunk of ``check_every``
        steps plus the pieces between groups; a compacted chunk has one graph per power-of-two row
        count. ``warmup`` eager runs on a side stream come first (at the current position, which they
        leave where it was). With ``compile``, the first of them compiles every graph. Captured, the
        whole cache is read under a mask (fixed shapes; with ``span_buckets`` one set of graphs per read
        span, each reading its span), and exits cannot break on the host.
        """
        if self.device.type != "cuda":
            raise RdepthError(f"decoder.capture needs a CUDA device; this decoder is on {self.device}")
        if self._compiled is not None and warmup < 1:
            raise RdepthError("decoder.capture: a compiled decoder needs warmup >= 1 (it compiles there)")
        if self.length >= self.capacity:
            raise RdepthError(f"decoder: the cache is full ({self.capacity} positions)")
        if self.compact and self.buckets is False:
            raise RdepthError("decoder.capture: compact chunks of every row count (buckets=False) "
                              "cannot be captured; use buckets=None or True")
        if self._plan.host_exits:
            raise RdepthError("decoder.capture: exits that break on the host (batch 1, check_every=1) "
                              "cannot be captured; use check_every=None or > 1")
        if self._prefix:  # graphs need fixed shapes: read the whole cache under the mask
            self._prefix = False
            self._make_contexts()
            self._row_contexts.clear()
            self._plans.clear()
            self._plan = self._plan_for(self.budget)
        pool = torch.cuda.graph_pool_handle()
        for span in self._capture_spans():  # one set of graphs per read span (one set without span buckets)
            self._use_span(span)
            self._span_graphs[span] = self._record(warmup, pool)
        self._use_span(self._span_for(self.length + 1))
        self._graphs = self._span_graphs[self._span]
        if self.span_buckets is None:
            self._span_graphs.clear()

    def _capture_spans(self) -> list[int | None]:
        """The read spans recorded now: those that hold the next position (the warm-up writes there; a
        shorter span's cache view ends before it). A shorter span, reached only by a rollback, runs eagerly."""
        return [span for span in self._spans() if span is None or span > self.length]

    def _record(self, warmup: int, pool) -> list:
        """The plan's pieces as CUDA graphs at the current read span, after ``warmup`` eager runs."""
        sizes = self._bucket_sizes()
        position = self.cache.position.clone()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self._compile_scope():
            for _ in range(warmup):
                for kind, item in self._plan.pieces:
                    if kind == "run":
                        item()
                    elif kind == "compact":
                        for rows in sizes:
                            item(rows)
                self.cache.position.copy_(position)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graphs: list = []
        with self._compile_scope():
            for kind, item in self._plan.pieces:
                if kind == "check":
                    graphs.append(None)
                elif kind == "run":
                    graphs.append(_captured(item, pool))
                else:
                    graphs.append({rows: _captured(lambda item=item, rows=rows: item(rows), pool)
                                   for rows in sizes})
        return graphs

    def _bucket_sizes(self) -> list[int]:
        return sorted({min(1 << n, self.batch_size) for n in range(self.batch_size.bit_length() + 1)})

    @property
    def captured(self) -> bool:
        return self._graphs is not None or bool(self._span_graphs)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None


class _ChunkKV:
    """The store of a lock-step pass over positions ``start .. end - 1``: writes their keys/values and
    reads the cache's first ``end`` positions (the causal mask does the rest)."""

    def __init__(self, cache: StaticKV, start: int, end: int):
        self.cache, self.start, self.end = cache, start, end

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``/``values`` ``[B*T, nh, hs]`` (rows by batch then position) -> ``[B, nh, end, hs]``."""
        cache_k, cache_v = self.cache.slots(layer, ctx.step)
        batch = ctx.n_batch
        span = slice(self.start, self.end)
        cache_k[:, :, span] = keys.view(batch, -1, *keys.shape[1:]).transpose(1, 2)
        cache_v[:, :, span] = values.view(batch, -1, *values.shape[1:]).transpose(1, 2)
        return cache_k[:, :, : self.end], cache_v[:, :, : self.end]


def _captured(piece: _Run, pool) -> "torch.cuda.CUDAGraph":
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        piece()
    return graph


def _sequence(pieces: list[_Run]) -> _Run:
    """One plan piece running ``pieces`` in order."""
    pieces = list(pieces)

    def run() -> None:
        for piece in pieces:
            piece()

    return run

def _resolve_budget(model: RecurrentLM, k_max, loop_counts, controller_factory, keep_steps
                    ) -> tuple[Budget, tuple[int, ...], tuple[int, ...]]:
    """A decoder's budget (fixed ``loop_counts``, else exits by ``controller_factory``, else ``k_max`` or
    the model's eval loops), the loop steps its first token runs per group (at most ``k_max``), and the
    steps the cache keeps per group (``keep_steps``, at least the budget's)."""
    n_groups = model.n_groups
    if loop_counts is not None and controller_factory is not None:
        raise RdepthError("decoder: give loop_counts or controller_factory, not both")
    if controller_factory is None:
        if loop_counts is None:
            loop_counts = k_max if k_max is not None else model.config.default_eval_loops
        counts = parse_loop_counts(loop_counts, n_groups) if n_groups else ()
        budget, first_steps = Budget(counts=counts), counts
    else:
        budget = Budget(controller_factory=controller_factory)
        probe = controller_factory()
        first_steps = tuple(probe.max_steps(group) for group in range(n_groups))
    caps = parse_loop_counts(k_max, n_groups) if (k_max is not None and n_groups) else first_steps
    for group, (n, cap) in enumerate(zip(first_steps, caps)):
        if not 1 <= n <= cap:
            raise RdepthError(f"decoder: group {group} would run {n} loop steps; k_max is {cap}")
    steps = tuple(first_steps)
    if keep_steps is not None:
        keep = parse_loop_counts(keep_steps, n_groups) if n_groups else ()
        if any(k < n for k, n in zip(keep, first_steps)):
            raise RdepthError(f"decoder: keep_steps {keep} is below the budget's steps {first_steps}")
        steps = tuple(keep)
    return budget, tuple(first_steps), steps


def _check_options(exits: bool, check_every, compact: bool, compile: bool, batch_quantile, prefix_attention) -> None:
    """The decoder's options that depend on each other: a one-line error for a combination that cannot run."""
    if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)
                                    or check_every < 1):
        raise RdepthError(f"decoder: check_every must be >= 1 or None, got {check_every!r}")
    if compact and (not exits or check_every is None):
        raise RdepthError("decoder: compact=True needs exits (controller_factory) and check_every "
                          "(rows are compacted at the checks between chunks)")
    if compile and compact:
        raise RdepthError("decoder: compile=True does not cover compacted chunks (compact=True); choose one")
    if batch_quantile is not None:
        if not exits:
            raise RdepthError("decoder: batch_quantile needs exits (controller_factory)")
        if isinstance(batch_quantile, bool) or not isinstance(batch_quantile, (int, float)) \
                or not 0 < batch_quantile <= 1:
            raise RdepthError(f"decoder: batch_quantile must be in (0, 1], got {batch_quantile!r}")
    if prefix_attention and compile:
        raise RdepthError("decoder: prefix_attention needs eager decoding (compiled pieces read the whole "
                          "cache at fixed shapes)")
