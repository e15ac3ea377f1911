"""Continuous depth batching against lock-step batches and fixed budgets, in wall time, on a mixed workload.

    python bench/depth_batching.py --run runs/demo/train --data runs/demo/data [--json out.json]

On a trained task model (the main job's), a mixed workload of held-out problems (``--difficulties``, equal
shares, ``--problems`` of each):

1. **Quality** of every fixed budget 1..``--full-loops`` and every rule x threshold of the grid, per problem
   (solved: every answer right), teacher-forced (which the engine equals: tests/test_engine.py) with each
   problem's initial states keyed by its index.
2. **Selection on half A, judged on half B** (even / odd problems): the cheapest fixed budget F within
   ``--tolerance`` of the full budget on A; per rule the cheapest setting that meets the bar on A pooled
   (paired difference from F at least ``-tolerance``) and per difficulty (no difficulty more than
   ``--per-difficulty`` under F's), ``plain``; ``safe`` (``safer``) asks the pooled difference less one
   (two) paired standard errors to meet it, ``strict`` (``strictest``) besides each difficulty's difference
   less one (two) of its own. Each is judged on B (the same bars), and over ``--splits`` random A/B splits: the
   share of splits whose choice meets the bar on its B.
3. **Wall time** at each width B of ``--widths``: ``max(4B, --min-requests)`` problems of half B (mixed
   difficulties, arrival order shuffled), each a request of its whole window (the positions fed one at a
   time, as every row of the lock-step decoder is), decoded by (a) the engine at F, (b) the engine with
   each chosen rule, (c) the lock-step decoder at F and (d) with each rule, B rows a batch. ``--rounds``
   interleaved rounds after ``--warmup``, median and range of tokens/s (positions/s), per-request latency
   p50 / p99 (all requests arrive at once), executed loop steps per position (the lock-step decoder: the
   steps its batch pays, the slowest row's), the bound those steps imply (F's steps over the rule's) and the
   share of that bound the measured speed-up reaches; the engine's answers on the timed problems against
   the teacher-forced ones. The engine runs each of ``--ticks`` (eager; static and compiled: every slot
   through one device function a tick, ``rdepth/engine/static.py``); ``vs_fastest_fixed`` is each row's
   speed against the fastest fixed-budget path at that width: any engine tick at F or the lock-step decoder at F
   (the target's ratio).

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
from depth_timing import engine_call, lockstep_call, throughput_rows, tick_list, timed_rounds  # noqa: E402
from flags import positive_ints  # noqa: E402

from rdepth.errors import RdepthError  # noqa: E402

GRID = {"step_norm_rel": (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5), "kl": (0.005, 0.01, 0.02, 0.03, 0.05, 0.1),
        "step_norm": (0.5, 1, 2, 4), "confidence": (0.01, 0.03, 0.1), "learned": (0.01, 0.03, 0.1)}


def parse_args(argv):
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/depth_batching.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained task run (its train/ folder)")
    parser.add_argument("--data", required=True, help="its prepared task data")
    parser.add_argument("--difficulties", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--problems", type=int, default=256, help="held-out problems of each difficulty")
    parser.add_argument("--policies", default="step_norm_rel,kl")
    parser.add_argument("--full-loops", type=int, default=12)
    parser.add_argument("--caps", default=None,
                        help="the loop caps each rule's grid runs at (default: --full-loops alone); a cap below "
                             "--full-loops is its own setting, 'NAME TAU cap K', chosen on A like any other "
                             "(a rule capped at F never pays more steps than the fixed budget)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="pooled accuracy below F's allowed")
    parser.add_argument("--per-difficulty", type=float, default=0.02, help="accuracy below F's allowed per difficulty")
    parser.add_argument("--splits", type=int, default=200)
    parser.add_argument("--widths", default="1,8,16,32,64")
    parser.add_argument("--min-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--shared", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the engine with the shared key/value layout (its quality change on the "
                             "timed problems, paired against the exact layout)")
    parser.add_argument("--ticks", default="eager,compiled",
                        help="the engine's ticks to time (eager, token, static, compiled, graph, compiled-graph: "
                             "docs/engine.md); each at F and with each rule; ratios against the fastest path at F (any "
                             "tick, the lock-step decoder)")
    parser.add_argument("--ahead", default="1",
                        help="ticks one call of the static and compiled ticks runs before the host reads the device "
                             "(Engine(ahead=N)); a list times each (1,4: both), at F and with each rule")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reuse-quality", action="store_true",
                        help="read step 1's per-problem results from --json's .quality.npz (written by an earlier run "
                             "with the same --run, --data, --problems, --difficulties, grid and seed) instead of "
                             "computing them: a timing-only rerun")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the GPU issue's call: bench/gpu/device_call.sh "
                        "step depth_batching)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in ("problems", "full_loops", "splits", "rounds", "threads", "min_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    unknown = [p for p in args.policies.split(",") if p and p not in GRID]
    if unknown:
        parser.error(f"--policies: no grid for {', '.join(unknown)} (choose from {', '.join(GRID)})")
    positive_ints("--widths", args.widths)  # (kept as text: read where it is used)
    args.caps = positive_ints("--caps", args.caps) if args.caps else [args.full_loops]
    if max(args.caps) > args.full_loops:
        parser.error(f"--caps: a cap above --full-loops ({args.full_loops}) has no fixed budget to compare")
    positive_ints("--ahead", args.ahead)
    positive_ints("--difficulties", args.difficulties)
    tick_list(args.ticks)
    return args


# ---------------------------------------------------------------------- quality and selection
def quality(model, heldout, settings: dict, seed: int, device="cpu") -> dict:
    """Per setting: solved [W] bool and executed loop steps per position (over every position)."""
    from exit_workload import window_solved

    from rdepth.tasks.evaluate import heldout_accuracy

    out = {}
    answers, others = int(heldout.answer_mask[:, 1:].sum()), int((~heldout.answer_mask[:, 1:]).sum())
    for label, setting in settings.items():
        result = heldout_accuracy(model, heldout, loop_counts=setting.get("loop_counts"),
                                  controller_factory=setting.get("factory"), batch_size=64, seed=seed, per_token=True,
                                  device=device)
        if "loop_counts" in setting:
            steps = float(sum(setting["loop_counts"]))
        else:
            steps = (result["mean_steps_answer"] * answers + result["mean_steps_other"] * others) / (answers + others)
        out[label] = {"steps": steps, "solved": window_solved(heldout, result["answer_right"])}
        print(f"  {label:<22} solved {100 * out[label]['solved'].mean():5.1f}%  steps/position {steps:5.2f}",
              flush=True)
    return out


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of ``a - b`` (bool per problem) and its standard error."""
    diff = a.astype(float) - b.astype(float)
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0


