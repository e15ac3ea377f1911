"""Loop geometry of a Raptor surrogate (and of its teacher), with ``rdepth analyze``'s own tools.

Each phase p of ``lengths`` is read as a loop group: its iterates are the states at depths
a, a+1, ..., a+n (a = sum of the earlier lengths), so "step 0" is the phase's input (the
previous phase's output) and steps 1..n are the block's applications. The states of real
tokens are streamed, one sentence at a time, through the same
:class:`~rdepth.geometry.stream.GeometryObserver` that watches a :class:`RecurrentLM`, and the
result is saved in ``rdepth analyze``'s format (``OUT/geometry/summary.json`` plus per-model
NPZ arrays). The same figures and the same report section are then drawn from it. The two
"checkpoints" are the teacher (its layers grouped by phase) and the surrogate.

Differences from a language model's analysis: the only budget is the fitted phase lengths
(the surrogate's iteration embedding fixes its depth), so there is no long budget; there is
no loss; the paper-literal DLR is 0 by construction (a phase starts from the previous
phase's output, not from noise); and Delta^(0) is the block's first application to that
input, not a jump from noise, so the "_refine" DLR (denominator: the phase's steps k >= 1)
leaves out a real step here, and is undefined (null) after a one-layer phase.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rdepth.geometry.stream import GeometryObserver
from rdepth.geometry.summary import DLR_LABELS, checkpoint_entry, new_summary, save_budget, write_summary

SOURCE_NOTE = (
    "Each phase of the surrogate is read as a loop: step 0 is the phase's input (the previous phase's "
    "output), steps 1..n the n applications of its block (for the teacher: the phase's n layers). "
    "Statistics over the real tokens of {sentences} held-out sentences; bands are 1 sigma over tokens. "
    "There is one budget (the fitted phase lengths) and no loss; the paper-literal DLR is 0 by construction. "
    "DLR = drift / loop step; drift (numerator) to the next phase's x(1) = its first output, or x(K) = its last; "
    "loop step (denominator) = the earlier phase's mean step size over all its n steps (k≥0, Eq. 2's denominator; "
    "here Δ(0) is the block's first application, not a jump from noise) or over its steps k≥1 only ('_refine', "
    "undefined after a one-layer phase). Saved names: {definitions}. "
    "All numbers are in geometry/summary.json and geometry/<model>/train.npz."
)


def phase_stream(states: torch.Tensor, mask: torch.Tensor, lengths: tuple[int, ...], threshold: float = 0.01):
    """Feed every sentence's real-token states, phase by phase, to a fresh observer; return its result.

    states (S, N, T, D) with S = sum(lengths) + 1 depths; mask (N, T) bool, True on real tokens.
    """
    if sum(lengths) != states.shape[0] - 1:
        raise ValueError(f"phase lengths {lengths} do not cover {states.shape[0] - 1} layers")
    observer = GeometryObserver(threshold, keep_sequence=0, rank=True)
    for sentence in range(states.shape[1]):
        real = states[:, sentence, mask[sentence]]  # (S, n_real, D)
        start = 0
        for phase, length in enumerate(lengths):
            for step in range(length + 1):
                observer(phase, step, real[start + step][None], None)
            start += length
    return observer.result()


def write_phase_geometry(out: str | Path, states: dict[str, torch.Tensor], mask: torch.Tensor,
                         lengths: tuple[int, ...], threshold: float = 0.01) -> dict[str, Any]:
    """Measure each model's phases, save summary + arrays under ``OUT/geometry``, add the report section.

    ``states``: model name -> (S, N, T, D) stacked states (e.g. ``{"teacher": ..., "raptor": ...}``).
    Returns the summary.
    """
    from rdepth.geometry.plots import draw_all
    from rdepth.geometry.report_page import geometry_section
    from rdepth.report import add_section

    out = Path(out)
    names = [f"{sum(lengths[:p])}-{sum(lengths[:p + 1]) - 1}" if n > 1 else str(sum(lengths[:p]))
             for p, n in enumerate(lengths)]
    definitions = ", ".join(f"{name} = {label}" for name, label in DLR_LABELS.items())
    settings = {"threshold": threshold, "keep_sequence": 0, "data": "held-out sentences",
                "source_note": SOURCE_NOTE.format(sentences=int(mask.shape[0]), definitions=definitions)}
    summary = new_summary(settings, names, int(mask.shape[0]), int(mask.shape[1]), {"train": list(lengths)})
    for model, model_states in states.items():
        result = phase_stream(model_states, mask, lengths, threshold)
        budget = save_budget(out, model, "train", result, names, list(lengths), loss=None)
        summary["checkpoints"].append(checkpoint_entry(model, -1, model, {"train": budget}))
    write_summary(out, summary)
    section = geometry_section(out, summary, draw_all(out, summary),
                               title="Loop geometry of the phases (rdepth analyze's tools)", order=45)
    add_section(out, section)
    return summary
