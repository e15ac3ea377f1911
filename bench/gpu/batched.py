"""Section ``batched``: batched decoding with exits (predicated) against the full
budget and a fixed budget of the same mean steps, tokens/s per batch size, with the greedy-token
agreement against the full budget. (The compacted variant was removed with the decoder's row compaction:
slower than predication at every batch on an H200, docs/results.md.)"""

from __future__ import annotations

import time

from bench.gpu.common import error_text, free_memory, ratio
from bench.gpu.decoding import (
    NO_GROUPS,
    agreement,
    batch_sizes,
    calibrate_tau,
    decode_inputs,
    full_budget_row,
    looped_decode_model,
    make_decoder,
    observe,
    policy_factory,
    rounds_args,
    static_timing,
    with_rate,
)


def batched_section(args, device, deadline, context) -> dict:
    import torch

    from rdepth.model.noise import StateNoise

    model, config, budget = looped_decode_model(args, device, context)
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
        calibration_prompt, calibration_steps = decode_inputs(config, 1, args, device)
        calibration = calibrate_tau(model, budget, args, device, StateNoise(0, [0]), calibration_prompt,
                                    calibration_steps[: max(4, args.tokens // 4)], deadline)
        tau, out["calibration"] = calibration["tau"], calibration
    out["tau"] = tau
    policy = policy_factory(args.policy, tau, budget)
    rounds = rounds_args(args)
    by_batch = {}
    start = time.perf_counter()
    for batch, until in batch_sizes(args.batches, deadline, by_batch, "batched decode"):
        prompt, steps = decode_inputs(config, batch, args, device)
        noise = StateNoise(0, range(batch))
        row = {}
        try:
            reference, row["full"] = full_budget_row(model, batch, budget, args, noise, prompt, steps, rounds,
                                                     device, until, graph)
            # Exits, every row computing every step of a chunk (predicated).
            variants = ["exits_predicated"]
            for variant in variants:
                exits = make_decoder(model, batch, budget, args, noise, factory=policy, check_every=every)
                seen = observe(exits, prompt, steps, every)
                row[variant] = with_rate(static_timing(exits, prompt, steps, rounds, device, until, graph), batch)
                row[variant].update(mean_steps=seen["mean_steps"], executed_steps=seen["executed_steps"],
                                    agreement=agreement(seen["tokens"], reference["tokens"]))
                del exits
            best = max(variants, key=lambda v: row[v]["tokens_per_s"])
            row["exits"] = {**row[best], "variant": best}  # the faster exit path
            seen = {"mean_steps": row["exits_predicated"]["mean_steps"]}
            fixed_counts = tuple(min(args.loops, max(1, round(m))) for m in seen["mean_steps"])
            fixed = make_decoder(model, batch, budget, args, noise, loop_counts=fixed_counts)
            fixed_seen = observe(fixed, prompt, steps, None)
            row["fixed_same_mean"] = with_rate(static_timing(fixed, prompt, steps, rounds, device, until, graph),
                                                batch)
            row["fixed_same_mean"].update(loop_counts=list(fixed_counts),
                                          agreement=agreement(fixed_seen["tokens"], reference["tokens"]))
            del fixed
            row["predicated_over_full"] = ratio(row["exits_predicated"]["tokens_per_s"], row["full"]["tokens_per_s"])
            row["exits_over_full"] = ratio(row["exits"]["tokens_per_s"], row["full"]["tokens_per_s"])
            row["exits_over_fixed"] = ratio(row["exits"]["tokens_per_s"], row["fixed_same_mean"]["tokens_per_s"])
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError as exc:
            row = {"status": "error", "error": error_text(exc)}
        free_memory(device)
        by_batch[str(batch)] = row
    out["by_batch"] = by_batch
    out["seconds"] = time.perf_counter() - start
    return out
