"""The saved format of a loop-geometry analysis, and its headline numbers.

Layout under ``OUT``::

    geometry/summary.json               settings, per checkpoint and budget: per-group
                                        step curves (mean/std), convergence and headline
                                        numbers, DLR stats per boundary and definition,
                                        validation loss
    geometry/<checkpoint>/<budget>.npz  per-token arrays (:mod:`rdepth.geometry.arrays`)
    geometry/slowest_tokens.json        tokens that need the longest loops

Everything a report page, a figure, the CLI or a benchmark shows is computed
here, once, when the analysis runs, and saved; readers never recompute. The
headline numbers of a group at one budget (``group["headline"]``):

* ``noise_floor_step``: first update index k >= 1 whose mean step size is under the noise floor, the larger
  of two: ``NOISE_FLOORS`` by the analysis precision (``NOISE_FLOOR`` when unknown) times the first
  refinement step ||Delta^(1)|| (the loop's own scale: shifting or rescaling every state changes nothing),
  and ``ROUNDING_MULTIPLE`` x the precision's epsilon x the mean state norm ||x^(k)|| (the rounding a
  difference of two states carries: :func:`rounding_floors`); None if never;
* ``decayed_step``: first k >= 2 with mean ||Delta^(k)|| <= ``DECAYED_FRACTION`` x ||Delta^(1)||
  (:func:`decayed_step`), None if never;
* ``settled_cosine``: mean of the last ``SETTLED_STEPS`` consecutive-step cosines j, after the step-size
  decay (j >= ``decayed_step``; when the mean steps never decay, j >= ``SETTLED_AFTER``; cos(Delta^(0),
  Delta^(1)), from the random start, never counts), whose steps are still above the noise floor; None when
  fewer than ``SETTLED_STEPS`` qualify (nothing to read), or ("no plateau") they spread over more than
  ``SETTLED_RANGE`` or trend by more than ``SETTLED_SLOPE`` a step beyond ``TREND_T`` standard errors;
  ``settled_cosine_window``: how many qualify, which it averages, their range and slope and,
  when there is no plateau, why; ``settled_cosine_std``: the
  mean over the same steps of the cosine's standard deviation over tokens (its spread);
* ``plateau``: whether step sizes level off at a nonzero value over the last
  ``PLATEAU_WINDOW`` steps (:func:`plateau`);
* ``first_step_size`` / ``second_step_size``: ||Delta^(0)||, ||Delta^(1)||;
* ``decay_5_over_0``, ``decay_10_over_0``, ``decay_10_over_1``: step-size decay
  ratios ||Delta^(k)|| / ||Delta^(j)|| (None when the loop is too short);
* ``last_effective_rank``: effective rank of the last update (when measured).

Summary-level: ``scale_budget`` (the budget the loop-scale numbers come from)
and ``headline_definitions`` (the constants above).

DLR (``budget["dlr"][boundary][definition]``: mean, std, median, p10, p90 over tokens)
is saved under every definition of :data:`rdepth.geometry.metrics.DLR_DEFINITIONS`,
described in ``dlr_definitions`` and labelled in ``dlr_labels``. Two denominators:
``<numerator>`` divides by Eq. 2's mean over all K_g steps of the earlier group, which
includes the jump Delta^(0) from the random initial state and so is dominated by it;
``<numerator>_refine`` divides by the mean over its refinement steps k >= 1 only.
``"literal"`` is Eq. 2 as written; ``dlr_default`` ("first") and ``dlr_default_refine``
("first_refine") are the two the report leads with. Beside them, ``"handoff"``
(:func:`rdepth.geometry.metrics.handoff_ratio`, the hand-off states' distance over the earlier
group's extent after its first computed iterate: free of K and of x^(0)), which claim 3 is judged
on, and ``"handoff_control"``: its reading on synthetic loops with the same dynamics and no drift.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from rdepth.errors import RdepthError
from rdepth.geometry.metrics import DEFAULT_DLR, DLR_DEFINITIONS, HANDOFF
from rdepth.geometry.stream import STEP_METRICS, StreamResult
from rdepth.io import environment_info, write_json

GEOMETRY_DIR = "geometry"
SUMMARY_FILE = "summary.json"
SLOWEST_FILE = "slowest_tokens.json"
# 1: the first release. 2: headline numbers saved (group "headline", "scale_budget",
# "headline_definitions"); loop-state noise keyed per held-out window, as ``rdepth eval``.
# 3: DLR under both denominators (``<numerator>`` and ``<numerator>_refine``), "dlr_labels",
# "dlr_default_refine"; DLR statistics over defined values only (null when none is).
# 4: noise floor 1e-3 relative, exact cosines (no additive epsilon), "precision" in the settings,
# plateau and settled-cosine spread in the headline, the DLR loop-budget curve ("dlr_curve") and
# the own-state Jacobian spectrum per checkpoint ("jacobian").
# 5: the hand-off ratio per boundary ("handoff", metrics.handoff_ratio) with its zero-drift control
# ("handoff_control"); the settled cosine leaves out cos(Delta^(0), Delta^(1)), needs SETTLED_STEPS cosines
# above the floor that stay within SETTLED_RANGE ("settled_cosine_window"), else it is None (no plateau).
# 6: the noise floor relative to the first refinement step ||Delta^(1)|| (not to ||x||); the settled window
# after the step-size decay ("decayed_step") and without a trend (SETTLED_SLOPE), with its "reason";
# the plateau's last step over ||Delta^(1)|| ("last_over_step1"); the hand-off control per token
# ("handoff_control": median, share of tokens clear of it, dynamics).
# 7 (issue 67): the noise floor also above ROUNDING_MULTIPLE x the precision's epsilon x the state norm (the
# "state_norm" curve, the budget's "noise_floor"); the settled window without a decay from SETTLED_AFTER, its
# trend judged against its standard error; the hand-off control with each token's own contraction and turning.
FORMAT_VERSION = 7
HANDOFF_CONTROL = "handoff_control"

DLR_NUMERATOR_TEXT = {
    "literal": "||x_{g+1}^(0) - x_g^(K_g)||, x^(0) the next group's random initial state",
    "first": "||x_{g+1}^(1) - x_g^(K_g)||, the next group's first computed iterate (real drift)",
    "output": "||x_{g+1}^(K_{g+1}) - x_g^(K_g)||, the two groups' hand-off states (output drift)",
}
DLR_DENOMINATOR_TEXT = {
    "all": "(1/K_g) sum_{k=0}^{K_g-1} ||Delta_g^(k)||, the mean over all K_g steps of group g, "
           "including Delta_g^(0) = x_g^(1) - x_g^(0), the jump from the random initial state (Eq. 2's denominator)",
    "refine": "(1/(K_g-1)) sum_{k=1}^{K_g-1} ||Delta_g^(k)||, the mean over group g's refinement steps only, "
              "leaving out the jump Delta_g^(0) from the random initial state (undefined, saved as null, when K_g = 1)",
}
# What each DLR definition divides by what (saved in summary.json and shown on the report page).
DLR_DESCRIPTIONS = {
    name: ("paper Eq. 2 as written: " if name == "literal" else "")
    + f"{DLR_NUMERATOR_TEXT[numerator]} divided by {DLR_DENOMINATOR_TEXT[denominator]}"
    for name, (numerator, denominator) in DLR_DEFINITIONS.items()
}
DLR_DESCRIPTIONS[HANDOFF] = ("||x_{g+1}^(K_{g+1}) - x_g^(K_g)||, the two groups' hand-off states, divided by "
                             "max_{1<=k<=K_g} ||x_g^(k) - x_g^(1)||, group g's extent after its first computed "
                             "iterate (free of the loop budget once the loops settle, and of the random start x^(0)); "
                             "claim 3 is judged on it, beside its zero-drift control")
# Short labels for table columns and figure legends: numerator iterate, then the steps averaged.
DLR_NUMERATOR_LABEL = {"literal": "x(0)", "first": "x(1)", "output": "x(K)"}
DLR_DENOMINATOR_LABEL = {"all": "mean |Δ(k)|, k≥0", "refine": "mean |Δ(k)|, k≥1"}
DLR_LABELS = {
    name: f"{DLR_NUMERATOR_LABEL[numerator]} ÷ {DLR_DENOMINATOR_LABEL[denominator]}"
    + (" (Eq. 2)" if name == "literal" else "")
    for name, (numerator, denominator) in DLR_DEFINITIONS.items()
}
DLR_LABELS[HANDOFF] = "x(K) hand-off ÷ group extent after x(1)"
# The refinement-step variant of the default definition (same numerator, k >= 1 denominator).
DEFAULT_DLR_REFINE = f"{DEFAULT_DLR}_refine"

SETTLED_STEPS = 5
# The settled cosine is a plateau: its SETTLED_STEPS cosines stay within this range of each other ...
SETTLED_RANGE = 0.2
# ... and do not trend: the least-squares slope over the window is at most this per loop step in size (a
# cosine moving 0.01 a step moves 0.04 over the five-cosine window, about a quarter of the paper's band
# 0.5-0.65; a cosine falling 0.04 a step stays within SETTLED_RANGE over five steps yet never settles) ...
SETTLED_SLOPE = 0.01
# ... unless the slope is within this many of its standard errors (least squares, SETTLED_STEPS - 2 = 3 degrees
# of freedom: 3.18 is the two-sided 95% t quantile). A zero-mean wobble inside the band fits a slope whose size
# depends on where the five-cosine window falls (0.2 x its amplitude for a period of 4 steps), with residuals
# as large: noise, not a trend. A cosine falling in a straight line fits with no residual and stays a trend.
TREND_T = 3.18
# When the mean step never falls to DECAYED_FRACTION of ||Delta^(1)|| (steps that level off and keep turning,
# the paper's section-4 regime, or tokens contracting at different rates), the window starts no earlier than this
# loop step, where the paper's own account ("typically within 5-10 steps") has the transient over; a budget too
# short for five cosines there leaves the settled cosine unread ("no decay": not measured, never a verdict).
SETTLED_AFTER = 10
# Comparisons of saved floats against these bounds allow this much (0.65 - 0.45 is 0.2000000000000001).
TOLERANCE = 1e-9
# The settled window lies after the step-size decay: from the first step k >= 2 whose mean step size is at
# most this share of the first refinement step ||Delta^(1)|| (claim 1's "decay", Fig. 3a).
DECAYED_FRACTION = 0.1
# Steps whose mean size is under this share of the first refinement step ||Delta^(1)|| are at the noise
# floor and left out of the settled cosine. The floor is relative to the loop's own scale, not to ||x||:
# shifting every state by one vector (the same geometry) must not move it. In float32 the rounding noise
# of a difference of two states is ~1e-7 of the state per coordinate; ``rdepth analyze`` runs in float64
# by default (``precision``), where rounding is ~1e-16 of the state, so a step 1,000x smaller than the
# loop's first refinement is where the loop, not the arithmetic, has stopped saying anything.
NOISE_FLOOR = 1e-3
# ... by the precision the analysis ran the model in. In float64 a difference of two states carries rounding
# of ~1e-16 of the state: a step of 1e-6 of ||Delta^(1)|| keeps its direction to ~1e-5 while the loop's first
# refinement moves at least 1e-4 of the state, so below it the loop, not the arithmetic, has gone quiet (a floor
# of 1e-3 there threw away cosines that were plainly measured, and a measured "no" read as "not tested").
# Issue 67: the float32 floor of 1e-3 dropped steps 40-100x above float32's rounding, so one trajectory read
# differently in float32 and float64; the precision now enters through the rounding term below, and the
# loop-relative floor is the same in both.
NOISE_FLOORS = {"float64": 1e-6, "float32": 1e-6}
# ... and never under this many times the precision's epsilon times the state's norm (mean ||x^(k)|| over tokens):
# a step is the difference of two states each rounded to ~eps ||x||, and a width-d layer accumulates about
# sqrt(d) roundings (28 at d = 768), so a step 32 times eps ||x|| keeps its size and direction; the float32
# floor of 1e-3 ||Delta^(1)|| sat 40-100x above eps ||x|| on the runs.
ROUNDING_MULTIPLE = 32.0
# The plateau test: over the last PLATEAU_WINDOW steps of the long budget the mean step size
# shrinks by less than PLATEAU_MAX_DECAY (last / first of the window >= 1 / PLATEAU_MAX_DECAY) and
# stays above the noise floor (the larger of NOISE_FLOORS x ||Delta^(1)|| and the rounding term): the paper's
# "norms plateau at a small nonzero value due to rotation". A loop contracting 2x per step shrinks ~1,000x over
# the window.
PLATEAU_WINDOW = 10
PLATEAU_MAX_DECAY = 2.0
# Claim 3's control: a hand-off ratio counts as drift only where it is at least this many times what the same
# loops would read with no drift (:func:`handoff_control`).
CONTROL_MARGIN = 2.0


# ------------------------------------------------------------------ headline numbers


def rounding_floors(group: dict[str, Any], eps: float) -> list[float] | None:
    """Per update index k, ROUNDING_MULTIPLE x ``eps`` x the mean state norm ||x^(k)|| (the group's saved
    ``state_norm`` curve); None when ``eps`` is 0 (unknown) or the curve is not saved."""
    norms = (group.get("state_norm") or {}).get("mean")
    if not eps or not norms:
        return None
    return [ROUNDING_MULTIPLE * eps * float(norm) for norm in norms]


def _floor_at(step_means: list[float], k: int, floor: float, rounding: list[float] | None) -> float:
    """The noise floor of update k: ``floor`` x ||Delta^(1)||, or the rounding term when larger."""
    relative = floor * step_means[1]
    if rounding is None or k >= len(rounding):
        return relative
    return max(relative, rounding[k])


def noise_floor_step(step_means: list[float], floor: float = NOISE_FLOOR,
                     rounding: list[float] | None = None) -> int | None:
    """First update index k >= 1 whose mean step size is under the noise floor: ``floor`` x the first refinement
    step ||Delta^(1)||, or ``rounding[k]`` when larger (:func:`rounding_floors`). 1 when that step is zero or
    itself under the rounding term; None: never, or a loop of one step."""
    if len(step_means) < 2:
        return None
    if not step_means[1] > 0 or (rounding is not None and len(rounding) > 1 and step_means[1] < rounding[1]):
        return 1
    return next((k for k in range(2, len(step_means)) if step_means[k] < _floor_at(step_means, k, floor, rounding)),
                None)


def decayed_step(step_means: list[float]) -> int | None:
    """First loop step k >= 2 whose mean step size is at most DECAYED_FRACTION x ||Delta^(1)|| (None: never).
    Step 0 is the jump from the random initial state, so the decay is measured from step 1."""
    if len(step_means) < 3 or not step_means[1] > 0:
        return None
    return next((k for k in range(2, len(step_means)) if step_means[k] <= DECAYED_FRACTION * step_means[1]), None)


def _slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index (per step)."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum((x - mean_x) ** 2 for x in range(n))


def _slope_error(values: list[float], slope: float) -> float:
    """The least-squares slope's standard error: sqrt(residual sum of squares / (n - 2) / sum (x - mean x)^2)."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in enumerate(values))
    return math.sqrt(residual / (n - 2) / sum((x - mean_x) ** 2 for x in range(n)))


