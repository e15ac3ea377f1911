"""HRM-Text (transformers' ``HrmTextForCausalLM``) through rdepth's looped adapter: parity with the class's own
forward and cached greedy decoding, its KV slots, loop geometry and per-token exits.

Tiny random configs are written with ``save_pretrained`` and read back with ``open_looped``; every weight is
drawn away from its init (``z_L_init`` zero, norms one) so that a piece called out of order shows.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "HrmTextForCausalLM"):
    pytest.skip("this transformers has no HrmTextForCausalLM", allow_module_level=True)

from rdepth.errors import RdepthError  # noqa: E402
from rdepth.looped.load import open_looped  # noqa: E402
from rdepth.looped.protocol import forward, greedy  # noqa: E402

VOCAB = 48
CONFIGS = {
    # tied head, 2 H steps of 3 L steps, 2 layers per stack
    "tied_h2_l3": dict(H_cycles=2, L_cycles=3, num_hidden_layers=2, tie_word_embeddings=True, prefix_lm=False),
    # own head, 3 H steps of 2 L steps, 1 layer per stack, the prefix-LM mask on
    "untied_h3_l2": dict(H_cycles=3, L_cycles=2, num_hidden_layers=1, tie_word_embeddings=False, prefix_lm=True),
}


def hrm_config(**fields):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, head_dim=8,
                max_position_embeddings=128, embedding_scale=1.0)
    return transformers.HrmTextConfig(**{**base, **fields})


def randomize(model, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype)
            param.copy_(1.0 + 0.1 * draw if name.endswith("norm.weight") else 0.3 * draw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hrm_text")
    out = {}
    for seed, (name, fields) in enumerate(CONFIGS.items()):
        model = transformers.HrmTextForCausalLM(hrm_config(**fields))
        randomize(model, seed)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def tokens(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_budget_logits_equal_the_class_forward(folders, name, dtype):
    adapter = open_looped(folders[name], dtype)
    assert (adapter.model.lm_head.weight is adapter.model.model.embed_tokens.weight) == ("untied" not in name)
    x = tokens()
    with torch.no_grad():
        reference = adapter.model(x).logits
        ours = forward(adapter, x)
        fewer = forward(adapter, x, budgets={"H": 1})
    # Same modules, same order, same sums: equal to the last bit (the brief's 1e-12 / 1e-6 with room to spare).
    assert ours.dtype == reference.dtype == dtype
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    assert (fewer - reference).abs().max() > 1e-3  # the loops matter: a skipped step would show


def test_prefix_lm_mask_follows_the_class(folders):
    adapter = open_looped(folders["untied_h3_l2"], torch.float64)
    x = tokens(length=8)
    token_type_ids = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        reference = adapter.model(x, token_type_ids=token_type_ids).logits
        ours = forward(adapter, x, token_type_ids=token_type_ids)
        causal = forward(adapter, x)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    assert (causal[:, :2] - ours[:, :2]).abs().max() > 1e-6  # the bidirectional prefix changed something


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_generation_is_token_identical(folders, name):
    adapter = open_looped(folders[name], torch.float32)
    prompt = tokens(length=6, seed=3)
    with torch.no_grad():
        reference = adapter.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                             do_sample=False, pad_token_id=0)
        ours = greedy(adapter, prompt, 10)
    assert torch.equal(ours, reference)


def test_smaller_budget_is_the_model_with_fewer_cycles(folders):
    """Budgets (H=1, L=1) and (H=2, L=2) give the class's own forward at H_cycles/L_cycles that small."""
    folder = folders["tied_h2_l3"]
    adapter = open_looped(folder, torch.float64)
    x = tokens()
    for high, low in ((1, 1), (2, 2), (1, 3)):
        small = transformers.HrmTextForCausalLM(hrm_config(**{**CONFIGS["tied_h2_l3"], "H_cycles": high,
                                                                "L_cycles": low})).double().eval()
        small.load_state_dict(adapter.model.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(forward(adapter, x, budgets={"H": high, "L": low}), small(x).logits,
                                       rtol=0, atol=0)


def test_each_step_writes_its_own_kv_slots(folders):
    """Walking the loops by hand, the cache layers a step initialises are exactly ``kv_slots`` of that step, and
    the full walk covers the model's ``num_hidden_layers`` slots once each."""
    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    config = adapter.model.config
    cache = adapter.new_cache()
    ctx = adapter.embed(tokens(), cache)
    carry = adapter.enter(ctx, "H", None)

    def filled() -> set[int]:
        return {i for i, layer in enumerate(cache.layers) if layer.is_initialized and layer.get_seq_length() > 0}

    seen: list[int] = []
    with torch.no_grad():
        for high in range(config.H_cycles):
            carry = adapter.enter(ctx, "L", carry)
            for low in range(config.L_cycles):
                before = filled()
                carry = adapter.step(ctx, "L", (high, low), carry)
                assert filled() - before == set(adapter.kv_slots("L", (high, low)))
                seen += adapter.kv_slots("L", (high, low))
            before = filled()
            carry = adapter.step(ctx, "H", (high,), adapter.leave(ctx, "L", carry))
            assert filled() - before == set(adapter.kv_slots("H", (high,)))
            seen += adapter.kv_slots("H", (high,))
    assert sorted(seen) == list(range(config.num_hidden_layers))


def test_bad_input_is_one_line(folders, tmp_path):
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(RdepthError, match="no looped adapter for model_type 'gpt2'; supported: hrm_text"):
        open_looped(other)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folders["tied_h2_l3"] / "config.json").read_text())
    with pytest.raises(RdepthError, match="no weights"):
        open_looped(bare)
    adapter = open_looped(folders["tied_h2_l3"])
    with pytest.raises(RdepthError, match=r"budget of loop 'L' must be in 1\.\.3, got 4"):
        forward(adapter, tokens(), budgets={"L": 4})
    with pytest.raises(RdepthError, match="no loop 'passes'"):
        forward(adapter, tokens(), budgets={"passes": 1})


