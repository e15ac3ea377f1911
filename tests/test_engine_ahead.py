"""A static tick that runs ahead (``Engine(ahead=N)``): one call runs N ticks, the device choosing and entering
every row's next token itself, and the host reads their outputs in one go. Every request still equals its
batch-1 decode (float64) for every rule, shape, width and arrival order; a request that ends in the first of
those ticks has its later outputs dropped and its slot goes to the next request; a sampled request or a rule
with per-row memory makes the tick read the device after every tick; the calls really run several ticks."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model
from test_engine import assert_same, factory, prompts, run_engine
from test_engine_static import SHAPES

from rdepth.engine import Engine, Request
from rdepth.errors import RdepthError


def counting(engine):
    """Wrap the tick's functions so a test sees how many calls ran ahead and how many ran one tick."""
    calls = {"ahead": 0, "one": 0}
    tick = engine.tick
    one, ahead = tick.function, tick.function_ahead

    def one_call(*args):
        calls["one"] += 1
        return one(*args)

    def ahead_call(*args):
        calls["ahead"] += 1
        return ahead(*args)

    tick.function = one_call
    if ahead is not None:
        tick.function_ahead = ahead_call
    return calls


def run_counted(model, requests, batch, order=None, **budget):
    engine = Engine(model, batch, **budget)
    calls = counting(engine)
    ids = {engine.add_request(requests[index]): index for index in (order or range(len(requests)))}
    results = {ids[done.request_id]: done for done in engine.run()}
    assert sorted(results) == sorted(range(len(requests)))
    return results, engine, calls


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ["step_norm_rel", "fixed", "learned"])
def test_every_request_equals_the_batch_1_decoder_when_the_tick_runs_ahead(name, shape):
    model = SHAPES[shape]()
    requests = [Request(p, max_tokens=2 + i % 5, keep_logits=True, sequence_id=i % 3, noise_seed=i)
                for i, p in enumerate(prompts(9, seed=2))]
    budget = {"controller_factory": factory(model, name)}
    for batch, ahead, seed in ((3, 3, 0), (8, 4, 1), (1, 2, 2)):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        results, engine, calls = run_counted(model, requests, batch, order, tick="static", ahead=ahead, **budget)
        assert_same(model, requests, results, **budget)
        # every position read out once (a request's outputs after its end dropped, never recorded)
        assert engine.stats.positions == sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
        assert calls["ahead"] > 0 and calls["one"] == 0
        assert engine.stats.ticks == ahead * calls["ahead"]


def test_a_request_that_ends_early_in_a_call_frees_its_slot_for_the_next():
    """With one slot, every request but the last ends inside a call that runs on past it: its later outputs
    are dropped and the next request takes the slot (admitted at the call's end), its answer unchanged."""
    model = SHAPES["prelude and coda"]()
    budget = {"controller_factory": factory(model, "step_norm_rel")}
    requests = [Request(p, max_tokens=1 + i % 3, keep_logits=True, sequence_id=i, stop=[7])
                for i, p in enumerate(prompts(6, seed=5))]
    results, engine, calls = run_counted(model, requests, 1, tick="static", ahead=5, **budget)
    assert_same(model, requests, results, **budget)
    assert calls["ahead"] > 0 and engine.live == [None]
    # the slot sat idle for some of the ticks it ran ahead: more ticks than positions read out
    assert engine.stats.ticks > engine.stats.positions


def test_a_sampled_request_makes_the_calls_read_after_every_tick():
    """A sampled token is the host's: while a sampling request holds a slot the tick runs one tick a call;
    with the greedy requests alone again it runs ahead; every request equals the batch-1 decoder."""
    model = SHAPES["two groups"]()
    budget = {"controller_factory": factory(model, "step_norm_rel")}
    requests = [Request(p, max_tokens=4, keep_logits=True, sequence_id=i, noise_seed=i,
                        **({"temperature": 1.2, "seed": 3} if i == 1 else {}))
                for i, p in enumerate(prompts(6, seed=7))]
    results, _, calls = run_counted(model, requests, 2, tick="static", ahead=3, **budget)
    assert_same(model, requests, results, **budget)
    assert calls["ahead"] > 0 and calls["one"] > 0


def test_a_rule_with_row_memory_reads_after_every_tick():
    """kl keeps each row's last distribution: the host restarts it when a row enters a loop, so the tick does
    not run ahead (and says so by having no function for it); its requests equal the batch-1 decoder."""
    model = SHAPES["loop only"]()
    budget = {"controller_factory": factory(model, "kl")}
    requests = [Request(p, max_tokens=3, sequence_id=i) for i, p in enumerate(prompts(4, seed=8))]
    results, engine, calls = run_counted(model, requests, 2, tick="static", ahead=4, **budget)
    assert engine.tick.function_ahead is None and calls["one"] > 0
    assert_same(model, requests, results, **budget)


