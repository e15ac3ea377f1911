"""Loop-speculative decoding (rdepth.model.loop_speculation) is lossless on the one decoder: greedy tokens are
plain decoding's for fixed budgets and every exit rule, the cache after the rounds is plain decoding's (the
latest-KV rule included), sampled tokens have the verifying budget's distribution (and are plain sampling's
tokens where the draft is the verifier); ``rdepth generate --speculate K --draft-loops D`` (float64, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory
from rdepth.exits.gate import random_gate
from rdepth.exits.policies import random_ouro_gate
from rdepth.exits.registry import POLICIES
from rdepth.model.budget import Budget
from rdepth.model.decoder import Decoder
from rdepth.model.generation import generate
from rdepth.model.loop_speculation import (
    Sampling,
    accept_drafts,
    draft_budget,
    speculate,
    speculative_decode,
)
from rdepth.model.noise import StateNoise

COUNTS = (6, 5)  # the verifying budget of tiny_model's two groups (layer 0, group 1, group 2-3, layer 4)
PROMPT = torch.tensor([[3, 7, 1, 9]])
# A threshold per rule under which the tiny model's tokens stop at different steps, each capped at COUNTS.
SETTINGS = {"step_norm": 1.0, "step_norm_rel": 0.3, "acceleration": 1.0, "acceleration_rel": 0.3,
            "acceleration_state": 0.3, "cosine": 0.01, "latent_diff": 0.3, "kl": 0.01, "minp_kl": 0.01,
            "entropy_diff": 0.01, "argmax_stable": 1, "confidence": 0.9, "learned": 0.5, "ouro": 0.5, "fixed": None}


def rule(model, name: str):
    """A factory of ``name``'s controllers on ``model``, capped at :data:`COUNTS`."""
    value, caps = SETTINGS[name], list(COUNTS)
    if name == "argmax_stable":
        return controller_factory(name, None, caps, lambda: model.readout, {"patience": value})
    if name == "fixed":
        return controller_factory(name, None, caps)
    if name == "learned":
        return controller_factory(name, value, caps, None, {"gate": random_gate(model.n_groups, 16, seed=3)})
    if name == "ouro":
        return controller_factory(name, value, caps, None, {"gate": random_ouro_gate(16, 3)})
    return controller_factory(name, value, caps, lambda: model.readout)


def cache_tensors(decoder: Decoder) -> list[torch.Tensor]:
    """Every key/value tensor of the decoder's cache, cut to the positions filled."""
    cache, filled = decoder.cache, decoder.length
    tensors = [t[:, :, :filled] for pair in cache.single.values() for t in pair]
    return tensors + [t[:, :, :, :filled] for pair in cache.looped.values() for t in pair]


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_greedy_tokens_are_plain_decodings_at_a_fixed_budget(tokens):
    """Two groups with single-pass layers before, between and after; drafts at one step, at two, and at a
    different count per group; many rejections (random weights) and a run into the block size."""
    model = tiny_model(block_size=24)
    plain = generate(model, PROMPT, 30, temperature=0, loop_counts=COUNTS, noise=StateNoise(1, [0]))
    assert plain.shape[1] == 25  # stopped at the block size
    for draft in (1, 2, (3, 1)):
        fast, stats = speculative_decode(model, PROMPT, 30, tokens=tokens, draft_loops=draft, loop_counts=COUNTS,
                                         noise=StateNoise(1, [0]))
        assert torch.equal(fast, plain), draft
        assert 0 < stats.accepted < stats.drafted
        # 20 tokens after the first: each round its kept drafts and the verifier's token (the last may need none)
        assert stats.rounds + stats.accepted in (20, 21)
        assert stats.mean_accepted == stats.accepted / stats.rounds


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_greedy_tokens_are_plain_decodings_under_every_exit_rule(name):
    """Drafts under the rule capped at 2 steps, verification under the rule in one pass."""
    model = tiny_model()
    factory = rule(model, name)
    plain = generate(model, PROMPT, 14, temperature=0, controller_factory=factory, noise=StateNoise(1, [0]))
    fast, stats = speculative_decode(model, PROMPT, 14, tokens=3, draft_loops=2, controller_factory=factory,
                                     noise=StateNoise(1, [0]))
    assert torch.equal(fast, plain)
    assert stats.accepted < stats.drafted  # rejections happened: the rollback is exercised


