"""``rdepth serve`` under hostile clients: whatever a request holds, the answer is OpenAI's error body (4xx for
the client's fault, with nothing in the log; 500 for the server's own), a body's size is bounded before it is
parsed, a prompt's length before it is tokenised, the choices of a request by --max-choices; a client that
leaves has its choices cancelled; a port in use or a host that does not resolve is one line and exit 2; and a
normal request after all of it gets the answer it gets from a server that saw none of it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import sigint_at_default, tiny_model
from fastapi.testclient import TestClient

from rdepth.cli.main import main
from rdepth.data.task_vocab import TaskVocab
from rdepth.engine import Engine
from rdepth.errors import RdepthError
from rdepth.serve.api import CHARS_PER_POSITION, ServedModel, build_app
from rdepth.serve.config import ServeConfig
from rdepth.serve.runner import EngineRunner
from rdepth.serve.server import served_model

ROOT = Path(__file__).resolve().parents[1]
NORMAL = {"model": "tiny", "prompt": ["The city", "A river"], "max_tokens": 5, "temperature": 0.9, "seed": 7,
          "n": 2}
DEEP = b"[" * 100_000 + b"]" * 100_000
SURROGATE_PROMPT = b'{"prompt": "abc \\ud800 def"}'
LIMIT = 4 * 1024 * 1024  # the default --max-body-bytes


@pytest.fixture(scope="module")
def served(tiny_text_run):
    made = served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=2, device="cpu", name="tiny"))
    yield made
    made.runner.stop()


@pytest.fixture(scope="module")
def client(served):
    return TestClient(build_app(served), raise_server_exceptions=True)


def answer(response) -> list:
    """What a completion answers, less its id and time: each choice's text, finish reason and depth."""
    assert response.status_code == 200, response.text
    return [(c["text"], c["finish_reason"], c["rdepth"]["steps"]) for c in response.json()["choices"]]


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = json.loads(response.content)
    assert set(body["error"]) == {"message", "type", "param", "code"} and "Traceback" not in body["error"]["message"]
    return body["error"]


