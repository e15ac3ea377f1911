"""Figures of a saved sweep (``sweep.json``): Figure 4 of the paper, a Pareto plot, exit histograms.

Every function takes the saved result dict and returns a matplotlib figure;
:func:`save_sweep_figures` writes them (PNG + SVG, through the one figure saver
:func:`rdepth.report.figures.save_figure`). Nothing here computes a number: the
points, the latency shown and the matched-quality line come from the result
and its saved summary (:mod:`rdepth.sweep.summary`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdepth.report.figures import plain_log_ticks, save_figure
from rdepth.report.figures import pyplot as _pyplot
from rdepth.sweep.summary import summary_of


def _by_policy(result: dict, parameter: str | None = "tau") -> dict[str, list[dict]]:
    """Points grouped by policy (in sweep order), sorted by value; only ``parameter`` sweeps."""
    groups: dict[str, list[dict]] = {}
    for point in result["points"]:
        if parameter is None or (point["parameter"] == parameter and "values" not in point):  # not a profile
            groups.setdefault(point["policy"], []).append(point)
    return {name: sorted(points, key=lambda p: p["value"]) for name, points in groups.items()}


def group_names(result: dict) -> list[str]:
    """The groups' layer-range names (``1``, ``2-3``, ``4``), as every other figure and table names
    them; the index when the saved model config does not say."""
    from rdepth.config import parse_groups

    model = result.get("model") or {}
    try:
        names = [spec.name for spec in parse_groups(str(model["groups"]), int(model["n_layer"]))]
    except Exception:  # an older or hand-made result: fall back to the position
        names = []
    return names if len(names) == len(result["k_max"]) else [str(i) for i in range(len(result["k_max"]))]


LATENCY_LABELS = {
    "ms_per_token_generate": "decode ms/token (cached generation, batch 1, packed path)",
    "ms_per_token_b1": "teacher-forced ms/token (batch 1, packed path)",
}


def latency_key(result: dict) -> str | None:
    """The latency plotted (saved in the summary): generation when measured, else the batch-1
    forward; None without timing."""
    return summary_of(result)["latency_key"]


def figure4(result: dict) -> Any:
    """Latency (the summary's ``latency_key``), perplexity and cross-entropy against tau, one line per policy.

    The full fixed budget is the dashed line; without timing the first panel
    shows mean loop steps (summed over groups) instead of latency.
    """
    plt = _pyplot()
    latency = latency_key(result)
    reference = result["reference"]
    panels = [
        (latency, LATENCY_LABELS[latency]) if latency else ("steps", "loop steps per token (all groups)"),
        ("ppl", "perplexity"),
        ("ce", "cross-entropy (nats)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label) in zip(axes, panels, strict=False):
        for name, points in _by_policy(result).items():
            xs = [p["value"] for p in points]
            ax.plot(xs, [p[key] for p in points], marker="o", label=name)
        ref = reference[key]
        ax.axhline(ref, color="grey", linestyle="--", linewidth=1, label=f"fixed {reference['budget']}")
        if key == latency:
            ax.set_yscale("log")  # one slow outlier must not flatten every other point
            _plain_log(ax.yaxis)
        ax.set_xscale("log")
        ax.set_xlabel("threshold tau")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Exit policies across thresholds")
    fig.tight_layout()
    return fig


def _plain_log(axis: Any) -> None:
    """Log scale with ticks written as plain numbers (0.3, 0.4, ...), not powers of ten."""
    plain_log_ticks(axis)


def _xerr(entries: list[dict], key: str | None) -> list[list[float]] | None:
    """Horizontal error bars from the saved IQRs (None without them)."""
    if key is None or not all(f"{key}_iqr" in e for e in entries):
        return None
    return [[max(e[key] - e[f"{key}_iqr"][0], 0.0) for e in entries],
            [max(e[f"{key}_iqr"][1] - e[key], 0.0) for e in entries]]


def _noisy(entry: dict, key: str | None, threshold: float) -> bool:
    """The saved timing's IQR exceeds ``threshold`` of its median (the noise rule's spread test)."""
    if key is None or f"{key}_iqr" not in entry:
        return False
    low, high = entry[f"{key}_iqr"]
    return entry[key] > 0 and (high - low) / entry[key] > threshold


def pareto(result: dict) -> Any:
    """Perplexity against latency (or loop steps) for every point of every policy and the fixed budgets,
    with the matched-quality limit.

    Latency on a log axis with the saved IQR as horizontal bars; points whose IQR exceeds the noise
    threshold are ringed in red (their position is uncertain).
    """
    plt = _pyplot()
    summary = summary_of(result)
    latency = summary["latency_key"]
    threshold = summary.get("noise_threshold", 0.1)

    def x_of(entry: dict) -> float:
        return entry[latency or "steps"]

    fig, ax = plt.subplots(figsize=(7, 5))
    noisy: list[dict] = []
    for name, points in _by_policy(result, parameter=None).items():
        ordered = sorted(points, key=x_of)
        ax.errorbar([x_of(p) for p in ordered], [p["ppl"] for p in ordered], xerr=_xerr(ordered, latency),
                    marker="o", capsize=2, label=name)
        noisy += [p for p in ordered if _noisy(p, latency, threshold)]
    ladder = sorted(result.get("fixed_ladder", []), key=x_of)
    if ladder:
        ax.errorbar([x_of(f) for f in ladder], [f["ppl"] for f in ladder], xerr=_xerr(ladder, latency),
                    color="black", marker="s", linestyle=":", capsize=2, label="fixed budgets (packed path)")
        noisy += [f for f in ladder if _noisy(f, latency, threshold)]
    reference = result["reference"]
    ax.scatter([x_of(reference)], [reference["ppl"]], marker="*", s=200, color="black", zorder=5,
               label=f"full budget {reference['budget']}")
    if _noisy(reference, latency, threshold):
        noisy.append(reference)
    if noisy:
        ax.scatter([x_of(e) for e in noisy], [e["ppl"] for e in noisy], s=160, facecolors="none",
                   edgecolors="red", linewidths=1.5, zorder=6,
                   label=f"timing IQR > {100 * threshold:g}% of median")
    ax.axhline(summary["ppl_limit"], color="grey", linestyle="--", linewidth=1,
               label=f"+{100 * summary['tolerance']:g}% perplexity")
    if latency:
        ax.set_xscale("log")
        _plain_log(ax.xaxis)
    ax.set_xlabel(LATENCY_LABELS[latency] if latency else "loop steps per token (all groups)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Latency-quality trade-off")
    fig.tight_layout()
    return fig


def exit_histograms(result: dict, policies: tuple[str, ...] = ("acceleration", "step_norm", "kl")) -> Any:
    """Steps computed per token, per group (columns) and policy (rows), one bar set per tau."""
    plt = _pyplot()
    grouped = {name: pts for name, pts in _by_policy(result, parameter=None).items() if name in policies}
    if not grouped:
        grouped = dict(list(_by_policy(result, parameter=None).items())[:3])
    n_groups = len(result["k_max"])
    names = group_names(result)
    fig, axes = plt.subplots(len(grouped), n_groups, figsize=(4 * n_groups, 2.6 * len(grouped)), squeeze=False)
    for row, (name, points) in enumerate(grouped.items()):
        for group in range(n_groups):
            ax = axes[row][group]
            width = 0.8 / len(points)
            for index, point in enumerate(points):
                counts = point["computed_histogram"][group]
                total = max(sum(counts), 1)
                steps = [k + (index - (len(points) - 1) / 2) * width for k in range(len(counts))]
                ax.bar(steps, [c / total for c in counts], width=width, label=f"{point['value']:g}")
            ax.set_title(f"{name}, group {names[group]}", fontsize=9)
            ax.set_xlabel("loop steps computed")
            if group == 0:
                ax.set_ylabel("fraction of tokens")
        axes[row][0].legend(fontsize=7, title=points[0]["parameter"], title_fontsize=7)
    fig.tight_layout()
    return fig


FIGURES = {
    "fig_latency_quality": ("figure4", figure4),
    "fig_pareto": ("pareto", pareto),
    "fig_exit_histograms": ("exit_histograms", exit_histograms),
}


def save_sweep_figures(result: dict, folder: str | Path) -> dict[str, Path]:
    """Write every figure under ``folder`` as ``<stem>.png`` and ``<stem>.svg``; returns name -> PNG path."""
    summary_of(result)  # an older result fails here, before any drawing
    return {name: save_figure(draw(result), folder, stem)["png"] for name, (stem, draw) in FIGURES.items()}
