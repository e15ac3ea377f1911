"""rdepth's engine on a looped transformers model (HRM-Text) against decoding its requests one at a time.

    python bench/looped_engine.py [--requests 24] [--widths 1,8] [--new 32] [--repeats 3] [--json out.json]

A random HRM-Text (speed does not depend on training: 256 wide, 2 layers per stack, H 2 / L 3, 256 byte ids)
decodes the same requests (prompts of 8-32 tokens, ``--new`` greedy tokens each) four ways, each timed
``--repeats`` times after a warm-up, interleaved, median reported:

* ``alone``: each request by the adapter's cached greedy decode (:func:`rdepth.looped.protocol.greedy`), one
  after another (the prompt in one call, then a token a call);
* ``generate``: each request by the class's own ``generate`` (greedy, its own cache), one after another;
* ``engine B``: :class:`rdepth.looped.engine.LoopedEngine` with B slots (every request queued at once; a prompt
  enters a token a tick).

Each way's tokens are compared with ``alone``'s (the share of tokens before a request's first difference: a
random model's near-ties can flip under another call shape's rounding). Prints tokens/s (new tokens over wall time) and each
way's ratio to ``alone``; names the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from depth_batching import _cpu_name as cpu_name  # noqa: E402
from flags import at_least, positive_ints  # noqa: E402


def build_model(seed: int = 0):
    import transformers

    config = transformers.HrmTextConfig(vocab_size=256, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                                        head_dim=64, num_hidden_layers=2, H_cycles=2, L_cycles=3,
                                        max_position_embeddings=256, prefix_lm=False)
    torch.manual_seed(seed)
    return transformers.HrmTextForCausalLM(config).eval()


def main(argv=None) -> int:
    from rdepth.cli.main import OneLineParser
    from rdepth.engine.request import Request
    from rdepth.looped.engine import LoopedEngine
    from rdepth.looped.load import adapter_for
    from rdepth.looped.protocol import greedy

    parser = OneLineParser(prog="bench/looped_engine.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--widths", default="1,8")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    at_least(args, 1, "requests", "new", "repeats", "threads")
    widths = positive_ints("--widths", args.widths)
    torch.set_num_threads(args.threads)
    model = build_model()
    adapter = adapter_for(model)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(n),), generator=generator).tolist()
               for n in torch.randint(8, 33, (args.requests,), generator=generator)]
    new = args.new

    def alone():
        return [greedy(adapter, torch.tensor([p]), new)[0, len(p):].tolist() for p in prompts]

    def generate():
        return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]

    def engine(width):
        def run():
            made = LoopedEngine(adapter, width)
            for p in prompts:
                made.add_request(Request(p, max_tokens=new))
            return [done.tokens for done in sorted(made.run(), key=lambda d: d.request_id)]
        return run

    ways = {"alone": alone, "generate": generate}
    ways.update({f"engine B={w}": engine(w) for w in widths})
    times = {name: [] for name in ways}
    with torch.no_grad():
        expected = alone()
        agreement = {}
        for name, way in ways.items():  # warm-up, and the tokens compared (the first token that differs ends a
            got = way()                 # request's comparison: a near-tie flipped by rounding changes what follows)
            same = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), new)
                    for a, b in zip(got, expected, strict=True)]
            agreement[name] = sum(same) / (len(prompts) * new)
        for _ in range(args.repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - start)
    tokens = len(prompts) * new
    base = statistics.median(times["alone"])
    print(f"CPU: {cpu_name()}, {args.threads} thread(s); torch {torch.__version__}; {len(prompts)} requests x {new} "
          f"new tokens; median of {args.repeats}")
    rows = {}
    for name, taken in times.items():
        median = statistics.median(taken)
        rows[name] = {"median_s": median, "min_s": min(taken), "max_s": max(taken), "tokens_per_s": tokens / median,
                      "vs_alone": base / median, "same_prefix": agreement[name]}
        print(f"  {name:12s} {tokens / median:9.1f} tokens/s  {base / median:5.2f}x alone  "
              f"(min {min(taken):.2f} s, max {max(taken):.2f} s; tokens before the first that differs from "
              f"alone's: {agreement[name]:.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "requests": len(prompts),
                                               "new": new, "ways": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/looped_engine.py", main))
