"""Continuous depth batching (rdepth.engine): every request's tokens, logits and loop steps equal its batch-1
decode on the one decoder under the same budget or exit rule, whatever else shares the batch and in whatever
order requests arrive (float64 on the CPU); slots are refilled; bad input ends one request, not the others."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model

from rdepth.engine import KV_LAYOUTS, Engine, Request
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory as exit_controllers
from rdepth.exits.gate import random_gate
from rdepth.exits.policies import random_ouro_gate
from rdepth.exits.registry import POLICIES
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise
from rdepth.model.sampling import choose_tokens

K_MAX = (6, 5)
# A threshold per rule under which the tiny model's tokens stop at several different steps (checked below).
SETTINGS = {"step_norm": 1.0, "step_norm_rel": 0.3, "acceleration": 1.0, "acceleration_rel": 0.3,
            "acceleration_state": 0.3, "cosine": 0.01, "latent_diff": 0.3, "kl": 0.01, "minp_kl": 0.01,
            "entropy_diff": 0.01, "argmax_stable": 1, "confidence": 0.9, "learned": 0.5, "ouro": 0.5, "fixed": None}


def caps_for(model) -> list[int]:
    """K_MAX per group (repeated for a model with more groups than it names)."""
    return [K_MAX[group % len(K_MAX)] for group in range(max(model.n_groups, len(K_MAX)))]


def factory(model, name: str, options: dict | None = None):
    value = SETTINGS[name]
    options = dict(options or {})
    caps = caps_for(model)
    if name == "argmax_stable":
        return exit_controllers(name, None, caps, lambda: model.readout, {"patience": value, **options})
    if name == "fixed":
        return exit_controllers(name, None, caps)
    if name == "learned":
        gate = random_gate(model.n_groups, model.config.d_model, seed=3)
        return exit_controllers(name, value, caps, None, {"gate": gate})
    if name == "ouro":
        return exit_controllers(name, value, caps, None, {"gate": random_ouro_gate(model.config.d_model, 3)})
    return exit_controllers(name, value, caps, lambda: model.readout, options)


def prompts(count: int, seed: int = 0, low: int = 2, high: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50) for _ in range(rng.randint(low, high))] for _ in range(count)]


def reference(model, request: Request, **budget):
    """The batch-1 decoder's run of ``request``: new tokens, logits of every fed position [T + n - 1, V], the
    loop steps of each fed position [T + n - 1][G]."""
    decoder = Decoder(model, 1, noise=StateNoise(request.noise_seed, [request.sequence_id]), **budget)
    prompt = torch.tensor([request.prompt])
    logits = [decoder.prefill(prompt)[0]]
    steps = decoder.prompt_computed[:, 0].T.tolist()
    generator = torch.Generator().manual_seed(request.seed) if request.temperature > 0 else None
    tokens, last = [], logits[0][-1:]
    while True:
        token = int(choose_tokens(last, request.temperature, request.top_k, generator, request.top_p))
        tokens.append(token)
        if len(tokens) >= request.max_tokens or token in request.stop or decoder.length >= decoder.capacity:
            break
        last = decoder.step(torch.tensor([[token]]))
        logits.append(last)
        steps.append(decoder.computed[:, 0].tolist())
    return tokens, torch.cat(logits), steps


def run_engine(model, requests, batch, order=None, **budget):
    engine = Engine(model, batch, **budget)
    ids = {}
    for index in (order or range(len(requests))):
        ids[engine.add_request(requests[index])] = index
    results = {ids[done.request_id]: done for done in engine.run()}
    assert sorted(results) == sorted(range(len(requests)))
    return results, engine


def assert_same(model, requests, results, **budget):
    """Tokens, loop steps, the reasons they ended, the prompt's predictions and (kept) logits: the batch-1
    decoder's."""
    k_max = Engine(model, 1, **budget).k_max
    for index, request in enumerate(requests):
        tokens, logits, steps = reference(model, request, **budget)
        done = results[index]
        assert done.error is None, done.error
        assert done.tokens == tokens, f"request {index}"
        assert done.steps == steps, f"request {index}"
        fixed = "loop_counts" in budget
        assert done.rules == [["budget" if fixed or s == k else "rule" for s, k in zip(position, k_max, strict=True)]
                              for position in steps], f"request {index}"
        assert done.predicted == logits[:len(request.prompt)].argmax(dim=-1).tolist(), f"request {index}"
        if request.keep_logits:
            torch.testing.assert_close(done.logits.double(), logits, rtol=0, atol=1e-9)
        else:
            assert done.logits is None


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fixed_budget_equals_the_batch_1_decoder_for_every_request(batch):
    model = tiny_model()
    requests = [Request(p, max_tokens=4 + i % 3, keep_logits=True, sequence_id=i) for i, p in enumerate(prompts(7))]
    results, engine = run_engine(model, requests, batch, loop_counts=K_MAX)
    assert_same(model, requests, results, loop_counts=K_MAX)
    assert engine.stats.requests == 7 and not engine.pending()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_exit_rule_equals_the_batch_1_decoder_in_any_arrival_order(name):
    """Rows at different steps share each call; each request's tokens, logits and steps are its own."""
    model = tiny_model()
    requests = [Request(p, max_tokens=3 + i % 4, keep_logits=True, sequence_id=i % 3, noise_seed=i)
                for i, p in enumerate(prompts(6, seed=1))]
    for batch, seed in ((3, 0), (8, 1), (1, 2)):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        results, engine = run_engine(model, requests, batch, order, controller_factory=factory(model, name))
        assert_same(model, requests, results, controller_factory=factory(model, name))
    if name != "fixed":
        distinct = {s for done in results.values() for position in done.steps for s in position}
        assert len(distinct) > 1, "the setting should make exits vary"


