"""Settings of ``rdepth sweep`` (torch-free at import, so that ``rdepth --help`` stays fast).

Every field is one flag of ``rdepth sweep`` (and of ``bench/exit_speed.py``),
with its default and help written here only. Validation looks policy names up
in the exit-policy registry, imported inside :meth:`SweepConfig.__post_init__`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError
from rdepth.exits.stats import NOISE_THRESHOLD
from rdepth.fields import option
from rdepth.run.config import (DEVICE_HELP, PROFILE_FORCE_HELP, check_autocast_name, check_device_name,
                               check_force_profile)
from rdepth.threads import THREADS_HELP

DEFAULT_TAUS = (1e-5, 1e-4, 1e-3, 1e-2)
# Tokens of the timed cached generation (the decode latency) when --generate-tokens is not given.
DEFAULT_GENERATE_TOKENS = 16
# How decoded rules (kl, entropy_diff, argmax_stable) read a group's state; see rdepth.exits.decode.
DECODE_MODES = ("head", "rest")


def checked_k_max(command: str, k_max) -> tuple[int, ...] | None:
    """``k_max`` as a tuple of integers in 1..MAX_LOOPS (None stays None); a one-line error otherwise."""
    if k_max is None:
        return None
    k_max = tuple(int(k) for k in k_max)
    if not k_max or any(not 1 <= k <= MAX_LOOPS for k in k_max):
        raise RdepthError(f"{command}: k_max must be integers in 1..{MAX_LOOPS}, got {k_max}")
    return k_max


def resolve_k_max(command: str, k_max: tuple[int, ...] | None, n_groups: int,
                  eval_loops: tuple[int, ...]) -> tuple[int, ...]:
    """Per-group step caps: ``k_max`` as given (one value for every group, or one per group), else
    twice the model's eval loop counts."""
    if k_max is None:
        return tuple(2 * int(k) for k in eval_loops)
    if len(k_max) == 1:
        return k_max * n_groups
    if len(k_max) != n_groups:
        raise RdepthError(f"{command}: {len(k_max)} k_max values for a model with {n_groups} groups")
    return k_max


