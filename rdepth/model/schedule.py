"""Training loop counts: Geiping et al.'s lognormal-Poisson schedule.

For each group and forward pass, a rate is drawn from a lognormal with
log-space spread ``sigma`` and mean ``r - 1``, and the loop count is
``1 + Poisson(rate)``, so counts are >= 1 with mean ``r`` and a heavy right
tail. (Geiping et al. draw around ``r`` and add 1, a mean of ``r + 1``; we
keep the configured value as the mean.) A group of several layers (5-6) is one
group and takes one draw. Drawing from an explicit generator seeded by the
training step makes every data-parallel rank draw the same counts.
"""

from __future__ import annotations

import math

import torch

from rdepth.config import ModelConfig


def sample_loop_counts(config: ModelConfig, generator: torch.Generator | None = None) -> tuple[int, ...]:
    """One loop count per group, ``>= 1``, with mean ``config.mean_loops``."""
    counts = []
    extra = config.mean_loops - 1.0
    for _ in config.group_specs:
        if extra <= 0:
            counts.append(1)
            continue
        sigma = config.loop_sigma
        mu = math.log(extra) - sigma**2 / 2  # E[lognormal] = extra
        log_rate = torch.normal(mu, sigma, size=(1,), generator=generator) if sigma > 0 else torch.tensor([mu])
        count = 1 + torch.poisson(log_rate.exp(), generator=generator)
        counts.append(int(count.item()))
    return tuple(counts)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator that depends only on (seed, step, stream): the same on every
    rank and after a resume."""
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1))
    return generator
