"""The decode sections' shared steps: the model and its inputs, a static-path decoder per setting, timed
rounds, kernel counts, an untimed observing pass (tokens and loop steps), and the exit threshold
calibrated to a share of the budget."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

KERNEL_COUNT_TOKENS = 2  # decoded tokens each kernel count of the decode section profiles
NO_GROUPS = {"status": "skipped", "reason": "the model has no recurrence groups"}


def rounds_args(args, repeats=None, warmup=None, tokens=None):
    return SimpleNamespace(repeats=repeats or args.repeats, warmup=args.warmup if warmup is None else warmup,
                           tokens=tokens or args.tokens)


def static_timing(decoder, prompt, steps, rounds, device, deadline, graph: bool) -> dict:
    """ms/token of ``decoder`` over the teacher-forced ``steps`` after ``prompt`` (eager or graphs). A
    compiled decoder compiles first, untimed (in the capture's warm-up, or on one eager token);
    ``compile_s`` records how long that took."""
    from bench.decode_speed import summary, time_rounds

    compiled = is_compiled(decoder)
    started = time.perf_counter()
    decoder.prefill(prompt)
    if graph:
        capture(decoder)
    elif compiled:
        decoder.step(steps[0])
    compile_s = time.perf_counter() - started
    times = time_rounds(lambda: decoder.prefill(prompt), lambda: [decoder.step(t) for t in steps],
                        rounds, device, deadline)
    result = summary(times)
    result["path"] = ("inductor+" if compiled else "") + ("graph" if graph else "eager")
    if compiled:
        result["compile_s"] = compile_s
    return result


def kernels_per_token(decoder, prompt, steps, device, replay: bool = False) -> dict:
    """Kernels per decoded token of ``decoder``, profiled (``torch.profiler``) over the first
    :data:`KERNEL_COUNT_TOKENS` of ``steps`` after ``prompt``, one untimed token first (it compiles an
    uncompiled decoder's pieces). On CUDA ``kernels``: the kernels the device ran (its activity records,
    memcpy/memset apart as ``copies``), with the launch calls that started them; on a CPU ``aten_ops``,
    the leaf aten ops (:func:`bench.decode_speed.count_per_token`), the CPU's stand-in for launches (Inductor's
    fused C++ kernels are no aten ops). ``per_token`` is the one of the two this device has. A captured
    decoder runs the pieces its graphs were recorded from, eagerly (``replay=False``: the same kernels,
    each launched), or replays its graphs (``replay=True``: one launch per graph)."""
    from bench.decode_speed import count_per_token

    tokens = steps[:KERNEL_COUNT_TOKENS]
    if is_captured(decoder):
        decoder.executor.replay = replay
    decoder.prefill(prompt)
    decoder.step(tokens[0])
    decoder.prefill(prompt)
    counts = count_per_token(lambda: [decoder.step(token) for token in tokens], device)
    if is_captured(decoder):
        decoder.executor.replay = True
    result = {key: value / len(tokens) for key, value in counts.items() if isinstance(value, (int, float))}
    result["per_token"] = result["kernels" if device.type == "cuda" else "aten_ops"]
    result["run"] = ("graph replay" if replay and is_captured(decoder) else "eager") + \
        (", Inductor pieces" if is_compiled(decoder) else "")
    return result


def is_compiled(decoder) -> bool:
    """Whether ``decoder``'s pieces run through Inductor (its executor, or the one under its graphs)."""
    from bench.gpu.executors.compiled import Compiled

    return isinstance(getattr(decoder.executor, "inner", decoder.executor), Compiled)


def is_captured(decoder) -> bool:
    from bench.gpu.executors.graphs import Captured

    return isinstance(decoder.executor, Captured) and bool(decoder.executor.graphs)


def capture(decoder) -> None:
    """Record ``decoder``'s main budget as CUDA graphs, per read span where it reads spans (``--span-buckets``)."""
    from bench.gpu.executors.graphs import Captured

    executor, span_buckets = decoder.executor, None
    if isinstance(executor, Captured):  # eager span reads (make_decoder): now graphs of the same spans
        span_buckets = executor.span_buckets
        decoder.use(executor.inner)
    Captured.record(decoder, span_buckets=span_buckets)