def test_a_non_finite_row_fails_alone_when_running_ahead():
    model = SHAPES["loop only"]()
    with torch.no_grad():
        model.wpe.weight[10] = float("nan")  # only the long request reaches position 10
    requests = [Request([1, 2, 3], max_tokens=3), Request(list(range(12)), max_tokens=3), Request([4, 5], max_tokens=3)]
    budget = {"controller_factory": factory(model, "step_norm_rel")}
    ahead, _ = run_engine(model, requests, 3, tick="static", ahead=3, **budget)
    eager, _ = run_engine(model, requests, 3, **budget)
    assert ahead[1].finish_reason == "error" and "not finite" in ahead[1].error
    for index in (0, 2):
        assert ahead[index].tokens == eager[index].tokens and ahead[index].steps == eager[index].steps


def test_a_row_that_fails_inside_its_prompt_reads_nothing_after_it_and_its_slot_goes_on_clean():
    """Non-finite at position 5 of a 20-token prompt, one loop a token (a readout every tick): the call's later
    readouts of that slot (positions 6, 7: in the prompt, finite) are dropped with it, and the request that
    takes the slot next equals its batch-1 decode."""
    model = SHAPES["loop only"]()
    with torch.no_grad():
        model.wpe.weight[5] = float("nan")
    budget = {"loop_counts": [1] * model.n_groups}
    requests = [Request(list(range(1, 21)), max_tokens=2), Request([4, 5, 6], max_tokens=3, sequence_id=1),
                Request([7, 8], max_tokens=2, sequence_id=2)]
    results, engine = run_engine(model, requests, 1, tick="static", ahead=4, **budget)
    assert results[0].finish_reason == "error" and "position 5" in results[0].error
    assert len(results[0].steps) == 5  # positions 0-4 read out, nothing after
    assert_same(model, requests[1:], {0: results[1], 1: results[2]}, **budget)


@pytest.mark.parametrize("ahead, tick, why", [(0, "static", "ahead must be an integer >= 1"),
                                              (True, "static", "ahead must be an integer >= 1"),
                                              (2, "eager", "reads the device after every tick")])
def test_an_ahead_it_cannot_run_is_a_one_line_error(ahead, tick, why):
    model = tiny_model(n_layer=1, groups="0")
    with pytest.raises(RdepthError, match=why):
        Engine(model, 2, tick=tick, ahead=ahead)


def test_requests_at_depths_of_their_own_run_ahead_exactly():
    """The server's engine (own depths: a fixed budget of a request's own, a named memoryless rule at its own
    threshold and cap) runs ahead; each request equals its batch-1 decode at its budget or rule."""
    from test_engine_depth import rule

    from rdepth.engine import Depth

    model = SHAPES["prelude and coda"]()
    depths = [None, Depth(loops=2), Depth(rule="step_norm_rel", tau=0.6), Depth(loops=4),
              Depth(rule="step_norm_rel", tau=0.1, k_max=3)]
    requests = [Request(p, max_tokens=2 + i % 3, keep_logits=True, sequence_id=i, depth=depth)
                for i, (p, depth) in enumerate(zip(prompts(len(depths), seed=6), depths, strict=True))]
    caps = Engine(model, 1).k_max
    built = Engine(model, 3, tick="static", ahead=3, controller_factory=rule(model, "step_norm_rel", 0.3),
                   rules={"step_norm_rel": rule(model, "step_norm_rel", 0.3)})
    calls = counting(built)
    ids = {built.add_request(request): index for index, request in enumerate(requests)}
    results = {ids[done.request_id]: done for done in built.run()}
    assert calls["ahead"] > 0 and calls["one"] == 0
    for index, request in enumerate(requests):
        depth = request.depth
        if depth is None:
            budget = {"controller_factory": rule(model, "step_norm_rel", 0.3)}
        elif depth.loops is not None:
            budget = {"loop_counts": (depth.loops,) * len(caps)}
        else:
            budget = {"controller_factory": rule(model, depth.rule, depth.tau, depth.k_max)}
        assert_same(model, [request], {0: results[index]}, **budget)


@pytest.mark.skipif(not __import__("shutil").which("g++"), reason="Inductor's CPU kernels need a C++ compiler")
def test_compiled_ahead_decides_as_the_eager_tick():
    """The compiled function of two ticks a call (one graph): in float64 every token, loop step and prediction
    is the eager tick's, the kept logits equal to rounding."""
    model = SHAPES["prelude and coda"]()
    requests = [Request(p, max_tokens=2 + i % 3, keep_logits=True, sequence_id=i) for i, p in enumerate(prompts(6, seed=9))]
    budget = {"controller_factory": factory(model, "step_norm_rel")}
    compiled, engine, calls = run_counted(model, requests, 4, tick="compiled", ahead=2, **budget)
    eager, _ = run_engine(model, requests, 4, **budget)
    assert calls["ahead"] > 0
    for index in range(len(requests)):
        assert compiled[index].tokens == eager[index].tokens and compiled[index].steps == eager[index].steps
        assert compiled[index].predicted == eager[index].predicted
        torch.testing.assert_close(compiled[index].logits, eager[index].logits, rtol=0, atol=1e-9)
