"""Section ``train``: the trainer's own ``TrainStep.train_step`` on the preset (loop counts drawn as in
training), then on a plain GPT of the same width and the mean unrolled depth: tokens/s, model FLOPs
(:func:`train_flops_per_row`), MFU against the card's datasheet peak, and the per-layer-application
throughput ratio."""

from __future__ import annotations

import time
import traceback

from bench.gpu.common import error_text, free_memory, ratio, stats

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
    for spec, count in zip(config.group_specs, counts, strict=False):
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


def train_overrides(pairs) -> dict:
    """``KEY=VALUE`` texts (``--train-set``) as :class:`rdepth.train.config.TrainConfig` fields, converted by
    each field's type (bools: true/false, on/off, 1/0); an unknown field or a bad value raises ``ValueError``
    naming it. The trainer's own validation runs when the section builds its config."""
    from rdepth.cli.options import field_kinds
    from rdepth.train.config import TrainConfig

    kinds = field_kinds(TrainConfig)
    own = {"compile": "--compile", "compile_scope": "--train-compile-scope", "batch_size": "--train-batch",
           "device": "--device", "data": None, "out": None, "max_steps": None, "seed": None}
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in kinds:
            raise ValueError(f"--train-set expects FIELD=VALUE with a TrainConfig field, got {pair!r}")
        if key in own:
            raise ValueError(f"--train-set {key}: the suite sets it" + (f" (use {own[key]})" if own[key] else ""))
        kind = kinds[key]
        if kind is bool:
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "on", "off", "1", "0"):
                raise ValueError(f"--train-set {key} expects true or false, got {text!r}")
            out[key] = lowered in ("true", "on", "1")
        else:
            try:
                out[key] = kind(text.strip())
            except ValueError:
                raise ValueError(f"--train-set {key} expects {kind.__name__}, got {text!r}") from None
    return out


def bench_trainer(model_config, batch: int, device, compile_layers: bool, seed: int = 0, compile_scope: str = "layer",
                  tokens=None, **overrides):
    """A :class:`rdepth.train.step.TrainStep` on random token ids of the model's vocabulary, or on
    ``tokens`` (a 1-D id array), without a data folder (:meth:`~rdepth.train.step.TrainStep.on_tokens`):
    seeded weights, the trainer's AdamW (fused on CUDA), bf16 autocast on CUDA, ``BatchSampler`` windows,
    each layer compiled when asked; only the step is timed. ``overrides``: further
    :class:`~rdepth.train.config.TrainConfig` fields (``--train-set``).
    """
    from rdepth.train.config import TrainConfig
    from rdepth.train.step import TrainStep

    config = TrainConfig(data="(random ids)", out="(none)", batch_size=batch, device=str(device),
                         compile=compile_layers, seed=seed, max_steps=10**6, compile_scope=compile_scope,
                         **overrides)
    return TrainStep.on_tokens(model_config, config, tokens)


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
                                    compile_scope=args.train_compile_scope, **args.train_set)
            return {**_timed_steps(trainer, model_config, batch, args, device, deadline),
                    "out_of_memory_at_batch": out_of_memory, "compile_scope": args.train_compile_scope,
                    "train_set": dict(args.train_set)}
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            print(f"  out of memory at batch {batch}; trying {batch // 2}", flush=True)
            out_of_memory.append(batch)
            batch //= 2
        finally:
            trainer = None
            free_memory(device)


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
    loss_finite = not bool(trainer.nonfinite)
    tokens = batch * model_config.block_size
    flops = [train_flops_per_row(model_config, c) for c in counts]
    step_flops = [f["total"] * batch for f in flops]
    applications = [f["layer_applications"] for f in flops]
    total_s = sum(step_ms) / 1000
    result = {
        "batch": batch, "seq_len": model_config.block_size, "tokens_per_step": tokens,
        "steps_timed": len(step_ms), "steps_asked": args.train_steps, "warmup_steps": args.train_warmup,
        "warmup_s": warmup_s, "wall_s": wall_s, "step_ms": stats(step_ms), "loop_counts": counts,
        "flops_per_step": step_flops, "layer_applications_per_token": applications,
        "tokens_per_s": tokens * len(step_ms) / total_s,
        "achieved_tflops": sum(step_flops) / total_s / 1e12,
        "achieved_tflops_per_step": stats([f / (t / 1000) / 1e12 for f, t in zip(step_flops, step_ms, strict=False)]),
        "layer_applications_per_s": sum(a * tokens for a in applications) / total_s,
        "loss_finite": loss_finite, "compiled": trainer.config.compile,
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
                out[f"{name}_compile_error"] = error_text(exc)
                print(f"  compiled step failed ({exc!r:.200}); timing eager", flush=True)
                out[name] = time_training(config, args, device, until, False)
        except Exception as exc:  # noqa: BLE001 - the other model is still measured
            out[name] = {"status": "error", "error": error_text(exc), "traceback": traceback.format_exc()}
            print(f"  train {name} failed: {error_text(exc)}", flush=True)
        free_memory(device)
    measured_models = [name for name in ("looped", "plain") if "achieved_tflops" in out[name]]
    if not measured_models:
        raise RuntimeError(f"neither model trained: {out['looped']['error']}")
    out["status"] = "ok" if len(measured_models) == 2 else "partial"
    peak = peak_tflops(context["device_name"]) if device.type == "cuda" else None
    measured = context.get("measured_peak_tflops")
    for name in measured_models:
        achieved = out[name]["achieved_tflops"]
        out[name]["mfu"] = ratio(achieved, peak)
        out[name]["mfu_vs_measured_ceiling"] = ratio(achieved, measured)
    out["peak_tflops"] = peak
    out["peak_note"] = ("datasheet dense bf16 peak of the card (PEAK_BF16_TFLOPS)" if peak
                        else "no bf16 peak for this device: MFU is null")
    out["layer_application_throughput_ratio"] = ratio(out["looped"].get("layer_applications_per_s"),
                                                       out["plain"].get("layer_applications_per_s"))
    out["flop_throughput_ratio"] = ratio(out["looped"].get("achieved_tflops"), out["plain"].get("achieved_tflops"))
    out["ratio_note"] = ("layer applications per second, looped over plain (the issue's measure; a looped step "
                         "run without gradients costs a third of one with them, which favours the looped model); "
                         "flop_throughput_ratio compares achieved model FLOP/s instead")
    return out

