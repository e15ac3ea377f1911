"""The latency-quality sweep of exit policies (paper §4, Figure 4, Appendix D).

For each policy and each value of its grid (``tau`` on a log scale, 1e-5 ...
1e-2 by default; ``patience`` for ``argmax_stable``) the sweep evaluates
held-out text teacher-forced with per-token exits and records: cross-entropy
and perplexity, mean loop steps per group, histograms of the steps computed
and of the state handed on, and ms/token at batch 1 and batched (warm,
synchronised, median of repeats). Every point gets a baseline: the fixed
budget at its mean steps (rounded per group). The full budget (every group at
``k_max``) is the reference, and a ladder of fixed budgets gives the
fixed-budget latency-quality curve.

Computing and saving (:func:`run_sweep`, :func:`write_sweep`) are separate
from drawing (:mod:`rdepth.exits.plots`), which reads ``sweep.json``.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from rdepth.errors import RdepthError
from rdepth.exits.base import POLICIES, ExitPolicy, get_policy_class
from rdepth.exits.controller import PolicyController
from rdepth.exits.evaluate import evaluate_with_exits
from rdepth.exits.timing import time_forward, time_generate
from rdepth.io import environment_info, write_json, write_text
from rdepth.model import RecurrentLM

log = logging.getLogger(__name__)

DEFAULT_TAUS = (1e-5, 1e-4, 1e-3, 1e-2)
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_policies() -> tuple[str, ...]:
    """Every registered policy except ``fixed`` (the baseline, always included)."""
    return tuple(name for name in POLICIES if name != "fixed")


@dataclass
class SweepConfig:
    """What to sweep and how to measure it.

    ``k_max``: per-group step cap (one value for every group or one per group);
    None: twice the model's evaluation loop counts. ``grids``: per-policy
    values replacing ``taus`` (or the policy's own default grid).
    ``max_batches`` x ``batch_size`` windows of ``block_size`` tokens are
    evaluated; timing uses the first ``timing_batch_size`` windows (batched)
    and the first window alone (batch 1); with ``generate_tokens`` > 0 also
    greedy cached generation of that many tokens after a ``generate_prompt``
    token prompt (ms per generated token, batch 1).
    """

    policies: tuple[str, ...] = field(default_factory=default_policies)
    taus: tuple[float, ...] = DEFAULT_TAUS
    grids: dict[str, tuple[float, ...]] = field(default_factory=dict)
    k_max: tuple[int, ...] | None = None
    batch_size: int = 8
    block_size: int | None = None
    max_batches: int | None = 4
    timing: bool = True
    timing_batch_size: int = 8
    warmup: int = 2
    repeats: int = 5
    generate_tokens: int = 0
    generate_prompt: int = 16
    fixed_ladder: bool = True
    autocast: str = "none"
    seed: int = 0

    def __post_init__(self) -> None:
        self.policies = tuple(self.policies)
        if not self.policies:
            raise RdepthError("sweep: policies is empty")
        for name in self.policies:
            get_policy_class(name)  # unknown names fail here
            if name == "fixed":
                raise RdepthError("sweep: 'fixed' is the baseline and always included; leave it out of policies")
        self.taus = tuple(float(t) for t in self.taus)
        if not self.taus or not all(math.isfinite(t) and t > 0 for t in self.taus):
            raise RdepthError(f"sweep: taus must be positive finite numbers, got {self.taus}")
        grids = {}
        for name, values in self.grids.items():
            get_policy_class(name)
            values = tuple(values)
            if not values:
                raise RdepthError(f"sweep: the grid for {name} is empty")
            grids[name] = values
        self.grids = grids
        if self.k_max is not None:
            self.k_max = tuple(int(k) for k in self.k_max)
            if not self.k_max or any(k < 1 for k in self.k_max):
                raise RdepthError(f"sweep: k_max must be positive integers, got {self.k_max}")
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
        if self.autocast not in AUTOCAST:
            raise RdepthError(f"sweep: autocast must be one of {', '.join(AUTOCAST)}, got {self.autocast!r}")

    def grid(self, name: str) -> tuple[float, ...]:
        """The values swept for ``name``."""
        if name in self.grids:
            return self.grids[name]
        cls = get_policy_class(name)
        if cls.default_grid is not None:
            return tuple(cls.default_grid)
        return self.taus

    def resolve_k_max(self, model: RecurrentLM) -> tuple[int, ...]:
        if self.k_max is None:
            return tuple(2 * k for k in model.config.default_eval_loops)
        if len(self.k_max) == 1:
            return self.k_max * model.n_groups
        if len(self.k_max) != model.n_groups:
            raise RdepthError(f"sweep: {len(self.k_max)} k_max values for a model with {model.n_groups} groups")
        return self.k_max


def policy_controller_factory(
    name: str, value: float, k_max: Sequence[int], decode: Callable | None
) -> Callable[[], PolicyController]:
    """A factory of fresh controllers running ``name`` with its sweep parameter set to ``value``."""
    cls = get_policy_class(name)

    def build_policy(group: int) -> ExitPolicy:
        if cls.sweep_parameter == "tau":
            return cls(tau=value, k_max=int(k_max[group]))
        return cls(k_max=int(k_max[group]), **{cls.sweep_parameter: _as_option(value)})

    build_policy(0)  # validate the settings before any work
    return lambda: PolicyController(build_policy, decode=decode)


def _as_option(value: float) -> Any:
    return int(value) if float(value).is_integer() else value


class _Measurer:
    """Evaluates and times one setting on fixed windows; caches fixed budgets."""

    def __init__(self, model: RecurrentLM, tokens: np.ndarray, config: SweepConfig, device: torch.device):
        self.model = model
        self.tokens = tokens
        self.config = config
        self.device = device
        self.block_size = config.block_size or model.config.block_size
        self.autocast = AUTOCAST[config.autocast]
        n_windows = (len(tokens) - 1) // self.block_size
        if n_windows < 1:
            raise RdepthError(
                f"held-out text has {len(tokens)} tokens, fewer than one window of {self.block_size} + 1"
            )
        windows = min(n_windows, config.timing_batch_size)
        starts = np.arange(windows) * self.block_size
        timing = np.stack([np.asarray(tokens[s : s + self.block_size], dtype=np.int64) for s in starts])
        self.timing_idx = torch.from_numpy(timing).to(device)
        if config.timing and config.generate_tokens:
            if config.generate_prompt + config.generate_tokens > min(self.block_size, model.config.block_size):
                raise RdepthError(
                    f"sweep: generate_prompt + generate_tokens = {config.generate_prompt + config.generate_tokens} "
                    f"exceeds the window of {self.block_size} tokens"
                )
        self.fixed_cache: dict[tuple[int, ...], dict] = {}

    def _eval(self, **kwargs) -> dict:
        config = self.config
        result = evaluate_with_exits(
            self.model, self.tokens, batch_size=config.batch_size, block_size=self.block_size,
            max_batches=config.max_batches, device=self.device, seed=config.seed,
            autocast_dtype=self.autocast, **kwargs,
        ).to_dict()
        return result

    def _time(self, **kwargs) -> dict:
        if not self.config.timing:
            return {}
        timings = {}
        for label, idx in (("b1", self.timing_idx[:1]), ("batched", self.timing_idx)):
            measured = time_forward(
                self.model, idx, warmup=self.config.warmup, repeats=self.config.repeats,
                seed=self.config.seed, autocast_dtype=self.autocast, **kwargs,
            )
            timings[f"ms_per_token_{label}"] = measured["ms_per_token"]
        timings["timing_batch_size"] = int(self.timing_idx.shape[0])
        if self.config.generate_tokens:
            measured = time_generate(
                self.model, self.timing_idx[:1, : self.config.generate_prompt], self.config.generate_tokens,
                warmup=min(self.config.warmup, 1), repeats=self.config.repeats, seed=self.config.seed, **kwargs,
            )
            timings["ms_per_token_generate"] = measured["ms_per_token"]
        return timings

    def policy(self, factory: Callable[[], PolicyController]) -> dict:
        return {**self._eval(controller=factory), **self._time(controller_factory=factory)}

    def fixed(self, budget: Sequence[int]) -> dict:
        budget = tuple(int(k) for k in budget)
        if budget not in self.fixed_cache:
            self.fixed_cache[budget] = {
                "budget": list(budget),
                **self._eval(loop_counts=budget),
                **self._time(loop_counts=budget),
            }
        return self.fixed_cache[budget]


def run_sweep(
    model: RecurrentLM, tokens: np.ndarray, config: SweepConfig, *, device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict:
    """Run the sweep; returns the JSON-ready result (see the module docstring).

    ``tokens``: 1-D held-out token ids. The model is put in eval mode on ``device``.
    """
    device = torch.device(device)
    model = model.to(device).eval()
    k_max = config.resolve_k_max(model)
    block_size = config.block_size or model.config.block_size
    if block_size > model.config.block_size:
        raise RdepthError(f"sweep: block_size {block_size} exceeds the model's {model.config.block_size}")
    used_tokens = np.asarray(tokens[: (config.max_batches or 1 << 30) * config.batch_size * block_size + 1])
    if used_tokens.size and int(used_tokens.max()) >= model.config.vocab_size:
        raise RdepthError(
            f"held-out text has token id {int(used_tokens.max())}, beyond the model's vocabulary of "
            f"{model.config.vocab_size}: data and checkpoint use different tokenizers"
        )
    measurer = _Measurer(model, tokens, config, device)
    log.info("sweep: k_max %s, reference = fixed budget %s", list(k_max), list(k_max))
    reference = measurer.fixed(k_max)
    settings = [(name, value) for name in config.policies for value in config.grid(name)]
    points = []
    for name, value in tqdm(settings, desc="sweep", disable=not progress):
        factory = policy_controller_factory(name, value, k_max, model.readout)
        point = {"policy": name, "parameter": get_policy_class(name).sweep_parameter, "value": value}
        point.update(measurer.policy(factory))
        budget = [max(1, min(cap, round(mean))) for mean, cap in zip(point["mean_steps"], k_max)]
        point["baseline"] = measurer.fixed(budget)
        points.append(point)
        log.info(
            "%s %s=%g: steps %s ppl %.4f (fixed %s: %.4f)", name, point["parameter"], value,
            [round(m, 2) for m in point["mean_steps"]], point["ppl"], budget, point["baseline"]["ppl"],
        )
    ladder = []
    if config.fixed_ladder:
        for steps in range(1, max(k_max) + 1):
            ladder.append(measurer.fixed([min(steps, cap) for cap in k_max]))
    return {
        "config": {**asdict(config), "k_max": list(k_max), "block_size": block_size},
        "environment": environment_info() | {"device": _device_name(device)},
        "model": model.config.to_dict(),
        "k_max": list(k_max),
        "reference": reference,
        "points": points,
        "fixed_ladder": ladder,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


# ------------------------------------------------------------------ summaries


TIMINGS = ("b1", "batched", "generate")


def matched_quality(result: dict, tolerance: float = 0.01, timing: str = "b1") -> list[dict]:
    """Per policy, its fastest point within ``tolerance`` of the full budget's perplexity.

    "Fastest" by ``ms_per_token_<timing>`` (by loop steps without timing).
    The chosen point is compared with the full budget and with the cheapest
    fixed budget (fewest steps, among the ladder and the per-point baselines)
    reaching the same quality. Rows: policy, value, ppl, ppl_vs_full, steps
    (mean, summed over groups), steps_saved (vs the full budget) and, per
    measured timing t, ``ms_per_token_t``, ``speedup_vs_full_t`` and
    ``speedup_vs_fixed_t`` (> 1: the policy is faster). A policy with no
    point within tolerance gets ``value`` None.
    """
    if timing not in TIMINGS:
        raise RdepthError(f"matched_quality: timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    reference = result["reference"]
    limit = reference["ppl"] * (1.0 + tolerance)
    primary = f"ms_per_token_{timing}"
    fixed_pool = list(result.get("fixed_ladder", [])) + [p["baseline"] for p in result["points"]]
    fixed_ok = [f for f in fixed_pool if f["ppl"] <= limit]
    best_fixed = min(fixed_ok, key=lambda f: (sum(f["budget"]), f.get(primary, 0.0))) if fixed_ok else None
    rows = []
    for name in dict.fromkeys(p["policy"] for p in result["points"]):
        candidates = [p for p in result["points"] if p["policy"] == name and p["ppl"] <= limit]
        row: dict[str, Any] = {"policy": name, "value": None}
        if candidates:
            best = min(candidates, key=lambda p: (p.get(primary, 0.0), sum(p["mean_steps"])))
            steps, full_steps = sum(best["mean_steps"]), sum(result["k_max"])
            row.update(
                value=best["value"], ppl=best["ppl"], ppl_vs_full=best["ppl"] / reference["ppl"] - 1.0,
                steps=steps, steps_saved=1.0 - steps / full_steps,
            )
            for t in TIMINGS:
                key = f"ms_per_token_{t}"
                if key not in best:
                    continue
                row[key] = best[key]
                row[f"speedup_vs_full_{t}"] = reference[key] / best[key]
                if best_fixed is not None and key in best_fixed:
                    row[f"speedup_vs_fixed_{t}"] = best_fixed[key] / best[key]
        if best_fixed is not None:
            row["matched_fixed_budget"] = best_fixed["budget"]
        rows.append(row)
    return rows


# ------------------------------------------------------------------ saving

CSV_FIELDS = (
    "policy", "parameter", "value", "ce", "ppl", "mean_steps", "mean_used",
    "ms_per_token_b1", "ms_per_token_batched", "ms_per_token_generate",
    "baseline_budget", "baseline_ce", "baseline_ppl", "baseline_ms_per_token_b1", "baseline_ms_per_token_batched",
    "baseline_ms_per_token_generate",
)


def sweep_rows(result: dict) -> list[dict]:
    """Flat rows (one per point, then the reference and the ladder) for the CSV."""
    rows = []

    def fixed_row(kind: str, fixed: dict) -> dict:
        return {
            "policy": kind, "parameter": "budget", "value": "|".join(map(str, fixed["budget"])),
            "ce": fixed["ce"], "ppl": fixed["ppl"], "mean_steps": _join(fixed["mean_steps"]),
            "mean_used": _join(fixed["mean_used"]), "ms_per_token_b1": fixed.get("ms_per_token_b1"),
            "ms_per_token_batched": fixed.get("ms_per_token_batched"),
            "ms_per_token_generate": fixed.get("ms_per_token_generate"),
        }

    for point in result["points"]:
        base = point["baseline"]
        rows.append({
            "policy": point["policy"], "parameter": point["parameter"], "value": point["value"],
            "ce": point["ce"], "ppl": point["ppl"], "mean_steps": _join(point["mean_steps"]),
            "mean_used": _join(point["mean_used"]), "ms_per_token_b1": point.get("ms_per_token_b1"),
            "ms_per_token_batched": point.get("ms_per_token_batched"),
            "ms_per_token_generate": point.get("ms_per_token_generate"),
            "baseline_budget": "|".join(map(str, base["budget"])), "baseline_ce": base["ce"],
            "baseline_ppl": base["ppl"], "baseline_ms_per_token_b1": base.get("ms_per_token_b1"),
            "baseline_ms_per_token_batched": base.get("ms_per_token_batched"),
            "baseline_ms_per_token_generate": base.get("ms_per_token_generate"),
        })
    rows.append(fixed_row("fixed_full", result["reference"]))
    rows.extend(fixed_row("fixed", fixed) for fixed in result.get("fixed_ladder", []))
    return rows


def _join(values: Sequence[float]) -> str:
    return "|".join(f"{v:.4f}" for v in values)


def write_sweep(result: dict, out: str | Path, *, report: bool = True) -> dict[str, Path]:
    """Save ``sweep.json``, ``sweep.csv``, the figures and (``report``) the page section."""
    out = Path(out)
    paths = {"json": out / "sweep.json", "csv": out / "sweep.csv"}
    write_json(paths["json"], result)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in sweep_rows(result):
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    write_text(paths["csv"], buffer.getvalue())
    from rdepth.exits.plots import save_sweep_figures

    paths.update(save_sweep_figures(result, out / "figures"))
    if report:
        from rdepth.exits.report_section import write_report_section

        paths["report"] = write_report_section(result, out, {k: v for k, v in paths.items() if k.startswith("fig")})
    return paths
