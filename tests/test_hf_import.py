"""``rdepth import-hf``: exported folders come back exactly; other architectures are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf_helpers import cli, one_line_error, tiny_run, tiny_tokenizer  # noqa: E402

from rdepth.errors import RdepthError
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise

TEXT = "The river runs south past the old bridge"


def test_export_then_import_is_the_same_run(tmp_path, monkeypatch):
    from rdepth.run.checkpoint import load_model
    from rdepth.run.heldout import run_tokenizer

    run, model = tiny_run(tmp_path / "run", groups="1|2-3")
    assert cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "hf", "--loops", "2,3") == 0
    assert cli(monkeypatch, "import-hf", "--hf", tmp_path / "hf", "--out", tmp_path / "back") == 0
    back, config = load_model(tmp_path / "back")
    assert config.eval_loops == (2, 3)  # the exported default budget
    assert config.replace(eval_loops=None) == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor)
    assert run_tokenizer(tmp_path / "back").encode(TEXT) == tiny_tokenizer().encode(TEXT)
    ids = torch.tensor([tiny_tokenizer().encode(TEXT)])
    with torch.no_grad():
        assert torch.equal(back(ids, noise=StateNoise(0, [0])).logits,
                           model(ids, loop_counts=(2, 3), noise=StateNoise(0, [0])).logits)


def _tiny_gpt2(folder, vocab_size=None, **overrides):
    """A random GPT-2 folder with every parameter (biases, norm gains) random, and a tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    config = transformers.GPT2Config(vocab_size=vocab_size or tokenizer.vocab_size, n_positions=32, n_embd=16,
                                     n_layer=3, n_head=2, **overrides)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    tokenizer.save(folder / "bpe")
    (folder / "tokenizer.json").write_text((folder / "bpe" / "tokenizer.json").read_text())
    return folder, model


def test_gpt2_logits_equal_transformers(tmp_path, monkeypatch):
    from rdepth.run.checkpoint import load_model
    from rdepth.run.heldout import run_tokenizer

    folder, reference = _tiny_gpt2(tmp_path / "gpt2")
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run") == 0
    model, config = load_model(tmp_path / "run")
    assert config.block == "gpt2" and config.groups == "" and config.n_layer == 3
    assert run_tokenizer(tmp_path / "run").encode(TEXT) == tiny_tokenizer().encode(TEXT)
    ids = torch.tensor([tiny_tokenizer().encode(TEXT)[:20], tiny_tokenizer().encode(TEXT[::-1])[:20]])
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(model.eval()(ids).logits, expected, rtol=1e-5, atol=1e-5)
        # cached decoding (rdepth's decoder) gives the same logits
        decoder = Decoder(model, 2)
        pieces = [decoder.prefill(ids[:, :7])] + [decoder.step(ids[:, t:t + 1])[:, None] for t in range(7, 20)]
        torch.testing.assert_close(torch.cat(pieces, 1), expected, rtol=1e-5, atol=1e-5)


def test_gpt2_greedy_tokens_equal_transformers_generate(tmp_path, monkeypatch):
    from rdepth.model.generation import generate
    from rdepth.run.checkpoint import load_model

    folder, reference = _tiny_gpt2(tmp_path / "gpt2")
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run") == 0
    model, _ = load_model(tmp_path / "run")
    prompt = torch.tensor([tiny_tokenizer().encode(TEXT)[:6]])
    with torch.no_grad():
        theirs = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        ours = generate(model.eval(), prompt, 12, temperature=0)
    assert torch.equal(ours, theirs)


def test_gpt2_from_pytorch_model_bin_and_retrofit_keeps_it_exact(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from rdepth.interop.hf_import import load_hf_folder
    from rdepth.interop.retrofit import retrofit_model

    folder, reference = _tiny_gpt2(tmp_path / "gpt2")
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save({name: tensor for name, tensor in weights.items()}, folder / "pytorch_model.bin")
    model, _ = load_hf_folder(folder)
    ids = torch.tensor([tiny_tokenizer().encode(TEXT)[:16]])
    looped = retrofit_model(model, "1-2", mean_loops=3.0, init_state_scale=1.0).eval()
    with torch.no_grad():
        plain = model(ids).logits
        torch.testing.assert_close(plain, reference(ids).logits, rtol=1e-5, atol=1e-5)
        for counts in ((1,), (4,)):  # the [0 | I] adapters ignore the state: the original, bit for bit
            assert torch.equal(looped(ids, loop_counts=counts, noise=torch.Generator().manual_seed(3)).logits,
                               plain)


def test_gpt2_tokenizer_is_rdepths_exact_gpt2_when_the_files_are_gpt2s(tmp_path):
    from rdepth.data.fetch import gpt2_bpe_files
    from rdepth.interop.hf_gpt2 import gpt2_tokenizer_files

    files = gpt2_bpe_files()
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "vocab.json").write_text(files["encoder.json"].read_text())
    (folder / "merges.txt").write_text(files["vocab.bpe"].read_text())
    assert gpt2_tokenizer_files(folder, 50257)[0] == "gpt2"
    (folder / "merges.txt").write_text("#version: 0.2\nĠ t\n")  # another BPE, and no tokenizer.json
    with pytest.raises(RdepthError, match="has no tokenizer"):
        gpt2_tokenizer_files(folder, 50257)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(activation_function="relu"), "activation_function 'relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(n_inner=40), "n_inner 40"),
])
def test_gpt2_settings_rdepth_does_not_compute_are_refused(tmp_path, monkeypatch, capsys, overrides, fragment):
    folder, _ = _tiny_gpt2(tmp_path / "gpt2", **overrides)
    capsys.readouterr()
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "(gpt2)" in err and fragment in err and not (tmp_path / "run").exists()


