"""Inkling-2 (transformers' ``Inkling2LoopForCausalLM``) through rdepth's looped adapter: parity with the class's
own forward and cached greedy decoding, a smaller pass budget against the class with fewer passes, each
pass's cache layers, and the geometry of its passes.

The class never ties its head (``_tied_weights_keys`` is empty: ``embed`` and ``unembed`` are separate
tensors), so both configs have their own head. Every weight is drawn away from its init (the block and
message queries start at zero, which would make the attention residuals a plain mean).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Inkling2LoopForCausalLM"):
    pytest.skip("this transformers has no Inkling2LoopForCausalLM", allow_module_level=True)

from rdepth.errors import RdepthError  # noqa: E402
from rdepth.looped.load import open_looped  # noqa: E402
from rdepth.looped.protocol import forward, greedy  # noqa: E402

VOCAB, OUTPUTS = 48, 44
SLIDING, FULL = "hybrid_sliding", "hybrid"
CONFIGS = {
    # 6 layers in blocks of 2, layers 2-3 looped 3 times
    "passes3": dict(num_hidden_layers=6, loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=3,
                    layer_types=[SLIDING, FULL] * 3),
    # 6 layers, layers 2-5 looped twice (the loop runs to the last layer: no post-loop layers)
    "passes2": dict(num_hidden_layers=6, loop_layer_index_start=2, loop_layer_index_end=6, loop_num_passes=2,
                    layer_types=[FULL, SLIDING, SLIDING, FULL, SLIDING, FULL]),
}
# the grouped matmul of the experts takes no float64 on a CPU: the class's eager experts then
EAGER = {"experts_implementation": "eager"}


def inkling_config(**fields):
    base = dict(vocab_size=VOCAB, unpadded_vocab_size=OUTPUTS, hidden_size=32, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                sliding_window_size=4, d_rel=4, rel_extent=8, log_scaling_n_floor=4, moe_intermediate_size=16,
                n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=2, loop_gate_rank=8,
                eos_token_id=None)
    return transformers.Inkling2LoopTextConfig(**{**base, **fields})


def randomize(model, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype)
            param.copy_(1.0 + 0.1 * draw if "norm" in name and param.dim() == 1 else 0.3 * draw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("inkling2")
    out = {}
    for seed, (name, fields) in enumerate(CONFIGS.items()):
        model = transformers.Inkling2LoopForCausalLM(inkling_config(**fields))
        randomize(model, seed)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def tokens(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, OUTPUTS, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_budget_logits_equal_the_class_forward(folders, name, dtype):
    adapter = open_looped(folders[name], dtype, **EAGER)
    x = tokens()
    with torch.no_grad():
        reference = adapter.model(x).logits
        ours = forward(adapter, x)
        fewer = forward(adapter, x, budgets={"passes": 1})
    assert adapter.model.model.embed_tokens.weight.dtype == dtype
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    assert (fewer - reference).abs().max() > 1e-3  # later passes matter (the message gates are live)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_generation_is_token_identical(folders, name):
    adapter = open_looped(folders[name], torch.float32)
    prompt = tokens(length=6, seed=3)
    with torch.no_grad():
        reference = adapter.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                           do_sample=False, pad_token_id=0)
        ours = greedy(adapter, prompt, 10)
    assert torch.equal(ours, reference)


def test_leaving_after_k_passes_is_the_class_with_k_passes(folders):
    folder = folders["passes3"]
    adapter = open_looped(folder, torch.float64, **EAGER)
    x = tokens()
    for passes in (1, 2):
        config = transformers.AutoConfig.from_pretrained(folder)
        config.loop_num_passes = passes
        fewer = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float64, **EAGER)
        with torch.no_grad():
            torch.testing.assert_close(forward(adapter, x, budgets={"passes": passes}), fewer.eval()(x).logits,
                                       rtol=0, atol=0)


def test_each_pass_writes_its_own_cache_layers(folders):
    adapter = open_looped(folders["passes3"], torch.float64, **EAGER)
    config = adapter.model.config
    cache = adapter.new_cache()
    ctx = adapter.embed(tokens(), cache)

    def filled() -> set[int]:
        return {i for i, layer in enumerate(cache.layers) if layer.is_initialized}

    with torch.no_grad():
        carry = adapter.enter(ctx, "passes", None)
        assert filled() == set(range(config.loop_layer_index_start))
        written = []
        for step in range(config.loop_num_passes):
            before = filled()
            carry = adapter.step(ctx, "passes", (step,), carry)
            assert filled() - before == set(adapter.kv_slots("passes", (step,)))
            written += adapter.kv_slots("passes", (step,))
    looped = config.loop_layer_index_end - config.loop_layer_index_start
    assert len(cache.layers) == config.num_hidden_layers + (config.loop_num_passes - 1) * looped
    assert sorted(written) == [2, 3, 6, 7, 8, 9]


def test_bad_input_is_one_line(folders, tmp_path):
    wrapper = tmp_path / "multimodal"
    wrapper.mkdir()
    (wrapper / "config.json").write_text(json.dumps({"model_type": "inkling2_loop"}))
    with pytest.raises(RdepthError, match="load its text model, model_type inkling2_loop_text"):
        open_looped(wrapper)
    adapter = open_looped(folders["passes2"])
    with pytest.raises(RdepthError, match=r"budget of loop 'passes' must be in 1\.\.2, got 3"):
        forward(adapter, tokens(), budgets={"passes": 3})


def test_geometry_of_the_passes(folders, tmp_path):
    """The passes' iterates: step 0 is the pre-loop state every pass restarts from, step k the hidden state at
    the end of pass k; leaving from step k's carry gives the class with k passes (tested above), and the
    saved step sizes are the norms of the recorded updates."""
    from rdepth.looped.geometry import SUMMARY_FILE, analyze_looped, record_iterates

    adapter = open_looped(folders["passes3"], torch.float64, **EAGER)
    x = tokens(length=7)
    logits, iterates = record_iterates(adapter, x)
    assert list(iterates) == ["passes"] and iterates["passes"].shape == (4, 14, 32)
    with torch.no_grad():
        ctx = adapter.embed(x)
        pre = adapter.enter(ctx, "passes", None)
        first = adapter.step(ctx, "passes", (0,), pre)
        torch.testing.assert_close(logits, adapter.model(x).logits, rtol=0, atol=0)
    torch.testing.assert_close(iterates["passes"][0], pre.hidden.double().reshape(14, 32), rtol=0, atol=0)
    torch.testing.assert_close(iterates["passes"][1], first.hidden.double().reshape(14, 32), rtol=0, atol=0)
    analyze_looped(adapter, x, tmp_path)
    saved = json.loads((tmp_path / SUMMARY_FILE).read_text())
    states = iterates["passes"]
    expected = (states[1:] - states[:-1]).norm(dim=-1).mean(dim=-1)
    torch.testing.assert_close(torch.tensor(saved["trajectories"]["passes"]["step_size"], dtype=torch.float64),
                               expected)
    assert saved["boundaries"] == {} and saved["budgets"] == {"passes": 3}


# -- the commands on a folder (rdepth analyze, sweep, generate) ------------------------------------------

TEXT_CONFIG = dict(CONFIGS["passes3"], vocab_size=256, unpadded_vocab_size=256, max_position_embeddings=64)
GOLDEN_SEED = 4321
GOLDEN_ABOUT = ("rdepth analyze on a tiny random Inkling-2 (tests/test_looped_inkling2.py text_folder: 32 wide, 3 passes "
                "over layers 2-3 of 6, weights drawn from seed 4321, a byte tokenizer) over 2 windows of 16 bytes of "
                "tests/looped_helpers.TEXT, float64: the summary's headline numbers. Rewrite with "
                "python tests/test_looped_inkling2.py write-golden")


def text_folder(root, seed: int = GOLDEN_SEED):
    """A tiny Inkling-2 with a byte tokenizer (ids = UTF-8 bytes) saved as a Hugging Face folder, and its text."""
    from looped_helpers import write_text

    from rdepth.looped.load import save_byte_tokenizer

    model = transformers.Inkling2LoopForCausalLM(inkling_config(**TEXT_CONFIG))
    randomize(model, seed)
    model.save_pretrained(root / "inkling")
    save_byte_tokenizer(root / "inkling")
    return root / "inkling", write_text(root)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    folder, data = text_folder(tmp_path_factory.mktemp("inkling_commands"))
    return folder, data, open_looped(folder, torch.float64)


def test_analyze_measures_the_passes(text, tmp_path, monkeypatch):
    """rdepth analyze on the folder: one group (the passes) with the recorded iterates' step sizes, the class's own
    loss, no boundary (claim 3 not tested), and the golden file's numbers."""
    from looped_helpers import check_golden, golden_numbers, text_windows, weights_digest
    from test_hf_helpers import cli

    from rdepth.looped.geometry import record_iterates

    folder, data, adapter = text
    out = tmp_path / "out"
    assert cli(monkeypatch, "analyze", "--checkpoints", folder, "--data", data, "--out", out, "--sequences", 2,
               "--seq-len", 16, "--no-progress") == 0
    summary = json.loads((out / "geometry" / "summary.json").read_text())
    assert summary["groups"] == ["passes"] and summary["budgets"] == {"train": [3]}
    windows = text_windows(16, 2)
    with torch.no_grad():
        _, iterates = record_iterates(adapter, windows[:, :-1])
        own = torch.nn.functional.cross_entropy(adapter.model(windows[:, :-1]).logits.reshape(-1, 256).double(),
                                                windows[:, 1:].reshape(-1))
    budget = summary["checkpoints"][0]["budgets"]["train"]
    assert budget["loss"] == pytest.approx(float(own), rel=1e-12) and budget["dlr"] == {}
    states = iterates["passes"]
    assert budget["groups"][0]["step_size"]["mean"] == pytest.approx(
        (states[1:] - states[:-1]).norm(dim=-1).mean(dim=-1).tolist(), rel=1e-9)
    claims = json.loads((out / "claims.json").read_text())
    assert claims["verdicts"]["dlr"] == "not tested" and "no boundary" in claims["claims"][3]["why"][0]
    assert "geometry claims judged on inkling2_loop_text" in (out / "index.html").read_text()
    check_golden("looped_inkling2", golden_numbers(summary), weights_digest(adapter.model), GOLDEN_ABOUT)


