"""The shared HTML report builder: sections registry, escaping, replacement."""

from __future__ import annotations

import json

import pytest

from rdepth.errors import RdepthError
from rdepth.report import Report, Section, add_section, format_value, load_sections, render


def test_write_renders_tables_figures_and_notes(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.png").write_bytes(b"png")
    (tmp_path / "figures" / "a.svg").write_text("<svg/>")
    report = Report("Loop <geometry>", intro="First paragraph.\n\nSecond.")
    report.section("geometry", "Loop geometry", order=10).table(
        [{"checkpoint": "step_100", "ratio": 0.123456}, {"checkpoint": "step_200", "dlr": 3.0}],
        caption="Headline",
    ).figure("figures/a.png", "PCA & co").note("A <b>note</b>.")
    path = report.write(tmp_path)
    page = path.read_text()
    assert path == tmp_path / "index.html"
    assert "<title>Loop &lt;geometry&gt;</title>" in page
    assert "<th>checkpoint</th><th>ratio</th><th>dlr</th>" in page  # union of keys, first-seen order
    assert "<td>0.1235</td>" in page
    assert 'href="figures/a.svg"' in page
    assert "PCA &amp; co" in page and "A &lt;b&gt;note&lt;/b&gt;." in page
    assert "<p>Second.</p>" in page
    saved = json.loads((tmp_path / "report" / "sections" / "geometry.json").read_text())
    assert saved["title"] == "Loop geometry" and saved["order"] == 10


def test_add_section_replaces_by_name_and_keeps_order(tmp_path):
    report = Report("Run")
    report.section("geometry", order=10).note("geometry text")
    report.write(tmp_path)
    add_section(tmp_path, Section("early_exit", "Early exit", order=5).note("old"))
    add_section(tmp_path, Section("early_exit", "Early exit", order=20).note("new"))
    names = [s.name for s in load_sections(tmp_path)]
    assert names == ["geometry", "early_exit"]
    page = (tmp_path / "index.html").read_text()
    assert "new" in page and "<p>old</p>" not in page
    assert page.index("geometry text") < page.index("<p>new</p>")
    assert "<h1>Run</h1>" in page


def test_add_section_to_a_run_without_a_page(tmp_path):
    add_section(tmp_path, Section("sweep").table([{"tau": 1e-5}]))
    page = render(tmp_path).read_text()
    assert f"<h1>{tmp_path.name}</h1>" in page
    assert "<td>1.000e-05</td>" in page


def test_bad_inputs_are_user_errors(tmp_path):
    with pytest.raises(RdepthError, match="section name"):
        Section("no spaces please")
    folder = tmp_path / "report" / "sections"
    folder.mkdir(parents=True)
    (folder / "broken.json").write_text("{not json")
    with pytest.raises(RdepthError, match="corrupt report section"):
        render(tmp_path)


def test_format_value():
    assert format_value(3) == "3"
    assert format_value(2.0) == "2"
    assert format_value(float("nan")) == "nan"
    assert format_value(123456.0) == "1.235e+05"
    assert format_value([1, 0.5]) == "1, 0.5"
    assert format_value(None) == ""
