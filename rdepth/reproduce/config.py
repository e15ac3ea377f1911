"""Settings of ``rdepth reproduce two-scale`` (torch-free, so that ``rdepth --help`` stays fast).

Fields left at None take a default that depends on the device kind ("cuda" or
"cpu"), from :data:`DEVICE_DEFAULTS`, through :meth:`ReproduceConfig.for_device`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.fields import check_fields, option
from rdepth.threads import THREADS_HELP

# The paper's threshold grid (Appendix D) and its three rules, plus the scale-free forms.
PAPER_TAUS = (1e-5, 1e-4, 1e-3, 1e-2)
PAPER_POLICIES = ("step_norm", "step_norm_rel", "kl", "acceleration", "acceleration_rel")
MAX_MINUTES = 24 * 60
# Claim 4 is judged along fronts (rdepth.reproduce.fronts): each judged rule swept on a grid that spans its own
# range, whatever the state's scale (issue 40 item 4). Eq. 6's bounded acceleration lies in [0, 1) and on a loop
# contracting by rho per step is at least (1 - rho) / (1 + rho): the paper's 1e-5..1e-2 never fires it. The
# relative step ||Δ|| / ||x|| reaches the 1e-3 noise floor; KL is in nats. The absolute rules keep PAPER_TAUS.
SCALE_FREE_GRID = {"acceleration_rel": (0.05, 0.1, 0.2, 0.4, 0.8), "step_norm_rel": (3e-3, 1e-2, 3e-2, 0.1, 0.3),
                   "kl": (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)}

# On CUDA, the `paper` and `small` sizes join the default sizes from this budget on. On an H100 their
# probes ran at about 108k and 104k tokens/s, and a long run trains slower than its probe (`mini`: 154k
# against 196k), so either needs about 14 minutes in all for 50M tokens (docs/reproduce.md). Below
# that, timing them only costs the budget their probes (32 s for `small` in the 9-minute run).
PAPER_SIZE_MINUTES = 15.0

# Per device kind: the defaults of the fields left at None.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": dict(sizes=("mini",), min_tokens=50_000_000, compile=True, probe_steps=8,
                 analyze_sequences=32, sweep_windows=64, val_windows=256, generate_tokens=8, repeats=3),
    "cpu": dict(sizes=("tiny", "toy"), min_tokens=200_000, compile=False, probe_steps=3, analyze_sequences=4,
                sweep_windows=8, val_windows=32, generate_tokens=0, repeats=1),
}


@dataclass
class ReproduceConfig:
    """One ``rdepth reproduce two-scale`` run: where, how long, on what data and device."""

    out: str = option("runs/reproduce", "output folder: data (unless --data), plan, training run, report, "
                                        "claims.json")
    minutes: float = option(9.0, "time budget of the whole command in minutes (prepare, speed probe, training, "
                                 "analysis, sweep, report); the default fits one H100 inside 10 minutes",
                            bounds=f"(0, {MAX_MINUTES}]")
    device: str = option("auto", "auto (CUDA when present), cpu or cuda[:N]")
    data: str | None = option(None, "prepared data folder (from rdepth prepare)", default_text="OUT/data")
    corpus: str | None = option(
        None, "when --data holds no prepared data: prepare this corpus into it first (any corpus rdepth prepare "
        "accepts, e.g. wiki or a file/folder)", default_text="none: --data must be prepared")
    tokenizer: str = option("gpt2", "tokenizer for --corpus (gpt2 or bpe:N)")
    max_documents: int | None = option(None, "with --corpus: prepare only the first N documents", default_text="all",
                                       bounds="[1, inf)")
    workers: int | None = option(None, "with --corpus: tokenizing processes", default_text="the machine's cores",
                                 bounds="[1, inf)")
    sizes: tuple[str, ...] | None = option(
        None, "model sizes to choose from, largest first (see rdepth.reproduce.plan.SIZES); the first is timed "
        "first", default_text="mini on CUDA (paper,small,mini from 15 minutes); tiny,toy on CPU")
    min_tokens: int | None = option(
        None, "training tokens the chosen size should reach: the largest size that reaches them in the budget "
        "is chosen (else the one that trains on the most)", default_text="50M on CUDA, 200k on CPU",
        bounds="[1, inf)")
    train_share: float = option(0.7, "share of the time left after preparing and timing that training gets; "
                                     "the rest is for validation, checkpoints, analysis, sweep and report",
                                bounds="(0, 1)")
    checkpoints: int = option(4, "checkpoints spread evenly over training (the geometry series)", bounds="[1, inf)")
    compile: bool | None = option(None, "torch.compile the layers in training (bf16 autocast is always on with "
                                        "CUDA)", default_text="on with CUDA")
    probe_steps: int | None = option(None, "timed training steps of the speed probe (after its warm-up steps)",
                                     default_text="8 on CUDA, 3 on CPU", bounds="[1, inf)")
    analyze_sequences: int | None = option(None, "held-out windows of the geometry analysis",
                                           default_text="32 on CUDA, 4 on CPU", bounds="[1, inf)")
    long_loops: int = option(30, "the long loop budget of the geometry analysis (the paper's Fig. 5: 30)",
                             bounds="[1, inf)")
    sweep_windows: int | None = option(None, "held-out windows of the exit sweep (quality on all of them)",
                                       default_text="64 on CUDA, 8 on CPU", bounds="[1, inf)")
    val_windows: int | None = option(None, "held-out windows of the validation perplexity at each loop budget",
                                     default_text="256 on CUDA, 32 on CPU", bounds="[1, inf)")
    policies: tuple[str, ...] = option(PAPER_POLICIES, "exit policies swept (the fixed budget is always measured)")
    taus: tuple[float, ...] = option(PAPER_TAUS, "threshold grid (the paper's Appendix D)", bounds="(0, inf)")
    timing_batch: int = option(32, "windows per forward in the throughput measurement (latency is at batch 1)",
                               bounds="[1, inf)")
    generate_tokens: int | None = option(
        None, "also time greedy cached decoding of this many tokens at batch 1 (decode latency; 0: teacher-forced "
        "latency only)", default_text="8 on CUDA, 0 on CPU", bounds="[0, inf)")
    repeats: int | None = option(None, "timed rounds of the latency measurement (median and IQR)",
                                 default_text="3 on CUDA, 1 on CPU", bounds="[1, inf)")
    export_dir: str | None = option(
        None, "also copy the few files worth bringing back (at most 8, see docs/reproduce.md) into this folder",
        default_text="none")
    seed: int = option(0, "seed of the training run and of every held-out measurement", bounds="[0, inf)")
    threads: int = option(0, THREADS_HELP, bounds="[0, inf)")
    mean_loops: float | None = option(
        None, "every size's mean training loop count instead of its own (the paper's recipe: 12)",
        default_text="the size's")
    backprop_depth: int | None = option(
        None, "every size's truncated-backprop depth instead of its own (the paper's recipe: 8)",
        default_text="the size's")
    loop_state: str | None = option(
        None, "every size's loop state: sandwich (Geiping et al.) or residual (a residual stream)",
        default_text="sandwich")

    def __post_init__(self) -> None:
        from rdepth.reproduce.plan import SIZES

        if not isinstance(self.out, str) or not self.out:
            raise RdepthError("reproduce: out must be a non-empty path")
        if self.device not in ("auto", "cpu", "cuda") and not (
                isinstance(self.device, str) and self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise RdepthError(f"reproduce: device must be auto, cpu or cuda[:N], got {self.device!r}")
        loops = {name: getattr(self, name) for name in ("mean_loops", "backprop_depth", "loop_state")}
        if any(value is not None for value in loops.values()):
            from rdepth.config import get_preset

            get_preset("tiny", **{k: v for k, v in loops.items() if v is not None})  # validates them, one line
        if self.sizes is not None:
            self.sizes = _known_names("sizes", self.sizes, SIZES, "size")
        self.taus = tuple(float(t) for t in self.taus)
        check_fields(self, "reproduce")
        self.policies = _known_policies(self.policies)
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus.strip()):
            raise RdepthError("reproduce: corpus must be a corpus name or a path")
        if self.data is None:
            self.data = str(Path(self.out) / "data")

    @property
    def budget_seconds(self) -> float:
        return 60.0 * float(self.minutes)

    def for_device(self, kind: str) -> ReproduceConfig:
        """A copy with every None field set to its default for device kind ``kind`` ("cuda" or "cpu")."""
        if kind not in DEVICE_DEFAULTS:
            raise RdepthError(f"reproduce: no defaults for device kind {kind!r}")
        values = dataclasses.asdict(self)
        for name, default in DEVICE_DEFAULTS[kind].items():
            if values[name] is None:
                values[name] = default
                if name == "sizes" and kind == "cuda" and self.minutes >= PAPER_SIZE_MINUTES:
                    values[name] = ("paper", "small", *default)
        return ReproduceConfig(**values)

    def grid(self) -> dict[str, tuple[float, ...]]:
        """The sweep's per-policy grids: SCALE_FREE_GRID for the swept policies it names (the rest: ``taus``)."""
        return {name: values for name, values in SCALE_FREE_GRID.items() if name in self.policies}

    def sweep_settings(self) -> int:
        """Policy points the sweep measures: each policy's grid, or ``taus``."""
        grid = self.grid()
        return sum(len(grid.get(name, self.taus)) for name in self.policies)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _known_names(field: str, names, known, what: str) -> tuple[str, ...]:
    """``names`` as a non-empty tuple of names from ``known``; a one-line error otherwise."""
    names = tuple(names)
    if not names:
        raise RdepthError(f"reproduce: {field} is empty")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise RdepthError(f"reproduce: unknown {what} {unknown[0]!r} (choose from {', '.join(known)})")
    return names


def _known_policies(policies) -> tuple[str, ...]:
    """The exit policies to sweep, each a registered name (an unknown one fails here, before any work)."""
    from rdepth.exits.registry import get_policy_class

    policies = tuple(policies)
    if not policies:
        raise RdepthError("reproduce: policies is empty")
    for name in policies:
        get_policy_class(name)
    return policies