@pytest.mark.parametrize("name", ["fixed", "kl", "acceleration", "ouro"])
def test_one_pass_under_an_exit_rule_equals_one_position_at_a_time(name):
    """``extend(lockstep=True)`` under exits: the same logits, steps, hand-off indices and cache (every step's
    slot, the latest key where a position stopped early) as the positions one at a time."""
    model = tiny_model()
    factory = rule(model, name)
    tokens = torch.tensor([[3, 7, 1, 9, 4, 4, 2, 8, 11, 5]])
    runs = []
    for lockstep in (False, True):
        decoder = Decoder(model, 1, controller_factory=factory, noise=StateNoise(2, [0]))
        decoder.extend(tokens[:, :3])
        logits = decoder.extend(tokens[:, 3:], lockstep=lockstep)
        runs.append((logits, decoder.prompt_computed.clone(), decoder.prompt_used.clone(), cache_tensors(decoder)))
    (logits, computed, used, cache), (logits_, computed_, used_, cache_) = runs
    torch.testing.assert_close(logits_, logits, rtol=0, atol=1e-12)
    assert torch.equal(computed_, computed) and torch.equal(used_, used)
    for tensor, tensor_ in zip(cache, cache_, strict=True):
        torch.testing.assert_close(tensor_, tensor, rtol=0, atol=1e-12)
    if name != "fixed":
        assert len(set(computed.flatten().tolist())) > 1  # positions stopped at different steps


@pytest.mark.parametrize("name", [None, "kl", "acceleration"])
def test_the_cache_after_the_rounds_is_plain_decodings(name):
    """After rounds with rejections, every filled position's keys/values at every loop step equal those plain
    decoding of the same tokens holds (drafts' entries rolled back, exited tokens' later slots settled)."""
    model = tiny_model()
    budget = dict(loop_counts=COUNTS) if name is None else dict(controller_factory=rule(model, name))
    decoder = Decoder(model, 1, noise=StateNoise(3, [0]), **budget)
    verify = decoder.budget
    out, stats = speculate(decoder, PROMPT, 16, tokens=4, draft=draft_budget(model, verify, 1))
    assert stats.accepted < stats.drafted
    assert decoder.length == out.shape[1] - 1  # the last token decided, not yet fed
    plain = Decoder(model, 1, noise=StateNoise(3, [0]), **budget)  # plain decoding: the prompt, then one by one
    plain.prefill(PROMPT)
    for token in out[0, PROMPT.shape[1] : decoder.length]:
        plain.step(token.view(1, 1))
    for tensor, tensor_ in zip(cache_tensors(plain), cache_tensors(decoder), strict=True):
        torch.testing.assert_close(tensor_, tensor, rtol=0, atol=1e-12)


def test_a_draft_equal_to_the_verifier_keeps_everything_and_samples_plain_samplings_tokens():
    """Draft = verifier: every draft kept; sampled tokens are plain sampling's draw for draw (drafts and the
    bonus token from ``rng``, one draw per position, as plain sampling)."""
    model = tiny_model()
    for temperature, top_k in ((0.0, None), (0.9, None), (1.3, 7)):
        plain = generate(model, PROMPT, 20, temperature=temperature, top_k=top_k, loop_counts=COUNTS,
                         noise=StateNoise(4, [0]), rng=torch.Generator().manual_seed(11))
        decoder = Decoder(model, 1, loop_counts=COUNTS, noise=StateNoise(4, [0]))
        fast, stats = speculate(decoder, PROMPT, 20, tokens=3, draft=Budget(counts=COUNTS),
                                sampling=Sampling(temperature, top_k), rng=torch.Generator().manual_seed(11),
                                accept_rng=torch.Generator().manual_seed(12))
        assert torch.equal(fast, plain), temperature
        assert stats.acceptance == 1.0 and stats.rounds == 5  # 19 tokens after the first: 3 + 1 per round


def test_rejection_sampling_gives_the_targets_distribution():
    """:func:`accept_drafts` on constructed distributions (vocabulary 5, two drafts from q): the first token
    kept or drawn follows p1, and the second (where the first draft was kept) p2, though q differs from p.
    Tolerance: total variation 0.03 over 12,000 rounds (its sampling spread is about 0.01 here), while the
    drafts' own distributions are 0.3 or more away from the targets (an implementation keeping drafts
    unchecked, or drawing the correction from p, fails)."""
    p = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05], [0.05, 0.05, 0.30, 0.30, 0.30]], dtype=torch.float64)
    q = torch.tensor([[0.10, 0.10, 0.20, 0.20, 0.40], [0.40, 0.30, 0.10, 0.10, 0.10]], dtype=torch.float64)
    assert all(0.5 * (p[i] - q[i]).abs().sum() >= 0.3 for i in range(2))
    verified = torch.cat([p.log(), torch.zeros(1, 5, dtype=torch.float64)])  # logits at temperature 1
    main, accept = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    rounds, first, second = 12_000, torch.zeros(5), torch.zeros(5)
    sampling = Sampling(temperature=1.0)
    for _ in range(rounds):
        drafts = [int(torch.multinomial(q[i].float(), 1, generator=main)) for i in range(2)]
        kept, token = accept_drafts(verified, drafts, q.float(), sampling, accept)
        first[drafts[0] if kept >= 1 else token] += 1
        if kept >= 1:
            second[drafts[1] if kept == 2 else token] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        assert 0.5 * (counts / counts.sum() - target.float()).abs().sum() < 0.03


