"""Loop-speculative decoding against plain decoding at the same budget, batch 1, the one decoder.

    python bench/loop_speculation.py --checkpoint RUN --data DATA [--draft-loops 1,2,3] [--tokens 2,3,4,5,6,8]
        [--loops N | --exit POLICY --tau X] [--temperature 0] [--prompts 4] [--rounds 3] [--threads 1] [--json F]
        [--plain-also 1,2,4 [--quality-windows 64] [--tolerance 0.01]]

Prompts are the first --prompt-tokens tokens of held-out windows. Each round times, for every prompt, plain
decoding (``rdepth.model.generation.generate``) and speculative decoding
(``rdepth.model.loop_speculation.speculative_decode``) at every draft budget D (--draft-loops) and draft
length K (--tokens), in an order shuffled per round (interleaved), each generating --new-tokens tokens at the
verifying budget (--loops, default the model's eval loops; or --exit's rule, the drafts its rule capped at D).
Before timing, each setting runs once per prompt: greedy outputs must equal plain decoding's (else exit 1).
Prints per setting the acceptance (drafts kept per draft), the mean accepted length (drafts kept per
verification pass), the median tokens/s over the timed calls with its interquartile range and the ratio of
the medians to plain decoding's, with the device and revision; --json writes them.

Speculation is lossless against its own budget, so it pays only if that budget buys quality a cheaper one does
not: --plain-also times plain decoding at other fixed budgets (N loop steps in every group) in the same shuffled
rounds, and scores every fixed budget by its held-out perplexity over --quality-windows windows (and how often
its teacher-forced argmax equals the verifying budget's: about how often a draft at that budget is kept). The verdict
line names the cheapest fixed budget whose perplexity is within --tolerance (relative) of the verifying budget's
and the fastest speculative setting's ratio to *it*: the speed-up a user sees against the cheapest plain decoding
of the same quality.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def iqr(values: list[float]) -> list[float]:
    """The interquartile range ``[q1, q3]`` of timed rates (the value twice for one)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def git_revision() -> str:
    """The short git revision of the checkout this script is in ('' without git)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def parse(argv: list[str] | None) -> argparse.Namespace:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/loop_speculation.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--loops", default=None, help="verifying budget N or N,N,... (default: eval loops)")
    parser.add_argument("--exit", default=None, help="verify under this exit rule instead of --loops")
    parser.add_argument("--tau", type=float, default=None)
    parser.add_argument("--k-max", type=int, default=None, help="with --exit: the rule's cap (default: 2x eval loops)")
    parser.add_argument("--draft-loops", type=int_list, default=[1, 2, 3], help="draft budgets D (steps per group)")
    parser.add_argument("--tokens", type=int_list, default=[2, 3, 4, 5, 6, 8], help="draft lengths K")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the order's shuffle and the sampling seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plain-also", type=int_list, default=[],
                        help="plain decoding at these fixed budgets too (N steps in every group), timed and scored")
    parser.add_argument("--quality-windows", type=int, default=64, help="with --plain-also: held-out windows scored")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="with --plain-also: relative perplexity a budget of the same quality may be above")
    args = parser.parse_args(argv)
    if args.exit is not None and args.loops is not None:
        parser.error("give --loops or --exit, not both")
    if args.plain_also and args.exit is not None:
        parser.error("--plain-also compares fixed budgets: give --loops, not --exit")
    if args.quality_windows < 1:
        parser.error(f"--quality-windows must be >= 1, got {args.quality_windows}")
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    return args


def same_quality_budget(perplexities: dict, verifying, tolerance: float):
    """The cheapest budget of ``perplexities`` (budget -> held-out perplexity; a budget is its per-group loop
    counts, compared by their sum) whose perplexity is at most the verifying budget's times ``1 + tolerance``;
    the verifying budget itself when no other is."""
    limit = perplexities[verifying] * (1 + tolerance)
    candidates = [budget for budget, ppl in perplexities.items() if ppl <= limit]
    return min(candidates, key=lambda budget: (sum(budget), budget != verifying))


def verifying_budget(args, run) -> tuple[dict, str]:
    """``generate``'s budget keywords for --loops or --exit, and how to show it."""
    from rdepth.config import parse_loop_counts

    model = run.model
    if args.exit is not None:
        from rdepth.exits.controller import controller_factory

        k_max = args.k_max or 2 * max(run.config.default_eval_loops)
        factory = controller_factory(args.exit, args.tau, k_max, lambda: model.readout)
        return {"controller_factory": factory}, f"{args.exit} tau={args.tau} k_max={k_max}"
    counts = parse_loop_counts(args.loops, run.config.n_groups) if args.loops else run.config.default_eval_loops
    return {"loop_counts": counts}, ",".join(map(str, counts))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from rdepth.errors import RdepthError
    from rdepth.model.generation import generate
    from rdepth.model.loop_speculation import SpeculativeStats, speculative_decode
    from rdepth.model.noise import StateNoise
    from rdepth.run.device import device_name
    from rdepth.run.opened import open_run

    if args.threads:
        torch.set_num_threads(args.threads)
    run = open_run(args.checkpoint, args.data, args.device)
    model = run.model
    verify, shown_budget = verifying_budget(args, run)
    windows = run.windows(args.prompts, seq_len=args.prompt_tokens)
    prompts = [windows[i : i + 1, : args.prompt_tokens].to(run.device) for i in range(windows.shape[0])]
    sampled = args.temperature > 0

    def rng(number):
        return torch.Generator(device=run.device).manual_seed(args.seed + number) if sampled else None

    def call(setting, number):
        """One generation of prompt ``number``: plain (at the verifying budget, or ``setting[1]`` steps in every
        group), or speculative at (D, K)."""
        if setting[0] == "plain":
            budget = verify if setting[1] is None else {"loop_counts": [setting[1]] * run.config.n_groups}
            return generate(model, prompts[number], args.new_tokens, temperature=args.temperature,
                            top_k=args.top_k, noise=StateNoise(0, [number]), rng=rng(number), **budget)
        return speculative_decode(model, prompts[number], args.new_tokens, tokens=setting[2],
                                  draft_loops=setting[1], temperature=args.temperature, top_k=args.top_k,
                                  noise=StateNoise(0, [number]), rng=rng(number), **verify)

    settings = [("plain", None, None)] + [("speculative", draft, tokens) for draft in args.draft_loops
                                          for tokens in args.tokens]
    others = [("plain", loops, None) for loops in args.plain_also]
    try:
        stats = checked(settings, len(prompts), call, sampled, SpeculativeStats)
    except RdepthError as error:
        print(error, file=sys.stderr)
        return 2
    if stats is None:
        return 1
    rates = timed(args, settings + others, len(prompts), call)
    result = {"device": device_name(run.device), "torch": torch.__version__, "revision": git_revision(),
              "threads": torch.get_num_threads(), "checkpoint": str(run.checkpoint), "verify": shown_budget,
              "temperature": args.temperature, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
              "prompts": len(prompts), "rounds": args.rounds, "rows": table_rows(settings, rates, stats)}
    if others:
        result["quality"] = quality(args, run, verify["loop_counts"], others, rates)
    report(result)
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null

        Path(args.json).write_text(json_text(result, indent=2) + "\n")
    return 0


