"""The engine's graph tick: the static tick's function recorded once as a CUDA graph and replayed every tick.

On a card the static tick (:mod:`rdepth.engine.static`) is some fifty small kernels a tick, each launched by the
host (through dynamo's guard check as well, compiled): the host, not the card, sets the pace at the widths a
server runs (the H200's figures in docs/results/gpu.md). The graph tick records the function once, when the
engine is built (after a warm-up on a side stream, where the compiled variant compiles), one graph for a tick
and one for a call that runs ahead (``Engine(ahead=N)``), and replays it: one launch a tick, no guard check.

A graph replays fixed addresses, so everything the function reads or writes is a buffer that lives as long as
the engine: the slots' loop states and input halves are the function's inputs and are overwritten in place with
its outputs inside the graph (the static tick rebinds them instead), and every other buffer (the cache, the
steps, positions and groups, the prompts, the initial states, the rule's per-row memory and per-row thresholds)
is written in place by the function and by the host's hand-over between replays (admission, a sampled token
entered, a rule's memory restarted). The decisions and logits a replay hands back are the graph's own
buffers, overwritten by the next replay: the scheduler reads them, and copies what it keeps, before that.

Recording needs a function with no host read and no shape that depends on the data; dynamo tracing it as one
graph with no break is the check that runs on the CPU (tests/test_engine_graph.py). Where no card is, the tick
refuses to start; with :attr:`GraphTick.replay` off (the tests) it runs the function over the same fixed
buffers, its outputs copied into buffers of their own as a replay leaves them, so everything but the recording
itself is tested on the CPU. Built on the empty slots, the warm-up's writes land where the static tick's free
slots write every tick (overwritten by a request before it reads them).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rdepth.engine.static import StaticTick
from rdepth.engine.tick import TickPlan, register_tick
from rdepth.errors import RdepthError
from rdepth.model.recurrent import RecurrentLM


@register_tick
class GraphTick(StaticTick):
    """The static tick's function as a CUDA graph (see the module)."""

    name: ClassVar[str] = "graph"
    replay: ClassVar[bool] = True  # False: run the function over the fixed buffers instead (the CPU tests)
    warmup: ClassVar[int] = 2  # runs on a side stream before recording (the compiled variant compiles there)

    def __init__(self, model: RecurrentLM, plan: TickPlan):
        if self.replay and plan.device.type != "cuda":
            raise RdepthError(f"engine: tick {self.name!r} replays CUDA graphs and needs a CUDA device; the model "
                              f"is on {plan.device} (use tick='static' or 'compiled')")
        super().__init__(model, plan)
        self._row_thresholds()
        self.recorded = {False: self._record(False)}
        if self.function_ahead is not None:
            self.recorded[True] = self._record(True)

    def _row_thresholds(self) -> None:
        """Every per-row threshold a request's depth may set made now, at each rule's own (a threshold made
        later would be a buffer the graph never reads)."""
        if len(self.controllers) == 1:
            return  # (no request brings a depth: no row's threshold is ever set)
        for controller in self.controllers[2:]:  # (the named rules, TickPlan.route)
            if not hasattr(controller, "policy"):
                continue  # (a controller of the caller's own: it takes no threshold per request)
            for group in range(self.groups):
                policy = controller.policy(group)
                if policy.uses_tau and policy.per_row_tau:
                    policy.set_row_tau(self.rows, policy.tau)

    def _body(self, ahead: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tick's function over the slots' fixed buffers: the new loop states and input halves written
        into them; returns the decisions and logits."""
        function = self.function_ahead if ahead else self.function
        state, projected, decisions, logits = function(self.state, self.projected)
        self.state.copy_(state)
        self.projected.copy_(projected)
        return decisions, logits

    def _record(self, ahead: bool):
        """The graph of the tick's function (``ahead``: the call of several ticks) and its output buffers (no
        graph where :attr:`replay` is off: buffers the function's outputs are copied into)."""
        with torch.inference_mode():  # (the engine's ticks run in inference mode: the compiled guards' mode)
            if not self.replay:
                return None, tuple(output.clone() for output in self._body(ahead))
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._body(ahead)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self._body(ahead)
        return graph, outputs

    def _launch(self, ahead: bool) -> tuple[torch.Tensor, torch.Tensor]:
        graph, outputs = self.recorded[ahead]
        if graph is not None:
            graph.replay()
        else:
            for buffer, output in zip(outputs, self._body(ahead), strict=True):
                buffer.copy_(output)
        return outputs


@register_tick
class CompiledGraphTick(GraphTick):
    """The compiled tick's function (Inductor's kernels) recorded as a CUDA graph."""

    name: ClassVar[str] = "compiled-graph"
    compiled: ClassVar[bool] = True
