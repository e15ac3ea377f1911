"""``rdepth serve``, round 2 (issue 63, items 0, 2 and 4): a choice's tokens do not depend on where it sits in a
request, on ``n`` or on what else is in flight; a stream never sends text the full answer does not hold; the
end-of-text token ends a completion; a request without ``seed`` samples with a fresh one; ``include_usage``;
``GET /v1/models/{id}``; ``logprobs`` and ``echo`` (prompt scoring) equal the model's own log-probabilities;
the engine's thread posts into asyncio queues (no thread per choice); a cancelled request frees its slot at
the next tick.

The streaming and end-token tests drive the server with a scripted engine (every request's new tokens are a
fixed script, byte-level tokens of a multi-byte character among them), so the expected text is known exactly;
the rest run the tiny text run's model."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque

import httpx
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from fastapi.testclient import TestClient
from test_hf_helpers import tiny_tokenizer

from rdepth.engine import Engine, EngineStats, Finished, Request
from rdepth.exits.controller import controller_factory
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import load_model
from rdepth.run.heldout import run_tokenizer
from rdepth.serve.api import ServedModel, build_app
from rdepth.serve.choice import held_back
from rdepth.serve.config import ServeConfig
from rdepth.serve.runner import EngineRunner
from rdepth.serve.server import served_model

TEXT = "The old café is by the river. Then more"  # "é": two byte tokens, each alone U+FFFD


class ScriptedEngine:
    """What the runner needs of an engine, decoding a script: every request's new tokens are ``script`` in
    turn, one a tick, until a token in its ``stop``, its ``max_tokens``, the script's end or a cancellation."""

    batch, kv_layout = 4, "exact"

    def __init__(self, script: list[int]):
        self.script, self.listener = list(script), None
        self.queue: deque = deque()
        self.live: dict[int, Finished] = {}
        self.cancelled: set[int] = set()
        self.requests: list[Request] = []
        self.stats = EngineStats(loop_steps=[0])

    def add_request(self, request: Request) -> int:
        self.requests.append(request)
        self.queue.append(len(self.requests) - 1)
        return len(self.requests) - 1

    def pending(self) -> bool:
        return bool(self.queue or self.live)

    def in_flight(self) -> int:
        return len(self.live)

    def cancel(self, request_id: int) -> None:
        self.cancelled.add(request_id)

    def step(self) -> list[Finished]:
        while self.queue:
            request_id = self.queue.popleft()
            self.live[request_id] = Finished(request_id, self.requests[request_id])
        done = []
        for request_id, result in list(self.live.items()):
            request, reason = result.request, "cancelled"
            if request_id not in self.cancelled:
                token = self.script[len(result.tokens)]
                result.tokens.append(token)
                self.listener(request_id, token, [1], ["budget"], None)
                limit = min(request.max_tokens, len(self.script))
                reason = "stop" if token in request.stop else "length" if len(result.tokens) >= limit else None
            if reason is not None:
                result.finish_reason = reason
                done.append(self.live.pop(request_id))
        self.stats.ticks += 1
        return done


@pytest.fixture()
def scripted():
    """A server on a scripted engine and the BPE of ``tiny_tokenizer`` (a factory: ``scripted(tokens)``)."""
    made = []

    def make(script: list[int]):
        runner = EngineRunner(ScriptedEngine(script)).start()
        made.append(runner)
        served = ServedModel("scripted", tiny_tokenizer(), runner, 64, {"loops": [1]})
        return served, TestClient(build_app(served))

    yield make
    for runner in made:
        runner.stop()


def streamed(client, body: dict, path: str = "/v1/completions") -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


# ---------------------------------------------------------------- streaming: nothing the full text lacks


def test_a_stream_holds_back_a_split_character_and_a_stop_string_spanning_tokens(scripted):
    """The character "é" comes as two byte tokens (each alone U+FFFD) and the stop string "e riv" spans the
    tokens "he" and " river": the stream sends neither a U+FFFD nor the "e" the stop cuts, and its chunks
    joined are the full answer, "The old café is by th" (before: "The old caf\ufffd\ufffd..." and a leaked "e")."""
    tokenizer = tiny_tokenizer()
    script = tokenizer.encode(TEXT)
    assert [tokenizer.decode([t]) for t in script[8:10]] == ["\ufffd", "\ufffd"]
    served, client = scripted(script)
    body = {"prompt": "x", "max_tokens": 40, "stop": ["e riv"]}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == "The old café is by th" and whole["finish_reason"] == "stop"
    chunks = streamed(client, body)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == whole["text"] and not any("\ufffd" in text for text in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # a choice that ends (max_tokens) inside the character releases what it holds: the full text's U+FFFD
    cut = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 9}).json()["choices"][0]["text"]
    assert cut == "The old caf\ufffd" == "".join(c["choices"][0]["text"] for c in streamed(client, {
        "prompt": "x", "max_tokens": 9}))


