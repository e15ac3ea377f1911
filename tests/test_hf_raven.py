"""``rdepth import-hf`` on Huginn-0125 / raven folders (rdepth.interop.hf_raven): the layout maps onto the
one model, and whatever rdepth cannot honour is refused in one line naming it, with nothing written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_helpers import cli, one_line_error, real, tiny_tokenizer  # noqa: E402

from rdepth.interop.hf_raven import HUGINN_0125, raven_config_json, raven_model, raven_weight_shapes, write_raven_folder
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise


def raven_folder(path, **overrides):
    tokenizer = tiny_tokenizer()
    folder = path / "raven"
    tokenizer.save(path / "bpe")
    return write_raven_folder(folder, seed=3, tokenizer_json=(path / "bpe" / "tokenizer.json").read_text(),
                              vocab_size=tokenizer.vocab_size, **overrides)


def test_a_raven_folder_imports_into_the_one_model(tmp_path, monkeypatch):
    from rdepth.run.checkpoint import load_model

    folder = raven_folder(tmp_path)
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run") == 0
    model, config = load_model(tmp_path / "run")
    assert (config.n_layer, config.groups, config.positions, config.mlp, config.mlp_hidden) == (
        4, "1-2", "rotary", "swiglu", 48)
    assert config.qk_bias and config.handoff_norm and config.eval_loops == (4,) and config.mean_loops == 5.0
    weights = load_file(str(folder / "model.safetensors"))
    torch.testing.assert_close(model.layers[2].attn.qkv.weight, weights["transformer.core_block.1.attn.Wqkv.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(model.layers[3].attn.qk_bias, weights["transformer.coda.0.attn.qk_bias"][:, 0],
                               rtol=0, atol=0)
    torch.testing.assert_close(model.adapters[0].weight, weights["transformer.adapter.weight"], rtol=0, atol=0)
    model = model.double()
    idx = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    noise = StateNoise(0, [0, 1])
    forced = model(idx, loop_counts=4, noise=noise).logits
    decoder = Decoder(model, 2, loop_counts=4, noise=noise)
    stepped = torch.cat([decoder.prefill(idx[:, :4])] + [decoder.step(idx[:, t:t + 1])[:, None] for t in range(4, 9)], 1)
    torch.testing.assert_close(stepped, forced, rtol=0, atol=1e-10)


def test_the_writer_is_a_function_of_its_seed(tmp_path):
    first = load_file(str(write_raven_folder(tmp_path / "a", seed=5) / "model.safetensors"))
    again = load_file(str(write_raven_folder(tmp_path / "b", seed=5) / "model.safetensors"))
    other = load_file(str(write_raven_folder(tmp_path / "c", seed=6) / "model.safetensors"))
    assert set(first) == set(raven_weight_shapes(raven_config_json())) | {"freqs_cis"}
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["transformer.adapter.weight"], other["transformer.adapter.weight"])


def _edit_weights(folder, edit):
    weights = load_file(str(folder / "model.safetensors"))
    edit(weights)
    save_file(weights, str(folder / "model.safetensors"))


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, named", [
    (lambda f: _edit_weights(f, lambda w: w.pop("transformer.coda.0.mlp.fc.weight")), "transformer.coda.0.mlp.fc.weight"),
    (lambda f: _edit_weights(f, lambda w: w.update({"transformer.extra.weight": torch.zeros(2)})),
     "transformer.extra.weight"),
    (lambda f: _edit_weights(f, lambda w: w.update({"transformer.adapter.weight": torch.zeros(32, 32)})),
     "transformer.adapter.weight"),
    (lambda f: _edit_weights(f, lambda w: w.update({"lm_head.weight": torch.zeros_like(w["transformer.wte.weight"])})),
     "lm_head"),
    (lambda f: _edit_weights(f, lambda w: w.update({"freqs_cis": torch.zeros(1, 64, 1, 4, 2)})), "freqs_cis"),
    (lambda f: _edit_config(f, num_key_value_heads=2), "num_key_value_heads"),
    (lambda f: _edit_config(f, nonlin_name="GELU"), "nonlin_name"),
    (lambda f: _edit_config(f, tie_embeddings=False), "tie_embeddings"),
    (lambda f: _edit_config(f, test_time_noise=0.5), "test_time_noise"),
    (lambda f: _edit_config(f, intermediate_size=40), "transformer.prelude.0.mlp.fc.weight"),
])
def test_bad_raven_folders_are_refused_in_one_line(tmp_path, monkeypatch, capsys, damage, named):
    folder = raven_folder(tmp_path)
    damage(folder)
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert named in err
    assert not (tmp_path / "run").exists()


GOLDEN = Path(__file__).parent / "golden" / "raven_tiny"


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_the_import_reproduces_the_reference_logits(tmp_path, dtype, tolerance):
    """tests/golden/raven_tiny: the checkpoint the writer makes from a seed (its bytes checked by hash), the
    reference implementation's logits for it at 1, 4 and 32 recurrences from rdepth's initial state (the
    .json names the code, versions and call). The import reproduces them: float32 against the released
    file, float64 against it with its float32 casts widened."""
    meta = json.loads(GOLDEN.with_suffix(".json").read_text())
    golden = load_file(str(GOLDEN.with_suffix(".safetensors")))
    folder = write_raven_folder(tmp_path / "raven", meta["writer"]["seed"], **meta["writer"]["overrides"])
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digest == meta["writer"]["model_safetensors_sha256"], "the writer no longer makes the golden checkpoint"
    model = raven_model(folder).to(dtype)
    tokens = torch.tensor(meta["tokens"])
    noise = StateNoise(meta["state_noise"]["seed"], meta["state_noise"]["sequence_ids"])
    state = model.init_state(0, torch.zeros(*tokens.shape, model.config.d_model), noise)
    assert torch.equal(state.float(), golden["state"]), "the initial state is not the one the reference was given"
    for steps in meta["steps"]:
        with torch.no_grad():
            logits = model(tokens, loop_counts=steps, noise=noise).logits
        reference = golden[f"logits_{str(dtype)[6:]}_steps{steps}"]
        assert reference.dtype == dtype
        difference = (logits - reference).abs().max().item()
        assert difference <= tolerance, f"{steps} recurrences: max |rdepth - reference| = {difference:.3e}"


def test_decoding_with_exits_reproduces_the_references_latest_m4_generation(tmp_path):
    """tests/golden/raven_exits.json: the reference's generate_with_adaptive_compute (latent-diff exits, its
    latest-m4 cache, greedy, batch 1) on a checkpoint the writer makes from a seed in Huginn's 2 + 4 layout.
    rdepth's decoder with latent_diff stops every token at the reference's step (5 to 16 steps), picks the
    same tokens and gives its logits: the cache rdepth reads after an exit is the reference's latest-m4."""
    from rdepth.exits.controller import controller_factory

    meta = json.loads((GOLDEN.parent / "raven_exits.json").read_text())
    folder = write_raven_folder(tmp_path / "raven", meta["writer"]["seed"], **meta["writer"]["overrides"])
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digest == meta["writer"]["model_safetensors_sha256"], "the writer no longer makes the golden checkpoint"
    model = raven_model(folder)
    noise = StateNoise(meta["state_noise"]["seed"], meta["state_noise"]["sequence_ids"])
    spread = set()
    for run in meta["runs"]:
        factory = controller_factory("latent_diff", run["tau"], (meta["cap"],), None, {})
        decoder = Decoder(model, 1, controller_factory=factory, noise=noise)
        logits = [decoder.prefill(torch.tensor(meta["prompt"]))[:, -1]]
        steps = [int(decoder.computed[0, 0])]
        for token in run["tokens"][:-1]:
            logits.append(decoder.step(torch.tensor([[token]])))
            steps.append(int(decoder.computed[0, 0]))
        logits = torch.cat(logits)
        assert steps == run["steps"], f"tau {run['tau']}"
        assert logits.argmax(-1).tolist() == run["tokens"]
        assert (logits - torch.tensor(run["logits"])).abs().max().item() <= 1e-5
        spread.update(steps)
    assert len(spread) >= 6


