"""``rdepth serve``: a depth per request (issue 63, item 1). A request's ``rdepth`` object (``{"loops": N}`` or
``{"exit": RULE, "tau": X, "k_max": N}``) sets its choices' budget or rule within the server's bounds
(``--max-loops``, ``--allow-exits``); requests at mixed depths in flight together each equal their batch-1
decode at their own budget or rule (tokens and loop steps); the depth report echoes the policy each choice ran;
every bad ``rdepth`` object is a 400 naming its field and the server goes on serving."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from test_engine import reference
from test_serve_chat import MESSAGES, huginn, rendered_ids  # noqa: F401  (huginn: a fixture)

from rdepth.cli.main import main
from rdepth.engine import Depth, Request
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory
from rdepth.run.checkpoint import load_model
from rdepth.run.heldout import run_tokenizer
from rdepth.serve.api import build_app
from rdepth.serve.config import ServeConfig
from rdepth.serve.parse import parse_completion
from rdepth.serve.server import served_model

PROMPTS = ["The city", "In 1900 the", "A river flows"]
SERVERS = {
    # a fixed budget (the run's eval loops, 2,2) with caps raised to 5 and two rules a request may name: a
    # request without a depth runs Depth(loops=2), the engine's own controller runs at the caps
    "fixed": dict(max_loops=5, allow_exits="kl:0.1,step_norm_rel"),
    # kl at the server's caps, two more rules (confidence without a default threshold)
    "kl": dict(exit="kl", tau=0.1, k_max=(4,), allow_exits="kl,step_norm_rel:0.3,confidence"),
    # kl with caps raised to 6 above its --k-max 4, on the static tick
    "kl static": dict(exit="kl", tau=0.1, k_max=(4,), max_loops=6, tick="static"),
    # step_norm_rel (no per-row memory) on the static tick running 3 ticks a call while every request is greedy
    "ahead": dict(exit="step_norm_rel", tau=0.3, k_max=(4,), tick="static", ahead=3),
}


@pytest.fixture(scope="module")
def servers(tiny_text_run):
    made = {key: served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=3, device="cpu", name="tiny",
                                          **flags)) for key, flags in SERVERS.items()}
    yield made
    for served in made.values():
        served.runner.stop()


@pytest.fixture(scope="module")
def model(tiny_text_run):
    return load_model(tiny_text_run)[0]


def budget(model, policy: dict) -> dict:
    """The batch-1 decoder's budget for a policy as the depth report echoes it."""
    if "loops" in policy:
        return {"loop_counts": tuple(policy["loops"])}
    return {"controller_factory": controller_factory(policy["exit"], policy["tau"], tuple(policy["k_max"]),
                                                     lambda: model.readout)}


def alone(run, model, prompt: str, max_tokens: int, policy: dict) -> tuple[str, list[list[int]], list[float]]:
    """A greedy choice's batch-1 decode (seed 0: StateNoise(0, [0])) under ``policy``: its text (ended by the
    end-of-text token), the loop steps per group of the position that chose each new token, and each new
    token's log-probability."""
    tokenizer = run_tokenizer(run)
    ids = tokenizer.encode(prompt)
    request = Request(ids, max_tokens=max_tokens, stop=(tokenizer.eot_id,))
    tokens, logits, steps = reference(model, request, **budget(model, policy))
    chose = torch.log_softmax(logits[len(ids) - 1:].float(), dim=-1)
    logprobs = [float(chose[i, token]) for i, token in enumerate(tokens)]
    text = tokens[:tokens.index(tokenizer.eot_id)] if tokenizer.eot_id in tokens else tokens
    return tokenizer.decode(text), steps[len(ids) - 1:], logprobs


def post_all(served, bodies: list[dict]) -> list[httpx.Response]:
    """Every body at once, concurrently (the engine's 3 slots share their ticks)."""
    app = build_app(served)

    async def many():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))

    return asyncio.run(many())


DEPTHS = [None, {"loops": 1}, {"loops": 3}, {"exit": "kl", "tau": 0.02, "k_max": 3},
          {"exit": "kl", "tau": 0.05, "k_max": 4}, {"exit": "step_norm_rel", "tau": 0.6, "k_max": 2},
          {"exit": "step_norm_rel", "tau": 0.2}]


