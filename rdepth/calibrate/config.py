"""Settings of ``rdepth calibrate`` (torch-free at import)."""

from __future__ import annotations

from dataclasses import dataclass

from rdepth.config import MAX_LOOPS
from rdepth.errors import RdepthError
from rdepth.exits.config import changed_fields, check_rule_flags_apply, checked_k_max, resolve_k_max
from rdepth.fields import check_fields, option
from rdepth.run.config import CHECKPOINT_GATE_RULES, DEVICE_HELP, check_device_name
from rdepth.threads import THREADS_HELP

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
        "task: accuracy drop, 0.01 = one point)", default_text="none; or give --mean-steps", bounds="[0, 1)")
    mean_steps: float | None = option(None, "target: mean loop steps per token summed over groups",
                                      default_text="none; or give --max-quality-loss", bounds=f"(0, {MAX_LOOPS * 1024}]")
    values: tuple[float, ...] | None = option(
        None, "candidate values of the policy's parameter", default_text="1e-6 .. 3 (tau) or the policy's grid", bounds="(0, inf)")
    k_max: tuple[int, ...] | None = option(
        None, "loop-step cap N (every group) or N,N,... (per group)", default_text="twice the model's eval loops")
    windows: int = option(128, "held-out windows the thresholds are chosen on (text: with --validation-windows at most "
                                "the split holds, an error beyond; task: capped at half the held-out set)", bounds="[1, inf)")
    validation_windows: int = option(128, "further held-out windows the chosen profile is checked on", bounds="[1, inf)")
    difficulty: int | None = option(None, "task data: the held-out difficulty to calibrate on",
                                    default_text="the top training difficulty", bounds="[1, inf)")
    kl_direction: str = option("new_old", "kl policy: new_old or old_new (see rdepth sweep)")
    kl_prior: str = option("none", "kl policy: none or uniform (see rdepth sweep)")
    batch_size: int = option(16, "windows per forward pass", bounds="[1, inf)")
    refine_rounds: int = option(
        3, "real runs on the calibration windows that may correct the additive estimate: while the chosen "
        "profile misses the target there, the estimate's error is taken off the target and the choice made "
        "again (0: trust the estimate)", bounds="[0, 20]")
    out: str | None = option(None, "where to write the profile (JSON; never overwritten)",
                             default_text="RUN/exit_profile_<policy>.json")
    seed: int = option(0, "seed of the initial loop-state noise", bounds=f"[0, {2**63})")
    device: str = option("auto", DEVICE_HELP)
    threads: int = option(0, THREADS_HELP, bounds="[0, inf)")

    def __post_init__(self) -> None:
        from rdepth.exits.registry import get_policy_class

        cls = get_policy_class(self.policy)
        if self.policy == "fixed":
            raise RdepthError("calibrate: 'fixed' has no threshold to calibrate")
        if (self.max_quality_loss is None) == (self.mean_steps is None):
            raise RdepthError("calibrate: give exactly one of --max-quality-loss and --mean-steps")
        check_fields(self, "calibrate")
        if self.values is not None:
            self.values = tuple(float(v) for v in self.values)
        if cls.sweep_parameter is None:
            raise RdepthError(f"calibrate: policy {self.policy!r} has no parameter to calibrate")
        self.k_max = checked_k_max("calibrate", self.k_max)
        if self.kl_direction not in get_policy_class("kl").DIRECTIONS:
            raise RdepthError(f"calibrate: kl_direction must be new_old or old_new, got {self.kl_direction!r}")
        if self.kl_prior not in get_policy_class("kl").PRIORS:
            raise RdepthError(f"calibrate: kl_prior must be none or uniform, got {self.kl_prior!r}")
        check_device_name("calibrate", self.device)
        self.check_flags_apply(changed_fields(self))

    def check_flags_apply(self, given) -> None:
        """A one-line error for a flag in ``given`` (field names) that the calibrated policy does not read."""
        check_rule_flags_apply("calibrate", given, (self.policy,))

    def candidate_values(self) -> tuple[float, ...]:
        from rdepth.exits.registry import get_policy_class

        if self.values is not None:
            return self.values
        cls = get_policy_class(self.policy)
        if cls.default_grid is not None:
            return tuple(cls.default_grid)
        return tuple(v for v in CALIBRATE_TAUS if cls.tau_max is None or v <= cls.tau_max)

    def policy_options(self) -> dict:
        if self.policy in CHECKPOINT_GATE_RULES:  # the checkpoint's own gate (rdepth gate's, or Ouro's in the model)
            return {"gate": self.checkpoint}
        return {"direction": self.kl_direction, "prior": self.kl_prior} if self.policy == "kl" else {}

    def resolve_k_max(self, n_groups: int, eval_loops: tuple[int, ...]) -> tuple[int, ...]:
        return resolve_k_max("calibrate", self.k_max, n_groups, eval_loops)
