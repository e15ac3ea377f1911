"""The token tick (rdepth.engine.token): every loop run to its exit within the tick, so every occupied row reads
out once a tick. Every request equals its batch-1 decode (float64) for every shape, rules and a fixed budget, any
arrival order, sampled tokens and depths of their own; rows never spread over the stages (each tick reads out
every occupied row, where the eager tick's spread); bad input as the engine's."""

from __future__ import annotations

import random

import pytest
from test_engine import assert_same, factory, prompts, reference, run_engine
from test_engine_depth import engine as depth_engine
from test_engine_depth import mixed
from test_engine_static import SHAPES

from rdepth.engine import Engine, Request
from rdepth.errors import RdepthError


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ["step_norm_rel", "kl", "acceleration", "fixed"])
def test_every_request_equals_the_batch_1_decoder_in_any_arrival_order(name, shape):
    """Two-hit rules too (the tick is the eager one's steps, many a tick)."""
    model = SHAPES[shape]()
    requests = [Request(p, max_tokens=3 + i % 4, keep_logits=True, sequence_id=i % 3, noise_seed=i,
                        temperature=1.2 if i % 4 == 3 else 0.0, seed=i)
                for i, p in enumerate(prompts(8, seed=1))]
    budget = {"controller_factory": factory(model, name)}
    for batch, seed in ((3, 0), (8, 1)):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        results, engine = run_engine(model, requests, batch, order, tick="token", **budget)
        assert_same(model, requests, results, **budget)
        assert engine.stats.positions == sum(len(r.prompt) + r.max_tokens - 1 for r in requests)


def readouts_per_tick(model, tick: str, budget: dict) -> list[tuple[int, int]]:
    """(rows occupied, rows read out) of every tick of an engine fed requests at staggered times."""
    engine = Engine(model, 4, tick=tick, **budget)
    seen = []
    original = engine.scheduler.update

    def spy(output):
        seen.append((int(engine.scheduler.taken.sum()), int(output.rows.size)))
        return original(output)

    engine.scheduler.update = spy
    pending = [Request(p, max_tokens=6, sequence_id=i) for i, p in enumerate(prompts(10, seed=4))]
    while pending or engine.pending():
        if pending and len(seen) % 3 == 0:
            engine.add_request(pending.pop())
        list(engine.step())
    return seen


def test_rows_stay_in_step_where_the_eager_ticks_spread():
    """Staggered arrivals on three groups under a rule: every occupied row reads out in every token tick; the eager
    tick reads out fewer rows than it holds in most ticks (the rows sit in different groups)."""
    model = SHAPES["three groups"]()
    budget = {"controller_factory": factory(model, "step_norm_rel")}
    token = readouts_per_tick(model, "token", budget)
    assert all(read == occupied for occupied, read in token)
    eager = readouts_per_tick(model, "eager", budget)
    assert sum(read < occupied for occupied, read in eager) > len(eager) // 2


def test_each_request_runs_its_own_depth_exactly():
    model = SHAPES["two groups"]()
    requests, budgets = mixed(model)
    built = depth_engine(model, 3, "token")
    ids = {built.add_request(request): index for index, request in enumerate(requests)}
    results = {ids[done.request_id]: done for done in built.run()}
    for index, (request, budget) in enumerate(zip(requests, budgets, strict=True)):
        tokens, _, steps = reference(model, request, **budget)
        assert (results[index].tokens, results[index].steps) == (tokens, steps), f"request {index}"


def test_it_runs_no_calls_ahead_and_no_speculation():
    model = SHAPES["loop only"]()
    with pytest.raises(RdepthError, match="reads the device after every tick"):
        Engine(model, 2, tick="token", ahead=2, loop_counts=3)
    with pytest.raises(RdepthError, match="runs on the eager tick, not 'token'"):
        Engine(model, 2, tick="token", loop_counts=3, speculate=2, draft_loops=1)
