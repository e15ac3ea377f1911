"""The demo report's first screen: what was trained, the result against the baseline, what the report found.

Compute, save, render, as every analysis does:

1. :func:`summarize_demo` reads the files the demo saved (``OUT/demo.json``, the
   training run's ``config.json``, ``summary.json`` and ``metrics.jsonl``, the data
   manifest, ``OUT/report/geometry/summary.json`` and ``OUT/report/sweep.json``)
   and writes every number the screen shows, and every finding as a sentence
   template with its numbers, to ``OUT/report/overview.json``;
2. :func:`draw_overview` draws the training-loss and loop-budget curves from it;
3. :func:`overview_section` formats it into the page's first section.

:func:`write_first_screen` does all three; the demo calls it last. Every
perplexity on the screen names its tokens; findings from sections that use
another subset of the held-out tokens say which.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.io import read_json_if_present, read_jsonl, write_json
from rdepth.report.html import Report, format_number, format_percent, format_value

REPORT_DIR = "report"
OVERVIEW_FILE = "overview.json"
SECTION = "overview"
FORMAT_VERSION = 1
# A loop budget "helps" when it lowers perplexity by at least this fraction against 1 loop.
LOOPS_HELP = 0.01


# ------------------------------------------------------------------ compute


def _finding(template: str, **values: Any) -> dict[str, Any]:
    """A sentence to show: ``template`` with ``{name}`` / ``{name:%}`` / ``{name:+%}`` fields,
    filled at render time from ``values`` (saved as computed)."""
    return {"template": template, "values": values}


def _loops_text(loops: list[int]) -> str:
    return str(loops[0]) if len(set(loops)) == 1 else ",".join(map(str, loops))


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def _curves(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    train = [(row["step"], row["loss"]) for row in metrics if "loss" in row]
    val = [(row["step"], row["val_ce"], row["val_ppl"]) for row in metrics if "val_ce" in row]
    return {"train_step": [s for s, _ in train], "train_loss": [v for _, v in train],
            "val_step": [s for s, _, _ in val], "val_ce": [v for _, v, _ in val], "val_ppl": [p for _, _, p in val],
            "tokens_trained": max((row.get("tokens", 0) for row in metrics), default=0)}


def _geometry_findings(geometry: dict[str, Any]) -> list[dict[str, Any]]:
    """Sentences from the geometry summary's saved headline numbers (last checkpoint)."""
    last = geometry["checkpoints"][-1]
    tokens = geometry["sequences"] * geometry["seq_len"]
    subset = dict(label=last["label"], windows=geometry["sequences"], seq_len=geometry["seq_len"], tokens=tokens)
    findings = []
    dlr = last["budgets"]["train"]["dlr"]
    default = geometry["dlr_default"]
    medians = {boundary: stats[default]["median"] for boundary, stats in dlr.items()
               if stats.get(default, {}).get("median") is not None}
    if medians:
        boundary, value = max(medians.items(), key=lambda item: item[1])
        findings.append(_finding(
            "Loop geometry ({label}, on its own {tokens} held-out tokens: {windows} windows × {seq_len}): a "
            "hand-off between groups moves a token {dlr:.3} times as far as a mean loop step (median drift-to-loop "
            "ratio, boundary {boundary}{others}), so {reading}.",
            **subset, dlr=value, boundary=boundary,
            others="" if len(medians) == 1 else f"; the largest of {len(medians)} boundaries",
            reading="the hand-off is a coarser move than a loop step (the paper's two scales)" if value > 1
            else "hand-offs are no larger than loop steps here"))
    budget = geometry["scale_budget"]
    groups = last["budgets"][budget]["groups"]
    settled = [(g["name"], g["headline"]["settled_cosine"]) for g in groups
               if g["headline"]["settled_cosine"] is not None]
    if settled:
        lowest = min(settled, key=lambda item: item[1])
        findings.append(_finding(
            "Within a loop of {steps} steps ({budget} budget), consecutive updates settle at cosine {cosines}: "
            "{reading}.",
            steps=groups[0]["steps"], budget=budget,
            cosines="; ".join(f"{value:.2f} in group {name}" for name, value in settled),
            reading="negative values mean the state oscillates around a point" if lowest[1] < 0
            else "positive values mean the state keeps moving in a steady direction"))
    never = [(g["name"], g["convergence"]["never_fraction"]) for g in groups
             if g["convergence"].get("never_fraction") is not None]
    if never:
        threshold = geometry["settings"].get("threshold")
        findings.append(_finding(
            "At the {budget} budget, the share of tokens whose relative step size never falls under {threshold} "
            "is {shares}.", budget=budget, threshold=threshold,
            shares="; ".join(f"{format_percent(value, 0, signed=False)} in group {name}" for name, value in never)))
    return findings


