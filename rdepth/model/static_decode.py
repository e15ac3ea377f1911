"""Decoding with static shapes: a preallocated key/value cache and one new token per row, for CUDA graphs.

The packed-row path (:meth:`RecurrentLM._forward_packed` through a :class:`~rdepth.model.kv.KVStore`)
serves every token count and every exit pattern, and pays for it at decode time: it rebuilds the
attention context and mask at every loop step (with a ``.item()``), selects the active rows with
boolean masks (host syncs), and scans the whole cache with ``torch.where`` at every step of every
looped layer. :class:`StaticDecoder` drives the same model pieces (``wte``/``wpe`` as
:meth:`~RecurrentLM.embed`, :meth:`~RecurrentLM.run_layers`, :meth:`~RecurrentLM.group_step`,
:meth:`~RecurrentLM.readout`, and the layers' own packed-row attention) with shapes that never
change from token to token:

* :class:`StaticKV` holds, for batch B and ``capacity`` positions, one key/value tensor per
  single-pass layer and one per (looped layer, loop step 1..k) of its group, allocated once.
  The current token's keys are written at a *device* position (``index_copy_``), so nothing on
  the host depends on the data.
* The latest-KV rule of exits (a later token at step k reads an earlier token's key of step k if
  that token computed step k, else its last computed one) is applied once, when a token's loop
  ends (:meth:`StaticKV.settle`: the token's slots of the steps it skipped take its last key), so
  that step k reads its slot as it is, with no scan of the cache.
* Exits are predicated: every row computes every step, and a row that has stopped keeps its state
  (``torch.where`` on an ``active`` [B] mask); the controller decides on the device. To save time
  at batch 1, ``check_every`` steps run as one chunk and the host asks ``active.any()`` once per
  chunk (one sync per chunk, none per step); without ``check_every`` a token has no sync at all.
* Row compaction (``compact=True``, with exits and ``check_every``): at each check the host reads
  how many rows still loop (the same one sync), and the group's next chunk runs on those rows only:
  their state, input, bookkeeping and the keys/values they read are gathered (:class:`StaticRows`,
  the store the layers then see), computed, and scattered back, so the matmuls, the exit rule and
  attention shrink with the rows. The rows gathered are the active ones first, in row order, then
  stopped ones as padding up to the chunk's row count: padding rows compute exactly what
  predication computes for a stopped row (and is discarded in the same way), so a padded chunk
  equals an unpadded one. Eager, a chunk runs on exactly the active count; captured as CUDA graphs,
  on the next power of two (one graph per size, ``buckets``).
* Every attention context holds one query per row, in row order (``one_per_row``, set on the host
  when the context is made): attention views the queries instead of packing them (fewer kernels,
  the same values).
* The attention mask is additive, in the model's dtype (0 where a key may be read, -inf where not),
  made once per token: a boolean mask would be turned into exactly this tensor by
  ``scaled_dot_product_attention`` at every layer application (``where(mask, 0, -inf)`` in the
  query's dtype), so every layer's attention sees the same values, at three fewer ops each (the
  conversion's two scalar fills and its ``where``).
  No row is ever fully masked (position 0 is always allowed), so SDPA's handling of such rows, which
  may differ between the two kinds of mask, never comes in.
* :meth:`StaticDecoder.capture` (CUDA only) records each piece of a token (the whole token at a
  fixed budget; at exits, the stretches between checks) as a ``torch.cuda.CUDAGraph`` over static
  buffers, replayed for every token.
* ``compile=True`` runs a loop step of each group, the single-pass runs and the exit rule's step
  through Inductor (``torch.compile(fullgraph=True)``), so that their small ops fuse; a loop step's
  key/value slots are handed to the compiled function as tensors (:class:`GivenKV`), so that all
  steps of a group share one compiled function. It composes with :meth:`~StaticDecoder.capture`,
  which compiles in its warm-up and then records the compiled kernels.

Results equal the packed path (cached decoding = teacher-forced evaluation, with exits): the
initial loop states are the same :class:`~rdepth.model.noise.StateNoise` draws (each row's
``[capacity, d]`` table per group, drawn once and indexed by the position tensor), and the prompt
runs through the packed path itself (:meth:`StaticDecoder.prefill`) and is copied into the
static cache.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.control import FixedController, LoopController
from rdepth.model.kv import AttentionContext, KVStore
from rdepth.model.noise import StateNoise
from rdepth.model.recurrent import RecurrentLM, StageKind


# Graphs dynamo may compile per compiled function (its default is 8): with ``compile``, a decoder's
# pieces compile a few graphs per group and single-pass stage, and each decoder in a process adds its own.
RECOMPILE_LIMIT = 64


class StaticKV:
    """Keys/values of every layer for one new token per row, at fixed shapes.

    Single-pass layer: ``[B, nh, S, hs]`` (K and V). Looped layer of group g: ``[steps_g, B, nh, S,
    hs]``, slot ``k - 1`` holding what step k attends to (the latest-KV rule already applied, see
    :meth:`settle`). ``position`` ``[1]`` (long, on the device) is where the current token writes.
    The :meth:`update` interface is the one the layers call on a :class:`KVStore`.

    Args:
        model: the model (its config and looped layers).
        batch_size: rows B.
        capacity: positions S (at most the block size).
        steps: loop steps kept per group (the most any token of that group computes).
        dtype, device: of keys and values (the model's).
    """

    def __init__(self, model: RecurrentLM, batch_size: int, capacity: int, steps: Sequence[int],
                 dtype: torch.dtype, device: torch.device):
        config = model.config
        self.batch_size = batch_size
        self.capacity = capacity
        self.steps = tuple(steps)
        shape = (batch_size, config.n_head, capacity, config.head_dim)
        self.group_of = {layer: group for group, layers in enumerate(model.group_layers) for layer in layers}
        self.single: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.looped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(config.n_layer):
            if layer in self.group_of:
                size = (self.steps[self.group_of[layer]], *shape)
                self.looped[layer] = (torch.zeros(size, dtype=dtype, device=device),
                                      torch.zeros(size, dtype=dtype, device=device))
            else:
                self.single[layer] = (torch.zeros(shape, dtype=dtype, device=device),
                                      torch.zeros(shape, dtype=dtype, device=device))
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        # 1-based step numbers of the slots, shaped to broadcast over [steps, B, nh, 1, hs]
        self._step_numbers = {group: torch.arange(1, n + 1, device=device).view(n, 1, 1, 1, 1)
                              for group, n in enumerate(self.steps)}

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' keys/values ``[B, nh, hs]`` at ``position``; return what layer ``layer``
        at step ``ctx.step`` attends to, ``[B, nh, S, hs]`` each (views, no copy)."""
        cache_k, cache_v = self.read(layer, ctx.step)
        return _write_at(cache_k, cache_v, self.position, keys, values)

    def read(self, layer: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What layer ``layer`` at loop step ``step`` (ignored for a single-pass layer) attends to:
        ``[B, nh, S, hs]`` each, views into the cache."""
        if layer in self.looped:
            all_keys, all_values = self.looped[layer]
            return all_keys[step - 1], all_values[step - 1]
        return self.single[layer]

    def settle(self, group: int, computed: torch.Tensor) -> None:
        """The current token's loop of ``group`` is over, row b after ``computed[b]`` steps (``[B]``
        long): its slots of the later steps take the key/value of step ``computed[b]``, which is what
        later tokens must read there (the latest-KV rule of :mod:`rdepth.model.kv`)."""
        numbers = self._step_numbers[group]  # (K, 1, 1, 1, 1)
        last = (computed - 1).view(1, -1, 1, 1, 1)  # (1, B, 1, 1, 1)
        keep = numbers <= computed.view(1, -1, 1, 1, 1)  # (K, B, 1, 1, 1)
        for layer, tensors in self.looped.items():
            if self.group_of[layer] != group:
                continue
            for tensor in tensors:
                column = tensor.index_select(3, self.position)  # (K, B, nh, 1, hs)
                latest = column.gather(0, last.expand(1, *column.shape[1:]))  # (1, B, nh, 1, hs)
                tensor.index_copy_(3, self.position, torch.where(keep, column, latest))

    def load(self, cache: KVStore, length: int) -> None:
        """Copy positions ``0 .. length-1`` of a packed-path ``cache`` (``keep_steps=True``) in: step
        k of position j is the cache's step-k key if j computed step k, else its latest (the read
        rule of :meth:`KVStore.update`)."""
        for layer, (keys, values) in self.single.items():
            latest_k, latest_v = cache.latest[layer]
            keys[:, :, :length] = latest_k[:, :, :length]
            values[:, :, :length] = latest_v[:, :, :length]
        for layer, (keys, values) in self.looped.items():
            latest_k, latest_v = cache.latest[layer]
            has_step = cache.computed[layer][:, None, :length, None]  # (B, 1, T, 1) steps computed
            for step in range(1, keys.shape[0] + 1):
                step_k, step_v = cache.steps.get((layer, step), (latest_k, latest_v))
                keys[step - 1, :, :, :length] = torch.where(
                    has_step >= step, step_k[:, :, :length], latest_k[:, :, :length])
                values[step - 1, :, :, :length] = torch.where(
                    has_step >= step, step_v[:, :, :length], latest_v[:, :, :length])

    def memory_bytes(self) -> int:
        tensors = [t for pair in (*self.single.values(), *self.looped.values()) for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)


class StaticRows:
    """Rows ``rows`` (``[P]`` long, distinct, on the device) of a :class:`StaticKV`, as the store of a
    layer call that computes only those rows: the layers see a batch of P rows (row i is cache row
    ``rows[i]``). ``rows`` may be a view of a buffer refilled in place (CUDA graphs)."""

    def __init__(self, cache: StaticKV, rows: torch.Tensor):
        self.cache = cache
        self.rows = rows

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' keys/values ``[P, nh, hs]`` at the cache's position; return their rows of
        what layer ``layer`` at step ``ctx.step`` attends to, ``[P, nh, S, hs]`` each (gathered copies)."""
        cache = self.cache
        if layer in cache.looped:
            all_keys, all_values = cache.looped[layer]
            cache_k, cache_v = all_keys[ctx.step - 1], all_values[ctx.step - 1]
        else:
            cache_k, cache_v = cache.single[layer]
        cache_k[self.rows, :, cache.position] = keys  # (P, nh, hs) at (rows, :, position, :)
        cache_v[self.rows, :, cache.position] = values
        return cache_k.index_select(0, self.rows), cache_v.index_select(0, self.rows)