def expected_policy(served, depth: dict | None) -> dict:
    """The policy a choice runs: without a k_max, a rule runs at the server's own caps."""
    if depth is None:
        return served.policy
    if "loops" in depth:
        return {"loops": [depth["loops"]] * len(served.depths.caps)}
    own = served.policy.get("k_max", served.policy.get("loops"))
    return {"exit": depth["exit"], "tau": depth["tau"], "k_max": own if "k_max" not in depth else
            [min(depth["k_max"], cap) for cap in served.depths.caps]}


@pytest.mark.parametrize("key", list(SERVERS))
def test_mixed_depths_in_flight_together_each_equal_their_batch_1_decode(tiny_text_run, model, servers, key):
    served = servers[key]
    depths = [d for d in DEPTHS if d is None or "loops" in d or d["exit"] in served.depths.rules]
    bodies = []
    for i, depth in enumerate(depths):
        body = {"prompt": PROMPTS if i == 1 else PROMPTS[i % 3], "max_tokens": 4 + i % 3, "temperature": 0,
                "logprobs": 0}
        if i == 2:
            body["n"] = 2
        bodies.append(body if depth is None else {**body, "rdepth": depth})
    responses = post_all(served, bodies)
    seen = set()
    for body, depth, response in zip(bodies, depths, responses, strict=True):
        assert response.status_code == 200, response.text
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]] * body.get("n", 1)
        choices = response.json()["choices"]
        assert len(choices) == len(prompts)
        for prompt, choice in zip(prompts, choices, strict=True):
            report = choice["rdepth"]
            assert report["policy"] == expected_policy(served, depth)
            text, steps, logprobs = alone(tiny_text_run, model, prompt, body["max_tokens"], report["policy"])
            assert choice["text"] == text, (depth, prompt)
            assert report["steps"] == steps, (depth, prompt)  # per new token, the end-of-text token's too
            # the state each row read and handed on, not only where it stopped: the log-probabilities agree
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-5), (depth, prompt)
            if depth is not None and "loops" in depth:
                assert report["steps"] == [[depth["loops"]] * 2] * len(steps)
                assert {r for rules in report["rules"] for r in rules} == {"budget"}
            seen.add(tuple(map(tuple, report["steps"])))
    assert len(seen) > 4, "the depths should differ between requests"


def test_the_servers_default_is_a_policy_like_any_other(servers):
    """Without 'rdepth' a request runs the server's policy; an 'rdepth' naming that policy runs the same way
    (the engine's own controller, or the server's default depth where --max-loops raised the caps)."""
    fixed, kl, moved = servers["fixed"], servers["kl"], servers["kl static"]
    assert fixed.policy == {"loops": [2, 2]} and fixed.depths.caps == (5, 5)
    assert kl.policy == {"exit": "kl", "tau": 0.1, "k_max": [4, 4]} and kl.depths.caps == (4, 4)
    assert moved.depths.caps == (6, 6)

    def depth_of(served, rdepth):
        body = {"prompt": "a", "max_tokens": 1} | ({} if rdepth is None else {"rdepth": rdepth})
        requests, settings = parse_completion(served, body)
        return requests[0].depth, settings.policy

    assert depth_of(fixed, None) == depth_of(fixed, {"loops": 2}) == (Depth(loops=2), fixed.policy)
    assert depth_of(kl, None) == depth_of(kl, {"exit": "kl"}) == depth_of(kl, {"exit": "kl", "tau": 0.1, "k_max": 4}) \
        == (None, kl.policy)
    assert depth_of(moved, None) == (Depth(rule="kl", tau=0.1, k_max=4), moved.policy)
    # without k_max a rule runs at the server's own caps, --k-max 4, not at the engine's raised ones (6)
    assert depth_of(moved, {"exit": "kl", "tau": 0.3}) == (Depth(rule="kl", tau=0.3, k_max=4),
                                                            {"exit": "kl", "tau": 0.3, "k_max": [4, 4]})
    assert depth_of(moved, {"exit": "kl", "k_max": 6})[1] == {"exit": "kl", "tau": 0.1, "k_max": [6, 6]}
    # a rule named without its threshold runs at the server's, given explicitly (never a slot's last request's)
    assert depth_of(kl, {"exit": "step_norm_rel"}) == (Depth(rule="step_norm_rel", tau=0.3),
                                                       {"exit": "step_norm_rel", "tau": 0.3, "k_max": [4, 4]})
    card = TestClient(build_app(kl)).get("/v1/models/tiny").json()["rdepth"]
    assert card["policy"] == kl.policy
    assert card["depths"] == {"max_loops": 4, "caps": [4, 4], "exits": {"kl": {"tau": 0.1},
                                                                         "step_norm_rel": {"tau": 0.3},
                                                                         "confidence": {"tau": None}}}


