"""Figures of a saved sweep (``sweep.json``): Figure 4 of the paper, a Pareto plot, exit histograms.

Every function takes the saved result dict and returns a matplotlib figure;
:func:`save_sweep_figures` writes them. Nothing here computes a metric.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdepth.io import atomic_path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_policy(result: dict, parameter: str | None = "tau") -> dict[str, list[dict]]:
    """Points grouped by policy (in sweep order), sorted by value; only ``parameter`` sweeps."""
    groups: dict[str, list[dict]] = {}
    for point in result["points"]:
        if parameter is None or point["parameter"] == parameter:
            groups.setdefault(point["policy"], []).append(point)
    return {name: sorted(points, key=lambda p: p["value"]) for name, points in groups.items()}


LATENCY_LABELS = {
    "ms_per_token_generate": "ms/token (cached generation, batch 1)",
    "ms_per_token_b1": "ms/token (forward, batch 1)",
}


def latency_key(result: dict) -> str | None:
    """The latency plotted: generation when measured, else the batch-1 forward; None without timing."""
    for key in LATENCY_LABELS:
        if key in result["reference"]:
            return key
    return None


def figure4(result: dict) -> Any:
    """Latency (ms/token, batch 1), perplexity and cross-entropy against tau, one line per policy.

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
    for ax, (key, label) in zip(axes, panels):
        for name, points in _by_policy(result).items():
            xs = [p["value"] for p in points]
            ys = [sum(p["mean_steps"]) if key == "steps" else p[key] for p in points]
            ax.plot(xs, ys, marker="o", label=name)
        ref = sum(reference["mean_steps"]) if key == "steps" else reference[key]
        ax.axhline(ref, color="grey", linestyle="--", linewidth=1, label=f"fixed {reference['budget']}")
        ax.set_xscale("log")
        ax.set_xlabel("threshold tau")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Exit policies across thresholds")
    fig.tight_layout()
    return fig


def pareto(result: dict) -> Any:
    """Perplexity against latency (or loop steps) for every point of every policy and the fixed budgets."""
    plt = _pyplot()
    latency = latency_key(result)

    def x_of(entry: dict) -> float:
        return entry[latency] if latency else sum(entry["mean_steps"])

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, points in _by_policy(result, parameter=None).items():
        ordered = sorted(points, key=x_of)
        ax.plot([x_of(p) for p in ordered], [p["ppl"] for p in ordered], marker="o", label=name)
    ladder = sorted(result.get("fixed_ladder", []), key=x_of)
    if ladder:
        ax.plot([x_of(f) for f in ladder], [f["ppl"] for f in ladder], color="black", marker="s",
                linestyle=":", label="fixed budgets")
    reference = result["reference"]
    ax.scatter([x_of(reference)], [reference["ppl"]], marker="*", s=200, color="black", zorder=5,
               label=f"full budget {reference['budget']}")
    ax.axhline(reference["ppl"] * 1.01, color="grey", linestyle="--", linewidth=1, label="+1% perplexity")
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
            ax.set_title(f"{name}, group {group}", fontsize=9)
            ax.set_xlabel("loop steps computed")
            if group == 0:
                ax.set_ylabel("fraction of tokens")
        axes[row][0].legend(fontsize=7, title=points[0]["parameter"], title_fontsize=7)
    fig.tight_layout()
    return fig


FIGURES = {
    "fig_latency_quality": ("figure4.png", figure4),
    "fig_pareto": ("pareto.png", pareto),
    "fig_exit_histograms": ("exit_histograms.png", exit_histograms),
}


def save_sweep_figures(result: dict, folder: str | Path) -> dict[str, Path]:
    """Write every figure as PNG under ``folder``; returns name -> path."""
    plt = _pyplot()
    folder = Path(folder)
    paths = {}
    for name, (filename, draw) in FIGURES.items():
        fig = draw(result)
        path = folder / filename
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=120)
        plt.close(fig)
        paths[name] = path
    return paths