def meets(solved: dict, label: str, fixed: str, rows: np.ndarray, labels: np.ndarray, args, margin: float = 0.0,
          difficulty_margin: float = 0.0):
    """Whether ``label`` meets the bar against ``fixed`` on ``rows``: the pooled paired difference, less ``margin``
    of its standard errors, >= -tolerance; and each difficulty's paired difference, less ``difficulty_margin``
    of its own standard errors, >= -``--per-difficulty``. (With 128 problems a difficulty in a half a
    difficulty's error is 1.5-2.5 points against the 2-point bar and its margin leaves nothing to choose;
    with 512 it is 0.5-1.5.)"""
    diff, error = paired(solved[label][rows], solved[fixed][rows])
    if diff - margin * error < -args.tolerance - 1e-12:
        return False
    for difficulty in np.unique(labels[rows]):
        part = rows[labels[rows] == difficulty]
        part_diff, part_error = paired(solved[label][part], solved[fixed][part]) if difficulty_margin else (
            solved[label][part].mean() - solved[fixed][part].mean(), 0.0)
        if part_diff - difficulty_margin * part_error < -args.per_difficulty - 1e-12:
            return False
    return True


# How strictly a rule's setting is chosen on half A, least strict first: (name, standard errors of margin on the
# pooled paired difference, and on each difficulty's)
MODES = (("plain", 0.0, 0.0), ("safe", 1.0, 0.0), ("safer", 2.0, 0.0), ("strict", 2.0, 1.0), ("strictest", 2.0, 2.0))