def asgi_post(app, chunks: list[bytes], headers: tuple = (), leave=None) -> tuple[int, bytes, int]:
    """POST /v1/completions straight to the ASGI app, its body in ``chunks``; once the body is read, the client
    disconnects when the coroutine ``leave()`` returns (never, without it). Returns the status sent, the body
    sent and how many chunks the app read."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"test"), (b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    read, sent = [0], []

    async def receive():
        if read[0] < len(chunks):
            read[0] += 1
            return {"type": "http.request", "body": chunks[read[0] - 1], "more_body": read[0] < len(chunks)}
        await (leave() if leave else asyncio.Event().wait())
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), read[0]


def wait_until(condition, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


# ---------------------------------------------------------------- item 1: every failure an error body


@pytest.mark.parametrize("content, status, param, words", [
    (DEEP, 400, None, "nests too deeply"),  # json.loads: RecursionError
    (SURROGATE_PROMPT, 400, "prompt", "lone surrogate"),  # the tokenizer: TypeError
    (b'{"model": "\\ud800", "prompt": "x"}', 404, "model", "not served here"),  # a message UTF-8 cannot encode
    (b'{"prompt": "x", "\\udfff": 1}', 400, "\udfff", "unknown field"),
    (b'{"prompt": {"a": 1}}', 400, "prompt", "must be a string"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "must be in"),
    (b'\xff\xfe{}', 400, None, "not valid JSON"),
])
def test_a_clients_fault_is_an_error_body_and_nothing_in_the_log(client, caplog, content, status, param, words):
    with caplog.at_level(logging.WARNING):
        response = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    body = error(response, status)
    assert body["param"] == param and words in body["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_word_outside_a_task_vocabulary_is_a_400(caplog):
    """The task vocabulary's RdepthError for a word it lacks ("cat"), the same line the CLI prints; a prompt in
    the vocabulary is answered as before it."""
    vocab = TaskVocab("task:chase")
    runner = EngineRunner(Engine(tiny_model(vocab_size=vocab.vocab_size), 2)).start()
    try:
        client = TestClient(build_app(ServedModel("task", vocab, runner, 32, {})))
        good = {"prompt": "a > b ; ? a =", "max_tokens": 3, "temperature": 0}
        before = answer(client.post("/v1/completions", json=good))
        with caplog.at_level(logging.WARNING):
            body = error(client.post("/v1/completions", json={"prompt": "a > cat ; ? a ="}), 400)
        assert body["param"] == "prompt" and body["message"] == "'cat' is not a token of the task vocabulary"
        assert not caplog.records
        assert answer(client.post("/v1/completions", json=good)) == before
    finally:
        runner.stop()


def test_the_servers_own_fault_is_a_500_error_body_logged_once(served, client, caplog, monkeypatch):
    """A tokenizer that raises what nobody expects: 500, type server_error, the exception's type named and
    its text and traceback kept in the log; streamed, the status is sent already, so the fault is the last
    event. The next request is answered."""
    normal = answer(client.post("/v1/completions", json=NORMAL))
    monkeypatch.setattr(served.tokenizer, "encode", lambda text: 1 / 0)
    with caplog.at_level(logging.WARNING):
        body = error(client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert body["type"] == "server_error" and "ZeroDivisionError" in body["message"]
    assert len(caplog.records) == 1 and caplog.records[0].exc_info[0] is ZeroDivisionError
    monkeypatch.undo()
    monkeypatch.setattr(served.tokenizer, "decode", lambda ids: 1 / 0)
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert json.loads(lines[-1][len("data: "):])["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert answer(client.post("/v1/completions", json=NORMAL)) == normal


def test_a_failed_engine_is_a_500_for_every_request_never_a_hang(tiny_text_run, caplog):
    """An exception out of the engine's tick (a device lost, a bug): the requests in flight and every later
    one end with a 500 server_error at once (before, they waited forever), one traceback in the log, /health
    says 503 "failed", a stream's last event is the error."""
    served = served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=2, device="cpu", name="tiny"))
    try:
        def broken():
            raise RuntimeError("device lost")

        served.runner.engine.step = broken
        app = build_app(served)
        request = json.dumps({"prompt": ["The city", "A river"], "max_tokens": 3}).encode()
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                status, body, _ = asgi_post(app, [request])
                assert status == 500 and json.loads(body)["error"] == {
                    "message": "the engine failed (RuntimeError); restart the server", "type": "server_error",
                    "param": None, "code": None}
        assert [r.exc_info[0] for r in caplog.records] == [RuntimeError]
        client = TestClient(app)
        assert client.get("/health").status_code == 503 and client.get("/health").json()["status"] == "failed"
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        assert json.loads(lines[-1][len("data: "):])["error"]["type"] == "server_error"
    finally:
        served.runner.stop()


# ---------------------------------------------------------------- item 2: a body and a prompt bounded


