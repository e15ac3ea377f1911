"""Section ``decode``: batch 1 at the full budget on the decoder (eager, CUDA graphs, Inductor-compiled
pieces), the looped model beside the plain one of the
same width; kernels (CPU: aten ops) per decoded token and per loop step."""

from __future__ import annotations

import time
import traceback

from bench.gpu.common import CUDA_ONLY, error_text, free_memory
from bench.gpu.decoding import (
    KERNEL_COUNT_TOKENS,
    decode_inputs,
    decode_model,
    kernels_per_token,
    make_decoder,
    rounds_args,
    static_timing,
)


def decode_section(args, device, deadline, context) -> dict:
    from rdepth.model import RecurrentLM
    from rdepth.model.noise import StateNoise

    dtype = context["decode_dtype"]
    model, config = decode_model(args, device, dtype)
    budget = (args.loops,) * config.n_groups
    prompt, steps = decode_inputs(config, 1, args, device)
    noise = StateNoise(0, [0])
    graphs = device.type == "cuda"
    out = {"status": "ok", "batch": 1, "loops": list(budget), "prompt": args.prompt, "tokens": args.tokens,
           "dtype": str(dtype).replace("torch.", ""), "capacity": args.capacity or config.block_size,
           "unit": "ms/token, median [IQR] over rounds"}
    start = time.perf_counter()

    def share(fraction):  # a setting's own deadline: a fraction of what the section has left
        now = time.perf_counter()
        return now + fraction * max(deadline - now, 0.0)

    decoders = {}  # row key -> the decoder it timed, kept for the kernel counts

    def static_rows(on, budget_of, noise_of, prefix, fractions) -> None:
        """The static path on model ``on``: eager, CUDA graph, and Inductor-compiled (graph on CUDA, eager
        on the CPU); each row its own decoder, each ``fractions`` of what the section has left."""
        key = f"{prefix}static_eager"
        decoders[key] = make_decoder(on, 1, budget_of, args, noise_of)
        out[key] = static_timing(decoders[key], prompt, steps, rounds_args(args), device, share(fractions[0]),
                                  graph=False)
        key = f"{prefix}static_graph"
        if graphs:
            decoders[key] = make_decoder(on, 1, budget_of, args, noise_of)
            out[key] = static_timing(decoders[key], prompt, steps, rounds_args(args), device, share(fractions[1]),
                                      graph=True)
        else:
            out[key] = {"status": CUDA_ONLY}
        key = f"{prefix}static_inductor"
        try:  # a compiler failure must not lose the rows measured
            decoders[key] = make_decoder(on, 1, budget_of, args, noise_of, compile=True)
            out[key] = static_timing(decoders[key], prompt, steps, rounds_args(args), device, share(fractions[2]),
                                      graph=graphs)
        except Exception as exc:  # noqa: BLE001
            decoders.pop(key, None)
            out[key] = {"status": "error", "error": error_text(exc), "traceback": traceback.format_exc()}
            print(f"  {key} failed: {error_text(exc)}", flush=True)
        free_memory(device)

    static_rows(model, budget, noise, "", (0.2, 0.25, 0.4))
    plain = RecurrentLM(config.replace(groups="", eval_loops=None)).to(device=device, dtype=dtype).eval()
    out["plain_layers"] = plain.config.n_layer
    static_rows(plain, (), None, "plain_", (0.25, 0.4, 0.75))  # the rest: the kernel counts
    try:  # a profiler failure must not lose the rows measured
        out["kernel_counts"] = kernel_counts(decoders, model, budget, noise, prompt, steps, args, device, deadline)
    except Exception as exc:  # noqa: BLE001
        out["kernel_counts"] = {"status": "error", "error": error_text(exc), "traceback": traceback.format_exc()}
        print(f"  kernel counts failed: {error_text(exc)}", flush=True)
    decoders.clear()
    out["fast_path"] = ("the static rows' attention views its one query per row (AttentionContext.one_per_row) and "
                        "reads an additive mask made once per token (docs/gpu.md)")
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
            return kernels_per_token(decoder, prompt, steps, device, replay=replay)
        except Exception as exc:  # noqa: BLE001
            return {"status": "error", "error": error_text(exc)}

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
        one = counted(make_decoder(model, 1, budget, args, noise, loop_counts=(1,) * len(budget), compile=compiled))
        if "per_token" not in one:
            out["per_loop_step"][key] = one
            continue
        out["per_loop_step"][key] = {"per_loop_step": (full - one["per_token"]) / extra, "full_budget": full,
                                     "budget_1": one["per_token"], "extra_loop_steps": extra}
    out["seconds"] = time.perf_counter() - started
    return out

