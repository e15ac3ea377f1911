"""Continuous depth batching against lock-step batches and fixed budgets, in wall time, on real text.

    python bench/depth_batching_text.py --run runs/text/train --data runs/text/data [--json out.json]

The text counterpart of ``bench/depth_batching.py`` (a task model, accuracy per difficulty): a trained text
model (the ``tiny`` preset: three looped groups) and ``--windows`` held-out windows of ``--window-tokens``
tokens spread over the prepared corpus's validation split (``rdepth.run.heldout``: the windows every
evaluation cuts). Every group runs the same budget: ``fixed k`` is k loop steps in each group; a rule
stops each group's loop per token, at most ``--full-loops`` steps.

1. **Quality**: per window, the teacher-forced mean next-token NLL (nats) under every fixed budget
   1..``--full-loops`` and every rule x threshold of the grid (the engine's prompt positions compute
   exactly this: tests/test_engine.py), each window's initial states keyed by its index, and the executed
   loop steps per position (summed over the groups).
2. **Selection on half A, judged on half B** (even / odd windows): F, the cheapest fixed budget whose mean
   NLL on A is within ``--tolerance`` (relative) of the full budget's; per rule the cheapest threshold whose
   paired NLL difference from F on A is at most ``--tolerance`` x F's mean NLL, pooled, and at most
   ``--per-bucket`` x F's in every bucket, ``plain``; ``safe`` / ``safer`` add one / two paired standard
   errors to the pooled difference, ``strict`` / ``strictest`` besides one / two of each bucket's own. (On text the budgets' NLLs lie close together: a 1% relative bar
   takes in every budget, so the default is 0.1%, about 0.5% perplexity.) The buckets stand in for the
   task's difficulties: the windows grouped by the full budget's NLL into ``--buckets`` quantile bins
   (quartiles by default; easy text to hard text). Each choice is judged on B (the same bar, no margin:
   paired difference, its standard error, per bucket), and over ``--splits`` random A/B splits: the share whose choice meets the bar on its B.
3. **Wall time** at each width B of ``--widths``: ``max(4B, --min-requests)`` windows of half B (order
   shuffled), each a request of its first ``--prompt-tokens`` tokens then ``--new-tokens`` greedy tokens,
   decoded by (a) the engine at F, (b) the engine with each rule's timed choice (``depth_batching``'s
   :func:`timed_choice`), (c) the lock-step decoder at F and (d) with each rule, B rows a batch, every
   position fed one at a time on both (``bench/depth_timing.py``). ``--rounds`` interleaved rounds after
   ``--warmup``: median and range of tokens/s (positions fed per second: prompt and generated), latency
   p50 / p99 (all requests arrive at once), executed and paid loop steps per position, the bound (F's steps
   over the paid ones) and the share of it reached; the engine's generated tokens against the lock-step
   decoder's at the same setting (agreement per token and per request).

Prints the device, torch version, thread count and git revision; writes everything to ``--json``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from depth_batching import MODES, _cpu_name, timed_choice  # noqa: E402
from depth_batching import split_shares as task_split_shares  # noqa: E402
from depth_timing import engine_call, lockstep_call, throughput_rows, tick_list, timed_rounds  # noqa: E402
from flags import positive_ints  # noqa: E402

# Thresholds per rule: text needs smaller ones than the task model (its states settle less)
GRID = {"step_norm_rel": (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5), "kl": (0.001, 0.003, 0.01, 0.03, 0.1, 0.3),
        "step_norm": (0.5, 1, 2, 4), "confidence": (0.01, 0.03, 0.1)}


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/depth_batching_text.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained text run (or one of its checkpoints)")
    parser.add_argument("--data", required=True, help="its prepared data folder (rdepth prepare), or a text file")
    parser.add_argument("--windows", type=int, default=256, help="held-out windows, spread over the split")
    parser.add_argument("--window-tokens", type=int, default=64, help="tokens a window scores (its context)")
    parser.add_argument("--policies", default="step_norm_rel,kl")
    parser.add_argument("--full-loops", type=int, default=8, help="the full budget: loop steps per group")
    parser.add_argument("--tolerance", type=float, default=0.001,
                        help="relative NLL above F's (and F's above the full budget's) allowed, pooled: 0.001 is "
                             "about 0.5%% perplexity at 5 nats, exit_wall.py's text bar")
    parser.add_argument("--per-bucket", type=float, default=0.002, help="relative NLL above F's allowed per bucket")
    parser.add_argument("--buckets", type=int, default=4, help="bins of the full budget's NLL (4: quartiles)")
    parser.add_argument("--splits", type=int, default=200)
    parser.add_argument("--widths", default="1,16,32")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens each request generates")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ticks", default="eager",
                        help="the engine's ticks to time (eager, token, static, compiled: docs/engine.md; with "
                             "several looped groups the static tick runs a step of every group a tick), each at F "
                             "and with each rule; rows 'engine TICK | setting'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in ("windows", "window_tokens", "full_loops", "buckets", "splits", "rounds", "threads", "min_requests",
                 "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.windows < 2 * args.buckets:
        parser.error(f"--windows must be at least 2 x --buckets ({2 * args.buckets}): each half needs every bucket")
    if args.prompt_tokens > args.window_tokens:
        parser.error(f"--prompt-tokens ({args.prompt_tokens}) must be at most --window-tokens ({args.window_tokens})")
    if not (0 <= args.tolerance < 1 and 0 <= args.per_bucket < 1):
        parser.error("--tolerance and --per-bucket are relative: in [0, 1)")
    unknown = [p for p in args.policies.split(",") if p and p not in GRID]
    if unknown:
        parser.error(f"--policies: no grid for {', '.join(unknown)} (choose from {', '.join(GRID)})")
    args.width_list = positive_ints("--widths", args.widths)
    args.tick_list = tick_list(args.ticks)
    return args


def policies(args) -> list[str]:
    return [p for p in args.policies.split(",") if p]


# ---------------------------------------------------------------------- quality
def settings_for(model, args) -> dict:
    """Every fixed budget 1..--full-loops (the same in each group) and every rule x threshold of the grid."""
    from rdepth.exits.controller import controller_factory

    groups = model.n_groups
    settings = {f"fixed {k}": {"loop_counts": (k,) * groups} for k in range(1, args.full_loops + 1)}
    for name in policies(args):
        for tau in GRID[name]:
            settings[f"{name} {tau:g}"] = {"factory": controller_factory(name, tau, args.full_loops,
                                                                          lambda: model.readout)}
    return settings


def window_quality(model, windows, setting: dict, seed: int, device) -> dict:
    """Teacher-forced: per window (``windows`` int64 ``[W, T + 1]``) the mean next-token NLL (nats) and the
    loop steps executed per position, summed over groups -> ``{"nll": [W], "steps": [W]}``. Window i's
    initial states are ``StateNoise`` row i of ``seed`` (:func:`rdepth.run.evaluate.eval_outputs`)."""
    import torch
    import torch.nn.functional as F

    from rdepth.model.generation import teacher_forced
    from rdepth.run.evaluate import eval_outputs

    def forward(x, y, noise):
        return teacher_forced(model, x, y, loop_counts=setting.get("loop_counts"),
                              controller_factory=setting.get("factory"), noise=noise)

    nll, steps, first = [], [], 0
    with torch.no_grad():
        for out, _ in eval_outputs(model, windows, forward, batch_size=32, device=device, seed=seed):
            batch = out.logits.shape[0]
            targets = windows[first:first + batch, 1:].to(out.logits.device)  # [b, T]
            first += batch
            per_token = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(), reduction="none")
            nll.append(per_token.view(batch, -1).mean(dim=1).double().cpu().numpy())
            if out.computed is None:
                steps.append(np.full(batch, float(sum(setting["loop_counts"]))))
            else:
                steps.append(sum(c.double().mean(dim=1) for c in out.computed).cpu().numpy())
    return {"nll": np.concatenate(nll), "steps": np.concatenate(steps)}


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of ``a - b`` (per window) and its standard error."""
    diff = a - b
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0