def test_a_stream_at_its_own_depth_echoes_the_policy_in_its_last_chunk(servers):
    client = TestClient(build_app(servers["kl"]))
    body = {"prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0,
            "rdepth": {"exit": "step_norm_rel", "tau": 0.4, "k_max": 3}}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    chunks = [json.loads(line[len("data: "):])["choices"][0] for line in lines[:-1]]
    policy = {"exit": "step_norm_rel", "tau": 0.4, "k_max": [3, 3]}
    assert whole["rdepth"]["policy"] == policy and chunks[-1]["rdepth"]["policy"] == policy
    assert "policy" not in chunks[0]["rdepth"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [s for c in chunks for s in c["rdepth"]["steps"]] == whole["rdepth"]["steps"]


BAD = [
    ("deep", "rdepth", "must be an object"),
    ([3], "rdepth", "must be an object"),
    ({}, "rdepth", "one of the two"),
    ({"loops": 2, "exit": "kl"}, "rdepth", "one of the two"),
    ({"loops": 5}, "rdepth.loops", "[1, 4]"),
    ({"loops": 0}, "rdepth.loops", "[1, 4]"),
    ({"loops": 2.5}, "rdepth.loops", "an integer"),
    ({"loops": True}, "rdepth.loops", "an integer"),
    ({"loops": "3"}, "rdepth.loops", "an integer"),
    ({"loops": 2, "tau": 0.1}, "rdepth.tau", "fixed 'loops' takes none"),
    ({"loops": 2, "k_max": 3}, "rdepth.k_max", "fixed 'loops' takes none"),
    ({"loops": 2, "depth": 3}, "rdepth.depth", "unknown field"),
    ({"exit": "nope", "tau": 0.1}, "rdepth.exit", "is not an exit rule"),
    ({"exit": "cosine", "tau": 0.1}, "rdepth.exit", "allows: kl, step_norm_rel, confidence"),
    ({"exit": 3}, "rdepth.exit", "an exit rule's name"),
    ({"exit": "kl", "tau": -1}, "rdepth.tau", "positive"),
    ({"exit": "kl", "tau": 0}, "rdepth.tau", "positive"),
    ({"exit": "kl", "tau": "0.1"}, "rdepth.tau", "a number"),
    ({"exit": "kl", "tau": math.inf}, "rdepth.tau", "finite"),
    ({"exit": "confidence", "tau": 1.5}, "rdepth.tau", "(0, 1]"),
    ({"exit": "confidence"}, "rdepth.tau", "sets none"),
    ({"exit": "kl", "k_max": 9}, "rdepth.k_max", "[1, 4]"),
    ({"exit": "kl", "k_max": 0}, "rdepth.k_max", "[1, 4]"),
    ({"exit": "kl", "k_max": 2.0}, "rdepth.k_max", "an integer"),
]


def test_every_bad_depth_is_a_400_naming_its_field_and_the_server_goes_on(tiny_text_run, model, servers):
    served = servers["kl"]
    client = TestClient(build_app(served))
    for rdepth, param, words in BAD:
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 2, "rdepth": rdepth})  # (inf as JSON's Infinity)
        for path, extra in (("/v1/completions", {}), ("/v1/completions", {"stream": True})):
            sent = body if not extra else body[:-1] + ', "stream": true}'
            response = client.post(path, content=sent, headers={"content-type": "application/json"})
            assert response.status_code == 400, (rdepth, response.text)
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], (rdepth, error)
            assert error["type"] == "invalid_request_error"
    response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                                    "rdepth": {"loops": 3}})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == alone(tiny_text_run, model, PROMPTS[0], 3, {"loops": [3, 3]})[0]
    assert client.get("/health").json()["status"] == "ok"
    assert served.runner.engine.in_flight() == 0 and served.runner.queue_length() == 0


