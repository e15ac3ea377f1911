"""rdepth serve --speculate K: loop speculation for a lone greedy request (the engine's rounds on its slot's cache
row). Its answers, log-probabilities and depth reports equal the server's without speculation; /metrics counts the
rounds and drafts; a sampled request speculates where every slot may (and repeats itself); the flags that need it,
or a tick that cannot run it, are one-line errors."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from rdepth.errors import RdepthError
from rdepth.serve.api import build_app
from rdepth.serve.config import ServeConfig
from rdepth.serve.server import served_model

PROMPTS = ["The city", "In 1900 the", "A river flows"]


@pytest.mark.parametrize("policy", [{}, {"exit": "step_norm_rel", "tau": 0.3, "k_max": (4,)}])
def test_a_lone_request_speculates_and_answers_as_without(tiny_text_run, policy):
    made = [served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=2, device="cpu", name="tiny",
                                     **policy, **extra)) for extra in ({}, {"speculate": 3, "draft_loops": "1"})]
    try:
        answers = []
        for served in made:
            client = TestClient(build_app(served))
            texts, reported = [], []
            for prompt in PROMPTS:  # one at a time: each request alone in the engine
                response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                                 "temperature": 0, "logprobs": 0})
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                texts.append((choice["text"], choice["rdepth"]["steps"],
                              [round(x, 5) for x in choice["logprobs"]["token_logprobs"]]))
                reported.append(choice["rdepth"].get("speculation"))
            answers.append(texts)
            metrics = {line.split()[0]: int(float(line.split()[-1])) for line in client.get("/metrics").text.splitlines()
                       if line.startswith("rdepth_speculation_")}
            answers[-1].append(metrics["rdepth_speculation_rounds_total"])
            # each answer's depth report counts its own rounds: together /metrics' counters
            if served is made[0]:
                assert reported == [None] * len(PROMPTS)
                continue
            for key in ("rounds", "drafted", "accepted"):
                assert sum(one[key] for one in reported) == metrics[f"rdepth_speculation_{key}_total"]
            assert all(one["rounds"] > 0 and one["acceptance"] == one["accepted"] / one["drafted"] for one in reported)
            # streamed: the last chunk carries the same counts (the same greedy request, alone again)
            with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8,
                                                                "temperature": 0, "stream": True}) as streamed:
                chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                          if line.startswith("data: {")]
            assert chunks[-1]["choices"][0]["rdepth"]["speculation"] == reported[0]
            assert all("speculation" not in chunk["choices"][0]["rdepth"] for chunk in chunks[:-1])
        plain, speculated = answers
        assert speculated[:-1] == plain[:-1]
        assert plain[-1] == 0 and speculated[-1] > 0
    finally:
        for served in made:
            served.runner.stop()


@pytest.mark.parametrize("flags, words", [({"draft_loops": "1"}, "give --speculate too"),
                                          ({"speculate_at_most": 2}, "give --speculate too"),
                                          ({"speculate": 2, "tick": "static"}, "--speculate runs on the eager tick"),
                                          ({"speculate": 0}, "speculate must be an integer in")])
def test_speculation_flags_it_cannot_run_are_one_line_errors(tiny_text_run, flags, words):
    with pytest.raises(RdepthError, match=words):
        ServeConfig(checkpoint=str(tiny_text_run), **flags)


def test_a_draft_budget_at_the_servers_is_refused_at_start(tiny_text_run):
    with pytest.raises(RdepthError, match="draft"):
        served_model(ServeConfig(checkpoint=str(tiny_text_run), device="cpu", loops=2, speculate=2, draft_loops="2"))


def test_a_sampled_request_speculates_where_every_slot_may_and_repeats_itself(tiny_text_run):
    """--speculate-at-most at the batch size: a sampled request runs rounds (rejection sampling), its text the same
    each time it is sent with its seed, and not always plain sampling's; below the batch size it samples plainly."""
    configs = [{}, {"speculate": 3, "draft_loops": "1", "speculate_at_most": 2},
               {"speculate": 3, "draft_loops": "1", "speculate_at_most": 1}]
    made = [served_model(ServeConfig(checkpoint=str(tiny_text_run), batch_size=2, device="cpu", name="tiny", **extra))
            for extra in configs]
    try:
        texts, rounds = [], []
        for served in made:
            client = TestClient(build_app(served))
            sent = []
            for seed in (1, 2, 3, 1):
                response = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 10,
                                                                 "temperature": 1.0, "seed": seed})
                assert response.status_code == 200, response.text
                sent.append(response.json()["choices"][0]["text"])
            texts.append(sent)
            metrics = client.get("/metrics").text
            rounds.append(int(next(line.split()[-1] for line in metrics.splitlines()
                                   if line.startswith("rdepth_speculation_rounds_total"))))
        plain, speculated, limited = texts
        assert speculated[0] == speculated[3] and speculated != plain and rounds[1] > 0
        assert limited == plain and rounds[2] == 0
    finally:
        for served in made:
            served.runner.stop()