def test_generate_at_a_pass_budget_is_the_class_with_those_passes(text, monkeypatch, capsys):
    from test_hf_helpers import cli

    from rdepth.looped.load import folder_tokenizer

    folder, _, _ = text
    prompt = torch.tensor([list(b"loop 3 turns")])
    config = transformers.AutoConfig.from_pretrained(folder)
    config.loop_num_passes = 2
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        made = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
    assert cli(monkeypatch, "generate", "--checkpoint", folder, "--prompt", "loop 3 turns", "--max-new-tokens", 6,
               "--temperature", 0, "--loops", 2) == 0
    assert capsys.readouterr().out == folder_tokenizer(folder).decode(made[0], skip_special_tokens=True) + "\n---\n"


def test_exit_commands_are_refused_in_one_line(text, tmp_path, monkeypatch, capsys):
    """Inkling-2's passes have no per-token exit: rdepth sweep and generate --exit say so; import-hf points at the
    commands that drive the folder in place."""
    from test_hf_helpers import cli, one_line_error

    folder, data, _ = text
    err = one_line_error(capsys, cli(monkeypatch, "sweep", "--checkpoint", folder, "--data", data, "--out",
                                     tmp_path / "sweep"))
    assert "per-token exits are offered for HRM-Text only" in err
    err = one_line_error(capsys, cli(monkeypatch, "generate", "--checkpoint", folder, "--exit", "cosine", "--tau", 0.5))
    assert "--exit is offered for HRM-Text only" in err
    err = one_line_error(capsys, cli(monkeypatch, "generate", "--checkpoint", folder, "--loops", "2,2"))
    assert "--loops for inkling2_loop_text is passes (1 count(s))" in err
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "(inkling2_loop_text) into rdepth's model" in err


if __name__ == "__main__":
    import sys
    import tempfile
    from pathlib import Path

    if sys.argv[1:] != ["write-golden"]:
        sys.exit("usage: python tests/test_looped_inkling2.py write-golden")
    sys.path.insert(0, str(Path(__file__).parent))
    from looped_helpers import check_golden, golden_numbers, weights_digest

    from rdepth.geometry.config import AnalyzeConfig
    from rdepth.looped.analyze import analyze_folders

    with tempfile.TemporaryDirectory() as scratch:
        folder, data = text_folder(Path(scratch))
        summary = analyze_folders(AnalyzeConfig(checkpoints=[str(folder)], data=str(data), out=f"{scratch}/out",
                                                sequences=2, seq_len=16, progress=False))
        check_golden("looped_inkling2", golden_numbers(summary), weights_digest(open_looped(folder).model),
                     GOLDEN_ABOUT, write=True)
