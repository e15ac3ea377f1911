"""The graph tick (rdepth.engine.graph): the static tick's function recorded as a CUDA graph and replayed.

Off a card the tick refuses to start; with ``GraphTick.replay`` off it runs the function over the fixed buffers a
replay writes (its outputs copied into buffers of their own, as a replay leaves them), so on the CPU: every
request equals its batch-1 decode (float64) for every shape, a rule, a fixed budget, running ahead, depths of their
own and sampled tokens; no buffer the function reads is rebound after recording (a graph would go on reading the
old one); the function traces as one graph with no break (what recording needs: no host read, no shape from the
data), and the check finds a break where one is. On a card (``gpu``): the replayed ticks equal the static tick."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model
from test_engine import assert_same, factory, prompts, reference, run_engine
from test_engine_depth import engine as depth_engine
from test_engine_depth import mixed
from test_engine_static import SHAPES

from rdepth.engine import Engine, Request
from rdepth.engine.graph import GraphTick
from rdepth.errors import RdepthError


@pytest.fixture
def emulated(monkeypatch):
    """The graph tick without recording (the CPU): the function over the fixed buffers, outputs copied."""
    monkeypatch.setattr(GraphTick, "replay", False)


def graph_breaks(function, *args) -> list[str]:
    """Why dynamo would split ``function(*args)`` into several graphs (a host read, a shape from the data):
    empty where it traces as one graph, as a CUDA graph's recording needs."""
    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(function)(*args)
    reasons = [str(reason.reason) for reason in explained.break_reasons]
    return reasons if explained.graph_count == 1 else reasons + [f"{explained.graph_count} graphs"]


def buffers(tick) -> dict[str, int]:
    """Where every tensor the tick's function reads or writes lives: the tick's own, the cache's, the initial
    states' and every controller's per-group memory."""
    found = {f"tick.{name}": value.data_ptr() for name, value in vars(tick).items() if isinstance(value, torch.Tensor)}
    for kind in ("looped", "single"):
        for layer, pair in getattr(tick.slots.cache, kind).items():
            for which, tensor in enumerate(pair):
                found[f"cache.{kind}[{layer}][{which}]"] = tensor.data_ptr()
    found.update({f"initial[{group}]": table.data_ptr() for group, table in tick.initial.items()})
    for index, controller in enumerate(tick.controllers):
        for group in range(tick.groups):
            policy = controller.policy(group) if hasattr(controller, "policy") else controller
            found.update({f"controller {index} group {group} .{name}": value.data_ptr()
                          for name, value in vars(policy).items() if isinstance(value, torch.Tensor)})
    return found


def test_off_a_card_it_is_a_one_line_error():
    with pytest.raises(RdepthError, match="tick 'graph' replays CUDA graphs and needs a CUDA device"):
        Engine(SHAPES["loop only"](), 2, tick="graph", loop_counts=3)
    with pytest.raises(RdepthError, match="tick 'compiled-graph' replays CUDA graphs"):
        Engine(SHAPES["loop only"](), 2, tick="compiled-graph", loop_counts=3)


@pytest.mark.parametrize("shape", ["prelude and coda", "three groups"])
@pytest.mark.parametrize("name", ["step_norm_rel", "kl", "fixed"])
def test_every_request_equals_the_batch_1_decoder(emulated, name, shape):
    """Kept logits too: a replay's logits are its own buffer, overwritten next tick (what the scheduler keeps
    is copied out first)."""
    model = SHAPES[shape]()
    requests = [Request(p, max_tokens=3 + i % 4, keep_logits=True, sequence_id=i % 3, noise_seed=i)
                for i, p in enumerate(prompts(7, seed=1))]
    budget = {"controller_factory": factory(model, name)}
    for batch, seed in ((3, 0), (1, 2)):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        results, engine = run_engine(model, requests, batch, order, tick="graph", **budget)
        assert engine.tick.name == "graph" and engine.tick.recorded[False][0] is None
        assert_same(model, requests, results, **budget)


def test_running_ahead_and_sampled_tokens(emulated):
    """The call that runs ahead has its own buffers; a sampled request makes the tick read after every tick (the
    host enters its token between replays)."""
    model = SHAPES["two groups"]()
    budget = {"controller_factory": factory(model, "fixed")}
    requests = [Request(p, max_tokens=2 + i % 5, keep_logits=True, sequence_id=i) for i, p in enumerate(prompts(6, seed=2))]
    requests += [Request(p, max_tokens=5, temperature=1.2, seed=3 + i, keep_logits=True)
                 for i, p in enumerate(prompts(2, seed=9))]
    results, engine = run_engine(model, requests, 3, tick="graph", ahead=3, **budget)
    assert set(engine.tick.recorded) == {False, True}
    assert_same(model, requests, results, **budget)