# -- loop geometry ---------------------------------------------------------------------------------------


def test_geometry_records_each_loop_run_and_saves_it(folders, tmp_path):
    from rdepth.looped.geometry import ARRAYS_FILE, SUMMARY_FILE, analyze_looped, record_iterates

    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    x = tokens(length=7)
    logits, iterates = record_iterates(adapter, x)
    assert list(iterates) == ["H", "L@h0", "L@h1"]
    assert iterates["H"].shape == (3, 14, 32) and iterates["L@h0"].shape == (4, 14, 32)
    # what the loops hand each other: the L loop restarts where it stopped, z_H^0 is the embedding,
    # the head reads the H loop's last iterate
    torch.testing.assert_close(iterates["L@h1"][0], iterates["L@h0"][-1], rtol=0, atol=0)
    embed = adapter.model.model.embed_tokens(x) * adapter.model.model.embedding_scale
    torch.testing.assert_close(iterates["H"][0], embed.reshape(14, 32), rtol=0, atol=0)
    torch.testing.assert_close(adapter.readout(iterates["H"][-1]), logits.reshape(14, -1), rtol=0, atol=0)

    summary = analyze_looped(adapter, x, tmp_path / "geometry")
    saved = json.loads((tmp_path / "geometry" / SUMMARY_FILE).read_text())
    assert saved["budgets"] == {"H": 2, "L": 3} and set(saved["trajectories"]) == {"H", "L@h0", "L@h1"}
    low = saved["trajectories"]["L@h1"]
    expected = (iterates["L@h1"][1:] - iterates["L@h1"][:-1]).norm(dim=-1).mean(dim=-1)
    torch.testing.assert_close(torch.tensor(low["step_size"], dtype=torch.float64), expected)
    assert len(low["step_cosine"]) == 2 and len(saved["trajectories"]["H"]["pca_explained"]) == 2
    boundary = saved["boundaries"]["L@h0->L@h1"]
    drift = (iterates["L@h1"][1] - iterates["L@h0"][-1]).norm(dim=-1)
    mean_step = (iterates["L@h0"][1:] - iterates["L@h0"][:-1]).norm(dim=-1).mean(dim=0)
    assert boundary["dlr_first_median"] == pytest.approx(float((drift / (mean_step + 1e-12)).median()), rel=1e-9)
    assert summary["boundaries"] == saved["boundaries"]
    import numpy as np

    with np.load(tmp_path / "geometry" / ARRAYS_FILE) as arrays:
        assert arrays["L@h0/pca_coords"].shape == (4, 7, 2) and arrays["L@h0->L@h1/dlr_first"].shape == (14,)


