"""Loop speculation through the engine, one request at a time: an ``Engine`` of one slot, plain against
``speculate=K`` at each ``--draft-loops`` D, the same greedy requests, tokens/s (median of ``--rounds`` after a
warm-up) and the rounds' acceptance.

    python bench/engine_speculation.py --run RUN [--speculate 4] [--draft-loops 1,2] [--new-tokens 48] [--rounds 3]

The prompts: four fixed English openings encoded by the run's tokenizer (a text model). One torch thread. Prints the
CPU and revision, and whether each setting's tokens equal the plain engine's (they must: speculation is exact).
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
    args = parser.parse_args(argv)

    def body() -> int:
        import torch
        from depth_batching import _cpu_name
        from exit_wall import revision

        from rdepth.engine import Engine, Request
        from rdepth.run.checkpoint import load_model
        from rdepth.run.heldout import run_tokenizer

        drafts = positive_ints("--draft-loops", args.draft_loops)
        torch.set_num_threads(1)
        model = load_model(args.run, torch.device("cpu"))[0].eval()
        tokenizer = run_tokenizer(args.run)
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        print(f"engine_speculation: {_cpu_name()}, revision {revision()}; {len(prompts)} requests of "
              f"{args.new_tokens} tokens, one at a time", flush=True)

        def once(engine):
            start, tokens = time.perf_counter(), []
            for k, prompt in enumerate(prompts):
                engine.add_request(Request(prompt, max_tokens=args.new_tokens, sequence_id=k))
                tokens += [list(done.tokens) for done in engine.run()]
            return time.perf_counter() - start, tokens

        plain_tokens = None
        for label, extra in [("plain", {}), *((f"speculate {args.speculate}, draft {d}",
                                              {"speculate": args.speculate, "draft_loops": d}) for d in drafts)]:
            engine = Engine(model, 1, **extra)
            once(engine)
            walls, tokens = zip(*(once(engine) for _ in range(args.rounds)), strict=True)
            wall = sorted(walls)[len(walls) // 2]
            plain_tokens = tokens[0] if plain_tokens is None else plain_tokens
            spec = engine.stats.as_dict(1)["speculation"]
            print(f"  {label:24s} {len(prompts) * args.new_tokens / wall:8.0f} tokens/s; acceptance "
                  f"{spec['acceptance']:.2f} over {spec['drafted']} drafts; tokens equal plain: "
                  f"{tokens[0] == plain_tokens}", flush=True)
        return 0

    return run_command("bench/engine_speculation.py", body)


if __name__ == "__main__":
    sys.exit(main())