def is_trend(values: list[float]) -> bool:
    """A trend: the least-squares slope is above SETTLED_SLOPE a step in size and above TREND_T standard errors
    (a wobble that fits a slope as large as its residuals is noise)."""
    slope = _slope(values)
    return abs(slope) > SETTLED_SLOPE + TOLERANCE and abs(slope) > TREND_T * _slope_error(values, slope)


def settled_window(cosine_means: list[float], floor: int | None, decayed: int | None = 1) -> dict[str, Any]:
    """Where the settled cosine is read: the last SETTLED_STEPS cosines j >= max(1, ``decayed``) whose two steps
    are above the noise floor.

    Cosine j compares updates j and j+1; j = 0 (cos(Delta^(0), Delta^(1))) is left out, since Delta^(0) is the
    jump from the random initial state, and so are the cosines before the step-size decay (``decayed``:
    :func:`decayed_step`; None when the mean steps never decay: then the window starts at SETTLED_AFTER, where
    the paper has the transient over). Cosine j counts while update j+1 is above the floor (``floor``:
    :func:`noise_floor_step`). Returns ``usable`` (how many cosines qualify), ``window`` ([first, last] cosine
    index averaged, or None), ``range`` and ``slope`` (per step) over the window, ``plateau`` (True when at least
    SETTLED_STEPS cosines qualify, stay within SETTLED_RANGE of each other and show no trend, :func:`is_trend`)
    and ``reason`` when there is no plateau: "too few" (the floor comes first) or "no decay" (the steps never
    decay and the budget ends before SETTLED_AFTER + SETTLED_STEPS): nothing to read; "range" or "trend": read,
    and not settled.
    """
    end = len(cosine_means) if floor is None else min(max(floor - 1, 0), len(cosine_means))
    usable = list(range(max(1, SETTLED_AFTER if decayed is None else decayed), end))
    if len(usable) < SETTLED_STEPS:
        return {"usable": len(usable), "window": None, "plateau": False, "range": None, "slope": None,
                "reason": "no decay" if decayed is None else "too few"}
    window = usable[-SETTLED_STEPS:]
    values = [cosine_means[j] for j in window]
    spread, slope = max(values) - min(values), _slope(values)
    reason = ("range" if spread > SETTLED_RANGE + TOLERANCE else "trend" if is_trend(values) else None)
    return {"usable": len(usable), "window": [window[0], window[-1]], "plateau": reason is None, "range": spread,
            "slope": slope, "reason": reason}