def buckets_of(full_nll: np.ndarray, count: int) -> np.ndarray:
    """Bucket 0..count-1 per window: the full budget's NLL cut at its quantiles (ties to the lower bucket)."""
    edges = np.quantile(full_nll, np.linspace(0, 1, count + 1)[1:-1])
    return np.searchsorted(edges, full_nll, side="left")


def meets(nll: dict, label: str, fixed: str, rows: np.ndarray, buckets: np.ndarray, args, margin: float = 0.0,
          bucket_margin: float = 0.0) -> bool:
    """Whether ``label``'s NLL on ``rows`` is close enough to ``fixed``'s: the pooled paired difference (plus
    ``margin`` standard errors) at most ``--tolerance`` x F's mean NLL, and in every bucket the mean
    difference (plus ``bucket_margin`` of that bucket's paired standard errors) at most ``--per-bucket`` x F's
    mean NLL there."""
    diff, error = paired(nll[label][rows], nll[fixed][rows])
    if diff + margin * error > args.tolerance * nll[fixed][rows].mean() + 1e-12:
        return False
    for bucket in np.unique(buckets[rows]):
        part = rows[buckets[rows] == bucket]
        part_diff, part_error = paired(nll[label][part], nll[fixed][part])
        if part_diff + bucket_margin * part_error > args.per_bucket * nll[fixed][part].mean() + 1e-12:
            return False
    return True


