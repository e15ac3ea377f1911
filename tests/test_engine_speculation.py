"""Loop speculation through the engine (rdepth.engine.speculation): at low occupancy a greedy request drafts at
few loop steps and is verified at the engine's budget on its own slot. Every request's tokens, loop steps,
predictions and (kept) logits equal its batch-1 decode and the engine's without speculation (float64), for a
fixed budget and exit rules, several groups with single-pass layers around them, one request alone and requests
arriving at random (speculation switching on and off with occupancy); a request that ends inside a round emits
nothing past its end; ``rdepth generate --prompts-file --speculate``; bad input is one line."""

from __future__ import annotations

import random
import re

import pytest
import torch
from conftest import tiny_model
from test_engine import assert_same, factory, prompts, reference, run_engine
from test_engine_static import SHAPES

from rdepth.engine import Engine, Request
from rdepth.engine.speculation import SpeculatingTick
from rdepth.errors import RdepthError
from rdepth.model.loop_speculation import speculative_decode
from rdepth.model.noise import StateNoise

BUDGETS = ("fixed", "step_norm_rel", "kl")


def budget_for(model, name: str) -> dict:
    return {"loop_counts": 6} if name == "fixed" else {"controller_factory": factory(model, name)}


@pytest.fixture
def rounds_seen(monkeypatch):
    """Every round the engines run: (slots occupied in its tick, the row's position, the round)."""
    seen = []
    original = SpeculatingTick._rounds

    def spy(self, tick_input):
        done = original(self, tick_input)
        seen.extend((int(tick_input.live.sum()), int(self.position[row]), one) for row, _, one in done)
        return done

    monkeypatch.setattr(SpeculatingTick, "_rounds", spy)
    return seen


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", BUDGETS)
def test_a_request_alone_equals_plain_decoding(shape, name, rounds_seen):
    """Tokens, steps (the verifier's), predictions and logits: the batch-1 decoder's and the plain engine's;
    drafts both kept and rejected, and the stats count the rounds."""
    model = SHAPES[shape]()
    budget = budget_for(model, name)
    requests = [Request(prompts(1, seed=3)[0], max_tokens=14, keep_logits=True, sequence_id=2, noise_seed=1)]
    results, engine = run_engine(model, requests, 1, speculate=3, draft_loops=4, **budget)
    assert_same(model, requests, results, **budget)
    plain, _ = run_engine(model, requests, 1, **budget)
    assert results[0].tokens == plain[0].tokens and results[0].steps == plain[0].steps
    stats = engine.stats.as_dict(1)["speculation"]
    assert stats["rounds"] == len(rounds_seen) > 0 and stats["ticks"] == stats["rounds"]
    assert 0 < stats["accepted"] < stats["drafted"] == sum(len(one.drafts) for _, _, one in rounds_seen)
    # the request's own counts (alone: the engine's)
    assert (results[0].rounds, results[0].drafted, results[0].accepted) == (stats["rounds"], stats["drafted"],
                                                                            stats["accepted"])
    # every position from the prompt's last on was decided by a round (one token left: a plain tick)
    decided = sum(one.decided for _, _, one in rounds_seen)
    assert decided in (14, 13) and engine.stats.positions == len(requests[0].prompt) + 13
    if name != "fixed":
        assert len({s for position in results[0].steps for s in position}) > 1, "exits should vary"


@pytest.mark.parametrize("name", BUDGETS)
def test_random_arrivals_switch_speculation_with_occupancy(name, rounds_seen):
    """Requests arriving in random orders at widths 3 and 8, some sampled, some keeping logits: rounds run only
    in ticks with at most ``speculate_at_most`` slots occupied and only for greedy rows, every request equals
    its batch-1 decode, and the plain ticks in between (rows of a tick above the limit) stay exact."""
    model = SHAPES["two groups"]()
    budget = budget_for(model, name)
    requests = [Request(p, max_tokens=4 + 3 * (i % 4), keep_logits=i % 2 == 0, sequence_id=i, noise_seed=i % 3,
                        temperature=1.1 if i % 5 == 4 else 0.0, seed=20 + i)
                for i, p in enumerate(prompts(10, seed=7))]
    for batch, at_most, seed in ((3, 2, 0), (8, 3, 1)):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        rounds_seen.clear()
        engine = Engine(model, batch, speculate=2, draft_loops=4, speculate_at_most=at_most, **budget)
        ids, results = {}, {}
        arrivals, rng = iter(order), random.Random(seed)
        while len(results) < len(requests):  # requests arrive between ticks, at random
            for _ in range(max(rng.randint(0, 2), not engine.pending())):
                index = next(arrivals, None)
                if index is not None:
                    ids[engine.add_request(requests[index])] = index
            for done in engine.step():
                results[ids[done.request_id]] = done
        assert_same(model, requests, results, **budget)
        assert rounds_seen and all(live <= at_most for live, _, _ in rounds_seen)
        stats = engine.stats
        assert 0 < stats.speculated_ticks < stats.ticks and stats.rounds == len(rounds_seen)
        sampled = {len(requests[i].prompt) for i in range(len(requests)) if requests[i].temperature > 0}
        assert sampled  # (their rows decode plainly: exact above, and never a round's)
        # each request counts its own rounds: together the engine's, none for a sampled one
        for name_ in ("rounds", "drafted", "accepted"):
            assert sum(getattr(r, name_) for r in results.values()) == getattr(stats, name_)
        assert all(results[i].rounds == 0 for i in range(len(requests)) if requests[i].temperature > 0)
        assert any(r.rounds > 0 for r in results.values())


