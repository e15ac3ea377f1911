"""Warm-started loops against fresh noise: accuracy (or perplexity), loop steps and the first step's size.

    python bench/warm_start.py --checkpoint RUN --data DATA [--difficulty D] [--json OUT]

On task data, the held-out set of ``--difficulty`` (default: the top training
difficulty); on text, ``--windows`` held-out windows. Every setting runs twice,
fresh (each loop starts from the run layer's noise) and warm (each group's loop
starts from the state it handed on at the previous position), both token by
token through the cache, so the only difference is the start state. Prints per
setting: quality, mean loop steps per token (answer / other tokens on a task)
and, per group, the size of the first loop step ||s1 - s0|| (mean and median).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flags import positive_ints  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/warm_start.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--difficulty", type=int, default=None)
    parser.add_argument("--windows", type=int, default=32, help="text: held-out windows")
    parser.add_argument("--fixed", default="1,2,3,4,6,8", help="fixed budgets (every group)")
    parser.add_argument("--policies", default="kl=1e-3,kl=1e-2,acceleration=1e-2,acceleration=1e-1",
                        help="policy=tau settings, comma-separated")
    parser.add_argument("--k-max", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    fixed = positive_ints("--fixed", args.fixed)

    import torch

    from rdepth.exitrun.evaluate import evaluate_with_exits
    from rdepth.exits.controller import PolicyController
    from rdepth.exits.registry import make_policy
    from rdepth.model.control import FixedController
    from rdepth.model.noise import StateNoise
    from rdepth.run.device import device_name
    from rdepth.run.opened import open_run
    from rdepth.tasks.data import load_heldout, task_manifest
    from rdepth.tasks.eval_checkpoint import is_task_data
    from rdepth.tasks.evaluate import heldout_accuracy

    if args.threads:
        torch.set_num_threads(args.threads)
    run = open_run(args.checkpoint, args.data, "cpu")
    model = run.model.eval()
    groups = model.n_groups
    settings = [(f"fixed {k}", (lambda k=k: FixedController([k] * groups))) for k in fixed]
    for item in filter(None, args.policies.split(",")):
        name, tau = item.split("=")
        settings.append((f"{name} tau={tau}", (lambda name=name, tau=float(tau): PolicyController(
            lambda group: make_policy(name, tau=tau, k_max=args.k_max), decode=model.readout))))

    task = is_task_data(args.data)
    if task:
        difficulty = args.difficulty or int(task_manifest(args.data)["train_difficulties"][1])
        heldout = load_heldout(args.data, difficulty)
        sample = torch.from_numpy(heldout.tokens[: args.batch_size, :-1]).long()
    else:
        windows = run.windows(args.windows)
        sample = windows[: args.batch_size, :-1]
    rows = []
    for label, factory in settings:
        for warm in (False, True):
            started = time.perf_counter()
            if task:
                result = heldout_accuracy(model, heldout, controller_factory=factory, batch_size=args.batch_size,
                                          warm_start=warm, seed=0)
                row = {"setting": label, "start": "warm" if warm else "fresh", "accuracy": result["accuracy"],
                       "steps_answer": result["mean_steps_answer"], "steps_other": result["mean_steps_other"]}
            else:
                result = evaluate_with_exits(model, windows, controller=factory, batch_size=args.batch_size,
                                             warm_start=warm)
                row = {"setting": label, "start": "warm" if warm else "fresh", "ppl": result.ppl,
                       "steps": float(sum(result.mean_steps))}
            row["seconds"] = round(time.perf_counter() - started, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    first = {}
    for warm in (False, True):  # the first loop step's size, every token (all rows run step 1)
        sizes: dict[int, list[torch.Tensor]] = {}
        start: dict[int, torch.Tensor] = {}

        def observer(group, step, state, active, sizes=sizes, start=start):
            if step == 0:
                start[group] = state.clone()
            elif step == 1:
                sizes.setdefault(group, []).append((state - start[group]).norm(dim=-1).flatten())

        with torch.no_grad():
            model(sample, loop_counts=2, noise=StateNoise.consecutive(0, 0, sample.shape[0]), observer=observer,
                  warm_start=warm)
        first["warm" if warm else "fresh"] = {
            g: {"mean": float(torch.cat(v).mean()), "median": float(torch.cat(v).median())} for g, v in sizes.items()}
    print(json.dumps({"first_step_size": first}))
    summary = {"checkpoint": str(run.checkpoint), "data": str(run.data), "device": device_name(torch.device("cpu")),
               "rows": rows, "first_step_size": first}
    if args.json:
        from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
        with open(args.json, "w") as handle:
            handle.write(json_text(summary, indent=2))
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/warm_start.py", main))
