"""A rank whose peer died mid-collective stops with one line, not gloo's ~28-line traceback (issue 43):
under `rdepth train` (torchrun) through the command line, and in the demo's spawned ranks."""

from __future__ import annotations

import multiprocessing
import types

import pytest

from rdepth.errors import lost_peer

GLOO = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41234: "
        "Connection reset by peer")


def test_lost_peer_recognises_gloo_and_nothing_else():
    assert "another rank of this run died" in lost_peer(RuntimeError(GLOO))
    assert lost_peer(RuntimeError("CUDA out of memory")) is None
    assert lost_peer(ValueError(GLOO)) is None


def test_the_command_line_folds_it_into_one_line(monkeypatch, capsys):
    import rdepth.cli.main as cli

    def dying(args):
        raise RuntimeError(GLOO + "\nException raised from recvHdr at ...\nframe #0: ...")

    parser = cli.build_parser()
    original = parser.parse_args
    monkeypatch.setattr(cli, "build_parser", lambda: types.SimpleNamespace(
        parse_args=lambda argv: types.SimpleNamespace(**{**vars(original(argv)), "func": dying})))
    assert cli.main(["prepare", "--corpus", "wiki"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another rank of this run died" in err[0] and err[0].startswith("rdepth prepare: error")


def test_a_spawned_rank_reports_it_as_its_error(monkeypatch, capsys):
    from rdepth.config import get_preset
    from rdepth.train import launch, ranks
    from rdepth.train.config import TrainConfig

    def dying(model_config, train_config):
        raise RuntimeError(GLOO)

    monkeypatch.setattr(launch, "train_or_reuse", dying)
    # in this process: no parent-death signal for pytest, no torchrun variables, no logging reset
    monkeypatch.setattr(ranks, "die_with_parent", lambda parent: None)
    monkeypatch.setattr(ranks, "rank_environment", lambda *args: {})
    monkeypatch.setattr(ranks.logging, "basicConfig", lambda **kwargs: None)
    errors = multiprocessing.get_context("spawn").Queue()
    model = get_preset("tiny").to_dict()
    train = TrainConfig(data="d", out="o", max_steps=2).to_dict()
    with pytest.raises(SystemExit) as stop:
        ranks._rank_main(model, train, 1, 2, 12345, 30, None, errors, 0)
    assert stop.value.code == 2
    rank, text = errors.get(timeout=10)
    assert rank == 1 and "another rank of this run died" in text
    assert capsys.readouterr().err.strip().count("\n") == 0
