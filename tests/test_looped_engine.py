"""The engine and ``rdepth serve`` on looped ``transformers`` models (rdepth.looped.engine, rdepth.serve.looped).

Every request's tokens (and kept logits, and loop steps under an exit rule) are those of the adapter's batch-1
decode, whatever shares its batch: HRM-Text with its slots in one call (a fixed budget, a smaller one, exit
rules on both loops), Inkling-2 with a call per slot. Tiny random folders from the per-model test files.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not (hasattr(transformers, "HrmTextForCausalLM") and hasattr(transformers, "Inkling2LoopForCausalLM")):
    pytest.skip("this transformers has no HrmTextForCausalLM or Inkling2LoopForCausalLM", allow_module_level=True)

from test_hf_helpers import cli, one_line_error  # noqa: E402  (sets HF_HUB_OFFLINE at import, as the suite runs)
from test_looped_hrm_text import CONFIGS as HRM_CONFIGS  # noqa: E402
from test_looped_hrm_text import folders, text_folder  # noqa: E402,F401  (folders: the HRM-Text fixture)
from test_looped_inkling2 import CONFIGS as INKLING_CONFIGS  # noqa: E402
from test_looped_inkling2 import EAGER  # noqa: E402
from test_looped_inkling2 import folders as inkling_folders  # noqa: E402,F401

from rdepth.engine.request import Depth, Request  # noqa: E402
from rdepth.errors import RdepthError  # noqa: E402
from rdepth.exits.registry import make_policy  # noqa: E402
from rdepth.looped.engine import LoopedEngine  # noqa: E402
from rdepth.looped.exits import decode_with_exits  # noqa: E402
from rdepth.looped.load import open_looped  # noqa: E402
from rdepth.looped.protocol import forward, greedy  # noqa: E402

LENGTHS = (3, 7, 1, 5, 9)  # five prompts through three slots: rows at different positions share every call
NEW = 6


def prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def run_engine(engine, asked: list[list[int]], new: int = NEW) -> list:
    for prompt in asked:
        engine.add_request(Request(prompt, max_tokens=new, keep_logits=True))
    return sorted(engine.run(), key=lambda done: done.request_id)


def assert_greedy(adapter, asked, finished, budgets=None, stepwise=False):
    """Each request's tokens are the batch-1 cached greedy decode's; its kept logits (every position read out)
    the class's forward over the whole sequence (to rounding), or with ``stepwise`` the batch-1 decode a token a
    call over the model's own cache (exactly: Inkling-2 computes parts in float32 even in a float64 model, so
    its whole-sequence and cached logits differ by ~1e-5)."""
    for prompt, done in zip(asked, finished, strict=True):
        assert done.finish_reason == "length", done.error
        whole = greedy(adapter, torch.tensor([prompt]), NEW, budgets)[0]
        assert done.tokens == whole[len(prompt):].tolist()
        with torch.no_grad():
            if stepwise:
                cache = adapter.new_cache()
                reference = torch.cat([forward(adapter, whole[None, t:t + 1], cache, budgets)[0]
                                       for t in range(len(whole) - 1)])
            else:
                reference = forward(adapter, whole[None, :-1], budgets=budgets)[0]
        torch.testing.assert_close(done.logits, reference, rtol=0, atol=0 if stepwise else 1e-12)


@pytest.mark.parametrize("name", list(HRM_CONFIGS))
def test_hrm_rows_decode_as_the_batch1_greedy_in_one_call(folders, name):  # noqa: F811
    adapter = open_looped(folders[name], torch.float64)
    asked = prompts(48)
    engine = LoopedEngine(adapter, 3)
    assert engine.tick.cache is not None  # every slot in one call
    finished = run_engine(engine, asked)
    assert_greedy(adapter, asked, finished)
    h, low = adapter.spec("H").budget, adapter.spec("L").budget
    assert all(steps == [h, h * low] for done in finished for steps in done.steps)  # H steps, L steps summed
    assert engine.stats.positions == sum(LENGTHS) + len(LENGTHS) * (NEW - 1)


def test_hrm_smaller_budget_and_float32(folders):  # noqa: F811
    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    asked = prompts(48, seed=5)
    budgets = {"H": 1, "L": 2}
    assert_greedy(adapter, asked, run_engine(LoopedEngine(adapter, 2, budgets=budgets), asked), budgets)
    single = open_looped(folders["tied_h2_l3"], torch.float32)
    finished = run_engine(LoopedEngine(single, 3), asked)
    for prompt, done in zip(asked, finished, strict=True):
        assert done.tokens == greedy(single, torch.tensor([prompt]), NEW)[0, len(prompt):].tolist()


def _rules(adapter):
    return (make_policy("cosine", tau=0.5, k_max=adapter.spec("L").budget),
            make_policy("kl", tau=0.05, k_max=adapter.spec("H").budget, decode=adapter.readout))


def _alone_with_exits(adapter, prompt: list[int]):
    """The batch-1 exit decode (the prompt teacher-forced, then a greedy token at a time): tokens, logits of every
    position read out, and (H steps, L steps summed) per position."""
    low, high = _rules(adapter)
    cache = adapter.new_cache()
    runs = [decode_with_exits(adapter, torch.tensor([prompt]), low, high, cache)]
    tokens = []
    for index in range(NEW):
        tokens.append(int(runs[-1].logits[0, -1].argmax()))
        if index + 1 < NEW:
            runs.append(decode_with_exits(adapter, torch.tensor([[tokens[-1]]]), low, high, cache))
    logits = torch.cat([run.logits[0] for run in runs])
    steps = [[int(run.high_steps[0, t]), int(run.low_steps[0, t].sum())] for run in runs
             for t in range(run.high_steps.shape[1])]
    return tokens, logits, steps


def test_hrm_exit_rules_decode_as_the_batch1_exit_decode(folders):  # noqa: F811
    """Per-token exits of both loops in the batched tick: each row's tokens, logits and steps per position are
    its batch-1 exit decode's (the rule's memory per row, the latest-KV rule at each row's own position)."""
    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    asked = prompts(48)
    low, high = _rules(adapter)
    engine = LoopedEngine(adapter, 3, low=low, high=high)
    finished = run_engine(engine, asked)
    for prompt, done in zip(asked, finished, strict=True):
        tokens, logits, steps = _alone_with_exits(adapter, prompt)
        assert done.tokens == tokens and done.steps == steps
        torch.testing.assert_close(done.logits, logits, rtol=0, atol=1e-12)
    every = [tuple(s) for done in finished for s in done.steps]
    assert len(set(every)) > 1 and min(s[1] for s in every) < 6, "the rules should stop tokens at different steps"
    assert {rule for done in finished for per in done.rules for rule in per} == {"budget", "rule"}


