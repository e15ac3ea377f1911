"""Does depth track difficulty? Executed loop steps against the hops each answer token needs.

On task data every answer token needs a known number of sequential lookups
(hops, :mod:`rdepth.tasks.hops`). For each answer token the task sweep records
the loop steps each exit-policy setting executed (summed over groups) and
whether the greedy prediction at each fixed budget 1..K is right. From these:

- **per-token oracle** steps: the fewest steps of a fixed budget ``k`` such that the
  token's greedy prediction is right at ``k`` *and at every larger budget up to the cap
  K* (the sweep's full budget). A token wrong at the cap has no oracle step (NaN; it is
  counted as ``undefined`` and left out of the oracle's numbers);
- **Spearman's rank correlation** between executed steps and hops on answer tokens
  (ties take their average rank; NaN when either side is constant), per setting and for
  the oracle, over every swept difficulty pooled and per difficulty;
- **mean steps per hop count**, per setting and for the oracle.

Plain numpy on arrays; nothing here reads or draws (torch-free, like :mod:`rdepth.sweep.stats`).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdepth.errors import RdepthError
from rdepth.report.figures import FIGURES_DIR

DEPTH_CSV = "depth_vs_hops.csv"
DEPTH_FIGURE = "depth_vs_hops"  # figures/depth_vs_hops.png beside task_sweep.json (sweep.task_report draws it)
CSV_FIELDS = ("label", "policy", "parameter", "value", "hops", "tokens", "mean_steps", "spearman")


def average_ranks(values) -> np.ndarray:
    """float64 [N]: the 1-based ranks of ``values`` [N], tied values sharing the mean of their ranks."""
    values = np.asarray(values)
    if values.ndim != 1:
        raise RdepthError(f"ranks: expected one dimension, got shape {values.shape}")
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])  # first index of each run of ties
    bounds = np.r_[starts, values.size]
    run_of = np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]]) - 1  # [N] run index in sorted order
    mean_rank = (bounds[:-1] + bounds[1:] + 1) / 2.0  # ranks start..end-1 (0-based) -> mean of 1-based
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = mean_rank[run_of]
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (both [N]): Pearson's correlation of their average
    ranks; NaN for fewer than two points or when either is constant (no order to agree with)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise RdepthError(f"spearman: x {x.shape} and y {y.shape} must be one [N] shape")
    if x.size < 2:
        return float("nan")
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    scale = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum() / scale) if scale > 0 else float("nan")


def oracle_steps(right, budget_steps) -> np.ndarray:
    """float64 [N]: per token the oracle's steps (module docstring), NaN where wrong at the cap.

    right: bool [K, N], whether the greedy prediction is right at fixed budget k (rows in increasing
    budget order, the last the cap); budget_steps: [K] loop steps each budget executes (summed over groups).
    """
    right = np.asarray(right, dtype=bool)
    budget_steps = np.asarray(budget_steps, dtype=np.float64)
    if right.ndim != 2 or budget_steps.shape != (right.shape[0],) or right.shape[0] == 0:
        raise RdepthError(f"oracle: right {right.shape} must be [budgets, tokens] with one step count per budget "
                          f"({budget_steps.shape})")
    if np.any(np.diff(budget_steps) <= 0):
        raise RdepthError("oracle: the budgets must increase")
    stays_right = np.logical_and.accumulate(right[::-1], axis=0)[::-1]  # right at k and every larger budget
    first = stays_right.argmax(axis=0)  # the first budget from which it stays right
    steps = budget_steps[first]
    steps[~stays_right[-1]] = np.nan  # wrong at the cap: no budget makes it right
    return steps


def steps_by_hops(steps, hops) -> tuple[list[int], list[float], list[int]]:
    """(hop counts present, mean steps at each, tokens at each), NaN steps left out."""
    steps, hops = np.asarray(steps, dtype=np.float64), np.asarray(hops)
    kept = ~np.isnan(steps)
    counts, means, tokens = [], [], []
    for hop in np.unique(hops[kept]).tolist():
        chosen = kept & (hops == hop)
        counts.append(int(hop))
        means.append(float(steps[chosen].mean()))
        tokens.append(int(chosen.sum()))
    return counts, means, tokens


def _measure(steps: np.ndarray, hops: np.ndarray, difficulty: np.ndarray) -> dict[str, Any]:
    kept = ~np.isnan(steps)
    counts, means, tokens = steps_by_hops(steps, hops)
    return {
        "tokens": int(kept.sum()),
        "mean_steps": float(steps[kept].mean()) if kept.any() else float("nan"),
        "spearman": spearman(steps[kept], hops[kept]),
        "spearman_by_difficulty": {str(d): spearman(steps[kept & (difficulty == d)], hops[kept & (difficulty == d)])
                                   for d in np.unique(difficulty).tolist()},
        "hops": counts, "mean_steps_by_hops": means, "tokens_by_hops": tokens,
    }


def depth_vs_hops(hops, difficulty, settings: Sequence[dict], oracle) -> dict[str, Any]:
    """The measure on answer tokens pooled over held-out sets.

    hops, difficulty: int [N] per answer token (its hops and its held-out set's difficulty);
    settings: dicts with ``label`` (and ``policy``, ``parameter``, ``value`` where a policy) and
    ``steps`` float [N], the loop steps the setting executed per token; oracle: float [N]
    (:func:`oracle_steps`, NaN where undefined). Returns the saved block: ``tokens``, ``settings``
    (each with :func:`_measure`'s numbers and ``spearman_oracle_tokens``, its rho on the tokens the oracle
    defines) and ``oracle`` (the same plus ``undefined``: tokens wrong at the cap).
    """
    hops, difficulty = np.asarray(hops), np.asarray(difficulty)
    oracle = np.asarray(oracle, dtype=np.float64)
    if not hops.shape == difficulty.shape == oracle.shape:
        raise RdepthError(f"depth: hops {hops.shape}, difficulty {difficulty.shape} and oracle {oracle.shape} differ")
    defined = ~np.isnan(oracle)
    rows = []
    for setting in settings:
        steps = np.asarray(setting["steps"], dtype=np.float64)
        if steps.shape != hops.shape:
            raise RdepthError(f"depth: {setting['label']} has {steps.shape} steps for {hops.shape} tokens")
        rows.append({**{k: v for k, v in setting.items() if k != "steps"}, **_measure(steps, hops, difficulty),
                     # on the oracle's tokens only (right at the cap): the same token set as the oracle's rho
                     "spearman_oracle_tokens": spearman(steps[defined], hops[defined])})
    return {"tokens": int(hops.size), "settings": rows,
            "oracle": {"label": "oracle", **_measure(oracle, hops, difficulty),
                       "undefined": int(np.isnan(oracle).sum())}}


def depth_csv(depth: dict) -> str:
    """``depth_vs_hops.csv``: one row per setting (the oracle last) and hop count."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in depth["settings"] + [depth["oracle"]]:
        for hop, mean, tokens in zip(row["hops"], row["mean_steps_by_hops"], row["tokens_by_hops"], strict=False):
            writer.writerow({"label": row["label"], "policy": row.get("policy", ""),
                             "parameter": row.get("parameter", ""), "value": row.get("value", ""), "hops": hop,
                             "tokens": tokens, "mean_steps": f"{mean:.6g}",
                             "spearman": "" if math.isnan(row["spearman"]) else f"{row['spearman']:.6g}"})
    return buffer.getvalue()


def depth_summary(result: dict, summary: dict) -> dict[str, Any]:
    """The headline of ``result["depth"]``: the oracle's correlation, the best setting's and, per policy, the
    setting its figure line shows. Settings are compared on accuracy and loop steps per token averaged over
    the swept difficulties, as :func:`rdepth.sweep.task.summarize_task_sweep` compares them on one: the best
    is the setting with the fewest steps within the tolerance of the full budget's accuracy (on one
    difficulty, the summary's best); a policy shows its own such setting, else its most accurate one."""
    depth = result["depth"]
    measured: dict[str, dict[str, list[float]]] = {}
    for block in result["difficulties"]:
        for entry in block["fixed"] + block["points"]:
            seen = measured.setdefault(entry["label"], {"accuracy": [], "steps": []})
            seen["accuracy"].append(entry["accuracy"])
            seen["steps"].append(entry["steps"])
    floor = float(np.mean(measured[result["difficulties"][0]["fixed"][-1]["label"]]["accuracy"])) - summary["tolerance"]
    best, shown = None, {}
    for row in depth["settings"]:
        if row["label"] not in measured:
            continue
        candidate = {"label": row["label"], "accuracy": float(np.mean(measured[row["label"]]["accuracy"])),
                     "steps": float(np.mean(measured[row["label"]]["steps"])), "spearman": row["spearman"]}
        policy = row.get("policy", row["label"])
        if policy not in shown or _preferred(candidate, shown[policy], floor):
            shown[policy] = candidate
        if candidate["accuracy"] >= floor - 1e-12 and (best is None or _preferred(candidate, best, floor)):
            best = candidate
    oracle = depth["oracle"]
    return {"oracle_spearman": oracle["spearman"], "oracle_undefined": oracle["undefined"], "tokens": depth["tokens"],
            "difficulties": [block["difficulty"] for block in result["difficulties"]], "best": best, "shown": shown,
            "figure": f"{FIGURES_DIR}/{DEPTH_FIGURE}.png"}


def _preferred(candidate: dict, current: dict, floor: float) -> bool:
    """Whether ``candidate`` beats ``current``: within the accuracy ``floor`` beats below it; within it,
    fewer steps (then higher accuracy); below it, higher accuracy (then fewer steps)."""
    matched = candidate["accuracy"] >= floor - 1e-12
    if matched != (current["accuracy"] >= floor - 1e-12):
        return matched
    if matched:
        return (candidate["steps"], -candidate["accuracy"]) < (current["steps"], -current["accuracy"])
    return (candidate["accuracy"], -candidate["steps"]) > (current["accuracy"], -current["steps"])