def test_gpt2_bad_weights_are_refused(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    folder, _ = _tiny_gpt2(tmp_path / "gpt2")
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["transformer.wte.weight"] + 1  # an untied head
    save_file(weights, str(folder / "model.safetensors"))
    capsys.readouterr()
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "lm_head differs from wte" in err
    del weights["lm_head.weight"], weights["transformer.h.1.mlp.c_fc.bias"]
    save_file(weights, str(folder / "model.safetensors"))
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "'h.1.mlp.c_fc.bias' is missing" in err and not (tmp_path / "run").exists()


def test_other_bad_folders(tmp_path, monkeypatch, capsys):
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", tmp_path / "nope", "--out", tmp_path / "r"))
    assert "not found" in err
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "bert"}))
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", odd, "--out", tmp_path / "r"))
    assert "'bert'" in err and "Huginn-0125 (raven) folders (model_type huginn_raven)" in err and "GPT-2" in err
    assert "Ouro (LoopLM) folders (model_type ouro)" in err
    (odd / "config.json").write_text(json.dumps({"model_type": "gpt_neo"}))
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", odd, "--out", tmp_path / "r"))
    assert "(gpt_neo)" in err and "local (windowed)" in err
    (odd / "config.json").write_text("{not json")
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", odd, "--out", tmp_path / "r"))
    assert "not valid JSON" in err
    # an exported folder whose weights were cut short
    run, _ = tiny_run(tmp_path / "run")
    assert cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "hf") == 0
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", tmp_path / "hf", "--out", tmp_path / "r"))
    assert "corrupt" in err and not (tmp_path / "r").exists()
    # an existing, non-empty --out is never touched
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", tmp_path / "hf", "--out", run))
    assert "not empty" in err


def test_help(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(monkeypatch, "import-hf", "--help")
    assert exit_info.value.code == 0
    assert "--hf" in capsys.readouterr().out


def test_imported_gpt2_is_a_surrogate_teacher_with_the_hf_folders_states(tmp_path, monkeypatch):
    """The run import-hf writes and the surrogate's own loader of the same folder agree layer by layer."""
    from rdepth.surrogate.teachers.hf_loader import load_hf_teacher
    from rdepth.surrogate.teachers.rdepth_teacher import load_rdepth_teacher

    folder, _ = _tiny_gpt2(tmp_path / "gpt2")
    assert cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run") == 0
    ids = torch.tensor([tiny_tokenizer().encode(TEXT)[:12]])
    with torch.no_grad():
        ours = load_rdepth_teacher(tmp_path / "run").layer_states(ids)
        theirs = load_hf_teacher(folder).layer_states(ids)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["rdepth", "gpt2"])
@pytest.mark.parametrize("damage", ["int32", "nan"])
def test_integer_or_nan_weights_are_refused(tmp_path, monkeypatch, capsys, kind, damage):
    """int32 weights (cast to float32 they were all zeros: a uniform model whose eval exited 0) and NaN
    weights loaded without complaint before; now a one-line error and no run folder."""
    from safetensors.torch import load_file, save_file

    if kind == "rdepth":
        run, _ = tiny_run(tmp_path / "run", groups="1|2-3")
        assert cli(monkeypatch, "export", "--checkpoint", run, "--out", tmp_path / "hf") == 0
        folder = tmp_path / "hf"
    else:
        folder, _ = _tiny_gpt2(tmp_path / "hf")
    weights = load_file(str(folder / "model.safetensors"))
    if damage == "int32":
        weights = {name: tensor.to(torch.int32) for name, tensor in weights.items()}
    else:
        name = sorted(weights)[0]
        weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(folder / "model.safetensors"))
    capsys.readouterr()
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "back"))
    assert ("not a floating-point type" if damage == "int32" else "NaN or infinite") in err
    assert not (tmp_path / "back").exists()
