"""The demo report's first screen, built from constructed saved files: numbers and sentences come from them.

Also the screenshot script: its page resolution and Chromium command work without Chromium; the
screenshot itself runs only where Chromium is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rdepth.demo.report import OVERVIEW_FILE, finding_text, summarize_demo, write_first_screen
from rdepth.errors import RdepthError
from rdepth.report import Section, add_section

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _geometry() -> dict:
    group = lambda name, cosine, never: {  # noqa: E731
        "name": name, "steps": 30, "headline": {"settled_cosine": cosine},
        "convergence": {"median": 12.0, "never_fraction": never}}
    return {
        "sequences": 4, "seq_len": 16, "dlr_default": "first", "scale_budget": "long",
        "settings": {"threshold": 0.01},
        "checkpoints": [{
            "label": "step_000200", "step": 200,
            "budgets": {
                "train": {"dlr": {"1->2-3": {"first": {"median": 3.25}}, "2-3->4": {"first": {"median": 1.5}}}},
                "long": {"groups": [group("1", -0.42, 0.25), group("2-3", 0.61, 0.0), group("4", 0.1, 0.5)]},
            },
        }],
    }


def _sweep() -> dict:
    return {
        "reference": {"budget": [8, 8, 8], "tokens": 512, "ppl": 270.0},
        "summary": {
            "full_ppl": 270.0, "tolerance": 0.01, "headline_ranking": "b1",
            # "best" is the fastest point; the page names the one that saves the most steps
            "best": {"policy": "step_norm", "parameter": "tau", "value": 1e-5, "steps_saved": 0.0},
            "matched_quality": {"steps": [
                {"policy": "step_norm", "parameter": "tau", "value": 1e-5, "ppl": 270.0, "steps_saved": 0.0},
                {"policy": "kl", "parameter": "tau", "value": 0.001, "ppl": 271.5, "steps_saved": 0.375,
                 "speedup_vs_full_b1": 1.42, "speedup_vs_full_b1_range": [1.3, 1.55],
                 "speedup_vs_full_b1_noise": None},
                {"policy": "cosine", "parameter": "tau", "value": None},
            ]},
        },
    }


@pytest.fixture()
def demo(tmp_path):
    """A demo output folder holding only the files the first screen reads."""
    out = tmp_path / "demo"
    run, data, report = out / "train", out / "data", out / "report"
    _write(data / "manifest.json", {
        "tokenizer": "bpe:4096", "corpus": {"name": "wiki", "documents_total": 10033},
        "splits": {"train": {"tokens": 2_000_000, "documents": 9500}, "val": {"tokens": 100_000, "documents": 533}}})
    _write(run / "config.json", {
        "model": {"n_layer": 5, "n_head": 4, "d_model": 128, "block_size": 128, "vocab_size": 4096,
                  "groups": "1|2-3|4", "mean_loops": 4.0},
        "train": {"batch_size": 16, "grad_accum": 1}})
    _write(run / "summary.json", {"step": 500, "parameters": 1_234_567, "device": "cpu"})
    rows = [{"step": 20, "loss": 8.0, "tokens": 40960}, {"step": 250, "val_ce": 6.0, "val_ppl": 403.4},
            {"step": 500, "loss": 5.5, "tokens": 1_024_000}, {"step": 500, "val_ce": 5.5, "val_ppl": 253.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    _write(report / "geometry" / "summary.json", _geometry())
    _write(report / "sweep.json", _sweep())
    _write(out / "demo.json", {
        "config": {"preset": "tiny", "corpus": "wiki", "model_overrides": ""},
        "outputs": {"data": str(data), "train": str(run), "analysis": str(report / "index.html"),
                    "sweep": str(report / "index.html")},
        "final_val": {"loop_counts": [4, 4, 4], "ce": 5.533, "ppl": 253.04, "tokens": 6144},
        "unigram_baseline": {"ce": 6.807, "ppl": 904.2, "tokens": 6144},
        "tokens_per_second": 2950.0,
        "loop_budgets": [{"loops": [1, 1, 1], "ppl": 254.1, "ce": 5.538, "tokens": 6144},
                         {"loops": [4, 4, 4], "ppl": 253.04, "ce": 5.533, "tokens": 6144},
                         {"loops": [8, 8, 8], "ppl": 253.0, "ce": 5.533, "tokens": 6144}],
        "stage_seconds": {"prepare": 5.0, "train": 347.0, "loop budgets": 20.0, "analyze": 16.0, "sweep": 79.0},
        "wall_seconds": 467.0,
    })
    return out


def test_summary_saves_the_headline_and_sentences_from_the_saved_files(demo):
    overview = summarize_demo(demo)
    assert json.loads((demo / "report" / OVERVIEW_FILE).read_text()) == overview  # saved as computed
    headline = overview["headline"]
    assert headline["ppl"] == 253.04 and headline["baseline_ppl"] == 904.2 and headline["tokens"] == 6144
    assert overview["training"]["tokens_trained"] == 1_024_000 and overview["model"]["groups"] == ["1", "2-3", "4"]
    assert overview["curves"]["val_ppl"] == [403.4, 253.0]
    sentences = [finding_text(finding) for finding in [overview["result"]] + overview["findings"]]
    assert sentences[0] == ("At 4 loops per group the model's validation perplexity is 253.0 on 6144 held-out "
                            "tokens, 72% lower than the unigram baseline's 904.2 on the same tokens.")
    assert "Training loss fell from 8 at step 20 to 5.5 at step 500 (1,024,000 tokens trained)" in sentences[1]
    assert "from 403.4 to 253.0" in sentences[1]
    # 254.1 -> 253.0 is under 1%: the page says the loops are barely used, not that they help
    assert "254.1 at 1 loop, 253.0 at 4 loops, 253.0 at 8 loops" in sentences[2]
    assert "barely uses its loops" in sentences[2]
    geometry = " ".join(sentences[3:6])
    assert "on its own 64 held-out tokens: 4 windows × 16" in geometry  # a different subset, named
    assert "3.25 times as far as a mean loop step" in geometry and "boundary 1->2-3" in geometry
    assert "-0.42 in group 1; 0.61 in group 2-3; 0.10 in group 4" in geometry
    assert "25% in group 1; 0% in group 2-3; 50% in group 4" in geometry
    sweep = sentences[6]
    assert "on its own 512 held-out tokens, against the full budget of 8 loops per group, perplexity 270.0" in sweep
    assert ("kl (tau = 0.001) saves the most loop steps within 1% of the full budget's perplexity: 37.5% of them, "
            "at perplexity 271.5") in sweep
    assert "1.42× the full budget's [1.3-1.55]" in sweep and "noise" not in sweep


def test_noisy_speedups_and_missing_sections_are_said_plainly(demo):
    sweep = _sweep()
    sweep["summary"]["matched_quality"]["steps"][1]["speedup_vs_full_b1_noise"] = "IQRs overlap"
    _write(demo / "report" / "sweep.json", sweep)
    result = json.loads((demo / "demo.json").read_text())
    del result["outputs"]["analysis"]
    result["unigram_baseline"]["ppl"] = 200.0
    _write(demo / "demo.json", result)
    overview = summarize_demo(demo)
    sentences = [finding_text(f) for f in [overview["result"]] + overview["findings"]]
    assert "26.5% higher than the unigram baseline's 200.0" in sentences[0]
    assert "has not yet learned more than token frequencies" in sentences[0]
    assert not any("Loop geometry" in s for s in sentences)  # no analysis, no geometry sentence
    assert "within timing noise (IQRs overlap), so not a demonstrated speedup" in sentences[-1]
    sweep["summary"]["matched_quality"]["steps"] = sweep["summary"]["matched_quality"]["steps"][:1]
    _write(demo / "report" / "sweep.json", sweep)
    last = finding_text(summarize_demo(demo)["findings"][-1])
    assert "no exit policy saves loop steps while staying within 1% of the full budget's perplexity" in last


def test_first_screen_leads_the_page_and_keeps_other_sections(demo):
    report = demo / "report"
    add_section(report, Section("early_exit", "Early exit", order=30).note("sweep details"))
    page = write_first_screen(demo).read_text()
    assert page.index('<p class="headline">At 4 loops per group the model&#x27;s validation perplexity is 253.0 on '
                      "6144 held-out tokens, 72% lower than the unigram baseline&#x27;s 904.2 on the same tokens.</p>"
                      ) < page.index("What the report found") < page.index("sweep details")
    assert "5 layers, width 128, 4 heads" in page and "1,234,567 parameters" in page
    assert "layers 1 | 2-3 | 4" in page and "wiki corpus (all 10,033 documents)" in page
    assert "500 steps × 16 sequences × 128 tokens = 1,024,000 tokens in 5 min 47 s" in page
    assert "254.1 at 1 loop, 253.0 at 4 loops" in page and page.count("72% lower") == 1  # said once
    assert 'href="../demo.json"' in page and 'href="../train/"' in page and 'href="sweep.json"' in page
    for name in ("overview_loss", "overview_loop_budgets"):
        assert f"figures/{name}.png" in page and (report / "figures" / f"{name}.png").stat().st_size > 1000


def test_first_screen_needs_the_demo_summary(tmp_path):
    with pytest.raises(RdepthError, match="demo.json is missing"):
        summarize_demo(tmp_path)


def _screenshot_module():
    spec = importlib.util.spec_from_file_location("screenshot_report", ROOT / "scripts" / "screenshot_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_screenshot_script_resolves_the_page_without_chromium(tmp_path):
    shot = _screenshot_module()
    (tmp_path / "index.html").write_text("<html><body><h1>page</h1></body></html>")
    page = shot.page_path(tmp_path)  # a folder means its index.html
    assert page == (tmp_path / "index.html").resolve()
    command = shot.chromium_command("chromium", page, tmp_path / "a.png", 1280, 800, tmp_path / "profile")
    assert command[0] == "chromium" and "--headless" in command and command[-1] == page.as_uri()
    assert "--window-size=1280,800" in command and f"--screenshot={tmp_path / 'a.png'}" in command
    with pytest.raises(FileNotFoundError):
        shot.page_path(tmp_path / "missing")
    assert shot.main([str(tmp_path / "missing")]) == 2


def test_screenshot_renders_a_page_where_chromium_is_installed(tmp_path):
    shot = _screenshot_module()
    if shot.find_chromium() is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    (tmp_path / "index.html").write_text("<html><body><h1>rdepth</h1></body></html>")
    png = shot.screenshot(tmp_path, tmp_path / "shot.png", width=400, height=300)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
