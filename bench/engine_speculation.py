"""Loop speculation through the engine: an ``Engine`` of each ``--widths`` W slots, plain against ``speculate=K`` at each
``--draft-loops`` D, the same greedy requests, tokens/s (median of ``--rounds`` after a warm-up) and the rounds'
acceptance.

    python bench/engine_speculation.py --run RUN [--speculate 4] [--draft-loops 1,2] [--new-tokens 48] [--rounds 3]
        [--widths 1,8,32] [--speculate-at-most 1]

The prompts: four fixed English openings encoded by the run's tokenizer (a text model); at width 1 the four requests
one after another, at width W > 1 2W requests (the openings in turn) queued at once, so the engine's slots stay full
until the tail, where at most ``--speculate-at-most`` requests remain and speculation turns on. One torch thread.
Prints the CPU and revision, and whether each setting's tokens equal the plain engine's (they must: speculation is
exact).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flags import positive_ints  # noqa: E402

PROMPTS = ["The history of the city", "In 1900 the river", "A new school was", "The album was released"]


def main(argv=None) -> int:
    from rdepth.cli.main import OneLineParser, run_command

    parser = OneLineParser(prog="bench/engine_speculation.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True)
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--draft-loops", default="1,2")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", default="1", help="engine slots W (comma list); W > 1 queues 2W requests")
    parser.add_argument("--speculate-at-most", type=int, default=1,
                        help="the engine speculates while at most M requests are in flight")
    args = parser.parse_args(argv)

    def body() -> int:
        import torch
        from depth_batching import _cpu_name
        from exit_wall import revision

        from rdepth.engine import Engine, Request
        from rdepth.run.checkpoint import load_model
        from rdepth.run.heldout import run_tokenizer

        drafts = positive_ints("--draft-loops", args.draft_loops)
        widths = positive_ints("--widths", args.widths)
        torch.set_num_threads(1)
        model = load_model(args.run, torch.device("cpu"))[0].eval()
        tokenizer = run_tokenizer(args.run)
        openings = [tokenizer.encode(p) for p in PROMPTS]
        print(f"engine_speculation: {_cpu_name()}, revision {revision()}; requests of {args.new_tokens} tokens, "
              f"widths {widths}, speculation while at most {args.speculate_at_most} in flight", flush=True)

        def once(engine, prompts):
            start = time.perf_counter()
            for k, prompt in enumerate(prompts):
                engine.add_request(Request(prompt, max_tokens=args.new_tokens, sequence_id=k, tag=k))
            done = {finished.request.tag: list(finished.tokens) for finished in engine.run()}
            return time.perf_counter() - start, [done[k] for k in range(len(prompts))]

        for width in widths:
            prompts = openings if width == 1 else [openings[k % len(openings)] for k in range(2 * width)]
            print(f"width {width}: {len(prompts)} requests", flush=True)
            plain_tokens, plain_rate = None, None
            for label, extra in [("plain", {}), *((f"speculate {args.speculate}, draft {d}",
                                                  {"speculate": args.speculate, "draft_loops": d,
                                                   "speculate_at_most": args.speculate_at_most}) for d in drafts)]:
                engine = Engine(model, width, **extra)
                once(engine, prompts)
                walls, tokens = zip(*(once(engine, prompts) for _ in range(args.rounds)), strict=True)
                wall = sorted(walls)[len(walls) // 2]
                rate = len(prompts) * args.new_tokens / wall
                plain_tokens = tokens[0] if plain_tokens is None else plain_tokens
                plain_rate = rate if plain_rate is None else plain_rate
                spec = engine.stats.as_dict(1)["speculation"]
                print(f"  {label:24s} {rate:8.0f} tokens/s (x{rate / plain_rate:.2f} plain); acceptance "
                      f"{spec['acceptance']:.2f} over {spec['drafted']} drafts; tokens equal plain: "
                      f"{tokens[0] == plain_tokens}", flush=True)
        return 0

    return run_command("bench/engine_speculation.py", body)


if __name__ == "__main__":
    sys.exit(main())