def select(qualities: dict, labels: np.ndarray, rows_a: np.ndarray, args) -> dict:
    """On ``rows_a``: the cheapest fixed budget F within tolerance of the full budget, and per rule its
    cheapest setting meeting the bar against F in each of :data:`MODES` (``plain``; ``safe`` and ``safer``
    with one and two standard errors of margin on the pooled difference; ``strict`` and ``strictest`` besides
    with one and two of each difficulty's own)."""
    solved = {label: q["solved"] for label, q in qualities.items()}
    full = f"fixed {args.full_loops}"
    bar = solved[full][rows_a].mean() - args.tolerance
    fixed = min((label for label in solved if label.startswith("fixed") and solved[label][rows_a].mean() >= bar - 1e-12),
                key=lambda label: qualities[label]["steps"])
    chosen = {}
    for name in [p for p in args.policies.split(",") if p]:
        labels_of = sorted((label for label in solved if label.split()[0] == name), key=lambda label: qualities[label]["steps"])
        for mode, margin, difficulty_margin in MODES:
            ok = [label for label in labels_of
                  if meets(solved, label, fixed, rows_a, labels, args, margin, difficulty_margin)]
            chosen[f"{name} {mode}"] = ok[0] if ok else None
    return {"fixed": fixed, "chosen": chosen}


def judge(qualities, labels, rows_b, choice, args) -> dict:
    solved = {label: q["solved"] for label, q in qualities.items()}
    out = {}
    for key, label in choice["chosen"].items():
        if label is None:
            out[key] = None
            continue
        diff, error = paired(solved[label][rows_b], solved[choice["fixed"]][rows_b])
        by_difficulty = {int(d): float(solved[label][rows_b[labels[rows_b] == d]].mean()
                                       - solved[choice["fixed"]][rows_b[labels[rows_b] == d]].mean())
                         for d in np.unique(labels[rows_b])}
        out[key] = {"setting": label, "meets": meets(solved, label, choice["fixed"], rows_b, labels, args),
                    "paired_diff": diff, "paired_se": error, "diff_by_difficulty": by_difficulty}
    return out


