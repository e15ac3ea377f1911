"""Self-speculative decoding of a reasoning task's answers, against plain greedy decoding, batch 1.

    python bench/speculative_task.py --checkpoint RUN --data TASK_DATA [--difficulty 4]
        [--loops 12] [--draft-loops 3] [--draft-tokens 4] [--problems 32] [--repeats 3]

Each held-out problem is a template: its statement and queries are given, its
answer tokens are free. Plain decoding (:func:`rdepth.model.speculative.greedy_fill`
at the verifying budget) decides each answer from the logits before it, feeding the
given tokens up to it in one chunk; speculative decoding
(:func:`~rdepth.model.speculative.speculative_fill`) drafts --draft-tokens answers at
--draft-loops and verifies them in one pass. The two must fill identical answers
(checked on every problem). Timing interleaves plain and speculative after a
warm-up; prints the median answers/s of each, their ratio with the interquartile
ranges, the acceptance rate and both answer accuracies (equal by construction), with
the device; --json writes them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from speculative import git_revision, iqr  # the sibling benchmark's helpers (bench/ is on the path)


def main(argv: list[str] | None = None) -> int:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/speculative_task.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True, help="the task data folder the run was trained on")
    parser.add_argument("--difficulty", type=int, default=None, help="held-out difficulty (default: the highest trained)")
    parser.add_argument("--loops", default=None, help="verifying budget N or N,N,... (default: eval loops)")
    parser.add_argument("--draft-loops", default="1")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from rdepth.config import parse_loop_counts
    from rdepth.model.noise import StateNoise
    from rdepth.model.speculative import greedy_fill, speculative_fill
    from rdepth.run.checkpoint import load_model
    from rdepth.run.device import device_name, resolve_device
    from rdepth.tasks.data import load_heldout, task_manifest

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, config = load_model(args.checkpoint, device)
    model.eval()
    difficulty = args.difficulty or max(task_manifest(args.data)["train_difficulties"])
    heldout = load_heldout(args.data, difficulty)
    verify = parse_loop_counts(args.loops, config.n_groups) if args.loops else config.default_eval_loops
    draft = parse_loop_counts(args.draft_loops, config.n_groups)

    templates = []
    for window in range(min(args.problems, heldout.tokens.shape[0])):
        ids = heldout.problem_ids[window]  # the problem of each answer token, -1 elsewhere
        if not (ids >= 0).any():
            continue
        first = ids == ids[ids >= 0].min()  # the window's first problem (windows start at a problem)
        length = int(np.nonzero(first)[0].max()) + 1  # up to its last answer
        tokens = torch.from_numpy(heldout.tokens[window, :length].astype(np.int64))[None].to(device)
        free = torch.from_numpy(first[:length]).to(device)
        templates.append((window, tokens, free))

    plain_rates, fast_rates, accepted, drafted, answers, right = [], [], 0, 0, 0, 0
    for window, tokens, free in templates:
        def plain(tokens=tokens, free=free, window=window):
            return greedy_fill(model, tokens, free, loop_counts=verify, noise=StateNoise(0, [window]))

        def fast(tokens=tokens, free=free, window=window):
            return speculative_fill(model, tokens, free, draft_loops=draft, loop_counts=verify,
                                    draft_tokens=args.draft_tokens, noise=StateNoise(0, [window]))

        reference, (candidate, stats) = plain(), fast()  # warm-up, and the exactness check
        if not torch.equal(reference, candidate):
            print(f"speculative answers differ from plain greedy decoding (problem {window})", file=sys.stderr)
            return 1
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        n_free = int(free.sum())
        answers += n_free
        right += int((reference[0, free] == tokens[0, free]).sum())
        for _ in range(args.repeats):
            for rates, call in ((plain_rates, plain), (fast_rates, fast)):
                start = time.perf_counter()
                call()
                rates.append(n_free / (time.perf_counter() - start))

    revision = git_revision()
    result = {
        "device": device_name(device), "torch": torch.__version__, "revision": revision,
        "checkpoint": str(args.checkpoint), "difficulty": difficulty, "verify_loops": list(verify),
        "draft_loops": list(draft), "draft_tokens": args.draft_tokens, "problems": len(templates),
        "answers": answers, "answer_token_accuracy": right / max(answers, 1),
        "plain_answers_per_s": statistics.median(plain_rates), "plain_iqr": iqr(plain_rates),
        "speculative_answers_per_s": statistics.median(fast_rates), "speculative_iqr": iqr(fast_rates),
        "acceptance": accepted / max(drafted, 1),
    }
    result["speedup"] = result["speculative_answers_per_s"] / result["plain_answers_per_s"]
    print(f"{result['device']}: difficulty {difficulty}, {len(templates)} problems, {answers} answers "
          f"({100 * result['answer_token_accuracy']:.1f}% right, both ways); plain "
          f"{result['plain_answers_per_s']:.1f} answers/s (IQR {result['plain_iqr'][0]:.1f}-{result['plain_iqr'][1]:.1f}), "
          f"speculative {result['speculative_answers_per_s']:.1f} (IQR {result['speculative_iqr'][0]:.1f}-"
          f"{result['speculative_iqr'][1]:.1f}): {result['speedup']:.2f}x; acceptance {result['acceptance']:.2f} "
          f"(drafts at {list(draft)}, verified at {list(verify)}, {args.draft_tokens} per round)")
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        Path(args.json).write_text(json_text(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/speculative_task.py", main))