def speculative_reference(model, request: Request, k: int, draft_loops: int, **budget) -> tuple[list[int], tuple]:
    """A sampled request's batch-1 speculative decode (the one decoder's rounds, rejection sampling), its tokens
    drawn from a generator seeded with the request's seed and the acceptance draws from seed + 1; with its
    rounds, drafts made and drafts kept."""
    rng = torch.Generator().manual_seed(request.seed)
    out, stats = speculative_decode(model, torch.tensor([request.prompt]), request.max_tokens, tokens=k,
                                    draft_loops=draft_loops, temperature=request.temperature, top_p=request.top_p,
                                    noise=StateNoise(request.noise_seed, [request.sequence_id]), rng=rng, **budget)
    return out[0, len(request.prompt):].tolist(), (stats.rounds, stats.drafted, stats.accepted)


@pytest.mark.parametrize("name", BUDGETS)
def test_sampled_requests_speculate_where_every_tick_may_and_equal_their_batch_1_speculative_decode(name,
                                                                                                    rounds_seen):
    """With speculate_at_most at the width, sampled requests run rounds (rejection sampling: drafts rejected and
    replaced by the verifier's draws) beside greedy ones, arriving in any order: each sampled request's tokens
    are its batch-1 speculative decode's, each greedy one its plain decode's; with a smaller limit a sampled
    request runs no round (its tokens would depend on the load) and equals plain sampling."""
    model = SHAPES["two groups"]()
    budget = budget_for(model, name)
    requests = [Request(p, max_tokens=9 + i % 3, sequence_id=i, noise_seed=i % 2, seed=40 + i,
                        temperature=1.3 if i % 2 else 0.0, top_p=0.95 if i % 4 == 1 else 1.0)
                for i, p in enumerate(prompts(6, seed=11))]
    sampled = [i for i, r in enumerate(requests) if r.temperature > 0]
    references = {i: speculative_reference(model, requests[i], 3, 1, **budget) for i in sampled}
    expected = {i: tokens for i, (tokens, _) in references.items()}
    plain, _ = run_engine(model, requests, 3, **budget)
    assert any(expected[i] != plain[i].tokens for i in sampled), "the rounds should draw other tokens"
    for width, seed in ((1, 0), (3, 1)):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        rounds_seen.clear()
        results, engine = run_engine(model, requests, width, order, speculate=3, draft_loops=1,
                                     speculate_at_most=width, **budget)
        for i in range(len(requests)):
            assert results[i].tokens == (expected[i] if i in sampled else plain[i].tokens), f"request {i}"
        for i in sampled:  # (its rounds are the batch-1 rounds: the same counts)
            assert (results[i].rounds, results[i].drafted, results[i].accepted) == references[i][1], f"request {i}"
        assert engine.stats.accepted < engine.stats.drafted, "some drafts should be rejected"
    assert len(rounds_seen) > 0
    rounds_seen.clear()
    results, _ = run_engine(model, requests, 3, speculate=3, draft_loops=1, speculate_at_most=2, **budget)
    assert all(results[i].tokens == plain[i].tokens for i in range(len(requests)))