def test_a_body_over_the_limit_is_413_before_it_is_read_or_parsed(served):
    """A declared Content-Length over --max-body-bytes: refused before a byte is read. A chunked body (no
    length): refused once it passes the limit, the rest never read (8 MiB offered in 64 KiB chunks)."""
    app = build_app(served)
    status, body, read = asgi_post(app, [b"x" * 1024], headers=((b"content-length", str(LIMIT + 1).encode()),))
    assert status == 413 and read == 0 and "--max-body-bytes" in json.loads(body)["error"]["message"]
    chunk = b" " * 65536
    status, body, read = asgi_post(app, [chunk] * (2 * LIMIT // len(chunk)))
    assert status == 413 and read == LIMIT // len(chunk) + 1
    status, body, read = asgi_post(app, [b'{"prompt": [1, 2], "max_tokens": 2', b', "temperature": 0}'])
    assert status == 200 and read == 2 and len(json.loads(body)["choices"][0]["rdepth"]["steps"]) == 2


def test_a_string_prompt_is_bounded_before_tokenising_and_tokenised_off_the_event_loop(served, client, monkeypatch):
    calls = []
    encode = served.tokenizer.encode

    def spy(text):
        try:
            asyncio.get_running_loop()
            calls.append("on the event loop")
        except RuntimeError:
            calls.append("off the event loop")
        return encode(text)

    monkeypatch.setattr(served.tokenizer, "encode", spy)
    limit = CHARS_PER_POSITION * served.context
    body = error(client.post("/v1/completions", json={"prompt": "a" * (limit + 1)}), 400)
    assert body["param"] == "prompt" and f"{limit + 1} characters" in body["message"] and f"({limit}:" in \
        body["message"]
    assert calls == []
    assert client.post("/v1/completions", json={"prompt": "The city", "max_tokens": 1}).status_code == 200
    assert calls == ["off the event loop"]


# ---------------------------------------------------------------- item 4: choices per request bounded


def test_the_choices_of_a_request_are_bounded_by_max_choices(served, client, capsys):
    for prompts, n, param in ((65, 1, "prompt"), (9, 8, "n"), (5000, 8, "prompt")):
        body = error(client.post("/v1/completions", json={"prompt": ["x"] * prompts, "n": n}), 400)
        assert body["param"] == param
        assert body["message"] == (f"a request may ask for at most 64 choices (prompts x n: --max-choices), this "
                                   f"one asks for {prompts} x {n} = {prompts * n}")
    assert len(client.post("/v1/completions", json={"prompt": ["x"] * 8, "n": 8, "max_tokens": 1}).json()[
        "choices"]) == 64
    with pytest.raises(RdepthError, match="--max-n 100 exceeds --max-choices 64"):
        ServeConfig(checkpoint="x", max_n=100)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-choices INT the most choices a request may ask for in all (its prompts x n) (default: 64)" in \
        help_text
    assert "--max-body-bytes INT the largest request body taken" in help_text and "(default: 4194304)" in help_text


# ---------------------------------------------------------------- item 3: a client that leaves


def slowed(engine, seconds: float = 0.05):
    """``engine.step`` at least ``seconds`` a tick (the tiny model decodes a request in milliseconds)."""
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    return slow


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(served, monkeypatch):
    """Two choices of up to 24 tokens, 50 ms a tick; the client leaves after their first tokens: both are
    cancelled within a few ticks (24 tokens each before), their slots freed, and the app answers nobody (499)."""
    runner = served.runner
    monkeypatch.setattr(runner.engine, "step", slowed(runner.engine))
    tokens, finished = runner.metrics["tokens_generated"], runner.metrics["requests"]

    async def after_first_tokens():
        while runner.metrics["tokens_generated"] < tokens + 2:
            await asyncio.sleep(0.005)

    request = json.dumps({"prompt": "x", "max_tokens": 24, "n": 2}).encode()
    status, _, _ = asgi_post(build_app(served), [request], leave=after_first_tokens)
    wait_until(lambda: runner.metrics["requests"] == finished + 2)
    assert status == 499 and runner.engine.in_flight() == 0 and runner.queue_length() == 0
    assert runner.metrics["tokens_generated"] - tokens <= 2 * 12  # a few ticks after the disconnect (slack: load)


# ---------------------------------------------------------------- every case in turn, then a normal request


def test_every_hostile_case_in_turn_leaves_the_normal_answer_unchanged(tiny_text_run, served, monkeypatch):
    """One app takes each case above in turn; then a normal request (two prompts, n=2, sampled) gets the answer
    a fresh server gives it."""
    fresh = served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=2, device="cpu", name="tiny"))
    try:
        expected = answer(TestClient(build_app(fresh)).post("/v1/completions", json=NORMAL))
    finally:
        fresh.runner.stop()
    app = build_app(served)
    client = TestClient(app)
    hostile = [DEEP, SURROGATE_PROMPT, b'{"model": "\\ud800"}', b'{"prompt": {"a": 1}}',
               json.dumps({"prompt": ["x"] * 5000, "n": 8}).encode(),
               json.dumps({"prompt": "a" * (CHARS_PER_POSITION * served.context + 1)}).encode(),
               json.dumps({"prompt": "word " * 60}).encode(), b"{not json"]
    for content in hostile:
        assert 400 <= client.post("/v1/completions", content=content).status_code < 500
    assert asgi_post(app, [b" " * 65536] * 100)[0] == 413
    assert asgi_post(app, [b"{}"], headers=((b"content-length", b"999999999999"),))[0] == 413
    runner = served.runner
    monkeypatch.setattr(runner.engine, "step", slowed(runner.engine))
    tokens, finished = runner.metrics["tokens_generated"], runner.metrics["requests"]

    async def after_a_token():
        while runner.metrics["tokens_generated"] == tokens:
            await asyncio.sleep(0.005)

    assert asgi_post(app, [json.dumps({"prompt": "x", "max_tokens": 24}).encode()], leave=after_a_token)[0] == 499
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 24, "stream": True}) as response:
        next(response.iter_lines())  # one event, then the client leaves
    wait_until(lambda: runner.metrics["requests"] == finished + 2)
    monkeypatch.undo()
    assert answer(client.post("/v1/completions", json=NORMAL)) == expected