def test_each_request_runs_its_own_depth_and_no_buffer_is_rebound(emulated):
    """Depths of their own in one batch (per-row thresholds set after recording, into the buffer made before),
    the engine's rule, sampled tokens: each equals its batch-1 decode, and every buffer the function reads is
    where it was when the graph was recorded."""
    model = SHAPES["two groups"]()
    requests, budgets = mixed(model)
    built = depth_engine(model, 3, "graph")
    before = buffers(built.tick)
    assert any("row_tau" in name for name in before), "the per-row thresholds should exist before recording"
    ids = {built.add_request(request): index for index, request in enumerate(requests)}
    results = {ids[done.request_id]: done for done in built.run()}
    for index, (request, budget) in enumerate(zip(requests, budgets, strict=True)):
        tokens, logits, steps = reference(model, request, **budget)
        assert (results[index].tokens, results[index].steps) == (tokens, steps), f"request {index}"
        torch.testing.assert_close(results[index].logits.double(), logits, rtol=0, atol=1e-9)
    assert buffers(built.tick) == before


def test_the_buffer_check_sees_a_rebound_buffer(emulated):
    """The judge above where it must say no: a rule's memory made anew (as a lazily made threshold would be)."""
    model = SHAPES["loop only"]()
    built = Engine(model, 2, tick="graph", controller_factory=factory(model, "kl"))
    before = buffers(built.tick)
    policy = built.tick.controller.policy(0)
    policy.prev_log_probs = policy.prev_log_probs.clone()
    changed = {name for name, pointer in buffers(built.tick).items() if before.get(name) != pointer}
    assert changed == {"controller 0 group 0 .prev_log_probs"}


@pytest.mark.parametrize("name", [None, "step_norm_rel", "kl"])
def test_the_function_traces_as_one_graph(emulated, name):
    """No host read and no shape from the data in a tick, nor in a call that runs ahead, nor with depths of
    their own: recordable (three groups with single-pass layers before, between and after them: every segment)."""
    model = SHAPES["three groups"]()
    budget = {"loop_counts": None} if name is None else {"controller_factory": factory(model, name)}
    tick = Engine(model, 3, tick="graph", ahead=2, **budget).tick
    assert graph_breaks(tick._tick, tick.state, tick.projected) == []
    if tick.function_ahead is not None:
        assert graph_breaks(tick._ticks, tick.state, tick.projected) == []
    own = depth_engine(model, 3, "graph").tick
    assert graph_breaks(own._tick, own.state, own.projected) == []


def test_the_trace_check_finds_a_host_read(emulated):
    """The judge where it must say no: a loop step that reads a value back to the host."""
    model = SHAPES["loop only"]()
    tick = Engine(model, 2, tick="graph", loop_counts=3).tick
    step = model.loop_step

    def reading(group, state, projected, ctx):
        new = step(group, state, projected, ctx)
        return new * 2 if float(new.abs().sum()) > 1e9 else new  # (a host read: a graph would need a sync)

    model.loop_step = reading
    assert graph_breaks(tick._tick, tick.state, tick.projected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tick", ["graph", "compiled-graph"])
def test_replayed_ticks_equal_the_static_tick_on_a_card(tick):
    """float32 on the card: the same tokens and loop steps as the static tick, the kept logits to 1e-4; running
    ahead too."""
    model = tiny_model(n_layer=4, groups="1-2").float().cuda()
    requests = [Request(p, max_tokens=4, keep_logits=True, sequence_id=i) for i, p in enumerate(prompts(6, seed=3))]
    for name, ahead in (("step_norm_rel", 1), ("fixed", 4)):
        budget = {"controller_factory": factory(model, name)}
        replayed, engine = run_engine(model, requests, 4, tick=tick, ahead=ahead, **budget)
        assert engine.tick.recorded[False][0] is not None
        static, _ = run_engine(model, requests, 4, tick="static", ahead=ahead, **budget)
        for index in range(len(requests)):
            assert replayed[index].tokens == static[index].tokens
            assert replayed[index].steps == static[index].steps
            torch.testing.assert_close(replayed[index].logits, static[index].logits, rtol=1e-4, atol=1e-4)