def test_sampled_decoding_keeps_the_verifying_budgets_distribution():
    """End to end on the model: the second new token (the first that drafting decides; one draft a round)
    has the verifying budget's marginal distribution, computed exactly from teacher-forced passes (sharpened
    head, vocabulary 6). Tolerance: total variation 0.12 over 500 runs (its sampling spread is about 0.04
    here); the draft budget's own marginal is more than 0.4 away."""
    model = tiny_model(vocab_size=6, block_size=8)
    with torch.no_grad():
        model.wte.weight.mul_(4.0)  # sharper distributions, so that budgets differ
    noise, prompt = StateNoise(5, [0]), torch.tensor([[1, 4]])

    @torch.no_grad()
    def marginal(counts):
        first = torch.softmax(model(prompt, loop_counts=counts, noise=noise).logits[0, -1], -1)
        pairs = torch.cat([prompt.repeat(6, 1), torch.arange(6)[:, None]], dim=1)
        second = torch.softmax(model(pairs, loop_counts=counts, noise=StateNoise(5, [0] * 6)).logits[:, -1], -1)
        return first @ second

    target, drafted = marginal(COUNTS), marginal((1, 1))
    assert 0.5 * (target - drafted).abs().sum() > 0.4
    decoder = Decoder(model, 1, loop_counts=COUNTS, noise=noise)
    draft = draft_budget(model, decoder.budget, 1)
    rng, accept_rng = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    counts, runs = torch.zeros(6, dtype=torch.float64), 500
    for _ in range(runs):
        out, _ = speculate(decoder, prompt, 2, tokens=1, draft=draft, sampling=Sampling(1.0), rng=rng,
                           accept_rng=accept_rng)
        counts[int(out[0, -1])] += 1
    assert 0.5 * (counts / runs - target).abs().sum() < 0.12


def test_bad_speculation_settings_are_one_line_errors():
    model = tiny_model()
    for options, message in (({"draft_loops": 6, "loop_counts": (6, 5)}, "at or above the verifying budget"),
                             ({"draft_loops": (7, 5), "loop_counts": COUNTS}, "at or above"),
                             ({"draft_loops": 6, "controller_factory": rule(model, "kl")}, "at or above the exit rule"),
                             ({"tokens": 0}, "K >= 1"), ({"draft_loops": 0}, "every count must be >= 1")):
        with pytest.raises(RdepthError, match=message):
            speculative_decode(model, PROMPT, 4, **options)
    with pytest.raises(RdepthError, match="cannot be capped"):
        draft_budget(model, Budget(controller_factory=lambda: object()), 1)
    with pytest.raises(RdepthError, match="warm start"):
        speculate(Decoder(model, 1, warm_start=True), PROMPT, 4, tokens=2, draft=Budget(counts=(1, 1)))
    one_group = tiny_model(groups="")
    with pytest.raises(RdepthError, match="no loops"):
        speculative_decode(one_group, PROMPT, 4)


def test_generate_command_speculates(tiny_text_run, capsys):
    """``--speculate K --draft-loops D``: greedy text equal to plain, with --loops and under --exit; sampled
    runs; bad input one line with exit status 2."""
    from rdepth.cli.main import main

    common = ["generate", "--checkpoint", str(tiny_text_run), "--prompt", "The river", "--max-new-tokens", "10",
              "--device", "cpu"]
    for budget in (["--loops", "3,3"], ["--exit", "kl", "--tau", "0.01", "--k-max", "3"]):
        capsys.readouterr()
        assert main(common + ["--temperature", "0", *budget]) == 0
        plain = capsys.readouterr().out
        assert main(common + ["--temperature", "0", *budget, "--speculate", "3", "--draft-loops", "1"]) == 0
        assert capsys.readouterr().out == plain
    assert main(common + ["--temperature", "0.8", "--speculate", "2", "--samples", "2"]) == 0
    assert capsys.readouterr().out.count("---") == 2
    for flags, message in ((["--speculate", "0"], "speculate"), (["--draft-loops", "1"], "give --speculate too"),
                           (["--speculate", "2", "--loops", "2,2", "--draft-loops", "2"], "at or above"),
                           (["--speculate", "2", "--warm-start"], "--warm-start with --speculate")):
        capsys.readouterr()
        assert main(common + flags) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