def test_huginn_0125s_published_config_is_accepted_and_sized():
    """Its layout (prelude 2, core 4 looped 32 times by default, coda 2) and its parameter count: 3,564,976,800,
    what the reference's own class counts for this config (the tied head once), built on the meta device."""
    from rdepth.config import ModelConfig
    from rdepth.interop.hf_raven import raven_model_config
    from rdepth.model import RecurrentLM

    values = raven_model_config(Path("huginn-0125"), HUGINN_0125)
    config = ModelConfig.from_dict({**values, "tokenizer": "bpe:65536"})
    assert (config.n_layer, config.groups, config.eval_loops, config.rope_base) == (8, "2-5", (32,), 50_000.0)
    with torch.device("meta"):
        model = RecurrentLM(config)
    assert model.num_parameters() == 3_564_976_800
    assert abs(config.weight_count / model.num_parameters() - 1) < 1e-3  # the memory check's estimate


def test_the_huginn_tiny_preset_is_huginn_0125s_architecture_at_its_width():
    """Every architecture field of the ``huginn_tiny`` preset is what the raven importer gives Huginn-0125's
    config at d 128, 4 heads, 384 hidden, a 128-token context and 4,096 words (the loop counts are its own); a
    changed field (the MLP) is told apart."""
    from dataclasses import asdict, replace

    from rdepth.config import ModelConfig, get_preset
    from rdepth.interop.hf_raven import raven_model_config

    small = {**HUGINN_0125, "n_embd": 128, "n_heads": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
             "intermediate_size": 384, "block_size": 128, "vocab_size": 4096, "padded_vocab_size": 4096}
    small.pop("head_dim", None)
    imported = ModelConfig.from_dict({**raven_model_config(Path("huginn-tiny"), small), "tokenizer": "bpe:4096"})
    loops = {"mean_loops", "loop_sigma", "backprop_depth", "eval_loops", "init_state_scale"}

    def architecture(config):
        return {key: value for key, value in asdict(config).items() if key not in loops}

    preset = get_preset("huginn_tiny")
    assert architecture(preset) == architecture(imported)
    assert architecture(replace(preset, mlp="plain")) != architecture(imported)