def select(qualities: dict, buckets: np.ndarray, rows_a: np.ndarray, args) -> dict:
    """On ``rows_a``: F, the cheapest fixed budget whose mean NLL is within --tolerance (relative) of the full
    budget's; per rule and mode of :data:`MODES`, its cheapest threshold (steps on A) meeting the bar."""
    nll = {label: q["nll"] for label, q in qualities.items()}
    full = nll[f"fixed {args.full_loops}"][rows_a].mean()
    fixed = min((label for label in nll if label.startswith("fixed")
                 and nll[label][rows_a].mean() <= full * (1 + args.tolerance) + 1e-12),
                key=lambda label: int(label.split()[1]))
    chosen = {}
    for name in policies(args):
        ordered = sorted((label for label in nll if label.split()[0] == name),
                         key=lambda label: qualities[label]["steps"][rows_a].mean())
        for mode, margin, bucket_margin in MODES:  # (the task's modes: a bucket stands for a difficulty)
            ok = [label for label in ordered if meets(nll, label, fixed, rows_a, buckets, args, margin, bucket_margin)]
            chosen[f"{name} {mode}"] = ok[0] if ok else None
    return {"fixed": fixed, "chosen": chosen}


def judge(qualities: dict, buckets: np.ndarray, rows_b: np.ndarray, choice: dict, args) -> dict:
    """Each choice on ``rows_b``: the bar (no margin), the paired NLL difference from F and its standard error
    (nats), that difference relative to F's mean NLL, steps per position, and per bucket F's mean NLL and
    the relative difference."""
    nll = {label: q["nll"] for label, q in qualities.items()}
    fixed = choice["fixed"]
    out = {}
    for key, label in choice["chosen"].items():
        if label is None:
            out[key] = None
            continue
        diff, error = paired(nll[label][rows_b], nll[fixed][rows_b])
        by_bucket = {}
        for bucket in np.unique(buckets[rows_b]):
            part = rows_b[buckets[rows_b] == bucket]
            base = float(nll[fixed][part].mean())
            by_bucket[int(bucket)] = {"fixed_nll": base, "relative_diff": float(nll[label][part].mean() / base - 1)}
        out[key] = {"setting": label, "meets": meets(nll, label, fixed, rows_b, buckets, args),
                    "paired_diff": diff, "paired_se": error,
                    "relative_diff": diff / float(nll[fixed][rows_b].mean()),
                    "steps": float(qualities[label]["steps"][rows_b].mean()),
                    "fixed_steps": float(qualities[fixed]["steps"][rows_b].mean()), "by_bucket": by_bucket}
    return out


