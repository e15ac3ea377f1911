"""Figures drawn from saved numbers only (JSON/NPZ contents); each function returns a Figure.

matplotlib is imported lazily with the Agg backend; :func:`rdepth.report.figures.save_figure` writes them.
"""

from __future__ import annotations

import numpy as np

from rdepth.report.figures import pyplot as _pyplot

MODEL_STYLES = {"raptor": ("C0", "-"), "equal_split": ("C1", "--"), "truncated": ("C2", ":"), "teacher": ("k", "-")}
PHASE_COLOURS = {"dp": "red", "maxcut": "white", "equal": "grey"}


def _by_depth(fig, axes, legend_size: int):
    """The shared finish of the per-depth panels: depth on every x axis, a legend on each."""
    for ax in axes:
        ax.set_xlabel("depth")
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    return fig


def plot_similarity(matrix: np.ndarray, phases: dict[str, list[int]], title: str):
    """Heatmap of an (L+1, L+1) depth-similarity matrix (depth 0 = embedding) with phases drawn.

    ``phases``: method name -> phase lengths over depths 1..L, drawn as squares.
    """
    from matplotlib.patches import Rectangle

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 4))
    image = ax.imshow(matrix, cmap="viridis", origin="upper")
    colorbar = fig.colorbar(image, ax=ax, fraction=0.046)
    colorbar.formatter.set_useOffset(False)  # similarities near 1 read as 0.9999, not "+1" and offsets
    colorbar.update_ticks()
    depths = np.arange(matrix.shape[0])
    ax.set_xticks(depths)
    ax.set_yticks(depths)
    for offset, (method, lengths) in enumerate(phases.items()):
        start = 1
        inset = 0.06 * offset  # keep coincident squares of different methods visible
        for i, length in enumerate(lengths):
            ax.add_patch(Rectangle((start - 0.5 + inset, start - 0.5 + inset), length - 2 * inset, length - 2 * inset,
                                   fill=False, lw=2, ls="-" if offset == 0 else "--",
                                   ec=PHASE_COLOURS.get(method, "orange"), label=method if i == 0 else None))
            start += length
    ax.set_xlabel("depth")
    ax.set_ylabel("depth")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower left", framealpha=0.6)
    fig.tight_layout()
    return fig


def plot_fidelity(models: dict[str, dict]):
    """Layer-wise cosine and relative MSE to the teacher, one line per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for name, metrics in models.items():
        if "layer_cosine" not in metrics:
            continue
        colour, style = MODEL_STYLES.get(name, (None, "-"))
        depths = np.arange(1, len(metrics["layer_cosine"]) + 1)
        axes[0].plot(depths, metrics["layer_cosine"], style, color=colour, marker="o", label=name)
        axes[1].plot(depths, metrics["layer_rel_mse"], style, color=colour, marker="o", label=name)
    axes[0].set_ylabel("cosine to teacher state")
    axes[1].set_ylabel("relative MSE to teacher state")
    axes[1].set_yscale("log")
    return _by_depth(fig, axes, legend_size=7)


def plot_dynamics(dynamics: dict[str, dict]):
    """Per-depth turning angle, mean-direction coherence and update effective rank."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for name, summary in dynamics.items():
        colour, style = MODEL_STYLES.get(name, (None, "-"))
        angular, coherence = summary["angular"], summary["coherence"]
        steps = np.arange(1, len(angular["step_first"]) + 1)
        axes[0].plot(steps, angular["step_first"], style, color=colour, marker="s", label=f"{name}: first token")
        axes[0].plot(steps, angular["step_others"], style, color=colour, marker="o", alpha=0.6, label=f"{name}: others")
        depths = np.arange(len(coherence["others"]))
        axes[1].plot(depths, coherence["first"], style, color=colour, marker="s", label=f"{name}: first vs mean")
        axes[1].plot(depths, coherence["others"], style, color=colour, marker="o", alpha=0.6, label=f"{name}: others vs mean")
        axes[2].plot(steps, summary["update_effective_rank"], style, color=colour, marker="o", label=name)
    axes[0].set_ylabel("angle turned per layer (deg)")
    axes[1].set_ylabel("cosine to others' mean direction")
    axes[2].set_ylabel("effective rank of update")
    return _by_depth(fig, axes, legend_size=6)


def plot_training(records: list[dict]):
    """Loss against step for every fitting stage in metrics.jsonl."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    stages: dict[str, tuple[list, list]] = {}
    for record in records:
        steps, losses = stages.setdefault(record["stage"], ([], []))
        steps.append(record["step"])
        losses.append(record["loss"])
    for stage, (steps, losses) in stages.items():
        ax.plot(steps, losses, label=stage)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("scaled state MSE")
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def plot_bars(rows: list[dict], value: str, label: str, title: str):
    """One bar per row (``label`` field names it) of the ``value`` field."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(rows) + 2), 3.2))
    heights = [np.nan if r[value] is None else r[value] for r in rows]  # saved JSON writes a nan as null
    ax.bar([str(r[label]) for r in rows], heights, color="C0")
    ax.set_ylabel(value)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    return fig


def plot_retention(results: dict, probe: str, floor_key: str = "pixel_probe_accuracy",
                   floor_label: str = "pixel probe (floor)"):
    """Probe accuracy against k for Raptor and the baselines, with the teacher and the floor.

    ``probe``: "teacher_probe" or "own_probe" (which accuracy of the saved retention numbers);
    ``floor_key``: the floor's accuracy in ``results["floor"]``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ks = [int(k) for k in results["by_k"]]
    for kind in ("raptor", "equal_split", "truncated"):
        colour, style = MODEL_STYLES[kind]
        values = [results["by_k"][str(k)]["models"][kind][f"{probe}_accuracy"] for k in ks]
        ax.plot(ks, values, style, color=colour, marker="o", label=kind)
    ax.axhline(results["teacher"]["own_probe_accuracy"], color="k", lw=1, label="teacher")
    ax.axhline(results["floor"][floor_key], color="grey", lw=1, ls="--", label=floor_label)
    ax.set_xticks(ks)
    ax.set_xlabel("k (distinct blocks)")
    ax.set_ylabel(f"test accuracy ({probe.replace('_', ' ')})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_basins(dynamics: dict[str, dict]):
    """Within- and between-class [CLS] angles over depth, and the nearest-class-direction rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for name in ("teacher", "raptor"):
        colour, style = MODEL_STYLES[name]
        basins = dynamics[name]["basins"]
        depths = np.arange(len(basins["within"]))
        axes[0].plot(depths, basins["within"], style, color=colour, marker="o", label=f"{name}: within class")
        axes[0].plot(depths, basins["between"], style, color=colour, marker="s", alpha=0.6,
                     label=f"{name}: between classes")
        axes[1].plot(depths, basins["nearest_class"], style, color=colour, marker="o", label=name)
    axes[0].set_ylabel("[CLS] angle (deg)")
    axes[1].set_ylabel("nearest class direction is own (fraction)")
    return _by_depth(fig, axes, legend_size=6)


def plot_perturbation(dynamics: dict[str, dict]):
    """Angle between perturbed and clean [CLS] from the perturbed depth to the last, per depth perturbed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, name in zip(axes, ("teacher", "raptor"), strict=False):
        for entry in dynamics[name]["perturbation"]:
            depths = np.arange(entry["depth"], entry["depth"] + len(entry["angle"]))
            ax.plot(depths, entry["angle"], marker="o", ms=3, label=f"perturbed at {entry['depth']}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("depth")
        ax.set_yscale("log")
    axes[0].set_ylabel("angle to the clean [CLS] (deg)")
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    return fig
