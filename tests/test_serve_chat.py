"""``/v1/chat/completions`` (issue 63, item 3): an imported Huginn (raven) or Ouro folder keeps its tokenizer's chat
template; the server renders a conversation with it, reads the template's special tokens as themselves, and
answers what ``/v1/completions`` answers for the rendered prompt's tokens (the batch-1 decode), streamed or
not; the template's end of turn ends the answer; a conversation the template refuses is a 400 naming
``messages``; a model without a template answers 404 (tests/test_serve.py)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from test_hf_helpers import cli, tiny_tokenizer
from test_serve_round2 import ScriptedEngine, streamed
from tokenizers import AddedToken, Tokenizer

from rdepth.data.tokenizers import BpeTokenizer
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise
from rdepth.run.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate
from rdepth.run.checkpoint import load_model
from rdepth.serve.api import ServedModel, build_app
from rdepth.serve.chat import ChatRenderer
from rdepth.serve.config import ServeConfig
from rdepth.serve.runner import EngineRunner
from rdepth.serve.server import served_model

TEMPLATE = ("{% for message in messages %}"
            "{% if message['role'] == 'tool' %}{{ raise_exception('this model takes no tool turns') }}{% endif %}"
            "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The old castle"}]


def chat_tokenizer_json() -> str:
    """The tiny BPE with the template's two markers added as special tokens (ids 320 and 321)."""
    hf = Tokenizer.from_str(tiny_tokenizer()._tokenizer.to_str())
    hf.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return hf.to_str()


def hub_folder(folder, writer, **fields):
    """A hub folder written by ``writer`` with the chat tokenizer and a ``tokenizer_config.json`` holding the
    template (its end of turn the eos token, as Ouro's is)."""
    writer(folder, seed=3, tokenizer_json=chat_tokenizer_json(), vocab_size=tiny_tokenizer().vocab_size + 2, **fields)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": None,
                                                              "eos_token": {"content": "<|im_end|>"}}))
    return folder


@pytest.fixture(scope="module")
def huginn(tmp_path_factory):
    from rdepth.interop.hf_raven import write_raven_folder

    root = tmp_path_factory.mktemp("chat")
    folder = hub_folder(root / "raven", write_raven_folder)
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", root / "run") == 0
    served = served_model(ServeConfig(checkpoint=str(root / "run"), batch_size=2, device="cpu", name="huginn"))
    yield root / "run", served, TestClient(build_app(served))
    served.runner.stop()


def rendered_ids() -> list[int]:
    """:data:`MESSAGES` through :data:`TEMPLATE`, tokenised by hand: the markers as their ids, the rest literally."""
    tokenizer, start, end = tiny_tokenizer(), 320, 321
    ids = []
    for message in MESSAGES:
        ids += [start] + tokenizer.encode(f"{message['role']}\n{message['content']}") + [end] + tokenizer.encode("\n")
    return ids + [start] + tokenizer.encode("assistant\n")


def test_the_import_keeps_the_template_and_the_server_renders_it(huginn):
    run, served, client = huginn
    kept = json.loads((run / "tokenizer" / CHAT_TEMPLATE_FILE).read_text())
    assert kept == {"chat_template": TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>"}
    assert served.end_tokens == {tiny_tokenizer().eot_id, 321}
    info = client.get("/tokenizer_info").json()
    assert info["chat_template"] == TEMPLATE and client.get("/v1/models").json()["data"][0]["rdepth"]["chat_template"]
    text = served.chat.render(MESSAGES)
    assert client.post("/tokenize", json={"prompt": text}).json()["tokens"] == rendered_ids()


def test_a_chat_answer_is_the_completion_of_its_rendered_prompt(huginn):
    """Greedy, 6 tokens: the chat's content equals /v1/completions' text for the rendered prompt's ids and the
    batch-1 decode (seed 0), to the end of turn or end of text where the model writes one."""
    run, served, client = huginn
    body = {"max_tokens": 6, "temperature": 0}
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body, "model": "huginn"})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["logprobs"] is None
    completion = client.post("/v1/completions", json={"prompt": rendered_ids(), **body}).json()["choices"][0]
    assert choice["message"]["content"] == completion["text"]
    assert choice["rdepth"]["steps"] == completion["rdepth"]["steps"]
    model, _ = load_model(run)
    ids = rendered_ids()
    new = generate(model, torch.tensor([ids]), 6, temperature=0, noise=StateNoise(0, [0]))[0, len(ids):].tolist()
    ends = [i for i, t in enumerate(new) if t in served.end_tokens]
    new = new[:ends[0]] if ends else new
    assert choice["message"]["content"] == tiny_tokenizer().decode(new)
    assert answer["usage"]["prompt_tokens"] == len(ids)

    chunks = streamed(client, {"messages": MESSAGES, **body, "stream_options": {"include_usage": True}},
                      "/v1/chat/completions")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["usage"] == answer["usage"]

    scored = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body, "logprobs": True,
                                                       "top_logprobs": 2}).json()["choices"][0]
    entries = scored["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == scored["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] == e["top_logprobs"][0]["logprob"] for e in entries)


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages", "this model takes no tool turns"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "text parts"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 99}, "top_logprobs", "[0, 20]"),
    ({"messages": MESSAGES, "prompt": "x"}, "prompt", "unknown field"),
    ({"messages": MESSAGES, "model": "gpt-4"}, "model", "not served here"),
])
def test_a_bad_conversation_is_an_error_body_naming_the_field(huginn, body, param, words):
    _, _, client = huginn
    response = client.post("/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code in (400, 404) and error["param"] == param and words in error["message"]
    assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200


def test_the_end_of_turn_ends_a_chat_answer():
    """A scripted model writes "Hi there", the template's end of turn, then more: the answer is "Hi there",
    finish_reason "stop", streamed the same."""
    tokenizer = tiny_tokenizer()
    runner = EngineRunner(ScriptedEngine(tokenizer.encode("Hi there") + [321] + tokenizer.encode(" more"))).start()
    try:
        chat_tokenizer = BpeTokenizer(Tokenizer.from_str(chat_tokenizer_json()), "bpe:322")
        template = ChatRenderer(ChatTemplate(TEMPLATE, None, "<|im_end|>"))
        served = ServedModel("scripted", chat_tokenizer, runner, 64, {"loops": [1]}, chat=template)
        client = TestClient(build_app(served))
        body = {"messages": MESSAGES, "max_tokens": 20}
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["message"]["content"] == "Hi there" and choice["finish_reason"] == "stop"
        chunks = streamed(client, body, "/v1/chat/completions")
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hi there"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        runner.stop()


def test_an_ouro_import_keeps_its_template_too(tmp_path, monkeypatch):
    from rdepth.interop.hf_ouro import write_ouro_folder

    folder = hub_folder(tmp_path / "ouro", write_ouro_folder, max_position_embeddings=64)
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run") == 0
    kept = json.loads((tmp_path / "run" / "tokenizer" / CHAT_TEMPLATE_FILE).read_text())
    assert kept["chat_template"] == TEMPLATE and kept["eos_token"] == "<|im_end|>"