def split_shares(qualities, labels, args, measure: str = "solved", select=None, judge=None, meets=None) -> dict:
    """Over ``--splits`` random halves: how often each rule's choice on A meets the bar on B, and, as the judge's
    own noise, how often the full budget itself meets it against that split's F. ``measure`` names the per-problem
    quality the bar reads; ``select`` / ``judge`` / ``meets`` default to this module's (the text benchmark passes
    its own: NLL per window, buckets for difficulties)."""
    select, judge, meets = select or _select, judge or _judge, meets or _meets
    rng = np.random.default_rng(args.seed)
    count = len(labels)
    values = {label: q[measure] for label, q in qualities.items()}
    hits: dict[str, list[bool]] = {}
    for _ in range(args.splits):
        order = rng.permutation(count)
        rows_a, rows_b = np.sort(order[: count // 2]), np.sort(order[count // 2:])
        choice = select(qualities, labels, rows_a, args)
        for key, judged in judge(qualities, labels, rows_b, choice, args).items():
            hits.setdefault(key, []).append(bool(judged and judged["meets"]))
        hits.setdefault("full budget (reference)", []).append(
            meets(values, f"fixed {args.full_loops}", choice["fixed"], rows_b, labels, args))
    return {key: float(np.mean(shares)) for key, shares in hits.items()}


_select, _judge, _meets = select, judge, meets  # (split_shares' defaults)


# ---------------------------------------------------------------------- wall time
def timing(model, heldout, labels, rows_b, choice, settings, args) -> dict:
    order = list(rows_b)
    random.Random(args.seed).shuffle(order)
    windows_all = heldout.tokens[:, :-1].astype("int64")
    timed_labels = [choice["fixed"], *sorted({label for label in choice["timed"].values() if label})]
    out = {}
    for width in [int(w) for w in args.widths.split(",") if w.strip()]:
        count = min(max(4 * width, args.min_requests), len(order))
        ids = np.array(order[:count])
        windows = windows_all[ids]
        calls, records = width_calls(model, windows, ids, width, timed_labels, settings, args)
        samples = timed_rounds(calls, args, width)
        positions = windows.size
        rows = throughput_rows(samples, records, positions, settings, choice["fixed"])
        mismatches = engine_quality(rows, records, heldout, ids, settings, model, args.seed)
        out[f"B={width}"] = {"requests": count, "positions": int(positions), "rows": rows,
                             "engine_answers_vs_teacher_forced": mismatches}
        print(f"B = {width}: {count} requests, {positions} positions; tokens/s median [range], vs the eager engine "
              f"at {choice['fixed']}, vs the fastest path at it, latency p50/p99 s, paid steps/position, share of "
              "bound (against the fastest)", flush=True)
        print_rows(rows)
    return out


def width_calls(model, windows, ids, width: int, timed_labels: list[str], settings: dict, args) -> tuple[dict, dict]:
    """Per timed setting, the engine's and the lock-step batches' call at ``width`` slots (and the engine with
    the shared key/value layout for a rule, with --shared), and the record each call fills."""
    calls, records = {}, {}
    for label in timed_labels:
        budget = ({"loop_counts": settings[label]["loop_counts"]} if "loop_counts" in settings[label]
                  else {"controller_factory": settings[label]["factory"]})
        calls[f"engine | {label}"], records[f"engine | {label}"] = engine_call(model, windows, ids, width, budget,
                                                                              args.seed)
        for tick in ticks(args):  # the other ticks (the eager one above), where the model has them
            for ahead in aheads(args, tick):
                name = f"engine {tick}{f' ahead {ahead}' if ahead > 1 else ''} | {label}"
                try:
                    calls[name], records[name] = engine_call(model, windows, ids, width, budget, args.seed,
                                                             tick=tick, ahead=ahead)
                except RdepthError as error:
                    print(f"  ({name}: not timed: {error})", flush=True)
        calls[f"lockstep | {label}"], records[f"lockstep | {label}"] = lockstep_call(model, windows, ids, width,
                                                                                    budget, args.seed)
        if "factory" in settings[label] and args.shared:
            name = f"engine shared-KV | {label}"
            calls[name], records[name] = engine_call(model, windows, ids, width, budget, args.seed, "shared")
    return calls, records


def aheads(args, tick: str) -> list[int]:
    """The --ahead values a tick is timed at: each of them for a tick that runs ahead, else 1 alone."""
    from rdepth.engine.tick import runs_ahead

    if not runs_ahead(tick):
        return [1]
    return list(dict.fromkeys(int(n) for n in args.ahead.split(",")))


def ticks(args) -> list[str]:
    """The engine's ticks besides the eager one that --ticks asks for."""
    return tick_list(args.ticks)[1:]


def engine_quality(rows: dict, records: dict, heldout, ids, settings: dict, model, seed: int) -> dict:
    """Each engine row's answers against the teacher-forced ones (returned) and its solved share (into
    ``rows``); the shared layout's quality change, paired on the same problems."""
    mismatches, solved = {}, {}
    for name, record in records.items():
        if name.startswith("engine"):
            mismatches[name] = engine_vs_teacher_forced(heldout, ids, record["predicted"],
                                                        settings, name.split(" | ")[1], model, seed)
            solved[name] = engine_solved(heldout, ids, record["predicted"])
            rows[name]["solved"] = float(solved[name].mean())
    for name in solved:  # the shared layout's quality change, paired on the same problems
        if name.startswith("engine shared-KV"):
            exact = f"engine | {name.split(' | ')[1]}"
            diff, error = paired(solved[name], solved[exact])
            rows[name]["vs_exact_layout"] = {"paired_diff": diff, "paired_se": error}
    return mismatches


def print_rows(rows: dict) -> None:
    for name, row in rows.items():
        low, high = row["range_tokens_per_s"]
        print(f"  {name:<34}{row['tokens_per_s']:9.0f} [{low:.0f}-{high:.0f}]  x{row['vs_engine_fixed']:.3f}  "
              f"x{row['vs_fastest_fixed']:.3f}  "
              f"{row['latency_p50_s']:.3f}/{row['latency_p99_s']:.3f}  {row['paid_steps_per_position']:5.2f}  "
              f"{100 * row['share_of_bound']:5.1f}%"
              + (f"  solved {100 * row['solved']:.1f}%" if "solved" in row else ""), flush=True)


def engine_solved(heldout, ids, predicted) -> np.ndarray:
    """bool per timed problem: every answer the engine predicted (teacher-forced positions) right."""
    targets = heldout.tokens[ids, 1:]
    mask = heldout.answer_mask[ids, 1:].astype(bool)
    engine = np.array([predicted[k] for k in range(len(ids))])
    return np.array([bool((engine[k][mask[k]] == targets[k][mask[k]]).all()) for k in range(len(ids))])


def engine_vs_teacher_forced(heldout, ids, predicted, settings, label, model, seed) -> dict:
    """The engine's answers on the timed problems against the teacher-forced predictions: answer tokens
    that differ (float32: an exit decision at a threshold's edge can flip)."""
    import torch

    from rdepth.model.generation import teacher_forced
    from rdepth.model.noise import StateNoise

    setting = settings[label]
    x = torch.from_numpy(heldout.tokens[ids, :-1].astype("int64")).to(next(model.parameters()).device)
    with torch.no_grad():
        out = teacher_forced(model, x, loop_counts=setting.get("loop_counts"),
                             controller_factory=setting.get("factory"), noise=StateNoise(seed, [int(i) for i in ids]))
    forced = out.logits.argmax(dim=-1).cpu().numpy()
    mask = heldout.answer_mask[ids, 1:].astype(bool)
    engine = np.array([predicted[k] for k in range(len(ids))])
    return {"answers": int(mask.sum()), "differ": int((engine[mask] != forced[mask]).sum())}


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from exit_wall import revision
    from exit_workload import mixed_heldout

    from rdepth.run.checkpoint import load_model

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load_model(args.run, device)[0].eval()
    if model.n_groups != 1:
        raise RdepthError(f"{args.run}: depth_batching takes a model with one looped group (the task models), "
                          f"not {model.n_groups}")
    difficulties = [int(d) for d in args.difficulties.split(",") if d.strip()]
    heldout, labels = mixed_heldout(args.data, difficulties, args.problems, 0)
    settings = settings_for(model, args)
    cpu = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    code = revision()  # once, at the start: the code that runs (a commit made while it runs is not it)
    print(f"depth_batching: {cpu}, torch {torch.__version__}, {args.threads} thread(s), revision {code}; "
          f"{len(labels)} problems, difficulties {difficulties}", flush=True)
    qualities = measured_quality(model, heldout, settings, args, device)
    rows_a, rows_b = np.arange(0, len(labels), 2), np.arange(1, len(labels), 2)
    choice = select(qualities, labels, rows_a, args)
    judged = judge(qualities, labels, rows_b, choice, args)
    shares = split_shares(qualities, labels, args)
    choice["timed"] = timed_choice(choice, shares, args)
    print(f"cheapest fixed budget on A: {choice['fixed']}; chosen on A: {choice['chosen']}; judged on B: "
          f"{ {k: (v['setting'], v['meets'], round(100 * v['paired_diff'], 2), round(100 * v['paired_se'], 2)) if v else None for k, v in judged.items()} }; "
          f"share of {args.splits} splits meeting the bar on B: {shares}; timed: {choice['timed']}", flush=True)
    report = {"device": cpu, "torch": torch.__version__, "threads": args.threads, "revision": code,
              "args": vars(args), "problems": int(len(labels)),
              "quality": quality_rows(qualities, labels, rows_a, rows_b, difficulties),
              "choice": choice, "judged_b": judged, "split_shares": shares}
    report["timing"] = timing(model, heldout, labels, rows_b, choice, settings, args)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(report, indent=1, default=float))
        print(f"wrote {args.json}")
    return 0


def settings_for(model, args) -> dict:
    """Every fixed budget 1..--full-loops and every rule's grid (the learned rule reads the run's gate)."""
    from rdepth.exits.controller import controller_factory

    settings = {f"fixed {k}": {"loop_counts": (k,)} for k in range(1, args.full_loops + 1)}
    for name in [p for p in args.policies.split(",") if p]:
        options = {"gate": args.run} if name == "learned" else {}
        for cap in args.caps:
            for tau in GRID[name]:
                label = f"{name} {tau:g}" + ("" if cap == args.full_loops else f" cap {cap}")
                settings[label] = {"factory": controller_factory(name, tau, cap, lambda: model.readout, options)}
    return settings


def measured_quality(model, heldout, settings: dict, args, device) -> dict:
    """Each setting's steps and solved problems: measured (and saved beside --json), or with --reuse-quality
    read from an earlier run's file (the settings it lacks, such as a new cap's, measured and added to it)."""
    cache = Path(args.json).with_suffix(".quality.npz") if args.json else None
    saved = {}
    if args.reuse_quality:
        if cache is None or not cache.is_file():
            raise RdepthError(f"--reuse-quality needs {cache or '--json'} from an earlier run")
        with np.load(cache) as stored:
            saved = {name: stored[name] for name in stored.files}
    qualities = {label: {"steps": float(saved[f"steps|{label}"]), "solved": saved[f"solved|{label}"]}
                 for label in settings if f"steps|{label}" in saved}
    missing = {label: setting for label, setting in settings.items() if label not in qualities}
    if not missing:
        return qualities
    qualities.update(quality(model, heldout, missing, args.seed, device))
    if cache is not None:  # (the earlier file's other settings kept; written whole, then moved into place)
        saved.update({f"{key}|{label}": q[key] for label, q in qualities.items() for key in ("steps", "solved")})
        partial = cache.with_name(cache.name + ".partial.npz")
        np.savez(partial, **saved)
        partial.replace(cache)
    return {label: qualities[label] for label in settings}


def timed_choice(choice: dict, shares: dict, args) -> dict:
    """Timed per rule: the choice of the least strict of :data:`MODES` that meets the bar on B in >= 90% of
    the splits, else of the mode with the highest share (the least strict of equals), among modes that chose
    a setting; ``choice["timed_mode"]`` says which."""
    timed, modes = {}, {}
    for name in [p for p in args.policies.split(",") if p]:
        named = [mode for mode, _, _ in MODES if choice["chosen"].get(f"{name} {mode}") is not None]
        held = [mode for mode in named if shares.get(f"{name} {mode}", 0) >= 0.9]
        best = max(named, key=lambda mode: shares.get(f"{name} {mode}", 0), default=None)  # first of equals
        modes[name] = held[0] if held else best
        timed[name] = choice["chosen"][f"{name} {modes[name]}"] if modes[name] else None
    choice["timed_mode"] = modes
    return timed


def quality_rows(qualities: dict, labels, rows_a, rows_b, difficulties: list[int]) -> dict:
    """Per setting: steps, and the solved share overall, on each half, and per difficulty on half B."""
    return {label: {"steps": q["steps"], "solved": float(q["solved"].mean()),
                    "solved_a": float(q["solved"][rows_a].mean()),
                    "solved_b": float(q["solved"][rows_b].mean()),
                    "by_difficulty_b": {int(d): float(q["solved"][rows_b[labels[rows_b] == d]].mean())
                                        for d in difficulties}}
            for label, q in qualities.items()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/depth_batching.py", main))