def test_an_imported_raven_run_exports_with_equal_logits(tmp_path, monkeypatch):
    """raven folder -> rdepth run -> exported folder: transformers' model of the export gives rdepth's logits
    bit for bit (every raven option travels in config.json and the bundled code), cached generation too."""
    transformers = pytest.importorskip("transformers")
    from rdepth.run.checkpoint import load_model

    folder = raven_folder(tmp_path)
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run") == 0
    assert cli(monkeypatch, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["positions"], config["mlp"], config["qk_bias"], config["handoff_norm"]) == (
        "rotary", "swiglu", True, True)
    model, _ = load_model(tmp_path / "run")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for steps in (1, 4):
            assert torch.equal(real(hf(ids, loop_counts=[steps]).logits),
                               model(ids, loop_counts=steps, noise=StateNoise(0, [0])).logits)
        cached = hf.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
        uncached = hf.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_a_raven_model_too_large_for_the_machine_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    import rdepth.config

    folder = raven_folder(tmp_path)
    monkeypatch.setattr(rdepth.config, "machine_memory_bytes", lambda: 1000)
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "cannot import" in err and "GiB" in err and "memory" in err
    assert not (tmp_path / "run").exists()


def test_exported_hidden_states_hand_on_what_the_coda_reads(tmp_path, monkeypatch):
    """With the hand-off norm, the exported model's hidden state of the core is the normalised state the
    coda reads, and the last hidden state is what the head reads: the logits follow from it."""
    transformers = pytest.importorskip("transformers")
    from rdepth.run.checkpoint import load_model

    folder = raven_folder(tmp_path)
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run") == 0
    assert cli(monkeypatch, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf") == 0
    model, _ = load_model(tmp_path / "run")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = hf(ids, loop_counts=[3], output_hidden_states=True)
        core_out = out.loop_states[0][-1]  # the last iterate, [B, T, d]
        torch.testing.assert_close(out.hidden_states[2], model.norm_f(core_out), rtol=0, atol=0)
        coda = model.run_layers([3], out.hidden_states[2])
        torch.testing.assert_close(out.hidden_states[3], coda, rtol=0, atol=0)
        logits = torch.nn.functional.linear(out.hidden_states[-1], model.wte.weight)[..., : model.config.vocab_size]
        torch.testing.assert_close(logits, real(out.logits), rtol=0, atol=1e-6)


def test_a_folder_holding_one_file_and_a_sharded_index_takes_the_file(tmp_path, monkeypatch):
    """Issue 55: with both ``model.safetensors`` and ``model.safetensors.index.json`` the import took the shards;
    transformers' ``from_pretrained`` takes the single file, and so does the import now."""
    folder = raven_folder(tmp_path / "a")
    alone = tmp_path / "alone"
    alone.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (alone / name).write_bytes((folder / name).read_bytes())
    other = write_raven_folder(tmp_path / "other", seed=9, vocab_size=tiny_tokenizer().vocab_size)
    shard = "model-00001-of-00001.safetensors"
    (folder / shard).write_bytes((other / "model.safetensors").read_bytes())
    names = load_file(str(other / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {name: shard for name in names}}))
    for source, out in ((folder, "both"), (alone, "single")):
        assert cli(monkeypatch, "import-hf", "--hf", source, "--out", tmp_path / out) == 0
    weights = [(tmp_path / out / "checkpoints" / "step_000000" / "model.safetensors").read_bytes()
               for out in ("both", "single")]
    assert weights[0] == weights[1]


def test_a_vocabulary_under_257_names_what_is_wrong_with_the_folder(tmp_path, monkeypatch, capsys):
    """Issue 55: the refusal named a tokenizer spec ('bpe:96') the user never wrote."""
    folder = write_raven_folder(tmp_path / "raven", tokenizer_json="{}")  # TINY_RAVEN: 96 tokens
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "its vocabulary has 96 tokens" in err and "bpe:96" not in err and not (tmp_path / "run").exists()


def test_import_hf_names_every_format_it_reads(tmp_path, monkeypatch, capsys):
    """Issue 55: the help named rdepth exports and GPT-2 folders only; Huginn-0125 (raven) folders import too."""
    from rdepth.interop.hf_import import FORMAT_NAMES, IMPORTERS

    with pytest.raises(SystemExit):
        cli(monkeypatch, "import-hf", "--help")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Huginn-0125 (raven)" in help_text and "GPT-2" in help_text and "rdepth export" in help_text
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "bert"}))
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", odd, "--out", tmp_path / "r"))
    for kind in IMPORTERS:  # a format added without a name in the refusal fails here
        assert kind in FORMAT_NAMES and f"{FORMAT_NAMES[kind]} (model_type {kind})" in err
