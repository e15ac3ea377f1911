"""The task demo's first screen: accuracy against loops, the baselines, the exits, the geometry.

Compute, save, render: :func:`summarize_task_demo` reads the saved files
(``OUT/demo.json``, ``OUT/report/task_sweep.json``,
``OUT/report/geometry/summary.json``) and writes every number the screen shows
to ``OUT/report/overview.json``; :func:`draw_task_overview` draws the
accuracy-against-loops figure from it; :func:`task_overview_section` formats it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.io import read_json_if_present, write_json
from rdepth.report.html import Report, Section, format_value

REPORT_DIR = "report"
OVERVIEW_FILE = "overview.json"
SECTION = "overview"
BASELINE_NAMES = {"no_loop": "same layers, no loop", "deep": "plain model of the unrolled depth"}
SHORT_NAMES = {"no_loop": "no loop", "deep": "deep plain"}  # table columns


def _by_budget(table: dict[str, Any]) -> dict[int, dict[int, float]]:
    """difficulty -> loops (first group's count; 0 for a model without loops) -> accuracy."""
    grid: dict[int, dict[int, float]] = {}
    for row in table["rows"]:
        loops = row["loop_counts"][0] if row.get("loop_counts") else 0
        grid.setdefault(row["difficulty"], {})[loops] = row["accuracy"]
    return grid


def _extrapolation(looped: dict, rows: list[dict], high: int, budgets: list[int]) -> list[dict[str, Any]]:
    """Per held-out difficulty above training: the accuracy curve over budgets, its peak, and whether
    accuracy falls past the peak by more than twice the binomial standard error (overthinking)."""
    problems = {row["difficulty"]: row["problems"] for row in rows}
    last = max(budgets)
    result = []
    for d in sorted(d for d in looped if d > high):
        peak = max(looped[d], key=lambda k: (looped[d][k], -k))
        error = (looped[d][peak] * (1 - looped[d][peak]) / max(problems.get(d, 1), 1)) ** 0.5
        result.append({
            "difficulty": d, "curve": {str(k): looped[d][k] for k in budgets}, "peak_loops": peak,
            "problems": problems.get(d), "standard_error": error,
            "overthinking": bool(peak < last and looped[d][peak] - looped[d][last] > 2 * error)})
    return result


def _geometry_headline(geometry: dict) -> dict[str, Any]:
    """The last checkpoint's per-group headline (decay, noise floor step, settled cosine), long budget first."""
    last = geometry["checkpoints"][-1]
    budget = last["budgets"].get("long") or last["budgets"]["train"]
    return {"checkpoint": last["label"], "groups": [
        {"name": g["name"], **{k: g["headline"][k] for k in ("decay_5_over_0", "noise_floor_step", "settled_cosine")}}
        for g in budget["groups"]]}


def summarize_task_demo(out: str | os.PathLike) -> dict[str, Any]:
    """Every number of the first screen, from the saved files; saved to ``OUT/report/overview.json``."""
    out = Path(out)
    demo = read_json_if_present(out / "demo.json")
    if demo is None or demo.get("mode") != "task":
        raise RdepthError(f"{out / 'demo.json'} is missing or not a task demo")
    tables = demo["accuracy"]
    looped = _by_budget(tables["looped"])
    low, high = tables["looped"]["train_difficulties"]
    budgets = sorted(next(iter(looped.values())))
    model = tables["looped"]["model"]
    overview: dict[str, Any] = {
        "train_difficulties": [low, high],
        "budgets": budgets,
        "train_mean_loops": model["mean_loops"],
        "looped": {str(d): {str(k): v for k, v in row.items()} for d, row in looped.items()},
        "baselines": {name: {str(d): row.get(0) for d, row in _by_budget(table).items()}
                      for name, table in tables.items() if name != "looped"},
        "parameters": {name: table.get("parameters") for name, table in tables.items()},
        "models": {name: {k: table["model"][k] for k in ("n_layer", "d_model", "n_head", "groups", "mean_loops")}
                   for name, table in tables.items()},
        "training": demo.get("training", {}),
        "stage_seconds": demo.get("stage_seconds", {}),
        "threads": demo.get("threads"),
        "wall_seconds": demo.get("wall_seconds"),
        "config": {k: demo["config"].get(k) for k in ("task", "task_params", "max_steps", "batch_size", "lr",
                                                      "curriculum_steps", "train_tokens")},
    }
    top = looped.get(high, {})
    best_loops = max(top, key=lambda k: (top[k], -k)) if top else None
    overview["headline"] = {
        "difficulty": high, "one_loop": top.get(1), "best": top.get(best_loops), "best_loops": best_loops,
        "no_loop": overview["baselines"].get("no_loop", {}).get(str(high)),
        "deep": overview["baselines"].get("deep", {}).get(str(high)),
    }
    overview["extrapolation"] = _extrapolation(looped, tables["looped"]["rows"], high, budgets)
    sweep = read_json_if_present(out / REPORT_DIR / "task_sweep.json")
    overview["exits"] = None if sweep is None else sweep["summary"]["difficulties"][0]
    if sweep is not None:
        overview["exits"]["tolerance"] = sweep["summary"]["tolerance"]
    depth = None if sweep is None else sweep["summary"].get("depth")
    overview["depth"] = None if depth is None else {
        **{k: depth[k] for k in ("oracle_spearman", "oracle_undefined", "tokens", "difficulties", "best")},
        # the sweep draws it into the same report folder; a page never links a missing figure
        "figure": depth["figure"] if (out / REPORT_DIR / depth["figure"]).is_file() else None}
    geometry = read_json_if_present(out / REPORT_DIR / "geometry" / "summary.json")
    if geometry is not None:
        overview["geometry"] = _geometry_headline(geometry)
    write_json(out / REPORT_DIR / OVERVIEW_FILE, overview)
    return overview


# Baselines have no loop budget: each is drawn at its own place left of 1 loop on the same axis.
BASELINE_PLACES = {"no_loop": (0.5, "D", "no loop"), "deep": (0.3, "^", "deep\nplain")}


def draw_task_overview(report_dir: str | os.PathLike, overview: dict[str, Any]) -> list[tuple[str, str]]:
    """Accuracy against test loops per difficulty, each baseline as a marker left of 1 loop; (path, caption)
    pairs. Drawn for the page's full width (1000 px at the figure saver's resolution)."""
    from matplotlib.lines import Line2D

    from rdepth.report.figures import pyplot, save_report_figure

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(10, 4.4))
    low, high = overview["train_difficulties"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    baselines = [name for name in BASELINE_PLACES if name in overview["baselines"]]
    handles = []
    for index, (difficulty, row) in enumerate(sorted(overview["looped"].items(), key=lambda item: int(item[0]))):
        color = colors[index % len(colors)]
        loops = sorted(int(k) for k in row)
        style = "o-" if int(difficulty) <= high else "s--"
        harder = "" if int(difficulty) <= high else f" ({int(difficulty) / high:.2g}x the top)"
        handles += axis.plot(loops, [100 * row[str(k)] for k in loops], style, color=color, markersize=5,
                             linewidth=1.8, label=f"difficulty {difficulty}{harder}")
        for name in baselines:
            value = overview["baselines"][name].get(difficulty)
            place, marker, _ = BASELINE_PLACES[name]
            if value is not None:
                axis.plot([place], [100 * value], marker, color=color, markersize=9, markerfacecolor="none",
                          markeredgewidth=1.8)
    for name in baselines:
        place, marker, _ = BASELINE_PLACES[name]
        handles.append(Line2D([], [], linestyle="none", marker=marker, markerfacecolor="none", color="0.3",
                              markersize=9, markeredgewidth=1.8, label=BASELINE_NAMES.get(name, name)))
    axis.axvline(overview["train_mean_loops"], color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    ticks = [BASELINE_PLACES[name][0] for name in baselines] + list(overview["budgets"])
    labels = [BASELINE_PLACES[name][2] for name in baselines] + [str(b) for b in overview["budgets"]]
    axis.set_xticks(ticks, labels)
    axis.minorticks_off()
    if baselines:
        axis.axvline(0.7, color="0.8", linewidth=0.8)  # baselines (no loop budget) | the looped model
    axis.set_xlabel(f"loops at test time (grey line: the training mean, {overview['train_mean_loops']:g})")
    axis.set_ylabel("exact match (%)")
    axis.set_ylim(-3, 103)
    axis.grid(alpha=0.3)
    axis.legend(handles=handles, fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    figure.tight_layout()
    path = save_report_figure(figure, report_dir, "overview_task_accuracy")
    return [(path, f"Exact match against test loops per difficulty (solid: trained on {low}..{high}; dashed: "
                   "harder than training). Open markers at the left: the baselines, trained on the same data and "
                   "steps, at the same difficulty (same colour).")]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def headline_text(overview: dict[str, Any]) -> str:
    h = overview["headline"]
    text = (f"Loops matter: at difficulty {h['difficulty']} (the top of training) the looped model solves "
            f"{_pct(h['one_loop'])} of problems with 1 loop and {_pct(h['best'])} with {_loops(h['best_loops'])}")
    if h.get("no_loop") is not None:
        text += f"; the same layers without loops, trained on the same data and steps, solve {_pct(h['no_loop'])}"
    if h.get("deep") is not None:
        text += f"; a plain model of the unrolled depth solves {_pct(h['deep'])}"
    return text + "."


def _versus(saved: float, what: str) -> str:
    if saved >= 0:
        return f" and {100 * saved:.0f}% fewer than {what}"
    return f", but {100 * -saved:.0f}% more than {what}"


def _time_versus(saved: float, label: str) -> str:
    if abs(saved) < 0.05:
        return f" and within 5% of {label}'s"
    if saved > 0:
        return f" and {100 * saved:.0f}% below {label}'s"
    return (f" but {100 * -saved:.0f}% above {label}'s (the policy's per-step decision costs more than the "
            "steps it saves)")


def _loops(count: int) -> str:
    return f"{count} loop{'s' if count != 1 else ''}"


def findings(overview: dict[str, Any]) -> list[str]:
    lines = []
    high = overview["train_difficulties"][1]
    for entry in overview["extrapolation"]:
        curve = entry["curve"]
        shown = ", ".join(f"{_pct(v)} at {k}" for k, v in curve.items())
        last = max(int(k) for k in curve)
        if entry["overthinking"]:
            tail = (f"; more loops lose accuracy ({_pct(curve[str(last)])} at {last}): overthinking, beyond twice "
                    f"the standard error of {100 * entry['standard_error']:.1f} points")
        elif entry["peak_loops"] < last:
            tail = (f"; past it accuracy stays within twice the standard error ({100 * entry['standard_error']:.1f} "
                    "points): no overthinking measurable")
        else:
            tail = ""
        lines.append(f"Harder than training (difficulty {entry['difficulty']}, {entry['difficulty'] / high:.2g}x the "
                     f"top): {shown} loops; best at {_loops(entry['peak_loops'])}{tail}.")
    exits = overview.get("exits")
    if exits and exits.get("best"):
        best, full = exits["best"], exits["full"]
        cheapest = exits.get("cheapest_fixed_as_accurate")
        lines.append(
            f"Early exit at difficulty {exits['difficulty']}: {best['label']} keeps {_pct(best['accuracy'])} "
            f"(full budget {full['label']}: {_pct(full['accuracy'])}) with {best['steps']:.2f} loop steps per token, "
            f"{100 * exits['steps_saved_vs_full']:.0f}% fewer than the full budget"
            + (_versus(exits["steps_saved_vs_cheapest_fixed"], f"{cheapest['label']}, the cheapest fixed budget as "
                                                                "accurate") if cheapest else "")
            + f"; answer tokens get {best['mean_steps_answer']:.2f} steps, the others {best['mean_steps_other']:.2f}"
            + (f"; teacher-forced wall time {100 * exits['time_saved_vs_full']:.0f}% below the full budget's"
               if exits.get("time_saved_vs_full") is not None else "")
            + (_time_versus(exits["time_saved_vs_cheapest_fixed"], cheapest["label"])
               if exits.get("time_saved_vs_cheapest_fixed") is not None and cheapest else "") + ".")
    elif exits:
        lines.append(f"Early exit at difficulty {exits['difficulty']}: no policy stays within "
                     f"{100 * exits['tolerance']:g} point(s) of the full budget.")
    depth = overview.get("depth")
    if depth:
        lines.append(depth_text(depth))
    for group in (overview.get("geometry") or {}).get("groups", []):
        floor = group["noise_floor_step"]
        decay = group["decay_5_over_0"]
        lines.append(f"Loop geometry (group {group['name']}): "
                     + ("" if decay is None else f"step size at step 5 is {format_value(decay)}x the first; ")
                     + ("steps never reach the noise floor within the budget" if floor is None else
                        f"steps reach the noise floor at step {floor}")
                     + f"; consecutive steps settle at cosine {format_value(group['settled_cosine'])} (the paper's "
                     "text model: 0.5-0.65, a slow spiral; a negative cosine is a back-and-forth oscillation).")
    return lines


def _rho(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def depth_text(depth: dict[str, Any]) -> str:
    """One finding: whether the loop steps executed on answer tokens follow the hops their answers need."""
    where = ", ".join(str(d) for d in depth["difficulties"])
    best = depth.get("best")
    text = (f"Does depth track difficulty? On the {depth['tokens']} answer tokens of difficulty {where}, Spearman's "
            "rank correlation of the loop steps executed with the hops each answer needs is ")
    text += (f"{_rho(best['spearman'])} for {best['label']} (the sweep's best setting: the fewest loop steps within "
             "the tolerance of the full budget's accuracy)" if best else
             "not given for a best setting (none within the tolerance of the full budget's accuracy)")
    return text + (f", and {_rho(depth['oracle_spearman'])} for the per-token oracle (the fewest fixed-budget steps "
                   f"from which a token stays right up to the cap; {depth['oracle_undefined']} token(s) wrong at the cap "
                   "left out).")


def percent_cell(fraction: float | None) -> str | None:
    """A table cell in percent with one decimal, ``0.0`` and ``50.0`` included (one format per column)."""
    return None if fraction is None else f"{100 * fraction:.1f}"


def _threads_fact(threads: dict[str, Any] | None) -> str:
    if not threads:
        return "not recorded"
    each = threads["per_process"]
    if "ranks" in threads:
        ranks = threads["ranks"]
        runs = f"{ranks} data-parallel training process{'es' if ranks != 1 else ''} per run"
    else:  # a demo.json written before --ranks: the baselines trained beside the looped model
        runs = f"{threads['side_by_side']} training process{'es' if threads['side_by_side'] != 1 else ''} side by side"
    return (f"{each} torch thread{'s' if each != 1 else ''} per process, {runs}; {threads['cores']} usable cores, "
            f"load {threads['load_at_start']:.1f} at the start")


def table_budgets(budgets: list[int], most: int = 5) -> list[int]:
    """At most ``most`` of the measured budgets for the first screen's table (the figure shows all):
    powers of two from 1, and the largest."""
    if len(budgets) <= most:
        return list(budgets)
    powers = [b for b in budgets if b & (b - 1) == 0 and b != budgets[-1]][: most - 1]
    return powers + [budgets[-1]]


def task_overview_section(overview: dict[str, Any], figures: list[tuple[str, str]]) -> Section:
    section = Section(SECTION, "Result", order=0)
    section.headline(headline_text(overview))
    for path, caption in figures:
        section.figure(path, caption)
    budgets = table_budgets(overview["budgets"], most=7 - len(overview["baselines"]))
    rows = []
    for difficulty, row in sorted(overview["looped"].items(), key=lambda item: int(item[0])):
        entry: dict[str, Any] = {"difficulty": int(difficulty)}
        entry.update({f"{k} loop{'s' if k > 1 else ''}": percent_cell(row[str(k)]) for k in budgets})
        for name, accuracies in overview["baselines"].items():
            entry[SHORT_NAMES.get(name, name)] = percent_cell(accuracies.get(difficulty))
        rows.append(entry)
    low, high = overview["train_difficulties"]
    section.table(rows, caption=f"Exact match (%) on held-out problems: the looped model at test loop "
                                f"budgets (trained on difficulties {low}..{high}, mean {overview['train_mean_loops']:g} "
                                "loops; every budget in the figure and demo.json) and the baselines trained on the "
                                "same data and steps")
    models = overview["models"]
    config = overview["config"]
    section.facts([
        (BASELINE_NAMES.get(name, "looped model" if name == "looped" else name),
         f"{m['n_layer']} layer{'' if m['n_layer'] == 1 else 's'}, width {m['d_model']}, groups {m['groups'] or 'none'}"
         + (f", mean {m['mean_loops']:g} loops" if m["groups"] else "")
         + f", {format_value(overview['parameters'].get(name))} parameters") for name, m in models.items()
    ] + [
        ("Task", f"{config['task']} {config['task_params']}"),
        ("Trained", f"{config['max_steps']} steps × {config['batch_size']} problems, lr {config['lr']}, "
                    f"curriculum over {config['curriculum_steps']} steps"),
        ("Threads", _threads_fact(overview.get("threads"))),
        ("Time", f"{overview['wall_seconds']:.0f} s for the whole demo ("
                 + ", ".join(f"{k} {v:.0f} s" for k, v in overview["stage_seconds"].items()) + ")"),
    ])
    section.bullets(findings(overview), caption="What the report found")
    depth = overview.get("depth") or {}
    if depth.get("figure"):
        section.figure(depth["figure"], "Loop steps executed per hop count on answer tokens: each exit policy at its "
                                        "cheapest setting within the tolerance (else its most accurate), and the "
                                        "per-token oracle; Spearman's rho in the legend (details: Early exit on the "
                                        "task, depth_vs_hops.csv).")
    return section


def write_task_first_screen(out: str | os.PathLike) -> Path:
    """Summarise, draw and render the task demo's first screen into ``OUT/report/index.html``."""
    out = Path(out)
    overview = summarize_task_demo(out)
    report_dir = out / REPORT_DIR
    figures = draw_task_overview(report_dir, overview)
    report = Report("rdepth demo report: a task whose answers need the loops",
                    intro=f"Output folder {out.resolve()}")
    report.sections[SECTION] = task_overview_section(overview, figures)
    return report.write(report_dir)
