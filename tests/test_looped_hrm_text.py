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


# -- the commands on a folder (rdepth analyze, sweep, generate) ------------------------------------------

TEXT_CONFIG = dict(vocab_size=256, H_cycles=2, L_cycles=3, num_hidden_layers=1, tie_word_embeddings=True,
                   prefix_lm=False)
GOLDEN_SEED = 1234
GOLDEN_ABOUT = ("rdepth analyze on a tiny random HRM-Text (tests/test_looped_hrm_text.py text_folder: 32 wide, H 2 / "
                "L 3, one layer per stack, tied head, weights drawn from seed 1234, a byte tokenizer) over 2 windows "
                "of 16 bytes of tests/looped_helpers.TEXT, float64: the summary's headline numbers. Rewrite with "
                "python tests/test_looped_hrm_text.py write-golden")


def text_folder(root, seed: int = GOLDEN_SEED):
    """A tiny HRM-Text with a byte tokenizer (ids = UTF-8 bytes) saved as a Hugging Face folder, and its text."""
    from looped_helpers import write_text

    from rdepth.looped.load import save_byte_tokenizer

    model = transformers.HrmTextForCausalLM(hrm_config(**TEXT_CONFIG))
    randomize(model, seed)
    model.save_pretrained(root / "hrm")
    save_byte_tokenizer(root / "hrm")
    return root / "hrm", write_text(root)


def _text_class(adapter, **cycles):
    """The class (float32) with the text folder's weights and these cycle counts."""
    model = transformers.HrmTextForCausalLM(hrm_config(**{**TEXT_CONFIG, **cycles})).eval()
    model.load_state_dict(adapter.model.state_dict())
    return model


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    folder, data = text_folder(tmp_path_factory.mktemp("hrm_commands"))
    return folder, data, open_looped(folder, torch.float64)


def test_analyze_measures_every_loop_run_and_judges_the_claims(text, tmp_path, monkeypatch):
    """rdepth analyze on the folder: one group per loop run, the step sizes and drift of the recorded iterates, the
    loss of the class's own forward, claims.json and the page; its numbers equal the golden file's."""
    import numpy as np
    from looped_helpers import check_golden, golden_numbers, text_windows, weights_digest
    from test_hf_helpers import cli

    from rdepth.geometry import metrics
    from rdepth.looped.geometry import record_iterates

    folder, data, adapter = text
    out = tmp_path / "out"
    # two batches (3 windows, batch 2): the observers stream across batches as they do for rdepth's models
    assert cli(monkeypatch, "analyze", "--checkpoints", folder, "--data", data, "--out", out, "--sequences", 3,
               "--seq-len", 16, "--batch-size", 2, "--no-progress") == 0
    summary = json.loads((out / "geometry" / "summary.json").read_text())
    assert summary["groups"] == ["H", "L@h0", "L@h1"] and summary["budgets"] == {"train": [2, 3, 3]}
    windows = text_windows(16, 3)
    with torch.no_grad():
        logits, iterates = record_iterates(adapter, windows[:, :-1])
        own = torch.nn.functional.cross_entropy(adapter.model(windows[:, :-1]).logits.reshape(-1, 256),
                                                windows[:, 1:].reshape(-1))
    budget = summary["checkpoints"][0]["budgets"]["train"]
    assert budget["loss"] == pytest.approx(float(own), rel=1e-12)
    for group in budget["groups"]:
        states = iterates[group["name"]]
        sizes = (states[1:] - states[:-1]).norm(dim=-1).mean(dim=-1)
        assert group["step_size"]["mean"] == pytest.approx(sizes.tolist(), rel=1e-9)
    dlr = budget["dlr"]["L@h0->L@h1"]
    expected = metrics.drift_to_loop_ratio(iterates["L@h0"], iterates["L@h1"], "first")
    assert dlr["first"]["median"] == pytest.approx(float(np.median(expected.numpy())), rel=1e-9)  # (an even count)
    assert dlr["literal"]["median"] == 0.0  # the L loop restarts exactly where it stopped
    claims = json.loads((out / "claims.json").read_text())
    assert [claim["id"] for claim in claims["claims"]] == ["step_decay", "plateau", "cosine", "dlr"]
    # H (2 steps) is left out of the per-loop claims and named; the plateau needs 10 steps
    assert "H: 2 steps" in " ".join(claims["claims"][0]["why"]) and claims["verdicts"]["plateau"] == "not tested"
    assert claims["claims"][3]["ours"]["boundaries"][0]["boundary"] == "L@h0->L@h1"
    page = (out / "index.html").read_text()
    assert "geometry claims judged on hrm_text" in page and "Loop geometry of hrm_text" in page
    # the golden file: the same analysis on the first two windows
    assert cli(monkeypatch, "analyze", "--checkpoints", folder, "--data", data, "--out", tmp_path / "golden",
               "--sequences", 2, "--seq-len", 16, "--no-progress") == 0
    summary = json.loads((tmp_path / "golden" / "geometry" / "summary.json").read_text())
    check_golden("looped_hrm_text", golden_numbers(summary), weights_digest(adapter.model), GOLDEN_ABOUT)


