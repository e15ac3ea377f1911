"""The main job end to end on a tiny model: every stage runs and the report holds both sections."""

from __future__ import annotations

import json

import pytest

from rdepth.cli.main import main

TINY = json.dumps({"n_layer": 4, "n_head": 2, "d_model": 32, "block_size": 32, "groups": "1|2",
                   "mean_loops": 3.0, "backprop_depth": 2, "vocab_size": 512, "tokenizer": "bpe:512"})


@pytest.mark.slow
def test_demo_end_to_end(wiki_small, tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--mode", "text", "--out", str(out), "--data", str(wiki_small), "--tokenizer", "bpe:512",
            "--max-documents", "400", "--model-overrides", TINY, "--max-steps", "6", "--batch-size", "4",
            "--checkpoint-every", "3", "--eval-batches", "2", "--analyze-sequences", "2", "--long-loops", "5",
            "--sweep-sequences", "8"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "unigram baseline" in printed and "report" in printed

    result = json.loads((out / "demo.json").read_text())
    assert result["final_val"]["ppl"] > 1 and result["unigram_baseline"]["ppl"] > 1
    assert [row["loops"] for row in result["loop_budgets"]][0] == [1, 1]
    assert set(result["stage_seconds"]) == {"prepare", "train", "loop budgets", "analyze", "sweep"}
    steps = sorted(p.name for p in (out / "train" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_000003", "step_000006"]

    page = (out / "report" / "index.html").read_text()
    assert "Early exit" in page and "step_000003" in page and "step_000006" in page
    assert (out / "report" / "sweep.csv").read_text().count("\n") > 5
    geometry = json.loads((out / "report" / "geometry" / "summary.json").read_text())
    assert len(geometry["checkpoints"]) == 2

    # A second run reuses every finished stage: the weights are not rewritten.
    weights = out / "train" / "checkpoints" / "step_000006" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert main(argv + ["--no-analyze", "--no-sweep"]) == 0
    assert weights.stat().st_mtime_ns == before
