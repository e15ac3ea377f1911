"""Size a reproduction to a time budget from a measured training speed (torch-free).

The run layer times a few real training steps of one size on the device (the
*probe*, :class:`Probe`): seconds per floating-point operation, from the steps'
wall times and the loop counts each step drew. A per-token FLOP count of every
size (:func:`train_flops`, :func:`forward_flops`) turns that into a step time
for each size and an estimate of everything after training (validation,
checkpoints, the loop-budget evaluation, the geometry analysis, the exit sweep
and the report: :func:`after_training_seconds`). :func:`plan_run` then gives
training its share of the time left and picks the largest size that trains on
at least ``min_tokens`` tokens, else the one that trains on the most.

The FLOP count is an approximation (smaller models run at lower efficiency,
evaluation at small batches lower still), so the pipeline times the chosen size
itself when it differs from the probed one, and records every estimate beside
the measured stage times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rdepth.config import ModelConfig, get_preset
from rdepth.errors import RdepthError


@dataclass(frozen=True)
class Size:
    """One model size: a preset with field overrides, and its training batch and learning rate."""

    preset: str
    overrides: dict[str, Any]
    batch_size: int
    lr: float
    note: str


# Largest first. Every size keeps the paper's layout of three groups (a self-loop, a paired
# loop, a self-loop) so that the drift between groups (claim 3) can be measured. Learning rates
# fall as 1 / width from the `tiny` size's 3e-3 at d=128 (AdamW steps in hidden matrices scale
# with width); with :func:`warmup_steps` they leave the unigram plateau on the medium corpus.
SIZES: dict[str, Size] = {
    "paper": Size("paper", {}, 32, 5e-4, "the paper's model: 12 layers, d=768, context 512, groups 4|5-6|7, r=12"),
    "small": Size("small", {}, 32, 7.5e-4, "12 layers, d=512, context 512, groups 4|5-6|7, r=8"),
    "mini": Size("small", dict(n_head=6, d_model=384, block_size=256, mean_loops=6.0, backprop_depth=4), 64, 1e-3,
                 "12 layers, d=384, context 256, groups 4|5-6|7, r=6"),
    "tiny": Size("tiny", {}, 16, 3e-3, "6 layers, d=128, context 128, groups 1|2-3|4, r=4"),
    "toy": Size("tiny", dict(n_head=2, d_model=64, block_size=64, mean_loops=4.0, backprop_depth=2), 8, 3e-3,
                "6 layers, d=64, context 64, groups 1|2-3|4, r=4 (plumbing checks on a CPU)"),
}

# Forward-only evaluation runs at smaller batches than training, with observers or exit
# controllers: seconds per FLOP this many times training's (1.5 matched the toy size on the CPU).
EVAL_OVERHEAD = 1.5
# Wall time per layer application in a forward call that is too small to be bound by FLOPs
# (kernel launches and Python on a GPU; dispatch on a CPU).
CALL_SECONDS = {"cuda": 3e-4, "cpu": 2e-4}
# Wall time per layer application of one decoded token on the sweep's packed cached path at batch 1,
# where host syncs dominate: the H100 run of the `mini` size spent 165 s in a sweep this model put at
# 74 s with CALL_SECONDS, all of the gap in decoding (9e-4 s per layer fits it; `paper` decodes at
# 67 ms for 56 layer applications, 1.2e-3); the CPU's `tiny` decodes at 7.9 ms for 18 (4.4e-4).
DECODE_CALL_SECONDS = {"cuda": 1e-3, "cpu": 4.5e-4}
# rdepth analyze per checkpoint, besides its forwards: loading, the per-step statistics, PCA and the
# figures (H100 run: 20.9 s for 4 checkpoints against 2.0 s of forwards; CPU toy run: 4.9 s against 0.7).
ANALYZE_SECONDS_PER_CHECKPOINT = {"cuda": 5.0, "cpu": 1.0}
# rdepth analyze measures in float64 (``AnalyzeConfig.precision``'s default, issue 26): its work costs
# this many times training's seconds per FLOP. CPU (AVX2): a vector holds half as many float64 numbers
# as float32. CUDA: a lead, not yet measured: the FP64 tensor rate (67 TFLOP/s on an H100) against the
# ~300 TFLOP/s bf16 training reached.
FLOAT64_SLOWDOWN = {"cuda": 6.0, "cpu": 2.0}
# The own-state Jacobian of one position (``torch.func.jacrev`` of a loop step over the position's
# prefix, d cotangents through one backward each) costs about this many loop-step forwards of the
# prefix per state dimension; vmap falls back to a Python loop over attention's backward on a CPU.
JACOBIAN_FORWARDS_PER_DIMENSION = {"cuda": 3.0, "cpu": 6.0}
DISK_BYTES_PER_SECOND = 5e8  # a checkpoint (weights and AdamW state) written
REPORT_SECONDS = {"cuda": 10.0, "cpu": 5.0}  # the claims, the claims page, the standalone page, the export
# A long run trains slower than the few probe steps (validation, logging, a busy machine: 10-40% on the
# shared 2-core CPU): its step time is planned at this multiple of the probe's. On the H100 the run
# trained 5% faster than its probe (175k against 167k tokens/s: compilation and warm-up were behind it).
SPEED_MARGIN = {"cuda": 1.05, "cpu": 1.2}
MIN_STEPS_PER_CHECKPOINT = 2
SAFETY_SECONDS = {"cuda": 20.0, "cpu": 5.0}  # kept free of any plan
# The validation the trainer runs at every checkpoint: batches x windows.
VAL_BATCHES, VAL_BATCH_SIZE = 4, 16
ANALYZE_BATCH = 4  # rdepth analyze's default windows per forward
SWEEP_WARMUP = 1  # untimed calls per setting before the timed rounds of the sweep


def size_config(name: str, vocab_size: int, tokenizer: str) -> ModelConfig:
    """The model config of size ``name`` for data with this vocabulary."""
    if name not in SIZES:
        raise RdepthError(f"unknown size {name!r} (choose from {', '.join(SIZES)})")
    size = SIZES[name]
    return get_preset(size.preset, **size.overrides, vocab_size=vocab_size, tokenizer=tokenizer)


# ------------------------------------------------------------------ FLOPs per token


def layer_flops(config: ModelConfig) -> float:
    """Forward FLOPs per token of one transformer layer: the matrices (attention 4 d^2, MLP
    2 x mlp_ratio x d^2, two FLOPs per multiply-add) and causal attention over T / 2 keys on average."""
    d = config.d_model
    return 2.0 * (4 + 2 * config.mlp_ratio) * d * d + 2.0 * config.block_size * d


def loop_step_flops(config: ModelConfig, group: int) -> float:
    """Forward FLOPs per token of one loop step of ``group``: its layers and its adapter (2d -> d)."""
    return len(config.group_specs[group].layers) * layer_flops(config) + 4.0 * config.d_model ** 2


def _once_flops(config: ModelConfig) -> float:
    """Forward FLOPs per token of the layers that run once and the head."""
    looped = sum(len(spec.layers) for spec in config.group_specs)
    return (config.n_layer - looped) * layer_flops(config) + 2.0 * config.padded_vocab_size * config.d_model


def forward_flops(config: ModelConfig, counts: Sequence[float]) -> float:
    """Forward FLOPs per token with ``counts[g]`` loop steps in group g."""
    return _once_flops(config) + sum(c * loop_step_flops(config, g) for g, c in enumerate(counts))


def train_flops(config: ModelConfig, counts: Sequence[float], backprop: Sequence[float] | None = None) -> float:
    """Training FLOPs per token of a step that drew ``counts``: the forward through every loop step,
    and a backward (twice a forward) through the last ``backprop_depth`` steps of each group
    (``backprop[g]``: the expected min(count, depth), when given)."""
    if backprop is None:
        backprop = [min(c, config.backprop_depth) for c in counts]
    backward = _once_flops(config) + sum(b * loop_step_flops(config, g) for g, b in enumerate(backprop))
    return forward_flops(config, counts) + 2.0 * backward


def expected_counts(config: ModelConfig, draws: int = 20_000) -> tuple[float, float]:
    """E[count] and E[min(count, backprop_depth)] of one group under the lognormal-Poisson
    schedule of :mod:`rdepth.model.schedule` (a fixed-seed Monte Carlo estimate)."""
    import numpy as np

    extra = config.mean_loops - 1.0
    if extra <= 0:
        return 1.0, 1.0
    rng = np.random.default_rng(0)
    sigma = config.loop_sigma
    rates = np.exp(rng.normal(math.log(extra) - sigma ** 2 / 2, sigma, draws)) if sigma > 0 else np.full(draws, extra)
    counts = 1 + rng.poisson(rates)
    return float(counts.mean()), float(np.minimum(counts, config.backprop_depth).mean())


def expected_train_flops(config: ModelConfig) -> float:
    """Training FLOPs per token averaged over the loop-count schedule."""
    mean, backprop = expected_counts(config)
    return train_flops(config, [mean] * config.n_groups, [backprop] * config.n_groups)


def layer_calls(config: ModelConfig, counts: Sequence[int]) -> int:
    """Layer applications of one forward with ``counts`` loop steps per group."""
    looped = sum(len(spec.layers) for spec in config.group_specs)
    return config.n_layer - looped + sum(c * len(spec.layers) for c, spec in zip(counts, config.group_specs, strict=False))


def parameter_count(config: ModelConfig) -> int:
    """Weights (approximate: matrices, adapters and the tied embedding)."""
    d = config.d_model
    return int(config.n_layer * (4 + 2 * config.mlp_ratio) * d * d + config.n_groups * 2 * d * d
               + (config.padded_vocab_size + config.block_size) * d)


# ------------------------------------------------------------------ the probe


@dataclass
class Probe:
    """Training speed measured on the device: ``seconds_per_flop`` of the timed steps of ``size``
    (total wall time / total training FLOPs of the counts they drew)."""

    size: str
    seconds_per_flop: float
    steps: int
    step_seconds: list[float] = field(default_factory=list)
    tokens_per_second: float | None = None  # at the schedule's expected counts
    wall_seconds: float | None = None  # the whole probe: building, compiling, warm-up, timed steps

    def __post_init__(self) -> None:
        if not (self.seconds_per_flop > 0 and math.isfinite(self.seconds_per_flop)):
            raise RdepthError(f"probe: seconds per FLOP must be positive, got {self.seconds_per_flop!r}")


def probe_from_steps(size: str, config: ModelConfig, rows: int,
                     steps: Sequence[tuple[float, Sequence[Sequence[int]]]], wall_seconds: float | None = None) -> Probe:
    """A :class:`Probe` from timed steps ``(seconds, loop counts of each micro-batch)`` of ``rows``
    windows of ``config.block_size`` tokens per step (split evenly over the micro-batches)."""
    if not steps:
        raise RdepthError("probe: no timed training steps")
    flops = 0.0
    for _, micro_counts in steps:
        micro_tokens = rows * config.block_size / len(micro_counts)
        flops += sum(micro_tokens * train_flops(config, counts) for counts in micro_counts)
    seconds = sum(s for s, _ in steps)
    if seconds <= 0 or flops <= 0:
        raise RdepthError("probe: the timed steps took no time")
    per_flop = seconds / flops
    return Probe(size, per_flop, len(steps), [float(s) for s, _ in steps],
                 1.0 / (per_flop * expected_train_flops(config)), wall_seconds)


# ------------------------------------------------------------------ after training


@dataclass
class Workload:
    """What runs after (and beside) training, as the pipeline will run it."""

    checkpoints: int
    analyze_sequences: int
    long_loops: int
    sweep_windows: int
    sweep_settings: int  # policy points (policies x taus)
    timing_batch: int
    generate_tokens: int
    repeats: int
    val_windows: int
    val_budgets: int = 3
    # rdepth analyze's loop-budget DLR curve (K = 1..dlr_curve_loops on the last checkpoint) and the
    # Jacobian spectra (jacobian_positions positions per group and checkpoint): AnalyzeConfig's defaults
    dlr_curve_loops: int = 30
    dlr_curve_sequences: int = 4
    jacobian_positions: int = 4
    analyze_precision: str = "float64"


def after_training_seconds(config: ModelConfig, work: Workload, seconds_per_flop: float, kind: str) -> dict[str, float]:
    """Estimated seconds of every stage besides the training steps, by name, and their ``total``."""
    T = config.block_size
    eval_loops = list(config.default_eval_loops)
    k_max = [2 * k for k in eval_loops]
    call = CALL_SECONDS[kind]

    def forward(tokens: float, counts: Sequence[int], calls: float) -> float:
        return tokens * forward_flops(config, counts) * seconds_per_flop * EVAL_OVERHEAD \
            + calls * layer_calls(config, counts) * call

    val_tokens = VAL_BATCHES * VAL_BATCH_SIZE * T
    parts = {
        "validation": work.checkpoints * forward(val_tokens, eval_loops, VAL_BATCHES),
        "checkpoints": work.checkpoints * 16.0 * parameter_count(config) / DISK_BYTES_PER_SECOND,
        "loop_budgets": work.val_budgets * forward(work.val_windows * T, [max(k_max)] * config.n_groups,
                                                   math.ceil(work.val_windows / VAL_BATCH_SIZE)),
    }
    parts["analyze"] = analyze_seconds(config, work, seconds_per_flop, kind)
    # Quality: the full budget, each point and its fixed baseline (at most the full budget each).
    sweep_batches = math.ceil(work.sweep_windows / 8)
    settings = 1 + 2 * work.sweep_settings
    quality = settings * forward(work.sweep_windows * T, k_max, sweep_batches)
    # Latency: every setting per round at batch 1 and batched (twice for fixed budgets: packed and
    # dense), and cached decoding token by token.
    fixed = 1 + work.sweep_settings
    batched = min(work.timing_batch, work.sweep_windows)
    per_round = (settings + fixed) * (forward(T, k_max, 1) + forward(batched * T, k_max, 1)) \
        + settings * work.generate_tokens * layer_calls(config, k_max) * DECODE_CALL_SECONDS[kind]
    parts["sweep"] = quality + (SWEEP_WARMUP + work.repeats) * per_round
    parts["report"] = REPORT_SECONDS[kind]
    parts["total"] = sum(parts.values())
    return parts


def analyze_seconds(config: ModelConfig, work: Workload, seconds_per_flop: float, kind: str) -> float:
    """Estimated seconds of ``rdepth analyze`` over the run's checkpoints: per checkpoint its fixed
    cost, the eval and long budgets and the Jacobian spectra; on the last one the DLR curve. The
    measured work runs in float64 (:data:`FLOAT64_SLOWDOWN`)."""
    T, groups = config.block_size, config.n_groups
    slow = FLOAT64_SLOWDOWN[kind] if work.analyze_precision == "float64" else 1.0
    call = CALL_SECONDS[kind]

    def forward(tokens: float, counts: Sequence[int], calls: float) -> float:
        return slow * tokens * forward_flops(config, counts) * seconds_per_flop * EVAL_OVERHEAD \
            + calls * layer_calls(config, counts) * call

    batches = math.ceil(work.analyze_sequences / ANALYZE_BATCH)
    per_checkpoint = (ANALYZE_SECONDS_PER_CHECKPOINT[kind]
                      + forward(work.analyze_sequences * T, list(config.default_eval_loops), batches)
                      + forward(work.analyze_sequences * T, [work.long_loops] * groups, batches))
    if work.jacobian_positions:
        positions = min(work.jacobian_positions, work.analyze_sequences)
        prefix = 0.625 * T  # positions are drawn past the first quarter of the window: 5/8 T on average
        jacobians = sum(positions * config.d_model * JACOBIAN_FORWARDS_PER_DIMENSION[kind] * prefix
                        * loop_step_flops(config, g) for g in range(groups))
        per_checkpoint += forward(positions * T, [work.long_loops] * groups, 1) \
            + slow * jacobians * seconds_per_flop * EVAL_OVERHEAD
    total = work.checkpoints * per_checkpoint
    if work.dlr_curve_loops and groups > 1:
        sequences = min(work.dlr_curve_sequences, work.analyze_sequences)
        calls = math.ceil(sequences / ANALYZE_BATCH)
        total += sum(forward(sequences * T, [k] * groups, calls) for k in range(1, work.dlr_curve_loops + 1))
    return total


# ------------------------------------------------------------------ the plan


def warmup_steps(steps: int) -> int:
    """Linear warm-up of a run of ``steps``: a tenth of it, at least 150 steps, at most a fifth.

    The looped models stay at the unigram loss when they reach a high learning rate within a few
    dozen steps of a random start, on the medium corpus (docs/results.md): the `tiny` size at lr 3e-3
    does with a 33-step warm-up and leaves it with 150 (`scripts/unigram_plateau.py`); the first
    H100 run warmed `mini` up over 28 steps and never left it.
    """
    return max(1, min(steps // 5, max(150, steps // 10)))



@dataclass
class Plan:
    """The chosen size and training run, with every estimate that chose them."""

    size: str
    model_overrides: dict[str, Any]
    preset: str
    batch_size: int
    lr: float
    max_steps: int
    checkpoint_every: int
    warmup_steps: int
    tokens: int
    step_seconds: float
    train_seconds: float
    after_training: dict[str, float]
    remaining_seconds: float
    probe_size: str
    seconds_per_flop: float
    reaches_min_tokens: bool
    candidates: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        from rdepth.io import dataclass_from_dict

        return dataclass_from_dict(cls, data, "reproduce plan")


def _candidate(name: str, config: ModelConfig, probe: Probe, remaining: float, train_share: float,
               work: Workload, kind: str) -> dict[str, Any]:
    size = SIZES[name]
    tokens_per_step = size.batch_size * config.block_size
    step_seconds = SPEED_MARGIN[kind] * tokens_per_step * expected_train_flops(config) * probe.seconds_per_flop
    after = after_training_seconds(config, work, probe.seconds_per_flop, kind)
    train_seconds = max(0.0, min(train_share * remaining, remaining - after["total"]))
    steps = int(train_seconds // step_seconds)
    per_checkpoint = steps // work.checkpoints
    fits = per_checkpoint >= MIN_STEPS_PER_CHECKPOINT
    steps = per_checkpoint * work.checkpoints
    return {"size": name, "fits": fits, "max_steps": steps, "checkpoint_every": max(per_checkpoint, 1),
            "tokens": steps * tokens_per_step, "step_seconds": step_seconds,
            "train_seconds": steps * step_seconds, "after_training": after,
            "tokens_per_second": tokens_per_step / step_seconds, "measured": name == probe.size}


def plan_run(configs: dict[str, ModelConfig], probe: Probe, remaining_seconds: float, *, min_tokens: int,
             train_share: float, work: Workload, kind: str) -> Plan:
    """Choose a size among ``configs`` (name -> model config, largest first) and its training run.

    Training gets ``train_share`` of ``remaining_seconds`` (less a safety margin), less whatever the
    stages after it need beyond the rest. The first size that reaches ``min_tokens`` wins; when none
    does, the one that trains on the most tokens. A one-line error when no size gets
    ``MIN_STEPS_PER_CHECKPOINT`` steps per checkpoint.
    """
    usable = remaining_seconds - SAFETY_SECONDS[kind]
    candidates = [_candidate(name, config, probe, usable, train_share, work, kind) for name, config in configs.items()]
    fitting = [c for c in candidates if c["fits"]]
    if not fitting:
        smallest = min(candidates, key=lambda c: c["step_seconds"])
        need = (smallest["after_training"]["total"] + work.checkpoints * MIN_STEPS_PER_CHECKPOINT
                * smallest["step_seconds"] + SAFETY_SECONDS[kind])
        raise RdepthError(f"the budget leaves {max(remaining_seconds, 0):.0f} s after preparing and timing, too little "
                          f"for even the {smallest['size']} size (about {need:.0f} s): raise --minutes")
    reaching = [c for c in fitting if c["tokens"] >= min_tokens]
    chosen = reaching[0] if reaching else max(fitting, key=lambda c: c["tokens"])
    size = SIZES[chosen["size"]]
    steps = chosen["max_steps"]
    return Plan(
        size=chosen["size"], model_overrides=dict(size.overrides), preset=size.preset, batch_size=size.batch_size,
        lr=size.lr, max_steps=steps, checkpoint_every=chosen["checkpoint_every"],
        warmup_steps=warmup_steps(steps), tokens=chosen["tokens"], step_seconds=chosen["step_seconds"],
        train_seconds=chosen["train_seconds"], after_training=chosen["after_training"],
        remaining_seconds=remaining_seconds, probe_size=probe.size, seconds_per_flop=probe.seconds_per_flop,
        reaches_min_tokens=bool(reaching), candidates=candidates,
    )