@pytest.mark.parametrize("text, stops, held", [
    ("abc", ["cd"], 1), ("ab", ["abx"], 2), ("xaa", ["aab"], 2), ("xaab", ["aabz", "bq"], 3), ("xa", ["b"], 0),
    ("a\ufffd", ["z"], 1), ("ab\ufffd\ufffd", ["bc"], 3), ("abc", ["abc"], 0), ("", ["a"], 0), ("ab", [], 0),
])
def test_what_an_open_choice_holds_back(text, stops, held):
    """A trailing U+FFFD (a character still incomplete), and the longest end of the text that begins a stop
    string (a stop string whole is cut, not held)."""
    assert held_back(text, stops) == held


def test_the_end_of_text_token_ends_a_completion_with_finish_reason_stop(scripted):
    """The model's end-of-text token ends the choice (the engine's request carries it as a stop token): no
    text of it, ``finish_reason`` "stop", the token counted in the usage (before: "<|endoftext|> more"
    and "length")."""
    tokenizer = tiny_tokenizer()
    head = tokenizer.encode("The old café")
    served, client = scripted(head + [tokenizer.eot_id] + tokenizer.encode(" more text"))
    for chunks in (None, streamed(client, {"prompt": "x", "max_tokens": 30})):
        if chunks is None:
            body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30}).json()
            choice, usage = body["choices"][0], body["usage"]
            text, finish = choice["text"], choice["finish_reason"]
            assert usage["completion_tokens"] == len(head) + 1 == len(choice["rdepth"]["steps"])
        else:
            text, finish = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
        assert text == "The old café" and finish == "stop"
    assert all(request.stop == frozenset({tokenizer.eot_id}) for request in served.runner.engine.requests)


def test_include_usage_sends_a_usage_chunk_last(scripted):
    tokenizer = tiny_tokenizer()
    _, client = scripted(tokenizer.encode(TEXT))
    body = {"prompt": ["a", "b"], "max_tokens": 5, "n": 2}
    usage = client.post("/v1/completions", json=body).json()["usage"]
    chunks = streamed(client, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage == {
        "prompt_tokens": 2, "completion_tokens": 20, "total_tokens": 22}
    assert all("usage" not in c for c in chunks[:-1])
    assert "usage" not in streamed(client, body)[-1]
    for bad in ({"stream_options": {"include_usage": True}}, {"stream": True, "stream_options": {"colour": 1}},
                {"stream": True, "stream_options": {"include_usage": "yes"}}):
        response = client.post("/v1/completions", json={"prompt": "a", **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def test_a_model_is_retrieved_by_its_id(scripted):
    served, client = scripted([1])
    for name in ("scripted", "runs/demo/train"):
        served.name = name
        card = client.get(f"/v1/models/{name}")
        assert card.status_code == 200 and card.json()["id"] == name == client.get("/v1/models").json()["data"][0][
            "id"]
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_the_tokenizer_endpoints_read_special_tokens_as_lm_eval_asks(scripted):
    """/tokenize reads the end token's text as the token (lm-eval's remote tokenizer takes its id from it);
    /v1/completions encodes a prompt's text literally, as rdepth does everywhere."""
    tokenizer = tiny_tokenizer()
    _, client = scripted([1])
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] is None
    ids = client.post("/tokenize", json={"prompt": "a river<|endoftext|>"}).json()["tokens"]
    assert ids == tokenizer.encode("a river") + [tokenizer.eot_id]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "a river<|endoftext|>"
    assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert client.post("/tokenize", json={"text": "x"}).json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------- the same answer however a client batches


@pytest.fixture(scope="module")
def served(tiny_text_run):
    made = served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=3, device="cpu", name="tiny"))
    yield made
    made.runner.stop()


@pytest.fixture(scope="module")
def client(served):
    return TestClient(build_app(served))


