"""bench/gpu/speculation_scale.py (issue 64's prepared GPU call) on the CPU: its constructed agreement is what it
claims (state scale 0: every draft kept, the tokens plain decoding's; the model as drawn: drafts rejected), and bad
flags are one line with status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu" / "speculation_scale.py"


def run(tmp_path, *flags):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--draft-loops", "1", "--tokens", "3",
                           "--prompts", "1", "--prompt-tokens", "8", "--new-tokens", "10", "--rounds", "1",
                           "--threads", "1", "--dtype", "float64", "--json", str(out), *flags],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_state_scale_zero_keeps_every_draft_and_the_model_as_drawn_does_not(tmp_path):
    proc, result = run(tmp_path, "--state-scale", "0")
    assert proc.returncode == 0, proc.stderr
    row = result["rows"][1]
    assert (row["acceptance"], row["equal_to_plain"]) == (1.0, 1.0)  # (the last round drafts fewer than 3)
    proc, result = run(tmp_path, "--state-scale", "1")
    row = result["rows"][1]
    assert proc.returncode == 0 and row["acceptance"] < 0.5 and row["equal_to_plain"] == 1.0


def test_bad_flags_are_one_line(tmp_path):
    for flags, words in ((["--state-scale", "2"], "--state-scale must be in [0, 1]"),
                         (["--loops", "1"], "--loops must be >= 2"),
                         (["--device", "cuda"] if not __import__("torch").cuda.is_available() else ["--prompts", "0"],
                          "no CUDA device" if not __import__("torch").cuda.is_available() else "--prompts must be")):
        proc, _ = run(tmp_path, *flags)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