def test_sweep_rules_have_known_answers(text, tmp_path, monkeypatch, capsys):
    """rdepth sweep on the folder: a rule that stops every token after one step equals the class with that loop's
    cycles at 1 (L, H, both), one that never stops equals the full budget; decoded rules run on H only."""
    from looped_helpers import text_windows
    from test_hf_helpers import cli

    folder, data, adapter = text
    out = tmp_path / "sweep"
    assert cli(monkeypatch, "sweep", "--checkpoint", folder, "--data", data, "--out", out, "--policies",
               "step_norm,kl", "--taus", "1e-12,1e9", "--max-batches", 1, "--batch-size", 2, "--block-size", 12,
               "--no-progress") == 0
    assert "step_norm on L+H" in capsys.readouterr().out
    result = json.loads((out / "looped_sweep.json").read_text())
    windows = text_windows(12, 2)

    def class_ce(high: int, low: int) -> float:
        small = _text_class(adapter, H_cycles=high, L_cycles=low)
        with torch.no_grad():
            logits = small(windows[:, :-1]).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256).double(), windows[:, 1:].reshape(-1)))

    full = result["full"]
    assert full["ce"] == pytest.approx(class_ce(2, 3), rel=1e-5) and full["stack_calls"] == 2 * (3 + 1)
    points = {(p["policy"], p["target"], p["value"]): p for p in result["points"]}
    assert {key[1] for key in points if key[0] == "kl"} == {"H"}
    for target, (high, low) in {"L": (2, 1), "H": (1, 3), "L+H": (1, 1)}.items():
        stops = points[("step_norm", target, 1e9)]
        assert stops["ce"] == pytest.approx(class_ce(high, low), rel=1e-5), target
        assert stops["stack_calls"] == high * (low + 1) and stops["compute_saved"] > 0
        never = points[("step_norm", target, 1e-12)]
        assert never["ce"] == full["ce"] and never["argmax_agreement"] == 1.0 and never["compute_saved"] == 0.0
    fixed = {(row["H"], row["L"]): row for row in result["fixed"]}
    assert fixed[(1, 1)]["ce"] == pytest.approx(class_ce(1, 1), rel=1e-5) and len(fixed) == 6
    assert "Early exit on hrm_text" in (out / "index.html").read_text()


def test_generate_with_an_exit_rule_has_known_answers(text, monkeypatch, capsys):
    """rdepth generate --exit on the folder, greedy: a rule that stops every token after one step gives the tokens
    of the class with H and L cycles 1; without a rule, the class's own greedy generate."""
    from test_hf_helpers import cli

    from rdepth.looped.load import folder_tokenizer

    folder, _, adapter = text
    tokenizer = folder_tokenizer(folder)
    prompt = torch.tensor([list(b"loop 3 turns")])

    def reference(**cycles) -> str:
        model = _text_class(adapter, **cycles)
        with torch.no_grad():
            made = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                  pad_token_id=0)
        return tokenizer.decode(made[0], skip_special_tokens=True)

    common = ("generate", "--checkpoint", folder, "--prompt", "loop 3 turns", "--max-new-tokens", 6, "--temperature", 0)
    assert cli(monkeypatch, *common, "--exit", "step_norm", "--tau", 1e9) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(reference(H_cycles=1, L_cycles=1) + "\n---\n")
    assert "mean L steps per L loop 1.00 of 3, mean H steps 1.00 of 2 (17 positions" in printed
    assert cli(monkeypatch, *common) == 0
    assert capsys.readouterr().out == reference() + "\n---\n"