def checked(settings, prompts: int, call, sampled: bool, stats_class):
    """Every setting once on every prompt: the warm-up, the exactness check (greedy: the plain tokens; None and a
    line on stderr where they differ) and the acceptance counts per speculative setting (deterministic)."""
    import torch

    from rdepth.errors import RdepthError

    stats = {setting: stats_class() for setting in settings[1:]}
    for number in range(prompts):
        reference = call(settings[0], number)
        for setting in settings[1:]:
            try:
                out, counted = call(setting, number)
            except RdepthError as error:
                raise RdepthError(f"D={setting[1]}: {error}") from error
            if not sampled and not torch.equal(out, reference):
                print(f"speculative output (D={setting[1]}, K={setting[2]}) differs from plain decoding",
                      file=sys.stderr)
                return None
            stats[setting].add(counted)
    return stats


def score_budget(model, windows, counts: list[int], device):
    """Held-out perplexity at the fixed budget ``counts`` and the argmax after every position (teacher-forced,
    the evaluation's noise)."""
    import torch

    from rdepth.model.generation import teacher_forced
    from rdepth.run.evaluate import eval_outputs, perplexity

    total, tokens, argmax = 0.0, 0, []
    with torch.no_grad():
        for output, count in eval_outputs(model, windows, lambda x, y, noise: teacher_forced(
                model, x, y, loop_counts=counts, noise=noise), batch_size=16, device=device):
            total += output.loss.item() * count
            tokens += count
            argmax.append(output.logits.argmax(dim=-1).flatten().cpu())
    return perplexity(total / max(tokens, 1)), torch.cat(argmax)


