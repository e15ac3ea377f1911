"""Section ``exits``: at batch 1, the per-step cost of an exit check (a rule that never fires, without
and with the per-chunk host check, on eager and Inductor-compiled pieces), and a rule calibrated to
about ``--exit-fraction`` of the steps, with host checks, against the full budget and a fixed budget of
the same mean. (The row with conditional steps was removed with the decoder's ``conditional`` option: no
torch this project uses has CUDA-graph conditional nodes, docs/gpu.md.)"""

from __future__ import annotations

import time

from bench.gpu.common import error_text, free_memory, ratio
from bench.gpu.decoding import (
    NO_GROUPS,
    agreement,
    calibrate_tau,
    decode_inputs,
    looped_decode_model,
    make_decoder,
    observe,
    policy_factory,
    rounds_args,
    static_timing,
)


def exits_section(args, device, deadline, context) -> dict:
    from rdepth.model.noise import StateNoise

    model, config, budget = looped_decode_model(args, device, context)
    if model is None:
        return dict(NO_GROUPS)
    prompt, steps = decode_inputs(config, 1, args, device)
    noise = StateNoise(0, [0])
    graph = device.type == "cuda"
    rounds = rounds_args(args)
    out = {"status": "ok", "batch": 1, "loops": list(budget), "path": "graph" if graph else "eager",
           "policy": args.policy, "check_every": args.check_every}
    start = time.perf_counter()

    def share(fraction):
        now = time.perf_counter()
        return now + fraction * max(deadline - now, 0.0)

    def timed(decoder, until):
        return static_timing(decoder, prompt, steps, rounds, device, until, graph)

    # First the threshold at about half the steps (the batched section uses it too).
    calibration = calibrate_tau(model, budget, args, device, noise, prompt, steps[: max(4, len(steps) // 4)],
                                share(0.2))
    out["calibration"] = calibration
    tau = calibration["tau"]
    context["exit_tau"] = tau
    out["full"] = timed(make_decoder(model, 1, budget, args, noise), share(0.12))
    out["budget_1"] = timed(make_decoder(model, 1, budget, args, noise, loop_counts=(1,) * len(budget)), share(0.12))
    steps_full = sum(budget)
    step_ms = (out["full"]["ms_per_token"] - out["budget_1"]["ms_per_token"]) / max(steps_full - len(budget), 1)
    out["loop_step_ms"] = step_ms
    # A rule that never fires: every step pays the rule and its predication, nothing is skipped.
    never = policy_factory("step_norm", 1e-30, budget)
    checks = {}
    for every in [None, *args.check_every]:
        key = "no_host_check" if every is None else f"check_every_{every}"
        timing = timed(make_decoder(model, 1, budget, args, noise, factory=never, check_every=every), share(0.1))
        extra = (timing["ms_per_token"] - out["full"]["ms_per_token"]) / steps_full
        checks[key] = {**timing, "check_ms_per_step": extra, "share_of_loop_step": ratio(extra, step_ms)}
    out["check_cost"] = checks
    # The same on the Inductor-compiled pieces (loop step and exit check fused), against their own loop step.
    try:
        inductor_full = timed(make_decoder(model, 1, budget, args, noise, compile=True), share(0.1))
        inductor_one = timed(make_decoder(model, 1, budget, args, noise, loop_counts=(1,) * len(budget),
                                          compile=True), share(0.1))
        out["full_inductor"], out["budget_1_inductor"] = inductor_full, inductor_one
        inductor_step = (inductor_full["ms_per_token"] - inductor_one["ms_per_token"]) / \
            max(steps_full - len(budget), 1)
        out["loop_step_ms_inductor"] = inductor_step
        for every in [None, *args.check_every]:
            key = ("no_host_check" if every is None else f"check_every_{every}") + "_inductor"
            timing = timed(make_decoder(model, 1, budget, args, noise, factory=never, check_every=every,
                                        compile=True), share(0.1))
            extra = (timing["ms_per_token"] - inductor_full["ms_per_token"]) / steps_full
            checks[key] = {**timing, "check_ms_per_step": extra,
                           "share_of_loop_step": ratio(extra, inductor_step)}
    except Exception as exc:  # noqa: BLE001 - a compiler failure must not lose the rest of the section
        out["inductor_error"] = error_text(exc)
        print(f"  exits, inductor rows failed: {error_text(exc)}", flush=True)
    free_memory(device)
    # The rule at about half the steps, with each host-check interval.
    policy = policy_factory(args.policy, tau, budget)
    reference = observe(make_decoder(model, 1, budget, args, noise), prompt, steps, None)
    runs = {}
    for every in args.check_every:
        if runs and time.perf_counter() > deadline:
            runs[f"check_every_{every}"] = {"status": "skipped", "reason": "out of time"}
            continue
        decoder = make_decoder(model, 1, budget, args, noise, factory=policy, check_every=every)
        seen = observe(decoder, prompt, steps, every)
        timing = timed(decoder, share(0.25))
        saved = steps_full - sum(seen["mean_steps"])
        # Issue 12: latency falls at least in proportion to the steps saved, less the 3% check allowance.
        bound = out["full"]["ms_per_token"] - saved * step_ms * (1 - 0.03)
        runs[f"check_every_{every}"] = {
            **timing, "mean_steps": seen["mean_steps"], "executed_steps": seen["executed_steps"],
            "steps_saved": saved, "latency_ratio": ratio(timing["ms_per_token"], out["full"]["ms_per_token"]),
            "steps_ratio": sum(seen["mean_steps"]) / steps_full, "bound_ms": bound,
            "agreement": agreement(seen["tokens"], reference["tokens"])}
        del decoder
    out["policy_runs"] = runs
    best_key = min((k for k in runs if "ms_per_token" in runs[k]), key=lambda k: runs[k]["ms_per_token"])
    out["best_check_every"] = int(best_key.rsplit("_", 1)[1])
    context["exit_check_every"] = out["best_check_every"]
    mean_steps = runs[best_key]["mean_steps"]
    fixed = tuple(min(args.loops, max(1, round(m))) for m in mean_steps)
    out["fixed_same_mean"] = {**timed(make_decoder(model, 1, budget, args, noise, loop_counts=fixed), deadline),
                              "loop_counts": list(fixed)}
    out["seconds"] = time.perf_counter() - start
    return out