def decoded(run, prompt: str, max_tokens: int, seed: int = 0, temperature: float = 0.0) -> str:
    """The batch-1 decode of a choice of seed ``seed``: StateNoise(0, [seed]), sampling seeded ``seed``."""
    model, _ = load_model(run)
    tokenizer = run_tokenizer(run)
    ids = torch.tensor([tokenizer.encode(prompt)])
    rng = torch.Generator().manual_seed(seed) if temperature > 0 else None
    out = generate(model, ids, max_tokens, temperature=temperature, top_k=None, noise=StateNoise(0, [seed]), rng=rng)
    new = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new[:new.index(tokenizer.eot_id)] if tokenizer.eot_id in new else new)


def texts(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [c["text"] for c in response.json()["choices"]]


def test_a_choice_does_not_depend_on_its_place_in_the_request_or_on_n(tiny_text_run, client):
    """Greedy: every prompt of a list, and each of n choices, is the prompt's batch-1 decode (seed 0); sampled
    with a seed S: choice j of any prompt is that prompt sent alone with seed S + j. Before, choice i drew
    StateNoise(seed, [i]) and sampled with S + i, i counted over the whole list."""
    prompts = ["The city", "A river flows", "The city"]
    greedy = texts(client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 5, "temperature": 0,
                                                        "n": 2}))
    expected = [decoded(tiny_text_run, p, 5) for p in prompts for _ in range(2)]
    assert greedy == expected and greedy[0] == greedy[1] == greedy[4] == greedy[5]
    sampled = texts(client.post("/v1/completions", json={"prompt": prompts[:2], "max_tokens": 6, "temperature": 0.9,
                                                         "n": 2, "seed": 40}))
    for index, text in enumerate(sampled):
        prompt, choice = prompts[index // 2], index % 2
        alone = texts(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0.9,
                                                           "seed": 40 + choice}))
        assert text == alone[0] == decoded(tiny_text_run, prompt, 6, seed=40 + choice, temperature=0.9)
    assert sampled[0] != sampled[1]  # sampled choices differ (their seeds do)


def test_a_request_without_seed_samples_with_a_fresh_one_it_reports(tiny_text_run, client):
    body = {"prompt": "The city", "max_tokens": 8, "temperature": 1.0}
    first, second = (client.post("/v1/completions", json=body).json()["choices"][0] for _ in range(2))
    assert first["rdepth"]["seed"] != second["rdepth"]["seed"] and first["text"] != second["text"]
    for choice in (first, second):  # the reported seed reproduces it
        assert choice["text"] == decoded(tiny_text_run, "The city", 8, seed=choice["rdepth"]["seed"], temperature=1.0)
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]
    assert greedy["rdepth"]["seed"] == 0 and greedy["text"] == decoded(tiny_text_run, "The city", 8)


# ---------------------------------------------------------------- log-probabilities


def dense_logprobs(run, served, ids: list[int], seed: int = 0) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 (``[T - 1]``) and the log-softmax rows (``[T - 1, V]``), from one dense
    forward at the server's budget with the noise of sequence ``seed``."""
    model, _ = load_model(run)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]), loop_counts=served.runner.engine.k_max,
                       noise=StateNoise(0, [seed])).logits[0]
    rows = F.log_softmax(logits.float(), dim=-1)
    return rows.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], rows


def test_echo_with_max_tokens_0_scores_the_prompt(tiny_text_run, served, client):
    """``echo`` + ``max_tokens`` 0 + ``logprobs`` (what lm-eval's loglikelihood reads): the prompt's text, its
    tokens' log-probabilities from the model's own dense forward (the first: none), the top ones, offsets."""
    prompt = "The city of the river is old"
    ids = served.tokenizer.encode(prompt)
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3,
                                                     "temperature": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length" and choice["rdepth"]["steps"] == []
    assert response.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    expected, rows = dense_logprobs(tiny_text_run, served, ids)
    assert logprobs["tokens"] == [served.tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-4)
    for position, top in enumerate(logprobs["top_logprobs"][1:]):
        best, want = rows[position].topk(3), {}
        for token, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            want.setdefault(served.tokenizer.decode([token]), value)  # (of tokens with one text, the likelier)
        assert set(want) <= set(top) and [top[k] for k in want] == pytest.approx(list(want.values()), abs=1e-4)
    assert logprobs["text_offset"] == [len(served.tokenizer.decode(ids[:i])) for i in range(len(ids))]


