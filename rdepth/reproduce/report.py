"""The claims table: ``claims.json``, a section on the report page, a self-contained page, the export.

Everything shown is read from the judged claims (:mod:`rdepth.reproduce.claims`);
the figures are the ones the analyses already drew from their saved numbers
(the geometry's ``fig2_dlr``, ``fig3b_loop_dynamics_long``, ``fig5_long_cosines``
and the sweep's ``figure4``, the paper's Figures 2-5).
"""

from __future__ import annotations

import base64
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.io import read_json_object, write_json, write_text
from rdepth.report.figures import FIGURES_DIR
from rdepth.report.html import Section, add_section
from rdepth.reproduce.claims import judged_text

log = logging.getLogger(__name__)

CLAIMS_FILE = "claims.json"
# 2: a fifth claim (the step-norm plateau), each claim's "judged_on" (budget, precision, seeds, spread).
# 3: claim 4 judged along fronts ("fronts"; the paper's absolute grid in "paper_grid", issue 40 item 4).
# 4: claim 4 decided at matched quality ("cheaper", per axis "matched", "stable", "jump"); claim 3's per-token
# control ("over_control_median", "share_clear", "per_step_median"); claim 2's window "reason", "slope" (issue 54).
# 5: claim 4's "verdict_note" and "ours.holds" (which of its comparisons hold: against KL, against the first-order
# step-norm rule, stability), its fronts compared within the quality slack ("matched.quality_slack",
# "matched.unmatched") and stability over every neighbouring threshold (issue 67).
CLAIMS_FORMAT = 5
PAPER = "Two-Scale Latent Dynamics for Recurrent-Depth Transformers (Pappone, Crisostomi, Rodolà)"
# Per claim: the figures that show it, best first (stems under report/figures); the first that exists is used.
CLAIM_FIGURES = {
    "step_decay": ("fig3b_loop_dynamics_long", "fig3_loop_dynamics"),
    "plateau": ("fig3b_loop_dynamics_long", "fig3_loop_dynamics"),
    "cosine": ("fig5_long_cosines", "fig3b_loop_dynamics_long", "fig3_loop_dynamics"),
    "dlr": ("fig2b_dlr_budget", "fig2_dlr"),
    "exits": ("figure4", "pareto"),
}
# The paper's four claims are numbered 1-4 as docs/reproduce.md numbers them; "P" is the step-norm plateau
# the paper states in §4 (a remark the exit rules rest on), judged beside them.
CLAIM_NUMBERS = {"step_decay": "1", "plateau": "P", "cosine": "2", "dlr": "3", "exits": "4"}
# What comes back from a GPU run: (file under OUT, name in the export folder). At most 8 files.
EXPORT_FILES = (
    ("claims.json", "claims.json"),
    ("report.html", "report.html"),
    ("reproduce.json", "reproduce.json"),
    ("train/metrics.jsonl", "metrics.jsonl"),
    ("train/summary.json", "train_summary.json"),
    ("report/geometry/summary.json", "geometry_summary.json"),
    ("report/sweep.json", "sweep.json"),
    ("report/sweep.csv", "sweep.csv"),
)
MAX_EXPORT_BYTES = 16 * 2**20
MAX_EXPORT_TOTAL = 64 * 2**20


def write_claims(out: str | Path, claims: list[dict[str, Any]], context: dict[str, Any],
                 report_dir: str | Path) -> dict[str, Any]:
    """Attach each claim's figure (a path relative to ``report_dir``) and write ``OUT/claims.json``."""
    report_dir = Path(report_dir)
    for claim in claims:
        stems = CLAIM_FIGURES.get(claim["id"], ())
        claim["figure"] = next((f"{FIGURES_DIR}/{stem}.png" for stem in stems
                                if (report_dir / FIGURES_DIR / f"{stem}.png").is_file()), None)
    doc = {"format": CLAIMS_FORMAT, "paper": PAPER, "claims": claims,
           "verdicts": {claim["id"]: claim["verdict"] for claim in claims}, "context": context}
    write_json(Path(out) / CLAIMS_FILE, doc)
    return doc


