"""``rdepth serve``: the OpenAI-compatible API on the engine. Each choice's text equals its batch-1 decode
under the same budget or rule, noise and seed, whatever else is in flight; streaming gives the same text;
every token reports its depth; bad requests get one error body and leave the server serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from rdepth.cli.main import main
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import load_model
from rdepth.run.heldout import run_tokenizer
from rdepth.serve.api import build_app
from rdepth.serve.config import ServeConfig
from rdepth.serve.server import served_model

PROMPTS = ["The city", "In 1900 the", "A river flows"]


@pytest.fixture(scope="module")
def run(tiny_text_run):
    return tiny_text_run


@pytest.fixture(scope="module")
def servers(run):
    """A fixed-budget server (2 slots, fewer than the requests sent at once) and a kl-exit server."""
    made = {"fixed": served_model(ServeConfig(checkpoint=str(run), batch_size=2, device="cpu", name="tiny")),
            "kl": served_model(ServeConfig(checkpoint=str(run), batch_size=3, device="cpu", exit="kl", tau=0.1,
                                           k_max=(4,), name="tiny"))}
    yield {key: (served, TestClient(build_app(served))) for key, served in made.items()}
    for served in made.values():
        served.runner.stop()


def alone(run, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0, exit=None):
    """A choice's batch-1 decode: its seed S keys the initial loop states, StateNoise(0, [S]), and the sampling
    generator; the text ends before the end-of-text token."""
    model, _ = load_model(run)
    tokenizer = run_tokenizer(run)
    factory = None
    if exit:
        factory = lambda: controller_factory("kl", 0.1, (4, 4), lambda: model.readout)()  # noqa: E731
    ids = torch.tensor([tokenizer.encode(prompt)])
    rng = torch.Generator().manual_seed(seed) if temperature > 0 else None
    out = generate(model, ids, max_tokens, temperature=temperature, top_k=None, noise=StateNoise(0, [seed]),
                   rng=rng, controller_factory=factory)
    new = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new[:new.index(tokenizer.eot_id)] if tokenizer.eot_id in new else new)


def post(client, **body):
    response = client.post("/v1/completions", json={"model": "tiny", **body})
    return response.status_code, response.json()


@pytest.mark.parametrize("key", ["fixed", "kl"])
def test_each_choice_is_its_batch_1_decode_and_reports_its_depth(run, servers, key):
    served, client = servers[key]
    status, body = post(client, prompt=PROMPTS, max_tokens=5, temperature=0, n=2)
    assert status == 200 and len(body["choices"]) == 6
    assert body["usage"]["completion_tokens"] == sum(len(c["rdepth"]["steps"]) for c in body["choices"])
    for number, choice in enumerate(body["choices"]):
        assert choice["index"] == number
        assert choice["text"] == alone(run, PROMPTS[number // 2], 5, exit=key == "kl")  # greedy: seed 0
        depth = choice["rdepth"]
        assert depth["seed"] == 0 and 1 <= len(depth["steps"]) <= 5 and all(len(s) == 2 for s in depth["steps"])
        if key == "fixed":
            assert all(s == served.runner.engine.k_max for s in depth["steps"])
            assert {r for rules in depth["rules"] for r in rules} == {"budget"}
    if key == "kl":
        steps = {s for c in body["choices"] for position in c["rdepth"]["steps"] for s in position}
        assert len(steps) > 1, "the rule should stop tokens at different steps"


def test_sampling_follows_the_requests_seed(run, servers):
    _, client = servers["fixed"]
    status, body = post(client, prompt=PROMPTS[1], max_tokens=6, temperature=0.9, seed=11, n=2)
    assert status == 200
    for number, choice in enumerate(body["choices"]):
        assert choice["text"] == alone(run, PROMPTS[1], 6, temperature=0.9, seed=11 + number)


def test_concurrent_clients_each_get_their_own_answer(run, servers):
    """Twelve requests in flight at once through 3 slots: each equals its decode alone."""
    served, _ = servers["kl"]
    app = build_app(served)

    async def many():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            calls = [client.post("/v1/completions", json={"prompt": PROMPTS[i % 3], "max_tokens": 3 + i % 3,
                                                          "temperature": 0}) for i in range(12)]
            return await asyncio.gather(*calls)

    for i, response in enumerate(asyncio.run(many())):
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == alone(run, PROMPTS[i % 3], 3 + i % 3, exit=True)


def test_streaming_gives_the_same_text_token_by_token_then_done(servers):
    _, client = servers["kl"]
    whole = post(client, prompt=PROMPTS[0], max_tokens=6, temperature=0)[1]["choices"][0]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                                                        "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text == whole["text"]
    token_chunks = [c for c in chunks if c["choices"][0]["rdepth"]["steps"]]
    assert len(token_chunks) == 6 and [c["choices"][0]["rdepth"]["steps"][0] for c in token_chunks] == \
        whole["rdepth"]["steps"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_echo_and_token_id_prompts(servers):
    _, client = servers["fixed"]
    text = post(client, prompt=PROMPTS[2], max_tokens=8, temperature=0)[1]["choices"][0]["text"]
    stop = text[2:4]
    assert stop and text.find(stop) == 2
    choice = post(client, prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=[stop])[1]["choices"][0]
    assert choice["text"] == text[:2] and choice["finish_reason"] == "stop"
    echoed = post(client, prompt=PROMPTS[2], max_tokens=8, temperature=0, echo=True)[1]["choices"][0]["text"]
    assert echoed == PROMPTS[2] + text
    served, _ = servers["fixed"]
    ids = served.tokenizer.encode(PROMPTS[2])
    assert post(client, prompt=ids, max_tokens=8, temperature=0)[1]["choices"][0]["text"] == text


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": "word " * 200}, 400, "prompt"),
    ({"prompt": "x", "colour": "red"}, 400, "colour"),
    ({"prompt": "x", "stop": 3}, 400, "stop"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_a_bad_request_gets_one_error_body_and_the_server_goes_on(servers, body, status, param):
    _, client = servers["fixed"]
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and "Traceback" not in error["message"]
    assert post(client, prompt="x", max_tokens=2, temperature=0)[0] == 200


def test_invalid_json_chat_models_health_and_metrics(servers):
    served, client = servers["fixed"]
    response = client.post("/v1/completions", content=b"{not json")
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 404 and "chat template" in chat.json()["error"]["message"]
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["rdepth"]["batch"] == 2
    assert client.get("/health").json()["status"] == "ok"
    before = client.get("/metrics").text
    post(client, prompt="x", max_tokens=3, temperature=0)
    after = client.get("/metrics").text

    def value(text, name):
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))

    assert value(after, "rdepth_tokens_generated_total") == value(before, "rdepth_tokens_generated_total") + 3
    assert value(after, "rdepth_requests_total") == value(before, "rdepth_requests_total") + 1
    assert "# TYPE rdepth_queue_length gauge" in after
    assert value(after, 'rdepth_mean_loop_steps{group="0"}') > 0


def test_serve_flags_are_checked_before_anything_loads(capsys):
    for flags, message in ((["--tau", "0.1"], "give --exit too"), (["--exit", "kl", "--loops", "2"], "replaces"),
                           (["--port", "0"], "port"), (["--kv-layout", "paged"], "kv")):
        assert main(["serve", "--checkpoint", "nowhere", *flags]) != 0
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_a_cancel_made_before_the_engine_took_the_request_is_not_dropped(run):
    """cancel() right after submit(), before the engine's thread gave the request an id: the runner resolves
    it on its thread (the request ends "cancelled"), and one for a submission it has not taken yet waits."""
    from rdepth.engine import Engine, Request
    from rdepth.serve.runner import EngineRunner

    model, _ = load_model(run)
    runner = EngineRunner(Engine(model.eval(), 1))  # not started: its thread's work done by hand below
    first = runner.submit(Request([1, 2, 3], max_tokens=50))
    runner.cancel(first)
    assert first.request_id is None
    runner._take_inbox()
    assert first.request_id is not None and first.request_id in runner.engine.scheduler.cancelled
    never = type(first)(Request([1], max_tokens=2))  # cancelled, never submitted: kept, not lost, not sent
    runner.cancel(never)
    runner._take_inbox()
    assert runner._unresolved == [never]
    with torch.no_grad():
        results = list(runner.engine.run())
    assert [r.finish_reason for r in results] == ["cancelled"] and results[0].tokens == []  # never admitted


def test_context_sizes_the_slots_and_is_checked_against_the_block_size(run):
    """--context: the engine's capacity per slot (a long-context model served with shorter slots); a prompt
    longer than it is a 400 naming it; a context above the block size is one line before anything serves."""
    served = served_model(ServeConfig(checkpoint=str(run), batch_size=1, device="cpu", context=8, name="tiny"))
    try:
        assert served.runner.engine.capacity == 8 and served.context == 8
        client = TestClient(build_app(served))
        status, body = post(client, prompt=[1] * 9, max_tokens=1)
        assert status == 400 and "exceeds the model's context of 8" in body["error"]["message"]
        status, body = post(client, prompt=[1] * 4, max_tokens=2)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    finally:
        served.runner.stop()
    block = load_model(run)[1].block_size
    with pytest.raises(RdepthError, match=f"--context {block + 1} exceeds the model's block size {block}"):
        served_model(ServeConfig(checkpoint=str(run), device="cpu", context=block + 1))