def test_a_reused_slot_reads_nothing_of_a_former_request(folders, monkeypatch):  # noqa: F811
    """A call reads every slot up to its furthest row's position, so a short row's slot is read past its own
    position, where a former request's entries lie; non-finite ones there would poison it (0 x inf = NaN)
    unless the slot is cleared when the request takes it."""
    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    short, long = prompts(48)[0], prompts(48)[4]

    def poisoned_then():
        engine = LoopedEngine(adapter, 2)
        run_engine(engine, [long, short])
        with torch.inference_mode():  # (the engine's tensors are made in inference mode)
            for keys in engine.tick.cache.keys.values():
                keys[1].fill_(float("inf"))  # (as a former request's non-finite entries in slot 1)
        engine.add_request(Request(long, max_tokens=NEW))  # slot 0, five positions ahead of the next
        finished = [done for _ in range(5) for done in engine.step()]
        engine.add_request(Request(short, max_tokens=NEW))  # slot 1: read as far as slot 0's position
        return sorted(finished + list(engine.run()), key=lambda done: done.request_id)

    assert [done.tokens for done in poisoned_then()] == [
        greedy(adapter, torch.tensor([p]), NEW)[0, len(p):].tolist() for p in (long, short)]
    from rdepth.looped.slot_cache import LoopedSlotCache

    monkeypatch.setattr(LoopedSlotCache, "clear", lambda self, slot: None)  # the check catches a slot left as it was
    assert [done.finish_reason for done in poisoned_then()] == ["length", "error"]


