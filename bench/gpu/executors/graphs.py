"""CUDA graphs of a decoder's main budget: recorded once, replayed for every token.

A fixed budget is one graph per group's loop and the pieces between; with exits, one graph per chunk
of ``check_every`` steps plus the pieces between groups (the host checks stay between replays). Graphs
need fixed shapes: attention reads the whole cache under the mask (the pieces of a
:class:`~bench.gpu.executors.masked.Masked` executor, or a compiled one) or, with ``span_buckets=n``, one set
of graphs per read span (the first n, 2n, 4n ... positions, up to the capacity), each token replaying
the smallest span that holds what is written; a span shorter than the one recorded at (reached by a
rollback) runs eagerly. Tokens at another budget (:meth:`Decoder.extend`'s) run through the executor
the graphs were recorded from.
"""

from __future__ import annotations

import torch

from bench.gpu.executors.masked import Masked
from rdepth.errors import RdepthError
from rdepth.model.executors.eager import Executor


class Captured(Executor):
    """Replays the graphs recorded by :meth:`record`; other tokens run through ``inner`` (an eager
    executor that reads the written prefix becomes a :class:`Masked` one of the same checks). ``replay``
    False: the main budget's tokens run the pieces the graphs were recorded from, each op launched
    (e.g. to count what a graph holds)."""

    def __init__(self, inner: Executor, span_buckets: int | None = None):
        super().__init__(inner.check_every)
        if span_buckets is not None and (isinstance(span_buckets, bool) or not isinstance(span_buckets, int)
                                         or span_buckets < 1):
            raise RdepthError(f"decoder: span_buckets must be an int >= 1, got {span_buckets!r}")
        if span_buckets is not None and getattr(inner, "mode", None) is not None:
            raise RdepthError("decoder: span_buckets reads fixed spans under the mask; not with compile "
                              "(pieces compiled for the whole cache)")
        self.inner = inner if isinstance(inner, Masked) else Masked(inner.check_every)
        self.span_buckets = span_buckets
        self.graphs: dict[int | None, list] = {}  # per read span: a graph per plan piece (None at checks)
        self.replay = True

    @classmethod
    @torch.no_grad()
    def record(cls, decoder, warmup: int = 2, span_buckets: int | None = None) -> Captured:
        """Record ``decoder``'s main budget as CUDA graphs after ``warmup`` eager runs on a side stream (at
        the current position, which they leave where it was; a compiled decoder compiles there); from
        now on :meth:`Decoder.step` replays them. Returns the executor (``decoder.executor``)."""
        inner = decoder.executor
        if decoder.device.type != "cuda":
            raise RdepthError(f"Captured.record needs a CUDA device; this decoder is on {decoder.device}")
        if isinstance(inner, Captured):
            raise RdepthError("Captured.record: this decoder is captured already")
        if getattr(inner, "mode", None) is not None and warmup < 1:
            raise RdepthError("Captured.record: a compiled decoder needs warmup >= 1 (it compiles there)")
        if decoder.length >= decoder.capacity:
            raise RdepthError(f"decoder: the cache is full ({decoder.capacity} positions)")
        captured = cls(inner, span_buckets)  # graphs need fixed shapes: the whole cache read under the mask
        decoder.use(captured.inner)
        pool = torch.cuda.graph_pool_handle()
        for span in captured.spans(decoder):
            if span is None or span > decoder.length:  # spans that hold the next position (warm-up writes there)
                captured.inner.read_span(span)
                captured.graphs[span] = captured._record(decoder, warmup, pool)
        decoder.use(captured)
        return captured

    def spans(self, decoder) -> list[int | None]:
        """Every read span a token can take (``[None]`` without buckets)."""
        if self.span_buckets is None:
            return [None]
        spans, span = [], self.span_buckets
        while span < decoder.capacity:
            spans.append(span)
            span *= 2
        return spans + [decoder.capacity]

    def span_for(self, decoder, length: int) -> int | None:
        """The read span of a token at ``length`` positions written (itself included)."""
        return next(span for span in self.spans(decoder) if span is None or span >= length)

    def _record(self, decoder, warmup: int, pool) -> list:
        position = decoder.cache.position.clone()
        side = torch.cuda.Stream(device=decoder.device)
        side.wait_stream(torch.cuda.current_stream(decoder.device))
        with torch.cuda.stream(side), self._scope():
            for _ in range(warmup):
                for kind, item in decoder.plan.pieces:
                    if kind == "run":
                        item()
                decoder.cache.position.copy_(position)
        torch.cuda.current_stream(decoder.device).wait_stream(side)
        graphs: list = []
        with self._scope():
            for kind, item in decoder.plan.pieces:
                graphs.append(_captured(item, pool) if kind == "run" else None)
        return graphs

    def _scope(self):
        scope = getattr(self.inner, "scope", None)
        return scope() if scope is not None else torch.no_grad()

    def attach(self, decoder) -> None:
        self.inner.attach(decoder)

    def begin_token(self, decoder) -> None:
        self.inner.begin_token(decoder)

    def run_layers(self, decoder, layers, x):
        return self.inner.run_layers(decoder, layers, x)

    def loop_step(self, decoder, group, state, step):
        return self.inner.loop_step(decoder, group, state, step)

    def exit_step(self, decoder, loop, step, state):
        return self.inner.exit_step(decoder, loop, step, state)

    def run_token(self, decoder, plan) -> None:
        self.inner.read_span(self.span_for(decoder, decoder.length + 1))
        graphs = self.graphs.get(self.inner.span) if (self.replay and plan is decoder.plan) else None
        if graphs is None:
            self.inner.run_token(decoder, plan)
        else:
            decoder.run_pieces(plan, graphs)


def _captured(piece, pool) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        piece()
    return graph