def test_a_server_without_rules_refuses_every_rule(servers, tiny_text_run):
    served = served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=2, device="cpu", name="tiny"))
    try:
        assert served.depths.rules == {} and served.depths.bound == 2
        client = TestClient(build_app(served))
        error = client.post("/v1/completions", json={"prompt": "a", "rdepth": {"exit": "kl", "tau": 0.1}}).json()
        assert error["error"]["param"] == "rdepth.exit" and "allows: none" in error["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                    "rdepth": {"loops": 1}}).status_code == 200
    finally:
        served.runner.stop()


def test_a_depth_the_engine_refuses_ends_that_request_alone(servers):
    """The engine's own refusal (a depth past its caps, were one to slip past the parser) ends that request
    with its error; the engine's thread goes on serving."""
    runner = servers["kl"].runner
    refused = runner.submit(Request([1, 2, 3], max_tokens=2, depth=Depth(loops=99)))
    done = refused.events.get(timeout=30)
    assert done.finish_reason == "error" and "holds at most 4" in done.error
    fine = runner.submit(Request([1, 2, 3], max_tokens=2, depth=Depth(loops=1)))
    events = [fine.events.get(timeout=30) for _ in range(3)]  # two tokens, then the result
    assert [event.steps for event in events[:2]] == [[1, 1], [1, 1]]
    assert events[2].finish_reason == "length" and runner.failure is None


@pytest.mark.parametrize("flags, words", [
    (dict(allow_exits="kl:-1"), "TAU a positive number"),
    (dict(allow_exits="kl:x"), "TAU a positive number"),
    (dict(allow_exits="kl,kl:0.2"), "names kl twice"),
    (dict(allow_exits="kl,,cosine:0.1"), "RULE[:TAU]"),
    (dict(allow_exits="none,kl"), "RULE[:TAU]"),
    (dict(exit="kl", tau=0.1, allow_exits="kl:0.2"), "runs at --tau"),
    (dict(max_loops=0), "max_loops"),
])
def test_bad_depth_flags_are_one_line_errors(flags, words):
    with pytest.raises(RdepthError) as raised:
        ServeConfig(checkpoint="x", **flags)
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_bad_rules_are_refused_before_the_checkpoint_loads_and_bounds_after(tiny_text_run, tmp_path):
    missing = str(tmp_path / "no-run")
    for flags, words in ((dict(allow_exits="nope"), "--allow-exits: unknown exit policy 'nope'"),
                         (dict(allow_exits="argmax_stable:0.5"), "takes no threshold"),
                         (dict(allow_exits="confidence:2"), "tau must be in (0, 1]")):
        with pytest.raises(RdepthError) as raised:
            served_model(ServeConfig(checkpoint=missing, device="cpu", **flags))
        assert words in str(raised.value)
    for flags, words in ((dict(max_loops=1), "--max-loops 1 is below the server's own loop budget 2,2"),
                         (dict(exit="kl", tau=0.1, k_max=(4,), max_loops=3), "below the server's own --k-max 4,4"),
                         (dict(loops="2,3", max_loops=4), "differs between groups (2,3)")):
        with pytest.raises(RdepthError) as raised:
            served_model(ServeConfig(checkpoint=str(tiny_text_run), device="cpu", **flags))
        assert words in str(raised.value)


def test_the_flags_are_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-loops" in out and "--allow-exits" in out



def test_a_chat_at_its_own_depth_is_the_completion_of_its_rendered_prompt_at_that_depth(huginn):  # noqa: F811
    _, served, client = huginn
    loops = served.depths.bound - 1 or 1
    body = {"max_tokens": 5, "temperature": 0, "rdepth": {"loops": loops}}
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body}).json()["choices"][0]
    completion = client.post("/v1/completions", json={"prompt": rendered_ids(), **body}).json()["choices"][0]
    assert chat["message"]["content"] == completion["text"]
    assert chat["rdepth"]["steps"] == completion["rdepth"]["steps"] == [[loops] * served.runner.engine.model.n_groups] \
        * len(chat["rdepth"]["steps"])
    assert chat["rdepth"]["policy"] == {"loops": [loops] * served.runner.engine.model.n_groups}
    error = client.post("/v1/chat/completions", json={"messages": MESSAGES, "rdepth": {"loops": 99}}).json()["error"]
    assert error["param"] == "rdepth.loops"