def settled_cosine(cosine_means: list[float], floor: int | None, decayed: int | None = 1) -> float | None:
    """Mean of the cosines over :func:`settled_window`'s window; None ("no plateau") when it has none."""
    where = settled_window(cosine_means, floor, decayed)
    if not where["plateau"]:
        return None
    first, last = where["window"]
    return float(np.mean(cosine_means[first:last + 1]))


def settled_spread(cosine_stds: list[float], cosine_means: list[float], floor: int | None,
                   decayed: int | None = 1) -> float | None:
    """The mean token-level standard deviation of the cosines :func:`settled_cosine` averages."""
    where = settled_window(cosine_means, floor, decayed)
    if not where["plateau"]:
        return None
    first, last = where["window"]
    return float(np.mean(cosine_stds[first:last + 1]))


def plateau(sizes: list[float], floor: float = NOISE_FLOOR, rounding: list[float] | None = None
            ) -> dict[str, Any] | None:
    """Do the mean step sizes level off at a nonzero value? None when the loop is shorter than the window.

    ``ratio`` = sizes[-1] / sizes[-1 - PLATEAU_WINDOW] (1: flat; 1e-3: still contracting);
    ``last_over_step1`` = sizes[-1] / sizes[1]; ``holds`` when ratio >= 1 / PLATEAU_MAX_DECAY and the last
    step is above the noise floor: at least ``floor`` x the first refinement step and ``rounding[-1]``
    (:func:`rounding_floors`) when given.
    """
    if len(sizes) <= PLATEAU_WINDOW or len(sizes) < 2:
        return None
    first, last = sizes[-1 - PLATEAU_WINDOW], sizes[-1]
    ratio = last / first if first > 0 else None
    over_step1 = last / sizes[1] if sizes[1] > 0 else None
    above = over_step1 is not None and over_step1 >= floor and (rounding is None or last >= rounding[min(len(sizes), len(rounding)) - 1])
    holds = ratio is not None and ratio >= 1.0 / PLATEAU_MAX_DECAY and above
    return {"ratio": ratio, "last_over_step1": over_step1, "window": PLATEAU_WINDOW, "holds": bool(holds)}


