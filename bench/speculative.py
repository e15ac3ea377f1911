"""Self-speculative greedy decoding against plain greedy decoding, batch 1, same code path.

    python bench/speculative.py --checkpoint RUN --data DATA [--draft-loops 1] [--draft-tokens 4]

Prompts are the first tokens of held-out windows. For each prompt, plain greedy
decoding at the verifying budget (the model's eval loops, or --loops) and
speculative decoding (drafts at --draft-loops) generate --new-tokens tokens,
interleaved (plain, speculative, plain, ...) after a warm-up; the outputs must be
identical. Prints the median tokens/s of each, their ratio, the interquartile
ranges and the acceptance rate, with the device; --json writes them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def iqr(values: list[float]) -> list[float]:
    """The interquartile range ``[q1, q3]`` of timed rates."""
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def git_revision() -> str:
    """The short git revision of the checkout this script is in ('' without git)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/speculative.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--loops", default=None, help="verifying budget N or N,N,... (default: eval loops)")
    parser.add_argument("--draft-loops", default="1")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from rdepth.config import parse_loop_counts
    from rdepth.model.generation import generate
    from rdepth.model.noise import StateNoise
    from rdepth.model.speculative import speculative_generate
    from rdepth.run.device import device_name
    from rdepth.run.opened import open_run

    if args.threads:
        torch.set_num_threads(args.threads)
    run = open_run(args.checkpoint, args.data, args.device)
    model, n_groups = run.model, run.config.n_groups
    verify = parse_loop_counts(args.loops, n_groups) if args.loops else run.config.default_eval_loops
    draft = parse_loop_counts(args.draft_loops, n_groups)
    windows = run.windows(args.prompts, seq_len=args.prompt_tokens)
    plain_rates, fast_rates, accepted, drafted = [], [], 0, 0
    for number in range(windows.shape[0]):
        prompt = windows[number : number + 1, : args.prompt_tokens].to(run.device)

        def plain(prompt=prompt, number=number):
            return generate(model, prompt, args.new_tokens, temperature=0.0, loop_counts=verify,
                            noise=StateNoise(0, [number]))

        def fast(prompt=prompt, number=number):
            return speculative_generate(model, prompt, args.new_tokens, draft_loops=draft, loop_counts=verify,
                                        draft_tokens=args.draft_tokens, noise=StateNoise(0, [number]))

        reference, (candidate, stats) = plain(), fast()  # warm-up, and the exactness check
        if not torch.equal(reference, candidate):
            print("speculative output differs from plain greedy decoding", file=sys.stderr)
            return 1
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        for _ in range(args.repeats):
            for rates, call in ((plain_rates, plain), (fast_rates, fast)):
                start = time.perf_counter()
                call()
                rates.append(args.new_tokens / (time.perf_counter() - start))

    revision = git_revision()
    result = {
        "device": device_name(run.device), "torch": torch.__version__, "revision": revision,
        "checkpoint": str(run.checkpoint), "verify_loops": list(verify), "draft_loops": list(draft),
        "draft_tokens": args.draft_tokens, "new_tokens": args.new_tokens, "prompts": int(windows.shape[0]),
        "plain_tokens_per_s": statistics.median(plain_rates), "plain_iqr": iqr(plain_rates),
        "speculative_tokens_per_s": statistics.median(fast_rates), "speculative_iqr": iqr(fast_rates),
        "acceptance": accepted / max(drafted, 1),
    }
    result["speedup"] = result["speculative_tokens_per_s"] / result["plain_tokens_per_s"]
    print(f"{result['device']}: plain {result['plain_tokens_per_s']:.1f} tok/s (IQR {result['plain_iqr'][0]:.1f}-"
          f"{result['plain_iqr'][1]:.1f}), speculative {result['speculative_tokens_per_s']:.1f} tok/s (IQR "
          f"{result['speculative_iqr'][0]:.1f}-{result['speculative_iqr'][1]:.1f}): {result['speedup']:.2f}x; "
          f"acceptance {result['acceptance']:.2f} (drafts at {list(draft)}, verified at {list(verify)})")
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        Path(args.json).write_text(json_text(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/speculative.py", main))
