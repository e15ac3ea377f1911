"""Section ``spread``: batched exits on a trained model's exit spread (each row's exit step drawn from
a recorded histogram), predicated and at batch quantiles, against the full budget and a fixed budget of
each one's mean steps. (Compacted and conditional rows were removed with those decoder paths: compaction
was slower than predication at every batch on an H200, and no torch this project uses has CUDA-graph
conditional nodes; docs/results.md, docs/gpu.md.)"""

from __future__ import annotations

import time

from bench.gpu.common import error_text, free_memory, ratio
from bench.gpu.decoding import (
    NO_GROUPS,
    agreement,
    batch_sizes,
    decode_inputs,
    full_budget_row,
    kernels_per_token,
    looped_decode_model,
    make_decoder,
    observe,
    rounds_args,
    static_timing,
    with_rate,
)

QUANTILES = (0.9, 0.75)  # the batch-quantile exits of the spread section


def spread_section(args, device, deadline, context) -> dict:
    """Batched exits on a trained model's exit spread: each row's exit step drawn on the device from
    ``bench/exit_histogram.json`` (:mod:`bench.exit_spread`), so a batch's rows leave the loop as trained rows do,
    on random weights. Per batch size: the full budget; the spread's exits predicated (chunks of the best
    ``--check-every``); the batch-quantile exits (``QUANTILES``, :class:`BatchQuantile`); a fixed budget of
    each one's mean steps; kernels (CPU: aten ops) per token of every decoder but the predicated one."""
    import torch

    from bench.exit_spread import DEFAULT_HISTOGRAM, factory, load_histogram
    from rdepth.model.noise import StateNoise

    model, config, budget = looped_decode_model(args, device, context)
    if model is None:
        return dict(NO_GROUPS)
    graph = device.type == "cuda"
    every = context.get("exit_check_every", args.check_every[0])
    histogram_path = args.histogram or str(DEFAULT_HISTOGRAM)
    histogram = load_histogram(histogram_path)
    out = {"status": "ok", "loops": list(budget), "path": "graph" if graph else "eager", "check_every": every,
           "histogram": {"path": histogram_path, "source": histogram.get("source"),
                         "mean_steps": histogram.get("mean_steps")},
           "quantiles": list(QUANTILES)}
    rounds = rounds_args(args)
    by_batch = {}
    for batch, until in batch_sizes(args.spread_batches, deadline, by_batch, "exit spread"):
        prompt, steps = decode_inputs(config, batch, args, device)
        noise = StateNoise(0, range(batch))
        spread = factory(histogram, budget, seed=0, device=device)
        row = {}
        try:
            reference, row["full"] = full_budget_row(model, batch, budget, args, noise, prompt, steps, rounds,
                                                     device, until, graph)
            variants = {"spread_predicated": {}}
            for q in QUANTILES:
                variants[f"quantile_{q:g}"] = {"quantile": q}
            for name, options in variants.items():
                if time.perf_counter() > until and name != "spread_predicated":  # the first always runs
                    row[name] = {"status": "skipped", "reason": "out of time"}
                    continue
                try:  # a setting that fails leaves the others
                    exits = make_decoder(model, batch, budget, args, noise, factory=spread, check_every=every,
                                         **options)
                    seen = observe(exits, prompt, steps, every)
                    row[name] = with_rate(static_timing(exits, prompt, steps, rounds, device, until, graph), batch)
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    row[name] = {"status": "error", "error": error_text(exc)}
                    print(f"  spread {name} at batch {batch} failed: {error_text(exc)}", flush=True)
                    free_memory(device)
                    continue
                row[name].update(mean_steps=seen["mean_steps"], executed_steps=seen["executed_steps"],
                                 agreement=agreement(seen["tokens"], reference["tokens"]))
                if name != "spread_predicated":
                    try:
                        row[name]["kernels_per_token"] = kernels_per_token(exits, prompt, steps, device)
                    except Exception as exc:  # noqa: BLE001 - a count that fails leaves the timing
                        row[name]["kernels_per_token"] = {"status": "error", "error": error_text(exc)}
                matched_to = "mean_steps"
                counts = tuple(min(args.loops, max(1, round(m))) for m in seen[matched_to])
                fixed_name = f"fixed_{name}"
                if time.perf_counter() < until:
                    fixed = make_decoder(model, batch, budget, args, noise, loop_counts=counts)
                    row[fixed_name] = with_rate(static_timing(fixed, prompt, steps, rounds, device, until, graph),
                                                 batch)
                    row[fixed_name]["loop_counts"] = list(counts)
                    row[fixed_name]["matched_to"] = matched_to
                    row[f"{name}_over_fixed"] = ratio(row[name]["tokens_per_s"], row[fixed_name]["tokens_per_s"])
                    del fixed
                row[f"{name}_over_full"] = ratio(row[name]["tokens_per_s"], row["full"]["tokens_per_s"])
                del exits
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError as exc:
            row = {"status": "error", "error": error_text(exc)}
        free_memory(device)
        by_batch[str(batch)] = row
    out["by_batch"] = by_batch
    return out