@pytest.mark.parametrize("name", list(INKLING_CONFIGS))
def test_inkling2_rows_decode_as_the_batch1_greedy_a_call_per_slot(inkling_folders, name):  # noqa: F811
    adapter = open_looped(inkling_folders[name], torch.float64, **EAGER)
    asked = prompts(44)
    engine = LoopedEngine(adapter, 3)
    assert engine.tick.cache is None  # a cache of the model's own per slot
    assert_greedy(adapter, asked, run_engine(engine, asked), stepwise=True)
    passes = adapter.spec("passes").budget
    if passes > 1:
        fewer = {"passes": passes - 1}
        assert_greedy(adapter, asked[:3], run_engine(LoopedEngine(adapter, 2, budgets=fewer), asked[:3]), fewer,
                      stepwise=True)


def test_refusals_are_one_line(folders, inkling_folders):  # noqa: F811
    hrm = open_looped(folders["tied_h2_l3"], torch.float64)
    inkling = open_looped(inkling_folders["passes3"], torch.float64, **EAGER)
    low, high = _rules(hrm)
    with pytest.raises(RdepthError, match="exits are offered for HRM-Text only"):
        LoopedEngine(inkling, 2, high=make_policy("step_norm", tau=0.1, k_max=3))
    with pytest.raises(RdepthError, match="budgets or rules, not both"):
        LoopedEngine(hrm, 2, budgets={"H": 1}, low=low)
    with pytest.raises(RdepthError, match="kl reads the prediction"):
        LoopedEngine(hrm, 2, low=make_policy("kl", tau=0.1, k_max=3, decode=hrm.readout))
    with pytest.raises(RdepthError, match="k_max 5 must be the loop's budget 3"):
        LoopedEngine(hrm, 2, low=make_policy("step_norm", tau=0.1, k_max=5))
    with pytest.raises(RdepthError, match="capacity must be 1..128"):
        LoopedEngine(hrm, 2, capacity=129)
    with pytest.raises(RdepthError, match="batch_size must be"):
        LoopedEngine(hrm, 0)
    with pytest.raises(RdepthError, match="budget of loop 'L' must be in 1..3"):
        LoopedEngine(hrm, 2, budgets={"L": 4})
    engine = LoopedEngine(hrm, 2)
    with pytest.raises(RdepthError, match="runs its own budget only"):
        engine.add_request(Request([1, 2], max_tokens=2, depth=Depth(loops=1)))
    too_long = run_engine(LoopedEngine(hrm, 1, capacity=4), [[1, 2, 3, 4, 5]])[0]
    assert too_long.finish_reason == "error" and "exceeds the engine's capacity 4" in too_long.error


# -- rdepth serve on a folder ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rdepth.serve.api import build_app
    from rdepth.serve.config import ServeConfig
    from rdepth.serve.server import served_model

    folder, _ = text_folder(tmp_path_factory.mktemp("hrm_serve"))
    made = {"fixed": served_model(ServeConfig(checkpoint=str(folder), batch_size=2, device="cpu")),
            "exit": served_model(ServeConfig(checkpoint=str(folder), batch_size=3, device="cpu", exit="step_norm_rel",
                                             tau=0.3))}
    yield folder, {key: (server, TestClient(build_app(server))) for key, server in made.items()}
    for server in made.values():
        server.runner.stop()