def step_ratio(sizes: list[float], k: int, base: int) -> float | None:
    """||Delta^(k)|| / ||Delta^(base)|| from mean step sizes (None if too short or a zero base)."""
    if len(sizes) <= k or sizes[base] == 0:
        return None
    return sizes[k] / sizes[base]


def group_headline(group: dict[str, Any], noise_floor: float = NOISE_FLOOR, eps: float = 0.0) -> dict[str, Any]:
    """The headline numbers of one group's saved curves (see the module docstring), at this noise floor
    (relative to ||Delta^(1)||) and, with ``eps`` (the states' machine epsilon), above its rounding term."""
    sizes = group["step_size"]["mean"]
    rounding = rounding_floors(group, eps)
    floor = noise_floor_step(sizes, noise_floor, rounding)
    decayed = decayed_step(sizes)
    ranks = group.get("effective_rank") or []
    return {
        "first_step_size": sizes[0] if sizes else None,
        "second_step_size": sizes[1] if len(sizes) > 1 else None,
        "decay_5_over_0": step_ratio(sizes, 5, 0),
        "decay_10_over_0": step_ratio(sizes, 10, 0),
        "decay_10_over_1": step_ratio(sizes, 10, 1),
        "noise_floor_step": floor,
        "decayed_step": decayed,
        "settled_cosine": settled_cosine(group["cosine"]["mean"], floor, decayed),
        "settled_cosine_std": settled_spread(group["cosine"]["std"], group["cosine"]["mean"], floor, decayed),
        "settled_cosine_window": settled_window(group["cosine"]["mean"], floor, decayed),
        "plateau": plateau(sizes, noise_floor, rounding),
        "last_effective_rank": ranks[-1] if ranks else None,
    }


