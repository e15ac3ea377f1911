"""What a server's arrivals and its per-token listener cost the engine, in-process (no HTTP).

    python scripts/engine_arrivals.py --run runs/demo-s0/train --data runs/data1024 [--jitter 2,5] [--rounds 3]

``bench/serve_load.py`` sets the server against the engine fed every request at once. This splits the gap: one
engine (fixed ``--loops`` on the compiled tick running ``--ahead`` ticks a call, ``--batch-size`` slots) decodes the
same held-out requests (``--requests`` prompts of ``--prompt-tokens`` tokens, ``--max-tokens`` new, greedy)

* ``all``: every request queued at once (the serve benchmark's in-process figure);
* ``all + listener``: the same with a per-token listener that builds what the server's runner builds
  (:class:`~rdepth.serve.runner.TokenEvent`), as ``rdepth serve`` sets one;
* ``closed loop J``: ``--batch-size`` clients, each submitting its next request 0..2J ticks (uniform, seeded) after
  its last one finished: the staggered arrivals of HTTP clients, with and without the listener.

Interleaved rounds, median tokens/s, occupancy and ticks; the CPU named.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def parse_args(argv):
    from flags import at_least, positive_ints
    from serve_load import add_workload_flags

    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="scripts/engine_arrivals.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser)
    parser.add_argument("--loops", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ahead", type=int, default=4)
    parser.add_argument("--jitter", default="2,5", help="half-widths J of the closed loop's delays, in ticks")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    at_least(args, 1, "requests", "prompt_tokens", "max_tokens", "loops", "batch_size", "ahead", "rounds")
    args.jitters = positive_ints("--jitter", args.jitter)
    return args


def main(argv=None) -> int:
    import torch
    from depth_batching import _cpu_name
    from serve_load import heldout_prompts

    from rdepth.engine import Engine, Request
    from rdepth.run.checkpoint import load_model
    from rdepth.run.heldout import run_tokenizer
    from rdepth.serve.runner import TokenEvent

    args = parse_args(argv)
    torch.set_num_threads(1)
    prompts = heldout_prompts(args)
    model = load_model(args.run, torch.device("cpu"))[0].eval()
    end = getattr(run_tokenizer(args.run), "eot_id", None)
    stop = () if end is None else (end,)
    engine = Engine(model, args.batch_size, loop_counts=args.loops, tick="compiled", ahead=args.ahead)
    events: list = []

    def listener(request_id, token, steps, rules, logprob=None) -> None:
        events.append(TokenEvent(token, steps, rules, logprob))

    def request(index: int) -> Request:
        return Request(prompts[index], max_tokens=args.max_tokens, sequence_id=0, stop=stop)

    def measure(jitter: int | None, listening: bool) -> tuple[float, float, int]:
        engine.listener = listener if listening else None
        ticks, occupied = engine.stats.ticks, engine.stats.occupied
        rng, waiting, due, tokens, tick = random.Random(0), list(range(len(prompts))), [], 0, 0
        start = time.perf_counter()
        first = waiting if jitter is None else waiting[:args.batch_size]
        for index in list(first):
            engine.add_request(request(index))
        waiting = [] if jitter is None else waiting[args.batch_size:]
        while engine.pending() or due or waiting:
            for entry in [entry for entry in due if entry[0] <= tick]:
                due.remove(entry)
                engine.add_request(request(entry[1]))
            finished = engine.step() if engine.pending() else []
            for done in finished:
                tokens += len(done.tokens)
                if waiting:
                    due.append((tick + rng.randint(0, 2 * jitter), waiting.pop(0)))
            tick += 1
        wall = time.perf_counter() - start
        events.clear()
        spent = engine.stats.ticks - ticks
        return tokens / wall, (engine.stats.occupied - occupied) / (spent * args.batch_size), spent

    settings = {"all": (None, False), "all + listener": (None, True)}
    for jitter in args.jitters:
        settings[f"closed loop {jitter}"] = (jitter, False)
        settings[f"closed loop {jitter} + listener"] = (jitter, True)
    measure(None, False)  # warm-up: the compiled tick's graphs
    rows = {label: [] for label in settings}
    for round_ in range(args.rounds):
        for label in (list(settings) if round_ % 2 == 0 else list(settings)[::-1]):
            rows[label].append(measure(*settings[label]))
    base = statistics.median(r[0] for r in rows["all"])
    print(f"engine_arrivals: {_cpu_name()}, one thread; {len(prompts)} requests, {args.batch_size} slots, fixed "
          f"{args.loops} loops, compiled tick {args.ahead} ahead; median of {args.rounds} rounds")
    for label, measured in rows.items():
        rate = statistics.median(r[0] for r in measured)
        print(f"  {label:28s} {rate:8.0f} tokens/s ({rate / base:.3f}x all), occupancy "
              f"{statistics.median(r[1] for r in measured):.1%}, ticks {statistics.median(r[2] for r in measured):.0f}")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command

    raise SystemExit(run_command("scripts/engine_arrivals.py", main))