# ---------------------------------------------------------------- item 10 and a real server over sockets


def test_a_port_in_use_or_a_host_that_does_not_resolve_is_one_line_and_exit_2(tiny_text_run, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--checkpoint", str(tiny_text_run), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"rdepth serve: error: serve: port {port} on 127.0.0.1 is in use (another server?): choose " \
                  "another --port\n"
    assert main(["serve", "--checkpoint", str(tiny_text_run), "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host 'no-such-host.invalid' does not resolve" in err


SLOW_SERVER = """
import sys, time
from rdepth.engine import Engine
step = Engine.step
Engine.step = lambda self: (time.sleep(0.05), step(self))[1]
from rdepth.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_real_server_over_sockets(tiny_text_run, tmp_path):
    """``rdepth serve`` in its own process, uvicorn on the socket bound first: hostile requests over real
    connections (a chunked body over the limit, JSON 100,000 deep, a lone surrogate, a client that leaves a
    non-streamed request) leave no traceback and no ERROR in its log, the leaver's choice is cancelled, a
    normal request is answered as before them, and Ctrl-C ends it with status 130."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as handle:
        server = subprocess.Popen([sys.executable, "-c", SLOW_SERVER, "serve", "--checkpoint", str(tiny_text_run),
                                   "--port", str(port), "--device", "cpu", "--threads", "1", "--name", "tiny"],
                                  stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  preexec_fn=sigint_at_default)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            wait_until(lambda: _healthy(client, server), timeout=120)
            normal = answer(client.post("/v1/completions", json=NORMAL))
            chunks = (b" " * 65536 for _ in range(100))  # a generator: sent chunked, no Content-Length
            assert client.post("/v1/completions", content=chunks).status_code == 413
            assert client.post("/v1/completions", content=DEEP).status_code == 400
            assert client.post("/v1/completions", content=SURROGATE_PROMPT).status_code == 400

            def metric(name: str) -> float:
                text = client.get("/metrics").text
                return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

            tokens, finished = metric("rdepth_tokens_generated_total"), metric("rdepth_requests_total")
            body = json.dumps({"prompt": "x", "max_tokens": 24}).encode()
            with socket.create_connection(("127.0.0.1", port)) as leaver:
                leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                wait_until(lambda: metric("rdepth_tokens_generated_total") > tokens)
            wait_until(lambda: metric("rdepth_requests_total") == finished + 1)
            assert metric("rdepth_tokens_generated_total") - tokens <= 12  # of 24
            assert answer(client.post("/v1/completions", json=NORMAL)) == normal
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 130
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text
    assert text.count('"POST /v1/completions HTTP/1.1" 400') == 2 and "413" in text


def _healthy(client: httpx.Client, server: subprocess.Popen) -> bool:
    assert server.poll() is None, "the server ended"
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False
