"""Settings of ``rdepth sweep`` (torch-free at import, so that ``rdepth --help`` stays fast).

Every field is one flag of ``rdepth sweep`` (and of ``bench/exit_speed.py``),
with its default and help written here only. Validation looks policy names up
in the exit-policy registry, imported inside :meth:`SweepConfig.__post_init__`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from rdepth.errors import RdepthError
from rdepth.exits.config import DECODE_MODES, changed_fields, check_rule_flags_apply, checked_k_max, resolve_k_max
from rdepth.fields import check_fields, option
from rdepth.run.config import (
    CHECKPOINT_GATE_RULES,
    DEVICE_HELP,
    PROFILE_FORCE_HELP,
    check_autocast_name,
    check_device_name,
    check_force_profile,
)
from rdepth.sweep.stats import NOISE_THRESHOLD
from rdepth.threads import THREADS_HELP

DEFAULT_TAUS = (1e-5, 1e-4, 1e-3, 1e-2)
# Tokens of the timed cached generation (the decode latency) when --generate-tokens is not given.
DEFAULT_GENERATE_TOKENS = 16


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
    taus: tuple[float, ...] = option(DEFAULT_TAUS, "threshold grid for policies with a tau, e.g. 1e-5,1e-4", bounds="(0, inf)")
    grid: dict[str, tuple[float, ...]] = option(
        {}, "values for one policy instead of the tau grid or its own default, e.g. kl=1e-6,1e-5 or "
        "argmax_stable=1,2,4 (repeatable)",
    )
    k_max: tuple[int, ...] | None = option(
        None, "loop-step cap N (every group) or N,N,... (per group)", default_text="twice the model's eval loops",
    )
    tolerance: float = option(0.01, "relative perplexity increase over the full budget that counts as matched quality", bounds="[0, inf)")
    batch_size: int = option(8, "held-out windows per forward pass", bounds="[1, inf)")
    block_size: int | None = option(
        None, "tokens per window", default_text="the model's block size, at most the held-out text", bounds="[2, inf)")
    max_batches: int | None = option(4, "batches of windows evaluated per point", bounds="[1, inf)")
    timing: bool = option(
        True, "measure latency of every point: teacher-forced ms/token (a whole window per forward, time / "
        "tokens; not decode latency), batch 1 and batched, and the decode latency (see --generate-tokens)",
    )
    timing_batch_size: int = option(8, "windows in the batched latency measurement", bounds="[1, inf)")
    warmup: int = option(2, "untimed calls of each setting before the timed rounds", bounds="[0, inf)")
    repeats: int = option(
        5, "timed rounds; each round times every setting once, in a shuffled order (median and IQR kept)", bounds="[1, inf)")
    noise_threshold: float = option(
        NOISE_THRESHOLD, "a speedup is flagged 'within noise' when the IQRs overlap or either timing's "
        "IQR exceeds this fraction of its median", bounds="(0, inf)")
    generate_tokens: int | None = option(
        None, "decode latency: time greedy cached generation of this many tokens at batch 1 after "
        "--generate-prompt tokens, ms per generated token (0: skip)",
        default_text=f"{DEFAULT_GENERATE_TOKENS}, fewer when the window is shorter; none with --decode rest", bounds="[0, inf)")
    generate_prompt: int = option(16, "prompt tokens before the timed generation", bounds="[1, inf)")
    fixed_ladder: bool = option(True, "also measure every fixed budget 1..k_max (the fixed-budget curve)")
    decode: str = option(
        "head", "how kl, entropy_diff and argmax_stable read a group's state: head (final norm + head, a "
        "logit-lens reading) or rest (the layers after the group, later groups at --decode-loops steps, then "
        "the head; teacher-forced only)", choices=DECODE_MODES)
    decode_loops: int = option(1, "with --decode rest: loop steps each later group runs in a reading", bounds="[1, inf)")
    kl_direction: str = option(
        "new_old", "kl policy: new_old = KL(p_new || p_old) (the paper's Eq. 4) or old_new = KL(p_old || p_new) "
        "(Geiping et al.'s code)",
    )
    kl_prior: str = option(
        "none", "kl policy: none (the first reading is never compared) or uniform (compared with the uniform "
        "distribution, as Geiping et al.'s code starts)")
    autocast: str = option("none", "autocast dtype during evaluation and timing: none, bf16 or fp16")
    difficulties: tuple[int, ...] | None = option(
        None, "task data: held-out difficulties to sweep", default_text="the top training difficulty")
    task_windows: int | None = option(
        None, "task data: held-out windows (problems, one per window when they fill it) per difficulty",
        default_text="all", bounds="[1, inf)")
    exit_profile: str | None = option(
        None, "also measure this exit profile (rdepth calibrate: one threshold per group) beside the policy grid",
        default_text="none")
    force_profile: bool = option(False, PROFILE_FORCE_HELP)
    accuracy_tolerance: float = option(
        0.01, "task data: accuracy below the full budget's that counts as matched (a fraction: 0.01 = one point)", bounds="[0, 1]")
    seed: int = option(0, "seed of the initial loop-state noise", bounds=f"[0, {2**63})")
    device: str = option("auto", DEVICE_HELP)
    progress: bool = option(True, "show a progress bar over the sweep points")
    threads: int = option(0, THREADS_HELP + "; fewer threads than cores steadies timings on a shared machine", bounds="[0, inf)")

    def __post_init__(self) -> None:
        from rdepth.exits.registry import get_policy_class

        self.policies = _checked_policies(self.policies)
        check_force_profile("sweep", self)
        check_fields(self, "sweep")
        self.taus = tuple(float(t) for t in self.taus)
        self.grid = _checked_grid(self.grid)
        self._check_bounded_and_trained()
        self.k_max = checked_k_max("sweep", self.k_max)
        if self.decode == "rest" and self.timing and self.generate_tokens:
            raise RdepthError(
                "sweep: decode=rest is defined for teacher-forced windows only; cached generation would need "
                "the later layers to read the key/value cache without writing it (set generate_tokens 0)"
            )
        directions = get_policy_class("kl").DIRECTIONS
        if self.kl_direction not in directions:
            raise RdepthError(f"sweep: kl_direction must be one of {', '.join(directions)}, got {self.kl_direction!r}")
        priors = get_policy_class("kl").PRIORS
        if self.kl_prior not in priors:
            raise RdepthError(f"sweep: kl_prior must be one of {', '.join(priors)}, got {self.kl_prior!r}")
        check_autocast_name("sweep", self.autocast)
        self.check_flags_apply(changed_fields(self))
        if self.difficulties is not None:
            self.difficulties = tuple(int(d) for d in self.difficulties)
            if not self.difficulties:
                raise RdepthError("sweep: difficulties is empty")
        if self.task_windows is not None and (isinstance(self.task_windows, bool) or self.task_windows < 1):
            raise RdepthError(f"sweep: task_windows must be >= 1, got {self.task_windows!r}")
        if not (isinstance(self.accuracy_tolerance, (int, float)) and 0 <= self.accuracy_tolerance <= 1):
            raise RdepthError(f"sweep: accuracy_tolerance must be a fraction in [0, 1], got {self.accuracy_tolerance!r}")
        check_device_name("sweep", self.device)

    def check_flags_apply(self, given) -> None:
        """A one-line error for a flag in ``given`` (field names) that no swept policy reads."""
        check_rule_flags_apply("sweep", given, self.policies, decode=self.decode, profile=self.exit_profile is not None)

    def _check_bounded_and_trained(self) -> None:
        """A one-line error before any work: a tau above a rule's bound (confidence, learned: 1); a trained
        rule (learned) on a checkpoint without a gate trained for it."""
        from rdepth.exitrun.gate_file import load_gate
        from rdepth.exits.registry import get_policy_class

        for name in self.policies:
            cls = get_policy_class(name)
            values = self.values(name)
            if not values:
                raise RdepthError(f"sweep: {name} takes tau in (0, {cls.tau_max:g}] and --taus holds none; give "
                                  f"--grid {name}=...")
            if cls.tau_max is not None and cls.sweep_parameter == "tau" and max(values) > cls.tau_max:
                raise RdepthError(f"sweep: {name} takes tau in (0, {cls.tau_max:g}]; the grid holds {max(values):g}")
            if name == "ouro" and self.checkpoint:  # Ouro's gate is inside the model: read it now
                from rdepth.exits.registry import make_policy

                make_policy(name, tau=min(values), k_max=1, **self.policy_options(name))
            elif cls.trained and self.checkpoint:
                load_gate(self.checkpoint)

    @property
    def max_windows(self) -> int | None:
        """Held-out windows evaluated per point (None: every window of the text)."""
        return None if self.max_batches is None else self.max_batches * self.batch_size

    def policy_options(self, policy: str) -> dict:
        """Options every point of ``policy`` is built with (besides its swept parameter)."""
        if policy in CHECKPOINT_GATE_RULES:  # the checkpoint's own gate (rdepth gate's, or Ouro's in the model)
            return {"gate": self.checkpoint}
        return {"direction": self.kl_direction, "prior": self.kl_prior} if policy == "kl" else {}

    def values(self, policy: str) -> tuple[float, ...]:
        """The values swept for ``policy``: its ``grid`` entry, else its own default grid, else ``taus`` (those
        within a bounded rule's range: confidence and learned take tau in (0, 1])."""
        from rdepth.exits.registry import get_policy_class

        if policy in self.grid:
            return self.grid[policy]
        cls = get_policy_class(policy)
        if cls.default_grid is not None:
            return tuple(cls.default_grid)
        return tuple(t for t in self.taus if cls.tau_max is None or t <= cls.tau_max)

    def resolve_k_max(self, n_groups: int, eval_loops: tuple[int, ...]) -> tuple[int, ...]:
        """The per-group step cap for a model with ``n_groups`` groups and these eval loop counts."""
        return resolve_k_max("sweep", self.k_max, n_groups, eval_loops)

    def generate_tokens_for(self, window: int) -> int:
        """Tokens of the timed generation for windows of ``window`` tokens (see
        :meth:`MeasureSettings.generate_tokens_for`)."""
        return self.measure_settings().generate_tokens_for(window)

    def measure_settings(self) -> MeasureSettings:
        """The fields that measuring one point needs, and no others (what the sweep's steps are handed)."""
        return MeasureSettings(**{f.name: getattr(self, f.name) for f in fields(MeasureSettings)})


def _checked_policies(policies: tuple[str, ...] | None) -> tuple[str, ...]:
    """The policies to sweep: every sweepable one by default; a one-line error for none, an unknown name
    or ``fixed`` (the baseline, always measured)."""
    from rdepth.exits.registry import get_policy_class, sweepable_policies

    policies = sweepable_policies() if policies is None else tuple(policies)
    if not policies:
        raise RdepthError("sweep: policies is empty")
    for name in policies:
        get_policy_class(name)  # unknown names fail here
        if name == "fixed":
            raise RdepthError("sweep: 'fixed' is the baseline and always included; leave it out of policies")
    return policies


def _checked_grid(grid: dict) -> dict[str, tuple[float, ...]]:
    """``--grid policy=v1,v2``: known policies, each with a non-empty list of positive finite values."""
    from rdepth.exits.registry import get_policy_class

    checked = {}
    for name, values in dict(grid).items():
        get_policy_class(name)
        values = tuple(values)
        if not values:
            raise RdepthError(f"sweep: the grid for {name} is empty")
        if not all(math.isfinite(float(v)) and float(v) > 0 for v in values):
            raise RdepthError(f"sweep: the grid for {name} must hold positive finite numbers, got {values}")
        checked[name] = values
    return checked


@dataclass(frozen=True)
class MeasureSettings:
    """What measuring a sweep point takes from :class:`SweepConfig`: held-out quality (``batch_size``,
    ``seed``, ``autocast``), the decoded rules' reading (``decode``, ``decode_loops``) and latency
    (``timing`` and the rest). The measuring steps see these fields only."""

    batch_size: int
    seed: int
    autocast: str
    decode: str
    decode_loops: int
    timing: bool
    timing_batch_size: int
    generate_prompt: int
    generate_tokens: int | None
    warmup: int
    repeats: int

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