# ---------------------------------------------------------------------- bench/serve_load.py --depth-mix
def serve_load(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import importlib

    return importlib.import_module("serve_load")


def test_serve_load_reads_a_mix_of_depths_as_the_server_does(tiny_text_run, monkeypatch):
    bench = serve_load(monkeypatch)
    argv = ["--run", str(tiny_text_run), "--data", "d", "--loops", "2", "--exit", "kl", "--tau", "0.1", "--k-max", "4",
            "--depth-mix", "loops=1, loops=3,exit=step_norm_rel:0.3,exit=kl:0.05:2"]
    args = bench.parse_args(argv)
    mix = bench.parse_depth_mix(args.depth_mix, args.k_max)
    assert mix == [{"loops": 1}, {"loops": 3}, {"exit": "step_norm_rel", "tau": 0.3, "k_max": 4},
                   {"exit": "kl", "tau": 0.05, "k_max": 2}]
    flags = bench.mix_server_flags(args, mix)
    assert flags == ["--loops", "2", "--max-loops", "4", "--tick", "eager", "--allow-exits", "step_norm_rel,kl"]
    engine, depths = bench.mix_engine(args, flags, mix, 5)(load_model(tiny_text_run)[0])
    assert engine.k_max == [4, 4] and engine.batch == args.batch_size
    assert depths == [Depth(loops=1), Depth(loops=3), Depth(rule="step_norm_rel", tau=0.3, k_max=4),
                      Depth(rule="kl", tau=0.05, k_max=2), Depth(loops=1)]
    assert bench.parse_args(argv[:-2]).depth_mix is None
    ahead = bench.parse_args([*argv, "--tick", "compiled", "--ahead", "4"])
    assert bench.mix_server_flags(ahead, mix)[:8] == ["--loops", "2", "--max-loops", "4", "--tick", "compiled",
                                                      "--ahead", "4"]


@pytest.mark.parametrize("mix, words", [
    ("", "--depth-mix takes loops=N or exit=RULE:TAU[:K_MAX]"),
    ("loops=0", "integers >= 1"),
    ("loops=x", "integers >= 1"),
    ("depth=3", "got 'depth=3'"),
    ("exit=kl", "got 'exit=kl'"),
    ("exit=kl:0.1:2:3", "got 'exit=kl:0.1:2:3'"),
    ("exit=nope:0.1", "--depth-mix exit=nope:0.1: unknown exit policy 'nope'"),
    ("exit=kl:-1", "tau must be positive"),
    ("exit=confidence:3", "tau must be in (0, 1]"),
    ("exit=argmax_stable:2", "takes no threshold per request"),
    ("exit=kl:0.1:0", "integers >= 1"),
])
def test_serve_load_refuses_a_bad_mix_in_one_line(monkeypatch, mix, words):
    bench = serve_load(monkeypatch)
    with pytest.raises(RdepthError) as raised:
        bench.parse_args(["--run", "r", "--data", "d", "--loops", "2", "--exit", "kl", "--tau", "0.1",
                          "--depth-mix", mix])
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_the_ahead_server_runs_several_ticks_a_call(servers):
    """(Its answers are checked with every server's above.) Its rules keep no per-row memory: the tick has its
    function of three ticks; the kl server's tick, whose rule keeps memory, has none."""
    assert servers["ahead"].runner.engine.tick.ahead == 3
    assert servers["ahead"].runner.engine.tick.function_ahead is not None
    assert servers["kl static"].runner.engine.tick.function_ahead is None


def test_ahead_without_a_static_tick_is_a_one_line_error(tiny_text_run):
    with pytest.raises(RdepthError, match="--ahead runs several ticks a call of the static or compiled tick"):
        ServeConfig(checkpoint=str(tiny_text_run), ahead=2)
    with pytest.raises(RdepthError, match="ahead must be an integer in"):
        ServeConfig(checkpoint=str(tiny_text_run), tick="static", ahead=0)
