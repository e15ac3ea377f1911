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
ranges, max - min) and by at least the finding's minimum effect (:data:`STATISTICS`), and the finding's
own checks hold on every trained seed. The paper reports them of trained ViTs ("We find i) directional
convergence into class-dependent angular basins with self-correcting trajectories under small perturbations, ii)
token-specific dynamics, ... and iii) a collapse to low rank updates in late depth"), so each is a finding about
training only where the trained model is beyond the nulls. "not reproduced" when the random-init null is not beaten: an
untrained network shows the same thing, so it says nothing about training. "partly" when the random-init
null is beaten but not the shuffled-depth one (learned, but not tied to the layers' order) or the own
checks fail at some seed. "not tested" with fewer than :data:`MIN_SEEDS` seeds, when a null of :data:`NULLS`
was not measured (each is required by name: a null that was not run is not a null beaten), or when the own
checks are missing for the finding or given for another number of seeds than measured. The gap is compared
with the spread and the minimum effect within :data:`TOLERANCE` (0.35 - 0.30 is 0.04999999999999999: a gap
equal to the minimum effect meets it).

What the spread is: the "trained" values are one trained network measured on several seeded halves of the
held-out images (and perturbation draws), not several trainings; a null's are several fresh initialisations
or layer orders. So the spread bounds the measurement's noise over data, and says nothing about how much a
second training would differ.

Pure functions on the saved dynamics dicts (JSON-ready); torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rdepth.errors import RdepthError

REPRODUCED, PARTLY, NOT, UNTESTED = "reproduced", "partly", "not reproduced", "not tested"
MIN_SEEDS = 3
NULLS = ("random_init", "shuffled_depth")
SPREAD_IS = ("trained: one trained network measured on seeded halves of the held-out images (not several "
             "trainings); nulls: one fresh initialisation or layer order per seed")


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


# finding (as basins.findings names it) -> (statistic, what it reads, "lower" or "higher" supports the claim,
# the minimum effect: the gap to a null, in the statistic's units, below which no spread makes it a finding).
# The ratios (basins, self-correction, low rank) live in [0, 1]-ish: 0.05 is five points of that range. A
# [CLS] turn of 5 degrees more than the patches' is a turn one can see on the angle plot. A coherence
# change of 0.02 in cosine is about a degree of angle toward the patch mean at cosines near 0.5.
STATISTICS: dict[str, tuple[Callable[[dict], float], str, str, float]] = {
    "class-dependent angular basins": (_basins, "within/between class angle at the last depth", "lower", 0.05),
    "self-correction under small perturbations": (_self_correction, "mean angle(last)/angle(perturbed) over the "
                                                                    "perturbed depths", "lower", 0.05),
    "[CLS] turns sharply late": (_cls_late, "largest late [CLS] turn minus the patches' (deg)", "higher", 5.0),
    "patch tokens cohere late toward their mean": (_coherence, "cos(patch, patch mean): last minus mid depth",
                                                   "higher", 0.02),
    "low-rank updates late in depth": (_low_rank, "last layer's update effective rank / the largest", "lower",
                                       0.05),
}
# The null whose beating makes a finding about training at all (an untrained network of the same shape).
TRAINING_NULL = "random_init"
# Comparisons of a gap against the spread and the minimum effect allow this much float rounding.
TOLERANCE = 1e-9


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _range(values: list[float]) -> float:
    return max(values) - min(values)


def compare(trained: list[float], null: list[float], direction: str, min_effect: float = 0.0) -> dict[str, Any]:
    """The trained model's statistic against one null's, over seeds. ``gap``: how far the trained mean is
    beyond the null's in the claim's direction (``direction``: "lower" or "higher" supports the claim);
    ``spread``: the larger range (max - min) over seeds; ``beats``: gap > spread and gap >= ``min_effect``,
    each within TOLERANCE (a gap that equals the spread does not beat it; one that equals the minimum effect
    meets it, whatever the rounding of the means)."""
    if direction not in ("lower", "higher"):
        raise ValueError(f"direction must be 'lower' or 'higher', got {direction!r}")
    gap = _mean(null) - _mean(trained) if direction == "lower" else _mean(trained) - _mean(null)
    spread = max(_range(trained), _range(null))
    return {"trained_mean": _mean(trained), "null_mean": _mean(null), "gap": gap, "spread": spread,
            "min_effect": min_effect,
            "beats": bool(math.isfinite(gap) and gap > spread + TOLERANCE and gap >= min_effect - TOLERANCE)}


def _statistic(finding: str, dynamics: dict, name: str, seed: int) -> float:
    read = STATISTICS[finding][0]
    try:
        return float(read(dynamics))
    except (KeyError, IndexError, ZeroDivisionError, TypeError) as exc:
        raise RdepthError(f"dynamics of '{name}' (seed {seed}) lack what '{finding}' reads ({exc!r}): they come "
                          "from an older rdepth; rerun `rdepth surrogate --teacher vit-fmnist` to recompute them") \
            from None


def _own_held(finding: str, own: list[list[dict]]) -> int | None:
    """The trained seeds whose own checks for ``finding`` all hold; None when some seed lacks them."""
    held = 0
    for rows in own:
        mine = [row for row in rows if row["finding"] == finding]
        if not mine:
            return None
        held += all(row["verdict"] == "reproduced" for row in mine)
    return held


def _verdict(against: dict[str, dict[str, Any]], held: int, seeds: int) -> str:
    """Beating the random-init null makes it a finding about training; beating every null of NULLS, with the own
    checks at every seed, reproduces it (``against`` holds every null of NULLS: :func:`judge` says "not tested"
    before this when one is missing)."""
    if not against[TRAINING_NULL]["beats"]:
        return NOT
    return REPRODUCED if all(c["beats"] for c in against.values()) and held == seeds else PARTLY


def judge(trained: list[dict], nulls: dict[str, list[dict]], own: list[list[dict]]) -> list[dict[str, Any]]:
    """Every finding of :data:`STATISTICS` judged against the nulls.

    ``trained``: the trained model's dynamics, one dict per seed; ``nulls``: null name -> its dynamics per seed;
    ``own``: per trained seed, :func:`rdepth.surrogate.measure.basins.findings` rows (the finding's own checks).
    A row per finding: ``statistic`` (what is compared), ``direction``, ``values`` (per model, per seed),
    ``against`` (per null: :func:`compare` with the finding's minimum effect), ``own_checks`` (the trained seeds
    whose own checks all hold) and ``verdict``: reproduced when every null is beaten and the own checks hold at
    every seed; not reproduced when the random-init null is not beaten; partly otherwise; not tested with fewer
    than MIN_SEEDS seeds anywhere, a null of NULLS not measured (named in ``why``), or own checks missing for the
    finding or given for another number of seeds than the trained model was measured on. ``spread_is``: what the
    spread measures (see the module docstring).
    """
    seeds = {"trained": len(trained), **{name: len(runs) for name, runs in nulls.items()}}
    rows = []
    for finding, (_, text, direction, min_effect) in STATISTICS.items():
        values = {"trained": [_statistic(finding, d, "trained", s) for s, d in enumerate(trained)]}
        for name, runs in nulls.items():
            values[name] = [_statistic(finding, d, name, s) for s, d in enumerate(runs)]
        held = _own_held(finding, own) if len(own) == len(trained) else None
        row = {"finding": finding, "statistic": text, "direction": direction, "min_effect": min_effect,
               "values": values, "seeds": seeds, "spread_is": SPREAD_IS,
               "own_checks": "missing" if held is None else f"{held} of {len(own)} seeds"}
        missing = [name for name in NULLS if name not in nulls]
        if missing:
            row.update(against={}, verdict=UNTESTED,
                       why=f"the {', '.join(missing)} null{'s were' if len(missing) > 1 else ' was'} not measured: "
                           f"each of {', '.join(NULLS)} is needed (a null not run is not a null beaten)")
            rows.append(row)
            continue
        if min(seeds.values()) < MIN_SEEDS:
            row.update(against={}, verdict=UNTESTED,
                       why=f"needs >= {MIN_SEEDS} seeds of the trained model and of each null ({seeds})")
            rows.append(row)
            continue
        if held is None:
            row.update(against={}, verdict=UNTESTED,
                       why=f"the finding's own checks are missing (given for {len(own)} seeds, "
                           f"{len(trained)} measured, or without this finding)")
            rows.append(row)
            continue
        against = {name: compare(values["trained"], values[name], direction, min_effect) for name in nulls}
        row.update(against=against, verdict=_verdict(against, held, len(own)),
                   why="; ".join(f"{name}: trained {c['trained_mean']:.3g} vs {c['null_mean']:.3g}, "
                                 f"gap {c['gap']:+.3g} "
                                 f"{'beats' if c['beats'] else 'does not beat'} spread {c['spread']:.3g} and minimum "
                                 f"effect {min_effect:g}" for name, c in against.items())
                   + f"; own checks hold at {held} of {len(own)} seeds")
        rows.append(row)
    return rows
