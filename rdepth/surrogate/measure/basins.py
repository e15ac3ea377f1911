"""The Raptor paper's dynamical findings as measurements: class basins, self-correction, and verdicts.

* :func:`class_basins`: per depth, how the [CLS] directions of one class gather around their
  class's mean direction (within-class angle) against how far apart the class directions are
  (between-class angle), and how often a [CLS] is nearest its own class's direction.
* :func:`perturbation_recovery`: perturb every token's state at depth j by a random vector of
  relative norm eps, run the remaining layers, and follow the angle between the perturbed and
  the clean [CLS] down to the last depth (self-correction: the angle shrinks).
* :func:`findings`: the paper's claims read off the saved numbers, each with the number behind
  it and a verdict (reproduced / partly / not).

All functions take plain tensors and return JSON-ready dicts of floats and lists.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

StepFn = Callable[[torch.Tensor, int], torch.Tensor]  # (state (N, T, D), depth d) -> state at depth d+1


def _angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Angle in degrees between the rows of a and b (broadcast), float64."""
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).clamp(-1.0, 1.0)
    return torch.rad2deg(torch.arccos(cos))


def class_basins(cls_states: torch.Tensor, labels: torch.Tensor, n_classes: int) -> dict[str, list[float]]:
    """Class-direction statistics of [CLS] states over depth.

    cls_states: (S, N, D), one [CLS] state per depth and example; labels (N,).
    Per depth: ``within`` = mean angle (deg) of an example to its class's mean unit direction;
    ``between`` = mean angle between the class mean directions (all pairs of present classes);
    ``ratio`` = within / between; ``nearest_class`` = fraction of examples whose nearest class
    direction (cosine) is their own.
    """
    classes = [c for c in range(n_classes) if bool((labels == c).any())]
    result: dict[str, list[float]] = {"within": [], "between": [], "ratio": [], "nearest_class": []}
    for state in cls_states:
        unit = torch.nn.functional.normalize(state.double(), dim=-1)  # (N, D)
        means = torch.stack([torch.nn.functional.normalize(unit[labels == c].mean(0), dim=-1) for c in classes])
        index = torch.tensor([classes.index(int(c)) for c in labels])
        within = float(_angles(unit, means[index]).mean())
        pairs = torch.triu_indices(len(classes), len(classes), offset=1)
        between = float(_angles(means[pairs[0]], means[pairs[1]]).mean()) if len(classes) > 1 else math.nan
        nearest = (unit @ means.T).argmax(1)
        result["within"].append(within)
        result["between"].append(between)
        result["ratio"].append(within / between if between > 0 else math.nan)
        result["nearest_class"].append(float((nearest == index).double().mean()))
    return result


def random_perturbation(state: torch.Tensor, relative: float, generator: torch.Generator) -> torch.Tensor:
    """A random direction per token scaled to ``relative`` x that token's state norm. state (N, T, D)."""
    noise = torch.randn(state.shape, generator=generator, dtype=state.dtype)
    noise = torch.nn.functional.normalize(noise, dim=-1)
    return noise * relative * state.norm(dim=-1, keepdim=True)


@torch.no_grad()
def perturbation_recovery(step: StepFn, clean: list[torch.Tensor], depth: int, relative: float,
                          generator: torch.Generator) -> dict:
    """Perturb the state at ``depth`` and follow the [CLS] angle to the clean run until the last depth.

    ``clean``: the model's own L+1 states (N, T, D); ``step(state, d)`` computes depth d+1.
    Returns {"depth", "angle": [deg at depths depth..L], "recovery": angle_L / angle_depth}.
    """
    state = clean[depth] + random_perturbation(clean[depth], relative, generator)
    angles = [float(_angles(state[:, 0], clean[depth][:, 0]).mean())]
    for d in range(depth, len(clean) - 1):
        state = step(state, d)
        angles.append(float(_angles(state[:, 0], clean[d + 1][:, 0]).mean()))
    return {"depth": depth, "angle": angles, "recovery": angles[-1] / angles[0] if angles[0] > 0 else math.nan}


def verdict(holds: list[bool]) -> str:
    """reproduced if every check holds, partly if some do, not if none do."""
    return "reproduced" if all(holds) else ("partly" if any(holds) else "not")


def findings(dynamics: dict[str, dict], model: str = "teacher") -> list[dict]:
    """The paper's dynamics claims read off one model's saved dynamics (see :mod:`.vision`).

    ``dynamics[model]`` holds "basins", "perturbation", "angular", "coherence",
    "update_effective_rank" and "step_size" as saved. Each finding: claim, number, verdict.
    """
    d = dynamics[model]
    rows = []
    basins = d["basins"]
    late = len(basins["ratio"]) - 1
    mid = late // 2
    holds = [basins["ratio"][late] < basins["ratio"][mid], basins["ratio"][late] < 0.5,
             basins["nearest_class"][late] > basins["nearest_class"][mid]]
    rows.append({"finding": "class-dependent angular basins",
                 "number": f"within/between angle {basins['ratio'][mid]:.2f} at depth {mid} -> "
                           f"{basins['ratio'][late]:.2f} at depth {late}; nearest-class-direction "
                           f"{basins['nearest_class'][mid]:.3f} -> {basins['nearest_class'][late]:.3f}",
                 "checks": "ratio falls from mid to last depth; last ratio < 0.5; nearest-class rises",
                 "verdict": verdict(holds)})
    recoveries = [entry["recovery"] for entry in d["perturbation"]]
    rows.append({"finding": "self-correction under small perturbations",
                 "number": "angle(last)/angle(perturbed) by depth: " + ", ".join(
                     f"{entry['depth']}: {entry['recovery']:.2f}" for entry in d["perturbation"]),
                 "checks": "ratio < 1 at every perturbed depth",
                 "verdict": verdict([r < 1.0 for r in recoveries])})
    step_first, step_others = d["angular"]["step_first"], d["angular"]["step_others"]
    n = len(step_first)
    late_half = range(n // 2, n)
    peak = max(range(n), key=lambda i: step_first[i])
    holds = [peak >= n // 2, max(step_first[i] for i in late_half) > max(step_others[i] for i in late_half)]
    rows.append({"finding": "[CLS] turns sharply late",
                 "number": f"largest [CLS] turn {step_first[peak]:.1f} deg at layer {peak + 1} of {n}; patches' "
                           f"largest late turn {max(step_others[i] for i in late_half):.1f} deg",
                 "checks": "peak in the second half; above the patches' late turns",
                 "verdict": verdict(holds)})
    coherence = d["coherence"]["others"]
    holds = [coherence[-1] > coherence[len(coherence) // 2], coherence[-1] == max(coherence[len(coherence) // 2:])]
    rows.append({"finding": "patch tokens cohere late toward their mean",
                 "number": f"cos(patch, patch mean) {coherence[len(coherence) // 2]:.3f} at depth "
                           f"{len(coherence) // 2} -> {coherence[-1]:.3f} at depth {len(coherence) - 1}",
                 "checks": "rises from mid depth; highest at the last depth",
                 "verdict": verdict(holds)})
    ranks = d["update_effective_rank"]
    holds = [ranks[-1] < max(ranks), ranks[-1] < 0.5 * max(ranks)]
    rows.append({"finding": "low-rank updates late in depth",
                 "number": f"effective rank of updates: max {max(ranks):.1f} (layer {ranks.index(max(ranks)) + 1}), "
                           f"last layer {ranks[-1]:.1f}; step sizes " + ", ".join(f"{v:.2f}" for v in d["step_size"]),
                 "checks": "last < max; last < half the max",
                 "verdict": verdict(holds)})
    return rows