def test_new_tokens_logprobs_are_the_models_streamed_or_not(tiny_text_run, served, client):
    """``logprobs`` 2: each new token (the batch-1 decoder's) with its log-probability from the model's dense
    forward over the prompt and the tokens before it, the two likeliest (greedy: the chosen one is the first),
    its offset in the text; a stream's chunks carry the same, token by token."""
    body = {"prompt": "A river flows", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    model, _ = load_model(tiny_text_run)
    prompt = served.tokenizer.encode("A river flows")
    new = generate(model, torch.tensor([prompt]), 6, temperature=0, noise=StateNoise(0, [0]))[0, len(prompt):]
    new = new.tolist()[:len(logprobs["tokens"])]  # (to the end token, where the model chose it)
    assert logprobs["tokens"] == [served.tokenizer.decode([t]) for t in new]
    assert len(new) == len(choice["rdepth"]["steps"]) and (len(new) == 6 or new[-1] == served.tokenizer.eot_id)
    expected, _ = dense_logprobs(tiny_text_run, served, prompt + new)
    assert logprobs["token_logprobs"] == pytest.approx(expected[len(prompt) - 1:].tolist(), abs=1e-4)
    for value, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert value == max(top.values()) and len(top) == 2  # greedy: the chosen token is the likeliest
    text_tokens = [t for t in new if t != served.tokenizer.eot_id]
    assert logprobs["text_offset"][:len(text_tokens)] == [len(served.tokenizer.decode(text_tokens[:i]))
                                                          for i in range(len(text_tokens))]
    chunks = streamed(client, body)
    per_token = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [p["token_logprobs"][0] for p in per_token] == logprobs["token_logprobs"]
    assert [p["text_offset"][0] for p in per_token] == logprobs["text_offset"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "logprobs"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
])
def test_logprobs_and_scoring_requests_out_of_bounds_are_400s(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------- the asyncio bridge and cancellation


@pytest.mark.parametrize("tick", ["eager", "static"])
def test_a_cancelled_request_frees_its_slot_at_the_next_tick(tick):
    """Two slots under an exit rule (rows mid-loop at their own steps), a request in its 20-token prompt and a
    third waiting: cancelled, the first ends in the next tick with no token and the waiting one takes its slot
    in that tick, then decodes as it does alone (tokens and loop steps); a queued request cancelled leaves the
    queue at once. Before, a cancelled request held its slot to the end of its prompt and its first new token."""
    model = tiny_model()

    def engine(width: int) -> Engine:
        rule = controller_factory("step_norm_rel", 0.3, (6, 6), lambda: model.readout)
        return Engine(model, width, controller_factory=rule, tick=tick)

    requests = [Request(list(range(1, 21)), max_tokens=5, sequence_id=3),
                Request([5, 6, 7, 8], max_tokens=6, sequence_id=4), Request([9, 10, 11], max_tokens=6, sequence_id=5)]
    shared = engine(2)
    first, *_ = [shared.add_request(r) for r in requests]
    for _ in range(7):
        assert shared.step() == []
    shared.cancel(first)
    done = shared.step()
    assert [(d.request_id, d.finish_reason, d.tokens) for d in done] == [(first, "cancelled", [])]
    assert shared.in_flight() == 2 and not shared.queue
    results = {d.request_id: d for d in shared.run()}
    for request_id, request in ((1, requests[1]), (2, requests[2])):
        alone = engine(1)
        alone.add_request(request)
        expected = next(iter(alone.run()))
        assert (results[request_id].tokens, results[request_id].steps) == (expected.tokens, expected.steps)
    queued = shared.add_request(Request([4, 5], max_tokens=2))
    shared.cancel(queued)
    assert [(d.request_id, d.finish_reason) for d in shared.step()] == [(queued, "cancelled")]


def test_no_thread_waits_for_a_choice(served, monkeypatch):
    """Twelve choices decoded at once through the app on its own event loop: the engine's events reach them
    through asyncio queues, so the loop's default executor never starts (before: one pool thread per waiting
    choice, up to the pool's size)."""
    import time

    step = served.runner.engine.step
    monkeypatch.setattr(served.runner.engine, "step", lambda: (time.sleep(0.01), step())[1])
    app = build_app(served)

    async def request():
        loop = asyncio.get_running_loop()
        before = {t.ident for t in threading.enumerate()}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            response = await http.post("/v1/completions", json={"prompt": ["The city", "A river"], "n": 6,
                                                                "max_tokens": 4, "temperature": 0})
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        return response, started, getattr(loop, "_default_executor", None)

    response, started, executor = asyncio.run(request())
    assert response.status_code == 200 and len(response.json()["choices"]) == 12
    assert executor is None and not [name for name in started if name.startswith("asyncio")], started
