"""bench/engine_speculation.py end to end on the tiny text run: every setting's tokens equal the plain engine's,
and a bad --draft-loops is one line."""

from __future__ import annotations

import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_setting_gives_the_plain_engines_tokens(tiny_text_run, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("engine_speculation")
    assert bench.main(["--run", str(tiny_text_run), "--new-tokens", "4", "--rounds", "1", "--draft-loops", "1",
                       "--widths", "1,2", "--speculate-at-most", "2"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "tokens/s" in line]
    assert len(lines) == 4 and all(line.endswith("tokens equal plain: True") for line in lines)
    assert "width 2: 4 requests" in out
    # speculation ran at both widths (at width 2 with both slots busy: --speculate-at-most 2)
    assert all(" 0 drafts" not in line for line in lines if line.lstrip().startswith("speculate"))
    assert bench.main(["--run", str(tiny_text_run), "--draft-loops", "0"]) == 2
    assert "--draft-loops takes integers >= 1" in capsys.readouterr().err
    assert bench.main(["--run", str(tiny_text_run), "--widths", "0"]) == 2
    assert "--widths takes integers >= 1" in capsys.readouterr().err
