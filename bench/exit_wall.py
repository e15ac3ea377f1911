"""Exit policies against fixed budgets in wall time, on the one decoder (rdepth.model.decoder.Decoder).

    python bench/exit_wall.py task --run runs/demo/train --data runs/demo/data [--difficulty 4] [--json out.json]
    python bench/exit_wall.py text --run RUN --data DATA --problems 64 [--json out.json]

``task`` (a trained task model, decoding one problem at a time, and batches of problems):

1. Quality and steps of every fixed budget 1..K and every policy setting of the grid on ``--problems``
   held-out problems (``rdepth.tasks.evaluate.heldout_accuracy``: teacher-forced, which the decoder
   equals exactly). The quality bar is the full budget's accuracy less ``--tolerance`` (1 point).
2. For each policy, its cheapest setting that meets the bar; the cheapest fixed budget that meets it.
3. Wall time of decoding ``--timed-problems`` problems token by token (each position one decoder step,
   the problem's tokens fed in, the same path as ``rdepth generate``) for the full budget, the cheapest
   fixed budget, every chosen policy setting, and each policy setting nearest half the full budget's
   steps: ``--rounds`` interleaved rounds (order shuffled per round) after a warm-up, median and range
   per setting, the executed loop steps per token beside each row, and the ratio against the cheapest
   fixed budget and the full budget measured in the same run. Batch 1 and each ``--batch`` size.
4. Ops and host reads per token (aten ops and single-value reads under the profiler, one problem).

``task --difficulties 1,2,...`` is a mixed workload: ``--problems`` problems of each difficulty (equal
shares) for quality (settings chosen on half A of them, even windows, and judged on half B, odd: both
reported), the first ``--timed-problems`` of each decoded per timed round, and beside the rules
two batch-1 references decoded on the same decoder (``bench/exit_workload.py``): the per-problem oracle
(each problem at the smallest fixed budget that solves it) and the router (each problem at its
difficulty's cheapest fixed budget within the tolerance there). Every row also gives the answer tokens'
mean loop steps per difficulty.

``text`` (a trained text model): the same with perplexity on ``--problems`` held-out windows spread over
the split, the bar the full budget's perplexity plus ``--tolerance`` (0.5%), and the first ``--tokens``
positions of ``--timed-problems`` windows decoded per timed round.

(The ``generate`` mode, the earlier packed cached path against the decoder, went with that path: the
model has one cache and one token-at-a-time path, the decoder.)

Prints the device, torch version and git revision, and writes everything to ``--json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flags import positive_ints  # noqa: E402

TAUS = {"step_norm": (0.5, 1, 2, 4, 8), "step_norm_rel": (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8),
        "acceleration": (0.5, 1, 2, 4, 8), "acceleration_rel": (0.1, 0.2, 0.4, 0.6, 0.8),
        "cosine": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1), "kl": (1e-3, 1e-2, 0.03, 0.05, 0.1, 0.3),
        "confidence": (1e-3, 1e-2, 0.03, 0.1), "learned": (1e-3, 1e-2, 0.03, 0.1)}


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/exit_wall.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["task", "text"])
    parser.add_argument("--run", default=None, help="a trained run (task mode: a task model)")
    parser.add_argument("--data", default=None, help="its prepared data (task mode)")
    parser.add_argument("--difficulty", type=int, default=4)
    parser.add_argument("--difficulties", default="",
                        help="task mode: a mixed workload, --problems (and --timed-problems) of each of these "
                             "difficulties (comma list), with the per-problem oracle and the difficulty router")
    parser.add_argument("--problems", type=int, default=256, help="problems for accuracy and steps")
    parser.add_argument("--timed-problems", type=int, default=16, help="problems decoded per timed round")
    parser.add_argument("--batch", default="16", help="batch sizes timed beside batch 1 (comma list; '' none)")
    parser.add_argument("--policies", default="step_norm,step_norm_rel,acceleration,acceleration_rel,cosine,kl")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="quality allowed below the full budget's: accuracy points (task, default 0.01) or "
                             "relative perplexity (text, default 0.005)")
    parser.add_argument("--full-loops", type=int, default=None,
                        help="the full budget: every fixed budget 1..N and every rule's cap (default: the model's "
                        "eval loops)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48,
                        help="text mode: positions decoded per window")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.tolerance is None:
        args.tolerance = 0.005 if args.mode == "text" else 0.01
    return args


def check_args(args) -> None:
    """One-line errors (RdepthError) before any work: an empty workload (no problems, no timed problems, no
    rounds, no positions), a policy this script has no grid for, a missing --run or --data."""
    import math

    from rdepth.errors import RdepthError

    if not (args.run and args.data):
        raise RdepthError(f"{args.mode} mode needs --run and --data")
    for name in ("problems", "timed_problems", "rounds", "tokens", "threads"):
        if getattr(args, name) < 1:
            raise RdepthError(f"--{name.replace('_', '-')} must be >= 1 (an empty workload measures nothing), "
                              f"got {getattr(args, name)}")
    if args.warmup < 0 or args.full_loops is not None and args.full_loops < 1:
        raise RdepthError(f"--warmup must be >= 0 and --full-loops >= 1, got {args.warmup} and {args.full_loops}")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise RdepthError(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    _check_policies(args.policies)
    positive_ints("--batch", args.batch, empty=True)  # '': batch 1 only
    positive_ints("--difficulties", args.difficulties, empty=True)  # '': the one --difficulty
    if args.difficulty < 1:
        raise RdepthError(f"--difficulty must be >= 1, got {args.difficulty}")


def _check_policies(policies: str) -> None:
    """Every name in ``policies`` a registered rule this script has a tau grid for (one line otherwise)."""
    from rdepth.errors import RdepthError
    from rdepth.exits.registry import get_policy_class

    for name in [p for p in policies.split(",") if p]:
        get_policy_class(name)  # an unknown name: one line naming the known ones
        if name not in TAUS:
            raise RdepthError(f"--policies: this script has no tau grid for {name}; choose from {', '.join(TAUS)}")


def revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def interleaved(calls: dict, rounds: int, warmup: int, seed: int) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``: warm-up, then ``rounds`` rounds in a shuffled order."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    order, samples = random.Random(seed), {label: [] for label in calls}
    for _ in range(rounds):
        labels = list(calls)
        order.shuffle(labels)
        for label in labels:
            start = time.perf_counter()
            calls[label]()
            samples[label].append(time.perf_counter() - start)
    return samples


def counts_per_token(run_tokens, tokens: int) -> dict:
    """Aten ops and host reads (single-value reads) per token of ``run_tokens()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_tokens()
    events = [event for event in prof.events() if event.name.startswith("aten::")]
    top = [event for event in events if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")]
    reads = sum(event.name == "aten::_local_scalar_dense" for event in events)
    return {"ops_per_token": len(top) / tokens, "host_reads_per_token": reads / tokens}


# ---------------------------------------------------------------------- task and text modes
def full_budget(model, args) -> tuple[int, ...]:
    """Per group, the full budget: ``--full-loops`` in every group, else the model's eval loops."""
    if args.full_loops is None:
        return tuple(model.config.default_eval_loops)
    return (args.full_loops,) * len(model.config.default_eval_loops)


def settings_for(model, args) -> dict:
    """Fixed budgets (k in every group, 1..the eval budget) and every policy x tau of the grid."""
    from rdepth.exits.controller import controller_factory

    full = full_budget(model, args)
    settings = {}
    for k in range(1, max(full) + 1):
        counts = tuple(min(k, cap) for cap in full)
        settings[f"fixed {','.join(map(str, counts))}"] = {"loop_counts": counts}
    for name in [p for p in args.policies.split(",") if p]:
        options = {"gate": args.run} if name == "learned" else {}  # the run's gate (rdepth gate)
        for tau in TAUS[name]:
            settings[f"{name} {tau:g}"] = {"policy": name, "tau": tau, "factory": controller_factory(
                name, tau, full, lambda: model.readout, options)}
    return settings


def task_quality(model, args, settings):
    """Accuracy (higher is better) and loop steps per token of every setting on the held-out problems; on a
    mixed workload also the oracle's and the router's (bench/exit_workload.py), added to ``settings``."""
    import numpy as np
    from exit_workload import mixed_heldout, oracle_budgets, router_budgets, steps_by_difficulty, window_solved

    from rdepth.tasks.data import load_heldout
    from rdepth.tasks.evaluate import heldout_accuracy

    difficulties = positive_ints("--difficulties", args.difficulties, empty=True)
    if difficulties:
        heldout, labels = mixed_heldout(args.data, difficulties, args.problems, args.timed_problems)
    else:
        heldout = load_heldout(args.data, args.difficulty).first_problems(args.problems)
        labels = np.full(heldout.tokens.shape[0], args.difficulty)
    quality, solved = {}, {}
    for label, setting in settings.items():
        result = heldout_accuracy(model, heldout, loop_counts=setting.get("loop_counts"),
                                  controller_factory=setting.get("factory"), batch_size=64, seed=args.seed,
                                  per_token=True)
        steps = float(sum(setting["loop_counts"])) if "loop_counts" in setting else _mean_steps(result, heldout)
        by_difficulty = steps_by_difficulty(heldout, labels, result["answer_steps"])
        right = window_solved(heldout, result["answer_right"])
        quality[label] = {"accuracy": result["accuracy"], "steps": steps, "answer_steps_by_difficulty": by_difficulty,
                          "accuracy_a": float(right[0::2].mean()), "accuracy_b": float(right[1::2].mean())}
        if "loop_counts" in setting and len(setting["loop_counts"]) == 1:
            solved[setting["loop_counts"][0]] = right
        print(f"  {label:<26} accuracy {100 * result['accuracy']:5.1f}%  steps/token {steps:5.2f}  answer steps by "
              f"difficulty {' '.join(f'{d}:{v:.2f}' for d, v in by_difficulty.items())}", flush=True)
    info = {"difficulties": difficulties or [args.difficulty], "problems": int(heldout.tokens.shape[0])}
    if difficulties and solved:  # one looped group: the per-window references
        full = max(solved)
        per_window = {"oracle": oracle_budgets(solved, full)}
        route = router_budgets({k: v[0::2] for k, v in solved.items()}, labels[0::2], full, args.tolerance)  # on A
        per_window["router"] = np.array([route[int(d)] for d in labels])
        info["router_budgets"] = route
        for label, budgets in per_window.items():
            settings[label] = {"per_window": budgets}
            right = np.array([solved[int(k)][w] for w, k in enumerate(budgets)])
            quality[label] = {"accuracy": float(right.mean()), "steps": float(budgets.mean()),
                              "accuracy_a": float(right[0::2].mean()), "accuracy_b": float(right[1::2].mean()),
                              "answer_steps_by_difficulty": {int(d): float(budgets[labels == d].mean())
                                                             for d in difficulties}}
            print(f"  {label:<26} accuracy {100 * right.mean():5.1f}%  steps/token {budgets.mean():5.2f}", flush=True)
    windows = heldout.tokens[:, :-1].astype("int64")
    return quality, windows, info, "accuracy"


def text_quality(model, args, settings, tokens):
    """Perplexity (lower is better) and loop steps per token of every setting on held-out windows of
    ``tokens`` (the data's held-out ids)."""
    from rdepth.exitrun.evaluate import evaluate_with_exits
    from rdepth.run.heldout import held_out_windows

    windows = held_out_windows(tokens, model.config.block_size, args.problems)
    quality = {}
    for label, setting in settings.items():
        result = evaluate_with_exits(model, windows, controller=setting.get("factory"),
                                     loop_counts=setting.get("loop_counts"), batch_size=16, seed=args.seed)
        quality[label] = {"ppl": result.ppl, "steps": float(sum(result.mean_steps))}
        print(f"  {label:<26} ppl {result.ppl:8.2f}  steps/token {quality[label]['steps']:5.2f}", flush=True)
    info = {"windows": int(windows.shape[0]), "window_tokens": int(windows.shape[1] - 1)}
    return quality, windows[:, :-1].numpy(), info, "ppl"


def compare_mode(args, text: bool) -> dict:
    import torch

    from rdepth.run.opened import open_run

    # the run with its data: the data's tokenizer checked against the run's (a text run on task data, or the
    # reverse, is one line in either mode, as in rdepth eval)
    run = open_run(args.run, args.data, "cpu")
    model = run.model.eval()
    settings = settings_for(model, args)
    if text:
        quality, windows, info, key = text_quality(model, args, settings, run.tokens)
    else:
        quality, windows, info, key = task_quality(model, args, settings)
    full_label = f"fixed {','.join(map(str, full_budget(model, args)))}"
    bar, meets = quality_bar(quality, info, key, full_label, args.tolerance)
    cheapest_fixed = min((label for label in meets if label.startswith("fixed")),
                         key=lambda label: quality[label]["steps"])
    chosen, half = choose_settings(args, quality, meets, quality[full_label]["steps"])
    references = [label for label in ("oracle", "router") if label in settings]
    timed = sorted({full_label, cheapest_fixed, *chosen.values(), *half.values(), *references},
                   key=lambda label: (not label.startswith("fixed"), label))
    mixed = len(info.get("difficulties", [])) > 1
    timed_windows = args.timed_problems * (len(info["difficulties"]) if mixed else 1)
    count = max(timed_windows, *_batches(args), 1)
    if windows.shape[0] < count:  # a batch or a timed round larger than the held-out windows there are
        from rdepth.errors import RdepthError

        raise RdepthError(f"{count} windows are timed (--timed-problems, --batch) but the held-out set gives "
                          f"{windows.shape[0]} (--problems, the split): ask for fewer or a larger set")
    windows = torch.from_numpy(windows[:count])
    if text:
        windows = windows[:, : args.tokens]  # decode the first --tokens positions of each window
    report = {**info, "metric": key, "timed_windows": timed_windows, "full_budget": full_label, "quality_bar": bar, "quality": quality,
              "cheapest_fixed": cheapest_fixed, "chosen": chosen, "half_steps": half, "timing": {}}
    timing = Timing(model, settings, windows, timed_windows, args)
    for batch in [1, *_batches(args)]:
        rows = timing.batch_rows(batch, timed, cheapest_fixed, full_label)
        report["timing"][f"batch {batch}"] = rows
        print(f"batch {batch}: ms/token (median, range), executed steps/token, vs {cheapest_fixed}, vs full",
              flush=True)
        share = loop_share(rows, quality, cheapest_fixed, full_label)
        if share is not None:
            report.setdefault("loop_share", {})[f"batch {batch}"] = share
        print_rows(rows, quality, info, key)
    report["counts"] = op_counts(model, settings, timed, windows[:1], args.seed)
    return report


def quality_bar(quality: dict, info: dict, key: str, full_label: str, tolerance: float) -> tuple[float, set[str]]:
    """The quality bar and the settings that meet it: accuracy at least the full budget's less the
    tolerance (a mixed workload: chosen on half A, the bar on half B recorded in ``info``), or perplexity at
    most the full budget's times 1 + tolerance."""
    full = quality[full_label][key]
    if key == "accuracy" and len(info.get("difficulties", [])) > 1:
        # honest selection: chosen on half A of the problems (even windows), judged on half B (odd)
        key_select = "accuracy_a"
        bar = quality[full_label][key_select] - tolerance
        meets = {label for label, q in quality.items() if q[key_select] >= bar - 1e-12 and label not in ("oracle", "router")}
        info["judged_bar_b"] = quality[full_label]["accuracy_b"] - tolerance
    elif key == "accuracy":
        bar = full - tolerance
        meets = {label for label, q in quality.items() if q[key] >= bar - 1e-12}
    else:
        bar = full * (1 + tolerance)
        meets = {label for label, q in quality.items() if q[key] <= bar}
    return bar, meets


def choose_settings(args, quality: dict, meets: set[str], full_steps: float) -> tuple[dict, dict]:
    """Per policy: its cheapest setting that meets the bar (if any), and its setting nearest half the full
    budget's steps."""
    chosen, half = {}, {}
    for name in [p for p in args.policies.split(",") if p]:
        labels = [label for label in quality if label.split()[0] == name]
        ok = [label for label in labels if label in meets]
        if ok:
            chosen[name] = min(ok, key=lambda label: quality[label]["steps"])
        half[name] = min(labels, key=lambda label: abs(quality[label]["steps"] - full_steps / 2))
    return chosen, half


class Timing:
    """The timed decoding of one run's settings: batch 1 over the timed windows, or one batch."""

    def __init__(self, model, settings: dict, windows, timed_windows: int, args):
        self.model, self.settings, self.windows = model, settings, windows
        self.timed_windows, self.args = timed_windows, args

    def decode_call(self, label: str, batch: int):
        """The call that decodes the rows of ``batch`` token by token, its step tally, and the tokens decoded."""
        from rdepth.model.decoder import Decoder
        from rdepth.model.noise import StateNoise

        setting, stats = self.settings[label], {"steps": 0, "tokens": 0}
        rows = self.windows[:self.timed_windows] if batch == 1 else self.windows[:batch]

        def budget(first):  # a per-window reference decodes each window at its own fixed budget
            if "per_window" in setting:
                return {"loop_counts": int(setting["per_window"][first])}
            return {"loop_counts": setting.get("loop_counts"), "controller_factory": setting.get("factory")}

        decoders = [Decoder(self.model, batch, noise=StateNoise(self.args.seed, range(first, first + batch)),
                            **budget(first))
                    for first in range(0, rows.shape[0], batch)]

        def call():
            for index, decoder in enumerate(decoders):
                part = rows[index * batch:(index + 1) * batch]
                decoder.reset()
                for t in range(part.shape[1]):
                    decoder.step(part[:, t:t + 1])
                    stats["steps"] += int(decoder.computed.sum())
                    stats["tokens"] += batch
        return call, stats, rows.numel()

    def batch_rows(self, batch: int, timed: list[str], cheapest_fixed: str, full_label: str) -> dict:
        """ms/token (median and range over interleaved rounds), executed steps per token and the ratios to the
        cheapest fixed budget and the full budget, per timed setting."""
        calls, stats, work = {}, {}, {}
        for label in timed:
            if batch > 1 and "per_window" in self.settings[label]:
                continue  # per-window budgets are batch-1 references (a lock-step batch runs one budget)
            calls[label], stats[label], work[label] = self.decode_call(label, batch)
        samples = interleaved(calls, self.args.rounds, self.args.warmup, self.args.seed)
        rows = {}
        for label in calls:
            median = statistics.median(samples[label])
            rows[label] = {"ms_per_token": 1e3 * median / work[label],
                           "range_ms_per_token": [1e3 * min(samples[label]) / work[label],
                                                  1e3 * max(samples[label]) / work[label]],
                           "executed_steps_per_token": stats[label]["steps"] / max(stats[label]["tokens"], 1)}
        base, top = rows[cheapest_fixed]["ms_per_token"], rows[full_label]["ms_per_token"]
        for row in rows.values():
            row["speedup_vs_cheapest_fixed"] = base / row["ms_per_token"]
            row["latency_vs_full"] = row["ms_per_token"] / top
        return rows


def loop_share(rows: dict, quality: dict, cheapest_fixed: str, full_label: str) -> dict | None:
    """A loop step's time and the rest's, from the two fixed budgets (None when they run the same steps);
    printed."""
    base, top = rows[cheapest_fixed]["ms_per_token"], rows[full_label]["ms_per_token"]
    steps_low, steps_full = quality[cheapest_fixed]["steps"], quality[full_label]["steps"]
    if steps_full <= steps_low:
        return None
    per_step = (top - base) / (steps_full - steps_low)
    outside = base - steps_low * per_step
    print(f"  a loop step {per_step:.3f} ms/token, the rest {outside:.3f}: the loop is "
          f"{100 * steps_full * per_step / top:.0f}% of a token at the full budget, "
          f"{100 * steps_low * per_step / base:.0f}% at {cheapest_fixed}", flush=True)
    return {"ms_per_loop_step": per_step, "ms_outside_loop": outside,
            "share_at_full": steps_full * per_step / top, "share_at_cheapest_fixed": steps_low * per_step / base}


def print_rows(rows: dict, quality: dict, info: dict, key: str) -> None:
    for label, row in rows.items():
        low, high = row["range_ms_per_token"]
        shown = (f"{100 * quality[label][key]:.1f}%" if key == "accuracy" else f"ppl {quality[label][key]:.2f}")
        if "accuracy_b" in quality[label] and "judged_bar_b" in info:
            shown += f"; A {100 * quality[label]['accuracy_a']:.1f}%, B {100 * quality[label]['accuracy_b']:.1f}%"
        print(f"  {label:<26}{row['ms_per_token']:8.3f} [{low:.3f}-{high:.3f}] "
              f"{row['executed_steps_per_token']:5.2f}  x{row['speedup_vs_cheapest_fixed']:.3f}  "
              f"{row['latency_vs_full']:.3f} of full ({shown})", flush=True)


def op_counts(model, settings: dict, timed: list[str], problem, seed: int) -> dict:
    """Ops and host reads per token of one problem, per timed setting (not the per-window references)."""
    from rdepth.model.decoder import Decoder
    from rdepth.model.noise import StateNoise

    counts = {}
    for label in [label for label in timed if "per_window" not in settings[label]]:
        decoder = Decoder(model, 1, loop_counts=settings[label].get("loop_counts"),
                          controller_factory=settings[label].get("factory"), noise=StateNoise(seed, [0]))

        def run_tokens(decoder=decoder):
            decoder.reset()
            for t in range(problem.shape[1]):
                decoder.step(problem[:, t:t + 1])

        run_tokens()
        counts[label] = counts_per_token(run_tokens, problem.shape[1])
        print(f"  {label:<26} ops/token {counts[label]['ops_per_token']:7.1f}  host reads/token "
              f"{counts[label]['host_reads_per_token']:5.2f}", flush=True)
    return counts


def _batches(args) -> list[int]:
    return positive_ints("--batch", args.batch, empty=True)


def _mean_steps(result: dict, heldout) -> float:
    answers = int(heldout.answer_mask[:, 1:].sum())
    others = int((~heldout.answer_mask[:, 1:]).sum())
    return (result["mean_steps_answer"] * answers + result["mean_steps_other"] * others) / max(answers + others, 1)


def main(argv=None) -> int:
    """``python bench/exit_wall.py ...``: bad input ends as the command line's does (one line, exit 2)."""
    from rdepth.cli.main import run_command

    return run_command("bench/exit_wall.py", lambda: _main(argv))


def _main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check_args(args)
    import torch

    torch.set_num_threads(args.threads)
    header = {"device": "cpu", "threads": args.threads, "torch": torch.__version__, "revision": revision(),
              "argv": sys.argv[1:] if argv is None else argv}
    print(f"device: cpu ({args.threads} threads)  torch {torch.__version__}  git {header['revision']}", flush=True)
    result = compare_mode(args, text=args.mode == "text")
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        with open(args.json, "w") as handle:
            handle.write(json_text({**header, args.mode: result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
