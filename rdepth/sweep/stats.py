"""Timing statistics and the noise rule (torch-free: a saved sweep is re-summarised anywhere).

A measurement is the list of per-round wall-clock samples of one setting
(ms/token), taken by :func:`rdepth.sweep.timing.time_interleaved`, which calls
every setting once per round in a shuffled order, so a burst of load falls on
rounds (and all settings timed in them), not on one setting's whole
measurement. It is kept as its median and interquartile range (IQR).

A ratio of two measurements (``reference / candidate``: > 1 means the candidate
is faster) is *within noise* when

* the two IQRs overlap (the measurements do not resolve a difference), or
* either measurement's relative IQR, ``(q3 - q1) / median``, exceeds the
  noise threshold (default :data:`NOISE_THRESHOLD`, the sweep's
  ``--noise-threshold``): its spread is too large to support a ratio.

The ratio saved is the ratio of medians; its range ``[ref q1 / cand q3,
ref q3 / cand q1]`` is the ratio the two IQRs allow at the extremes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rdepth.errors import RdepthError

NOISE_THRESHOLD = 0.10


def quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of ``samples`` (linear interpolation between order statistics; one sample:
    all three equal)."""
    values = sorted(float(s) for s in samples)
    if not values:
        raise RdepthError("quartiles of an empty measurement")
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def spread(samples: Sequence[float]) -> dict:
    """``median``, ``iqr`` ``[q1, q3]`` and ``rel_iqr`` (``(q3 - q1) / median``) of ``samples``."""
    q1, median, q3 = quartiles(samples)
    return {"median": median, "iqr": [q1, q3], "rel_iqr": (q3 - q1) / median if median > 0 else 0.0}


def rel_iqr(median: float, iqr: Sequence[float]) -> float:
    """Relative interquartile range of a saved measurement."""
    return (iqr[1] - iqr[0]) / median if median > 0 else 0.0


def compare(
    reference: tuple[float, Sequence[float]], candidate: tuple[float, Sequence[float]],
    threshold: float = NOISE_THRESHOLD,
) -> dict:
    """The ratio ``reference / candidate`` of two saved measurements ``(median, [q1, q3])``.

    Returns ``ratio`` (of medians), ``range`` ``[low, high]`` and ``noise``: None when the ratio is
    resolved, else why it is within noise (``"IQRs overlap"`` and/or ``"spread > X%"``).
    """
    (ref_median, (ref_q1, ref_q3)), (cand_median, (cand_q1, cand_q3)) = reference, candidate
    if min(ref_median, cand_median, ref_q1, cand_q1) <= 0:
        raise RdepthError(f"compare: timings must be positive, got {reference} and {candidate}")
    reasons = []
    if ref_q1 <= cand_q3 and cand_q1 <= ref_q3:
        reasons.append("IQRs overlap")
    widest = max(rel_iqr(ref_median, (ref_q1, ref_q3)), rel_iqr(cand_median, (cand_q1, cand_q3)))
    if widest > threshold:
        reasons.append(f"spread {100 * widest:.1f}% > {100 * threshold:g}%")
    return {
        "ratio": ref_median / cand_median,
        "range": [ref_q1 / cand_q3, ref_q3 / cand_q1],
        "noise": "; ".join(reasons) or None,
    }


def format_ratio(compared: dict | None, suffix: str = "x") -> str:
    """``1.23x [1.10-1.35]``, with `` (within noise: why)`` when flagged; ``-`` for None."""
    if not compared:
        return "-"
    low, high = compared["range"]
    text = f"{compared['ratio']:.3g}{suffix} [{low:.3g}-{high:.3g}]"
    return text + (f" (within noise: {compared['noise']})" if compared["noise"] else "")