def test_commands_refuse_what_they_cannot_do_in_one_line(text, tmp_path, monkeypatch, capsys):
    from test_hf_helpers import cli, one_line_error

    folder, data, _ = text
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    err = one_line_error(capsys, cli(monkeypatch, "analyze", "--checkpoints", other, "--data", data, "--out", tmp_path / "a"))
    assert "model_type 'gpt2'" in err and "hrm_text or inkling2_loop_text" in err and "import-hf" in err
    err = one_line_error(capsys, cli(monkeypatch, "analyze", "--checkpoints", folder, "--data", data, "--out",
                                     tmp_path / "a", "--long-loops", 8))
    assert "--long-loops does not apply to a looped Hugging Face folder" in err
    err = one_line_error(capsys, cli(monkeypatch, "analyze", "--checkpoints", folder, "--data", tmp_path, "--out",
                                     tmp_path / "a"))
    assert "reads a UTF-8 text file" in err
    err = one_line_error(capsys, cli(monkeypatch, "generate", "--checkpoint", folder, "--exit", "cosine", "--tau", 0.5,
                                     "--k-max", 3))
    assert "--k-max does not apply" in err
    err = one_line_error(capsys, cli(monkeypatch, "sweep", "--checkpoint", folder, "--data", data, "--out",
                                     tmp_path / "s", "--repeats", 3))
    assert "--repeats does not apply" in err
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "(hrm_text) into rdepth's model" in err and "drive the folder in place" in err


def test_the_gpu_scale_script_runs_tiny_and_skips_1b_without_cuda(tmp_path, capsys):
    """bench/gpu/hrm_text_scale.py (the prepared device call): every timing on a tiny config, and without CUDA the 1B
    size skipped in one line with exit 0."""
    from bench.gpu.hrm_text_scale import main

    assert main(["--out", str(tmp_path), "--size", "tiny", "--tokens", "8", "--warmup", "0", "--repeats", "1",
                 "--batches", "1,2"]) == 0
    report = json.loads((tmp_path / "hrm_text_scale.json").read_text())
    assert [row["batch"] for row in report["batches"]] == [1, 2]
    assert {"prefill", "decode", "step", "exit_decode", "engine"} <= set(report["batches"][0])
    engine = report["batches"][1]["engine"]
    assert engine["requests_agreeing"] == 2 and engine["engine_tokens_per_s"] > 0
    if not torch.cuda.is_available():
        capsys.readouterr()
        assert main(["--out", str(tmp_path / "1b")]) == 0
        assert "skipped, no CUDA device" in capsys.readouterr().out and not (tmp_path / "1b").exists()


if __name__ == "__main__":
    import sys
    import tempfile
    from pathlib import Path

    if sys.argv[1:] != ["write-golden"]:
        sys.exit("usage: python tests/test_looped_hrm_text.py write-golden")
    sys.path.insert(0, str(Path(__file__).parent))
    from looped_helpers import check_golden, golden_numbers, weights_digest

    from rdepth.geometry.config import AnalyzeConfig
    from rdepth.looped.analyze import analyze_folders

    with tempfile.TemporaryDirectory() as scratch:
        folder, data = text_folder(Path(scratch))
        summary = analyze_folders(AnalyzeConfig(checkpoints=[str(folder)], data=str(data), out=f"{scratch}/out",
                                                sequences=2, seq_len=16, progress=False))
        check_golden("looped_hrm_text", golden_numbers(summary), weights_digest(open_looped(folder).model),
                     GOLDEN_ABOUT, write=True)
