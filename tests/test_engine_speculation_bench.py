"""bench/engine_speculation.py end to end on the tiny text run: every setting's tokens equal the plain engine's,
and a bad --draft-loops is one line."""

from __future__ import annotations

import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_setting_gives_the_plain_engines_tokens(tiny_text_run, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("engine_speculation")
    assert bench.main(["--run", str(tiny_text_run), "--new-tokens", "4", "--rounds", "1", "--draft-loops", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    assert len(lines) == 2 and all(line.endswith("tokens equal plain: True") for line in lines)
    assert bench.main(["--run", str(tiny_text_run), "--draft-loops", "0"]) == 2
    assert "--draft-loops takes integers >= 1" in capsys.readouterr().err
