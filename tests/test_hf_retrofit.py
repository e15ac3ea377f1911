"""``rdepth retrofit``: looping layers of a plain model, where one loop per group is the original."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf_helpers import cli, one_line_error, tiny_run, tiny_tokenizer  # noqa: E402

from rdepth.errors import RdepthError
from rdepth.model.generation import generate
from rdepth.model.noise import StateNoise

TEXT = "The small village by the lake has an old market and a tower"


@pytest.mark.parametrize("groups", ["2", "1-3", "0|2-3|4"])
@pytest.mark.parametrize("scale", [1.0, 0.0])
def test_one_loop_is_the_original_bit_for_bit(tmp_path, groups, scale):
    from rdepth.interop.retrofit import retrofit_model

    _, plain = tiny_run(tmp_path / "run", groups="", init_state_scale=scale)
    looped = retrofit_model(plain, groups, mean_loops=6.0).eval()
    assert looped.config.groups == groups and looped.config.mean_loops == 6.0
    ids = torch.tensor([tiny_tokenizer().encode(TEXT)] * 2)
    with torch.no_grad():
        expected = plain(ids).logits
        # random initial states (keyed or from a generator) are ignored by the [0 | I] adapters
        for noise in (StateNoise(3, [0, 1]), torch.Generator().manual_seed(5)):
            assert torch.equal(looped(ids, loop_counts=1, noise=noise).logits, expected)
        # the packed path (cached generation) too
        ours = generate(looped, ids[:1], 8, temperature=0, loop_counts=(1,) * looped.n_groups,
                        noise=StateNoise(0, [0]))
        assert ours.tolist() == generate(plain, ids[:1], 8, temperature=0).tolist()
        # every step recomputes layers_g(e) until training moves the adapters' state half off zero
        assert torch.equal(looped(ids, loop_counts=3, noise=StateNoise(3, [0, 1])).logits, expected)
        with torch.no_grad():
            for adapter in looped.adapters:
                adapter.weight[:, : looped.config.d_model] += 0.05
        assert not torch.allclose(looped(ids, loop_counts=3, noise=StateNoise(3, [0, 1])).logits, expected)


def test_refuses_a_model_that_already_loops(tmp_path):
    from rdepth.interop.retrofit import retrofit_model

    _, looped = tiny_run(tmp_path / "run", groups="1|2-3")
    with pytest.raises(RdepthError, match="already loops"):
        retrofit_model(looped, "2")


def test_retrofitted_adapters_train(tmp_path):
    """The identity start is a starting point, not a fixed point: gradients reach the adapter's state half."""
    from rdepth.interop.retrofit import retrofit_model

    _, plain = tiny_run(tmp_path / "run", groups="")
    looped = retrofit_model(plain, "2-3").train()
    ids = torch.tensor([tiny_tokenizer().encode(TEXT)])
    out = looped(ids[:, :-1], ids[:, 1:], loop_counts=3, noise=StateNoise(0, [0]))
    out.loss.backward()
    d = looped.config.d_model
    assert looped.adapters[0].weight.grad[:, :d].abs().sum() > 0


def test_cli_writes_a_run_that_rdepth_reads(tmp_path, monkeypatch, capsys):
    from rdepth.run.checkpoint import load_model, resolve_checkpoint
    from rdepth.run.heldout import run_tokenizer

    run, plain = tiny_run(tmp_path / "run", groups="")
    out = tmp_path / "looped"
    assert cli(monkeypatch, "retrofit", "--checkpoint", run, "--groups", "1|2-3", "--out", out,
               "--mean-loops", "5", "--init-state-scale", "0.5") == 0
    model, config = load_model(out)
    assert config.groups == "1|2-3" and config.mean_loops == 5.0 and config.init_state_scale == 0.5
    assert run_tokenizer(out).encode(TEXT) == tiny_tokenizer().encode(TEXT)
    assert json.loads((resolve_checkpoint(out) / "state.json").read_text())["step"] == 0
    assert json.loads((out / "retrofit.json").read_text())["source_step"] == 7
    ids = torch.tensor([tiny_tokenizer().encode(TEXT)])
    with torch.no_grad():
        assert torch.equal(model(ids, loop_counts=1, noise=StateNoise(0, [0])).logits, plain(ids).logits)
    capsys.readouterr()

    err = one_line_error(capsys, cli(monkeypatch, "retrofit", "--checkpoint", out, "--groups", "2", "--out",
                                     tmp_path / "again"))
    assert "already loops" in err and not (tmp_path / "again").exists()
    err = one_line_error(capsys, cli(monkeypatch, "retrofit", "--checkpoint", run, "--groups", "3-9", "--out",
                                     tmp_path / "bad"))
    assert "out of range" in err and not (tmp_path / "bad").exists()
    err = one_line_error(capsys, cli(monkeypatch, "retrofit", "--checkpoint", tmp_path, "--groups", "2", "--out",
                                     tmp_path / "bad"))
    assert "not an rdepth run" in err
    before = (out / "retrofit.json").read_bytes()
    err = one_line_error(capsys, cli(monkeypatch, "retrofit", "--checkpoint", run, "--groups", "2", "--out", out))
    assert "not empty" in err and (out / "retrofit.json").read_bytes() == before


def test_help(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(monkeypatch, "retrofit", "--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--groups" in text and "--init-from" in text and "--mean-loops" in text


def _train_has_init_from() -> bool:
    import dataclasses

    from rdepth.train.config import TrainConfig

    return "init_from" in {field.name for field in dataclasses.fields(TrainConfig)}


@pytest.mark.skipif(not _train_has_init_from(), reason="rdepth train --init-from is not wired in yet")
def test_train_init_from_a_retrofitted_run(tmp_path, wiki_small, monkeypatch, capsys):
    """``rdepth train --init-from`` starts from the retrofitted weights and model config."""
    from rdepth.data.shards import TokenShards
    from rdepth.run.checkpoint import load_model

    run, _ = tiny_run(tmp_path / "plain", groups="", n_layer=4, tokenizer=TokenShards.open(wiki_small).tokenizer)
    assert cli(monkeypatch, "retrofit", "--checkpoint", run, "--groups", "1-2", "--out", tmp_path / "looped") == 0
    flags = ["--data", wiki_small, "--max-steps", 1, "--lr", "1e-12", "--warmup-steps", 0, "--weight-decay", 0,
             "--batch-size", 2, "--eval-every", 1, "--eval-batches", 1, "--eval-batch-size", 2,
             "--checkpoint-every", 1, "--log-every", 1, "--device", "cpu", "--threads", 1]
    assert cli(monkeypatch, "train", "--init-from", tmp_path / "looped", "--out", tmp_path / "trained", *flags) == 0
    trained, config = load_model(tmp_path / "trained")
    looped, looped_config = load_model(tmp_path / "looped")
    assert config.groups == "1-2" and config.d_model == looped_config.d_model == 32
    for name, tensor in looped.state_dict().items():  # one step at lr 1e-12 moves nothing visible
        torch.testing.assert_close(trained.state_dict()[name], tensor, rtol=0, atol=1e-6)
    capsys.readouterr()
    other, _ = tiny_run(tmp_path / "other", groups="")  # another tokenizer than the data's
    err = one_line_error(capsys, cli(monkeypatch, "train", "--init-from", other, "--out", tmp_path / "bad", *flags))
    assert "--init-from" in err and "tokenizer" in err
