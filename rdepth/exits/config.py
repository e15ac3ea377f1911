"""Settings of ``rdepth sweep`` (torch-free at import, so that ``rdepth --help`` stays fast).

Every field is one flag of ``rdepth sweep`` (and of ``bench/exit_speed.py``),
with its default and help written here only. Validation looks policy names up
in the exit-policy registry, imported inside :meth:`SweepConfig.__post_init__`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.run.config import DEVICE_HELP, check_device_name

DEFAULT_TAUS = (1e-5, 1e-4, 1e-3, 1e-2)
AUTOCAST_NAMES = ("none", "bf16", "fp16")


@dataclass
class SweepConfig:
    """One sweep: which policies and thresholds, on which held-out windows, measured how.

    ``max_batches`` x ``batch_size`` held-out windows of ``block_size`` tokens
    are evaluated per point; timing runs the first ``timing_batch_size`` of
    them (batched) and the first alone (batch 1).
    """

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    data: str = option("", "prepared data folder (its val split) or a UTF-8 text file", required=True)
    out: str = option("", "output folder for sweep.json, sweep.csv, figures/ and index.html", required=True)
    policies: tuple[str, ...] | None = option(
        None, "comma-separated exit policies to sweep (the fixed budget is always measured)",
        default_text="every registered policy except fixed",
    )
    taus: tuple[float, ...] = option(DEFAULT_TAUS, "threshold grid for policies with a tau, e.g. 1e-5,1e-4")
    grid: dict[str, tuple[float, ...]] = option(
        {}, "values for one policy instead of the tau grid or its own default, e.g. kl=1e-6,1e-5 or "
        "argmax_stable=1,2,4 (repeatable)",
    )
    k_max: tuple[int, ...] | None = option(
        None, "loop-step cap N (every group) or N,N,... (per group)", default_text="twice the model's eval loops",
    )
    tolerance: float = option(0.01, "relative perplexity increase over the full budget that counts as matched quality")
    batch_size: int = option(8, "held-out windows per forward pass")
    block_size: int | None = option(
        None, "tokens per window", default_text="the model's block size, at most the held-out text",
    )
    max_batches: int | None = option(4, "batches of windows evaluated per point")
    timing: bool = option(True, "measure latency (ms/token) of every point")
    timing_batch_size: int = option(8, "windows in the batched latency measurement")
    warmup: int = option(2, "untimed calls before each latency measurement")
    repeats: int = option(5, "timed calls per latency measurement (the median is kept)")
    generate_tokens: int = option(0, "also time greedy cached generation of this many tokens at batch 1 (0: skip)")
    generate_prompt: int = option(16, "prompt tokens before the timed generation")
    fixed_ladder: bool = option(True, "also measure every fixed budget 1..k_max (the fixed-budget curve)")
    autocast: str = option("none", "autocast dtype during evaluation and timing: none, bf16 or fp16")
    seed: int = option(0, "seed of the initial loop-state noise")
    device: str = option("auto", DEVICE_HELP)
    progress: bool = option(True, "show a progress bar over the sweep points")

    def __post_init__(self) -> None:
        from rdepth.exits.registry import get_policy_class, sweepable_policies

        self.policies = sweepable_policies() if self.policies is None else tuple(self.policies)
        if not self.policies:
            raise RdepthError("sweep: policies is empty")
        for name in self.policies:
            get_policy_class(name)  # unknown names fail here
            if name == "fixed":
                raise RdepthError("sweep: 'fixed' is the baseline and always included; leave it out of policies")
        self.taus = tuple(float(t) for t in self.taus)
        if not self.taus or not all(math.isfinite(t) and t > 0 for t in self.taus):
            raise RdepthError(f"sweep: taus must be positive finite numbers, got {self.taus}")
        grid = {}
        for name, values in dict(self.grid).items():
            get_policy_class(name)
            values = tuple(values)
            if not values:
                raise RdepthError(f"sweep: the grid for {name} is empty")
            grid[name] = values
        self.grid = grid
        if self.k_max is not None:
            self.k_max = tuple(int(k) for k in self.k_max)
            if not self.k_max or any(k < 1 for k in self.k_max):
                raise RdepthError(f"sweep: k_max must be positive integers, got {self.k_max}")
        if not (isinstance(self.tolerance, (int, float)) and math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise RdepthError(f"sweep: tolerance must be a finite number >= 0, got {self.tolerance!r}")
        if self.generate_tokens < 0 or self.generate_prompt < 1:
            raise RdepthError(
                f"sweep: need generate_tokens >= 0 and generate_prompt >= 1, got "
                f"{self.generate_tokens}, {self.generate_prompt}"
            )
        for name in ("batch_size", "timing_batch_size", "repeats"):
            if getattr(self, name) < 1:
                raise RdepthError(f"sweep: {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise RdepthError(f"sweep: warmup must be >= 0, got {self.warmup}")
        if self.max_batches is not None and self.max_batches < 1:
            raise RdepthError(f"sweep: max_batches must be >= 1, got {self.max_batches}")
        if self.block_size is not None and self.block_size < 2:
            raise RdepthError(f"sweep: block_size must be >= 2, got {self.block_size}")
        if self.autocast not in AUTOCAST_NAMES:
            raise RdepthError(f"sweep: autocast must be one of {', '.join(AUTOCAST_NAMES)}, got {self.autocast!r}")
        check_device_name("sweep", self.device)

    @property
    def max_windows(self) -> int | None:
        """Held-out windows evaluated per point (None: every window of the text)."""
        return None if self.max_batches is None else self.max_batches * self.batch_size

    def values(self, policy: str) -> tuple[float, ...]:
        """The values swept for ``policy``: its ``grid`` entry, else its own default grid, else ``taus``."""
        from rdepth.exits.registry import get_policy_class

        if policy in self.grid:
            return self.grid[policy]
        cls = get_policy_class(policy)
        if cls.default_grid is not None:
            return tuple(cls.default_grid)
        return self.taus

    def resolve_k_max(self, n_groups: int, eval_loops: tuple[int, ...]) -> tuple[int, ...]:
        """The per-group step cap for a model with ``n_groups`` groups and these eval loop counts."""
        if self.k_max is None:
            return tuple(2 * int(k) for k in eval_loops)
        if len(self.k_max) == 1:
            return self.k_max * n_groups
        if len(self.k_max) != n_groups:
            raise RdepthError(f"sweep: {len(self.k_max)} k_max values for a model with {n_groups} groups")
        return self.k_max
