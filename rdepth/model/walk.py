"""The model's one stage walk: the order in which a token goes through a :class:`~rdepth.model.RecurrentLM`.

A model's layers form *stages* (:func:`build_stages`): runs of single-pass layers and recurrence groups,
whose layers loop together. Every driver takes a token the same way::

    embed -> for each stage:  single-pass layers                      (single)
                              or a group: its input half (group_input)
                                          and each position's initial state  (enter: start)
                                          the loop                           (loop)
                                          the hand-off to the next stage     (leave: hand_on)
          -> readout

:class:`StageWalk` holds that order once; a driver subclasses it and supplies only what differs: where a
group's initial states come from (:meth:`StageWalk.start`), how its loop runs (:meth:`StageWalk.loop`),
and the attention context a call reads (:meth:`StageWalk.context`). The drivers:

* :class:`DenseWalk` -- training and fixed-budget evaluation, ``[B, T, d]`` (and :meth:`RecurrentLM.run_after`);
* :class:`PackedWalk` -- every position in lock-step as packed rows under a loop controller (per-token exits);
* the :class:`~rdepth.model.decoder.Decoder`'s walks -- its lock-step prompt (several positions at a fixed
  budget) and, at plan time, its per-token pieces;
* :func:`rdepth.geometry.jacobian.group_fixed_points` -- a group's input rebuilt around observed iterates;
* the :class:`~rdepth.engine.Engine`'s tick -- one visit of every stage per tick over the rows at it, a
  group's visit one loop step; its rows enter and leave a group through the walk's :meth:`StageWalk.enter`
  and :meth:`StageWalk.leave`.

A driver that runs a group's loop in pieces (the decoder's plan, the engine's ticks) overrides
:meth:`StageWalk.group` and calls :meth:`StageWalk.enter` and :meth:`StageWalk.leave` itself when its rows
arrive and stop.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rdepth.config import ModelConfig
from rdepth.model.control import LoopController
from rdepth.model.kv import AttentionContext, RowsKV
from rdepth.model.loop import LoopRows, run_fixed
from rdepth.model.noise import CounterNoise, StateNoise

# observer(group, step, state [B, T, d], active [B, T] bool or None)
Observer = Callable[[int, int, torch.Tensor, "torch.Tensor | None"], None]
# Where initial loop states come from: keyed noise (per sequence, or the counter-based hash), one
# generator for the whole batch, or (None) the global RNG.
Noise = StateNoise | CounterNoise | torch.Generator | None


class StageKind(enum.Enum):
    SINGLE = "single"  # layers run once
    GROUP = "group"  # layers loop together


@dataclass(frozen=True)
class Stage:
    kind: StageKind
    layers: tuple[int, ...]
    group: int | None = None


def build_stages(config: ModelConfig) -> list[Stage]:
    """The model's stages in order: maximal runs of single-pass layers between its recurrence groups."""
    stages: list[Stage] = []
    single: list[int] = []
    group_at = {spec.start: (index, spec) for index, spec in enumerate(config.group_specs)}
    layer = 0
    while layer < config.n_layer:
        if layer in group_at:
            if single:
                stages.append(Stage(StageKind.SINGLE, tuple(single)))
                single = []
            index, spec = group_at[layer]
            stages.append(Stage(StageKind.GROUP, spec.layers, index))
            layer = spec.end + 1
        else:
            single.append(layer)
            layer += 1
    if single:
        stages.append(Stage(StageKind.SINGLE, tuple(single)))
    return stages


