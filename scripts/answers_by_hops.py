"""Per-answer accuracy of a task run by the hops each answer needs, at several fixed loop budgets.

    python scripts/answers_by_hops.py --run RUN --data DATA [--difficulties 4,8] [--loops 1,2,3,4,6,8]

How many hops does one loop step resolve? For each held-out difficulty, the first ``--problems``
problems are evaluated teacher-forced at each budget (``rdepth.tasks.evaluate.heldout_accuracy``); every
answer token is grouped by the hops its query needs (recomputed from the statement, ``Task.answer_hops``),
and the share right per hop count is printed (a row per budget). One torch thread.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a trained task run (its train folder or checkpoint)")
    parser.add_argument("--data", required=True, help="its prepared task data")
    parser.add_argument("--difficulties", default="4,8")
    parser.add_argument("--loops", default="1,2,3,4,6,8")
    parser.add_argument("--problems", type=int, default=128)
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    from rdepth.errors import RdepthError
    from rdepth.run.checkpoint import load_model
    from rdepth.tasks.data import load_heldout
    from rdepth.tasks.evaluate import heldout_accuracy
    from rdepth.tasks.hops import heldout_hops, manifest_tasks

    torch.set_num_threads(1)
    try:
        difficulties = [int(d) for d in args.difficulties.split(",") if d.strip()]
        budgets = [int(k) for k in args.loops.split(",") if k.strip()]
        model = load_model(args.run, torch.device("cpu"))[0].eval()
        tasks = manifest_tasks(args.data)
        for difficulty in difficulties:
            heldout = load_heldout(args.data, difficulty).first_problems(args.problems)
            hops = heldout_hops(tasks, heldout)
            counts = sorted(set(int(h) for h in hops))
            print(f"difficulty {difficulty}: % of answers right by the hops they need "
                  f"({' '.join(f'{h}:{int((hops == h).sum())}' for h in counts)} answers)")
            print("  loops  " + " ".join(f"{h:>5}" for h in counts))
            for budget in budgets:
                result = heldout_accuracy(model, heldout, loop_counts=(budget,), batch_size=64, per_token=True)
                right = np.asarray(result["answer_right"])
                print(f"  {budget:>5}  " + " ".join(f"{100 * right[hops == h].mean():5.0f}" for h in counts))
    except RdepthError as error:
        print(f"answers_by_hops: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