@dataclass
class SweepConfig:
    """One sweep: which policies and thresholds, on which held-out windows, measured how.

    ``max_batches`` x ``batch_size`` held-out windows of ``block_size`` tokens
    are evaluated per point; timing runs the first ``timing_batch_size`` of
    them (batched) and the first alone (batch 1). Those latencies are
    teacher-forced (a whole window in one forward, wall time / tokens), not
    decode latency; beside them, the decode latency of greedy cached generation
    at batch 1 (ms per generated token) is timed for ``generate_tokens`` tokens
    (by default :data:`DEFAULT_GENERATE_TOKENS`, see :meth:`generate_tokens_for`).
    Policies and fixed budgets are timed on the same (packed) path; fixed
    budgets also on the dense path, as a separate reference.
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
    timing: bool = option(
        True, "measure latency of every point: teacher-forced ms/token (a whole window per forward, time / "
        "tokens; not decode latency), batch 1 and batched, and the decode latency (see --generate-tokens)",
    )
    timing_batch_size: int = option(8, "windows in the batched latency measurement")
    warmup: int = option(2, "untimed calls of each setting before the timed rounds")
    repeats: int = option(
        5, "timed rounds; each round times every setting once, in a shuffled order (median and IQR kept)",
    )
    noise_threshold: float = option(
        NOISE_THRESHOLD, "a speedup is flagged 'within noise' when the IQRs overlap or either timing's "
        "IQR exceeds this fraction of its median",
    )
    generate_tokens: int | None = option(
        None, "decode latency: time greedy cached generation of this many tokens at batch 1 after "
        "--generate-prompt tokens, ms per generated token (0: skip)",
        default_text=f"{DEFAULT_GENERATE_TOKENS}, fewer when the window is shorter; none with --decode rest",
    )
    generate_prompt: int = option(16, "prompt tokens before the timed generation")
    fixed_ladder: bool = option(True, "also measure every fixed budget 1..k_max (the fixed-budget curve)")
    decode: str = option(
        "head", "how kl, entropy_diff and argmax_stable read a group's state: head (final norm + head, a "
        "logit-lens reading) or rest (the layers after the group, later groups at --decode-loops steps, then "
        "the head; teacher-forced only)",
    )
    decode_loops: int = option(1, "with --decode rest: loop steps each later group runs in a reading")
    kl_direction: str = option(
        "new_old", "kl policy: new_old = KL(p_new || p_old) (the paper's Eq. 4) or old_new = KL(p_old || p_new) "
        "(Geiping et al.'s code)",
    )
    autocast: str = option("none", "autocast dtype during evaluation and timing: none, bf16 or fp16")
    difficulties: tuple[int, ...] | None = option(
        None, "task data: held-out difficulties to sweep", default_text="the top training difficulty")
    task_windows: int | None = option(
        None, "task data: held-out windows (problems, one per window when they fill it) per difficulty",
        default_text="all")
    exit_profile: str | None = option(
        None, "also measure this exit profile (rdepth calibrate: one threshold per group) beside the policy grid",
        default_text="none")
    force_profile: bool = option(False, PROFILE_FORCE_HELP)
    accuracy_tolerance: float = option(
        0.01, "task data: accuracy below the full budget's that counts as matched (a fraction: 0.01 = one point)")
    seed: int = option(0, "seed of the initial loop-state noise")
    device: str = option("auto", DEVICE_HELP)
    progress: bool = option(True, "show a progress bar over the sweep points")
    threads: int = option(0, THREADS_HELP + "; fewer threads than cores steadies timings on a shared machine")

    def __post_init__(self) -> None:
        from rdepth.exits.registry import get_policy_class, sweepable_policies

        self.policies = sweepable_policies() if self.policies is None else tuple(self.policies)
        if not self.policies:
            raise RdepthError("sweep: policies is empty")
        check_force_profile("sweep", self)
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
            if not all(math.isfinite(float(v)) and float(v) > 0 for v in values):
                raise RdepthError(f"sweep: the grid for {name} must hold positive finite numbers, got {values}")
            grid[name] = values
        self.grid = grid
        self.k_max = checked_k_max("sweep", self.k_max)
        if not (isinstance(self.tolerance, (int, float)) and math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise RdepthError(f"sweep: tolerance must be a finite number >= 0, got {self.tolerance!r}")
        if (self.generate_tokens is not None and self.generate_tokens < 0) or self.generate_prompt < 1:
            raise RdepthError(
                f"sweep: need generate_tokens >= 0 and generate_prompt >= 1, got "
                f"{self.generate_tokens}, {self.generate_prompt}"
            )
        for name in ("batch_size", "timing_batch_size", "repeats"):
            if getattr(self, name) < 1:
                raise RdepthError(f"sweep: {name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise RdepthError(f"sweep: threads must be an integer >= 0, got {self.threads!r}")
        if self.warmup < 0:
            raise RdepthError(f"sweep: warmup must be >= 0, got {self.warmup}")
        if self.max_batches is not None and self.max_batches < 1:
            raise RdepthError(f"sweep: max_batches must be >= 1, got {self.max_batches}")
        if self.block_size is not None and self.block_size < 2:
            raise RdepthError(f"sweep: block_size must be >= 2, got {self.block_size}")
        if self.decode not in DECODE_MODES:
            raise RdepthError(f"sweep: decode must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}")
        if isinstance(self.decode_loops, bool) or not isinstance(self.decode_loops, int) or self.decode_loops < 1:
            raise RdepthError(f"sweep: decode_loops must be an integer >= 1, got {self.decode_loops!r}")
        if self.decode == "rest" and self.timing and self.generate_tokens:
            raise RdepthError(
                "sweep: decode=rest is defined for teacher-forced windows only; cached generation would need "
                "the later layers to read the key/value cache without writing it (set generate_tokens 0)"
            )
        directions = get_policy_class("kl").DIRECTIONS
        if self.kl_direction not in directions:
            raise RdepthError(f"sweep: kl_direction must be one of {', '.join(directions)}, got {self.kl_direction!r}")
        if not (isinstance(self.noise_threshold, (int, float)) and math.isfinite(self.noise_threshold)
                and self.noise_threshold > 0):
            raise RdepthError(f"sweep: noise_threshold must be a finite number > 0, got {self.noise_threshold!r}")
        check_autocast_name("sweep", self.autocast)
        if self.difficulties is not None:
            self.difficulties = tuple(int(d) for d in self.difficulties)
            if not self.difficulties:
                raise RdepthError("sweep: difficulties is empty")
        if self.task_windows is not None and (isinstance(self.task_windows, bool) or self.task_windows < 1):
            raise RdepthError(f"sweep: task_windows must be >= 1, got {self.task_windows!r}")
        if not (isinstance(self.accuracy_tolerance, (int, float)) and 0 <= self.accuracy_tolerance <= 1):
            raise RdepthError(f"sweep: accuracy_tolerance must be a fraction in [0, 1], got {self.accuracy_tolerance!r}")
        check_device_name("sweep", self.device)

    @property
    def max_windows(self) -> int | None:
        """Held-out windows evaluated per point (None: every window of the text)."""
        return None if self.max_batches is None else self.max_batches * self.batch_size

    def policy_options(self, policy: str) -> dict:
        """Options every point of ``policy`` is built with (besides its swept parameter)."""
        return {"direction": self.kl_direction} if policy == "kl" else {}

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
        return resolve_k_max("sweep", self.k_max, n_groups, eval_loops)

    def generate_tokens_for(self, window: int) -> int:
        """Tokens of the timed generation for windows of ``window`` tokens (0: not timed):
        ``generate_tokens`` as given; by default :data:`DEFAULT_GENERATE_TOKENS`, fewer when the
        prompt and they do not fit the window, none with ``decode`` rest (teacher-forced only)."""
        if not self.timing:
            return 0
        if self.generate_tokens is not None:
            return self.generate_tokens
        if self.decode == "rest":
            return 0
        return max(0, min(DEFAULT_GENERATE_TOKENS, window - self.generate_prompt))


CALIBRATE_TAUS = (1e-6, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)


@dataclass
class CalibrateConfig:
    """One ``rdepth calibrate`` run: a policy's threshold per group for a quality target, by replay.

    Give exactly one target: ``max_quality_loss`` (text: relative perplexity increase over the
    full budget, 0.01 = 1%; a task: drop in exact-match accuracy, 0.01 = one point) or
    ``mean_steps`` (loop steps per token summed over groups).
    """

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    data: str = option("", "prepared data folder (text or task)", required=True)
    policy: str = option("acceleration", "the exit policy to calibrate")
    max_quality_loss: float | None = option(
        None, "target: the most quality to give up (text: relative perplexity increase, 0.01 = 1%; "
        "task: accuracy drop, 0.01 = one point)", default_text="none; or give --mean-steps")
    mean_steps: float | None = option(None, "target: mean loop steps per token summed over groups",
                                      default_text="none; or give --max-quality-loss")
    values: tuple[float, ...] | None = option(
        None, "candidate values of the policy's parameter", default_text="1e-6 .. 3 (tau) or the policy's grid")
    k_max: tuple[int, ...] | None = option(
        None, "loop-step cap N (every group) or N,N,... (per group)", default_text="twice the model's eval loops")
    windows: int = option(128, "held-out windows the thresholds are chosen on (text: with --validation-windows at most "
                                "the split holds, an error beyond; task: capped at half the held-out set)")
    validation_windows: int = option(128, "further held-out windows the chosen profile is checked on")
    difficulty: int | None = option(None, "task data: the held-out difficulty to calibrate on",
                                    default_text="the top training difficulty")
    kl_direction: str = option("new_old", "kl policy: new_old or old_new (see rdepth sweep)")
    batch_size: int = option(16, "windows per forward pass")
    refine_rounds: int = option(
        3, "real runs on the calibration windows that may correct the additive estimate: while the chosen "
        "profile misses the target there, the estimate's error is taken off the target and the choice made "
        "again (0: trust the estimate)")
    out: str | None = option(None, "where to write the profile (JSON; never overwritten)",
                             default_text="RUN/exit_profile_<policy>.json")
    seed: int = option(0, "seed of the initial loop-state noise")
    device: str = option("auto", DEVICE_HELP)
    threads: int = option(0, THREADS_HELP)

    def __post_init__(self) -> None:
        from rdepth.exits.registry import get_policy_class

        cls = get_policy_class(self.policy)
        if self.policy == "fixed":
            raise RdepthError("calibrate: 'fixed' has no threshold to calibrate")
        if (self.max_quality_loss is None) == (self.mean_steps is None):
            raise RdepthError("calibrate: give exactly one of --max-quality-loss and --mean-steps")
        if self.max_quality_loss is not None and not (
                isinstance(self.max_quality_loss, (int, float)) and 0 <= self.max_quality_loss < 1):
            raise RdepthError(f"calibrate: max_quality_loss must be in [0, 1), got {self.max_quality_loss!r}")
        if self.mean_steps is not None and not (isinstance(self.mean_steps, (int, float)) and
                                                0 < self.mean_steps <= MAX_LOOPS * 1024):
            raise RdepthError(f"calibrate: mean_steps must be a finite number > 0, got {self.mean_steps!r}")
        if self.values is not None:
            self.values = tuple(float(v) for v in self.values)
            if not self.values or not all(math.isfinite(v) and v > 0 for v in self.values):
                raise RdepthError(f"calibrate: values must be positive finite numbers, got {self.values}")
        if cls.sweep_parameter is None:
            raise RdepthError(f"calibrate: policy {self.policy!r} has no parameter to calibrate")
        self.k_max = checked_k_max("calibrate", self.k_max)
        for name in ("windows", "validation_windows", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RdepthError(f"calibrate: {name} must be a positive integer, got {value!r}")
        if self.difficulty is not None and (isinstance(self.difficulty, bool) or self.difficulty < 1):
            raise RdepthError(f"calibrate: difficulty must be a positive integer, got {self.difficulty!r}")
        if self.kl_direction not in get_policy_class("kl").DIRECTIONS:
            raise RdepthError(f"calibrate: kl_direction must be new_old or old_new, got {self.kl_direction!r}")
        if not isinstance(self.refine_rounds, int) or isinstance(self.refine_rounds, bool) or not \
                0 <= self.refine_rounds <= 20:
            raise RdepthError(f"calibrate: refine_rounds must be an integer in 0..20, got {self.refine_rounds!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise RdepthError(f"calibrate: threads must be an integer >= 0, got {self.threads!r}")
        check_device_name("calibrate", self.device)

    def candidate_values(self) -> tuple[float, ...]:
        from rdepth.exits.registry import get_policy_class

        if self.values is not None:
            return self.values
        cls = get_policy_class(self.policy)
        return tuple(cls.default_grid) if cls.default_grid is not None else CALIBRATE_TAUS

    def policy_options(self) -> dict:
        return {"direction": self.kl_direction} if self.policy == "kl" else {}

    def resolve_k_max(self, n_groups: int, eval_loops: tuple[int, ...]) -> tuple[int, ...]:
        return resolve_k_max("calibrate", self.k_max, n_groups, eval_loops)
