"""Every compute command takes --threads and sets torch's CPU threads before any work."""

from __future__ import annotations

import pytest
import torch

from rdepth.cli.main import main
from rdepth.errors import RdepthError


@pytest.mark.parametrize("command", ["train", "eval", "generate", "analyze", "sweep", "surrogate", "demo"])
def test_every_compute_command_has_a_threads_flag(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--threads INT" in capsys.readouterr().out


def _recorded(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def test_analyze_and_sweep_set_threads_first(monkeypatch, tmp_path):
    from rdepth.geometry.analyze import analyze
    from rdepth.geometry.config import AnalyzeConfig
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.run import sweep_checkpoint

    calls = _recorded(monkeypatch)
    missing = str(tmp_path / "no-run")
    with pytest.raises(RdepthError):  # the run does not exist: threads were set before it was looked for
        analyze(AnalyzeConfig(checkpoints=[missing], data=missing, out=str(tmp_path / "a"), threads=3))
    with pytest.raises(RdepthError):
        sweep_checkpoint(SweepConfig(checkpoint=missing, data=missing, out=str(tmp_path / "s"), threads=2))
    assert calls == [3, 2]
    calls.clear()
    with pytest.raises(RdepthError):  # 0 keeps torch's default
        analyze(AnalyzeConfig(checkpoints=[missing], data=missing, out=str(tmp_path / "a")))
    assert calls == []


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_threads_must_be_a_count(bad, tmp_path):
    from rdepth.geometry.config import AnalyzeConfig
    from rdepth.sweep.config import SweepConfig

    with pytest.raises(RdepthError, match="threads"):
        AnalyzeConfig(checkpoints=["x"], data="x", out="x", threads=bad)
    with pytest.raises(RdepthError, match="threads"):
        SweepConfig(checkpoint="x", data="x", out="x", threads=bad)