class GivenKV:
    """The keys/values of a few layers handed in as tensors, as the store of a compiled piece: the
    layers see the tensors given for this call (``kv``: K then V, ``[B, nh, S, hs]`` each, per layer of
    ``layers``) and write at ``position``. A loop step's slots are chosen outside the compiled code, so
    that every step of a group runs the same compiled function (the step is no constant inside)."""

    def __init__(self, layers: Sequence[int], kv: Sequence[torch.Tensor], position: torch.Tensor):
        self.tensors = {layer: (kv[2 * index], kv[2 * index + 1]) for index, layer in enumerate(layers)}
        self.position = position

    def update(self, layer: int, ctx: AttentionContext, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache_k, cache_v = self.tensors[layer]
        return _write_at(cache_k, cache_v, self.position, keys, values)


def _write_at(cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``keys``/``values`` ``[B, nh, hs]`` at ``position`` ``[1]`` of ``cache_k``/``cache_v``
    ``[B, nh, S, hs]`` (in place); return the two caches."""
    cache_k.index_copy_(2, position, keys.unsqueeze(2))
    cache_v.index_copy_(2, position, values.unsqueeze(2))
    return cache_k, cache_v


# A piece of a token's plan: run a function (one CUDA graph when captured); a compacted chunk, run
# with the number of rows to compute (one graph per row count); or, after a chunk of group
# ``group``'s loop, skip to the plan index ``skip_to`` when no row of it still loops.
_Run = Callable[[], None]


class StaticDecoder:
    """Decode one token per row at a time with static shapes (see the module).

    Args:
        model: the model (put in eval mode; converted in place to ``dtype`` when given).
        batch_size: rows B decoded together (prompts of equal length).
        k_max: the most loop steps of each group (one value or one per group): the cache keeps this
            many steps, and it is the budget when neither ``loop_counts`` nor ``controller_factory``
            is given.
        dtype: weights and keys/values (e.g. ``torch.bfloat16``); None keeps the model's.
        loop_counts: a fixed budget per group (each <= k_max).
        controller_factory: ``() -> LoopController`` for per-token exits (e.g. a
            :class:`rdepth.exits.controller.PolicyController`); one is made for the decoding steps and
            a fresh one for every prefill. Its decisions must be per row and free of host syncs
            (every built-in exit rule is): the decoder calls it with all B rows at every step and
            ignores the rows that already stopped.
        noise: the initial loop states (:class:`StateNoise`, one id per row); needed when the model's
            ``init_state_scale`` is not 0.
        check_every: with exits, loop steps per chunk between two checks whether any row still
            loops (one host sync per chunk); None: no check, every group runs its ``k_max`` steps
            predicated (no sync at all).
        capacity: positions the cache holds (default: the block size).
        compact: with exits and ``check_every``, run each chunk after the first on the rows that
            still loop only (gathered and scattered back; see the module); results are unchanged.
        buckets: with ``compact``, the rows a chunk runs on: the active count rounded up to a power of
            two (True; padded with stopped rows) or exactly the active count (False). None: powers
            of two once captured as CUDA graphs (one graph per size), exact counts when eager.
        compile: run the token's heavy pieces through Inductor (``torch.compile(fullgraph=True,
            dynamic=False)``, default mode: no CUDA graphs of its own, :meth:`capture` stays ours), so that
            norms, residual adds, activations and the exit rule's small ops fuse: one loop step of a group
            (a single compiled function for every step of the group: the step's key/value slots are
            handed in as tensors, :class:`GivenKV`, so a fixed budget does not unroll into one graph),
            each run of single-pass layers, and with exits the rule's decision with its bookkeeping
            after a step (compiled with the step number symbolic: one graph for the middle steps of a
            group, one each for its first and last). Compiled on first use; :meth:`capture` compiles in
            its eager warm-up, before it records. Not with ``compact``.
    """

    def __init__(self, model: RecurrentLM, batch_size: int, k_max: int | Sequence[int],
                 dtype: torch.dtype | None = None, *, loop_counts: Sequence[int] | str | int | None = None,
                 controller_factory: Callable[[], LoopController] | None = None,
                 noise: StateNoise | None = None, check_every: int | None = None, capacity: int | None = None,
                 compact: bool = False, buckets: bool | None = None, compile: bool = False):
        config = model.config
        if dtype is not None:
            model.to(dtype)
        model.eval()
        self.model = model
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        if batch_size < 1:
            raise RdepthError(f"StaticDecoder: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.capacity = capacity or config.block_size
        if not 1 <= self.capacity <= config.block_size:
            raise RdepthError(f"StaticDecoder: capacity must be 1..{config.block_size} (the block size), "
                              f"got {self.capacity}")
        n_groups = model.n_groups
        self.k_max = parse_loop_counts(k_max, n_groups) if n_groups else ()
        if loop_counts is not None and controller_factory is not None:
            raise RdepthError("StaticDecoder: give loop_counts or controller_factory, not both")
        self.controller_factory = controller_factory
        if controller_factory is None:
            self.loop_counts = parse_loop_counts(loop_counts, n_groups) if loop_counts is not None else self.k_max
            self.controller: LoopController = FixedController(self.loop_counts)
        else:
            self.loop_counts = None
            self.controller = controller_factory()
        steps = tuple(self.controller.max_steps(group) for group in range(n_groups))
        for group, (n, cap) in enumerate(zip(steps, self.k_max)):
            if not 1 <= n <= cap:
                raise RdepthError(f"StaticDecoder: group {group} would run {n} loop steps; k_max is {cap}")
        self.steps = steps
        if check_every is not None and check_every < 1:
            raise RdepthError(f"StaticDecoder: check_every must be >= 1, got {check_every}")
        self.check_every = check_every
        if compact and (controller_factory is None or check_every is None):
            raise RdepthError("StaticDecoder: compact=True needs exits (controller_factory) and check_every "
                              "(rows are compacted at the checks between chunks)")
        self.compact = compact
        self.buckets = buckets
        if compile and compact:
            raise RdepthError("StaticDecoder: compile=True does not cover compacted chunks (compact=True); "
                              "choose one")
        self._count = batch_size  # rows still looping, as read at the last check (compact)
        if n_groups and config.init_state_scale != 0 and not isinstance(noise, StateNoise):
            raise RdepthError("StaticDecoder: the model starts its loops from noise (init_state_scale "
                              f"{config.init_state_scale}); give noise=StateNoise(seed, ids), one id per row")
        if isinstance(noise, StateNoise) and len(noise.sequence_ids) != batch_size:
            raise RdepthError(f"StaticDecoder: noise holds {len(noise.sequence_ids)} sequence ids for "
                              f"{batch_size} rows")
        self.noise = noise
        self.length = 0  # positions filled; the host counts them, never reads the device
        self.prompt_computed: torch.Tensor | None = None  # [G, B, T] loop steps of the prompt's tokens

        with torch.no_grad():
            self.cache = StaticKV(model, batch_size, self.capacity, steps, self.dtype, self.device)
            self._allocate()
        self._plan = self._build_plan()
        self._compiled = self._compile() if compile else None
        # per plan piece: its graph, or for a compacted chunk {rows: graph}; None where nothing is captured
        self._graphs: list[torch.cuda.CUDAGraph | dict[int, torch.cuda.CUDAGraph] | None] | None = None

    # ---------------------------------------------------------------- buffers
    def _allocate(self) -> None:
        """Every tensor a token reads or hands between plan pieces, at a fixed address."""
        model, batch, device, d = self.model, self.batch_size, self.device, self.model.config.d_model
        n_groups = model.n_groups
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # input of step()
        self.logits = torch.zeros(batch, model.config.vocab_size, dtype=self.dtype, device=device)
        self.computed = torch.zeros(n_groups, batch, dtype=torch.long, device=device)  # last token's steps
        self.used = torch.zeros(n_groups, batch, dtype=torch.long, device=device)  # iterate handed on
        if self.loop_counts is not None:
            counts = torch.tensor(self.loop_counts, dtype=torch.long, device=device).view(-1, 1)
            self.computed.copy_(counts.expand(-1, batch))
            self.used.copy_(self.computed)
        self._x = torch.zeros(batch, d, dtype=self.dtype, device=device)  # activations between pieces
        self._inputs = torch.zeros_like(self._x)  # the group's input e
        self._state = torch.zeros_like(self._x)  # each row's newest iterate
        self._handed = torch.zeros_like(self._x)  # the state each stopped row hands on
        self._active = torch.zeros(batch, dtype=torch.bool, device=device)
        self._rows = torch.arange(batch, device=device)
        # compaction: the rows still looping first (in row order), then the stopped ones
        self._order = torch.arange(batch, device=device)
        self._row_contexts: dict[tuple[int, int], AttentionContext] = {}  # (rows, step) -> context
        self._key_positions = torch.arange(self.capacity, device=device)
        # The additive attention mask [B, 1, 1, S] (0: read, -inf: not yet written), refilled per token
        # (_begin_token) from these two values; the compacted contexts read its first rows.
        self._mask = torch.zeros(batch, 1, 1, self.capacity, dtype=self.dtype, device=device)
        self._mask_open = torch.zeros((), dtype=self.dtype, device=device)
        self._mask_shut = torch.full((), float("-inf"), dtype=self.dtype, device=device)
        # One context per loop step (0: single-pass layers); the mask is refreshed in place per token.
        self._contexts = {
            step: AttentionContext(self.cache, step, self._rows, self.cache.position.expand(batch),
                                   torch.zeros_like(self._rows), 1, batch, self._mask, one_per_row=True)
            for step in range(max(self.steps, default=0) + 1)
        }
        # Each group's initial states for every position, [B, S, d] (the packed path's draws).
        self._initial: dict[int, torch.Tensor] = {}
        if n_groups and model.config.init_state_scale != 0:
            blank = torch.zeros(batch, self.capacity, d, dtype=self.dtype, device=device)
            for group in range(n_groups):
                self._initial[group] = model.init_state(group, blank, self.noise, 0)

    # ------------------------------------------------------------- the plan
    def _build_plan(self) -> list[tuple[str, object]]:
        """A token as a list of ``("run", fn)`` pieces, ``("compact", fn(rows))`` chunks (with
        ``compact``) and ``("check", (group, skip_to))`` points."""
        exits = self.loop_counts is None
        plan: list[tuple[str, object]] = []
        pending: list[_Run] = [self._begin_token]
        for stage in self.model.stages:
            if stage.kind is StageKind.SINGLE:
                pending.append(lambda layers=stage.layers: self._run_single(layers))
                continue
            group = stage.group
            if not exits:
                pending.append(lambda group=group: self._fixed_loop(group))
                continue
            pending.append(lambda group=group: self._begin_group(group))
            plan.append(("run", _sequence(pending)))
            every = self.check_every or self.steps[group]
            chunks = [range(first, min(first + every, self.steps[group] + 1))
                      for first in range(1, self.steps[group] + 1, every)]
            checks = []
            for number, chunk in enumerate(chunks):
                order = self.compact and number < len(chunks) - 1  # the next check compacts
                if self.compact and number > 0:  # every row loops in the first chunk
                    plan.append(("compact", lambda rows, group=group, chunk=chunk, order=order:
                                 self._compact_steps(group, chunk, rows, order)))
                else:
                    plan.append(("run", lambda group=group, chunk=chunk, order=order:
                                 self._exit_steps(group, chunk, order)))
                if number < len(chunks) - 1:
                    checks.append(len(plan))
                    plan.append(("check", None))
            for index in checks:  # a check skips the group's remaining chunks
                plan[index] = ("check", (group, len(plan)))
            pending = [lambda group=group: self._end_group(group)]
        pending.append(self._end_token)
        plan.append(("run", _sequence(pending)))
        return plan

    def _begin_token(self) -> None:
        x = self.model.embed(self.tokens, positions=self.cache.position)  # (B, 1, d), the position on the device
        self._x.copy_(x.view(self.batch_size, -1))
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

    def _initial_state(self, group: int, like: torch.Tensor) -> torch.Tensor:
        """``[B, d]``: each row's initial state of ``group`` at the current position."""
        if group not in self._initial:
            return torch.zeros_like(like)
        return self._initial[group].index_select(1, self.cache.position).squeeze(1)

    def _fixed_loop(self, group: int) -> None:
        """Every row runs the group's budget; no predication, no settle (all rows computed alike)."""
        inputs = self._x
        state = self._initial_state(group, inputs)
        for step in range(1, self.steps[group] + 1):
            state = self._group_step(group, state, inputs, step)
        self._x.copy_(state)

    def _begin_group(self, group: int) -> None:
        self._inputs.copy_(self._x)
        self._state.copy_(self._initial_state(group, self._x))
        self._handed.copy_(self._state)
        self._active.fill_(True)
        self.controller.begin(group, self._state)

    def _exit_steps(self, group: int, steps: range, order: bool = False) -> None:
        """Loop steps ``steps`` of ``group`` for every row. A stopped row keeps its hand-off, step count
        and used index (predicated on ``active``); its further iterates, keys and controller memory
        are never read (:meth:`StaticKV.settle` rewrites the keys it wrote)."""
        state = self._state
        check = self._after_step if self._compiled is None else self._compiled["check"]
        for step in steps:
            new = self._group_step(group, state, self._inputs, step)
            check(group, step, state, new)
            state = new  # a stopped row's iterate is never read again: no predication needed
        self._state.copy_(state)
        if order:
            self._order_rows()

    def _after_step(self, group: int, step: int, state: torch.Tensor, new: torch.Tensor) -> None:
        """The exit rule after loop step ``step`` of ``group`` (``state`` -> ``new``, ``[B, d]``) and its
        predicated bookkeeping, in place: hand-off, used index and step count of the rows stopping now,
        and the ``active`` mask."""
        computed, used, active, handed = self.computed[group], self.used[group], self._active, self._handed
        done, handoff, used_now = self.controller.after_step(group, step, self._rows, state, new)
        stopping = active if step == self.steps[group] else active & done  # (B,) all stop at the last step
        torch.where(stopping[:, None], handoff.to(self.dtype), handed, out=handed)
        torch.where(stopping, used_now, used, out=used)
        computed.masked_fill_(active, step)
        active.masked_fill_(done, False)

    def _group_step(self, group: int, state: torch.Tensor, inputs: torch.Tensor, step: int) -> torch.Tensor:
        """Loop step ``step`` of ``group`` for every row: ``[B, d]`` -> ``[B, d]`` (compiled or eager)."""
        if self._compiled is None:
            return self.model.group_step(group, state, inputs, self._contexts[step])
        return self._compiled["step"](group, state, inputs, *self._kv[self.model.group_layers[group], step])

    # ------------------------------------------------------------ compiling
    def _compile(self) -> dict[str, Callable]:
        """The compiled pieces (see the class's ``compile``) and, per (layers, step), the key/value
        slots they are handed (``_kv``: views into the cache, made once)."""
        self._kv: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, ...]] = {}
        for stage in self.model.stages:
            steps = [0] if stage.kind is StageKind.SINGLE else range(1, self.steps[stage.group] + 1)
            for step in steps:
                self._kv[stage.layers, step] = tuple(
                    tensor for layer in stage.layers for tensor in self.cache.read(layer, step))
        fixed = {"fullgraph": True, "dynamic": False}
        # The step number of the exit rule varies (and some rules branch on it): automatic dynamic
        # (dynamic=None) makes it symbolic after its first change; the tensors' shapes never change,
        # so they stay static.
        return {"layers": torch.compile(self._layers_given, **fixed),
                "step": torch.compile(self._step_given, **fixed),
                "check": torch.compile(self._after_step, fullgraph=True)}

    def _given_context(self, layers: Sequence[int], kv: Sequence[torch.Tensor]) -> AttentionContext:
        """The attention context of a compiled piece: every row, reading and writing ``kv`` (:class:`GivenKV`;
        the context's step is unused)."""
        position = self.cache.position
        return AttentionContext(GivenKV(layers, kv, position), 0, self._rows, position.expand(self.batch_size),
                                self._contexts[0].slot_index, 1, self.batch_size, self._mask, one_per_row=True)

    def _layers_given(self, layers: tuple[int, ...], x: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        return self.model.run_layers(layers, x, self._given_context(layers, kv))

    def _step_given(self, group: int, state: torch.Tensor, inputs: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        return self.model.group_step(group, state, inputs, self._given_context(self.model.group_layers[group], kv))

    def _compile_scope(self):
        """Around calls that may compile: room for every graph of the pieces (a few per group and
        stage, more with several decoders in one process), where dynamo's default allows 8 per function
        before it silently runs it eagerly."""
        if self._compiled is None:
            return contextlib.nullcontext()
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        return torch._dynamo.config.patch(recompile_limit=limit)

    def _order_rows(self) -> None:
        """``_order``: the rows still looping in row order, then the stopped ones (on the device)."""
        stopped = (~self._active).to(torch.uint8)  # 0 sorts first; stable: in row order
        self._order.copy_(torch.sort(stopped, stable=True).indices)

    def _rows_context(self, rows: int, step: int) -> AttentionContext:
        """The attention context of loop step ``step`` (0: single-pass) over the first ``rows`` rows of
        ``_order``: a batch of that many rows, each reading its own cache row."""
        key = (rows, step)
        if key not in self._row_contexts:
            index = torch.arange(rows, device=self.device)
            self._row_contexts[key] = AttentionContext(
                StaticRows(self.cache, self._order[:rows]), step, index, self.cache.position.expand(rows),
                torch.zeros_like(index), 1, rows, self._mask[:rows], one_per_row=True)  # every row's mask is the same
        return self._row_contexts[key]

    def _compact_steps(self, group: int, steps: range, rows: int, order: bool) -> None:
        """:meth:`_exit_steps` on the first ``rows`` rows of ``_order`` only (every looping row, then
        stopped rows as padding, which compute as predication has them compute): gather, run, scatter."""
        if rows == self.batch_size:
            self._exit_steps(group, steps, order)
            return
        picked = self._order[:rows]
        computed, used = self.computed[group], self.used[group]
        state = self._state.index_select(0, picked)
        inputs = self._inputs.index_select(0, picked)
        handed = self._handed.index_select(0, picked)
        active = self._active.index_select(0, picked)
        row_computed, row_used = computed.index_select(0, picked), used.index_select(0, picked)
        last = self.steps[group]
        for step in steps:
            new = self.model.group_step(group, state, inputs, self._rows_context(rows, step))
            done, handoff, used_now = self.controller.after_step(group, step, picked, state, new)
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

    def _end_group(self, group: int) -> None:
        self.cache.settle(group, self.computed[group])
        self._x.copy_(self._handed)

    def _end_token(self) -> None:
        self.logits.copy_(self.model.readout(self._x))
        self.cache.position.add_(1)

    # ------------------------------------------------------------- decoding
    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Run ``prompt`` ``[B, T]`` through the packed path (the same controller, noise and budget)
        and load its keys/values; returns its logits ``[B, T, V]``. Starts a new sequence."""
        batch, length = prompt.shape
        if batch != self.batch_size:
            raise RdepthError(f"StaticDecoder holds {self.batch_size} rows; the prompt has {batch}")
        if not 1 <= length <= self.capacity:
            raise RdepthError(f"StaticDecoder: a prompt of {length} tokens (capacity {self.capacity})")
        controller = self.controller_factory() if self.controller_factory else FixedController(self.loop_counts)
        packed = self.model.new_cache(batch)
        out = self.model(prompt.to(self.device), controller=controller, cache=packed, generator=self.noise)
        self.cache.load(packed, length)
        self.cache.position.fill_(length)
        self.length = length
        self.prompt_computed = (torch.stack(out.computed) if out.computed  # [G, B, T]
                                else torch.zeros(0, batch, length, dtype=torch.long, device=self.device))
        return out.logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decode ``tokens`` ``[B, 1]`` at the next position; returns logits ``[B, V]`` (a copy).

        The loop steps each row computed and the index of the iterate it handed on are in
        ``computed`` / ``used`` ``[G, B]`` afterwards. No host sync, except one per chunk of
        ``check_every`` steps with exits.
        """
        self._advance(tokens)
        return self.logits.clone()

    @torch.no_grad()
    def _advance(self, tokens: torch.Tensor, replay: bool = True) -> None:
        """:meth:`step` without the copy of the logits. ``replay=False``: a captured decoder runs the
        pieces its graphs were recorded from, eagerly (compiled ones compiled, compacted chunks at the
        recorded row counts): the same results, the graphs' kernels launched one by one (to count them)."""
        if self.length >= self.capacity:
            raise RdepthError(f"StaticDecoder: the cache is full ({self.capacity} positions)")
        self.tokens.copy_(tokens)
        graphs = self._graphs if replay else None
        with self._compile_scope() if graphs is None else contextlib.nullcontext():
            self._run_plan(graphs)
        self.length += 1

    def _run_plan(self, graphs: list | None) -> None:
        """One token's plan: its pieces eager (compiled or not; ``graphs`` None) or replayed, and its checks."""
        plan = self._plan
        index = 0
        while index < len(plan):
            kind, item = plan[index]
            if kind == "run":
                if graphs is None:
                    item()
                else:
                    graphs[index].replay()
                index += 1
            elif kind == "compact":
                rows = self._chunk_rows()
                if graphs is None:
                    item(rows)
                else:
                    graphs[index][rows].replay()
                index += 1
            else:
                group, skip_to = item
                if self.compact:
                    self._count = int(self._active.sum())  # the one sync of a chunk
                    looping = self._count > 0
                else:
                    looping = bool(self._active.any())  # the one sync of a chunk
                index = index + 1 if looping else skip_to

    @torch.no_grad()
    def greedy(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: ``prompt`` ``[B, T0]`` extended by up to ``max_new_tokens`` tokens (fewer
        at the capacity), as :func:`rdepth.model.generation.generate` with ``temperature=0``. The
        chosen tokens stay on the device; the host syncs only where the plan checks exits."""
        if max_new_tokens < 1:
            return prompt
        logits = self.prefill(prompt)[:, -1]
        chosen = [logits.float().argmax(dim=-1, keepdim=True)]
        for _ in range(max_new_tokens - 1):
            if self.length >= self.capacity:
                break
            self._advance(chosen[-1])
            chosen.append(self.logits.float().argmax(dim=-1, keepdim=True))
        return torch.cat([prompt.to(self.device), *chosen], dim=1)

    # ---------------------------------------------------------- CUDA graphs
    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Record the token plan's pieces as CUDA graphs; :meth:`step` replays them from now on.

        A fixed budget is one graph per token; with exits, one graph per chunk of ``check_every``
        steps plus the pieces between groups; a compacted chunk has one graph per power-of-two row
        count, replayed by the active count (``buckets=False`` cannot be captured). The controller
        must keep its per-row memory in tensors it updates in place (every built-in rule does): a
        compacted chunk's graphs of different sizes then hand on the same tensors. ``warmup`` eager
        runs on a side stream come first (at the current position, which they leave where it was:
        the next token overwrites every slot they wrote). With ``compile``, the first of them compiles
        every graph (and runs Inductor's first-call tuning), so nothing compiles while recording.
        """
        if self.device.type != "cuda":
            raise RdepthError(f"StaticDecoder.capture needs a CUDA device; this decoder is on {self.device}")
        if self._compiled is not None and warmup < 1:
            raise RdepthError("StaticDecoder.capture: a compiled decoder needs warmup >= 1 (it compiles there)")
        if self.length >= self.capacity:
            raise RdepthError(f"StaticDecoder: the cache is full ({self.capacity} positions)")
        if self.compact and self.buckets is False:
            raise RdepthError("StaticDecoder.capture: compact chunks of every row count (buckets=False) "
                              "cannot be captured; use buckets=None or True")
        sizes = self._bucket_sizes()
        position = self.cache.position.clone()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self._compile_scope():  # compiled pieces compile here, not in capture
            for _ in range(warmup):
                for kind, item in self._plan:
                    if kind == "run":
                        item()
                    elif kind == "compact":
                        for rows in sizes:
                            item(rows)
                self.cache.position.copy_(position)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        graphs: list = []
        with self._compile_scope():
            for kind, item in self._plan:  # in plan order: a piece may read what the previous allocated
                if kind == "check":
                    graphs.append(None)
                elif kind == "run":
                    graphs.append(_captured(item, pool))
                else:
                    graphs.append({rows: _captured(lambda item=item, rows=rows: item(rows), pool)
                                   for rows in sizes})
        self._graphs = graphs

    def _bucket_sizes(self) -> list[int]:
        """The row counts a captured compacted chunk may run on: powers of two below B, and B."""
        return sorted({min(1 << n, self.batch_size) for n in range(self.batch_size.bit_length() + 1)})

    @property
    def captured(self) -> bool:
        return self._graphs is not None

    @property
    def compiled(self) -> bool:
        """Whether the pieces run Inductor-compiled (``compile=True``)."""
        return self._compiled is not None


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
