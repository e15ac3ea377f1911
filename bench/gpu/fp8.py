"""Section ``fp8`` (run when named: ``--sections fp8``): the trainer's step with ``TrainConfig.fp8`` (torchao
float8 matmuls in the layers and adapters) against bf16, on the same tokens from the same initial weights.

Both runs build a trainer from the same seed (weights, batches, loop counts and loop-state noise are
functions of it and the step), train ``--fp8-steps`` steps, and keep every step's loss; the loss curve
of each, the relative gap per step ``(fp8 - bf16) / bf16``, tokens/s, model FLOP/s and MFU against the
card's *bf16* peak (the issue's measure: float8 is judged on the bf16 scale) are recorded. The first
``--train-warmup`` steps (compilation) count in the curve, not in the timing. The tokens: a prepared data
folder's training split (``--fp8-data``, e.g. the wiki corpus in GPT-2 tokens, carried to the card), or
random ids of the preset's vocabulary, on which both runs only fall to the uniform loss (a weak check
of the curve; the speed is the same). bf16 runs first, in 45% of the time; fp8 then runs as many steps, or
fewer if the deadline comes first: the curves are compared over the steps both ran. Needs a CUDA card of
compute capability >= 8.9 and torchao; elsewhere the section records ``skipped (needs CUDA sm_89+)`` (or
``skipped (torchao not installed)``) and returns."""

from __future__ import annotations

import time
import traceback

from bench.gpu.common import error_text, free_memory, ratio, stats
from bench.gpu.train import bench_trainer, peak_tflops, train_flops_per_row

LOSS_TOLERANCE = 0.01  # the issue's target: the fp8 loss within 1% of bf16's at the same step
NEEDS_CARD = "skipped (needs CUDA sm_89+)"


def fp8_section(args, device, deadline, context) -> dict:
    from rdepth.errors import RdepthError
    from rdepth.train import fp8 as fp8_module

    try:
        fp8_module.check_fp8_device(device)
    except RdepthError as exc:
        return {"status": NEEDS_CARD, "reason": str(exc)}
    try:
        fp8_module.require_torchao()
    except RdepthError as exc:
        return {"status": "skipped (torchao not installed)", "reason": str(exc)}
    model_config, tokens, data = _model_and_tokens(args)
    compile_layers = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    overrides = {k: v for k, v in args.train_set.items() if k != "fp8"}  # the section sets fp8 itself
    out = {"status": "ok", "preset": args.preset, "data": data, "seed": 0, "compile": compile_layers,
           "compile_scope": args.train_compile_scope, "train_set": overrides, "steps_asked": args.fp8_steps,
           "loss_tolerance": LOSS_TOLERANCE}
    start = time.perf_counter()
    runs = {}
    # bf16 first, within 45% of the time; fp8 then runs the steps bf16 ran (compiling float8 casts takes
    # longer), stopping at the deadline if it must; the curves are compared over the steps both ran.
    for name, fp8, until, steps in (("bf16", False, start + 0.45 * (deadline - start), args.fp8_steps),
                                    ("fp8", True, deadline, None)):
        steps = steps if steps is not None else len(runs["bf16"]["loss"])
        print(f"  fp8 section: {name}, {steps} steps", flush=True)
        try:
            try:
                runs[name] = _run(model_config, tokens, args, device, compile_layers, overrides, fp8, steps, until)
            except Exception as exc:  # noqa: BLE001 - a compile failure falls back to eager, recorded
                if not compile_layers:
                    raise
                print(f"  compiled {name} run failed ({exc!r:.200}); running it eager", flush=True)
                free_memory(device)
                runs[name] = _run(model_config, tokens, args, device, False, overrides, fp8, steps, until)
                runs[name]["compile_error"] = error_text(exc)
        except Exception as exc:  # noqa: BLE001 - the bf16 curve already measured is kept
            out[name] = {"status": "error", "error": error_text(exc), "traceback": traceback.format_exc()}
            out.update(runs, status="error", error=f"{name} run: {error_text(exc)}")
            return out
        finally:
            free_memory(device)
    bf16, fp8 = runs["bf16"], runs["fp8"]
    gaps = [(b - a) / a for a, b in zip(bf16["loss"], fp8["loss"], strict=False)]
    peak = peak_tflops(context["device_name"]) if device.type == "cuda" else None
    for entry in runs.values():
        entry["mfu"] = ratio(entry["achieved_tflops"], peak)  # against the bf16 peak, float8 or not
        entry["mfu_vs_measured_ceiling"] = ratio(entry["achieved_tflops"], context.get("measured_peak_tflops"))
    out.update(runs)
    out.update({
        "steps": len(gaps), "relative_gap": gaps, "max_abs_relative_gap": max(map(abs, gaps)),
        "final_relative_gap": gaps[-1], "loss_within_tolerance": all(abs(g) <= LOSS_TOLERANCE for g in gaps),
        "fp8_over_bf16_tokens_per_s": ratio(fp8["tokens_per_s"], bf16["tokens_per_s"]), "peak_tflops": peak,
        "peak_note": "MFU of both runs against the card's datasheet dense bf16 peak (PEAK_BF16_TFLOPS)",
    })
    return out


