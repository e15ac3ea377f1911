"""``rdepth import-hf``: exported folders come back exactly; other architectures are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.model.noise import StateNoise

from test_hf_helpers import cli, one_line_error, tiny_run, tiny_tokenizer  # noqa: E402

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
        assert torch.equal(back(ids, generator=StateNoise(0, [0])).logits,
                           model(ids, loop_counts=(2, 3), generator=StateNoise(0, [0])).logits)


def _tiny_gpt2(folder):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_gpt2_is_refused_with_the_mismatch_named(tmp_path, monkeypatch, capsys):
    from rdepth.interop.hf_import import load_hf_folder

    folder = _tiny_gpt2(tmp_path / "gpt2")
    capsys.readouterr()  # transformers' own warnings while saving
    with pytest.raises(RdepthError, match="sandwich-RMSNorm"):
        load_hf_folder(folder)
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", folder, "--out", tmp_path / "run"))
    assert "(gpt2)" in err and "LayerNorm with biases" in err and not (tmp_path / "run").exists()


def test_other_bad_folders(tmp_path, monkeypatch, capsys):
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", tmp_path / "nope", "--out", tmp_path / "r"))
    assert "not found" in err
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "bert"}))
    err = one_line_error(capsys, cli(monkeypatch, "import-hf", "--hf", odd, "--out", tmp_path / "r"))
    assert "'bert'" in err and "supported: rdepth" in err
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
