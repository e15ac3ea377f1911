"""``rdepth serve`` through OpenAI's own Python client (``openai``), as a user calls it: completions (greedy, a
depth of its own through ``extra_body``, log-probabilities, streaming) equal the batch-1 decode; every refusal
raises the client's exception class for its status, with the field named; the chat route is a NotFoundError on a
model without a chat template."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_serve_depth import alone

from rdepth.run.checkpoint import load_model
from rdepth.serve.api import build_app
from rdepth.serve.config import ServeConfig
from rdepth.serve.server import served_model

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(tiny_text_run):
    served = served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=2, device="cpu", name="tiny",
                                      max_loops=4, allow_exits="kl:0.1"))
    http = TestClient(build_app(served))
    yield openai.OpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http, max_retries=0)
    served.runner.stop()


@pytest.fixture(scope="module")
def model(tiny_text_run):
    return load_model(tiny_text_run)[0]


def test_completions_equal_the_batch_1_decode_at_the_depth_asked(client, model, tiny_text_run):
    plain = client.completions.create(model="tiny", prompt="The city", max_tokens=5, temperature=0)
    assert plain.choices[0].text == alone(tiny_text_run, model, "The city", 5, {"loops": [2, 2]})[0]
    deep = client.completions.create(model="tiny", prompt="The city", max_tokens=5, temperature=0,
                                     extra_body={"rdepth": {"loops": 4}})
    assert deep.choices[0].text == alone(tiny_text_run, model, "The city", 5, {"loops": [4, 4]})[0]
    ruled = client.completions.create(model="tiny", prompt="The city", max_tokens=5, temperature=0,
                                      extra_body={"rdepth": {"exit": "kl", "tau": 0.05, "k_max": 3}})
    policy = {"exit": "kl", "tau": 0.05, "k_max": [3, 3]}
    text, _, logprobs = alone(tiny_text_run, model, "The city", 5, policy)
    assert ruled.choices[0].text == text
    scored = client.completions.create(model="tiny", prompt="The city", max_tokens=5, temperature=0, logprobs=2,
                                       extra_body={"rdepth": {"exit": "kl", "tau": 0.05, "k_max": 3}})
    got = scored.choices[0].logprobs
    assert len(got.token_logprobs) == len(got.top_logprobs) and all(len(top) == 2 for top in got.top_logprobs)
    assert got.token_logprobs[: len(logprobs)] == pytest.approx(logprobs[: len(got.token_logprobs)], abs=1e-5)


def test_a_stream_joins_to_the_full_text(client):
    full = client.completions.create(model="tiny", prompt="In 1900 the", max_tokens=8, temperature=0)
    stream = client.completions.create(model="tiny", prompt="In 1900 the", max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == full.choices[0].text


def test_refusals_raise_the_clients_exception_classes(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body={"rdepth": {"loops": 99}})
    assert error.value.body["param"] == "rdepth.loops"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="a", max_tokens=2,
                                  extra_body={"rdepth": {"exit": "cosine", "tau": 0.1}})
    assert error.value.body["param"] == "rdepth.exit"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="a", max_tokens=2)
    with pytest.raises(openai.NotFoundError):  # the tiny run's tokenizer carries no chat template
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert client.completions.create(model="tiny", prompt="a", max_tokens=1).choices[0].finish_reason in (
        "length", "stop")


@pytest.fixture(scope="module")
def over_a_socket(tiny_text_run, tmp_path_factory):
    """The OpenAI client against ``rdepth serve`` in its own process, over 127.0.0.1."""
    from serve_helpers import serve_process

    with serve_process(tiny_text_run, tmp_path_factory.mktemp("openai_socket"), "--batch-size", "3", "--name",
                       "tiny", "--max-loops", "4", "--allow-exits", "kl:0.1") as port:
        yield openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=120)


def test_over_a_socket_several_prompts_streamed_and_not(over_a_socket, model, tiny_text_run):
    """Three prompts in one request, their choices each the batch-1 decode at the depth asked; the same request
    streamed: each choice's chunks (told apart by index) join to its text."""
    prompts = ["The city", "In 1900 the", "A river flows"]
    depth = {"rdepth": {"loops": 3}}
    full = over_a_socket.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                            extra_body=depth)
    texts = {choice.index: choice.text for choice in full.choices}
    assert texts == {i: alone(tiny_text_run, model, p, 6, {"loops": [3, 3]})[0] for i, p in enumerate(prompts)}
    streamed: dict[int, str] = {}
    for chunk in over_a_socket.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                                  stream=True, extra_body=depth):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == texts
    with pytest.raises(openai.BadRequestError) as error:
        over_a_socket.completions.create(model="tiny", prompt=prompts, max_tokens=2, extra_body={"rdepth": {"loops": 9}})
    assert error.value.body["param"] == "rdepth.loops"


@pytest.mark.parametrize("flags", [("--tick", "static", "--ahead", "2"), ("--speculate", "2", "--draft-loops", "1"),
                                   ("--tick", "token")], ids=["ahead", "speculate", "token"])
def test_over_a_socket_the_fast_paths_answer_as_the_batch_1_decode(flags, model, tiny_text_run, tmp_path):
    """The static tick running 2 ticks a call, loop speculation for a lone request, the token tick: the OpenAI client over
    127.0.0.1, several prompts in one request (and one alone), streamed and not, each choice the batch-1 decode at
    the server's budget; the speculating server counts its rounds in /metrics."""
    import httpx
    from serve_helpers import serve_process

    from rdepth.engine import Engine

    loops = {"loops": Engine(model, 1).k_max}  # the server's own budget: the run's eval loops
    prompts = ["The city", "In 1900 the", "A river flows"]
    expected = {i: alone(tiny_text_run, model, p, 6, loops)[0] for i, p in enumerate(prompts)}
    with serve_process(tiny_text_run, tmp_path, "--batch-size", "3", "--name", "tiny", *flags) as port:
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=120)
        alone_text = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=6, temperature=0)
        assert alone_text.choices[0].text == expected[1]
        full = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0)
        assert {choice.index: choice.text for choice in full.choices} == expected
        # each choice's depth report: its own speculation counts where the server speculates, none otherwise
        reports = [choice.model_extra["rdepth"].get("speculation") for choice in full.choices]
        assert all((report is not None) == ("--speculate" in flags) for report in reports)
        streamed: dict[int, str] = {}
        for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        assert streamed == expected
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    rounds = int(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("rdepth_speculation_rounds_total")))
    assert (rounds > 0) == ("--speculate" in flags)