def test_gpt2_blocks_rotary_positions_and_a_residual_loop_too():
    for options in ({"block": "gpt2"}, {"positions": "rotary"}, {"loop_state": "residual"}):
        model = tiny_model(**options)
        requests = [Request(p, max_tokens=4, keep_logits=True) for p in prompts(5, seed=2)]
        results, _ = run_engine(model, requests, 3, controller_factory=factory(model, "step_norm_rel"))
        assert_same(model, requests, results, controller_factory=factory(model, "step_norm_rel"))


def test_warm_start_equals_the_batch_1_decoders_warm_start():
    model = tiny_model()
    requests = [Request(p, max_tokens=4, keep_logits=True, sequence_id=i) for i, p in enumerate(prompts(5, seed=3))]
    for budget in ({"loop_counts": K_MAX}, {"controller_factory": factory(model, "kl")}):
        results, _ = run_engine(model, requests, 2, warm_start=True, **budget)
        assert_same(model, requests, results, warm_start=True, **budget)


def test_sampling_is_each_requests_own_draw_whatever_shares_the_batch():
    model = tiny_model()
    requests = [Request(p, max_tokens=6, temperature=1.3, top_p=0.9, top_k=20, seed=10 + i, keep_logits=True)
                for i, p in enumerate(prompts(6, seed=4))]
    results, _ = run_engine(model, requests, 4, controller_factory=factory(model, "step_norm"))
    assert_same(model, requests, results, controller_factory=factory(model, "step_norm"))
    alone, _ = run_engine(model, requests[2:3], 1, controller_factory=factory(model, "step_norm"))
    assert alone[0].tokens == results[2].tokens


def test_a_single_group_model_without_single_pass_layers():
    """The main job's shape: the loop is the whole model."""
    model = tiny_model(n_layer=1, groups="0")
    requests = [Request(p, max_tokens=5, keep_logits=True, sequence_id=i) for i, p in enumerate(prompts(9, seed=5))]
    budget = {"controller_factory": exit_controllers("step_norm_rel", 0.3, 6)}
    results, engine = run_engine(model, requests, 4, **budget)
    assert_same(model, requests, results, **budget)
    stats = engine.stats.as_dict(4)
    assert stats["positions"] == sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
    assert 0 < stats["occupancy"] <= 1


def test_stop_tokens_capacity_and_slots_refilled():
    model = tiny_model()
    request = Request([1, 2, 3], max_tokens=20)
    first = reference(model, request, loop_counts=K_MAX)[0]
    stop = Request([1, 2, 3], max_tokens=20, stop=[first[2]])
    results, engine = run_engine(model, [stop, Request([4] * 30, max_tokens=10)], 1, loop_counts=K_MAX)
    assert results[0].tokens == first[:first.index(first[2]) + 1] and results[0].finish_reason == "stop"
    assert results[1].finish_reason == "context" and len(results[1].tokens) == 3  # 30 + 3 - 1 = 32 positions
    assert engine.live == [None]


def test_bad_input_is_a_one_line_error_or_ends_one_request():
    model = tiny_model()
    for bad in ({"prompt": []}, {"prompt": [1], "max_tokens": 0}, {"prompt": [1], "temperature": -1},
                {"prompt": [1], "top_p": 0}, {"prompt": [1], "top_k": 0}):
        with pytest.raises(RdepthError):
            Request(**bad)
    with pytest.raises(RdepthError, match="batch_size"):
        Engine(model, 0)
    with pytest.raises(RdepthError, match="kv_layout"):
        Engine(model, 2, kv_layout="paged")
    with pytest.raises(RdepthError, match="gate"):
        exit_controllers("learned", 0.5, 4)
    requests = [Request([1] * 40, max_tokens=2), Request([1, 2], max_tokens=3)]
    results, _ = run_engine(model, requests, 2, loop_counts=K_MAX)
    assert results[0].finish_reason == "error" and "capacity" in results[0].error
    assert results[1].error is None and len(results[1].tokens) == 3


def test_a_row_whose_state_goes_non_finite_fails_alone():
    model = tiny_model()
    with torch.no_grad():
        model.wpe.weight[10] = float("nan")  # only the long request reaches position 10
    requests = [Request([1, 2, 3], max_tokens=3, keep_logits=True), Request(list(range(12)), max_tokens=3),
                Request([4, 5], max_tokens=3, keep_logits=True)]
    results, _ = run_engine(model, requests, 3, loop_counts=K_MAX)
    assert results[1].finish_reason == "error" and "not finite" in results[1].error
    assert len(results[1].steps) == len(results[1].predicted) == 10  # positions 0..9 read out, 10 failed
    assert results[1].steps == [list(K_MAX)] * 10 and results[1].rules == [["budget"] * 2] * 10
    for index in (0, 2):
        assert results[index].tokens == reference(model, requests[index], loop_counts=K_MAX)[0]


