"""Issue 12's GPU targets, measured side by side on one card in one run (about 5 minutes on an H100).

    python bench/gpu_suite.py --out gpu_out --revision <git hash>     # the GPU session's one command
    python bench/gpu_suite.py --smoke --out /tmp/gpu_smoke           # CPU-sized, every section in seconds

Runs from the repository root without installing rdepth. Random weights (speed needs no trained
ones; ``--checkpoint RUN`` puts a trained run's weights under the decode sections), random token ids.
Sections, in order, each timed after warm-up, synchronised, repeated, kept as median and IQR:

  ceiling  a large bf16 matrix product and a device-to-device copy (CUDA only): the card's real peaks
  train    the trainer's own ``Trainer.train_step`` (bf16 autocast and per-layer compile on CUDA, AdamW,
           clipping, truncated backprop) on the ``paper`` preset with the loop counts drawn as in
           training, then on a plain GPT of the same width and the mean unrolled depth: tokens/s,
           model FLOPs (:func:`train_flops_per_row`), MFU, per-layer-application throughput ratio
  decode   batch 1 at the full budget: the packed path (``generate``'s), the static path eager, as CUDA
           graphs, and with Inductor-compiled pieces captured as CUDA graphs (``compile=True``; eager on
           a CPU); the plain 12-layer model on the same three static paths (ms/token)
  exits    batch 1: the per-step cost of an exit check (a rule that never fires against the fixed
           budget; without and with the per-chunk host check), on eager and on Inductor-compiled
           pieces (each against its own loop step), and a rule calibrated to about half the steps
           against the full budget and a fixed budget of the same mean steps
  batched  batch 8, 32, 128 (as time allows): tokens/s with exits, at the full budget and at a fixed
           budget of the same mean steps, with the greedy-token agreement against the full budget

Every section has a share of ``--budget-s``; it shortens its repeats or skips its later settings when
its time runs out, and says so. A section that fails records its error and the rest go on.
``OUT/gpu_suite.json`` (device, versions, revision, every number, each target met or missed and by
how much) and ``OUT/gpu_suite.md`` (the targets table) are rewritten after every section; the
table is printed at the end.

Training data: the ``paper`` preset's GPT-2 vocabulary needs tokenizer files that an offline GPU
machine does not hold, and the vocabulary size is part of what is timed (the head is ~8% of the
FLOPs). So the trainer's step runs on random token ids of the preset's vocabulary through the
trainer's own ``BatchSampler``; the trainer is built without a data folder
(``Trainer.on_random_tokens``, :func:`bench_trainer`), and only ``train_step`` is driven: the step
users run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# rdepth from this working tree, installed or not (the GPU machine has it uninstalled); decode_speed beside.
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# Dense bf16 tensor-core peaks (datasheet figures without sparsity), TFLOP/s, by a substring of the
# device name; the first match wins, so the specific names come first. H100 SXM: 989.4; the H200
# has the H100's compute (989.4). A card of this workplace measured ~790-800 on an 8192^3 bf16
# product (KINDS.md): the ``ceiling`` section measures it and MFU is also given against it.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
)
TARGET_DEVICES = ("H100", "H200")  # the absolute targets (ms/token, MFU) are set for these cards

SECTIONS = ("ceiling", "train", "decode", "exits", "batched", "spread", "loss")
KERNEL_COUNT_TOKENS = 2  # decoded tokens each kernel count of the decode section profiles
# Share of the remaining budget each section may use (of the sections still to run).
SHARES = {"ceiling": 0.03, "train": 0.33, "decode": 0.19, "exits": 0.14, "batched": 0.16, "spread": 0.12,
          "loss": 0.03}
QUANTILES = (0.9, 0.75)  # the batch-quantile exits of the spread section
CUDA_ONLY = "cuda only"


# ----------------------------------------------------------------------------- arguments
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset, 1-2 repeats, small batches: every section in seconds on a CPU")
    parser.add_argument("--preset", default=None, help="model preset (default: paper; tiny with --smoke)")
    parser.add_argument("--checkpoint", default=None,
                        help="a trained run or checkpoint whose weights the decode, exits and batched sections use")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-time budget (default 330; 60 with --smoke)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of " + ",".join(SECTIONS))
    parser.add_argument("--train-batch", type=int, default=None,
                        help="sequences per training step (default 32; 2 smoke)")
    parser.add_argument("--train-steps", type=int, default=None, help="timed training steps (default 12; 2 smoke)")
    parser.add_argument("--train-compile-scope", choices=("layer", "step"), default="layer",
                        help="TrainConfig.compile_scope: each layer compiled, or each loop step one region")
    parser.add_argument("--train-warmup", type=int, default=None, help="untimed steps first (default 3; 1 smoke)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile each layer in training (auto: on CUDA, as the trainer)")
    parser.add_argument("--loops", type=int, default=12, help="the full decode budget per group")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 16; 8 smoke)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens decoded per timed round (default 64; 8 smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per setting (default 5; 2 smoke)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds per setting (default 2; 1 smoke)")
    parser.add_argument("--batches", default=None, help="batched-decode sizes (default 8,32,128; 2,4 smoke)")
    parser.add_argument("--policy", default="step_norm",
                        help="the exit rule calibrated to --exit-fraction of the steps")
    parser.add_argument("--exit-fraction", type=float, default=0.5, help="target share of the full budget's steps")
    parser.add_argument("--check-every", default=None,
                        help="chunk sizes between host checks for exits (default 2,4; 2 smoke)")
    parser.add_argument("--capacity", type=int, default=None, help="decode cache positions (default: the block size)")
    parser.add_argument("--spread-batches", default=None, help="spread section batch sizes (default 32,128; 4 smoke)")
    parser.add_argument("--histogram", default=None,
                        help="exit-step histogram JSON of the spread section (default bench/exit_histogram.json)")
    parser.add_argument("--revision", default=None,
                        help="code revision to record (default: git rev-parse here; give it where .git is absent)")
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = dict(preset="tiny" if smoke else "paper", budget_s=60.0 if smoke else 330.0,
                    train_batch=2 if smoke else 32, train_steps=2 if smoke else 12, train_warmup=1 if smoke else 3,
                    prompt=8 if smoke else 16, tokens=8 if smoke else 64, repeats=2 if smoke else 5,
                    warmup=1 if smoke else 2, batches="2,4" if smoke else "8,32,128",
                    check_every="2" if smoke else "2,4", spread_batches="4" if smoke else "32,128")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    try:
        args.batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
        args.spread_batches = [int(b) for b in str(args.spread_batches).split(",") if b.strip()]
        args.check_every = [int(c) for c in str(args.check_every).split(",") if c.strip()]
    except ValueError:
        parser.error("--batches and --check-every take comma-separated integers")
    sizes = args.batches + args.spread_batches + args.check_every + [args.train_batch, args.train_steps, args.prompt, args.tokens,
                                                args.repeats, args.loops]
    if min(sizes) < 1 or args.train_warmup < 0 or args.warmup < 0:
        parser.error("sizes, counts and repeats must be >= 1 (warm-ups >= 0)")
    if not 0 < args.exit_fraction < 1:
        parser.error("--exit-fraction must be in (0, 1)")
    from rdepth.errors import RdepthError
    from rdepth.exits.registry import get_policy_class

    try:
        rule = get_policy_class(args.policy)
    except RdepthError as exc:
        parser.error(f"--policy: {exc}")
    if not rule.uses_tau:  # the calibration varies tau
        parser.error(f"--policy: {args.policy} takes no tau; choose a rule with a threshold")
    return args


# ----------------------------------------------------------------------------- FLOPs
def train_flops_per_row(config, counts, seq_len: int | None = None) -> dict:
    """Model FLOPs of one training sequence (a row of ``seq_len`` tokens) at per-group loop ``counts``.

    Matmuls count 2 FLOPs per weight per token in the forward and 4 in the backward (input and
    weight gradients). A layer holds ``4 d^2 + 2 d h`` matmul weights (qkv, proj, fc, proj; h =
    mlp_ratio * d; biases and norms are left out), an adapter ``2 d^2``, the tied head ``V d``
    (the real vocabulary; the embedding lookups are free). Causal attention (QK^T and AV) costs
    ``2 d T (T + 1)`` per layer application and row forward (query t reads t + 1 keys, 4 d FLOPs
    each), twice that backward. Truncated backprop: of a group's ``c`` steps only the last
    ``min(c, backprop_depth)`` run a backward; the others are forward only. So with every step
    under gradients this is the usual ``6 N T`` plus attention.

    Returns forward, backward and total FLOPs per row, and ``layer_applications``: layers applied
    per token (single-pass layers once, a group's layers once per loop step; adapters not counted).
    """
    T = config.block_size if seq_len is None else seq_len
    d, hidden = config.d_model, config.mlp_ratio * config.d_model
    layer_fwd = 2 * (4 * d * d + 2 * d * hidden) * T + 2 * d * T * (T + 1)
    adapter_fwd = 2 * (2 * d * d) * T
    head_fwd = 2 * config.vocab_size * d * T
    looped = {layer for spec in config.group_specs for layer in spec.layers}
    singles = config.n_layer - len(looped)
    forward = singles * layer_fwd + head_fwd
    backward = 2 * (singles * layer_fwd + head_fwd)
    applications = singles
    for spec, count in zip(config.group_specs, counts):
        step_fwd = len(spec.layers) * layer_fwd + adapter_fwd
        forward += count * step_fwd
        backward += 2 * min(count, config.backprop_depth) * step_fwd
        applications += count * len(spec.layers)
    return {"forward": forward, "backward": backward, "total": forward + backward,
            "layer_applications": applications}


def peak_tflops(device_name: str) -> float | None:
    """Datasheet dense bf16 peak of the named card (:data:`PEAK_BF16_TFLOPS`); None when unknown (the CPU)."""
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


# ----------------------------------------------------------------------------- small helpers
def _stats(values: list[float]) -> dict:
    """Median and interquartile range of ``values`` (the rounds kept too)."""
    if len(values) > 1:
        q = statistics.quantiles(values, n=4)
        low, high = q[0], q[2]
    else:
        low = high = values[0]
    return {"median": statistics.median(values), "iqr": [low, high], "n": len(values), "values": values}


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def _finite(value):
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def code_fingerprint() -> str:
    """SHA-256 (16 hex digits) of the Python sources under rdepth/ and bench/: names the code measured
    even where the working tree is uncommitted or carries no .git folder."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("rdepth/**/*.py"), *ROOT.glob("bench/*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def environment(args, device) -> dict:
    import subprocess

    import torch

    from rdepth.io import environment_info
    from rdepth.run.device import device_name

    info = environment_info()
    info["device"] = device_name(device)
    info["cuda"] = torch.version.cuda
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "multiprocessors": props.multi_processor_count,
                       "capability": f"{props.major}.{props.minor}"}
    revision, dirty = args.revision, None
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            revision = revision or rev.stdout.strip()
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    info["revision"] = revision or "unknown"
    info["uncommitted_changes"] = dirty
    info["code_sha256"] = code_fingerprint()
    info["date_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return info


class Budget:
    """The suite's wall-time budget, shared out to the sections still to run."""

    def __init__(self, seconds: float, sections: list[str]):
        self.start = time.perf_counter()
        self.end = self.start + seconds
        self.pending = list(sections)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def deadline_for(self, section: str) -> float:
        """A ``perf_counter`` deadline: the section's share of what is left among the pending sections."""
        now = time.perf_counter()
        shares = sum(SHARES[s] for s in self.pending)
        self.pending.remove(section)
        return now + max(self.end - now, 0.0) * SHARES[section] / shares


# ----------------------------------------------------------------------------- ceiling
def ceiling_section(args, device, deadline, context) -> dict:
    """The card's measured bf16 matrix rate and copy bandwidth (the roofline's two numbers)."""
    if device.type != "cuda":
        return {"status": CUDA_ONLY}
    import torch

    from decode_speed import _timed

    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)  # random, never zeros (METHOD.md)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = [_timed(lambda: a @ b, device) for _ in range(10)]
    matmul = _stats([2 * size**3 / (t / 1000) / 1e12 for t in times])
    source = torch.randn(2**28, device=device, dtype=torch.bfloat16)  # 512 MiB
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = [_timed(lambda: target.copy_(source), device) for _ in range(10)]
    copy = _stats([2 * source.numel() * 2 / (t / 1000) / 1e9 for t in times])
    context["measured_peak_tflops"] = matmul["median"]
    return {"status": "ok", "bf16_matmul_tflops": matmul, "matmul_size": size,
            "copy_gb_per_s": copy, "copy_note": "bytes read plus bytes written"}


# ----------------------------------------------------------------------------- train
def bench_trainer(model_config, batch: int, device, compile_layers: bool, seed: int = 0, compile_scope: str = "layer"):
    """A :class:`rdepth.train.trainer.Trainer` on random token ids of the model's vocabulary, without a data
    folder (:meth:`~rdepth.train.trainer.Trainer.on_random_tokens`): seeded weights, the trainer's AdamW
    (fused on CUDA), bf16 autocast on CUDA, ``BatchSampler`` windows, each layer compiled when asked. No
    run folder, validation or checkpoints: only the step is timed.
    """
    from rdepth.train.config import TrainConfig
    from rdepth.train.trainer import Trainer

    scope = {} if compile_scope == "layer" else {"compile_scope": compile_scope}  # older trees: no field
    config = TrainConfig(data="(random ids)", out="(none)", batch_size=batch, device=str(device),
                         compile=compile_layers, seed=seed, max_steps=10**6, **scope)
    return Trainer.on_random_tokens(model_config, config)


def time_training(model_config, args, device, deadline, compile_layers: bool) -> dict:
    """Warm-up steps, then timed ``train_step`` calls (device events on CUDA) until ``args.train_steps``
    or the deadline; each step's FLOPs from the counts it drew. Halves the batch on out-of-memory."""
    import torch

    batch = args.train_batch
    out_of_memory = []
    while True:
        trainer = None
        try:
            trainer = bench_trainer(model_config, batch, device, compile_layers,
                                    compile_scope=args.train_compile_scope)
            return {**_timed_steps(trainer, model_config, batch, args, device, deadline),
                    "out_of_memory_at_batch": out_of_memory, "compile_scope": args.train_compile_scope}
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            print(f"  out of memory at batch {batch}; trying {batch // 2}", flush=True)
            out_of_memory.append(batch)
            batch //= 2
        finally:
            trainer = None
            _free(device)


def _timed_steps(trainer, model_config, batch, args, device, deadline) -> dict:
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for step in range(args.train_warmup):
        trainer.train_step(step)
    if cuda:
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - started
    events, host_times, counts = [], [], []
    wall_start = time.perf_counter()
    for index in range(args.train_steps):
        step = args.train_warmup + index
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss, used = trainer.train_step(step)
            end.record()
            events.append((start, end))
        else:
            t0 = time.perf_counter()
            loss, used = trainer.train_step(step)
            host_times.append(1000 * (time.perf_counter() - t0))
        counts.append(list(used[0]))  # one micro-batch per step here
        if time.perf_counter() > deadline and index + 1 >= 2:
            break
    if cuda:
        torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - wall_start
    step_ms = [s.elapsed_time(e) for s, e in events] if cuda else host_times
    finite = not bool(trainer.nonfinite)
    tokens = batch * model_config.block_size
    flops = [train_flops_per_row(model_config, c) for c in counts]
    step_flops = [f["total"] * batch for f in flops]
    applications = [f["layer_applications"] for f in flops]
    total_s = sum(step_ms) / 1000
    result = {
        "batch": batch, "seq_len": model_config.block_size, "tokens_per_step": tokens,
        "steps_timed": len(step_ms), "steps_asked": args.train_steps, "warmup_steps": args.train_warmup,
        "warmup_s": warmup_s, "wall_s": wall_s, "step_ms": _stats(step_ms), "loop_counts": counts,
        "flops_per_step": step_flops, "layer_applications_per_token": applications,
        "tokens_per_s": tokens * len(step_ms) / total_s,
        "achieved_tflops": sum(step_flops) / total_s / 1e12,
        "achieved_tflops_per_step": _stats([f / (t / 1000) / 1e12 for f, t in zip(step_flops, step_ms)]),
        "layer_applications_per_s": sum(a * tokens for a in applications) / total_s,
        "loss_finite": finite, "compiled": trainer.config.compile,
        "parameters": trainer.model.num_parameters(),
    }
    if cuda:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def train_section(args, device, deadline, context) -> dict:
    from rdepth.config import get_preset

    looped_config = get_preset(args.preset)
    depth = max(1, round(looped_config.unrolled_depth))
    plain_config = looped_config.replace(groups="", n_layer=depth, eval_loops=None)
    compile_layers = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    out = {"status": "ok", "preset": args.preset, "backprop_depth": looped_config.backprop_depth,
           "mean_loops": looped_config.mean_loops, "plain_depth": depth, "compile": compile_layers,
           "data": "random token ids of the preset's vocabulary through the trainer's BatchSampler",
           "flop_formula": train_flops_per_row.__doc__.split("\n\n")[1].strip()}
    start = time.perf_counter()
    # The looped model first; it may take 60% of the section (compilation included).
    looped_deadline = start + 0.6 * (deadline - start)
    for name, config, until in (("looped", looped_config, looped_deadline), ("plain", plain_config, deadline)):
        print(f"  train {name} ({config.n_layer} layers, groups {config.groups!r})", flush=True)
        try:
            try:
                out[name] = time_training(config, args, device, until, compile_layers)
            except Exception as exc:  # noqa: BLE001 - a compile failure falls back to eager, recorded
                if not compile_layers:
                    raise
                out[f"{name}_compile_error"] = _error_text(exc)
                print(f"  compiled step failed ({exc!r:.200}); timing eager", flush=True)
                out[name] = time_training(config, args, device, until, False)
        except Exception as exc:  # noqa: BLE001 - the other model is still measured
            out[name] = {"status": "error", "error": _error_text(exc), "traceback": traceback.format_exc()}
            print(f"  train {name} failed: {_error_text(exc)}", flush=True)
        _free(device)
    measured_models = [name for name in ("looped", "plain") if "achieved_tflops" in out[name]]
    if not measured_models:
        raise RuntimeError(f"neither model trained: {out['looped']['error']}")
    out["status"] = "ok" if len(measured_models) == 2 else "partial"
    peak = peak_tflops(context["device_name"]) if device.type == "cuda" else None
    measured = context.get("measured_peak_tflops")
    for name in measured_models:
        achieved = out[name]["achieved_tflops"]
        out[name]["mfu"] = _ratio(achieved, peak)
        out[name]["mfu_vs_measured_ceiling"] = _ratio(achieved, measured)
    out["peak_tflops"] = peak
    out["peak_note"] = ("datasheet dense bf16 peak of the card (PEAK_BF16_TFLOPS)" if peak
                        else "no bf16 peak for this device: MFU is null")
    out["layer_application_throughput_ratio"] = _ratio(out["looped"].get("layer_applications_per_s"),
                                                       out["plain"].get("layer_applications_per_s"))
    out["flop_throughput_ratio"] = _ratio(out["looped"].get("achieved_tflops"), out["plain"].get("achieved_tflops"))
    out["ratio_note"] = ("layer applications per second, looped over plain (the issue's measure; a looped step "
                         "run without gradients costs a third of one with them, which favours the looped model); "
                         "flop_throughput_ratio compares achieved model FLOP/s instead")
    return out


# ----------------------------------------------------------------------------- decoding helpers
def _rounds_args(args, repeats=None, warmup=None, tokens=None):
    return SimpleNamespace(repeats=repeats or args.repeats, warmup=args.warmup if warmup is None else warmup,
                           tokens=tokens or args.tokens)


def _static_timing(decoder, prompt, steps, rounds, device, deadline, graph: bool) -> dict:
    """ms/token of ``decoder`` over the teacher-forced ``steps`` after ``prompt`` (eager or graphs). A
    compiled decoder compiles first, untimed (in the capture's warm-up, or on one eager token);
    ``compile_s`` records how long that took."""
    from decode_speed import summary, time_rounds

    compiled = getattr(decoder, "compiled", False)
    started = time.perf_counter()
    decoder.prefill(prompt)
    if graph:
        decoder.capture()
    elif compiled:
        decoder._advance(steps[0])
    compile_s = time.perf_counter() - started
    times = time_rounds(lambda: decoder.prefill(prompt), lambda: [decoder._advance(t) for t in steps],
                        rounds, device, deadline)
    result = summary(times)
    result["path"] = ("inductor+" if compiled else "") + ("graph" if graph else "eager")
    if compiled:
        result["compile_s"] = compile_s
    return result


def _kernels_per_token(decoder, prompt, steps, device, replay: bool = False) -> dict:
    """Kernels per decoded token of ``decoder``, profiled (``torch.profiler``) over the first
    :data:`KERNEL_COUNT_TOKENS` of ``steps`` after ``prompt``, one untimed token first (it compiles an
    uncompiled decoder's pieces). On CUDA ``kernels``: the kernels the device ran (its activity records,
    memcpy/memset apart as ``copies``), with the launch calls that started them; on a CPU ``aten_ops``,
    the leaf aten ops (:func:`decode_speed.count_per_token`), the CPU's stand-in for launches (Inductor's
    fused C++ kernels are no aten ops). ``per_token`` is the one of the two this device has. A captured
    decoder runs the pieces its graphs were recorded from, eagerly (``replay=False``: the same kernels,
    each launched), or replays its graphs (``replay=True``: one launch per graph)."""
    from decode_speed import count_per_token

    tokens = steps[:KERNEL_COUNT_TOKENS]
    decoder.prefill(prompt)
    decoder._advance(tokens[0], replay=replay)
    decoder.prefill(prompt)
    counts = count_per_token(lambda: [decoder._advance(token, replay=replay) for token in tokens], device)
    result = {key: value / len(tokens) for key, value in counts.items() if isinstance(value, (int, float))}
    result["per_token"] = result["kernels" if device.type == "cuda" else "aten_ops"]
    result["run"] = ("graph replay" if replay and decoder.captured else "eager") + \
        (", Inductor pieces" if decoder.compiled else "")
    return result


def _observe(decoder, prompt, steps, check_every: int | None) -> dict:
    """An untimed teacher-forced pass: the greedy token at each position ``[B, T]`` and the loop steps
    taken, per group: the rule's mean over rows and tokens, and the steps the batch executed (every row
    runs until the last one stops, rounded up to a chunk of ``check_every``)."""
    import torch

    decoder.prefill(prompt)
    chosen, computed = [], []
    for token in steps:
        chosen.append(decoder.step(token).float().argmax(dim=-1))
        computed.append(decoder.computed.clone())
    taken = torch.stack(computed).float()  # (T, G, B)
    budget = torch.tensor(decoder.steps, dtype=torch.float32, device=taken.device).view(1, -1)
    executed = taken.amax(dim=2)  # (T, G)
    if check_every is None:
        executed = budget.expand_as(executed)
    else:
        executed = torch.minimum(torch.ceil(executed / check_every) * check_every, budget)
    return {"tokens": torch.stack(chosen, dim=1), "mean_steps": taken.mean(dim=(0, 2)).tolist(),
            "executed_steps": executed.mean(dim=0).tolist()}


def _decode_inputs(config, batch, args, device, seed=1):
    import torch

    ids = torch.randint(0, config.vocab_size, (batch, args.prompt + args.tokens),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    return ids[:, : args.prompt], [ids[:, t : t + 1] for t in range(args.prompt, ids.shape[1])]


def decode_model(args, device, dtype):
    """The decode sections' model: the checkpoint's (``--checkpoint``) or the preset's random weights."""
    import torch

    from rdepth.config import get_preset
    from rdepth.model import RecurrentLM

    if args.checkpoint:
        from rdepth.run.checkpoint import load_model

        model, config = load_model(args.checkpoint, device)
        return model.to(dtype=dtype).eval(), config
    config = get_preset(args.preset)
    torch.manual_seed(0)
    return RecurrentLM(config).to(device=device, dtype=dtype).eval(), config


def _decoder(model, batch, budget, args, noise, *, loop_counts=None, factory=None, check_every=None,
             compact=False, compile=False):
    from rdepth.model.decoder import Decoder

    options = {"controller_factory": factory, "check_every": check_every} if factory else \
        {"loop_counts": loop_counts or budget}
    if compact:
        options["compact"] = True
    if compile:
        options["compile"] = True
    return Decoder(model, batch, max(budget) if budget else (), noise=noise,
                         capacity=args.capacity, **options)


def decoder_compiles() -> bool:
    """Whether this tree's ``Decoder`` can run its pieces Inductor-compiled (``compile=True``)."""
    import inspect

    from rdepth.model.decoder import Decoder

    return "compile" in inspect.signature(Decoder).parameters


def decoder_compacts() -> bool:
    """Whether this tree's ``Decoder`` can run exit chunks on the still-looping rows only."""
    import inspect

    from rdepth.model.decoder import Decoder

    return "compact" in inspect.signature(Decoder).parameters


def _policy_factory(name, tau, budget):
    from rdepth.exits import PolicyController

    return lambda: PolicyController.from_name(name, tau=tau, k_max=list(budget))


# ----------------------------------------------------------------------------- decode (batch 1)
def decode_section(args, device, deadline, context) -> dict:
    from decode_speed import packed_decoding, summary, time_rounds
    from rdepth.model import RecurrentLM
    from rdepth.model.noise import StateNoise

    dtype = context["decode_dtype"]
    model, config = decode_model(args, device, dtype)
    budget = (args.loops,) * config.n_groups
    prompt, steps = _decode_inputs(config, 1, args, device)
    noise = StateNoise(0, [0])
    graphs = device.type == "cuda"
    out = {"status": "ok", "batch": 1, "loops": list(budget), "prompt": args.prompt, "tokens": args.tokens,
           "dtype": str(dtype).replace("torch.", ""), "capacity": args.capacity or config.block_size,
           "unit": "ms/token, median [IQR] over rounds"}
    start = time.perf_counter()

    def share(fraction):  # a setting's own deadline: a fraction of what the section has left
        now = time.perf_counter()
        return now + fraction * max(deadline - now, 0.0)

    # The packed path is the slowest per round: fewer rounds.
    packed_setup, packed_decode, state = packed_decoding(model, prompt, steps, noise, 1,
                                                         lambda: {"loop_counts": budget})
    rounds = _rounds_args(args, repeats=max(1, min(args.repeats, 3)), warmup=min(args.warmup, 1))
    out["packed"] = summary(time_rounds(packed_setup, packed_decode, rounds, device, share(0.25)))
    out["packed"]["path"] = "packed (generate's path, eager)"
    state.clear()

    decoders = {}  # row key -> the decoder it timed, kept for the kernel counts

    def static_rows(on, budget_of, noise_of, prefix, fractions) -> None:
        """The static path on model ``on``: eager, CUDA graph, and Inductor-compiled (graph on CUDA, eager
        on the CPU); each row its own decoder, each ``fractions`` of what the section has left."""
        key = f"{prefix}static_eager"
        decoders[key] = _decoder(on, 1, budget_of, args, noise_of)
        out[key] = _static_timing(decoders[key], prompt, steps, _rounds_args(args), device, share(fractions[0]),
                                  graph=False)
        key = f"{prefix}static_graph"
        if graphs:
            decoders[key] = _decoder(on, 1, budget_of, args, noise_of)
            out[key] = _static_timing(decoders[key], prompt, steps, _rounds_args(args), device, share(fractions[1]),
                                      graph=True)
        else:
            out[key] = {"status": CUDA_ONLY}
        key = f"{prefix}static_inductor"
        if not decoder_compiles():
            out[key] = {"status": "no compile option in this tree"}
            return
        try:  # a compiler failure must not lose the rows measured
            decoders[key] = _decoder(on, 1, budget_of, args, noise_of, compile=True)
            out[key] = _static_timing(decoders[key], prompt, steps, _rounds_args(args), device, share(fractions[2]),
                                      graph=graphs)
        except Exception as exc:  # noqa: BLE001
            decoders.pop(key, None)
            out[key] = {"status": "error", "error": _error_text(exc), "traceback": traceback.format_exc()}
            print(f"  {key} failed: {_error_text(exc)}", flush=True)
        _free(device)

    static_rows(model, budget, noise, "", (0.2, 0.25, 0.4))
    plain = RecurrentLM(config.replace(groups="", eval_loops=None)).to(device=device, dtype=dtype).eval()
    out["plain_layers"] = plain.config.n_layer
    static_rows(plain, (), None, "plain_", (0.25, 0.4, 0.75))  # the rest: the kernel counts
    try:  # a profiler failure must not lose the rows measured
        out["kernel_counts"] = kernel_counts(decoders, model, budget, noise, prompt, steps, args, device, deadline)
    except Exception as exc:  # noqa: BLE001
        out["kernel_counts"] = {"status": "error", "error": _error_text(exc), "traceback": traceback.format_exc()}
        print(f"  kernel counts failed: {_error_text(exc)}", flush=True)
    decoders.clear()
    out["fast_path"] = ("the static rows' attention views its one query per row (AttentionContext.one_per_row) and "
                        "reads an additive mask made once per token; revisions without the first (e.g. 6942ad7, "
                        "5.19 ms/token on an H100) packed and unpacked the queries, three more kernels per layer "
                        "application, and without the second SDPA converted a boolean mask at every layer "
                        "application (three more)")
    for name, prefix in (("looped", ""), ("plain", "plain_")):
        rows = [f"{prefix}static_graph", f"{prefix}static_inductor"] if graphs else \
            [f"{prefix}static_eager", f"{prefix}static_inductor"]
        timed_rows = [row for row in rows if "ms_per_token" in out[row]]
        if not timed_rows:  # both failed or ran out of time: their own entries say why
            out[f"best_{name}_ms"], out[f"best_{name}_path"] = None, None
            continue
        best = min(timed_rows, key=lambda row: out[row]["ms_per_token"])
        out[f"best_{name}_ms"] = out[best]["ms_per_token"]
        out[f"best_{name}_path"] = out[best]["path"]
    out["speedup_graph_over_packed"] = _ratio(out["packed"]["ms_per_token"], out["best_looped_ms"])
    out["seconds"] = time.perf_counter() - start
    return out


def kernel_counts(decoders: dict, model, budget, noise, prompt, steps, args, device, deadline) -> dict:
    """Kernels per decoded token of the decode section's static rows (``decoders``: row key -> the decoder
    it timed), each counted alone (an error recorded in its place), and per loop step of the looped model:
    (full budget - 1 loop per group) / the extra loop steps, from a budget-1 decoder counted the same way
    (the compiled one compiles first; skipped once the section's time is out). The graph rows' kernels are
    those of the eager rows (a graph records the launches of one eager token); on CUDA the graph row is
    also counted replayed (``static_graph_replay``: the kernels the device ran, one launch per token)."""
    cuda = device.type == "cuda"
    out = {"status": "ok", "tokens": KERNEL_COUNT_TOKENS,
           "what": "CUDA kernels" if cuda else "aten ops (CPU)",
           "unit": ("kernels the device ran per decoded token (torch.profiler's CUDA activity records; "
                    "memcpy/memset apart as copies)") if cuda else
                   ("leaf aten ops per decoded token (no views or allocations): the CPU's stand-in for "
                    "kernel launches; Inductor's fused C++ kernels are not aten ops"),
           "per_token": {}, "per_loop_step": {}}
    started = time.perf_counter()

    def counted(decoder, replay=False) -> dict:
        try:
            return _kernels_per_token(decoder, prompt, steps, device, replay=replay)
        except Exception as exc:  # noqa: BLE001
            return {"status": "error", "error": _error_text(exc)}

    for key in ("static_eager", "static_inductor", "plain_static_eager", "plain_static_inductor"):
        out["per_token"][key] = counted(decoders[key]) if key in decoders else {"status": "no decoder (row failed)"}
    if "static_graph" in decoders:
        out["per_token"]["static_graph_replay"] = counted(decoders["static_graph"], replay=True)
    extra = sum(budget) - len(budget)  # loop steps the full budget runs beyond 1 per group
    for key, compiled in (("static_eager", False), ("static_inductor", True)):
        full = out["per_token"][key].get("per_token")
        if full is None or extra < 1:
            out["per_loop_step"][key] = {"status": "no full-budget count" if extra >= 1 else "no loops"}
            continue
        if compiled and time.perf_counter() > deadline:
            out["per_loop_step"][key] = {"status": "skipped: the section's time is out (a budget-1 decoder "
                                                   "would compile)"}
            continue
        one = counted(_decoder(model, 1, budget, args, noise, loop_counts=(1,) * len(budget), compile=compiled))
        if "per_token" not in one:
            out["per_loop_step"][key] = one
            continue
        out["per_loop_step"][key] = {"per_loop_step": (full - one["per_token"]) / extra, "full_budget": full,
                                     "budget_1": one["per_token"], "extra_loop_steps": extra}
    out["seconds"] = time.perf_counter() - started
    return out


# ----------------------------------------------------------------------------- exits (batch 1)
def calibrate_tau(model, budget, args, device, noise, prompt, steps, deadline, iterations=14,
                  min_tries=8) -> dict:
    """A ``--policy`` threshold whose rule takes about ``--exit-fraction`` of ``budget``'s steps: bisection
    on log(tau) (a larger tau exits earlier), each try a real teacher-forced pass of the static path.
    At least ``min_tries`` tries whatever the deadline: the exit sections stand on this tau."""
    target = args.exit_fraction * sum(budget) / len(budget)
    low, high = math.log(1e-6), math.log(1e6)
    best = None
    tries = []
    for _ in range(iterations):
        if len(tries) >= min_tries and time.perf_counter() > deadline:
            break
        mid = (low + high) / 2
        tau = math.exp(mid)
        decoder = _decoder(model, 1, budget, args, noise, factory=_policy_factory(args.policy, tau, budget))
        seen = _observe(decoder, prompt, steps, None)
        mean = sum(seen["mean_steps"]) / len(seen["mean_steps"])
        tries.append({"tau": tau, "mean_steps": mean})
        if best is None or abs(mean - target) < abs(best["mean_steps"] - target):
            best = {"tau": tau, "mean_steps": mean}
        if mean > target:  # too many steps: exit earlier
            low = mid
        else:
            high = mid
        if abs(mean - target) < 0.25:
            break
    # Tokens that all converge alike (random weights) can jump past the target: say so.
    return {**best, "target_mean_steps": target, "on_target": abs(best["mean_steps"] - target) <= 0.25 * target,
            "tries": tries}


NO_GROUPS = {"status": "skipped", "reason": "the model has no recurrence groups"}


def _looped_decode_model(args, device, context):
    """The exit sections' model in the decode dtype, its config and the full budget (``--loops`` in every
    group); ``(None, config, ())`` when the model has no recurrence groups."""
    model, config = decode_model(args, device, context["decode_dtype"])
    if not config.n_groups:
        return None, config, ()
    return model, config, (args.loops,) * config.n_groups


def exits_section(args, device, deadline, context) -> dict:
    from rdepth.model.noise import StateNoise

    model, config, budget = _looped_decode_model(args, device, context)
    if model is None:
        return dict(NO_GROUPS)
    prompt, steps = _decode_inputs(config, 1, args, device)
    noise = StateNoise(0, [0])
    graph = device.type == "cuda"
    rounds = _rounds_args(args)
    out = {"status": "ok", "batch": 1, "loops": list(budget), "path": "graph" if graph else "eager",
           "policy": args.policy, "check_every": args.check_every}
    start = time.perf_counter()

    def share(fraction):
        now = time.perf_counter()
        return now + fraction * max(deadline - now, 0.0)

    def timed(decoder, until):
        return _static_timing(decoder, prompt, steps, rounds, device, until, graph)

    # First the threshold at about half the steps (the batched section uses it too).
    calibration = calibrate_tau(model, budget, args, device, noise, prompt, steps[: max(4, len(steps) // 4)],
                                share(0.2))
    out["calibration"] = calibration
    tau = calibration["tau"]
    context["exit_tau"] = tau
    out["full"] = timed(_decoder(model, 1, budget, args, noise), share(0.12))
    out["budget_1"] = timed(_decoder(model, 1, budget, args, noise, loop_counts=(1,) * len(budget)), share(0.12))
    steps_full = sum(budget)
    step_ms = (out["full"]["ms_per_token"] - out["budget_1"]["ms_per_token"]) / max(steps_full - len(budget), 1)
    out["loop_step_ms"] = step_ms
    # A rule that never fires: every step pays the rule and its predication, nothing is skipped.
    never = _policy_factory("step_norm", 1e-30, budget)
    checks = {}
    for every in [None, *args.check_every]:
        key = "no_host_check" if every is None else f"check_every_{every}"
        timing = timed(_decoder(model, 1, budget, args, noise, factory=never, check_every=every), share(0.1))
        extra = (timing["ms_per_token"] - out["full"]["ms_per_token"]) / steps_full
        checks[key] = {**timing, "check_ms_per_step": extra, "share_of_loop_step": _ratio(extra, step_ms)}
    out["check_cost"] = checks
    # The same on the Inductor-compiled pieces (loop step and exit check fused), against their own loop step.
    if decoder_compiles():
        try:
            inductor_full = timed(_decoder(model, 1, budget, args, noise, compile=True), share(0.1))
            inductor_one = timed(_decoder(model, 1, budget, args, noise, loop_counts=(1,) * len(budget),
                                          compile=True), share(0.1))
            out["full_inductor"], out["budget_1_inductor"] = inductor_full, inductor_one
            inductor_step = (inductor_full["ms_per_token"] - inductor_one["ms_per_token"]) / \
                max(steps_full - len(budget), 1)
            out["loop_step_ms_inductor"] = inductor_step
            for every in [None, *args.check_every]:
                key = ("no_host_check" if every is None else f"check_every_{every}") + "_inductor"
                timing = timed(_decoder(model, 1, budget, args, noise, factory=never, check_every=every,
                                        compile=True), share(0.1))
                extra = (timing["ms_per_token"] - inductor_full["ms_per_token"]) / steps_full
                checks[key] = {**timing, "check_ms_per_step": extra,
                               "share_of_loop_step": _ratio(extra, inductor_step)}
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not lose the rest of the section
            out["inductor_error"] = _error_text(exc)
            print(f"  exits, inductor rows failed: {_error_text(exc)}", flush=True)
        _free(device)
    # The rule at about half the steps, with each host-check interval.
    policy = _policy_factory(args.policy, tau, budget)
    reference = _observe(_decoder(model, 1, budget, args, noise), prompt, steps, None)
    runs = {}
    for every in args.check_every:
        if runs and time.perf_counter() > deadline:
            runs[f"check_every_{every}"] = {"status": "skipped", "reason": "out of time"}
            continue
        decoder = _decoder(model, 1, budget, args, noise, factory=policy, check_every=every)
        seen = _observe(decoder, prompt, steps, every)
        timing = timed(decoder, share(0.25))
        saved = steps_full - sum(seen["mean_steps"])
        # Issue 12: latency falls at least in proportion to the steps saved, less the 3% check allowance.
        bound = out["full"]["ms_per_token"] - saved * step_ms * (1 - 0.03)
        runs[f"check_every_{every}"] = {
            **timing, "mean_steps": seen["mean_steps"], "executed_steps": seen["executed_steps"],
            "steps_saved": saved, "latency_ratio": _ratio(timing["ms_per_token"], out["full"]["ms_per_token"]),
            "steps_ratio": sum(seen["mean_steps"]) / steps_full, "bound_ms": bound,
            "agreement": _agreement(seen["tokens"], reference["tokens"])}
        del decoder
    out["policy_runs"] = runs
    best_key = min((k for k in runs if "ms_per_token" in runs[k]), key=lambda k: runs[k]["ms_per_token"])
    out["best_check_every"] = int(best_key.rsplit("_", 1)[1])
    context["exit_check_every"] = out["best_check_every"]
    mean_steps = runs[best_key]["mean_steps"]
    fixed = tuple(min(args.loops, max(1, round(m))) for m in mean_steps)
    out["fixed_same_mean"] = {**timed(_decoder(model, 1, budget, args, noise, loop_counts=fixed), deadline),
                              "loop_counts": list(fixed)}
    out["seconds"] = time.perf_counter() - start
    return out


def _agreement(tokens, reference) -> float:
    return float((tokens == reference).float().mean())


# ----------------------------------------------------------------------------- batched
def batched_section(args, device, deadline, context) -> dict:
    import torch

    from decode_speed import packed_decoding, summary, time_rounds
    from rdepth.model.noise import StateNoise

    model, config, budget = _looped_decode_model(args, device, context)
    if model is None:
        return dict(NO_GROUPS)
    graph = device.type == "cuda"
    tau = context.get("exit_tau")
    every = context.get("exit_check_every", args.check_every[0])
    out = {"status": "ok", "loops": list(budget), "path": "graph" if graph else "eager", "policy": args.policy,
           "check_every": every, "tokens": args.tokens, "capacity": args.capacity or config.block_size,
           "quality_note": ("matched quality cannot be measured on random weights; agreement is the share of "
                            "teacher-forced greedy tokens equal to the full budget's" +
                            ("" if args.checkpoint else ". Random weights also converge alike on every token, "
                             "so a batch's rows exit together; trained weights spread the exits"))}
    if tau is None:
        calibration_prompt, calibration_steps = _decode_inputs(config, 1, args, device)
        calibration = calibrate_tau(model, budget, args, device, StateNoise(0, [0]), calibration_prompt,
                                    calibration_steps[: max(4, args.tokens // 4)], deadline)
        tau, out["calibration"] = calibration["tau"], calibration
    out["tau"] = tau
    policy = _policy_factory(args.policy, tau, budget)
    compacts = decoder_compacts()
    out["compaction"] = compacts
    rounds = _rounds_args(args)
    by_batch = {}
    start = time.perf_counter()
    for position, batch in enumerate(args.batches):
        left = len(args.batches) - position
        until = time.perf_counter() + max(deadline - time.perf_counter(), 0.0) / left
        if by_batch and time.perf_counter() > deadline:
            by_batch[str(batch)] = {"status": "skipped", "reason": "out of time"}
            continue
        print(f"  batched decode, batch {batch}", flush=True)
        prompt, steps = _decode_inputs(config, batch, args, device)
        noise = StateNoise(0, range(batch))
        row = {}
        try:
            full = _decoder(model, batch, budget, args, noise)
            reference = _observe(full, prompt, steps, None)
            row["full"] = _with_rate(_static_timing(full, prompt, steps, rounds, device, until, graph), batch)
            del full
            # Exits, every row computing every step of a chunk (predicated); then, where the decoder
            # can, each chunk after the first on the still-looping rows only (compacted).
            variants = ["exits_predicated"] + (["exits_compacted"] if compacts else [])
            for variant in variants:
                exits = _decoder(model, batch, budget, args, noise, factory=policy, check_every=every,
                                 compact=variant == "exits_compacted")
                seen = _observe(exits, prompt, steps, every)
                row[variant] = _with_rate(_static_timing(exits, prompt, steps, rounds, device, until, graph), batch)
                row[variant].update(mean_steps=seen["mean_steps"], executed_steps=seen["executed_steps"],
                                    agreement=_agreement(seen["tokens"], reference["tokens"]))
                del exits
            best = max(variants, key=lambda v: row[v]["tokens_per_s"])
            row["exits"] = {**row[best], "variant": best}  # the faster exit path
            seen = {"mean_steps": row["exits_predicated"]["mean_steps"]}
            fixed_counts = tuple(min(args.loops, max(1, round(m))) for m in seen["mean_steps"])
            fixed = _decoder(model, batch, budget, args, noise, loop_counts=fixed_counts)
            fixed_seen = _observe(fixed, prompt, steps, None)
            row["fixed_same_mean"] = _with_rate(_static_timing(fixed, prompt, steps, rounds, device, until, graph),
                                                batch)
            row["fixed_same_mean"].update(loop_counts=list(fixed_counts),
                                          agreement=_agreement(fixed_seen["tokens"], reference["tokens"]))
            del fixed
            row["predicated_over_full"] = _ratio(row["exits_predicated"]["tokens_per_s"], row["full"]["tokens_per_s"])
            row["exits_over_full"] = _ratio(row["exits"]["tokens_per_s"], row["full"]["tokens_per_s"])
            row["exits_over_fixed"] = _ratio(row["exits"]["tokens_per_s"], row["fixed_same_mean"]["tokens_per_s"])
            if batch <= 32 and time.perf_counter() < until:  # the packed path with exits (generate --exit)
                packed_steps = steps[:16]  # the slowest path per token: a shorter round
                packed_setup, packed_decode, state = packed_decoding(model, prompt, packed_steps, noise, batch,
                                                                     lambda: {"controller": policy()})
                packed = summary(time_rounds(packed_setup, packed_decode,
                                             _rounds_args(args, repeats=2, warmup=1, tokens=len(packed_steps)),
                                             device, until))
                row["packed_exits"] = {**_with_rate(packed, batch), "tokens": len(packed_steps)}
                state.clear()
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError as exc:
            row = {"status": "error", "error": _error_text(exc)}
        _free(device)
        by_batch[str(batch)] = row
    out["by_batch"] = by_batch
    out["seconds"] = time.perf_counter() - start
    return out


def decoder_quantiles() -> bool:
    """Whether this tree's ``Decoder`` has the batch-quantile exit (``batch_quantile``)."""
    import inspect

    from rdepth.model.decoder import Decoder

    return "batch_quantile" in inspect.signature(Decoder).parameters


def spread_section(args, device, deadline, context) -> dict:
    """Batched exits on a trained model's exit spread: each row's exit step drawn on the device from
    ``bench/exit_histogram.json`` (:mod:`exit_spread`), so a batch's rows leave the loop as trained rows do,
    on random weights. Per batch size: the full budget; the spread's exits predicated and compacted
    (chunks of the best ``--check-every``); the batch-quantile exits (``QUANTILES``, compacted) where the
    decoder has them; a fixed budget of each one's mean steps; kernels (CPU: aten ops) per token of the
    compacted and quantile decoders."""
    import torch

    from exit_spread import DEFAULT_HISTOGRAM, factory, load_histogram
    from rdepth.model.decoder import Decoder
    from rdepth.model.noise import StateNoise

    model, config, budget = _looped_decode_model(args, device, context)
    if model is None:
        return dict(NO_GROUPS)
    graph = device.type == "cuda"
    every = context.get("exit_check_every", args.check_every[0])
    histogram_path = args.histogram or str(DEFAULT_HISTOGRAM)
    histogram = load_histogram(histogram_path)
    out = {"status": "ok", "loops": list(budget), "path": "graph" if graph else "eager", "check_every": every,
           "histogram": {"path": histogram_path, "source": histogram.get("source"),
                         "mean_steps": histogram.get("mean_steps")},
           "quantiles": list(QUANTILES) if decoder_quantiles() else [], "compaction": decoder_compacts()}
    rounds = _rounds_args(args)
    by_batch = {}
    for position, batch in enumerate(args.spread_batches):
        left = len(args.spread_batches) - position
        until = time.perf_counter() + max(deadline - time.perf_counter(), 0.0) / left
        if by_batch and time.perf_counter() > deadline:
            by_batch[str(batch)] = {"status": "skipped", "reason": "out of time"}
            continue
        print(f"  exit spread, batch {batch}", flush=True)
        prompt, steps = _decode_inputs(config, batch, args, device)
        noise = StateNoise(0, range(batch))
        spread = factory(histogram, budget, seed=0, device=device)
        row = {}
        try:
            full = _decoder(model, batch, budget, args, noise)
            reference = _observe(full, prompt, steps, None)
            row["full"] = _with_rate(_static_timing(full, prompt, steps, rounds, device, until, graph), batch)
            del full
            variants = {"spread_predicated": {}}
            if out["compaction"]:
                variants["spread_compacted"] = {"compact": True}
            for q in out["quantiles"]:
                variants[f"quantile_{q:g}"] = {"compact": out["compaction"], "batch_quantile": q}
            for name, options in variants.items():
                if time.perf_counter() > until and name != "spread_predicated":  # the first always runs
                    row[name] = {"status": "skipped", "reason": "out of time"}
                    continue
                exits = Decoder(model, batch, max(budget), noise=noise, capacity=args.capacity,
                                controller_factory=spread, check_every=every, **options)
                seen = _observe(exits, prompt, steps, every)
                row[name] = _with_rate(_static_timing(exits, prompt, steps, rounds, device, until, graph), batch)
                row[name].update(mean_steps=seen["mean_steps"], executed_steps=seen["executed_steps"],
                                 agreement=_agreement(seen["tokens"], reference["tokens"]))
                if name != "spread_predicated":
                    try:
                        row[name]["kernels_per_token"] = _kernels_per_token(exits, prompt, steps, device)
                    except Exception as exc:  # noqa: BLE001 - a count that fails leaves the timing
                        row[name]["kernels_per_token"] = {"status": "error", "error": _error_text(exc)}
                counts = tuple(min(args.loops, max(1, round(m))) for m in seen["mean_steps"])
                fixed_name = f"fixed_{name}"
                if time.perf_counter() < until:
                    fixed = _decoder(model, batch, budget, args, noise, loop_counts=counts)
                    row[fixed_name] = _with_rate(_static_timing(fixed, prompt, steps, rounds, device, until, graph),
                                                 batch)
                    row[fixed_name]["loop_counts"] = list(counts)
                    row[f"{name}_over_fixed"] = _ratio(row[name]["tokens_per_s"], row[fixed_name]["tokens_per_s"])
                    del fixed
                row[f"{name}_over_full"] = _ratio(row[name]["tokens_per_s"], row["full"]["tokens_per_s"])
                del exits
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError as exc:
            row = {"status": "error", "error": _error_text(exc)}
        _free(device)
        by_batch[str(batch)] = row
    out["by_batch"] = by_batch
    return out


def loss_section(args, device, deadline, context) -> dict:
    """The training loss's head: ``lm_loss(F.linear(h, W))`` (the logits made whole) against the fused
    head + cross-entropy (:func:`rdepth.model.fused_loss.linear_cross_entropy`), forward + backward at the
    training shape (``--train-batch`` x block size rows, bf16 autocast on CUDA): ms and peak memory."""
    import torch
    import torch.nn.functional as F

    from decode_speed import summary
    from rdepth.config import get_preset

    try:
        from rdepth.model.fused_loss import linear_cross_entropy
    except ImportError:
        return {"status": "not in this tree (rdepth.model.fused_loss)"}
    from rdepth.model.recurrent import lm_loss

    config = get_preset(args.preset)
    rows, d, vocab = args.train_batch * config.block_size, config.d_model, config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(rows, d, generator=generator).to(device).requires_grad_()
    weight = (0.02 * torch.randn(vocab, d, generator=generator)).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    paths = {"unfused": lambda: lm_loss(F.linear(hidden, weight), targets),
             "fused": lambda: linear_cross_entropy(hidden, weight, targets)}
    out = {"status": "ok", "rows": rows, "d_model": d, "vocab": vocab,
           "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32"}
    for name, loss_of in paths.items():
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        for round_number in range(args.warmup + args.repeats):
            if time.perf_counter() > deadline and times:
                break
            hidden.grad = weight.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            with autocast:
                loss = loss_of()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_number >= args.warmup:
                times.append(1000 * (time.perf_counter() - started))
        timing = summary(times)
        out[name] = {"ms": timing["ms_per_token"], "iqr": timing["iqr"], "rounds": timing["rounds"], "loss": float(loss)}
        if device.type == "cuda":
            out[name]["peak_mib_over_inputs"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    out["unfused_over_fused_ms"] = _ratio(out["unfused"]["ms"], out["fused"]["ms"])
    return out


def _with_rate(timing: dict, batch: int) -> dict:
    timing["tokens_per_s"] = batch * 1000 / timing["ms_per_token"]
    return timing


# ----------------------------------------------------------------------------- targets and report
def _target(key, text, measured, unit, met, gap, note="") -> dict:
    return {"id": key, "target": text, "measured": _finite(measured), "unit": unit, "met": met,
            "gap": _finite(gap), "note": note}


def evaluate_targets(report: dict) -> list[dict]:
    """Issue 12's targets, each met (True/False) or not judged (None, with the reason) and its gap
    (positive: room to spare; negative: missed by this much, in the target's unit)."""
    sections = report["sections"]
    device = report["environment"].get("device", "")
    on_target_card = any(name in device for name in TARGET_DEVICES)
    smoke = report["settings"]["smoke"]
    absolute_note = "" if on_target_card else "absolute target set for an H100/H200; not judged on this device"
    if smoke:
        absolute_note = "smoke run (tiny preset); not judged"

    def ok(section):
        return sections.get(section, {}).get("status") == "ok"

    def judge_at_least(value, bound, absolute):
        if value is None or (absolute and (smoke or not on_target_card)):
            return None, None if value is None else value - bound
        return value >= bound, value - bound

    def judge_at_most(value, bound, absolute):
        if value is None or (absolute and (smoke or not on_target_card)):
            return None, None if value is None else bound - value
        return value <= bound, bound - value

    targets = []
    train = sections.get("train", {}) if sections.get("train", {}).get("status") in ("ok", "partial") else {}
    mfu = train.get("looped", {}).get("mfu")
    met, gap = judge_at_least(None if mfu is None else 100 * mfu, 50.0, True)
    note = absolute_note or (f"{100 * train['looped']['mfu_vs_measured_ceiling']:.1f}% of the measured "
                             "matmul ceiling" if train.get("looped", {}).get("mfu_vs_measured_ceiling") else "")
    if train and mfu is None:
        note = "no bf16 peak for this device" if train.get("peak_tflops") is None else "looped model not measured"
    targets.append(_target("train_mfu", "paper training (truncated backprop 8): MFU >= 50%", None if mfu is None
                           else 100 * mfu, "% of bf16 peak", met, gap, note))
    ratio = train.get("layer_application_throughput_ratio")
    met, gap = judge_at_least(ratio, 0.95, False)
    targets.append(_target("train_layer_ratio", "per-layer-application throughput >= 0.95x a plain GPT "
                           "(same width, mean unrolled depth)", ratio, "x plain", met, gap,
                           f"FLOP/s ratio {train['flop_throughput_ratio']:.3f}" if train.get("flop_throughput_ratio")
                           else ""))
    decode = sections.get("decode", {}) if ok("decode") else {}
    for key, text, name, bound in (
            ("decode_looped_ms", "paper decode, batch 1, 12 loops/group: <= 2.5 ms/token", "looped", 2.5),
            ("decode_plain_ms", "plain 12-layer decode, batch 1: <= 0.8 ms/token", "plain", 0.8)):
        value = decode.get(f"best_{name}_ms")
        met, gap = judge_at_most(value, bound, True)
        path = decode.get(f"best_{name}_path", "")
        targets.append(_target(key, text, value, "ms/token", met, gap,
                               "; ".join(part for part in (path and f"static path, {path}", absolute_note) if part)))
    exits = sections.get("exits", {}) if ok("exits") else {}
    checks = exits.get("check_cost", {})
    # Judged on the path that decodes the full budget faster (Inductor-compiled pieces or not).
    compiled_full = exits.get("full_inductor", {}).get("ms_per_token")
    suffix = "_inductor" if compiled_full is not None and compiled_full < exits["full"]["ms_per_token"] else ""
    every = exits.get("best_check_every")
    chosen = f"check_every_{every}" if every else None
    share = checks.get(chosen + suffix, {}).get("share_of_loop_step") if chosen else None
    met, gap = judge_at_most(None if share is None else 100 * share, 3.0, False)
    bare = checks.get("no_host_check" + suffix, {}).get("share_of_loop_step")
    other = checks.get(chosen + ("" if suffix else "_inductor"), {}).get("share_of_loop_step") if chosen else None
    note = ""
    if chosen and bare is not None:
        note = (f"{'Inductor-compiled' if suffix else 'eager'} pieces, with a host check every {every} steps; the "
                f"rule alone, no host check: {100 * bare:.1f}%")
        if other is not None:
            note += f"; {'eager' if suffix else 'Inductor-compiled'} pieces: {100 * other:.1f}%"
    targets.append(_target("exit_check_cost", "per-step exit check < 3% of a loop step (batch 1)",
                           None if share is None else 100 * share, "% of a loop step", met, gap, note))
    run = exits.get("policy_runs", {}).get(chosen, {}) if chosen else {}
    full_ms = exits.get("full", {}).get("ms_per_token")
    bound = run.get("bound_ms")
    met, gap = judge_at_most(run.get("ms_per_token"), bound, False) if bound is not None else (None, None)
    targets.append(_target(
        "exit_latency", "policy at ~half the steps: batch-1 latency falls >= in proportion to steps saved, less 3%",
        _ratio(run.get("ms_per_token"), full_ms), "x full-budget latency", met,
        None if gap is None or not full_ms else gap / full_ms,
        (f"steps {run['steps_ratio']:.2f} of the budget; bound {bound / full_ms:.3f}x of the full budget"
         if run and full_ms else "")
        + ("; calibration missed the target steps" if exits and not exits["calibration"]["on_target"] else "")))
    batched = sections.get("batched", {}) if ok("batched") else {}
    row = batched.get("by_batch", {}).get("32", {})
    speedup = row.get("exits_over_full")
    met, gap = judge_at_least(speedup, 1.4, False)
    targets.append(_target("batched_exits_32", "batch 32 with exits: >= 1.4x the full budget's tokens/s "
                           "(matched quality)", speedup, "x full budget", met, gap,
                           (f"{row['exits']['variant'].split('_')[1]} exits; agreement with the full budget "
                            f"{row['exits']['agreement']:.2f}; quality not measurable on random weights"
                            if row.get("exits") else "batch 32 not measured")))
    rows = [r for r in batched.get("by_batch", {}).values() if r.get("exits_over_fixed") is not None]
    worst = min((r["exits_over_fixed"] for r in rows), default=None)
    met, gap = judge_at_least(worst, 1.0, False)
    targets.append(_target("batched_vs_fixed", "exits never slower than a fixed budget of the same mean steps "
                           "(every batch measured)", worst, "x fixed (worst batch)", met, gap,
                           "batches " + ", ".join(k for k, r in batched.get("by_batch", {}).items()
                                                 if r.get("exits_over_fixed") is not None)))
    elapsed = report.get("elapsed_s")
    met, gap = judge_at_most(elapsed, 360.0, True)
    targets.append(_target("suite_runtime", "the whole suite in under 6 minutes on one GPU", elapsed, "s", met, gap,
                           absolute_note))
    return targets


def _fmt(value, unit="") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def _cell(entry: dict, key="ms_per_token") -> str:
    if entry.get("status") == CUDA_ONLY:
        return CUDA_ONLY
    value = entry.get(key)
    if value is None:
        return entry.get("status", "-")
    iqr = entry.get("iqr")
    return f"{value:.3f} [{iqr[0]:.3f}-{iqr[1]:.3f}]" if iqr and key == "ms_per_token" else f"{value:.4g}"


def _kernel_rows(counts: dict) -> list[str]:
    """The decode table's rows of kernels per token and per loop step (:func:`kernel_counts`)."""
    if counts.get("status") != "ok":
        return [f"| kernels per token | {counts.get('status', '-')}: {counts.get('error', '')[:100]} | |"]
    what, per_token, per_step = counts["what"], counts["per_token"], counts["per_loop_step"]

    def cell(entry: dict, key: str) -> str:
        value = entry.get(key)
        return _fmt(value) if value is not None else entry.get("status", "-")

    rows = [f"| {what} per token, static eager (a CUDA graph holds the same) | "
            f"{cell(per_token['static_eager'], 'per_token')} | {cell(per_token['plain_static_eager'], 'per_token')} |",
            f"| {what} per token, static, Inductor pieces | {cell(per_token['static_inductor'], 'per_token')} | "
            f"{cell(per_token['plain_static_inductor'], 'per_token')} |"]
    if "static_graph_replay" in per_token:
        rows.append(f"| {what} per token, static CUDA graph replayed (launch calls) | "
                    f"{cell(per_token['static_graph_replay'], 'per_token')} "
                    f"({cell(per_token['static_graph_replay'], 'kernel_launches')}) | - |")
    rows.append(f"| {what} per loop step, static eager / Inductor pieces | "
                f"{cell(per_step['static_eager'], 'per_loop_step')} / "
                f"{cell(per_step['static_inductor'], 'per_loop_step')} | - |")
    return rows


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# rdepth GPU suite (issue 12)", "",
        f"device **{env.get('device')}**, torch {env.get('torch')}, CUDA {env.get('cuda')}, python "
        f"{env.get('python')}; revision `{env.get('revision')}`"
        f"{' (uncommitted changes)' if env.get('uncommitted_changes') else ''}, code sha256 "
        f"`{env.get('code_sha256')}`; {env.get('date_utc')}; preset `{report['settings']['preset']}`"
        f"{' (smoke)' if report['settings']['smoke'] else ''}; {report.get('elapsed_s', 0):.0f} s of a "
        f"{report['settings']['budget_s']:.0f} s budget", "",
        "| target | measured | met? | gap | note |", "| --- | --- | --- | --- | --- |",
    ]
    for target in report.get("targets", []):
        met = {True: "yes", False: "**no**", None: "-"}[target["met"]]
        lines.append(f"| {target['target']} | {_fmt(target['measured'], target['unit'])} | {met} | "
                     f"{_fmt(target['gap'])} | {target['note']} |")
    lines += ["", "| section | status | seconds |", "| --- | --- | --- |"]
    for name, section in report["sections"].items():
        status = section.get("status", "?")
        if section.get("error"):
            status += ": " + section["error"].splitlines()[0][:120]
        lines.append(f"| {name} | {status} | {_fmt(section.get('section_s'))} |")
    sections = report["sections"]
    decode = sections.get("decode", {})
    if decode.get("status") == "ok":
        lines += ["", "Decode, batch 1, ms/token (median [IQR])", "", "| setting | looped | plain |",
                  "| --- | --- | --- |",
                  f"| packed (generate) | {_cell(decode['packed'])} | - |",
                  f"| static eager | {_cell(decode['static_eager'])} | {_cell(decode['plain_static_eager'])} |",
                  f"| static CUDA graph | {_cell(decode['static_graph'])} | {_cell(decode['plain_static_graph'])} |",
                  f"| static, Inductor pieces, CUDA graph (eager on a CPU) | {_cell(decode.get('static_inductor', {}))} "
                  f"| {_cell(decode.get('plain_static_inductor', {}))} |",
                  *_kernel_rows(decode.get("kernel_counts", {})),
                  "", decode.get("fast_path", "")]
    exits = sections.get("exits", {})
    if exits.get("status") == "ok":
        lines += ["", "Exit check (a rule that never fires), batch 1: extra ms per loop step and share of a loop step",
                  "", "| pieces | loop step ms | host check | extra ms/step | share |", "| --- | --- | --- | --- | --- |"]
        for suffix, pieces, step_key in (("", "eager", "loop_step_ms"),
                                         ("_inductor", "Inductor-compiled", "loop_step_ms_inductor")):
            for key, entry in exits["check_cost"].items():
                if key.endswith("_inductor") != bool(suffix):
                    continue
                check = key.removesuffix("_inductor").replace("check_every_", "every ").replace("no_host_check", "none")
                share = entry.get("share_of_loop_step")
                lines.append(f"| {pieces} | {_fmt(exits.get(step_key))} | {check} | {_fmt(entry.get('check_ms_per_step'))} "
                             f"| {'-' if share is None else f'{100 * share:.1f}%'} |")
    train = sections.get("train", {})
    if train.get("status") in ("ok", "partial"):
        lines += ["", "Training step (the trainer's train_step)", "",
                  "| model | batch | tokens/s | TFLOP/s | MFU | layer applications/s | step ms |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name in ("looped", "plain"):
            entry = train[name]
            if "achieved_tflops" not in entry:
                lines.append(f"| {name} | {entry.get('status')}: {entry.get('error', '')[:100]} | | | | | |")
                continue
            mfu = "-" if entry.get("mfu") is None else f"{100 * entry['mfu']:.1f}%"
            lines.append(f"| {name} | {entry['batch']} | {entry['tokens_per_s']:,.0f} | "
                         f"{entry['achieved_tflops']:.3g} | {mfu} | {entry['layer_applications_per_s']:.4g} | "
                         f"{entry['step_ms']['median']:.1f} |")
    batched = sections.get("batched", {})
    if batched.get("status") == "ok":
        lines += ["", "Batched decode with exits, tokens/s", "",
                  "| batch | full budget | exits, predicated | exits, compacted | fixed, same mean steps | "
                  "exits/full | exits/fixed | agreement | packed path, exits |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

        def rate(entry):
            return "-" if entry is None else f"{entry['tokens_per_s']:,.0f}"

        for batch, row in batched["by_batch"].items():
            if row.get("status") != "ok":
                lines.append(f"| {batch} | {row.get('status')} | | | | | | | |")
                continue
            lines.append(f"| {batch} | {rate(row['full'])} | {rate(row['exits_predicated'])} | "
                         f"{rate(row.get('exits_compacted'))} | {rate(row['fixed_same_mean'])} | "
                         f"{row['exits_over_full']:.3f} | {row['exits_over_fixed']:.3f} | "
                         f"{row['exits']['agreement']:.2f} | {rate(row.get('packed_exits'))} |")
        lines += ["", "exits/full and exits/fixed use the faster exit path of the row."]
        lines += ["", batched.get("quality_note", "")]
    lines += _spread_lines(sections.get("spread", {})) + _loss_lines(sections.get("loss", {}))
    return "\n".join(lines) + "\n"


def _spread_lines(spread: dict) -> list[str]:
    """The spread section's table: tokens/s, ratio to the full budget and to the fixed budget of the
    same mean steps, mean and executed steps, kernels per token."""
    if spread.get("status") != "ok":
        return [] if not spread else ["", f"Exit spread: {spread.get('status')} {spread.get('error', '')}"]
    lines = ["", f"Batched exits on a trained model's exit spread ({spread['histogram']['path']}, "
                 f"check every {spread['check_every']}), tokens/s", "",
             "| batch | setting | tokens/s | x full | x fixed, same mean | fixed budget | mean steps | "
             "executed steps | kernels per token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for batch, row in spread.get("by_batch", {}).items():
        if row.get("status") != "ok":
            lines.append(f"| {batch} | {row.get('status')} | | | | | | | |")
            continue
        lines.append(f"| {batch} | full budget | {row['full']['tokens_per_s']:,.0f} | 1 | | | | | |")
        for name, entry in row.items():
            if name == "full" or name.startswith("fixed_") or not isinstance(entry, dict) or "tokens_per_s" not in entry:
                continue
            fixed = row.get(f"fixed_{name}", {})
            kernels = entry.get("kernels_per_token", {}).get("per_token")
            lines.append(f"| {batch} | {name} | {entry['tokens_per_s']:,.0f} | {_fmt(row.get(name + '_over_full'))} | "
                         f"{_fmt(row.get(name + '_over_fixed'))} | {fixed.get('loop_counts', '-')} | "
                         f"{'/'.join(f'{m:.2f}' for m in entry['mean_steps'])} | "
                         f"{'/'.join(f'{m:.2f}' for m in entry['executed_steps'])} | {_fmt(kernels)} |")
    return lines


def _loss_lines(loss: dict) -> list[str]:
    if loss.get("status") != "ok":
        return [] if not loss else ["", f"Loss head: {loss.get('status')} {loss.get('error', '')}"]
    lines = ["", f"Training loss head, forward + backward, {loss['rows']} rows x {loss['vocab']} ({loss['dtype']})", "",
             "| path | ms | peak MiB over inputs | loss |", "| --- | --- | --- | --- |"]
    for name in ("unfused", "fused"):
        entry = loss[name]
        lines.append(f"| {name} | {entry['ms']:.2f} | {_fmt(entry.get('peak_mib_over_inputs'))} | {entry['loss']:.4f} |")
    return lines


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def write_report(report: dict, out: Path) -> None:
    from rdepth.io import write_json, write_text

    report["targets"] = evaluate_targets(report)
    write_json(out / "gpu_suite.json", report)
    write_text(out / "gpu_suite.md", markdown(report))


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s, args.sections)
    import torch

    from rdepth.run.device import device_name, resolve_device

    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    context = {"device_name": device_name(device),
               "decode_dtype": torch.bfloat16 if device.type == "cuda" else torch.float32}
    report = {"suite": "rdepth bench/gpu_suite.py", "format": 1, "environment": environment(args, device),
              "settings": {key: value for key, value in vars(args).items() if key != "out"},
              "sections": {}, "elapsed_s": 0.0}
    report["settings"]["decode_dtype"] = str(context["decode_dtype"]).replace("torch.", "")
    env = report["environment"]
    print(f"gpu_suite: {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, revision {env['revision']}, "
          f"budget {args.budget_s:.0f} s", flush=True)
    runners = {"ceiling": ceiling_section, "train": train_section, "decode": decode_section,
               "exits": exits_section, "batched": batched_section, "spread": spread_section,
               "loss": loss_section}
    for name in args.sections:
        deadline = budget.deadline_for(name)
        print(f"[{budget.elapsed():6.1f} s] {name} (until +{deadline - time.perf_counter():.0f} s)", flush=True)
        started = time.perf_counter()
        try:
            result = runners[name](args, device, deadline, context)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            result = {"status": "error", "error": _error_text(exc), "traceback": traceback.format_exc()}
            print(f"  {name} failed: {_error_text(exc)}", flush=True)
        result["section_s"] = time.perf_counter() - started
        report["sections"][name] = result
        report["elapsed_s"] = budget.elapsed()
        _free(device)
        write_report(report, out)
    report["elapsed_s"] = budget.elapsed()
    write_report(report, out)
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
