"""The engine's token tick: each tick moves every occupied slot one whole token on, every loop run to its exit.

The eager tick (:mod:`rdepth.engine.eager`) moves a looping row one loop step a tick, so rows that arrive at
different times sit in different stages and groups: a tick then calls each stage and group on a few rows. At a
fixed budget it already runs a group's whole loop in one tick (every row there at one step), so every row stays
a whole token a tick; with an exit rule on a model with several groups (the text presets, the paper's layout)
under staggered arrivals, as a server sees them, rows spread over the groups and a tick's calls multiply: on the
text ``tiny`` preset ``rdepth serve``'s rule ran at 0.63x the fixed budget it equals in steps (docs/results/speed.md),
while the same requests queued at once (rows in step, one call a stage) ran at 0.92x.

The token tick runs, in each group, loop steps on the rows still looping until every one has stopped (its rule, or
its cap), the rows that stop leaving at once for the next stage, in the same tick: every row reads out once a
tick, so rows never spread, and a group's calls per tick are its slowest row's steps, on fewer rows as rows
leave. What each row computes is the eager tick's (the same loop steps, rule, keys written through, readout), so
its tokens are the batch-1 decoder's; the price is that a tick lasts as long as its slowest row's loops, so a row
that stops early waits for the others before its next token (the lock-step decoder's cost, without its padding:
the rows that stopped are out of the calls). Where depths spread widely (the task models' one group) the eager
tick, which refills a row's place at once, is the faster one; ``bench/serve_load.py --tick token`` measures it.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from rdepth.engine.eager import EagerTick
from rdepth.engine.tick import register_tick


@register_tick
class TokenTick(EagerTick):
    """The eager tick with every loop run to its exit within the tick (see the module)."""

    name: ClassVar[str] = "token"

    def _loop(self, group: int, rows: np.ndarray) -> None:
        stage = int(self.stage[rows[0]])  # (every row here is at this group's stage)
        while rows.size:
            super()._loop(group, rows)  # one step (or a fixed budget's whole loop); the rows that stop move on
            rows = rows[self.stage[rows] == stage]
