"""Raptor's dynamics findings judged against null models (issue 40, item 5).

A finding of :func:`rdepth.surrogate.measure.basins.findings` ("self-correction": the perturbed
[CLS] angle shrinks by the last depth) can hold for reasons that have nothing to do with what the
model learned: a residual stream whose norm grows with depth shrinks every angle. So each finding
is reduced to one number per model (:data:`STATISTICS`), measured over >= :data:`MIN_SEEDS` seeds on

* the trained model,
* null models of the same shape: a randomly initialised ViT (``random_init``) and the trained
  layers applied in a shuffled order (``shuffled_depth``),

and the verdict (:func:`judge`) is "reproduced" only where the trained model's mean is beyond every
null's mean, in the claim's direction, by more than the spread over seeds (the larger of the two
ranges, max - min), and the finding's own checks hold on every trained seed. "not reproduced" when
no null is beaten: the null shows the same thing, so it says nothing about training.

Pure functions on the saved dynamics dicts (JSON-ready); torch-free.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from rdepth.errors import RdepthError

REPRODUCED, PARTLY, NOT, UNTESTED = "reproduced", "partly", "not reproduced", "not tested"
MIN_SEEDS = 3
NULLS = ("random_init", "shuffled_depth")


def _basins(d: dict) -> float:
    return d["basins"]["ratio"][-1]


def _self_correction(d: dict) -> float:
    recoveries = [entry["recovery"] for entry in d["perturbation"]]
    return sum(recoveries) / len(recoveries)


def _cls_late(d: dict) -> float:
    first, others = d["angular"]["step_first"], d["angular"]["step_others"]
    late = range(len(first) // 2, len(first))
    return max(first[i] for i in late) - max(others[i] for i in late)


def _coherence(d: dict) -> float:
    others = d["coherence"]["others"]
    return others[-1] - others[len(others) // 2]


def _low_rank(d: dict) -> float:
    ranks = d["update_effective_rank"]
    return ranks[-1] / max(ranks)


# finding (as basins.findings names it) -> (statistic, what it reads, "lower" or "higher" supports the claim)
STATISTICS: dict[str, tuple[Callable[[dict], float], str, str]] = {
    "class-dependent angular basins": (_basins, "within/between class angle at the last depth", "lower"),
    "self-correction under small perturbations": (_self_correction, "mean angle(last)/angle(perturbed) over the "
                                                                    "perturbed depths", "lower"),
    "[CLS] turns sharply late": (_cls_late, "largest late [CLS] turn minus the patches' (deg)", "higher"),
    "patch tokens cohere late toward their mean": (_coherence, "cos(patch, patch mean): last minus mid depth",
                                                   "higher"),
    "low-rank updates late in depth": (_low_rank, "last layer's update effective rank / the largest", "lower"),
}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _range(values: list[float]) -> float:
    return max(values) - min(values)


def compare(trained: list[float], null: list[float], direction: str) -> dict[str, Any]:
    """The trained model's statistic against one null's, over seeds. ``gap``: how far the trained mean is
    beyond the null's in the claim's direction (``direction``: "lower" or "higher" supports the claim);
    ``spread``: the larger range (max - min) over seeds; ``beats``: gap > spread."""
    if direction not in ("lower", "higher"):
        raise ValueError(f"direction must be 'lower' or 'higher', got {direction!r}")
    gap = _mean(null) - _mean(trained) if direction == "lower" else _mean(trained) - _mean(null)
    spread = max(_range(trained), _range(null))
    return {"trained_mean": _mean(trained), "null_mean": _mean(null), "gap": gap, "spread": spread,
            "beats": bool(math.isfinite(gap) and gap > spread)}


def _statistic(finding: str, dynamics: dict, name: str, seed: int) -> float:
    read = STATISTICS[finding][0]
    try:
        return float(read(dynamics))
    except (KeyError, IndexError, ZeroDivisionError, TypeError) as exc:
        raise RdepthError(f"dynamics of '{name}' (seed {seed}) lack what '{finding}' reads ({exc!r}): they come "
                          "from an older rdepth; rerun `rdepth surrogate --teacher vit-fmnist` to recompute them") \
            from None


def judge(trained: list[dict], nulls: dict[str, list[dict]], own: list[list[dict]]) -> list[dict[str, Any]]:
    """Every finding of :data:`STATISTICS` judged against the nulls.

    ``trained``: the trained model's dynamics, one dict per seed; ``nulls``: null name -> its dynamics per seed;
    ``own``: per trained seed, :func:`rdepth.surrogate.measure.basins.findings` rows (the finding's own checks).
    A row per finding: ``statistic`` (what is compared), ``direction``, ``values`` (per model, per seed),
    ``against`` (per null: :func:`compare`), ``own_checks`` (the trained seeds whose own checks all hold) and
    ``verdict``: reproduced when every null is beaten and the own checks hold at every seed; partly when some
    null is beaten; not reproduced when none is; not tested with fewer than MIN_SEEDS seeds anywhere.
    """
    seeds = {"trained": len(trained), **{name: len(runs) for name, runs in nulls.items()}}
    rows = []
    for finding, (_, text, direction) in STATISTICS.items():
        values = {"trained": [_statistic(finding, d, "trained", s) for s, d in enumerate(trained)]}
        for name, runs in nulls.items():
            values[name] = [_statistic(finding, d, name, s) for s, d in enumerate(runs)]
        held = sum(all(row["verdict"] == "reproduced" for row in rows_ if row["finding"] == finding) for rows_ in own)
        row = {"finding": finding, "statistic": text, "direction": direction, "values": values,
               "own_checks": f"{held} of {len(own)} seeds", "seeds": seeds}
        if not nulls or min(seeds.values()) < MIN_SEEDS:
            row.update(against={}, verdict=UNTESTED,
                       why=f"needs >= {MIN_SEEDS} seeds of the trained model and of each null ({seeds})")
            rows.append(row)
            continue
        against = {name: compare(values["trained"], values[name], direction) for name in nulls}
        beaten = [name for name, c in against.items() if c["beats"]]
        if not beaten:
            verdict = NOT
        elif len(beaten) == len(against) and held == len(own) and own:
            verdict = REPRODUCED
        else:
            verdict = PARTLY
        row.update(against=against, verdict=verdict,
                   why="; ".join(f"{name}: trained {c['trained_mean']:.3g} vs {c['null_mean']:.3g}, gap {c['gap']:+.3g} "
                                 f"{'>' if c['beats'] else '<='} spread {c['spread']:.3g}" for name, c in against.items())
                   + f"; own checks hold at {held} of {len(own)} seeds")
        rows.append(row)
    return rows