def table_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per claim: its number (:data:`CLAIM_NUMBERS`), the claim, the paper's figure and numbers, ours,
    the verdict and why."""
    return [{"#": CLAIM_NUMBERS.get(claim["id"], index), "claim": claim["claim"],
             "paper": f"{claim['paper']['figure']}: {claim['paper']['value']}",
             "ours": claim["ours"].get("value", ""), "judged on": judged_text(claim), "verdict": _verdict_text(claim),
             "why": " ".join(claim["why"])}
            for index, claim in enumerate(doc["claims"], 1)]


def _verdict_text(claim: dict[str, Any]) -> str:
    """The verdict, with what it rests on where the judge says (claim 4: which comparisons hold)."""
    note = claim.get("verdict_note")
    return f"{claim['verdict']} ({note})" if note and claim["verdict"] != "not tested" else claim["verdict"]


def markdown_table(doc: dict[str, Any]) -> str:
    """The claims table as Markdown (for a results page or an issue comment)."""
    lines = ["| # | claim | paper | ours | judged on | verdict |", "|---|---|---|---|---|---|"]
    for row in table_rows(doc):
        cells = [str(row[key]).replace("|", "/") for key in ("#", "claim", "paper", "ours", "judged on", "verdict")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _quality_text(context: dict[str, Any]) -> str | None:
    rows, unigram = context.get("loop_budgets") or [], context.get("unigram")
    at_mean = next((row for row in rows if max(row["loops"]) == context.get("train_loops")), None)
    if at_mean is None:
        return None
    text = f"validation perplexity {at_mean['ppl']:.2f} at {context['train_loops']} loops per group"
    if unigram:
        text += f" against the unigram baseline's {unigram['ppl']:.2f} on the same {unigram['tokens']:,} tokens"
    return text


def write_claims_page(report_dir: str | Path, doc: dict[str, Any]) -> Path:
    """Put the claims table (with each claim's figure beside it) first on ``report_dir``'s page."""
    context = doc["context"]
    verdicts = list(doc["verdicts"].values())
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(verdicts))
    section = Section("claims", "The paper's claims: reproduced?", order=-10)
    section.headline(f"{len(verdicts)} claims of the two-scale paper: {counts}.")
    facts = [("model", f"{context.get('size')} ({context.get('parameters') or 0:,} parameters)"),
             ("training", f"{context.get('training_tokens', 0):,} tokens in {context.get('training_steps')} steps"
                          + (f" ({context['epochs']:.2f} passes over the training split)" if context.get("epochs")
                             else "") + f", a checkpoint every {context.get('checkpoint_every')}"),
             ("device", context.get("device"))]
    if context.get("tokens_per_second"):
        facts.append(("training throughput", f"{context['tokens_per_second']:,.0f} tokens/s"))
    quality = _quality_text(context)
    if quality:
        facts.append(("quality", quality))
    section.facts(facts)
    # the reasons are sentences: under the table, where they wrap, not as a column that widens it past the page
    rows = [{key: value for key, value in row.items() if key != "why"} for row in table_rows(doc)]
    section.table(rows, caption="Each claim, the paper's figure and numbers, ours, and the verdict")
    section.bullets([f"Claim {row['#']} ({row['verdict']}): {row['why']}" for row in table_rows(doc) if row["why"]],
                    caption="Why each verdict")
    figures = [(claim["figure"], f"Claim {index} ({claim['paper']['figure']}): {claim['verdict']}")
               for index, claim in enumerate(doc["claims"], 1) if claim.get("figure")]
    if figures:
        section.figures(figures)
    section.bullets([f"Claim {index}: {claim['criteria']}." for index, claim in enumerate(doc["claims"], 1)],
                    caption="How each verdict is decided")
    return add_section(report_dir, section)


def write_standalone(report_dir: str | Path, path: str | Path) -> Path:
    """``report_dir/index.html`` as one file: every PNG it shows embedded, links to other files dropped."""
    report_dir = Path(report_dir)
    page = (report_dir / "index.html").read_text()

    def embed(match: re.Match) -> str:
        target = report_dir / match.group(2)
        if not target.is_file():
            return match.group(0)
        data = base64.b64encode(target.read_bytes()).decode("ascii")
        return f'{match.group(1)}="data:image/png;base64,{data}"'

    page = re.sub(r'(src)="([^"]+\.png)"', embed, page)
    page = re.sub(r'href="(?!#|https?:|data:)[^"]*"', 'href="#"', page)
    write_text(path, page)
    return Path(path)


def export(out: str | Path, folder: str | Path) -> list[str]:
    """Copy :data:`EXPORT_FILES` that exist (each at most 16 MiB, 64 MiB in all) into ``folder``;
    returns the names copied."""
    out, folder = Path(out), Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RdepthError(f"export folder {folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    copied, total = [], 0
    for source, name in EXPORT_FILES:
        path = out / source
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size > MAX_EXPORT_BYTES or total + size > MAX_EXPORT_TOTAL:
            log.warning("not exported: %s (%.1f MiB)", path, size / 2**20)
            continue
        shutil.copyfile(path, folder / name)
        copied.append(name)
        total += size
    log.info("exported %d files (%.1f MiB) to %s", len(copied), total / 2**20, folder)
    return copied


def load_claims(out: str | Path) -> dict[str, Any]:
    """A saved ``OUT/claims.json``."""
    doc = read_json_object(Path(out) / CLAIMS_FILE, "claims")
    if doc.get("format") != CLAIMS_FORMAT:
        raise RdepthError(f"{Path(out) / CLAIMS_FILE} has format {doc.get('format')!r}, not {CLAIMS_FORMAT}")
    return doc