def split_shares(qualities: dict, buckets: np.ndarray, args) -> dict:
    """Over --splits random halves: how often each choice on A meets the bar on B; and, as the judge's own
    noise, how often the full budget meets it against that split's F (the task benchmark's splits)."""
    return task_split_shares(qualities, buckets, args, "nll", select, judge, meets)


# ---------------------------------------------------------------------- wall time
def timing(model, windows: np.ndarray, rows_b: np.ndarray, choice: dict, settings: dict, args) -> dict:
    """Per width: the engine and the lock-step decoder at F and at each timed rule, on prompts of half B."""
    order = list(rows_b)
    random.Random(args.seed).shuffle(order)
    timed = [choice["fixed"], *sorted({label for label in choice["timed"].values() if label})]
    out = {}
    for width in args.width_list:
        count = min(max(4 * width, args.min_requests), len(order))
        ids = np.array(order[:count])
        prompts = windows[ids, : args.prompt_tokens]
        calls, records = {}, {}
        for label in timed:
            budget = ({"loop_counts": settings[label]["loop_counts"]} if "loop_counts" in settings[label]
                      else {"controller_factory": settings[label]["factory"]})
            for path, make in (("engine", engine_call), ("lockstep", lockstep_call)):
                calls[f"{path} | {label}"], records[f"{path} | {label}"] = make(
                    model, prompts, ids, width, budget, args.seed, new_tokens=args.new_tokens)
            for tick in args.tick_list[1:]:  # the static and compiled ticks besides the eager one above
                name = f"engine {tick} | {label}"
                calls[name], records[name] = engine_call(model, prompts, ids, width, budget, args.seed,
                                                         new_tokens=args.new_tokens, tick=tick)
        samples = timed_rounds(calls, args, width)
        positions = count * (args.prompt_tokens + args.new_tokens - 1)
        rows = throughput_rows(samples, records, positions, settings, choice["fixed"])
        agreement = {label: agreement_of(records[f"engine | {label}"]["tokens"], records[f"lockstep | {label}"]["tokens"])
                     for label in timed}
        engine_positions = {name: record["positions"] for name, record in records.items() if name.startswith("engine")}
        out[f"B={width}"] = {"requests": count, "positions": positions, "engine_positions": engine_positions,
                             "rows": rows, "engine_vs_lockstep_tokens": agreement}
        print(f"B = {width}: {count} requests, {positions} positions; tokens/s median [range], vs engine at "
              f"{choice['fixed']}, latency p50/p99 s, paid steps/position, share of bound", flush=True)
        for name, row in rows.items():
            low, high = row["range_tokens_per_s"]
            print(f"  {name:<28}{row['tokens_per_s']:9.0f} [{low:.0f}-{high:.0f}]  x{row['vs_engine_fixed']:.3f}  "
                  f"{row['latency_p50_s']:.3f}/{row['latency_p99_s']:.3f}  {row['paid_steps_per_position']:5.2f}  "
                  f"{100 * row['share_of_bound']:5.1f}%", flush=True)
        print("  engine vs lock-step generated tokens: " + "; ".join(
            f"{label}: {100 * a['tokens']:.1f}% tokens, {100 * a['requests']:.1f}% requests"
            for label, a in agreement.items()), flush=True)
    return out


