"""Inductor-compiled decoder pieces: the loop step with its exit rule, and each run of single-pass layers.

One compiled call per loop step: a step's key/value slots are handed in as tensors (:class:`GivenKV`),
so every step of a group runs the same compiled function, and the whole cache is read under the mask
(fixed shapes: :class:`~bench.gpu.executors.masked.Masked`). ``mode``: Inductor's, ``default`` or ``max-autotune-no-cudagraphs`` (matmul templates
benchmarked while compiling; minutes of compiling, fewer kernels per layer on a GPU); none that
captures graphs of its own (:class:`~bench.gpu.executors.graphs.Captured` does that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bench.gpu.executors.masked import Masked
from rdepth.config import COMPILE_MODES
from rdepth.errors import RdepthError
from rdepth.model.kv import AttentionContext, GivenKV
from rdepth.model.loop import LoopRows
from rdepth.model.walk import StageKind

# Graphs dynamo may compile per compiled function (its default is 8): a decoder's pieces compile a few
# graphs per group and single-pass stage, and each decoder in a process adds its own.
RECOMPILE_LIMIT = 64


class Compiled(Masked):
    """The decoder's pieces through ``torch.compile(fullgraph=True)`` (see the module); one per decoder."""

    def __init__(self, mode: str = "default", check_every: int | None = None):
        super().__init__(check_every)
        if mode not in COMPILE_MODES:
            raise RdepthError(f"decoder: compile_mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
        self.mode = mode

    def attach(self, decoder) -> None:
        """Compile the pieces of ``decoder`` and collect, per (layers, step), the slots they are handed
        (once: attached again, nothing changes)."""
        if self.decoder is decoder:
            return
        super().attach(decoder)
        self.kv: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, ...]] = {}
        for stage in decoder.model.stages:
            steps = [0] if stage.kind is StageKind.SINGLE else range(1, decoder.steps[stage.group] + 1)
            for step in steps:
                self.kv[stage.layers, step] = tuple(
                    tensor for layer in stage.layers for tensor in decoder.cache.read(layer, step))
        mode = {} if self.mode == "default" else {"mode": self.mode}
        fixed = {"fullgraph": True, "dynamic": False, **mode}
        # The exit rule's step number varies (some rules branch on it): automatic dynamic makes it
        # symbolic after its first change; the tensors' shapes never change, so they stay static.
        self.layers = torch.compile(self._layers_given, **fixed)
        self.step = torch.compile(self._step_given, **fixed)
        self.step_check = torch.compile(self._step_check_given, fullgraph=True, **mode)

    def run_layers(self, decoder, layers, x):
        return self.layers(layers, x, *self.kv[layers, 0])

    def loop_step(self, decoder, group, state, step):
        return self.step(group, state, decoder.inputs, *self.kv[decoder.model.group_layers[group], step])

    def exit_step(self, decoder, loop: LoopRows, step: int, state: torch.Tensor) -> torch.Tensor:
        # another budget's loop, or a fixed budget's last step: the bookkeeping eager (Inductor fails to
        # generate a fixed controller's step-valued tensors once the step is symbolic: torch 2.13, CPU)
        if loop is not decoder.plan.loops.get(loop.group) or decoder.plan.budget.fixed:
            return super().exit_step(decoder, loop, step, state)
        return self.step_check(loop.group, step, state, decoder.inputs,
                               *self.kv[decoder.model.group_layers[loop.group], step])

    def run_token(self, decoder, plan) -> None:
        with self.scope():
            super().run_token(decoder, plan)

    def scope(self):
        """Dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT` around compiled calls."""
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        return torch._dynamo.config.patch(recompile_limit=limit)

    def _context(self, layers: Sequence[int], kv: Sequence[torch.Tensor]) -> AttentionContext:
        decoder = self.decoder
        position = decoder.cache.position
        return AttentionContext(GivenKV(layers, kv, position), 0, decoder.rows, position.expand(decoder.batch_size),
                                self.contexts[0].slot_index, 1, decoder.batch_size, self.mask,
                                one_per_row=True)

    def _layers_given(self, layers: tuple[int, ...], x: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        return self.decoder.model.run_layers(layers, x, self._context(layers, kv))

    def _step_given(self, group: int, state: torch.Tensor, projected: torch.Tensor,
                    *kv: torch.Tensor) -> torch.Tensor:
        model = self.decoder.model
        return model.loop_step(group, state, projected, self._context(model.group_layers[group], kv))

    def _step_check_given(self, group: int, step: int, state: torch.Tensor, projected: torch.Tensor,
                          *kv: torch.Tensor) -> torch.Tensor:
        """A loop step and the loop routine's bookkeeping after it, as one compiled region."""
        new = self._step_given(group, state, projected, *kv)
        self.decoder.plan.loops[group].step_all(step, state, new)
        return new
