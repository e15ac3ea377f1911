"""Loop-geometry figures, drawn only from the numbers ``analyze`` saved.

Each ``figure_*`` function takes the parsed ``summary.json`` (and, for the PCA
figure, the arrays of one NPZ) and returns a matplotlib Figure; :func:`draw_all`
saves them with :func:`rdepth.report.figures.save_report_figure` (PNG + SVG
under ``OUT/figures``) and returns (path, caption) pairs for the report. matplotlib is
imported lazily with the Agg backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rdepth.report.figures import plain_log_ticks, save_report_figure
from rdepth.report.figures import pyplot as _pyplot

log = logging.getLogger(__name__)


def _checkpoint_colours(count: int):
    """Light to dark: early checkpoints pale, the last one darkest."""
    cmap = _pyplot().get_cmap("viridis")
    return [cmap(0.85 - 0.75 * i / max(count - 1, 1)) for i in range(count)]


def _label(entry: dict[str, Any]) -> str:
    return f"step {entry['step']}" if entry.get("step", -1) >= 0 else entry["label"]


# ------------------------------------------------------------------ Fig 1


def figure_pca(arrays: dict[str, np.ndarray], group_names: list[str], tokens: int = 6, zoom_group: int | None = None):
    """Fig. 1: PCA trajectories of a few tokens of one sequence through every group's
    loop steps (step 0, the random initial state, omitted), coloured light -> dark by
    iteration order, with an inset zooming on one token's loop in ``zoom_group``."""
    plt = _pyplot()
    coords, group_of, step_of = arrays["pca_coords"], arrays["pca_group"], arrays["pca_step"]
    explained = arrays["pca_explained"]
    computed = step_of > 0
    seq_len = coords.shape[1]
    shown = np.unique(np.linspace(0, seq_len - 1, min(tokens, seq_len)).round().astype(int))
    order = np.cumsum(computed) - 1  # iteration index along depth, over computed states
    cmap = plt.get_cmap("viridis_r")
    norm = plt.Normalize(0, max(int(order[computed].max()), 1))
    figure, (axis, inset) = plt.subplots(
        1, 2, figsize=(11, 5.2), gridspec_kw={"width_ratios": [1.6, 1]}, layout="constrained"
    )
    for token in shown:
        path = coords[computed, token]
        axis.plot(path[:, 0], path[:, 1], color="0.75", linewidth=0.7, zorder=1)
        points = axis.scatter(path[:, 0], path[:, 1], c=order[computed], cmap=cmap, norm=norm, s=12, zorder=2)
        axis.annotate(f"t{token}", path[-1], fontsize=7, xytext=(3, 3), textcoords="offset points")
    group_count = int(group_of.max()) + 1
    # mark the hand-offs: the first computed iterate of every group
    for group in range(group_count):
        first = np.flatnonzero(computed & (group_of == group))[0]
        axis.scatter(coords[first, shown, 0], coords[first, shown, 1], marker="x", color="k", s=18, zorder=3,
                     label="first iterate of a group" if group == 0 else None)
    # the zoom: one token's iterates inside one group's loop
    if zoom_group is None:  # the longest loop, nearest the middle on ties
        steps = [int((computed & (group_of == g)).sum()) for g in range(group_count)]
        zoom_group = max(range(group_count), key=lambda g: (steps[g], -abs(g - group_count // 2)))
    zoom = zoom_group
    token = int(shown[len(shown) // 2])
    rows = computed & (group_of == zoom)
    loop = coords[rows, token]
    inset.plot(loop[:, 0], loop[:, 1], color="0.6", linewidth=0.8)
    inset.scatter(loop[:, 0], loop[:, 1], c=order[rows], cmap=cmap, norm=norm, s=22)
    for number, point in enumerate(loop, start=1):
        inset.annotate(str(number), point, fontsize=6, xytext=(2, 2), textcoords="offset points")
    inset.set_title(f"zoom: token t{token} inside group {group_names[zoom]} ({len(loop)} loop steps)", fontsize=9)
    pad = 0.15 * max(np.ptp(loop[:, 0]), np.ptp(loop[:, 1]), 1e-6 * (1.0 + float(np.abs(loop).max())))
    inset.set_xlim(loop[:, 0].min() - pad, loop[:, 0].max() + pad)
    inset.set_ylim(loop[:, 1].min() - pad, loop[:, 1].max() + pad)
    inset.tick_params(labelsize=7)
    axis.indicate_inset_zoom(inset, edgecolor="0.4")
    figure.colorbar(points, ax=[axis, inset], label="iteration order (depth x loop step)", shrink=0.8)
    axis.set_xlabel(f"PC1 ({100 * explained[0]:.1f}% of variance)")
    axis.set_ylabel(f"PC2 ({100 * explained[1]:.1f}% of variance)")
    axis.set_title("Token trajectories through depth and loop steps (2-D PCA)")
    axis.legend(loc="best", fontsize=7)
    return figure


# ------------------------------------------------------------------ Fig 2


def has_boundaries(summary: dict[str, Any], budget: str = "train") -> bool:
    """Whether the model hands a state from one looped group to another (a drift to measure)."""
    return bool(summary["checkpoints"][0]["budgets"][budget]["dlr"])


def figure_dlr(summary: dict[str, Any], budget: str = "train"):
    """Fig. 2: mean DLR (band: 10th-90th percentile over tokens) per boundary across
    checkpoints; solid = the default drift over Eq. 2's all-step mean, dash-dot = the same
    drift over the mean refinement step (k >= 1), dashed = Eq. 2 as written (paper-literal)."""
    plt = _pyplot()
    entries = summary["checkpoints"]
    by_step = all(entry.get("step", -1) >= 0 for entry in entries)
    steps = [entry["step"] for entry in entries] if by_step else list(range(len(entries)))
    boundaries = list(entries[0]["budgets"][budget]["dlr"])
    labels = summary.get("dlr_labels", {})
    figure, axis = plt.subplots(figsize=(7.5, 4.6))
    styles = {summary["dlr_default"]: ("-", "o"), summary.get("dlr_default_refine"): ("-.", "^"),
              "literal": ("--", "s")}
    colours = plt.get_cmap("tab10")
    for index, boundary in enumerate(boundaries):
        for definition, (style, marker) in styles.items():
            if definition not in entries[0]["budgets"][budget]["dlr"][boundary]:
                continue
            stats = [entry["budgets"][budget]["dlr"][boundary][definition] for entry in entries]
            mean = np.array([np.nan if s["mean"] is None else s["mean"] for s in stats], dtype=float)
            axis.plot(steps, mean, style, marker=marker, color=colours(index),
                      markerfacecolor=colours(index) if style == "-" else "none",
                      label=f"{boundary}: {labels.get(definition, definition)}")
            if style == "-":
                low, high = ([np.nan if s[key] is None else s[key] for s in stats] for key in ("p10", "p90"))
                axis.fill_between(steps, low, high, color=colours(index), alpha=0.15, linewidth=0)
    axis.axhline(1.0, color="k", linewidth=0.8, linestyle=":")
    axis.set_yscale("log")
    plain_log_ticks(axis.yaxis)
    if by_step:
        axis.set_xlabel("training step")
    else:  # named models (e.g. a teacher and its surrogate), not a training series
        axis.set_xticks(steps, [entry["label"] for entry in entries])
    axis.set_ylabel("drift-to-loop ratio")
    axis.set_title(f"Cross-block drift vs. mean loop step ({budget} budget); >1: coarse hand-off", fontsize=10)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)
    else:  # one looped group: no boundary between groups, no drift to plot
        axis.text(0.5, 0.5, "one looped group: no drift between groups", transform=axis.transAxes, ha="center")
    return figure


# ------------------------------------------------------------------ Fig 3 / 5


def _group_panels(summary: dict[str, Any], rows: int, height: float, width: float = 4.0):
    """One column of ``rows`` panels per recurrence group: ``(figure, axes [rows, groups], checkpoints,
    group names, checkpoint colours light -> dark)``."""
    entries, names = summary["checkpoints"], summary["groups"]
    figure, axes = _pyplot().subplots(rows, len(names), figsize=(width * len(names), height), squeeze=False)
    return figure, axes, entries, names, _checkpoint_colours(len(entries))


def _cosine_panel(axis, entries, budget, group, colours) -> None:
    """cos(Delta^(k), Delta^(k-1)) per checkpoint on [-1, 1], the zero line drawn."""
    _curves(axis, entries, budget, group, "cosine", colours, offset=1)
    axis.set_ylim(-1.05, 1.05)
    axis.axhline(0, color="k", linewidth=0.5)
    axis.set_xlabel("k")


def _curves(axis, entries, budget, group, metric, colours, offset: int = 0) -> None:
    for entry, colour in zip(entries, colours, strict=False):
        values = entry["budgets"][budget]["groups"][group][metric]
        mean, std = np.asarray(values["mean"]), np.asarray(values["std"])
        k = np.arange(len(mean)) + offset
        axis.plot(k, mean, color=colour, linewidth=1.2, label=_label(entry),
                  marker="o" if len(mean) == 1 else None)  # a one-step loop is a single point
        axis.fill_between(k, mean - std, mean + std, color=colour, alpha=0.15, linewidth=0)
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def figure_loop_dynamics(summary: dict[str, Any], budget: str = "train"):
    """Fig. 3: (a) step norms ||Delta^(k)|| and (b) cos(Delta^(k), Delta^(k-1)) per group,
    mean and 1-sigma band over tokens, one curve per checkpoint."""
    figure, axes, entries, names, colours = _group_panels(summary, rows=2, height=6.5)
    for group, name in enumerate(names):
        top, bottom = axes[0, group], axes[1, group]
        _curves(top, entries, budget, group, "step_size", colours)
        top.set_yscale("log")
        plain_log_ticks(top.yaxis)
        top.set_title(f"({'i' * (group + 1) if group < 3 else group + 1}) group {name}")
        top.set_xlabel("k")
        _cosine_panel(bottom, entries, budget, group, colours)
    axes[0, 0].set_ylabel(r"(a) step norm $\|\Delta^{(k)}\|_2$", parse_math=True)
    axes[1, 0].set_ylabel(r"(b) $\cos\angle(\Delta^{(k)}, \Delta^{(k-1)})$", parse_math=True)
    axes[0, -1].legend(fontsize=7)
    loops = ",".join(map(str, summary["budgets"][budget])) if "budgets" in summary else budget
    figure.suptitle(f"Loop dynamics at {budget} budget (loops {loops}); bands: 1 sigma over tokens")
    figure.tight_layout()
    return figure


def figure_long_cosines(summary: dict[str, Any]):
    """Fig. 5: cos(Delta^(k), Delta^(k-1)) at the long fixed budget across checkpoints."""
    figure, axes, entries, names, colours = _group_panels(summary, rows=1, height=3.4)
    for group, name in enumerate(names):
        axis = axes[0, group]
        _cosine_panel(axis, entries, "long", group, colours)
        axis.set_title(f"group {name}")
    axes[0, 0].set_ylabel(r"$\cos\angle(\Delta^{(k)}, \Delta^{(k-1)})$", parse_math=True)
    axes[0, -1].legend(fontsize=7)
    figure.suptitle(f"Consecutive-step cosine at a fixed {summary['budgets']['long'][0]}-loop budget")
    figure.tight_layout()
    return figure


def figure_effective_rank(summary: dict[str, Any], budget: str = "long"):
    """Effective rank of the updates Delta^(k) over tokens, per step, per checkpoint."""
    figure, axes, entries, names, colours = _group_panels(summary, rows=1, height=3.2)
    for group, name in enumerate(names):
        axis = axes[0, group]
        for entry, colour in zip(entries, colours, strict=False):
            ranks = entry["budgets"][budget]["groups"][group].get("effective_rank", [])
            axis.plot(np.arange(len(ranks)), ranks, color=colour, label=_label(entry))
        axis.set_title(f"group {name}")
        axis.set_xlabel("k")
    axes[0, 0].set_ylabel("effective rank of updates")
    axes[0, -1].legend(fontsize=7)
    figure.tight_layout()
    return figure


def figure_dlr_budget(summary: dict[str, Any]):
    """DLR against the loop budget K (the saved ``dlr_curve``): Eq. 2 as written, which grows about like K,
    beside the hand-off drift over the refinement steps, which does not depend on the random start."""
    plt = _pyplot()
    curve = summary["dlr_curve"]
    loops = curve["loops"]
    figure, axis = plt.subplots(figsize=(6, 3.8))
    for index, (boundary, definitions) in enumerate(curve["boundaries"].items()):
        colour = f"C{index}"
        for definition, style, label in (("literal", "--", "Eq. 2 (x(0), all steps)"),
                                         ("output_refine", "-", "hand-offs x(K), refinement steps"),
                                         ("handoff", ":", "hand-offs x(K) ÷ extent after x(1)")):
            stats = definitions.get(definition)
            if not stats:
                continue
            median = np.array([np.nan if v is None else v for v in stats["median"]], dtype=float)
            low = np.array([np.nan if v is None else v for v in stats["p10"]], dtype=float)
            high = np.array([np.nan if v is None else v for v in stats["p90"]], dtype=float)
            axis.plot(loops, median, style, color=colour, label=f"{boundary}: {label}")
            axis.fill_between(loops, low, high, color=colour, alpha=0.08)
    axis.axvline(12, color="grey", linewidth=0.8, linestyle=":")
    axis.axhline(10, color="k", linewidth=0.5, linestyle=":")
    axis.set_yscale("log")
    plain_log_ticks(axis.yaxis)
    axis.set_xlabel("loop budget K (every group)")
    axis.set_ylabel("DLR (median over tokens, p10-p90 band)")
    axis.set_title(f"DLR against the loop budget ({curve['checkpoint']}; paper's r = 12 dotted)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def figure_jacobian(summary: dict[str, Any]):
    """The own-state Jacobian's leading eigenvalues at each group's last iterate (last checkpoint), in the
    complex plane with the unit circle: modulus = contraction per step, angle = turning per step."""
    spectra = summary["checkpoints"][-1]["jacobian"]
    figure, axes, _, names, _ = _group_panels(summary, rows=1, height=3.6, width=3.6)
    circle = np.linspace(0, 2 * np.pi, 200)
    for axis, name, group in zip(axes[0], names, spectra["groups"], strict=False):
        axis.plot(np.cos(circle), np.sin(circle), color="grey", linewidth=0.6)
        for position, rows in enumerate(group["eigenvalues"]):
            axis.scatter([r["real"] for r in rows], [r["imag"] for r in rows], s=14, color=f"C{position}",
                         label=f"position {spectra['positions'][position]}")
        radius = group["spectral_radius"]["median"]
        angle = group["leading_angle_deg"]["median"]
        axis.set_title(f"group {name}: |λ1| {radius:.2f}, ∠ {angle:.0f}°", fontsize=9)
        axis.set_aspect("equal")
        axis.axhline(0, color="k", linewidth=0.4)
        axis.axvline(0, color="k", linewidth=0.4)
        axis.set_xlabel("Re λ")
    axes[0, 0].set_ylabel("Im λ")
    axes[0, -1].legend(fontsize=6)
    figure.suptitle(f"Own-state Jacobian eigenvalues at the last of {spectra['loop_counts'][0]} loop steps "
                    f"(top {spectra['top']} per position)", fontsize=10)
    figure.tight_layout()
    return figure


# ------------------------------------------------------------------ all


def draw_all(out: str | Path, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Draw every figure into ``OUT/figures``; returns (relative PNG path, caption) pairs."""
    from rdepth.geometry.arrays import load_arrays

    out = Path(out)
    last = summary["checkpoints"][-1]
    pca_arrays = load_arrays(out / last["budgets"]["train"]["arrays"], prefix="pca_")
    figures: list[tuple[str, Callable[[], Any], str]] = []
    if pca_arrays:
        figures.append(("fig1_pca_trajectories", lambda: figure_pca(pca_arrays, summary["groups"]),
                        f"Fig. 1: PCA trajectories ({_label(last)}, training budget, sequence "
                        f"{summary['settings']['keep_sequence']}); tight arcs inside loops (inset), "
                        "larger jumps at group hand-offs (x marks)."))
    if has_boundaries(summary):  # one looped group hands on to no other: no drift to plot
        figures.append((
            "fig2_dlr", lambda: figure_dlr(summary),
            "Fig. 2: drift-to-loop ratio per boundary across checkpoints (log scale; dotted line = 1). Solid: drift "
            "to the next group's first iterate x(1) over the earlier group's mean step over all steps k≥0 (Eq. 2's "
            "denominator, dominated by the jump Δ(0) from the random initial state); dash-dot: the same drift over "
            "the mean refinement step, k≥1; dashed: Eq. 2 as written (from the random x(0), over all steps)."))
    figures += [
        ("fig3_loop_dynamics", lambda: figure_loop_dynamics(summary, "train"),
         "Fig. 3: step norms (top, log scale) and consecutive-step cosines (bottom) per group, training budget."),
    ]
    if "long" in summary["budgets"]:  # absent for a surrogate's phases (one budget only)
        figures += [
            ("fig3b_loop_dynamics_long", lambda: figure_loop_dynamics(summary, "long"),
             f"Fig. 3 at the long budget: the same curves over {summary['budgets']['long'][0]} loop steps."),
            ("fig5_long_cosines", lambda: figure_long_cosines(summary),
             "Fig. 5: consecutive-step cosine at the long fixed budget across checkpoints."),
        ]
    if summary.get("dlr_curve"):
        figures.append(("fig2b_dlr_budget", lambda: figure_dlr_budget(summary),
                        "DLR against the loop budget K = 1..N (median over tokens, p10-p90 band): Eq. 2 as written "
                        "(dashed) grows about like K, so a DLR verdict must name its K (the paper's r = 12, dotted); "
                        "solid: the two groups' hand-off states over the earlier group's refinement steps, free of "
                        "the random start."))
    if last.get("jacobian"):
        figures.append(("fig_jacobian", lambda: figure_jacobian(summary),
                        "Leading eigenvalues of each group's own-state Jacobian at its last iterate (last "
                        "checkpoint, sampled positions): inside the unit circle contracts; the angle is the turning "
                        "per step (near 180°: steps flip back and forth, negative cosines; near 0°: they keep "
                        "going, positive cosines)."))
    rank_budget = summary["scale_budget"]
    if "effective_rank" in last["budgets"][rank_budget]["groups"][0]:
        figures.append(("fig_effective_rank", lambda: figure_effective_rank(summary, rank_budget),
                        "Effective rank (exp entropy of normalised singular values) of the updates per step, "
                        f"{rank_budget} budget."))
    saved = []
    for stem, build, caption in figures:
        saved.append((save_report_figure(build(), out, stem), caption))
        log.debug("saved figure %s", stem)
    return saved
