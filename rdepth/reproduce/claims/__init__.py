"""The two-scale paper's four claims and its §4 plateau, judged from the saved summaries (pure functions, torch-free).

Inputs are what the analyses saved: the geometry summary (``geometry/summary.json``,
:mod:`rdepth.geometry.summary`) and the sweep result (``sweep.json``,
:mod:`rdepth.sweep.summary`). Each claim function returns a dict: ``id``,
``claim`` (the paper's sentence), ``paper`` (its figure and numbers), ``ours``
(the numbers measured, the text shown), ``verdict`` (one of :data:`VERDICTS`),
``why`` (sentences), ``criteria`` (how the verdict is decided, with the
constants) and ``judged_on`` (the budget, precision, seeds and spread it rests on). The report
draws nothing from anything else.

One module per claim, in the paper's order: :mod:`.step_decay` (claim 1), :mod:`.plateau` (§4's
step-norm plateau), :mod:`.cosine` (claim 2), :mod:`.dlr` (claim 3), :mod:`.exits` (claim 4, with the
paper's absolute grid in :mod:`.paper_grid`); :mod:`.verdict` holds what they share and :mod:`.judge`
runs them all.
"""

from rdepth.reproduce.claims.cosine import (
                                            COLLINEAR,
                                            COSINE_SLACK,
                                            PAPER_COSINE,
                                            TREND_MIN_MOVE,
                                            claim_cosine,
                                            cosine_status,
                                            cosine_trend,
)
from rdepth.reproduce.claims.dlr import (
                                            CONTROL_MARGIN,
                                            DLR_MUCH,
                                            HANDOFF,
                                            HANDOFF_CONTROL,
                                            NOISE_FREE_DLR,
                                            PAPER_LOOPS,
                                            claim_dlr,
                                            dlr_at,
)
from rdepth.reproduce.claims.exits import FRONT_QUALITY_SLACK, FRONT_RULES, FRONT_STEPS_SLACK, claim_exits, exit_fronts
from rdepth.reproduce.claims.judge import judge_all, unlearned_reason
from rdepth.reproduce.claims.paper_grid import CLIFF_LOSS, CLIFF_SAFE_TAU, MIN_STEPS_SAVED
from rdepth.reproduce.claims.plateau import claim_plateau
from rdepth.reproduce.claims.step_decay import (
                                            DECAY_BY_STEP,
                                            DECAY_FRACTION,
                                            DECAY_TREND_FACTOR,
                                            claim_step_decay,
                                            decay_left,
                                            decay_step,
                                            decay_trend,
)
from rdepth.reproduce.claims.verdict import (
                                            NOT,
                                            PARTLY,
                                            REPRODUCED,
                                            UNTESTED,
                                            VERDICTS,
                                            judged_on,
                                            judged_text,
                                            missing_field,
)

__all__ = [
    "CLIFF_LOSS", "CLIFF_SAFE_TAU", "COLLINEAR", "CONTROL_MARGIN", "COSINE_SLACK", "DECAY_BY_STEP", "DECAY_FRACTION",
    "DECAY_TREND_FACTOR", "DLR_MUCH", "FRONT_QUALITY_SLACK", "FRONT_RULES", "FRONT_STEPS_SLACK", "HANDOFF",
    "HANDOFF_CONTROL", "MIN_STEPS_SAVED", "NOISE_FREE_DLR", "NOT", "PAPER_COSINE", "PAPER_LOOPS", "PARTLY",
    "REPRODUCED", "TREND_MIN_MOVE", "UNTESTED", "VERDICTS", "claim_cosine", "claim_dlr", "claim_exits",
    "claim_plateau", "claim_step_decay", "cosine_status", "cosine_trend", "decay_left", "decay_step", "decay_trend",
    "dlr_at", "exit_fronts", "judge_all", "judged_on", "judged_text", "missing_field", "unlearned_reason",
]
