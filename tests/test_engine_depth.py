"""Each request at its own depth (rdepth.engine.Depth): a fixed budget of its own, or one of the engine's named
rules at its own threshold and cap, in one batch with requests at the engine's own rule. Every request's tokens,
loop steps, predictions and logits equal its batch-1 decode at that budget or rule (float64), for every tick, any
arrival order; bad depths are one-line errors."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model
from test_engine import caps_for, prompts, reference
from test_engine_static import SHAPES

from rdepth.engine import Depth, Engine, Request
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory

ENGINE_RULE = ("step_norm_rel", 0.3)


def rule(model, name: str, tau: float, k_max: int | None = None):
    caps = caps_for(model) if k_max is None else [min(k_max, k) for k in caps_for(model)]
    return controller_factory(name, tau, caps[:model.n_groups], lambda: model.readout)


def mixed(model):
    """Requests at the engine's rule, at fixed budgets of their own, at kl and step_norm_rel with their own
    thresholds and caps; and each one's batch-1 budget."""
    depths = [None, Depth(loops=2), Depth(rule="kl", tau=0.01), Depth(rule="kl", tau=0.05, k_max=3),
              Depth(rule="step_norm_rel", tau=0.6), Depth(loops=4), Depth(rule="step_norm_rel", tau=0.1, k_max=4)]
    requests, budgets = [], []
    for i, (prompt, depth) in enumerate(zip(prompts(len(depths), seed=5), depths, strict=True)):
        requests.append(Request(prompt, max_tokens=3 + i % 3, keep_logits=True, sequence_id=i, depth=depth))
        if depth is None:
            budgets.append({"controller_factory": rule(model, *ENGINE_RULE)})
        elif depth.loops is not None:
            budgets.append({"loop_counts": (depth.loops,) * model.n_groups})
        else:
            budgets.append({"controller_factory": rule(model, depth.rule, depth.tau, depth.k_max)})
    return requests, budgets


def engine(model, width, tick="eager"):
    caps = caps_for(model)[:model.n_groups]
    return Engine(model, width, tick=tick, controller_factory=rule(model, *ENGINE_RULE),
                  rules={"kl": controller_factory("kl", 0.02, caps, lambda: model.readout),
                         "step_norm_rel": controller_factory("step_norm_rel", 0.3, caps)})


@pytest.mark.parametrize("tick", ["eager", "static"])
@pytest.mark.parametrize("shape", ["two groups", "prelude and coda"])
def test_each_request_runs_its_own_depth_exactly(tick, shape):
    model = SHAPES[shape]()
    requests, budgets = mixed(model)
    for width, seed in ((3, 0), (7, 1)):
        built = engine(model, width, tick)
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        ids = {built.add_request(requests[index]): index for index in order}
        results = {ids[done.request_id]: done for done in built.run()}
        seen = set()
        for index, (request, budget) in enumerate(zip(requests, budgets, strict=True)):
            tokens, logits, steps = reference(model, request, **budget)
            done = results[index]
            assert done.error is None and done.tokens == tokens, f"request {index}"
            assert done.steps == steps, f"request {index}"
            assert done.predicted == logits[:len(request.prompt)].argmax(dim=-1).tolist()
            torch.testing.assert_close(done.logits.double(), logits, rtol=0, atol=1e-9)
            seen.add(tuple(map(tuple, steps)))
            depth = request.depth
            if depth is not None and depth.loops is not None:
                assert all(rules == ["budget"] * model.n_groups for rules in done.rules)
            if depth is not None and depth.k_max is not None:
                assert max(s for position in done.steps for s in position) <= depth.k_max
        assert len(seen) > 3, "the depths should differ between requests"


def test_a_depth_the_engine_cannot_serve_is_a_one_line_error():
    model = tiny_model()
    built = engine(model, 2)
    with pytest.raises(RdepthError, match="holds at most 5"):
        built.add_request(Request([1, 2], depth=Depth(loops=6)))
    with pytest.raises(RdepthError, match="serves kl, step_norm_rel"):
        built.add_request(Request([1, 2], depth=Depth(rule="cosine", tau=0.1)))
    with pytest.raises(RdepthError, match="depth tau must be a positive finite number"):
        Depth(rule="kl", tau=-1.0)
    with pytest.raises(RdepthError, match="loops or a rule"):
        Depth()
    with pytest.raises(RdepthError, match="takes no tau"):
        Depth(loops=2, tau=0.1)
    plain = Engine(model, 2, loop_counts=(2, 2))
    with pytest.raises(RdepthError, match="runs its own budget only"):
        plain.add_request(Request([1, 2], depth=Depth(loops=1)))
    with pytest.raises(RdepthError, match="caps its loops"):
        Engine(model, 2, loop_counts=(6, 5), rules={"kl": controller_factory("kl", 0.02, [3, 3], lambda: model.readout)})
    own = Engine(model, 2, loop_counts=(6, 5), own_depths=True)
    own.add_request(Request([1, 2], max_tokens=2, depth=Depth(loops=5)))  # fixed loops need no rule
    assert [done.steps for done in own.run()] == [[[5, 5]] * 3]


def test_a_fixed_budget_engine_serves_named_rules_exactly():
    """Engine(loop_counts=..., rules=...): a row under a named rule stops early, and at its next position a later
    loop step reads this position's keys at steps it never ran: the cache is written through (the latest-KV
    rule) though the engine's own budget is fixed."""
    model = SHAPES["two groups"]()
    caps = caps_for(model)[:model.n_groups]
    engine = Engine(model, 3, loop_counts=tuple(caps),
                    rules={"step_norm_rel": controller_factory("step_norm_rel", 0.3, caps)})
    requests = [Request(p, max_tokens=4, sequence_id=i, depth=Depth(rule="step_norm_rel", tau=0.3 + 0.1 * i))
                for i, p in enumerate(prompts(4, seed=5))]
    ids = {engine.add_request(r): i for i, r in enumerate(requests)}
    done = {ids[d.request_id]: d for d in engine.run()}
    for i, request in enumerate(requests):
        tokens, _, steps = reference(model, request,
                                     controller_factory=controller_factory("step_norm_rel", request.depth.tau, caps))
        assert (done[i].tokens, done[i].steps) == (tokens, steps), f"request {i}"


@pytest.mark.parametrize("tick", ["eager", "static"])
def test_a_slots_next_request_at_the_rules_own_threshold_does_not_inherit_the_last_ones(tick):
    """Depth(rule=R) with tau None after Depth(rule=R, tau=X) on the same slot runs at the rule's own tau, not
    the slot's last request's."""
    model = SHAPES["two groups"]()
    caps = caps_for(model)[:model.n_groups]
    engine = Engine(model, 1, tick=tick, controller_factory=controller_factory("step_norm_rel", 0.3, caps),
                    rules={"step_norm_rel": controller_factory("step_norm_rel", 0.3, caps)})
    first, second = prompts(2, seed=5)
    engine.add_request(Request(first, max_tokens=4, depth=Depth(rule="step_norm_rel", tau=3.0)))
    engine.add_request(Request(second, max_tokens=4, sequence_id=1, depth=Depth(rule="step_norm_rel")))
    done = {d.request_id: d for d in engine.run()}
    _, _, steps = reference(model, done[1].request, controller_factory=controller_factory("step_norm_rel", 0.3, caps))
    assert done[1].steps == steps