def scale_budget(budgets: dict[str, Any]) -> str:
    """The budget the loop-scale numbers come from: "long" when measured (language models), else "train"."""
    return "long" if "long" in budgets else "train"


# ------------------------------------------------------------------ one budget


def _stats(values: np.ndarray) -> dict[str, float | None]:
    """Mean, std, median, 10th/90th percentile over the finite values (all None when there are none,
    e.g. a "_refine" DLR after a one-step group); "defined" is the fraction of finite values."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {"mean": None, "std": None, "median": None, "p10": None, "p90": None, "defined": 0.0}
    return {
        "mean": float(finite.mean()), "std": float(finite.std()), "median": float(np.median(finite)),
        "p10": float(np.quantile(finite, 0.1)), "p90": float(np.quantile(finite, 0.9)),
        "defined": float(finite.size / values.size),
    }


def handoff_control(previous: dict[str, Any], following: dict[str, Any], parts: dict[str, np.ndarray] | None,
                    handoff: np.ndarray | None) -> dict[str, Any]:
    """The zero-drift control of the hand-off ratio at a boundary, per token.

    With no drift both groups settle at one point p, so the hand-off states are at most the two groups'
    distances left to p apart. In a linear loop x^(k+1) - p = r R(theta) (x^(k) - p) that distance is
    r ||Delta^(K-1)|| / |r e^(i theta) - 1|, read from each token's own last step. The contraction r and turning
    theta are each token's own (its last step over the one before, and the cosine between them: ``before_*`` and
    ``turn_*`` in ``parts``), never less than the group's (read off its saved mean curves, refinement steps above
    the noise floor: :func:`rdepth.geometry.synthetic.dynamics_from_curves`): when tokens contract at different
    rates, the mean curve follows the few with the largest steps, and a group factor read off it understates what
    the slow tokens have left (issue 67). A token whose own steps do not shrink (r >= 1: it has settled to its
    noise, or does not settle) keeps the group's. Per token: control = (distance left in group g + in group g+1)
    / group g's extent after x^(1) (the ratio's denominator), so a token whose earlier loop barely moves gets a
    large control. ``parts``: the observer's per-token ``extent``, ``last_*``, ``before_*``, ``turn_*``;
    ``handoff``: the per-token hand-off ratio. Returns ``median`` (the control's median over tokens),
    ``over_control`` (the ratio over its control: median, p10, p90), ``share_clear`` (the tokens whose ratio is
    at least CONTROL_MARGIN x their control), ``dynamics``, ``factors`` (the groups') and ``token_factors`` (the
    medians of the factors used per token); ``median`` None ("not tested") when a group has too few refinement
    steps above the noise floor to read its dynamics.
    """
    from rdepth.geometry.synthetic import dynamics_from_curves

    dynamics = [dynamics_from_curves(g["step_size"]["mean"], g["cosine"]["mean"], g["headline"]["noise_floor_step"])
                for g in (previous, following)]
    loops = [previous["steps"], following["steps"]]
    if any(d is None for d in dynamics) or not parts or handoff is None:
        return {"median": None, "loops": loops, "dynamics": None, "over_control": None, "share_clear": None,
                "margin": CONTROL_MARGIN}
    factors = [_distance_left_factor(d.contraction, d.rotation) for d in dynamics]
    per_token = [_token_factors(parts, side, factor) for side, factor in zip(("prev", "next"), factors, strict=True)]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        left = sum(np.where(parts[f"last_{side}"] > 0, factor * parts[f"last_{side}"], 0.0)
                   for side, factor in zip(("prev", "next"), per_token, strict=True))
        extent = parts["extent"]
        control = np.where(extent > 0, left / np.where(extent > 0, extent, 1.0), np.nan)
        over = handoff / np.maximum(control, np.finfo(np.float64).tiny)  # a control of 0: clear by any margin
    defined = np.isfinite(handoff) & ~np.isnan(control)
    clear = (handoff[defined] >= CONTROL_MARGIN * control[defined])
    return {"median": _stats(control)["median"], "loops": loops, "margin": CONTROL_MARGIN,
            "over_control": {key: _stats(over[defined])[key] for key in ("median", "p10", "p90")},
            "share_clear": float(clear.mean()) if clear.size else None, "factors": factors,
            "token_factors": [float(np.median(f)) if f.size else None for f in per_token],
            "dynamics": [{"contraction": d.contraction, "rotation": d.rotation, "noise": d.noise} for d in dynamics]}


def _token_factors(parts: dict[str, np.ndarray], side: str, group_factor: float) -> np.ndarray:
    """Per token of one side ("prev": group g, "next": group g+1), ||x^(K) - p|| / ||Delta^(K-1)|| of the linear
    loop with the token's own contraction (last step over the one before) and turning (the cosine between
    them), never under ``group_factor``; the group's where the token's own is undefined or does not contract."""
    last = parts[f"last_{side}"]
    before, turn = parts.get(f"before_{side}"), parts.get(f"turn_{side}")
    if before is None or turn is None:
        return np.full(last.shape, group_factor, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(before > 0, last / np.where(before > 0, before, 1.0), np.nan)
        angle = np.arccos(np.clip(np.nan_to_num(turn, nan=1.0), -1.0, 1.0))
        gap = np.hypot(rate * np.cos(angle) - 1.0, rate * np.sin(angle))
        own = np.where(gap > 0, rate / np.where(gap > 0, gap, 1.0), np.inf)
    valid = (before > 0) & (rate < 1.0) & np.isfinite(turn)
    return np.where(valid, np.maximum(own, group_factor), group_factor)


def _distance_left_factor(contraction: float, rotation: float) -> float:
    """||x^(K) - p|| / ||Delta^(K-1)|| in the linear loop of this contraction and rotation (inf when it neither
    contracts nor turns: such a loop never settles, so it cannot tell drift from what is left)."""
    gap = abs(complex(contraction * math.cos(rotation), contraction * math.sin(rotation)) - 1)
    return contraction / gap if gap > 0 else math.inf


def summarize_budget(result: StreamResult, group_names: list[str], loss: float | None,
                     noise_floor: float = NOISE_FLOOR) -> dict[str, Any]:
    """The JSON summary of one budget: per-group curves, convergence, headline numbers (at ``noise_floor``:
    :data:`NOISE_FLOORS` by the analysis precision) and DLR statistics."""
    groups = []
    for name, arrays in zip(group_names, result.groups, strict=False):
        entry: dict[str, Any] = {"name": name, "steps": int(arrays["steps"])}
        for metric in STEP_METRICS:
            entry[metric] = {"mean": arrays[f"{metric}_mean"].tolist(), "std": arrays[f"{metric}_std"].tolist()}
        if "effective_rank" in arrays:
            entry["effective_rank"] = arrays["effective_rank"].tolist()
        convergence = arrays["convergence_step"]
        entry["convergence"] = {
            **_stats(convergence.astype(np.float64)),
            "never_fraction": float((convergence >= entry["steps"]).mean()),
        }
        entry["headline"] = group_headline(entry, noise_floor, result.eps)
        groups.append(entry)
    dlr, controls = {}, {}
    for boundary, definitions in result.boundaries.items():
        a, b = (int(part) for part in boundary.split("->"))
        dlr[f"{group_names[a]}->{group_names[b]}"] = {name: _stats(v) for name, v in definitions.items()}
        controls[f"{group_names[a]}->{group_names[b]}"] = handoff_control(
            groups[a], groups[b], result.handoff_parts.get(boundary), definitions.get(HANDOFF))
    return {"loss": loss, "tokens": result.tokens, "groups": groups, "dlr": dlr, HANDOFF_CONTROL: controls,
            "noise_floor": {"relative": noise_floor, "eps": result.eps, "rounding_multiple": ROUNDING_MULTIPLE}}


def save_budget(out: str | Path, label: str, budget: str, result: StreamResult, group_names: list[str],
                loop_counts: list[int], loss: float | None, noise_floor: float = NOISE_FLOOR) -> dict[str, Any]:
    """Save one budget's per-token arrays as ``OUT/geometry/<label>/<budget>.npz`` and return its
    summary entry (loop counts, :func:`summarize_budget`, the NPZ's path relative to OUT)."""
    from rdepth.geometry.arrays import budget_arrays, save_npz

    out = Path(out)
    path = out / GEOMETRY_DIR / label / f"{budget}.npz"
    save_npz(path, budget_arrays(result, group_names))
    return {"loop_counts": list(loop_counts), **summarize_budget(result, group_names, loss, noise_floor),
            "arrays": path.relative_to(out).as_posix()}


# ------------------------------------------------------------------ the whole summary


def new_summary(settings: dict[str, Any], groups: list[str], sequences: int, seq_len: int,
                budgets: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """An empty summary: append checkpoint entries to ``summary["checkpoints"]``, then :func:`write_summary`.

    ``settings`` are saved as given (a ``source_note`` there replaces the language-model
    note on the report page). ``budgets``: budget name -> loop counts, if known now.
    """
    return {
        "format_version": FORMAT_VERSION, "settings": settings, "environment": environment_info(),
        "dlr_definitions": DLR_DESCRIPTIONS, "dlr_labels": DLR_LABELS, "dlr_default": DEFAULT_DLR,
        "dlr_default_refine": DEFAULT_DLR_REFINE,
        "dlr_terms": {"numerators": {DLR_NUMERATOR_LABEL[n]: t for n, t in DLR_NUMERATOR_TEXT.items()},
                      "denominators": {DLR_DENOMINATOR_LABEL[d]: t for d, t in DLR_DENOMINATOR_TEXT.items()}},
        "headline_definitions": {"settled_steps": SETTLED_STEPS, "settled_range": SETTLED_RANGE,
                                 "settled_slope": SETTLED_SLOPE, "decayed_fraction": DECAYED_FRACTION,
                                 "noise_floor": NOISE_FLOORS.get(settings.get("precision"), NOISE_FLOOR),
                                 "noise_floor_of": "the first refinement step",
                                 "plateau_window": PLATEAU_WINDOW, "plateau_max_decay": PLATEAU_MAX_DECAY},
        "groups": list(groups), "sequences": int(sequences), "seq_len": int(seq_len),
        "budgets": dict(budgets or {}), "checkpoints": [],
    }


def checkpoint_entry(label: str, step: int, path: str, budgets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One analysed model: its label, training step (-1 if none), path and per-budget summaries."""
    return {"label": label, "step": int(step), "path": str(path), "budgets": budgets}


def write_summary(out: str | Path, summary: dict[str, Any]) -> Path:
    """Fill the summary-level headline (``scale_budget``) and write ``OUT/geometry/summary.json``."""
    if not summary["checkpoints"]:
        raise RdepthError("geometry summary has no checkpoints")
    if not summary["budgets"]:
        summary["budgets"] = {name: b["loop_counts"] for name, b in summary["checkpoints"][0]["budgets"].items()}
    summary["scale_budget"] = scale_budget(summary["budgets"])
    path = Path(out) / GEOMETRY_DIR / SUMMARY_FILE
    write_json(path, summary)
    return path


def load_summary(out: str | Path) -> dict[str, Any]:
    """Read ``OUT/geometry/summary.json`` (RdepthError if missing, corrupt or of another format)."""
    path = Path(out) / GEOMETRY_DIR / SUMMARY_FILE
    if not path.is_file():
        raise RdepthError(f"no geometry summary at {path} (run `rdepth analyze` first)")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise RdepthError(f"geometry summary {path} is corrupt") from None
    version = summary.get("format_version") if isinstance(summary, dict) else None
    if version != FORMAT_VERSION:
        raise RdepthError(f"geometry summary {path} has format {version!r}, this rdepth reads format "
                          f"{FORMAT_VERSION}: rerun `rdepth analyze` to rewrite it")
    if not summary.get("checkpoints"):
        raise RdepthError(f"geometry summary {path} has no checkpoints")
    return summary


def write_slowest(out: str | Path, checkpoint: str, budget: str, threshold: float, rows: list[dict]) -> Path:
    """Save the slowest-token table (:func:`rdepth.geometry.slowest.slowest_tokens`)."""
    path = Path(out) / GEOMETRY_DIR / SLOWEST_FILE
    write_json(path, {"checkpoint": checkpoint, "budget": budget, "threshold": threshold, "rows": rows})
    return path


def load_slowest(out: str | Path) -> dict[str, Any] | None:
    """The saved slowest-token table, or None when there is none."""
    path = Path(out) / GEOMETRY_DIR / SLOWEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None