class StageWalk:
    """The walk of ``model``'s (a :class:`~rdepth.model.RecurrentLM`) ``stages`` (default: all of them) over activations ``x`` (see the module).

    Calling the walk runs every stage on ``x`` and returns the last stage's output (before the readout).
    :meth:`visit` is the one place a stage's kind is told apart."""

    def __init__(self, model: nn.Module, stages: Sequence[Stage] | None = None):
        self.model = model
        self.stages = tuple(model.stages if stages is None else stages)

    def __call__(self, x: Any) -> Any:
        for stage in self.stages:
            x = self.visit(stage, x)
        return x

    def visit(self, stage: Stage, x: Any) -> Any:
        """One stage on ``x``: its single-pass layers, or its group."""
        if stage.kind is StageKind.SINGLE:
            return self.single(stage.layers, x)
        return self.group(stage.group, x)

    # ----------------------------------------------------------- the phases
    def single(self, layers: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        """A run of single-pass layers, reading :meth:`context` at step 0."""
        return self.model.run_layers(layers, x, self.context(0))

    def group(self, group: int, inputs: torch.Tensor) -> torch.Tensor:
        """A recurrence group as a whole: enter, loop, leave."""
        state, projected = self.enter(group, inputs)
        return self.leave(group, self.loop(group, state, projected))

    def enter(self, group: int, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows arriving at ``group`` with ``inputs``: the group's input half ``W_e e`` (computed once for
        every loop step, :meth:`RecurrentLM.group_input`) and their initial states (:meth:`start`)."""
        projected = self.model.group_input(group, inputs)
        return self.start(group, inputs), projected

    def leave(self, group: int, state: torch.Tensor) -> torch.Tensor:
        """What the next stage reads from rows whose loop of ``group`` ended at ``state``."""
        return self.model.hand_on(state)

    # ---------------------------------------------------- the driver's hooks
    def context(self, step: int) -> AttentionContext | None:
        """The attention context of a call at loop step ``step`` (0: single-pass layers); None: causal
        attention over the call's own positions (the dense layout)."""
        return None

    def start(self, group: int, inputs: torch.Tensor) -> torch.Tensor:
        """The initial loop states of rows entering ``group`` with ``inputs``."""
        raise NotImplementedError

    def loop(self, group: int, state: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """``group``'s loop from ``state`` given its input half; returns the state to hand on."""
        raise NotImplementedError


class DenseWalk(StageWalk):
    """Dense ``[B, T, d]`` at fixed ``counts`` per group, each loop from ``noise`` (training: the last
    ``backprop_depth`` steps with gradients); ``observer`` sees every iterate; ``shifted_warm_start`` as
    :meth:`RecurrentLM.forward`."""

    def __init__(self, model: nn.Module, counts: Sequence[int], noise: Noise = None,
                 observer: Observer | None = None, shifted_warm_start: bool = False,
                 stages: Sequence[Stage] | None = None):
        super().__init__(model, stages)
        self.counts, self.noise, self.observer = counts, noise, observer
        self.shifted_warm_start = shifted_warm_start

    def start(self, group, inputs):
        return self.model.init_state(group, inputs, self.noise)

    def loop(self, group, state, projected):
        model, steps = self.model, self.counts[group]

        def step_fn(state, step):
            return model.loop_step(group, state, projected)

        if self.shifted_warm_start:
            state = self._shifted_start(group, state, step_fn, steps)
        observe = None
        if self.observer is not None:
            self.observer(group, 0, state, None)

            def observe(step, state):
                self.observer(group, step, state, None)

        # Truncated backprop: the first steps run without a graph.
        return run_fixed(state, steps, step_fn, observe, max(steps - model.config.backprop_depth, 0) + 1)

    @staticmethod
    @torch.no_grad()
    def _shifted_start(group: int, noise_state: torch.Tensor, step_fn, steps: int) -> torch.Tensor:
        """Start states ``[B, T, d]`` for the shifted warm start: position 0 keeps its noise, position t the
        state position t-1 hands on after ``steps`` steps from noise."""
        state = run_fixed(noise_state, steps, step_fn)
        return torch.cat([noise_state[:, :1], state[:, :-1]], dim=1)


class PackedWalk(StageWalk):
    """Every position of a ``[B, T]`` batch in lock-step as packed rows ``[B*T, d]`` under ``controller``
    (a row that stops drops out; later steps read its last key: :class:`RowsKV`). After the walk,
    ``computed`` / ``used`` hold per group ``[B, T]``: the loop steps each position ran and the iterate it
    handed on."""

    def __init__(self, model: nn.Module, batch: int, seq: int, controller: LoopController, noise: Noise,
                 observer: Observer | None, dtype: torch.dtype, device: torch.device):
        super().__init__(model)
        self.batch, self.seq, self.controller, self.noise, self.observer = batch, seq, controller, noise, observer
        self.store = RowsKV(model.new_cache(batch, seq, dtype=dtype, device=device))
        self.batch_index = torch.arange(batch, device=device).repeat_interleave(seq)
        self.position = torch.arange(seq, device=device).repeat(batch)
        self.all_rows = AttentionContext.build(self.store, 1, self.batch_index, self.position)
        self.computed: list[torch.Tensor] = []
        self.used: list[torch.Tensor] = []

    def context(self, step):
        return self.all_rows

    def start(self, group, inputs):
        shaped = inputs.view(self.batch, self.seq, -1)
        return self.model.init_state(group, shaped, self.noise).reshape(self.batch * self.seq, -1)

    def loop(self, group, state, projected):
        loop = LoopRows(self.controller, group, state)
        batch, seq, observer = self.batch, self.seq, self.observer
        if observer is not None:
            observer(group, 0, state.view(batch, seq, -1), None)

        def step_fn(prev, step, rows):
            ctx = AttentionContext.build(self.store, step, self.batch_index[rows], self.position[rows])
            return self.model.loop_step(group, prev, projected[rows], ctx)

        def observe(step, state, active):
            observer(group, step, state.view(batch, seq, -1), active.view(batch, seq))

        loop.run(state, step_fn, observe if observer is not None else None)
        self.computed.append(loop.computed.view(batch, seq))
        self.used.append(loop.used.view(batch, seq))
        return loop.handed_on