def observe(decoder, prompt, steps, check_every: int | None) -> dict:
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
    executed = taken.amax(dim=2)  # (T, G): the batch's slowest row
    executed = budget.expand_as(executed) if check_every is None else \
        torch.minimum(torch.ceil(executed / check_every) * check_every, budget)
    return {"tokens": torch.stack(chosen, dim=1), "mean_steps": taken.mean(dim=(0, 2)).tolist(),
            "executed_steps": executed.mean(dim=0).tolist()}


def decode_inputs(config, batch, args, device, seed=1):
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


def make_decoder(model, batch, budget, args, noise, *, loop_counts=None, factory=None, check_every=None,
                 compile=False, quantile=None):
    """A ``Decoder`` of ``model`` for ``batch`` rows: fixed ``loop_counts`` (``budget`` when None), or a loop
    controller from ``factory`` checked on the host every ``check_every`` steps (with ``quantile``: the
    batch-quantile exit around it). Its executor: Inductor-compiled pieces (``compile``, in
    ``--decode-compile-mode``), else eager reading the written span in ``--span-buckets`` sizes (the spans
    :func:`capture` records graphs of), else eager."""
    from bench.gpu.batch_quantile import BatchQuantile
    from bench.gpu.executors.compiled import Compiled
    from bench.gpu.executors.graphs import Captured
    from bench.gpu.executors.masked import Masked
    from rdepth.model.decoder import Decoder
    from rdepth.model.executors.eager import Executor

    if factory is not None and quantile is not None:
        factory = (lambda rule: lambda: BatchQuantile(rule(), quantile))(factory)
    options = {"controller_factory": factory} if factory else {"loop_counts": loop_counts or budget}
    decoder = Decoder(model, batch, noise=noise, capacity=args.capacity, **options)
    if compile:
        return decoder.use(Compiled(args.decode_compile_mode, check_every))
    decoder.use(Executor(check_every))
    if args.span_buckets is not None:
        decoder.use(Captured(Masked(check_every), args.span_buckets))
    return decoder


def policy_factory(name, tau, budget):
    from rdepth.exits.controller import controller_factory

    return controller_factory(name, tau, list(budget))


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
        decoder = make_decoder(model, 1, budget, args, noise, factory=policy_factory(args.policy, tau, budget))
        seen = observe(decoder, prompt, steps, None)
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



def looped_decode_model(args, device, context):
    """The exit sections' model in the decode dtype, its config and the full budget (``--loops`` in every
    group); ``(None, config, ())`` when the model has no recurrence groups."""
    model, config = decode_model(args, device, context["decode_dtype"])
    if not config.n_groups:
        return None, config, ()
    return model, config, (args.loops,) * config.n_groups


def agreement(tokens, reference) -> float:
    return float((tokens == reference).float().mean())


def with_rate(timing: dict, batch: int) -> dict:
    timing["tokens_per_s"] = batch * 1000 / timing["ms_per_token"]
    return timing


def batch_sizes(batches, deadline, by_batch: dict, label: str):
    """Each of ``batches`` with its own deadline, an even share of the time the section has left; once the
    section's ``deadline`` has passed, the sizes not reached are recorded skipped in ``by_batch`` (the
    first always runs). Yields ``(batch, until)``."""
    for position, batch in enumerate(batches):
        until = time.perf_counter() + max(deadline - time.perf_counter(), 0.0) / (len(batches) - position)
        if by_batch and time.perf_counter() > deadline:
            by_batch[str(batch)] = {"status": "skipped", "reason": "out of time"}
            continue
        print(f"  {label}, batch {batch}", flush=True)
        yield batch, until


def full_budget_row(model, batch, budget, args, noise, prompt, steps, rounds, device, until, graph):
    """The full budget at ``batch`` rows: its untimed observed pass (the reference tokens the exit rows
    agree with) and its timing with tokens/s."""
    full = make_decoder(model, batch, budget, args, noise)
    reference = observe(full, prompt, steps, None)
    return reference, with_rate(static_timing(full, prompt, steps, rounds, device, until, graph), batch)