def test_serve_answers_as_the_adapters_decode(served):
    folder, made = served
    server, client = made["fixed"]
    adapter = open_looped(folder, torch.float32)
    text = "loop 3 turns"
    body = client.post("/v1/completions", json={"model": server.name, "prompt": [text, "and hands"], "max_tokens": 5,
                                               "temperature": 0}).json()
    for choice, prompt in zip(body["choices"], [text, "and hands"], strict=True):
        ids = list(prompt.encode())
        expected = greedy(adapter, torch.tensor([ids]), 5)[0, len(ids):].tolist()
        assert choice["text"] == server.tokenizer.decode(expected)
        assert choice["rdepth"]["steps"] == [[2, 6]] * 5
    assert body["choices"][0]["rdepth"]["policy"] == {"loops": [2, 3]}
    refused = client.post("/v1/completions", json={"model": server.name, "prompt": text, "max_tokens": 2,
                                                  "rdepth": {"loops": 1}})
    assert refused.status_code == 400 and "looped transformers folder" in refused.json()["error"]["message"]
    card = client.get("/v1/models").json()["data"][0]["rdepth"]
    assert card["policy"] == {"loops": [2, 3]} and card["depths"] == {"max_loops": None, "caps": [2, 6], "exits": {}}


def test_serve_with_an_exit_rule_reports_each_tokens_steps(served):
    folder, made = served
    server, client = made["exit"]
    body = client.post("/v1/completions", json={"model": server.name, "prompt": ["loop 3 turns", "hands on 7"] * 2,
                                               "max_tokens": 6, "temperature": 0}).json()
    steps = [tuple(s) for choice in body["choices"] for s in choice["rdepth"]["steps"]]
    assert len(steps) == 24 and all(1 <= h <= 2 and 1 <= low <= 6 for h, low in steps)
    assert body["choices"][0]["text"] == body["choices"][2]["text"]  # the same prompt, whatever shares the batch


def test_serve_refuses_flags_a_folder_does_not_read(served, monkeypatch, capsys):
    folder, _ = served
    for flag, value in (("--tick", "static"), ("--allow-exits", "kl:0.1"), ("--k-max", "3"), ("--seed", "2")):
        exit_rule = ("--exit", "step_norm_rel") if flag == "--k-max" else ()
        err = one_line_error(capsys, cli(monkeypatch, "serve", "--checkpoint", folder, flag, value, *exit_rule))
        assert f"{flag} does not apply to a looped Hugging Face folder" in err
    err = one_line_error(capsys, cli(monkeypatch, "serve", "--checkpoint", folder, "--loops", "1,2,3"))
    assert "--loops for hrm_text is H,L" in err


def test_the_openai_client_over_a_socket_several_prompts_and_a_stream(served, tmp_path):
    """``rdepth serve`` on the folder as its own process, the ``openai`` package over a real socket: two prompts in
    one request and a streamed one, each text the adapter's greedy decode."""
    openai = pytest.importorskip("openai")
    from serve_helpers import serve_process

    folder, made = served
    server = made["fixed"][0]
    adapter = open_looped(folder, torch.float32)

    def expected(text: str, new: int) -> str:
        ids = server.tokenizer.encode(text)
        return server.tokenizer.decode(greedy(adapter, torch.tensor([ids]), new)[0, len(ids):].tolist())

    prompts = ["loop 3 turns", "and hands on 7"]
    with serve_process(folder, tmp_path, "--batch-size", "2", "--name", "hrm") as port:
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
        body = client.completions.create(model="hrm", prompt=prompts, max_tokens=5, temperature=0)
        assert [choice.text for choice in sorted(body.choices, key=lambda c: c.index)] == \
            [expected(text, 5) for text in prompts]
        chunks = client.completions.create(model="hrm", prompt=prompts[0], max_tokens=6, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in chunks) == expected(prompts[0], 6)