# -- per-token exits -------------------------------------------------------------------------------------


def _policy(rule, tau, k_max, adapter=None):
    from rdepth.exits.registry import make_policy

    return make_policy(rule, tau=tau, k_max=k_max, decode=None if adapter is None else adapter.readout)


def _small_model(adapter, **cycles):
    small = transformers.HrmTextForCausalLM(hrm_config(**{**CONFIGS["tied_h2_l3"], **cycles})).double().eval()
    small.load_state_dict(adapter.model.state_dict())
    return small


def test_exits_at_full_budget_and_at_the_first_step_have_known_answers(folders):
    """No rule: the class's forward. Every token leaving L after its first step: the class with L_cycles=1
    (the state handed on is z_L^(1)); leaving H after its first step: the class with H_cycles=1."""
    from rdepth.looped.exits import decode_with_exits

    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    x = tokens(length=8)
    with torch.no_grad():
        full = decode_with_exits(adapter, x)
        torch.testing.assert_close(full.logits, adapter.model(x).logits, rtol=0, atol=1e-12)
        assert (full.low_steps == 3).all() and (full.high_steps == 2).all()
        low_once = decode_with_exits(adapter, x, low=_policy("step_norm", 1e9, 3))
        torch.testing.assert_close(low_once.logits, _small_model(adapter, L_cycles=1)(x).logits, rtol=0, atol=1e-12)
        assert (low_once.low_steps == 1).all()
        high_once = decode_with_exits(adapter, x, high=_policy("step_norm", 1e9, 2))
        torch.testing.assert_close(high_once.logits, _small_model(adapter, H_cycles=1)(x).logits, rtol=0, atol=1e-12)
        assert (high_once.high_steps == 1).all() and (high_once.low_steps[..., 1] == 0).all()


def test_exited_tokens_slots_hold_their_latest_kv_and_rows_are_independent(folders):
    from rdepth.looped.exits import decode_with_exits

    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    x = tokens(length=8)
    with torch.no_grad():
        run = decode_with_exits(adapter, x, low=_policy("cosine", 0.5, 3), high=_policy("kl", 0.05, 2, adapter))
    low_steps = run.low_steps
    assert 1 <= low_steps.min() < low_steps.max() == 3  # a mix of early and full L loops
    cache, layers = run.cache, adapter.layers_per_stack
    checked = 0
    for b in range(2):
        for t in range(8):
            for h in range(int(run.high_steps[b, t])):
                last = adapter.kv_slots("L", (h, int(low_steps[b, t, h]) - 1))
                for skipped in range(int(low_steps[b, t, h]), 3):
                    for source, slot in zip(last, adapter.kv_slots("L", (h, skipped)), strict=True):
                        assert torch.equal(cache.layers[slot].keys[b, :, t], cache.layers[source].keys[b, :, t])
                        assert torch.equal(cache.layers[slot].values[b, :, t], cache.layers[source].values[b, :, t])
                        checked += 1
    assert checked >= layers
    with torch.no_grad():  # a batch decodes as its rows one by one
        for b in range(2):
            alone = decode_with_exits(adapter, x[b:b + 1], low=_policy("cosine", 0.5, 3),
                                      high=_policy("kl", 0.05, 2, adapter))
            torch.testing.assert_close(alone.logits, run.logits[b:b + 1], rtol=0, atol=1e-12)
            assert torch.equal(alone.low_steps, low_steps[b:b + 1])


def test_exit_quality_and_refusals(folders):
    from rdepth.looped.exits import decode_with_exits, exit_quality

    adapter = open_looped(folders["tied_h2_l3"], torch.float64)
    x = tokens(length=8)
    same = exit_quality(adapter, x)
    assert same["ce_exit"] == same["ce_full"] and same["argmax_agreement"] == 1.0 and same["mean_low_steps"] == 3.0
    early = exit_quality(adapter, x, low=_policy("step_norm", 1e9, 3))
    assert early["mean_low_steps"] == 1.0 and early["ce_exit"] != early["ce_full"]
    with pytest.raises(RdepthError, match="kl reads the prediction"):
        decode_with_exits(adapter, x, low=_policy("kl", 0.1, 3, adapter))
    with pytest.raises(RdepthError, match="k_max 5 must be the loop's budget 3"):
        decode_with_exits(adapter, x, low=_policy("step_norm", 0.1, 5))
