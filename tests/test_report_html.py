"""The shared HTML report builder: sections registry, escaping, replacement."""

from __future__ import annotations

import json

import pytest

from rdepth.errors import RdepthError
from rdepth.report import Report, Section, add_section, format_value, load_sections, render
from rdepth.report.html import format_number, format_percent, formula_html, rich_text


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
    # union of keys, first-seen order; numeric columns right-aligned and never wrapped
    assert '<th>checkpoint</th><th class="num">ratio</th><th class="num">dlr</th>' in page
    assert '<td class="num">0.1235</td>' in page and "<td>step_100</td>" in page
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
    assert '<td class="num">1×10⁻⁵</td>' in page


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
    assert format_value(123456.0) == "123,456"
    assert format_value([1, 0.5]) == "1, 0.5"
    assert format_value(None) == ""
    assert format_value(12345) == "12,345" and format_value(1024) == "1024"


def test_numbers_read_without_exponents_or_negative_zero():
    assert format_number(4.886e-4) == "4.886×10⁻⁴"  # never 4.886e-04, which wraps as "4.886e-" / "04"
    assert format_number(2.5e7) == "2.5×10⁷"
    assert format_number(12345.6) == "12,346" and format_number(1234.56) == "1,235"
    assert format_number(-0.00001234, 2) == "-1.2×10⁻⁵"
    assert format_number(-0.0) == "0" and format_number(0.00049999, 1) == "5×10⁻⁴"
    assert format_percent(-3.4e-5) == "0.00%" and format_percent(0.01234) == "+1.23%"
    assert format_percent(-0.5, 1, signed=False) == "-50.0%"


def test_formulas_render_as_sub_and_superscripts():
    rendered = formula_html("||x_{g+1}^(0) - x_g^(K_g)||, the hand-off; first_refine")
    assert "‖x<sub>g+1</sub><sup>(0)</sup> − x<sub>g</sub><sup>(K<sub>g</sub>)</sup>‖" in rendered
    assert "first_refine" in rendered  # words with underscores stay words
    assert "∑<sub>k=0</sub><sup>K<sub>g</sub>-1</sup>" in formula_html("sum_{k=0}^{K_g-1}")
    assert "Δ<sub>g</sub>" in formula_html("Delta_g") and "≥" in formula_html("k >= 1")
    assert rich_text("a $x_g$ <b>") == 'a <span class="math">x<sub>g</sub></span> &lt;b&gt;'
    assert rich_text("costs $5") == "costs $5"  # an unpaired $ is text


def test_reading_blocks_and_empty_columns(tmp_path):
    section = Section("overview", "Result", order=0)
    section.headline("Perplexity 12.5 on 1024 tokens.").facts([("Model", "4 layers"), ("Tokens", 38400)])
    section.bullets(["first $x_1$", "second"], caption="What the report found")
    section.links([("../demo.json", "demo.json")], caption="Files")
    section.table([{"a": 1.0, "never": None}, {"a": 2.0, "never": None}])
    add_section(tmp_path, section)
    page = (tmp_path / "index.html").read_text()
    assert '<p class="headline">Perplexity 12.5 on 1024 tokens.</p>' in page
    assert "<th>Tokens</th><td>38,400</td>" in page
    assert "<li>first <span class=\"math\">x<sub>1</sub></span></li>" in page
    assert '<a href="../demo.json">demo.json</a>' in page
    assert "never" not in page  # a column no row fills is left out


def test_someone_elses_index_html_is_never_replaced(tmp_path):
    from rdepth.errors import RdepthError
    from rdepth.report.html import Section, add_section

    (tmp_path / "index.html").write_text("<p>my page</p>")
    with pytest.raises(RdepthError, match="not an rdepth report page"):
        add_section(tmp_path, Section("x", "X"))
    assert (tmp_path / "index.html").read_text() == "<p>my page</p>"