def _sweep_findings(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """Sentences from the sweep's saved summary: the policy that saves the most loop steps at matched
    quality, and its measured speed against the full budget with the saved noise flag."""
    summary = sweep["summary"]
    reference = sweep["reference"]
    subset = dict(tokens=reference["tokens"], full=_loops_text(reference["budget"]), full_ppl=summary["full_ppl"],
                  tolerance=summary["tolerance"])
    intro = ("Early exit (on its own {tokens} held-out tokens, against the full budget of {full} loops per group, "
             "perplexity {full_ppl:.1f}): ")
    matched = [row for row in summary.get("matched_quality", {}).get("steps", []) if row.get("value") is not None]
    best = max(matched, key=lambda row: row["steps_saved"], default=None)
    if best is None or best["steps_saved"] <= 0:
        return [_finding(intro + "no exit policy saves loop steps while staying within {tolerance:%} of the full "
                         "budget's perplexity.", **subset)]
    ranking = summary.get("headline_ranking", "steps")
    speed = f"speedup_vs_full_{ranking}"
    text = ("{policy} ({parameter} = {value}) saves the most loop steps within {tolerance:%} of the full "
            "budget's perplexity: {saved:%} of them, at perplexity {ppl:.1f}")
    values = dict(subset, policy=best["policy"], parameter=best["parameter"], value=best["value"],
                  saved=best["steps_saved"], ppl=best["ppl"])
    if speed in best:
        low, high = best[f"{speed}_range"]
        values.update(speedup=best[speed], low=low, high=high)
        text += "; its measured speed is {speedup:.3}× the full budget's [{low:.3}-{high:.3}]"
        if best[f"{speed}_noise"]:
            values["noise"] = best[f"{speed}_noise"]
            text += ", within timing noise ({noise}), so not a demonstrated speedup"
    return [_finding(intro + text + ".", **values)]


def _result_sentence(final: dict, baseline: dict | None) -> dict | None:
    """The headline: the model's validation perplexity against the unigram baseline's."""
    if not baseline:
        return None
    relative = final["ppl"] / baseline["ppl"] - 1
    same = baseline["tokens"] == final["tokens"]
    return _finding(
        "At {loops} loops per group the model's validation perplexity is {ppl:.1f} on {tokens} held-out tokens, "
        "{change:%} {direction} than the unigram baseline's {baseline:.1f} on {baseline_tokens}{reading}.",
        loops=_loops_text(final["loop_counts"]), ppl=final["ppl"], tokens=final["tokens"],
        change=abs(relative), direction="lower" if relative < 0 else "higher", baseline=baseline["ppl"],
        baseline_tokens="the same tokens" if same else f"{baseline['tokens']:,} tokens",
        reading="" if relative < 0 else ": the model has not yet learned more than token frequencies "
        "(train longer)")


def _training_finding(curves: dict) -> dict | None:
    """How the training loss (and the validation perplexity) moved."""
    if not curves["train_loss"]:
        return None
    return _finding(
        "Training loss {moved} from {first} at step {first_step} to {last} at step {last_step} "
        "({tokens} tokens trained){validation}.",
        moved="fell" if curves["train_loss"][-1] < curves["train_loss"][0] else "did not fall: it went",
        first=curves["train_loss"][0], first_step=curves["train_step"][0], last=curves["train_loss"][-1],
        last_step=curves["train_step"][-1], tokens=curves["tokens_trained"],
        validation="" if len(curves["val_ppl"]) < 2 else
        f"; validation perplexity went from {curves['val_ppl'][0]:,.1f} to "
        f"{curves['val_ppl'][-1]:,.1f} on the same held-out tokens")


def _loops_finding(budgets: list[dict]) -> dict | None:
    """What more loops at test time do to perplexity on the same tokens."""
    if len(budgets) < 2:
        return None
    one = budgets[0]
    best = min(budgets, key=lambda b: b["ppl"])
    gain = 1 - best["ppl"] / one["ppl"]
    return _finding(
        "More loops at test time, on the same {tokens} tokens: perplexity {budgets}; {reading}.",
        tokens=one["tokens"],
        budgets=", ".join(f"{b['ppl']:,.1f} at {_loops_text(b['loops'])} loop"
                          f"{'' if b['loops'] == [1] * len(b['loops']) else 's'}" for b in budgets),
        reading=f"the best budget ({_loops_text(best['loops'])} loops) is {format_percent(gain, 1, signed=False)} "
                "below 1 loop" if gain >= LOOPS_HELP
        else f"the model barely uses its loops (under {format_percent(LOOPS_HELP, 0, signed=False)} change), so "
             "the sections below show the machinery rather than the paper's effects")


def _overview_model(demo: dict, model: dict, final: dict, run_summary: dict) -> dict:
    return {
        "preset": demo["config"].get("preset"), "n_layer": model.get("n_layer"), "d_model": model.get("d_model"),
        "n_head": model.get("n_head"), "block_size": model.get("block_size"), "vocab_size": model.get("vocab_size"),
        "groups": [part.strip() for part in str(model.get("groups", "")).split("|") if part.strip()],
        "mean_loops": model.get("mean_loops"), "eval_loops": final["loop_counts"],
        "parameters": run_summary.get("parameters"),
        "overridden": bool(demo["config"].get("model_overrides")),
    }


def _overview_data(demo: dict, manifest: dict) -> dict:
    splits = manifest.get("splits", {})
    corpus = manifest.get("corpus", {})
    return {
        "corpus": corpus.get("name") or demo["config"].get("corpus"), "documents": sum(
            split.get("documents", 0) for split in splits.values()) or None,
        "documents_total": corpus.get("documents_total"), "tokenizer": manifest.get("tokenizer"),
        "train_tokens": splits.get("train", {}).get("tokens"), "val_tokens": splits.get("val", {}).get("tokens"),
    }


def summarize_demo(out: str | os.PathLike) -> dict[str, Any]:
    """Collect the first screen's numbers and findings from the demo's saved files and write them to
    ``OUT/report/overview.json``; returns them. Needs ``OUT/demo.json`` and the training run."""
    out = Path(out)
    demo = read_json_if_present(out / "demo.json")
    if demo is None:
        raise RdepthError(f"{out / 'demo.json'} is missing: run rdepth demo --out {out} first")
    report_dir = out / REPORT_DIR
    run = Path(demo["outputs"]["train"])
    run_config = read_json_if_present(run / "config.json") or {}
    run_summary = read_json_if_present(run / "summary.json") or {}
    manifest = read_json_if_present(Path(demo["outputs"]["data"]) / "manifest.json") or {}
    metrics = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    model, train = run_config.get("model", {}), run_config.get("train", {})
    curves = _curves(metrics)

    final, baseline = demo["final_val"], demo["unigram_baseline"]
    budgets = demo["loop_budgets"]
    headline = {"loops": final["loop_counts"], "ppl": final["ppl"], "ce": final["ce"], "tokens": final["tokens"],
                "baseline_ppl": baseline["ppl"] if baseline else None,
                "baseline_ce": baseline["ce"] if baseline else None,
                "baseline_tokens": baseline["tokens"] if baseline else None}
    result = _result_sentence(final, baseline)  # the headline sentence: the result against the baseline
    findings = [f for f in (_training_finding(curves), _loops_finding(budgets)) if f is not None]
    geometry = read_json_if_present(report_dir / "geometry" / "summary.json") if demo["outputs"].get("analysis") else None
    if geometry and geometry.get("checkpoints"):
        findings += _geometry_findings(geometry)
    sweep = read_json_if_present(report_dir / "sweep.json") if demo["outputs"].get("sweep") else None
    if sweep and "summary" in sweep:
        findings += _sweep_findings(sweep)

    overview = {
        "format_version": FORMAT_VERSION,
        "model": _overview_model(demo, model, final, run_summary),
        "data": _overview_data(demo, manifest),
        "training": {
            "steps": run_summary.get("step"), "batch_size": train.get("batch_size"),
            "grad_accum": train.get("grad_accum", 1), "tokens_trained": curves["tokens_trained"],
            "seconds": demo["stage_seconds"].get("train"), "tokens_per_second": demo.get("tokens_per_second"),
            "device": run_summary.get("device"),
        },
        "time": {"wall_seconds": demo["wall_seconds"], "stage_seconds": demo["stage_seconds"]},
        "headline": headline,
        "result": result,
        "loop_budgets": budgets,
        "curves": curves,
        "findings": findings,
        "links": {
            "demo.json": _relative(out / "demo.json", report_dir),
            "training run": _relative(run, report_dir) + "/",
            "metrics.jsonl": _relative(run / "metrics.jsonl", report_dir),
            "run summary.json": _relative(run / "summary.json", report_dir),
            **({"geometry summary.json": "geometry/summary.json"} if geometry else {}),
            **({"sweep.json": "sweep.json"} if sweep else {}),
        },
    }
    write_json(report_dir / OVERVIEW_FILE, overview)
    return overview


# ------------------------------------------------------------------ draw


def draw_overview(report_dir: str | os.PathLike, overview: dict[str, Any]) -> list[tuple[str, str]]:
    """The training-loss and loop-budget figures (PNG + SVG under ``report_dir/figures``), drawn from
    ``overview``; returns (relative PNG path, caption) pairs."""
    from rdepth.report.figures import pyplot, save_report_figure

    plt = pyplot()
    curves, headline = overview["curves"], overview["headline"]
    saved = []
    if curves["train_loss"]:
        figure, axis = plt.subplots(figsize=(5.2, 3.0))
        axis.plot(curves["train_step"], curves["train_loss"], color="tab:blue", linewidth=1.2,
                  label="training loss (batch)")
        if curves["val_ce"]:
            axis.plot(curves["val_step"], curves["val_ce"], "o-", color="tab:orange", label="validation CE")
        _finish_panel(figure, axis, headline["baseline_ce"], "training step", "cross-entropy (nats/token)")
        saved.append((save_report_figure(figure, report_dir, "overview_loss"),
                      f"Training loss and validation cross-entropy (validation and baseline on the same "
                      f"{format_value(headline['tokens'])} held-out tokens)."))
    budgets = overview["loop_budgets"]
    if budgets:
        figure, axis = plt.subplots(figsize=(5.2, 3.0))
        labels = [_loops_text(b["loops"]) for b in budgets]
        uniform = all(len(set(b["loops"])) == 1 for b in budgets)
        xs = [b["loops"][0] for b in budgets] if uniform else list(range(len(budgets)))
        axis.plot(xs, [b["ppl"] for b in budgets], "o-", color="tab:blue", label="model")
        eval_index = next((i for i, b in enumerate(budgets) if b["loops"] == headline["loops"]), None)
        if eval_index is not None:
            axis.plot([xs[eval_index]], [budgets[eval_index]["ppl"]], "*", color="black", markersize=12,
                      label="training's eval loops")
        axis.set_xticks(xs, labels)
        _finish_panel(figure, axis, headline["baseline_ppl"], "loops per group at test time", "validation perplexity")
        saved.append((save_report_figure(figure, report_dir, "overview_loop_budgets"),
                      f"Perplexity against loops per group, on the same {format_value(budgets[0]['tokens'])} "
                      "held-out tokens."))
    return saved


def _finish_panel(figure, axis, baseline: float | None, xlabel: str, ylabel: str) -> None:
    """The overview panels' common end: the unigram baseline (dashed, where known), axis labels, grid, legend."""
    if baseline is not None:
        axis.axhline(baseline, color="grey", linestyle="--", linewidth=1, label="unigram baseline")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()


# ------------------------------------------------------------------ render


class _Formatter(string.Formatter):
    """Fills a finding's template: numbers through :func:`format_value`, ``:%``/``:+%`` as percentages."""

    def format_field(self, value: Any, spec: str) -> str:
        if spec in ("%", "+%"):
            text = format_number(100 * value, 3) + "%"
            return ("+" + text) if spec == "+%" and not text.startswith(("-", "0%")) else text
        if spec == ".1f" and isinstance(value, (int, float)):
            return f"{value:,.1f}"
        if spec == ".3" and isinstance(value, float):
            return format_number(value, 3)
        return format_value(value)


def finding_text(finding: dict[str, Any]) -> str:
    """One saved finding as a sentence (formatting only)."""
    return _Formatter().format(finding["template"], **finding["values"])


def _seconds(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.1f} s" if value < 120 else f"{int(value // 60)} min {round(value % 60):02d} s"


def overview_section(overview: dict[str, Any], figures: list[tuple[str, str]]):
    """The page's first section: the result against the baseline, what was trained, the two curves beside
    it, what the report found, links to the saved files."""
    from rdepth.report import Section

    model, data, training, headline = (overview[k] for k in ("model", "data", "training", "headline"))
    section = Section(SECTION, "Result", order=0)
    if overview.get("result"):
        section.headline(finding_text(overview["result"]))
    else:  # no baseline to compare with
        section.headline(f"Validation perplexity {headline['ppl']:,.1f} at {_loops_text(headline['loops'])} loops per "
                         f"group, on {format_value(headline['tokens'])} held-out tokens.")
    groups = " | ".join(model["groups"]) or "none"
    parameters = f"; {format_value(model['parameters'])} parameters" if model.get("parameters") else ""
    documents = ""
    if data.get("documents"):
        total = data.get("documents_total")
        documents = (f" (all {format_value(total)} documents)" if total == data["documents"] else
                     f" ({format_value(data['documents'])} of {format_value(total)} documents)" if total else
                     f" ({format_value(data['documents'])} documents)")
    stages = ", ".join(f"{name} {_seconds(value)}" for name, value in overview["time"]["stage_seconds"].items())
    batch = training["batch_size"] * (training.get("grad_accum") or 1) if training.get("batch_size") else None
    section.figures(figures, aside=True)  # beside what was trained and the findings: one screen holds all
    section.facts([
        ("Model", f"{model['n_layer']} layers, width {model['d_model']}, {model['n_head']} heads, "
                  f"{model['block_size']}-token context{parameters} (preset {model['preset']}"
                  f"{' with overrides' if model.get('overridden') else ''})"
         if model.get("preset") else f"{model['n_layer']} layers, width {model['d_model']}{parameters}"),
        ("Looped groups", f"layers {groups} (0-based; each group loops on its own), a mean of "
                          f"{format_value(model['mean_loops'])} loops in training, evaluated at "
                          f"{_loops_text(model['eval_loops'])}"),
        ("Data", f"{data['corpus']} corpus{documents}, tokenizer {data['tokenizer']}; "
                 f"{format_value(data['train_tokens'])} training and {format_value(data['val_tokens'])} held-out "
                 "tokens"),
        ("Trained", f"{format_value(training['steps'])} steps"
                    + (f" × {batch} sequences × {model['block_size']} tokens" if batch else "")
                    + f" = {format_value(training['tokens_trained'])} tokens in {_seconds(training['seconds'])}"
                    + (f" ({format_value(round(training['tokens_per_second']))} tokens/s" if
                       training.get("tokens_per_second") else " (")
                    + f" on {training.get('device') or '?'})"),
        ("Time", f"{_seconds(overview['time']['wall_seconds'])} for the whole demo ({stages})"),
    ])
    section.bullets([finding_text(f) for f in overview["findings"]], caption="What the report found")
    section.links([(href, label) for label, href in overview["links"].items()], caption="Files")
    return section


def write_first_screen(out: str | os.PathLike) -> Path:
    """Summarise, draw and render the first screen of ``OUT/report/index.html`` from the demo's saved
    files (``OUT/demo.json`` and what it points to); other sections of the page are kept. Returns the
    page's path."""
    out = Path(out)
    overview = summarize_demo(out)
    report_dir = out / REPORT_DIR
    figures = draw_overview(report_dir, overview)
    report = Report("rdepth demo report", intro=f"Output folder {out.resolve()}")
    report.sections[SECTION] = overview_section(overview, figures)
    return report.write(report_dir)


__all__ = ["draw_overview", "finding_text", "overview_section", "summarize_demo", "write_first_screen"]
