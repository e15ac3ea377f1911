"""The demo's accuracy stage: one pass per family of budgets against one run per budget, on one thread.

    python bench/task_accuracy_time.py --run RUN --data DATA [--budgets 1,2,3,4,6,8,12,16,32] [--repeats 3]

Times :func:`rdepth.tasks.evaluate.task_accuracy_table` (budgets that differ only in the last group's
count share that group's trajectory) against the same table made budget by budget with
:func:`rdepth.tasks.evaluate.heldout_accuracy`, on every held-out set of a task run, alternating the
two, one warm-up round each; prints the median seconds of each, the ratio, and whether the two tables
are equal (they must be, to the last bit).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flags import positive_ints  # noqa: E402


def main(argv=None) -> int:
    from rdepth.cli.main import OneLineParser

    parser = OneLineParser(prog="bench/task_accuracy_time.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained task run (rdepth demo's OUT/train)")
    parser.add_argument("--data", required=True, help="its task data (rdepth demo's OUT/data)")
    parser.add_argument("--budgets", default="1,2,3,4,6,8,12,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    budgets = positive_ints("--budgets", args.budgets)
    import torch

    from rdepth.run.opened import open_run
    from rdepth.tasks.data import load_heldout, task_manifest
    from rdepth.tasks.evaluate import heldout_accuracy, task_accuracy_table

    torch.set_num_threads(1)
    model = open_run(args.run, args.data, "cpu").model
    difficulties = sorted(int(d) for d in task_manifest(args.data)["heldout"])
    sets = [load_heldout(args.data, d) for d in difficulties]

    def shared():
        return task_accuracy_table(model, args.data, budgets, batch_size=args.batch_size)["rows"]

    def one_by_one():
        return [heldout_accuracy(model, heldout, loop_counts=budget, batch_size=args.batch_size)
                for budget in budgets for heldout in sets]

    times: dict[str, list[float]] = {"shared": [], "one_by_one": []}
    tables = {}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name, call in (("shared", shared), ("one_by_one", one_by_one)):
            start = time.perf_counter()
            tables[name] = call()
            if round_:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"device: {platform.processor() or platform.machine()} CPU, 1 torch thread; "
          f"{len(sets)} held-out sets, budgets {args.budgets}, {args.repeats} rounds after a warm-up")
    for name, values in times.items():
        print(f"{name:>10}: median {medians[name]:.1f} s (min {min(values):.1f}, max {max(values):.1f})")
    print(f"ratio one_by_one / shared: {medians['one_by_one'] / medians['shared']:.2f}x; "
          f"tables equal: {tables['shared'] == tables['one_by_one']}")
    return 0


if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/task_accuracy_time.py", main))