def test_the_shared_layout_keeps_one_slot_and_changes_only_later_positions():
    """Shared slot: K times fewer looped bytes per token; the first position (nothing cached to read) is
    exact; later ones read final keys, so they differ."""
    model = tiny_model()
    exact = Engine(model, 2, loop_counts=K_MAX)
    shared = Engine(model, 2, loop_counts=K_MAX, kv_layout="shared")
    per_layer = 2 * model.config.d_model * 8  # K and V, float64
    assert exact.kv_bytes_per_token() == per_layer * (2 + K_MAX[0] + 2 * K_MAX[1])  # layers 0 and 4 run once
    assert shared.kv_bytes_per_token() == per_layer * 5
    request = Request([1, 2, 3, 4], max_tokens=2, keep_logits=True)
    for engine in (exact, shared):
        engine.add_request(request)
    one, two = next(exact.run()), next(shared.run())
    torch.testing.assert_close(one.logits[0], two.logits[0], rtol=0, atol=1e-12)
    assert (one.logits[1:] - two.logits[1:]).abs().max() > 1e-6


@pytest.mark.parametrize("name", sorted(KV_LAYOUTS))
def test_every_layout_keeps_its_slots_and_is_exact_where_it_says(name):
    """Each registered layout: the bytes a position takes are what its kept step slots imply; a layout that
    claims exactness equals the batch-1 decoder for every request under an exit rule in any arrival order; one
    that does not is exact at a request's first position and differs later."""
    model = tiny_model()
    layout = KV_LAYOUTS[name]()
    engine = Engine(model, 3, loop_counts=K_MAX, kv_layout=name)
    per_layer = 2 * model.config.d_model * 8  # K and V, float64
    looped = sum(kept * len(spec.layers) for kept, spec in zip(layout.kept(K_MAX), model.config.group_specs,
                                                            strict=True))
    assert engine.kv_bytes_per_token() == per_layer * (2 + looped)  # layers 0 and 4 run once
    requests = [Request(prompt, max_tokens=3, keep_logits=True) for prompt in prompts(5, seed=3)]
    budget = {"controller_factory": factory(model, "step_norm_rel")}
    results, _ = run_engine(model, requests, 3, order=[2, 0, 4, 1, 3], kv_layout=name, **budget)
    if layout.exact:
        assert_same(model, requests, results, **budget)
        return
    later = []
    for index, request in enumerate(requests):
        logits, kept = reference(model, request, **budget)[1], results[index].logits
        torch.testing.assert_close(kept[0], logits[0], rtol=0, atol=1e-12)
        later.append((kept[1:] - logits[1:kept.shape[0]]).abs().max().item())
    assert max(later) > 1e-6


def test_the_controller_must_serve_rows_at_different_steps():
    class Bare:
        def max_steps(self, group):
            return 2

    with pytest.raises(RdepthError, match="begin_rows"):
        Engine(tiny_model(), 2, controller_factory=Bare)


@pytest.mark.parametrize("keep", ["none", "some"])
def test_prompt_rows_read_out_together_equal_the_decoder(keep):
    """The readout's rows in their prompt are handled at once (no logits kept): every slot at one position
    (requests of one length), rows at different positions, rows generating beside rows in their prompt,
    rows keeping logits beside rows that do not (which then go one by one)."""
    model = tiny_model()
    lengths = [5, 5, 5, 5, 3, 8, 2, 6]
    requests = [Request(list(range(1 + i, 1 + i + n)), max_tokens=1 + i % 3, sequence_id=i,
                        keep_logits=keep == "some" and i % 2 == 0) for i, n in enumerate(lengths)]
    for budget in ({"loop_counts": K_MAX}, {"controller_factory": factory(model, "step_norm_rel")}):
        for batch in (4, 3):
            results, _ = run_engine(model, requests, batch, **budget)
            assert_same(model, requests, results, **budget)


def test_the_listener_gets_each_tokens_steps_and_rules():
    model = tiny_model()
    heard = []
    engine = Engine(model, 3, controller_factory=factory(model, "step_norm_rel"),
                    listener=lambda *event: heard.append(event))
    requests = [Request(p, max_tokens=3, sequence_id=i) for i, p in enumerate(prompts(4, seed=6))]
    for request in requests:
        engine.add_request(request)
    results = {done.request_id: done for done in engine.run()}
    for request_id, done in results.items():
        events = [event[1:4] for event in heard if event[0] == request_id]
        assert all(event[4] is None for event in heard)  # (a log-probability only where a request asks)
        first = len(done.request.prompt) - 1  # the position whose readout chose the first new token
        assert events == [(token, done.steps[first + i], done.rules[first + i]) for i, token in enumerate(done.tokens)]