@pytest.mark.parametrize("name", BUDGETS)
def test_a_request_ending_inside_a_round_emits_nothing_past_its_end(name, rounds_seen):
    """A stop token among a round's kept drafts ends the request there: the listener sees exactly the tokens up
    to it; every max_tokens and a context's end give the batch-1 decoder's tokens."""
    model = SHAPES["prelude and coda"]()
    budget = budget_for(model, name)
    prompt = prompts(1, seed=5)[0]
    full, _, _ = reference(model, Request(prompt, max_tokens=20), **budget)
    inside = 0
    for index, token in enumerate(full):
        if token in full[:index]:
            continue
        rounds_seen.clear()
        heard = []
        engine = Engine(model, 1, speculate=4, draft_loops=5, listener=lambda i, t, *rest, heard=heard: heard.append(t),
                        **budget)
        engine.add_request(Request(prompt, max_tokens=20, stop=[token]))
        (done,) = list(engine.run())
        assert done.tokens == heard == full[:index + 1] and done.finish_reason == "stop"
        start = len(prompt) - 1
        for _, position, one in rounds_seen:  # the stop's readout inside a round with readouts after it
            if position <= start + index < position + one.decided - 1:
                inside += 1
    assert inside > 0, "a stop token should fall inside a round's kept drafts"
    for max_tokens in range(1, 9):
        request = Request(prompt, max_tokens=max_tokens, keep_logits=True)
        results, _ = run_engine(model, [request], 1, speculate=3, draft_loops=5, **budget)
        assert_same(model, [request], results, **budget)
        assert results[0].finish_reason == "length"
    short = tiny_model(n_layer=4, groups="1-2", block_size=len(prompt) + 7)  # the context ends mid-generation
    short_budget = budget_for(short, name)
    request = Request(prompt, max_tokens=20, keep_logits=True)
    results, _ = run_engine(short, [request], 1, speculate=3, draft_loops=5, **short_budget)
    assert_same(short, [request], results, **short_budget)
    assert results[0].finish_reason == "context" and len(results[0].tokens) == 8


def test_bad_input_is_one_line():
    model = SHAPES["two groups"]()

    class Uncappable:  # serves rows at different steps, but has no after_step to cap a draft with
        def max_steps(self, group):
            return 3

        def begin(self, group, state):
            pass

        def begin_rows(self, group, rows, state):
            pass

        def after_steps(self, group, steps, values, rows, prev, new):
            return steps >= 3, new, steps

    for kwargs, message in (({"speculate": 0}, "speculate (K drafts a round) must be an integer >= 1"),
                            ({"speculate": True}, "speculate (K drafts a round) must be"),
                            ({"speculate": 2, "speculate_at_most": 0}, "speculate_at_most must be"),
                            ({"speculate": 2, "draft_loops": 6, "loop_counts": 6}, "nothing to draft"),
                            ({"speculate": 2, "draft_loops": "7,6", "controller_factory": factory(model, "kl")},
                             "nothing to draft"),
                            ({"speculate": 2, "tick": "static"}, "runs on the eager tick"),
                            ({"speculate": 2, "kv_layout": "shared"}, "exact key/value layout"),
                            ({"speculate": 2, "warm_start": True}, "without warm start"),
                            ({"speculate": 2, "controller_factory": Uncappable}, "cannot be capped")):
        with pytest.raises(RdepthError, match=re.escape(message)) as caught:
            Engine(model, 2, **kwargs)
        assert "\n" not in str(caught.value)


def test_generate_prompts_file_speculates(tiny_text_run, tmp_path, capsys):
    """``rdepth generate --prompts-file --speculate K --draft-loops D``: the texts of plain decoding through the
    engine, a request alone (batch 1) and several (speculating at up to 3 in flight); refusals are one line."""
    from rdepth.cli.main import main

    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("The city\nIn 1900 the\nA river\n")
    common = ["generate", "--checkpoint", str(tiny_text_run), "--prompts-file", str(prompts_file), "--device", "cpu",
              "--max-new-tokens", "8", "--temperature", "0"]
    texts = []
    for flags in ([], ["--speculate", "3", "--draft-loops", "1", "--batch-size", "1"], ["--speculate", "2", "--batch-size", "3",
                                                                   "--speculate-at-most", "3"]):
        capsys.readouterr()
        assert main(common + flags) == 0
        texts.append(capsys.readouterr().out)
    assert texts[1] == texts[0] and texts[2] == texts[0] and texts[0].count("--- prompt") == 3
    for flags, message in ((["--speculate", "2", "--tick", "static"], "runs on --tick eager"),
                           (["--speculate-at-most", "2"], "--speculate-at-most is the engine's"),
                           (["--speculate", "2", "--draft-loops", "9"], "nothing to draft")):
        capsys.readouterr()
        assert main(common + flags) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_logprobs_come_from_the_verifier():
    """A request asking for log-probabilities gets the verifying pass's, equal to plain decoding's."""
    model = SHAPES["loop only"]()
    request = Request(prompts(1, seed=2)[0], max_tokens=9, logprobs=3)
    fast, _ = run_engine(model, [request], 1, speculate=3, draft_loops=5, loop_counts=6)
    plain, _ = run_engine(model, [request], 1, loop_counts=6)
    assert fast[0].tokens == plain[0].tokens
    for a, b in zip(fast[0].logprobs, plain[0].logprobs, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-6  # (a float32 log-softmax)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