def _run(model_config, tokens, args, device, compile_layers, overrides, fp8, steps, until) -> dict:
    """One run of the comparison: a fresh trainer from seed 0 (fp8 or not) and :func:`_curve`."""
    trainer = bench_trainer(model_config, args.train_batch, device, compile_layers,
                            compile_scope=args.train_compile_scope, tokens=tokens, fp8=fp8, **overrides)
    result = _curve(trainer, model_config, args, device, steps, until)
    result["compiled"] = compile_layers
    if fp8:
        result["plan"] = trainer.fp8_plan.to_dict()
    return result


def _model_and_tokens(args):
    """The preset's config and the training tokens: ``--fp8-data``'s train split (its vocabulary and
    tokenizer replace the preset's), else None (random ids of the preset's vocabulary)."""
    from rdepth.config import get_preset

    config = get_preset(args.preset)
    if not args.fp8_data:
        return config, None, "random token ids of the preset's vocabulary (both runs fall to the uniform loss)"
    from rdepth.data.shards import TokenShards
    from rdepth.train.resume import data_model_config

    shards = TokenShards.open(args.fp8_data, verify=True)
    config = data_model_config(config, shards)
    return config, shards.train, f"{args.fp8_data}: train split, {len(shards.train):,} tokens ({config.tokenizer})"


def _curve(trainer, model_config, args, device, steps: int, until: float | None) -> dict:
    """``steps`` train steps from step 0 (fewer if ``until`` passes, at least warm-up + 2): every step's loss
    (read once at the end: no host sync per step) and the timing of those after the warm-up."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, counts, times, events = [], [], [], []
    warmup = min(args.train_warmup, max(steps - 1, 0))
    started = time.perf_counter()
    for step in range(steps):
        timed = step >= warmup
        if cuda and timed:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        t0 = time.perf_counter()
        loss, used = trainer.train_step(step)
        if timed:
            if cuda:
                end.record()
                events.append((begin, end))
            else:
                times.append(1000 * (time.perf_counter() - t0))
            counts.append(list(used[0]))
        losses.append(loss)
        if step == warmup - 1 and cuda:
            torch.cuda.synchronize(device)
        if step == warmup - 1:
            warmup_s = time.perf_counter() - started
        if until is not None and time.perf_counter() > until and step + 1 >= warmup + 2:
            break
    if cuda:
        torch.cuda.synchronize(device)
    step_ms = [b.elapsed_time(e) for b, e in events] if cuda else times
    tokens = args.train_batch * model_config.block_size
    step_flops = [train_flops_per_row(model_config, c)["total"] * args.train_batch for c in counts]
    total_s = sum(step_ms) / 1000
    return {"loss": [float(value) for value in losses], "steps_timed": len(step_ms), "warmup_steps": warmup,
            "warmup_s": warmup_s if warmup else 0.0, "step_ms": stats(step_ms),
            "tokens_per_s": tokens * len(step_ms) / total_s, "achieved_tflops": sum(step_flops) / total_s / 1e12,
            "loop_counts": counts, "loss_finite": not bool(trainer.nonfinite),
            **({"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30} if cuda else {})}