def agreement_of(engine: dict, lockstep: dict) -> dict:
    """Generated tokens equal at the same place (share of tokens), and requests equal throughout."""
    same = [np.asarray(engine[k]) == np.asarray(lockstep[k]) for k in sorted(lockstep)]
    return {"tokens": float(np.mean(np.concatenate(same))), "requests": float(np.mean([s.all() for s in same]))}


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from exit_wall import revision

    from rdepth.errors import RdepthError
    from rdepth.run.heldout import held_out_windows
    from rdepth.run.opened import open_run

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    code = revision()  # once, at the start: the code that runs
    run = open_run(args.run, args.data, device)
    model = run.model.eval()
    if model.n_groups < 1:
        raise RdepthError("depth_batching_text: the model has no looped group (exits need a loop)")
    if args.window_tokens > model.config.block_size or args.prompt_tokens + args.new_tokens > model.config.block_size:
        raise RdepthError(f"depth_batching_text: --window-tokens and --prompt-tokens + --new-tokens must fit the "
                          f"model's context ({model.config.block_size})")
    windows = held_out_windows(run.tokens, args.window_tokens, args.windows)
    if windows.shape[0] < 2 * args.buckets:
        raise RdepthError(f"depth_batching_text: {args.data} holds only {windows.shape[0]} windows of "
                          f"{args.window_tokens + 1} tokens")
    settings = settings_for(model, args)
    cpu = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    print(f"depth_batching_text: {cpu}, torch {torch.__version__}, {args.threads} thread(s), revision {code}; "
          f"{windows.shape[0]} windows of {args.window_tokens} tokens, {model.n_groups} looped groups", flush=True)
    qualities = {}
    for label, setting in settings.items():
        qualities[label] = window_quality(model, windows, setting, args.seed, device)
        print(f"  {label:<22} NLL {qualities[label]['nll'].mean():.4f}  steps/position "
              f"{qualities[label]['steps'].mean():5.2f}", flush=True)
    count = windows.shape[0]
    buckets = buckets_of(qualities[f"fixed {args.full_loops}"]["nll"], args.buckets)
    rows_a, rows_b = np.arange(0, count, 2), np.arange(1, count, 2)
    choice = select(qualities, buckets, rows_a, args)
    judged = judge(qualities, buckets, rows_b, choice, args)
    shares = split_shares(qualities, buckets, args)
    choice["timed"] = timed_choice(choice, shares, args)
    print(f"F (cheapest fixed budget on A): {choice['fixed']}; chosen on A: {choice['chosen']}", flush=True)
    for key, value in judged.items():
        if value is not None:
            print(f"  judged on B: {key:<20} {value['setting']:<20} meets {value['meets']}  paired diff "
                  f"{value['paired_diff']:+.4f} +- {value['paired_se']:.4f} nats ({100 * value['relative_diff']:+.2f}%)"
                  f"  steps {value['steps']:.2f} vs F {value['fixed_steps']:.2f}  per bucket "
                  + " ".join(f"{b}:{100 * v['relative_diff']:+.2f}%" for b, v in value["by_bucket"].items()),
                  flush=True)
    print(f"share of {args.splits} splits meeting the bar on B: {shares}; timed: {choice['timed']}", flush=True)
    report = {"device": cpu, "torch": torch.__version__, "threads": args.threads, "revision": code,
              "args": {k: v for k, v in vars(args).items() if k != "width_list"},
              "windows": int(count), "groups": model.n_groups,
              "quality": {label: {"nll": float(q["nll"].mean()), "nll_a": float(q["nll"][rows_a].mean()),
                                  "nll_b": float(q["nll"][rows_b].mean()), "steps": float(q["steps"].mean())}
                          for label, q in qualities.items()},
              "bucket_sizes": {int(b): int((buckets == b).sum()) for b in np.unique(buckets)},
              "choice": choice, "judged_b": judged, "split_shares": shares}
    report["timing"] = timing(model, windows[:, :-1].numpy(), rows_b, choice, settings, args)
    if args.json:
        import json

        from rdepth.io import write_json

        write_json(args.json, json.loads(json.dumps(report, default=float)))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/depth_batching_text.py", main))