def quality(args, run, verifying: list[int], others, rates) -> dict:
    """Held-out perplexity of every fixed budget, its argmax's agreement with the verifying budget's after each
    held-out position (teacher-forced: what decides whether a draft at that budget is kept), each plain budget's
    speed, and the verdict: the cheapest budget of the verifying one's quality and the fastest speculation's
    ratio to it."""
    windows = run.windows(args.quality_windows)
    budgets = [tuple(verifying)] + [(loops,) * run.config.n_groups for _, loops, _ in others]
    perplexities, argmax = {}, {}
    for budget in dict.fromkeys(budgets):
        perplexities[budget], argmax[budget] = score_budget(run.model, windows, list(budget), run.device)
    reference = argmax[tuple(verifying)]
    base = statistics.median(rates[("plain", None, None)])
    plain = {tuple(verifying): base} | {budget: statistics.median(rates[setting])
                                        for budget, setting in zip(budgets[1:], others, strict=True)}
    cheapest = same_quality_budget(perplexities, tuple(verifying), args.tolerance)
    fastest = max((setting for setting in rates if setting[0] == "speculative"),
                  key=lambda setting: statistics.median(rates[setting]), default=None)
    verdict = {"budget": list(cheapest), "tokens_per_s": plain[cheapest]}
    if fastest is not None:
        verdict.update(draft_loops=fastest[1], tokens=fastest[2],
                       speedup=statistics.median(rates[fastest]) / plain[cheapest])
    return {"windows": int(windows.shape[0]), "tolerance": args.tolerance, "verdict": verdict,
            "budgets": [{"budget": list(budget), "ppl": perplexities[budget], "tokens_per_s": plain[budget],
                         "speedup": plain[budget] / base,
                         "argmax_equal": float((argmax[budget] == reference).double().mean())}
                        for budget in budgets]}


def timed(args, settings, prompts: int, call) -> dict:
    """Tokens/s of every call, per setting: each round every (setting, prompt) once, in a shuffled order."""
    rates: dict = {setting: [] for setting in settings}
    order = random.Random(args.seed)
    for _ in range(args.rounds):
        calls = [(setting, number) for setting in settings for number in range(prompts)]
        order.shuffle(calls)
        for setting, number in calls:
            start = time.perf_counter()
            call(setting, number)
            rates[setting].append(args.new_tokens / (time.perf_counter() - start))
    return rates


def table_rows(settings, rates, stats) -> list[dict]:
    base = statistics.median(rates[settings[0]])
    rows = []
    for setting in settings:
        median = statistics.median(rates[setting])
        row = {"draft_loops": setting[1], "tokens": setting[2], "tokens_per_s": median, "iqr": iqr(rates[setting]),
               "speedup": median / base}
        if setting in stats:
            row.update(acceptance=stats[setting].acceptance, mean_accepted=stats[setting].mean_accepted)
        rows.append(row)
    return rows


def report(result: dict) -> None:
    print(f"{result['device']}, torch {result['torch']}, {result['threads']} thread(s), revision {result['revision']}; "
          f"verifying at {result['verify']}, {result['new_tokens']} new tokens after {result['prompt_tokens']}-token "
          f"prompts, {result['prompts']} prompts x {result['rounds']} rounds, temperature {result['temperature']}")
    print("| D | K | acceptance | mean accepted | tokens/s [IQR] | vs plain |")
    print("|---|---|---|---|---|---|")
    for row in result["rows"]:
        label = ("plain", "") if row["draft_loops"] is None else (row["draft_loops"], row["tokens"])
        accepted = (f"{row['acceptance']:.2f} | {row['mean_accepted']:.2f}" if "acceptance" in row else "- | -")
        print(f"| {label[0]} | {label[1]} | {accepted} | {row['tokens_per_s']:.1f} [{row['iqr'][0]:.1f}-"
              f"{row['iqr'][1]:.1f}] | {row['speedup']:.2f}x |")
    if "quality" not in result:
        return
    scored = result["quality"]
    print(f"plain decoding at fixed budgets, perplexity over {scored['windows']} held-out windows:")
    print("| budget | perplexity | argmax equal to the verifying budget's | tokens/s | vs plain |")
    print("|---|---|---|---|---|")
    for row in scored["budgets"]:
        print(f"| {','.join(map(str, row['budget']))} | {row['ppl']:.2f} | {row['argmax_equal']:.3f} | "
              f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}x |")
    verdict = scored["verdict"]
    line = (f"cheapest fixed budget within {scored['tolerance']:.1%} of the verifying budget's perplexity: "
            f"{','.join(map(str, verdict['budget']))} ({verdict['tokens_per_s']:.1f} tokens/s)")
    if "speedup" in verdict:
        line += (f"; the fastest speculation (D={verdict['draft_loops']}, K={verdict['tokens']}) runs "
                 f"{verdict['speedup']:.2f}x it")
    print(line)


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/loop_speculation.py", main))
