"""The timed calls the depth-batching benchmarks share: the engine and the lock-step decoder over one set of
requests, interleaved timing rounds, and the throughput table.

``bench/depth_batching.py`` (task windows: each request its whole window, one new token) and
``bench/depth_batching_text.py`` (text prompts, then ``new_tokens`` greedy tokens) build their requests
and settings and call these. Both paths feed every position one at a time (the engine always does; the
lock-step decoder through :meth:`Decoder.step`), so the two differ only in how rows share a batch.
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np


def tick_list(text: str) -> list[str]:
    """The engine's ticks named by a benchmark's --ticks (comma-separated; eager always among them, first)."""
    from rdepth.engine import TICKS
    from rdepth.errors import RdepthError

    asked = [tick.strip() for tick in text.split(",") if tick.strip()]
    unknown = sorted(set(asked) - set(TICKS))
    if unknown:
        raise RdepthError(f"--ticks takes {', '.join(TICKS)}; got {', '.join(unknown)}")
    return ["eager", *[tick for tick in dict.fromkeys(asked) if tick != "eager"]]


def engine_call(model, windows, ids, width, budget, seed, kv_layout="exact", new_tokens=1, tick="eager", ahead=1):
    """A call that decodes ``windows`` ``[N, T]`` (each request's prompt; initial states keyed by ``ids``)
    through one :class:`rdepth.engine.Engine` of ``width`` slots at ``budget`` (``loop_counts`` or
    ``controller_factory``), ``new_tokens`` greedy tokens each; and the record it fills: per-request
    latency (s from the call's start), the teacher-forced ``predicted`` and generated ``tokens`` per
    request (by its index in ``windows``), executed loop steps per position (summed over groups) and
    ``paid`` (the same: the engine pays only the steps it runs). ``tick``: the engine's tick (``eager``,
    ``static``, ``compiled``); ``ahead``: the ticks one call of a static or compiled tick runs."""
    from rdepth.engine import Engine, Request

    engine = Engine(model, width, kv_layout=kv_layout, tick=tick, ahead=ahead, **budget)
    requests = [Request(window.tolist(), max_tokens=new_tokens, noise_seed=seed, sequence_id=int(i), tag=k)
                for k, (window, i) in enumerate(zip(windows, ids, strict=False))]
    record = {}

    def call():
        start = time.perf_counter()
        steps_before, positions_before = sum(engine.stats.loop_steps), engine.stats.positions
        for request in requests:
            engine.add_request(request)
        done = list(engine.run())
        record["latency"] = [d.finished_s - start for d in done]
        record["predicted"] = {d.request.tag: d.predicted for d in done}
        record["tokens"] = {d.request.tag: list(d.tokens) for d in done}
        record["positions"] = engine.stats.positions - positions_before
        record["steps"] = (sum(engine.stats.loop_steps) - steps_before) / record["positions"]
        record["paid"] = record["steps"]
    return call, record


def lockstep_call(model, windows, ids, width, budget, seed, new_tokens=1):
    """A call that decodes ``windows`` in lock-step batches of ``width`` rows (:class:`Decoder`, one position
    at a time), then ``new_tokens - 1`` more greedy positions per row (the argmax of the previous
    position fed back: ``new_tokens`` tokens chosen in all, as the engine's ``max_tokens``); and its record:
    latency, generated ``tokens`` per request, executed loop steps per position and ``paid`` (each
    position's slowest row's steps per group, for every row of its batch). Each batch's decoder is made in the
    call, as a user of the lock-step decoder makes one per batch of prompts: its rows' initial states drawn
    there, as the engine draws each request's when it admits it."""
    import torch

    from rdepth.model.decoder import Decoder
    from rdepth.model.noise import StateNoise

    batches = [(windows[first:first + width], ids[first:first + width]) for first in range(0, len(windows), width)]
    tensors = [torch.from_numpy(part).to(next(model.parameters()).device) for part, _ in batches]
    record = {}

    def call():
        start = time.perf_counter()
        latency, rows, paid, positions, tokens = [], 0.0, 0.0, 0, {}
        for first, ((_, part_ids), part) in enumerate(zip(batches, tensors, strict=True)):
            decoder = Decoder(model, part.shape[0], noise=StateNoise(seed, [int(i) for i in part_ids]), **budget)
            chosen = []
            for t in range(part.shape[1] + new_tokens - 1):
                logits = decoder.step(part[:, t:t + 1] if t < part.shape[1] else chosen[-1])
                if t >= part.shape[1] - 1 and new_tokens > 1:
                    chosen.append(logits.argmax(dim=-1, keepdim=True))  # [B, 1]
                computed = decoder.computed  # [G, B]
                rows += float(computed.sum())
                paid += float(computed.max(dim=1).values.sum()) * part.shape[0]
                positions += part.shape[0]
            latency += [time.perf_counter() - start] * part.shape[0]
            if chosen:
                generated = torch.cat(chosen, dim=1).cpu().tolist()  # [B, new_tokens]
                tokens.update({first * width + k: row for k, row in enumerate(generated)})
        record.update(latency=latency, steps=rows / positions, paid=paid / positions, positions=positions,
                      tokens=tokens)
    return call, record


def timed_rounds(calls: dict, args, width: int) -> dict[str, list[float]]:
    """--warmup untimed calls of each, then --rounds rounds in a shuffled order: seconds per call."""
    samples = {label: [] for label in calls}
    for call in calls.values():
        for _ in range(args.warmup):
            call()
    shuffle = random.Random(args.seed + width)
    for _ in range(args.rounds):
        names = list(calls)
        shuffle.shuffle(names)
        for name in names:
            start = time.perf_counter()
            calls[name]()
            if args.device.startswith("cuda"):
                import torch

                torch.cuda.synchronize()
            samples[name].append(time.perf_counter() - start)
    return samples


def throughput_rows(samples: dict, records: dict, positions: int, settings: dict, fixed: str) -> dict:
    """Tokens/s (positions/s: median and range), latency percentiles, steps and paid steps per position, and
    the ratio to the engine at the ``fixed`` budget (``vs_engine_fixed``: its eager tick; ``vs_fastest_fixed``:
    the fastest fixed-budget path timed at that width, any engine tick or the lock-step decoder) against the bound the paid steps allow (F's steps per position, summed
    over groups, over the row's paid steps)."""
    rows = {}
    for name, seconds in samples.items():
        latency = np.array(records[name]["latency"])
        rows[name] = {"tokens_per_s": positions / statistics.median(seconds),
                      "range_tokens_per_s": [positions / max(seconds), positions / min(seconds)],
                      "latency_p50_s": float(np.percentile(latency, 50)),
                      "latency_p99_s": float(np.percentile(latency, 99)),
                      "steps_per_position": records[name]["steps"],
                      "paid_steps_per_position": records[name]["paid"]}
    base = rows[f"engine | {fixed}"]
    # the fastest fixed-budget path rdepth offers at this width: every engine tick timed at F and the lock-step
    # decoder at F (not the shared layout, which changes the answers)
    fastest = max(row["tokens_per_s"] for name, row in rows.items()
                  if name.endswith(f" | {fixed}") and "shared" not in name)
    fixed_steps = sum(settings[fixed]["loop_counts"])
    for row in rows.values():
        row["vs_engine_fixed"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["vs_fastest_fixed"] = row["tokens_per_s"] / fastest
        row["bound"] = fixed_steps / row["paid_steps_per_position"]
        row["share_of_bound"] = row["vs_fastest_fixed"] / row["bound"]
    return rows
